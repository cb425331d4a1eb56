package idempotency_test

import (
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

const testTraceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

func parentMessage(t *testing.T) (*message.Message, envelope.Envelope) {
	t.Helper()
	p, err := envelope.New("urn:babel:orders:created", map[string]int{"order": 1})
	if err != nil {
		t.Fatal(err)
	}
	body, _ := p.Marshal()
	msg := message.NewMessage(p.Meta.ID, body)
	msg.Metadata.Set("traceparent", testTraceparent)
	msg.Metadata.Set("x-attempts", "4")
	msg.Metadata.Set(envelope.MetadataMessageID, p.Meta.ID)
	return msg, p
}

func TestNewChildMessage(t *testing.T) {
	t.Parallel()
	parent, p := parentMessage(t)
	child, err := idempotency.NewChildMessage(parent, "invoice", "urn:babel:invoices:requested", map[string]int{"order": 1})
	if err != nil {
		t.Fatal(err)
	}
	again, _ := idempotency.NewChildMessage(parent, "invoice", "urn:babel:invoices:requested", map[string]int{"order": 1})
	e, err := envelope.Parse(child.Payload)
	if err != nil {
		t.Fatal(err)
	}
	if e.Meta.ID != envelope.DeriveID(p.Meta.ID, "invoice") || child.UUID != e.Meta.ID || again.UUID != child.UUID || e.TraceID != p.TraceID {
		t.Fatalf("child %s uuid %s", child.Payload, child.UUID)
	}
	want := map[string]string{"traceparent": testTraceparent, envelope.MetadataMessageID: e.Meta.ID,
		envelope.MetadataTraceID: p.TraceID, envelope.MetadataJob: "urn:babel:invoices:requested"}
	for k, v := range want {
		if child.Metadata.Get(k) != v {
			t.Errorf("metadata %s = %q, want %q", k, child.Metadata.Get(k), v)
		}
	}
	if len(child.Metadata) != len(want) {
		t.Errorf("metadata %v", child.Metadata)
	}
	if _, err := idempotency.NewChildMessage(message.NewMessage("x", []byte("not json")), "a", "urn:x", nil); err == nil {
		t.Fatal("a child of a message that is not an envelope was built")
	}
}

// TestCarryHeaders: the messages a handler returns get the handled
// message's traceparent without code in the handler, and what the handler
// set itself is kept.
func TestCarryHeaders(t *testing.T) {
	t.Parallel()
	ps := newPubSub()
	defer ps.Close()
	out, err := ps.Subscribe(t.Context(), "invoices")
	if err != nil {
		t.Fatal(err)
	}
	r := newRouter(t)
	r.AddMiddleware(idempotency.CarryHeaders, idempotency.Middleware(memstore.New()))
	r.AddHandler("invoice", "orders", ps, "invoices", ps, func(msg *message.Message) ([]*message.Message, error) {
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			return nil, err
		}
		child, err := envelope.NewChild(e, "invoice", "urn:babel:invoices:requested", nil)
		if err != nil {
			return nil, err
		}
		body, _ := child.Marshal()
		first := message.NewMessage(child.Meta.ID, body)
		second := message.NewMessage(child.Meta.ID+"-2", body)
		second.Metadata.Set("traceparent", "00-set-by-the-handler-01")
		return []*message.Message{first, second}, nil
	})
	testenv.RunRouter(t, r)
	parent, _ := parentMessage(t)
	if err := ps.Publish("orders", parent); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		select {
		case m := <-out:
			m.Ack()
			want := testTraceparent
			if strings.HasSuffix(m.UUID, "-2") { // the one whose traceparent the handler set
				want = "00-set-by-the-handler-01"
			}
			if m.Metadata.Get("traceparent") != want || m.Metadata.Get("x-attempts") != "" || m.Metadata.Get(envelope.MetadataMessageID) != "" {
				t.Errorf("produced message %s metadata %v", m.UUID, m.Metadata)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("no produced message")
		}
	}
}
