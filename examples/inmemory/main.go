// Command inmemory shows the idempotency middleware skipping redeliveries,
// with no services at all: Watermill's in-process GoChannel pub/sub and the
// in-memory store.
//
//	go run ./examples/inmemory
//
// It publishes three payments, one of them three times over (a broker
// redelivering), and one whose handler fails on its first run. It prints
// what ran and what was skipped, then exits 0 when every payment was charged
// exactly once.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "inmemory:", err)
		os.Exit(1)
	}
}

// payment is one message the example publishes, and how often.
type payment struct {
	id, customer string
	cents        int
	deliveries   int
}

func run(ctx context.Context, w io.Writer) error {
	logger := watermill.NopLogger{}
	out := &lockedWriter{w: w} // handlers run concurrently

	// 1. A pub/sub and a store. GoChannel stands in for a real broker; a
	//    nacked message is redelivered, as a broker would.
	pubSub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, logger)
	store := memstore.New(memstore.WithTTL(72 * time.Hour))

	// 2. Count the middleware's decisions, to print a summary at the end.
	//    GoChannel redelivers a nacked message at once, so a parked copy
	//    comes back again and again while the first one is being charged:
	//    print it once per message.
	var mu sync.Mutex
	outcomes := map[idempotency.Outcome]int{}
	failedRuns := 0
	parked := map[string]bool{}
	observer := idempotency.ObserverFunc(func(_ context.Context, e idempotency.Event) {
		mu.Lock()
		outcomes[e.Outcome]++
		if e.Outcome == idempotency.OutcomeRun && e.Err != nil {
			failedRuns++
		}
		firstPark := e.Outcome == idempotency.OutcomePark && !parked[e.MessageID]
		if firstPark {
			parked[e.MessageID] = true
		}
		mu.Unlock()
		switch {
		case e.Outcome == idempotency.OutcomeSkip:
			fmt.Fprintf(out, "  skipped  %s (already charged)\n", e.MessageID)
		case firstPark:
			fmt.Fprintf(out, "  parked   %s (a copy is being charged right now; redelivered until it is done)\n", e.MessageID)
		}
	})

	// 3. The router with the one line that matters. The router handles
	//    deliveries concurrently, so copies of one message can arrive at the
	//    same moment: WithClaim lets one run and parks the others until it
	//    is done (they are then skipped).
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		return err
	}
	router.AddMiddleware(idempotency.Middleware(store, idempotency.WithClaim(10*time.Second), idempotency.WithObserver(observer)))

	// 4. The handler: charge a card. The gateway times out once for pay-3.
	var charges sync.Map // meta.id -> *atomic.Int32
	var gatewayDown atomic.Bool
	gatewayDown.Store(true)
	router.AddConsumerHandler("charge", "payments", pubSub, func(msg *message.Message) error {
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			return err
		}
		if e.Meta.ID == "pay-3" && gatewayDown.CompareAndSwap(true, false) {
			fmt.Fprintf(out, "  failed   %s (gateway timeout, will be redelivered)\n", e.Meta.ID)
			return errors.New("payment gateway timeout")
		}
		n, _ := charges.LoadOrStore(e.Meta.ID, new(atomic.Int32))
		n.(*atomic.Int32).Add(1)
		fmt.Fprintf(out, "  charged  %s %s\n", e.Meta.ID, e.Data)
		return nil
	})

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(runCtx) }()
	<-router.Running()

	// 5. Publish: pay-1 once, pay-2 three times (redeliveries), pay-3 once.
	payments := []payment{
		{"pay-1", "c-1", 1299, 1},
		{"pay-2", "c-2", 4500, 3},
		{"pay-3", "c-3", 990, 1},
	}
	fmt.Fprintln(out, "deliveries:")
	total := 0
	for _, p := range payments {
		e, err := envelope.New("urn:babel:payments:requested",
			map[string]any{"customer": p.customer, "amount_cents": p.cents},
			envelope.WithID(p.id), envelope.WithQueue("payments"))
		if err != nil {
			return err
		}
		payload, err := e.Marshal()
		if err != nil {
			return err
		}
		for range p.deliveries {
			if err := pubSub.Publish("payments", message.NewMessage(watermill.NewUUID(), payload)); err != nil {
				return err
			}
			total++
		}
	}

	// 6. Wait until every delivery was either charged or skipped.
	for {
		mu.Lock()
		done := outcomes[idempotency.OutcomeSkip]+countCharges(&charges) == total
		mu.Unlock()
		if done {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("timed out waiting for deliveries: %w", ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
	stop()
	if err := <-routerDone; err != nil {
		return err
	}

	// 7. The summary: one charge per payment, whatever the broker did.
	mu.Lock()
	defer mu.Unlock()
	fmt.Fprintf(out, "\nsummary: %d messages published, %d handler runs (%d failed and redelivered), %d skipped as duplicates\n",
		total, outcomes[idempotency.OutcomeRun], failedRuns, outcomes[idempotency.OutcomeSkip])
	for _, p := range payments {
		n := 0
		if v, ok := charges.Load(p.id); ok {
			n = int(v.(*atomic.Int32).Load())
		}
		fmt.Fprintf(out, "  %s charged %d time(s)\n", p.id, n)
		if n != 1 {
			return fmt.Errorf("%s was charged %d times, want exactly 1", p.id, n)
		}
	}
	fmt.Fprintln(out, "every payment charged exactly once")
	return nil
}

func countCharges(charges *sync.Map) int {
	n := 0
	charges.Range(func(_, v any) bool {
		n += int(v.(*atomic.Int32).Load())
		return true
	})
	return n
}

// lockedWriter serialises writes from concurrent handlers.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
