// Command effects charges orders through a payment provider that misbehaves
// the way real ones do, and shows each order charged exactly once.
//
//	docker compose up -d --wait redis   # or any Redis 6.2+; REDIS_URL overrides
//	go run ./examples/effects
//
// The provider is our own (testkit/fakepay), an HTTP server on loopback. In
// the first part it honours idempotency keys and answers status lookups, but
// times out after charging, loses replies, and sends its callbacks twice and
// out of order. Two workers in one Redis Streams consumer group charge the
// orders (a fifth of them published twice) through effects.Do: the provider
// key is derived from the order message, the intent is recorded before the
// call, a lost reply leaves the charge unknown, and the retry reconciles it
// with a status lookup, or resubmits under the same key. The provider's own
// ledger then shows one charge per order.
//
// In the second part the provider has no idempotency keys and no lookups,
// and every reply is lost after charging. The declared policy is Park: the
// retries never call again, the charges stay unknown, and the list an
// operator gets from `bq-idempotency effects list --state unknown` shows
// them, to be resolved by hand.
//
// It removes what it wrote when it ends (its streams and its records).
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/fakepay"
)

func main() {
	url := os.Getenv("REDIS_URL")
	if url == "" {
		url = "redis://localhost:6379/0"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := run(ctx, os.Stdout, url, 40); err != nil {
		fmt.Fprintln(os.Stderr, "effects example:", err)
		os.Exit(1)
	}
}

// Setup names what the workers share: Redis, the topic and group, the
// prefixes of the stores, the provider, and the effect's policy.
type Setup struct {
	RedisURL, Topic, Group, Prefix, ProviderURL string
	// Keys: the provider deduplicates idempotency keys and answers lookups.
	Keys bool
}

func (s Setup) effectsPrefix() string { return s.Prefix + "fx" }

// Consume runs one worker until ctx is done: a Redis Streams consumer
// whose handler charges each order through effects.Do.
func Consume(ctx context.Context, s Setup, name string, logger watermill.LoggerAdapter) error {
	opts, err := redis.ParseURL(s.RedisURL)
	if err != nil {
		return err
	}
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client: redis.NewClient(opts), ConsumerGroup: s.Group, Consumer: name, OldestId: "0",
		BlockTime: 100 * time.Millisecond, DisableIndefiniteInitialBlock: true,
		ClaimInterval: 200 * time.Millisecond, MaxIdleTime: time.Second, // a dead worker's entries move on
	}, logger)
	if err != nil {
		return err
	}
	// 1. The records of messages, and the records of effects: both in Redis,
	// shared by the fleet.
	store := redisstore.New(rdb, redisstore.WithPrefix(s.Prefix), redisstore.WithTTL(time.Hour))
	fx, err := effects.New(redisstore.NewEffects(rdb, redisstore.WithEffectsPrefix(s.effectsPrefix())),
		effects.WithCallTimeout(300*time.Millisecond), effects.WithLease(time.Second), effects.WithLogger(logger))
	if err != nil {
		return err
	}
	defer fx.Close()

	// 2. The effect, declared once: how to find out what happened, and what
	// to do when nobody knows.
	client := fakepay.Client{BaseURL: s.ProviderURL, HTTP: &http.Client{}}
	var charge *effects.Effect
	if s.Keys {
		charge = fx.Effect("charge",
			effects.WithResolver(func(ctx context.Context, key string) (effects.Outcome, error) {
				ch, found, err := client.Lookup(ctx, key)
				switch {
				case err != nil:
					return effects.Outcome{}, err
				case !found:
					return effects.NotFound(), nil
				}
				return effects.Succeeded([]byte(ch.ID)), nil
			}),
			effects.WithPolicy(effects.Resubmit), // the provider deduplicates its keys
			effects.WithMaxCalls(10))
	} else {
		charge = fx.Effect("charge", effects.WithPolicy(effects.Park)) // no keys, no lookups: never call twice
	}

	// 3. The handler: the order's charge, once.
	handler := func(msg *message.Message) error {
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			return err
		}
		var req fakepay.Request
		if err := json.Unmarshal(e.Data, &req); err != nil {
			return err
		}
		_, err = charge.Do(msg.Context(), req, func(ctx context.Context, key string) (effects.Outcome, error) {
			ch, err := client.Charge(ctx, key, req)
			switch {
			case errors.Is(err, fakepay.ErrDeclined):
				return effects.Failed("card_declined"), nil
			case err != nil:
				return effects.Outcome{}, err // a timeout, a lost reply: unknown, never failed
			}
			return effects.Succeeded([]byte(ch.ID)), nil
		})
		if errors.Is(err, effects.ErrFailed) {
			return nil // declined: an answer, not a fault (a real service records it)
		}
		return err
	}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		return err
	}
	// 4. The README's wiring: a charge still unknown after Retry leaves the
	// line for the dead-letter topic (reason unknown_outcome), or a broker
	// that redelivers in order would hand it back before anything behind it.
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: rdb}, logger)
	if err != nil {
		return err
	}
	dlq, err := deadletter.Middleware(pub)
	if err != nil {
		return err
	}
	router.AddMiddleware(
		dlq,
		middleware.Retry{MaxRetries: 3, InitialInterval: 50 * time.Millisecond,
			ShouldRetry: func(p middleware.RetryParams) bool { return !idempotency.IsPermanent(p.Err) }}.Middleware,
		deadletter.CountAttempts,
		idempotency.Middleware(store, idempotency.WithClaim(2*time.Second)),
	)
	router.AddConsumerHandler("charge", s.Topic, sub, handler)
	return router.Run(ctx)
}

// Publish puts one order message per order on the topic, a fifth of them
// twice (a producer that retried), and returns the order ids.
func Publish(ctx context.Context, s Setup, orders int) ([]string, error) {
	opts, err := redis.ParseURL(s.RedisURL)
	if err != nil {
		return nil, err
	}
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: rdb}, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	var ids []string
	for i := range orders {
		req := fakepay.Request{OrderID: fmt.Sprintf("order-%03d", i+1), AmountCents: int64(1000 + i)}
		e, err := envelope.New("urn:babel:orders:charge", req)
		if err != nil {
			return nil, err
		}
		payload, err := e.Marshal()
		if err != nil {
			return nil, err
		}
		copies := 1
		if i%5 == 0 {
			copies = 2
		}
		for range copies {
			if err := pub.Publish(s.Topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
				return nil, err
			}
		}
		ids = append(ids, req.OrderID)
	}
	return ids, nil
}

// Webhook serves the provider's callbacks: each applied once by its event
// id, through the effect's transitions.
func Webhook(fx *effects.Runner) (url string, stop func(), err error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: fx.HTTPHandler(func(r *http.Request) (effects.Callback, error) {
		var e fakepay.Event
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<16)).Decode(&e); err != nil {
			return effects.Callback{}, err
		}
		outcome := effects.Unknown(e.Type)
		if e.Type == "charge.succeeded" {
			outcome = effects.Succeeded([]byte(e.ChargeID))
		}
		return effects.Callback{EventID: e.ID, ProviderKey: e.Reference, Outcome: outcome}, nil
	})}
	var wg sync.WaitGroup
	wg.Go(func() { _ = srv.Serve(ln) })
	return "http://" + ln.Addr().String(), func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
		wg.Wait()
	}, nil
}

func run(ctx context.Context, out io.Writer, redisURL string, orders int) error {
	opts, err := redis.ParseURL(redisURL)
	if err != nil {
		return err
	}
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	if err := rdb.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis at %s: %w (start it with `docker compose up -d --wait redis`)", redisURL, err)
	}
	run := randomHex(4)
	s := Setup{RedisURL: redisURL, Topic: "bq-example-effects-" + run, Group: "billing", Prefix: "bq-example-" + run + ":", Keys: true}
	defer cleanup(rdb, s)

	// Part 1: a provider with idempotency keys and lookups that times out
	// after charging, loses replies and sends callbacks twice and late.
	fx, err := effects.New(redisstore.NewEffects(rdb, redisstore.WithEffectsPrefix(s.effectsPrefix())))
	if err != nil {
		return err
	}
	defer fx.Close()
	hook, stopHook, err := Webhook(fx)
	if err != nil {
		return err
	}
	defer stopHook()
	provider, err := fakepay.Start(fakepay.Config{IdempotentKeys: true, Lookups: true, Webhook: hook, Seed: 7,
		Faults: fakepay.Faults{TimeoutAfterCharge: 0.2, LoseReply: 0.1, DuplicateCallback: 0.3, StaleCallback: 0.3}})
	if err != nil {
		return err
	}
	defer provider.Close()
	s.ProviderURL = provider.URL()
	ids, err := Publish(ctx, s, orders)
	if err != nil {
		return err
	}
	if err := work(ctx, rdb, s, fx, len(ids)); err != nil {
		return err
	}
	requests, faults := provider.Stats()
	perOrder := provider.ChargesPerOrder()
	fmt.Fprintf(out, "part 1: a provider with idempotency keys and lookups\n")
	fmt.Fprintf(out, "  %d orders (a fifth published twice), 2 workers; the provider got %d charge requests\n", len(ids), requests)
	fmt.Fprintf(out, "  injected: %s\n", describe(faults))
	exact := true
	for _, id := range ids {
		if perOrder[id] != 1 {
			exact = false
			fmt.Fprintf(out, "  %s charged %d times\n", id, perOrder[id])
		}
	}
	fmt.Fprintf(out, "  provider ledger: %d charges for %d orders\n", len(provider.Ledger()), len(ids))
	if dead, err := rdb.XLen(ctx, s.Topic+".dlq").Result(); err != nil || dead != 0 {
		return fmt.Errorf("%d messages dead-lettered (%v)", dead, err)
	}
	if !exact || len(provider.Ledger()) != len(ids) {
		return errors.New("an order was not charged exactly once")
	}
	fmt.Fprintln(out, "  every order charged exactly once")

	// Part 2: a provider without idempotency keys or lookups, every reply
	// lost after charging. Policy Park: no second call, ever.
	s2 := Setup{RedisURL: redisURL, Topic: s.Topic + "-nokeys", Group: "billing", Prefix: "bq-example-" + run + "-2:"}
	defer cleanup(rdb, s2)
	blind, err := fakepay.Start(fakepay.Config{Faults: fakepay.Faults{TimeoutAfterCharge: 1, Hold: time.Second}})
	if err != nil {
		return err
	}
	defer blind.Close()
	s2.ProviderURL = blind.URL()
	ids2, err := Publish(ctx, s2, 5)
	if err != nil {
		return err
	}
	store2 := redisstore.NewEffects(rdb, redisstore.WithEffectsPrefix(s2.effectsPrefix()))
	if err := parked(ctx, rdb, s2, store2, len(ids2)); err != nil {
		return err
	}
	requests2, _ := blind.Stats()
	fmt.Fprintf(out, "part 2: a provider without idempotency keys or lookups, every reply lost\n")
	fmt.Fprintf(out, "  %d orders; the provider got %d charge requests, charged %d times (no second call)\n", len(ids2), requests2, len(blind.Ledger()))
	unknown, err := store2.List(ctx, stores.EffectQuery{States: []stores.EffectState{stores.EffectUnknown}})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "  bq-idempotency effects list --state unknown:\n")
	for _, e := range unknown {
		fmt.Fprintf(out, "    %s  %-7s  %s  handler %s  message %s  %s\n", e.Key, e.State, e.Name, e.Scope, e.MessageID[:8], e.Note)
	}
	if requests2 != len(ids2) || len(unknown) != len(ids2) {
		return fmt.Errorf("%d requests and %d unknown effects for %d orders", requests2, len(unknown), len(ids2))
	}
	dead, err := rdb.XLen(ctx, s2.Topic+".dlq").Result()
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "  %d messages dead-lettered with reason unknown_outcome after their retries\n", dead)
	fmt.Fprintln(out, "  each charge parked as unknown for an operator; none sent twice")
	return nil
}

// work runs two workers until every order's charge succeeded and the
// stream is drained.
func work(ctx context.Context, rdb *redis.Client, s Setup, fx *effects.Runner, orders int) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for _, name := range []string{"worker-1", "worker-2"} {
		wg.Go(func() { errs <- Consume(ctx, s, name, watermill.NopLogger{}) })
	}
	defer wg.Wait()
	defer cancel()
	for {
		done, err := Done(ctx, rdb, s, fx.Store(), orders)
		if err != nil {
			return err
		}
		if done {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("orders not all charged: %w", ctx.Err())
		case err := <-errs:
			return fmt.Errorf("a worker stopped: %v", err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// parked runs one worker until every order's charge is unknown and its
// message was dead-lettered after its retries.
func parked(ctx context.Context, rdb *redis.Client, s Setup, store stores.EffectStore, orders int) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	wg.Go(func() { _ = Consume(ctx, s, "worker-1", watermill.NopLogger{}) })
	defer wg.Wait()
	defer cancel()
	for {
		stats, err := store.Stats(ctx)
		if err != nil {
			return err
		}
		dead, err := rdb.XLen(ctx, s.Topic+".dlq").Result()
		if err != nil {
			return err
		}
		if stats[stores.EffectUnknown].Count == int64(orders) && dead >= int64(orders) {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Done reports whether every order's charge succeeded and the consumer
// group has nothing pending.
func Done(ctx context.Context, rdb *redis.Client, s Setup, store stores.EffectStore, orders int) (bool, error) {
	stats, err := store.Stats(ctx)
	if err != nil {
		return false, err
	}
	if stats[stores.EffectSucceeded].Count != int64(orders) {
		return false, nil
	}
	pending, err := rdb.XPending(ctx, s.Topic, s.Group).Result()
	if err != nil {
		return false, err
	}
	groups, err := rdb.XInfoGroups(ctx, s.Topic).Result()
	if err != nil {
		return false, err
	}
	return pending.Count == 0 && len(groups) == 1 && groups[0].Lag == 0, nil
}

func describe(faults map[string]int) string {
	var parts []string
	for k, v := range faults {
		parts = append(parts, fmt.Sprintf("%d %s", v, strings.ReplaceAll(k, "_", " ")))
	}
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}

// cleanup removes the run's streams and records.
func cleanup(rdb *redis.Client, s Setup) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rdb.Del(ctx, s.Topic, s.Topic+".dlq")
	for _, pattern := range []string{s.Prefix + "*", "{" + s.effectsPrefix() + "}*"} {
		iter := rdb.Scan(ctx, 0, pattern, 1000).Iterator()
		for iter.Next(ctx) {
			rdb.Del(ctx, iter.Val())
		}
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
