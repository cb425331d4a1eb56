// Command redrive walks through an operator's day with dead letters on Redis
// Streams:
//
//		docker compose up -d --wait redis   # or any Redis 6.2+; REDIS_URL overrides
//		go run ./examples/redrive
//
//	 1. Orders flow through a handler whose payment gateway is down; after
//	    their retries they land on orders.dlq as plain envelopes.
//	 2. The DLQ is triaged: reason, error, attempts and trace_id per message.
//	 3. The gateway is fixed and the DLQ is redriven: each order is processed
//	    once and the confirmation email goes out once.
//	 4. Processed orders are replayed on purpose (forget, then redrive with the
//	    replay-bypass marker): the idempotent core runs again, the email is not
//	    sent twice.
//
// It exits 0 when every check holds, and removes what it wrote when it ends
// (its streams and its records).
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/redrive"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
)

func main() {
	url := os.Getenv("REDIS_URL")
	if url == "" {
		url = "redis://localhost:6379/0"
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := run(ctx, os.Stdout, url); err != nil {
		fmt.Fprintln(os.Stderr, "redrive:", err)
		os.Exit(1)
	}
}

// shop is the order service: a payment gateway that can be down, and the
// counts of what it did.
type shop struct {
	gatewayDown atomic.Bool
	mu          sync.Mutex
	processed   map[string]int // the idempotent core: the order is recorded
	emails      map[string]int // the external effect
}

func (s *shop) handle(msg *message.Message) error {
	e, err := envelope.Parse(msg.Payload)
	if err != nil {
		return err
	}
	if s.gatewayDown.Load() {
		return errors.New("payment gateway: 503 service unavailable")
	}
	s.mu.Lock()
	s.processed[e.Meta.ID]++
	s.mu.Unlock()
	// The email must never go out twice, not even on a deliberate replay.
	return idempotency.BypassExternalEffects(msg.Context(), func(context.Context) error {
		s.mu.Lock()
		s.emails[e.Meta.ID]++
		s.mu.Unlock()
		return nil
	})
}

func (s *shop) counts(id string) (processed, emails int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.processed[id], s.emails[id]
}

func run(ctx context.Context, out io.Writer, redisURL string) error {
	opts, err := redis.ParseURL(redisURL)
	if err != nil {
		return fmt.Errorf("REDIS_URL: %w", err)
	}
	admin := redis.NewClient(opts)
	defer admin.Close()
	if err := admin.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis at %s: %w (start one with `docker compose up -d redis`)", redisURL, err)
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	runID := hex.EncodeToString(b)
	orders := "orders-" + runID
	dlq := orders + ".dlq"
	prefix := "ex" + runID[:4] + ":"
	defer func() { // a real service keeps its streams, and its records for their TTL
		cleanup := context.WithoutCancel(ctx)
		admin.Del(cleanup, orders, dlq)
		iter := admin.Scan(cleanup, 0, prefix+"*", 1000).Iterator()
		for iter.Next(cleanup) {
			admin.Unlink(cleanup, iter.Val())
		}
	}()
	logger := watermill.NopLogger{}
	// redisstream closes the client it is given: every subscriber and
	// publisher gets its own.
	newSub := func(group string) (message.Subscriber, error) {
		return redisstream.NewSubscriber(redisstream.SubscriberConfig{
			Client: redis.NewClient(opts), ConsumerGroup: group, Consumer: "example", OldestId: "0",
			BlockTime: 100 * time.Millisecond, DisableIndefiniteInitialBlock: true,
			MaxIdleTime: time.Millisecond, ClaimInterval: time.Hour,
		}, logger)
	}
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(opts)}, logger)
	if err != nil {
		return err
	}
	defer pub.Close()
	store := redisstore.New(admin, redisstore.WithPrefix(prefix), redisstore.WithTTL(time.Hour))

	// The order service: dead letters outside Retry, the guard innermost.
	s := &shop{processed: map[string]int{}, emails: map[string]int{}}
	s.gatewayDown.Store(true)
	dlqMiddleware, err := deadletter.Middleware(pub)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		return err
	}
	router.AddMiddleware(dlqMiddleware,
		middleware.Retry{MaxRetries: 2, InitialInterval: 10 * time.Millisecond,
			ShouldRetry: func(p middleware.RetryParams) bool { return !idempotency.IsPermanent(p.Err) }}.Middleware,
		deadletter.CountAttempts,
		idempotency.Middleware(store))
	sub, err := newSub("order-service")
	if err != nil {
		return err
	}
	router.AddConsumerHandler("place-order", orders, sub, s.handle)
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(runCtx) }()
	<-router.Running()

	// 1. Orders arrive while the gateway is down.
	var ids []string
	for i := range 5 {
		e, err := envelope.New("urn:babel:orders:created", map[string]any{"order": 1000 + i, "cents": 1999}, envelope.WithQueue(orders))
		if err != nil {
			return err
		}
		payload, _ := e.Marshal()
		if err := pub.Publish(orders, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			return err
		}
		ids = append(ids, e.Meta.ID)
	}
	if err := waitFor(ctx, func() bool { n, _ := admin.XLen(ctx, dlq).Result(); return n == int64(len(ids)) }); err != nil {
		return fmt.Errorf("orders did not reach %s: %w", dlq, err)
	}

	// 2. Triage.
	fmt.Fprintf(out, "1. the gateway is down: %d orders on %s\n\n2. triage\n", len(ids), dlq)
	entries, err := admin.XRange(ctx, dlq, "-", "+").Result()
	if err != nil {
		return err
	}
	for _, x := range entries {
		payload, _ := x.Values["payload"].(string)
		e, err := envelope.Parse([]byte(payload))
		if err != nil || e.DeadLetter == nil {
			return fmt.Errorf("a dead letter that is not a dead-lettered envelope: %v", err)
		}
		fmt.Fprintf(out, "   %s  reason=%s attempts=%d trace_id=%s error=%q\n",
			e.Meta.ID[:8], e.DeadLetter.Reason, e.DeadLetter.Attempts, e.TraceID[:8], *e.DeadLetter.Error)
	}

	// 3. Fix the gateway, redrive.
	s.gatewayDown.Store(false)
	report, err := redriveOnce(ctx, newSub, pub, dlq)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "\n3. gateway fixed; redrive moved %d messages back to %s\n", report.Moved, orders)
	if err := waitFor(ctx, func() bool {
		for _, id := range ids {
			if p, _ := s.counts(id); p == 0 {
				return false
			}
		}
		return true
	}); err != nil {
		return fmt.Errorf("redriven orders were not processed: %w", err)
	}
	for _, id := range ids {
		if p, e := s.counts(id); p != 1 || e != 1 {
			return fmt.Errorf("order %s processed %d times, %d emails", id, p, e)
		}
	}
	fmt.Fprintf(out, "   every order processed once, one confirmation email each\n")

	// 4. A deliberate replay of the processed orders: put them on the DLQ as
	//    an operator's replay batch, forget their records, redrive with the
	//    bypass marker.
	//    The orders stream holds each order twice (the first delivery and
	//    the redriven one): the batch takes each order once.
	inBatch := map[string]bool{}
	for _, x := range mustRange(ctx, admin, orders) {
		payload, _ := x.Values["payload"].(string)
		e, err := envelope.Parse([]byte(payload))
		if err != nil {
			return err
		}
		if inBatch[e.Meta.ID] {
			continue
		}
		inBatch[e.Meta.ID] = true
		e.DeadLetter = &envelope.DeadLetter{Reason: envelope.ReasonFailed, OriginalQueue: orders, FailedAt: time.Now().UnixMilli(), Lang: envelope.Lang}
		replay, _ := e.Marshal()
		if err := pub.Publish(dlq, message.NewMessage(watermill.NewUUID(), replay)); err != nil {
			return err
		}
		if err := store.Forget(ctx, idempotency.Key("place-order", e.Meta.ID)); err != nil {
			return err
		}
	}
	report, err = redriveOnce(ctx, newSub, pub, dlq, redrive.WithReplayBypass())
	if err != nil {
		return err
	}
	if err := waitFor(ctx, func() bool {
		for _, id := range ids {
			if p, _ := s.counts(id); p != 2 {
				return false
			}
		}
		return true
	}); err != nil {
		return fmt.Errorf("replayed orders were not processed: %w", err)
	}
	fmt.Fprintf(out, "\n4. replayed %d processed orders with bypass\n", report.Moved)
	for _, id := range ids {
		p, e := s.counts(id)
		fmt.Fprintf(out, "   %s  core ran %d times, emails sent %d\n", id[:8], p, e)
		if e != 1 {
			return fmt.Errorf("order %s: %d confirmation emails", id, e)
		}
	}
	fmt.Fprintln(out, "\nevery order processed, no email sent twice")
	stop()
	return <-routerDone
}

func redriveOnce(ctx context.Context, newSub func(string) (message.Subscriber, error), pub message.Publisher, dlq string, opts ...redrive.Option) (redrive.Report, error) {
	sub, err := newSub("redrive")
	if err != nil {
		return redrive.Report{}, err
	}
	report, err := redrive.Run(ctx, sub, pub, dlq, append(opts, redrive.WithIdleTimeout(500*time.Millisecond))...)
	time.Sleep(100 * time.Millisecond) // let the last ack land before closing
	_ = sub.Close()
	return report, err
}

func mustRange(ctx context.Context, client *redis.Client, stream string) []redis.XMessage {
	entries, _ := client.XRange(ctx, stream, "-", "+").Result()
	return entries
}

func waitFor(ctx context.Context, cond func() bool) error {
	for !cond() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return nil
}
