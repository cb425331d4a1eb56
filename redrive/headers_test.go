package redrive_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/redrive"
)

// TestRedriveCarriesOutOfBandHeaders: a redriven message keeps the trace
// and the user's headers; the dead letter's transport headers (x-attempts
// of the dead letter, whose body said 3) do not follow it, since its body
// now says 0.
func TestRedriveCarriesOutOfBandHeaders(t *testing.T) {
	t.Parallel()
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 8, Persistent: true}, watermill.NopLogger{})
	defer ps.Close()
	e, _ := envelope.New("urn:babel:payments:charge", map[string]int{"order": 1}, envelope.WithQueue("orders"))
	reason := "boom"
	e.Attempts = 3
	e.DeadLetter = &envelope.DeadLetter{Reason: envelope.ReasonFailed, Error: &reason, OriginalQueue: "orders", Attempts: 3, Lang: "python"}
	body, _ := e.Marshal()
	dead := message.NewMessage(e.Meta.ID, body)
	for k, v := range map[string]string{
		"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tenant": "eu",
		"x-attempts": "3", "bq-attempts": "3", "_watermill_redelivered": "true",
	} {
		dead.Metadata.Set(k, v)
	}
	if err := ps.Publish("orders.dlq", dead); err != nil {
		t.Fatal(err)
	}
	out, err := ps.Subscribe(context.Background(), "orders")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	report, err := redrive.Run(ctx, ps, ps, "orders.dlq", redrive.WithIdleTimeout(200*time.Millisecond))
	if err != nil || report.Moved != 1 {
		t.Fatalf("moved %d: %v", report.Moved, err)
	}
	msg := <-out
	msg.Ack()
	if msg.Metadata.Get("traceparent") != dead.Metadata.Get("traceparent") || msg.Metadata.Get("tenant") != "eu" {
		t.Errorf("out-of-band headers lost: %v", msg.Metadata)
	}
	for _, k := range []string{"x-attempts", "bq-attempts", "_watermill_redelivered"} {
		if v, ok := msg.Metadata[k]; ok {
			t.Errorf("transport header %s=%q copied onto the redriven message", k, v)
		}
	}
}
