package deadletter_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestDeadLetterIsLoggedAndCounted: without a logger, a dead-lettered
// message is a warning through slog.Default() (replaced here after the
// middleware was built: it is read at each line) naming the message, the
// topics and the reason, and it counts in MetricMessages by topic and
// reason. It replaces the process's slog default: not parallel.
func TestDeadLetterIsLoggedAndCounted(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	h := newHarness(t, func(*message.Message) error { return errors.New("card declined") }, deadletter.WithMeterProvider(mp))
	logs := testenv.CaptureSlog(t)

	msg := message.NewMessage(watermill.NewUUID(), conformance.Fixture(t, "order-created.json"))
	if err := h.pubSub.Publish("orders", msg); err != nil {
		t.Fatal(err)
	}
	h.next(t)
	var lines []map[string]any
	testenv.Eventually(t, "the dead letter's log line", func() bool {
		lines = logs.Where(t, "message_uuid", msg.UUID)
		return len(lines) > 0
	})
	line := lines[0]
	id, _ := envelope.ReadIdentity(msg.Payload)
	want := map[string]string{"level": "WARN", "msg": "Message dead-lettered", "topic": "orders", "dead_letter_topic": "orders.dlq",
		"reason": envelope.ReasonFailed, "message_id": id.ID, "error": "card declined", "handler": "charge"}
	for k, v := range want {
		if line[k] != v {
			t.Errorf("%s = %v, want %q; the line: %v", k, line[k], v, line)
		}
	}
	if len(lines) != 1 {
		t.Errorf("%d lines for one dead letter:\n%s", len(lines), logs)
	}

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	counted := int64(-1)
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != deadletter.MetricMessages {
				continue
			}
			for _, p := range m.Data.(metricdata.Sum[int64]).DataPoints {
				topic, _ := p.Attributes.Value("topic")
				reason, _ := p.Attributes.Value("reason")
				if topic.AsString() == "orders" && reason.AsString() == envelope.ReasonFailed {
					counted = p.Value
				}
			}
		}
	}
	if counted != 1 {
		t.Fatalf("%s{topic=orders,reason=failed} = %d, want 1; collected: %+v", deadletter.MetricMessages, counted, rm)
	}
}
