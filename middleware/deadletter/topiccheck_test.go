package deadletter_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// checker fails its first fails checks of each topic, and records them.
type checker struct {
	mu      sync.Mutex
	fails   int
	checked []string
}

func (c *checker) CheckTopic(_ context.Context, topic string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.checked = append(c.checked, topic)
	if len(c.checked) <= c.fails {
		return errors.New("no stream captures the subject; create it")
	}
	return nil
}

func (c *checker) calls() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.checked...)
}

// sumOf returns the sum of the metric name's data points whose attribute
// dead_letter_topic is topic.
func sumOf(t *testing.T, reader *sdkmetric.ManualReader, name, topic string) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			for _, p := range m.Data.(metricdata.Sum[int64]).DataPoints {
				if v, _ := p.Attributes.Value("dead_letter_topic"); v.AsString() == topic {
					n += p.Value
				}
			}
		}
	}
	return n
}

// TestDeadLetterTopicIsCheckedBeforeTheFirstMessage: while the dead-letter
// topic fails its check, no message of its topic reaches the handler: the
// delivery goes back unhandled, each failed check is counted, the failure
// is logged once (naming both topics and the checker's fix), and the check
// runs again no sooner than the recheck interval, however fast the broker
// hands the message back (GoChannel: at once). Once it passes, the handler
// runs and the topic is not checked again.
func TestDeadLetterTopicIsCheckedBeforeTheFirstMessage(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	logs := testenv.CaptureSlog(t)
	c := &checker{fails: 2}
	const recheck = 300 * time.Millisecond
	var runs atomic.Int32
	ps := routed(t, func(*message.Message) error { runs.Add(1); return nil },
		deadletter.WithTopicCheck(c), deadletter.WithTopicRecheck(recheck), deadletter.WithMeterProvider(mp))
	start := time.Now()
	for range 3 {
		if err := ps.Publish("orders", message.NewMessage(watermill.NewUUID(), conformance.Fixture(t, "order-created.json"))); err != nil {
			t.Fatal(err)
		}
	}
	testenv.Eventually(t, "the three messages handled once the check passed", func() bool { return runs.Load() == 3 })
	if took := time.Since(start); took < 2*recheck {
		t.Errorf("three checks within %v, under two recheck intervals (%v): a failing topic would spin", took, 2*recheck)
	}
	if got := c.calls(); len(got) != 3 || got[0] != "orders.dlq" || got[2] != "orders.dlq" {
		t.Errorf("checks %v: want three of orders.dlq (two failed, one passed), then none", got)
	}
	if n := sumOf(t, reader, deadletter.MetricTopicCheckFailures, "orders.dlq"); n != 2 {
		t.Errorf("%s = %d, want 2", deadletter.MetricTopicCheckFailures, n)
	}
	lines := logs.Where(t, "dead_letter_topic", "orders.dlq")
	if len(lines) < 1 || lines[0]["level"] != "ERROR" || lines[0]["topic"] != "orders" ||
		!strings.Contains(lines[0]["error"].(string), "create it") {
		t.Fatalf("want the failure logged at error, naming the fix; got:\n%s", logs)
	}
	errorLines := 0
	for _, l := range lines {
		if l["level"] == "ERROR" {
			errorLines++
		}
	}
	if errorLines != 1 {
		t.Errorf("the same failure logged %d times at error, want once:\n%s", errorLines, logs)
	}
}

// routed runs a router on a GoChannel with the dead-letter middleware
// (opts) in front of handler, consuming "orders"; it returns the GoChannel.
func routed(t *testing.T, handler message.NoPublishHandlerFunc, opts ...deadletter.Option) *gochannel.GoChannel {
	t.Helper()
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16, Persistent: true}, watermill.NopLogger{})
	mw, err := deadletter.Middleware(ps, opts...)
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(mw)
	r.AddConsumerHandler("charge", "orders", ps, handler)
	testenv.RunRouter(t, r)
	return ps
}

// checkingPublisher is a GoChannel that checks topics itself.
type checkingPublisher struct {
	*gochannel.GoChannel
	*checker
}

// TestPublisherThatChecksTopicsIsUsed: a publisher that implements
// TopicChecker checks its dead-letter topics without WithTopicCheck;
// WithTopicCheck(nil) turns that off.
func TestPublisherThatChecksTopicsIsUsed(t *testing.T) {
	for _, off := range []bool{false, true} {
		ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
		t.Cleanup(func() { _ = ps.Close() })
		c := &checker{fails: 1}
		var opts []deadletter.Option
		if off {
			opts = append(opts, deadletter.WithTopicCheck(nil))
		}
		mw, err := deadletter.Middleware(checkingPublisher{ps, c}, opts...)
		if err != nil {
			t.Fatal(err)
		}
		_, err = mw(func(*message.Message) ([]*message.Message, error) { return nil, nil })(message.NewMessage("u", nil))
		switch {
		case off && (err != nil || len(c.calls()) != 0):
			t.Errorf("WithTopicCheck(nil): err %v, checks %v; want no check", err, c.calls())
		case !off && !errors.Is(err, deadletter.ErrTopicUnusable):
			t.Errorf("a checking publisher: err %v, want ErrTopicUnusable (checks %v)", err, c.calls())
		}
	}
}

// TestCheckOnSubscribeFailsTheRouter: with CheckOnSubscribe, a dead-letter
// topic that fails its check makes Router.Run return an error naming it,
// before any message is consumed.
func TestCheckOnSubscribeFailsTheRouter(t *testing.T) {
	ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	if err := ps.Publish("refunds", message.NewMessage("u", []byte("{}"))); err != nil {
		t.Fatal(err)
	}
	c := &checker{fails: 100}
	opts := []deadletter.Option{deadletter.WithTopicCheck(c), deadletter.WithTopic(func(t string) string { return t + "_dlq" })}
	mw, err := deadletter.Middleware(ps, opts...)
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(mw)
	r.AddSubscriberDecorators(deadletter.CheckOnSubscribe(ps, opts...))
	var runs atomic.Int32
	r.AddConsumerHandler("refund", "refunds", ps, func(*message.Message) error { runs.Add(1); return nil })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = r.Run(ctx)
	if !errors.Is(err, deadletter.ErrTopicUnusable) || !strings.Contains(err.Error(), "refunds_dlq") {
		t.Fatalf("Router.Run = %v, want an error matching ErrTopicUnusable naming refunds_dlq", err)
	}
	if runs.Load() != 0 {
		t.Fatalf("the handler ran %d times", runs.Load())
	}
}

// TestPublishFailureIsCounted: a dead letter that cannot be published is
// counted in MetricPublishFailures by topic and dead-letter topic.
func TestPublishFailureIsCounted(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	mw, err := deadletter.Middleware(brokenPublisher{}, deadletter.WithMeterProvider(mp), deadletter.WithLogger(watermill.NopLogger{}))
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		msg := message.NewMessage("u", []byte(`{}`))
		if _, err := mw(func(*message.Message) ([]*message.Message, error) { return nil, errors.New("failed") })(msg); err == nil {
			t.Fatal("a dead letter that could not be published was swallowed")
		}
	}
	if n := sumOf(t, reader, deadletter.MetricPublishFailures, ".dlq"); n != 2 { // no router: the topic is ""
		t.Fatalf("%s = %d, want 2", deadletter.MetricPublishFailures, n)
	}
}
