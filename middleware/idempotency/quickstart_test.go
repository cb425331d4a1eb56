package idempotency_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// rejections counts the OutcomeReject decisions.
type rejections struct{ n atomic.Int64 }

func (r *rejections) Observe(_ context.Context, e idempotency.Event) {
	if e.Outcome == idempotency.OutcomeReject {
		r.n.Add(1)
	}
}

// TestQuickStartPermanentRejection backs what the README's quick start says
// at its one line: with the guard alone, a message it rejects for good (an
// unknown schema_version) is redelivered again and again; with the poison
// queue line beside it, it is rejected once and lands on the dead-letter
// topic.
func TestQuickStartPermanentRejection(t *testing.T) {
	t.Parallel()
	future := []byte(`{"job":"urn:babel:payments:requested","data":{},"meta":{"id":"payment-1043","schema_version":2}}`)
	run := func(t *testing.T, poisonQueue bool) (*rejections, <-chan *message.Message) {
		logger := watermill.NopLogger{}
		pubSub := gochannel.NewGoChannel(gochannel.Config{}, logger)
		t.Cleanup(func() { _ = pubSub.Close() })
		router, err := message.NewRouter(message.RouterConfig{}, logger)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		dlq, err := pubSub.Subscribe(ctx, "payments.dlq")
		if err != nil {
			t.Fatal(err)
		}
		if poisonQueue {
			poison, err := middleware.PoisonQueueWithFilter(pubSub, "payments.dlq", idempotency.IsPermanent)
			if err != nil {
				t.Fatal(err)
			}
			router.AddMiddleware(poison)
		}
		seen := &rejections{}
		router.AddMiddleware(idempotency.Middleware(memstore.New(), idempotency.WithObserver(seen)))
		router.AddConsumerHandler("charge", "payments", pubSub, func(*message.Message) error {
			t.Error("the handler ran on a rejected message")
			return nil
		})
		stopped := make(chan struct{})
		go func() { _ = router.Run(ctx); close(stopped) }()
		t.Cleanup(func() { cancel(); <-stopped })
		<-router.Running()
		if err := pubSub.Publish("payments", message.NewMessage(watermill.NewUUID(), future)); err != nil {
			t.Fatal(err)
		}
		return seen, dlq
	}

	t.Run("guard alone", func(t *testing.T) {
		seen, _ := run(t, false)
		deadline := time.Now().Add(20 * time.Second)
		for seen.n.Load() < 100 {
			if time.Now().After(deadline) {
				t.Fatalf("rejected %d times in 20 s; expected the router to keep redelivering it", seen.n.Load())
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
	t.Run("with the poison queue", func(t *testing.T) {
		seen, dlq := run(t, true)
		select {
		case msg := <-dlq:
			msg.Ack()
			if string(msg.Payload) != string(future) {
				t.Errorf("dead-lettered %s, want the rejected message", msg.Payload)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("nothing reached payments.dlq")
		}
		time.Sleep(100 * time.Millisecond) // a redelivery would show by now
		if n := seen.n.Load(); n != 1 {
			t.Errorf("rejected %d times, want once", n)
		}
	})
}
