package envelope_test

import (
	"errors"
	"testing"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

// A producer whose business key came out empty must hear about it: a fresh
// random meta.id would make every retry of its message a new message.
func TestNewRejectsAnEmptyGivenID(t *testing.T) {
	for _, id := range []string{"", " ", "\t\n"} {
		e, err := envelope.New("urn:babel:orders:created", nil, envelope.WithID(id))
		if !errors.Is(err, envelope.ErrInvalid) {
			t.Fatalf("New(WithID(%q)) = meta.id %q, err %v; want an error matching ErrInvalid", id, e.Meta.ID, err)
		}
	}
	// Without WithID a fresh id is still minted.
	if e, err := envelope.New("urn:babel:orders:created", nil); err != nil || e.Meta.ID == "" {
		t.Fatalf("New without WithID: %+v, %v", e, err)
	}
	// A child of a parent with an empty meta.id gets a derived, non-empty id.
	if c, err := envelope.NewChild(envelope.Envelope{TraceID: "t"}, "x", "urn:x", nil); err != nil || c.Meta.ID == "" {
		t.Fatalf("NewChild: %+v, %v", c, err)
	}
}
