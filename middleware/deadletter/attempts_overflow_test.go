package deadletter_test

import (
	"errors"
	"strconv"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
)

type sink struct{ msgs []*message.Message }

func (s *sink) Publish(_ string, msgs ...*message.Message) error {
	s.msgs = append(s.msgs, msgs...)
	return nil
}
func (*sink) Close() error { return nil }

// TestHugeAttemptsSaturate: a message whose attempts is already the
// largest integer is dead-lettered with that count, not a wrapped negative
// one (which would read as "never tried" to every SDK's max-attempts
// check after a redrive or a re-publish).
func TestHugeAttemptsSaturate(t *testing.T) {
	body := `{"job":"urn:babel:orders:created","trace_id":"t-1","data":{},"meta":{"id":"m-1","schema_version":1},"attempts":` +
		strconv.FormatInt(1<<63-1, 10) + `}`
	s := &sink{}
	dl, err := deadletter.Middleware(s)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dl(func(*message.Message) ([]*message.Message, error) {
		return nil, errors.New("declined")
	})(message.NewMessage("u", []byte(body))); err != nil {
		t.Fatal(err)
	}
	if len(s.msgs) != 1 {
		t.Fatalf("%d dead letters", len(s.msgs))
	}
	e, err := envelope.Parse(s.msgs[0].Payload)
	if err != nil {
		t.Fatal(err)
	}
	if e.Attempts < 0 || e.DeadLetter == nil || e.DeadLetter.Attempts < 0 {
		t.Fatalf("dead letter attempts %d, dead_letter.attempts %d: wrapped negative", e.Attempts, e.DeadLetter.Attempts)
	}
}
