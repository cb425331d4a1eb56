package deadletter_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// harness runs a router whose handler fails as told, with the dead-letter
// middleware outside Retry, and collects what reaches "<topic>.dlq".
type harness struct {
	pubSub *gochannel.GoChannel
	dlq    <-chan *message.Message
}

func newHarness(t *testing.T, handler message.NoPublishHandlerFunc, opts ...deadletter.Option) *harness {
	t.Helper()
	logger := watermill.NopLogger{}
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64, Persistent: true}, logger)
	dlq, err := ps.Subscribe(context.Background(), "orders.dlq")
	if err != nil {
		t.Fatal(err)
	}
	mw, err := deadletter.Middleware(ps, opts...)
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(mw,
		middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond,
			ShouldRetry: func(p middleware.RetryParams) bool { return !idempotency.IsPermanent(p.Err) }}.Middleware,
		deadletter.CountAttempts,
		idempotency.Middleware(memstore.New()))
	r.AddConsumerHandler("charge", "orders", ps, handler)
	testenv.RunRouter(t, r)
	return &harness{pubSub: ps, dlq: dlq}
}

func (h *harness) next(t *testing.T) *message.Message {
	t.Helper()
	select {
	case m := <-h.dlq:
		m.Ack()
		return m
	case <-time.After(5 * time.Second):
		t.Fatal("nothing reached the dead-letter topic")
		return nil
	}
}

func TestFailedEnvelopeIsDeadLetteredWithItsBlock(t *testing.T) {
	fixture := conformance.Fixture(t, "order-created.json")
	h := newHarness(t, func(*message.Message) error { return fmt.Errorf("charge: %w", errors.New("payment gateway timeout")) })
	before := time.Now().UnixMilli()
	if err := h.pubSub.Publish("orders", message.NewMessage(watermill.NewUUID(), fixture)); err != nil {
		t.Fatal(err)
	}
	dead := h.next(t)
	e, err := envelope.Parse(dead.Payload)
	if err != nil {
		t.Fatalf("a dead-lettered message must parse as an envelope: %v", err)
	}
	orig, _ := envelope.Parse(fixture)
	if e.Job != orig.Job || e.TraceID != orig.TraceID || e.Meta.ID != orig.Meta.ID || e.Meta.Queue != orig.Meta.Queue ||
		e.Meta.Lang != orig.Meta.Lang || e.Meta.CreatedAt != orig.Meta.CreatedAt || compact(t, e.Data) != compact(t, orig.Data) {
		t.Fatalf("identity or data changed: %+v", e)
	}
	dl := e.DeadLetter
	if dl == nil || dl.Reason != envelope.ReasonFailed || dl.OriginalQueue != "orders" || dl.Attempts != 3 || e.Attempts != 3 ||
		dl.Lang != "go" || *dl.Error != "charge: payment gateway timeout" || *dl.Exception != "*errors.errorString" ||
		dl.FailedAt < before || dl.FailedAt > time.Now().UnixMilli() {
		t.Fatalf("dead_letter block: %+v (attempts %d)", dl, e.Attempts)
	}
	for key, want := range map[string]string{
		deadletter.MetadataReason: "failed", deadletter.MetadataOriginalTopic: "orders",
		middleware.PoisonedTopicKey: "orders", middleware.PoisonedHandlerKey: "charge",
		middleware.ReasonForPoisonedKey: "charge: payment gateway timeout", envelope.MetadataMessageID: orig.Meta.ID,
	} {
		if got := dead.Metadata.Get(key); got != want {
			t.Fatalf("metadata %s = %q, want %q", key, got, want)
		}
	}
}

func compact(t *testing.T, raw []byte) string {
	var b bytes.Buffer
	if err := json.Compact(&b, raw); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// TestDeadLetterHasTheFixtureShape: the dead_letter block written here has
// exactly the members of the suite's dead-lettered fixture, so other SDKs
// read it.
func TestDeadLetterHasTheFixtureShape(t *testing.T) {
	h := newHarness(t, func(*message.Message) error { return errors.New("boom") })
	if err := h.pubSub.Publish("orders", message.NewMessage(watermill.NewUUID(), conformance.Fixture(t, "order-created.json"))); err != nil {
		t.Fatal(err)
	}
	dead := h.next(t)
	members := func(raw []byte) []string {
		var v struct {
			DeadLetter map[string]json.RawMessage `json:"dead_letter"`
		}
		if err := json.Unmarshal(raw, &v); err != nil {
			t.Fatal(err)
		}
		var names []string
		for k := range v.DeadLetter {
			names = append(names, k)
		}
		sort.Strings(names)
		return names
	}
	if got, want := members(dead.Payload), members(conformance.Fixture(t, "dead-lettered.json")); !reflect.DeepEqual(got, want) {
		t.Fatalf("dead_letter members %v, the fixture has %v", got, want)
	}
}

func TestReasons(t *testing.T) {
	for _, c := range []struct {
		name    string
		payload []byte
		err     error
		reason  string
		attempt int
	}{
		{"unknown URN", nil, fmt.Errorf("route: %w", deadletter.ErrUnknownURN), envelope.ReasonUnknownURN, 3},
		// A parked effect is retried, then dead-lettered for an operator.
		{"unknown outcome, parked", nil, fmt.Errorf("charge: %w", effects.ErrUnknownOutcome), envelope.ReasonUnknownOutcome, 3},
		// Its budget exhausted: permanent, one attempt, the same reason.
		{"unknown outcome, budget exhausted", nil, fmt.Errorf("charge: %w", effects.ErrBudgetExhausted), envelope.ReasonUnknownOutcome, 1},
		// A permanent rejection is not retried: one attempt.
		{"unsupported schema version", []byte(`{"job":"j","trace_id":"t","data":{},"meta":{"id":"a","schema_version":2},"attempts":0}`),
			nil, envelope.ReasonPoison, 1},
		// One reason per cause, each permanent (one attempt).
		{"effect request differs from its intent", nil, fmt.Errorf("charge: %w", effects.ErrPayloadConflict), envelope.ReasonConflict, 1},
		{"meta.id reused for another message", nil, fmt.Errorf("check: %w", idempotency.ErrConflict), envelope.ReasonConflict, 1},
		{"older than the replay horizon", nil, fmt.Errorf("check: %w", idempotency.ErrTooOld), envelope.ReasonTooOld, 1},
		{"the handler rejects it for good", nil, fmt.Errorf("card expired: %w", idempotency.ErrPermanent), envelope.ReasonRejected, 1},
		{"no identity where one is required", nil, fmt.Errorf("check: %w", idempotency.ErrNoIdentity), envelope.ReasonPoison, 1},
		{"a sensitive field the cipher cannot open", nil, fmt.Errorf("check: %w", idempotency.ErrUndecryptable), envelope.ReasonPoison, 1},
		{"the handler cannot read it", nil, fmt.Errorf("decode: %w", envelope.ErrInvalid), envelope.ReasonPoison, 3},
		{"a plain failure", nil, errors.New("gateway timeout"), envelope.ReasonFailed, 3},
	} {
		t.Run(c.name, func(t *testing.T) {
			runs := 0
			h := newHarness(t, func(*message.Message) error { runs++; return c.err })
			payload := c.payload
			if payload == nil {
				payload = conformance.Fixture(t, "order-created.json")
			}
			if err := h.pubSub.Publish("orders", message.NewMessage(watermill.NewUUID(), payload)); err != nil {
				t.Fatal(err)
			}
			dead := h.next(t)
			if got := dead.Metadata.Get(deadletter.MetadataReason); got != c.reason {
				t.Fatalf("reason %q, want %q", got, c.reason)
			}
			if e, err := envelope.Parse(dead.Payload); err == nil && e.DeadLetter.Attempts != c.attempt {
				t.Fatalf("attempts %d, want %d", e.DeadLetter.Attempts, c.attempt)
			}
		})
	}
}

func TestNonEnvelopeIsDeadLetteredVerbatim(t *testing.T) {
	h := newHarness(t, func(*message.Message) error { return errors.New("cannot parse") })
	body := []byte("\x00not an envelope at all")
	if err := h.pubSub.Publish("orders", message.NewMessage(watermill.NewUUID(), body)); err != nil {
		t.Fatal(err)
	}
	dead := h.next(t)
	if string(dead.Payload) != string(body) || dead.Metadata.Get(deadletter.MetadataVerbatim) != "1" ||
		dead.Metadata.Get(deadletter.MetadataError) != "cannot parse" {
		t.Fatalf("payload %q metadata %v", dead.Payload, dead.Metadata)
	}
}

// brokenPublisher fails every publish.
type brokenPublisher struct{ message.Publisher }

func (brokenPublisher) Publish(string, ...*message.Message) error {
	return errors.New("broker unreachable")
}

func TestPublishFailureNacks(t *testing.T) {
	mw, err := deadletter.Middleware(brokenPublisher{})
	if err != nil {
		t.Fatal(err)
	}
	fail := errors.New("handler failed")
	_, got := mw(func(*message.Message) ([]*message.Message, error) { return nil, fail })(message.NewMessage("u", []byte(`{}`)))
	if !errors.Is(got, fail) || !strings.Contains(got.Error(), "broker unreachable") {
		t.Fatalf("err = %v: want the handler's error and the publish failure, so the router nacks", got)
	}
}

func TestFilterLetsOtherErrorsThrough(t *testing.T) {
	mw, _ := deadletter.Middleware(brokenPublisher{}, deadletter.WithFilter(idempotency.IsPermanent))
	transient := errors.New("timeout")
	_, got := mw(func(*message.Message) ([]*message.Message, error) { return nil, transient })(message.NewMessage("u", nil))
	if got != transient {
		t.Fatalf("err = %v, want the transient error untouched", got)
	}
	if _, err := deadletter.Middleware(nil); !errors.Is(err, deadletter.ErrNoPublisher) {
		t.Fatalf("nil publisher: %v", err)
	}
}

// TestCoarseReasonKeepsToTheSDKsThree: for readers that know only the
// BabelQueue SDKs' three reasons, every cause maps to one of them, and
// nothing an operator must settle first maps to failed.
func TestCoarseReasonKeepsToTheSDKsThree(t *testing.T) {
	t.Parallel()
	for err, want := range map[error]string{
		errors.New("gateway timeout"):                            envelope.ReasonFailed,
		fmt.Errorf("route: %w", deadletter.ErrUnknownURN):        envelope.ReasonUnknownURN,
		fmt.Errorf("x: %w", effects.ErrUnknownOutcome):           envelope.ReasonPoison,
		fmt.Errorf("x: %w", effects.ErrPayloadConflict):          envelope.ReasonPoison,
		fmt.Errorf("x: %w", idempotency.ErrConflict):             envelope.ReasonPoison,
		fmt.Errorf("x: %w", idempotency.ErrTooOld):               envelope.ReasonPoison,
		fmt.Errorf("card expired: %w", idempotency.ErrPermanent): envelope.ReasonPoison,
		fmt.Errorf("x: %w", envelope.ErrInvalid):                 envelope.ReasonPoison,
	} {
		if got := deadletter.CoarseReason(err); got != want {
			t.Errorf("CoarseReason(%v) = %q, want %q (Reason says %q)", err, got, want, deadletter.Reason(err))
		}
	}
}
