package deadletter_test

import (
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
)

// TestDeadLetterCarriesOutOfBandHeaders: the dead letter keeps the trace
// and the user's headers, and none of the consumed hop's transport headers
// (a stale x-attempts of 0 would disagree with the dead letter's body).
func TestDeadLetterCarriesOutOfBandHeaders(t *testing.T) {
	h := newHarness(t, func(*message.Message) error { return errors.New("card declined") })
	e, _ := envelope.New("urn:babel:payments:charge", map[string]int{"order": 1})
	body, _ := e.Marshal()
	msg := message.NewMessage(e.Meta.ID, body)
	for k, v := range map[string]string{
		"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tenant": "eu",
		"x-attempts": "0", "bq-attempts": "0", "x-source-lang": "python", "_watermill_redelivered": "true",
	} {
		msg.Metadata.Set(k, v)
	}
	if err := h.pubSub.Publish("orders", msg); err != nil {
		t.Fatal(err)
	}
	var dead *message.Message
	select {
	case dead = <-h.dlq:
		dead.Ack()
	case <-time.After(10 * time.Second):
		t.Fatal("no dead letter")
	}
	if dead.Metadata.Get("traceparent") != msg.Metadata.Get("traceparent") || dead.Metadata.Get("tenant") != "eu" {
		t.Errorf("out-of-band headers lost: %v", dead.Metadata)
	}
	for _, k := range []string{"x-attempts", "bq-attempts", "x-source-lang", "_watermill_redelivered"} {
		if v, ok := dead.Metadata[k]; ok {
			t.Errorf("transport header %s=%q copied onto the dead letter", k, v)
		}
	}
	if dead.Metadata.Get(deadletter.MetadataReason) != envelope.ReasonFailed {
		t.Errorf("metadata %v", dead.Metadata)
	}
}
