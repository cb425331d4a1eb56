package cqrsenvelope_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/envelope/cqrsenvelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// PlaceOrder is a command; its package is cqrsenvelope_test.
type PlaceOrder struct {
	OrderID string          `json:"order_id"`
	Amount  json.Number     `json:"amount"`
	Note    string          `json:"note,omitempty"`
	Extra   json.RawMessage `json:"extra,omitempty"`
}

// SendInvoice is sent while handling PlaceOrder.
type SendInvoice struct {
	OrderID string `json:"order_id"`
}

func TestMarshalBuildsAnEnvelope(t *testing.T) {
	m := cqrsenvelope.Marshaler{Queue: func(urn string) string { return "commands" }}
	before := time.Now().UnixMilli()
	msg, err := m.Marshal(&PlaceOrder{OrderID: "o-1", Amount: "12345678901234567890", Note: "<b>"})
	if err != nil {
		t.Fatal(err)
	}
	e, err := envelope.Parse(msg.Payload)
	if err != nil {
		t.Fatalf("not an envelope a consumer accepts: %v\n%s", err, msg.Payload)
	}
	if e.Job != "urn:babel:cqrsenvelope_test:place_order" || e.Meta.Lang != "go" || e.Meta.SchemaVersion != 1 ||
		e.Meta.Queue != "commands" || e.Meta.CreatedAt < before || len(e.Meta.ID) != 36 || len(e.TraceID) != 36 {
		t.Fatalf("envelope: %+v", e)
	}
	if !strings.Contains(string(e.Data), `"amount":12345678901234567890`) {
		t.Fatalf("big integer not kept exactly: %s", e.Data)
	}
	if msg.UUID != e.Meta.ID || msg.Metadata.Get(envelope.MetadataMessageID) != e.Meta.ID ||
		msg.Metadata.Get(envelope.MetadataTraceID) != e.TraceID || msg.Metadata.Get(envelope.MetadataJob) != e.Job {
		t.Fatalf("UUID %q and metadata %v do not project the envelope", msg.UUID, msg.Metadata)
	}
	if m.NameFromMessage(msg) != m.Name(&PlaceOrder{}) || m.Name(PlaceOrder{}) != m.Name(&PlaceOrder{}) {
		t.Fatalf("NameFromMessage %q, Name %q", m.NameFromMessage(msg), m.Name(&PlaceOrder{}))
	}
	var back PlaceOrder
	if err := m.Unmarshal(msg, &back); err != nil || back.OrderID != "o-1" || back.Amount != "12345678901234567890" || back.Note != "<b>" {
		t.Fatalf("Unmarshal: %+v, %v", back, err)
	}
	// One id per message: a second Marshal mints another.
	again, _ := m.Marshal(&PlaceOrder{OrderID: "o-1"})
	if again.UUID == msg.UUID {
		t.Fatal("two messages share a meta.id")
	}
}

func TestMarshalUsesTheApplicationsIDAndURN(t *testing.T) {
	m := cqrsenvelope.Marshaler{
		ID: func(v any) string {
			if c, ok := v.(*PlaceOrder); ok {
				return "place-order-" + c.OrderID
			}
			return ""
		},
		URN: func(v any) string {
			if _, ok := v.(*PlaceOrder); ok {
				return "urn:babel:orders:place"
			}
			return cqrsenvelope.DefaultURN(v)
		},
	}
	msg, err := m.Marshal(&PlaceOrder{OrderID: "o-7"})
	if err != nil {
		t.Fatal(err)
	}
	e, _ := envelope.Parse(msg.Payload)
	if e.Meta.ID != "place-order-o-7" || e.Job != "urn:babel:orders:place" || msg.UUID != "place-order-o-7" {
		t.Fatalf("envelope: %+v", e)
	}
	// A blank business key is an error, never a random id.
	blank := cqrsenvelope.Marshaler{ID: func(any) string { return " " }}
	if _, err := blank.Marshal(&PlaceOrder{}); !errors.Is(err, envelope.ErrInvalid) {
		t.Fatalf("blank id: err = %v, want ErrInvalid", err)
	}
}

func TestDefaultURN(t *testing.T) {
	type HTTPInvoiceSent struct{}
	type V2Thing struct{}
	for _, c := range []struct {
		v    any
		want string
	}{
		{PlaceOrder{}, "urn:babel:cqrsenvelope_test:place_order"},
		{&PlaceOrder{}, "urn:babel:cqrsenvelope_test:place_order"},
		{&HTTPInvoiceSent{}, "urn:babel:cqrsenvelope_test:http_invoice_sent"},
		{V2Thing{}, "urn:babel:cqrsenvelope_test:v2_thing"},
	} {
		if got := cqrsenvelope.DefaultURN(c.v); got != c.want {
			t.Errorf("DefaultURN(%T) = %q, want %q", c.v, got, c.want)
		}
	}
}

// pythonPlaceOrder is what a Python service using the BabelQueue SDK puts on
// the wire for the Go command: the "urn" alias instead of "job", meta.lang
// "python", a retry count, fields this SDK does not know at every level,
// escaped unicode, and a big integer.
const pythonPlaceOrder = `{
  "urn": "urn:babel:orders:place",
  "trace_id": "5b0e3c0a-7d1f-4a4e-9f43-0f3c1c9e2a11",
  "data": {"order_id": "py-1", "amount": 98765432109876543210, "note": "caf\u00e9", "extra": {"k": [1, 2.5, null]}, "ignored_by_go": true},
  "meta": {"id": "0f9d3c7e-3c53-4d8e-b1a3-2a4b6c8d0e1f", "queue": "commands", "lang": "python", "schema_version": 1, "created_at": 1764500000000, "python_only": "x"},
  "attempts": 2,
  "x_tenant": {"id": 7}
}`

func urnMapping(v any) string {
	switch v.(type) {
	case *PlaceOrder, PlaceOrder:
		return "urn:babel:orders:place"
	case *SendInvoice, SendInvoice:
		return "urn:babel:billing:send_invoice"
	}
	return cqrsenvelope.DefaultURN(v)
}

func TestUnmarshalAnotherSDKsEnvelope(t *testing.T) {
	m := cqrsenvelope.Marshaler{URN: urnMapping}
	msg := message.NewMessage(watermill.NewUUID(), []byte(pythonPlaceOrder))
	if got := m.NameFromMessage(msg); got != m.Name(&PlaceOrder{}) {
		t.Fatalf("NameFromMessage = %q, the Go handler routes on %q", got, m.Name(&PlaceOrder{}))
	}
	var cmd PlaceOrder
	if err := m.Unmarshal(msg, &cmd); err != nil {
		t.Fatal(err)
	}
	if cmd.OrderID != "py-1" || cmd.Amount != "98765432109876543210" || cmd.Note != "café" || string(cmd.Extra) != `{"k": [1, 2.5, null]}` {
		t.Fatalf("command: %+v", cmd)
	}
	for _, bad := range []string{
		`{"job":"urn:babel:orders:place","trace_id":"t","data":{},"meta":{"id":"x","schema_version":2}}`,
		`{"job":"urn:babel:orders:place","data":{},"meta":{"id":"x","schema_version":1}}`,
		`[1]`,
	} {
		if err := m.Unmarshal(message.NewMessage("u", []byte(bad)), &cmd); !errors.Is(err, envelope.ErrInvalid) {
			t.Errorf("Unmarshal(%s) err = %v, want ErrInvalid", bad, err)
		}
	}
	if m.NameFromMessage(message.NewMessage("u", []byte(`not json`))) != "" {
		t.Error("a message that is no envelope has a name")
	}
}

// app is a CQRS application on GoChannel with the kit as router middleware
// on its default path (meta.id of the envelope).
type app struct {
	ps       *gochannel.GoChannel
	m        cqrsenvelope.Marshaler
	router   *message.Router
	commands *cqrs.CommandBus
	proc     *cqrs.CommandProcessor
	acked    atomic.Int64 // deliveries the router acked
	wg       sync.WaitGroup
}

func newApp(t *testing.T, m cqrsenvelope.Marshaler) *app {
	t.Helper()
	logger := watermill.NopLogger{}
	a := &app{ps: gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, logger), m: m}
	var err error
	a.router, err = message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	a.router.AddMiddleware(a.count, idempotency.Middleware(memstore.New(), idempotency.WithClaim(10*time.Second)))
	topic := func(name string) string { return "commands." + name }
	a.commands, err = cqrs.NewCommandBusWithConfig(a.ps, cqrs.CommandBusConfig{
		GeneratePublishTopic: func(p cqrs.CommandBusGeneratePublishTopicParams) (string, error) { return topic(p.CommandName), nil },
		OnSend:               m.OnSend,
		Marshaler:            m,
		Logger:               logger,
	})
	if err != nil {
		t.Fatal(err)
	}
	a.proc, err = cqrs.NewCommandProcessorWithConfig(a.router, cqrs.CommandProcessorConfig{
		GenerateSubscribeTopic: func(p cqrs.CommandProcessorGenerateSubscribeTopicParams) (string, error) {
			return topic(p.CommandName), nil
		},
		SubscriberConstructor: func(cqrs.CommandProcessorSubscriberConstructorParams) (message.Subscriber, error) { return a.ps, nil },
		Marshaler:             m,
		Logger:                logger,
	})
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// count counts deliveries the router acked.
func (a *app) count(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		a.wg.Add(1)
		go func() {
			defer a.wg.Done()
			select {
			case <-msg.Acked():
				a.acked.Add(1)
			case <-msg.Nacked():
			case <-time.After(10 * time.Second):
			}
		}()
		return h(msg)
	}
}

func (a *app) run(t *testing.T) {
	t.Helper()
	testenv.RunRouter(t, a.router)
}

func (a *app) waitAcked(t *testing.T, n int64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for a.acked.Load() < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d deliveries acked, want %d", a.acked.Load(), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
	a.wg.Wait()
}

// A command sent twice under one business key is one message sent twice:
// its handler runs once.
func TestCommandSentTwiceHandledOnceWithTheKit(t *testing.T) {
	a := newApp(t, cqrsenvelope.Marshaler{URN: urnMapping, ID: func(v any) string {
		if c, ok := v.(*PlaceOrder); ok {
			return "place-order-" + c.OrderID
		}
		return ""
	}})
	var fx testenv.Effects
	if err := a.proc.AddHandlers(cqrs.NewCommandHandler("place", func(_ context.Context, c *PlaceOrder) error {
		fx.Add(c.OrderID)
		return nil
	})); err != nil {
		t.Fatal(err)
	}
	a.run(t)
	for _, id := range []string{"o-1", "o-1", "o-2"} {
		if err := a.commands.Send(context.Background(), &PlaceOrder{OrderID: id, Amount: "1"}); err != nil {
			t.Fatal(err)
		}
	}
	a.waitAcked(t, 3)
	if err := fx.ExactlyOnce([]string{"o-1", "o-2"}); err != nil {
		t.Fatal(err)
	}
}

// The Python service's command reaches the Go handler through the broker
// and the kit, and its redelivery is skipped.
func TestAnotherSDKsCommandRoutesToTheGoHandler(t *testing.T) {
	a := newApp(t, cqrsenvelope.Marshaler{URN: urnMapping})
	var fx testenv.Effects
	var got PlaceOrder
	if err := a.proc.AddHandlers(cqrs.NewCommandHandler("place", func(_ context.Context, c *PlaceOrder) error {
		got = *c
		fx.Add(c.OrderID)
		return nil
	})); err != nil {
		t.Fatal(err)
	}
	a.run(t)
	topic := "commands." + urnMapping(&PlaceOrder{})
	for range 2 {
		if err := a.ps.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte(pythonPlaceOrder))); err != nil {
			t.Fatal(err)
		}
	}
	a.waitAcked(t, 2)
	if err := fx.ExactlyOnce([]string{"py-1"}); err != nil {
		t.Fatal(err)
	}
	if got.Note != "café" || got.Amount != "98765432109876543210" {
		t.Fatalf("command: %+v", got)
	}
}

// A handler that sends a command and then fails is retried; the retry sends
// the same command with the same derived meta.id and the handled message's
// trace_id, so the downstream handler runs once.
func TestCommandsSentWhileHandlingGetDerivedIDs(t *testing.T) {
	a := newApp(t, cqrsenvelope.Marshaler{URN: urnMapping})
	var placeRuns atomic.Int64
	var invoices testenv.Effects
	var mu sync.Mutex
	var invoiceMsgs []*message.Message
	if err := a.proc.AddHandlers(
		cqrs.NewCommandHandler("place", func(ctx context.Context, c *PlaceOrder) error {
			if err := a.commands.Send(ctx, &SendInvoice{OrderID: c.OrderID}); err != nil {
				return err
			}
			// Two identical reminders, told apart by name.
			for _, name := range []string{"reminder-1", "reminder-2"} {
				if err := a.commands.Send(cqrsenvelope.ChildName(ctx, name), &SendInvoice{OrderID: c.OrderID + "/" + "reminder"}); err != nil {
					return err
				}
			}
			if placeRuns.Add(1) == 1 {
				return errors.New("crashed after sending")
			}
			return nil
		}),
		cqrs.NewCommandHandler("invoice", func(ctx context.Context, c *SendInvoice) error {
			mu.Lock()
			invoiceMsgs = append(invoiceMsgs, cqrs.OriginalMessageFromCtx(ctx))
			mu.Unlock()
			invoices.Add(c.OrderID)
			return nil
		}),
	); err != nil {
		t.Fatal(err)
	}
	a.run(t)
	place, err := a.m.Marshal(&PlaceOrder{OrderID: "o-9", Amount: "5"})
	if err != nil {
		t.Fatal(err)
	}
	parent, _ := envelope.Parse(place.Payload)
	if err := a.ps.Publish("commands."+urnMapping(&PlaceOrder{}), place); err != nil {
		t.Fatal(err)
	}
	// place: a failure (nacked), then a success; invoice: 3 sent per run,
	// 6 deliveries, every one acked (run or skipped).
	a.waitAcked(t, 7)
	if placeRuns.Load() != 2 {
		t.Fatalf("place ran %d times, want 2", placeRuns.Load())
	}
	if invoices.Count("o-9") != 1 || invoices.Count("o-9/reminder") != 2 {
		t.Fatalf("invoice ran %d times, reminders %d; want 1 and 2", invoices.Count("o-9"), invoices.Count("o-9/reminder"))
	}
	for _, msg := range invoiceMsgs {
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			t.Fatal(err)
		}
		if e.TraceID != parent.TraceID {
			t.Errorf("trace_id %q, want the handled message's %q", e.TraceID, parent.TraceID)
		}
		if e.Meta.ID == parent.Meta.ID || len(e.Meta.ID) != 36 {
			t.Errorf("meta.id %q not derived", e.Meta.ID)
		}
	}
}

// Outside a handler OnSend leaves the message as Marshal built it.
func TestContinueWithoutAHandledMessage(t *testing.T) {
	m := cqrsenvelope.Marshaler{}
	msg, _ := m.Marshal(&SendInvoice{OrderID: "x"})
	before := string(msg.Payload)
	if err := m.Continue(msg, &SendInvoice{OrderID: "x"}); err != nil || string(msg.Payload) != before {
		t.Fatalf("changed: %v\n%s\n%s", err, before, msg.Payload)
	}
	// With a plain (non-envelope) handled message the id derives from its UUID.
	parent := message.NewMessage("parent-uuid", []byte(`plain`))
	msg.SetContext(cqrs.CtxWithOriginalMessage(context.Background(), parent))
	if err := m.Continue(msg, &SendInvoice{OrderID: "x"}); err != nil {
		t.Fatal(err)
	}
	e, _ := envelope.Parse(msg.Payload)
	if e.Meta.ID == "" || msg.UUID != e.Meta.ID {
		t.Fatalf("derived id: %+v", e)
	}
	again, _ := m.Marshal(&SendInvoice{OrderID: "x"})
	again.SetContext(cqrs.CtxWithOriginalMessage(context.Background(), parent))
	_ = m.Continue(again, &SendInvoice{OrderID: "x"})
	if again.UUID != msg.UUID {
		t.Fatalf("the same child of the same parent got two ids: %s, %s", again.UUID, msg.UUID)
	}
}

// OnPublish continues the handled message in an event as OnSend does in a
// command.
func TestOnPublishContinuesTheHandledMessage(t *testing.T) {
	m := cqrsenvelope.Marshaler{}
	handled, _ := envelope.New("urn:babel:orders:place", nil, envelope.WithID("parent-1"), envelope.WithTraceID("trace-1"))
	payload, _ := handled.Marshal()
	ctx := cqrs.CtxWithOriginalMessage(context.Background(), message.NewMessage("u", payload))
	event := &SendInvoice{OrderID: "o-1"}
	ids := map[string]bool{}
	for range 2 {
		msg, _ := m.Marshal(event)
		msg.SetContext(ctx)
		if err := m.OnPublish(cqrs.OnEventSendParams{EventName: m.Name(event), Event: event, Message: msg}); err != nil {
			t.Fatal(err)
		}
		e, _ := envelope.Parse(msg.Payload)
		if e.TraceID != "trace-1" || msg.Metadata.Get(envelope.MetadataTraceID) != "trace-1" || msg.UUID != e.Meta.ID {
			t.Fatalf("event: %+v, metadata %v", e, msg.Metadata)
		}
		ids[e.Meta.ID] = true
	}
	if len(ids) != 1 {
		t.Fatalf("the same event of the same handled message got %d ids", len(ids))
	}
	// Another event, or the same event under another name, gets another id.
	other, _ := m.Marshal(&SendInvoice{OrderID: "o-2"})
	other.SetContext(ctx)
	named, _ := m.Marshal(event)
	named.SetContext(cqrsenvelope.ChildName(ctx, "second"))
	for _, msg := range []*message.Message{other, named} {
		if err := m.Continue(msg, nil); err != nil {
			t.Fatal(err)
		}
		if ids[msg.UUID] {
			t.Fatalf("distinct child got the same id %s", msg.UUID)
		}
	}
}
