// Command payments runs two payment workers in one Redis Streams consumer
// group, sharing one Redis idempotency store, and shows that every payment is
// charged exactly once although the producer publishes duplicates and the
// workers race for them.
//
//	docker compose up -d --wait redis   # or any Redis 6.2+; REDIS_URL overrides
//	go run ./examples/payments
//
// It prints the charges each worker made, the duplicates it skipped and the
// deliveries it parked (a duplicate arriving while the first copy was still
// being charged), and exits 0 when every payment was charged once.
//
// The example removes what it wrote when it ends (its stream and its
// records); a real service keeps its records for their TTL.
//
// The middleware's OpenTelemetry metrics are served for Prometheus at
// http://127.0.0.1:2112/metrics while it runs (METRICS_ADDR overrides), and
// the delivery counters are printed at the end.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
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
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
)

func main() {
	url := os.Getenv("REDIS_URL")
	if url == "" {
		url = "redis://localhost:6379/0"
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	addr := os.Getenv("METRICS_ADDR")
	if addr == "" {
		addr = "127.0.0.1:2112"
	}
	if err := run(ctx, os.Stdout, url, addr, 40); err != nil {
		fmt.Fprintln(os.Stderr, "payments:", err)
		os.Exit(1)
	}
}

// ledger records the charges, as a payment gateway would see them.
type ledger struct {
	mu       sync.Mutex
	charges  map[string]int // meta.id -> charges
	byWorker map[string]int
	outcomes map[string]map[idempotency.Outcome]int // worker -> outcome -> count
}

func (l *ledger) charge(worker, id string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.charges[id]++
	l.byWorker[worker]++
}

func (l *ledger) observe(worker string) idempotency.Observer {
	return idempotency.ObserverFunc(func(_ context.Context, e idempotency.Event) {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.outcomes[worker][e.Outcome]++
	})
}

func run(ctx context.Context, out io.Writer, redisURL, metricsAddr string, payments int) error {
	opts, err := redis.ParseURL(redisURL)
	if err != nil {
		return fmt.Errorf("REDIS_URL: %w", err)
	}
	client := redis.NewClient(opts)
	defer client.Close()
	if err := client.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis at %s: %w (start one with `docker compose up -d redis`)", redisURL, err)
	}
	logger := watermill.NopLogger{}
	runID := randomHex(4)
	topic := "bq-example-payments-" + runID
	prefix := "bq-example-" + runID + ":"
	defer func() {
		// Runs before client.Close: remove the stream and the records.
		cleanup := context.WithoutCancel(ctx)
		client.Del(cleanup, topic)
		_ = dropKeys(cleanup, client, prefix+"*")
	}()

	// 1. One store for the whole fleet: records live in Redis for a day
	//    (under a prefix of this run's own, so that it can remove them).
	store := redisstore.New(client, redisstore.WithPrefix(prefix), redisstore.WithTTL(24*time.Hour))

	// Metrics: an OpenTelemetry meter provider exporting to Prometheus,
	// served on /metrics.
	metricsURL, meterProvider, stopMetrics, err := serveMetrics(metricsAddr)
	if err != nil {
		return err
	}
	defer stopMetrics()
	fmt.Fprintf(out, "metrics at %s\n", metricsURL)

	// 2. Two workers in one consumer group. Each is a router whose handler
	//    charges a card; WithClaim makes sure two workers never charge the
	//    same payment at once.
	book := &ledger{charges: map[string]int{}, byWorker: map[string]int{}, outcomes: map[string]map[idempotency.Outcome]int{}}
	workers := []string{"worker-1", "worker-2"}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	var wg sync.WaitGroup
	errs := make(chan error, len(workers))
	for _, name := range workers {
		book.outcomes[name] = map[idempotency.Outcome]int{}
		// A client of its own: closing a redisstream subscriber closes its
		// client, which must not cut the other worker's reads short.
		sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
			Client: redis.NewClient(opts), ConsumerGroup: "payment-workers", Consumer: name, OldestId: "0",
			NackResendSleep: 50 * time.Millisecond, BlockTime: 100 * time.Millisecond, DisableIndefiniteInitialBlock: true,
		}, logger)
		if err != nil {
			return err
		}
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
		if err != nil {
			return err
		}
		router.AddMiddleware(idempotency.Middleware(store, idempotency.WithClaim(30*time.Second),
			idempotency.WithObserver(book.observe(name)), idempotency.WithMeterProvider(meterProvider)))
		router.AddConsumerHandler("charge-card", topic, sub, func(msg *message.Message) error {
			e, err := envelope.Parse(msg.Payload)
			if err != nil {
				return err
			}
			time.Sleep(5 * time.Millisecond) // the payment gateway
			book.charge(name, e.Meta.ID)
			return nil
		})
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- router.Run(runCtx)
		}()
		<-router.Running()
	}

	// 3. The producer publishes every payment once, and a third of them two
	//    or three times more, as a retrying producer or a replay would.
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(opts)}, logger)
	if err != nil {
		return err
	}
	defer pub.Close()
	entries := 0
	for i := range payments {
		e, err := envelope.New("urn:babel:payments:requested",
			map[string]any{"payment": i + 1, "amount_cents": 1000 + 7*i}, envelope.WithQueue(topic))
		if err != nil {
			return err
		}
		payload, err := e.Marshal()
		if err != nil {
			return err
		}
		copies := 1
		if i%3 == 0 {
			copies = 2 + i%2
		}
		for range copies {
			if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
				return err
			}
			entries++
		}
	}
	fmt.Fprintf(out, "published %d payments as %d stream entries to %s\n", payments, entries, topic)

	// 4. Wait until the group has read every entry and acked it.
	for {
		groups, err := client.XInfoGroups(ctx, topic).Result()
		if err != nil {
			return err
		}
		if len(groups) == 1 && groups[0].EntriesRead == int64(entries) && groups[0].Pending == 0 {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("workers did not drain the stream: %w", ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	stop()
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			return err
		}
	}

	// 5. The result.
	book.mu.Lock()
	defer book.mu.Unlock()
	fmt.Fprintln(out, "\nworker    charges  skipped  parked")
	var skipped, parked int
	for _, w := range workers {
		o := book.outcomes[w]
		fmt.Fprintf(out, "%-9s %7d  %7d  %6d\n", w, book.byWorker[w], o[idempotency.OutcomeSkip], o[idempotency.OutcomePark])
		skipped += o[idempotency.OutcomeSkip]
		parked += o[idempotency.OutcomePark]
	}
	total := 0
	var wrong []string
	for id, n := range book.charges {
		total += n
		if n != 1 {
			wrong = append(wrong, fmt.Sprintf("%s charged %d times", id, n))
		}
	}
	fmt.Fprintf(out, "\n%d charges for %d payments; %d duplicates skipped, %d deliveries parked and redelivered\n",
		total, payments, skipped, parked)
	sort.Strings(wrong)
	if len(book.charges) != payments || len(wrong) > 0 {
		return fmt.Errorf("%d of %d payments charged; %v", len(book.charges), payments, wrong)
	}
	fmt.Fprintln(out, "every payment charged exactly once")

	// 6. What Prometheus scrapes.
	fmt.Fprintf(out, "\nfrom %s:\n", metricsURL)
	return printCounters(ctx, out, metricsURL)
}

// serveMetrics serves an OpenTelemetry meter provider's metrics for
// Prometheus on addr until stop is called.
func serveMetrics(addr string) (url string, mp *sdkmetric.MeterProvider, stop func(), err error) {
	registry := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(registry))
	if err != nil {
		return "", nil, nil, err
	}
	mp = sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", nil, nil, fmt.Errorf("metrics listener on %s: %w (set METRICS_ADDR)", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	stop = func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
		<-done
		_ = mp.Shutdown(ctx)
	}
	return "http://" + ln.Addr().String() + "/metrics", mp, stop, nil
}

// printCounters scrapes url and prints the middleware's delivery counters.
func printCounters(ctx context.Context, out io.Writer, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("scrape %s: %w", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	printed := 0
	for _, line := range strings.Split(string(body), "\n") {
		if strings.HasPrefix(line, "bq_idempotency_deliveries") {
			fmt.Fprintln(out, "  "+line)
			printed++
		}
	}
	if printed == 0 {
		return fmt.Errorf("no bq_idempotency_deliveries series at %s", url)
	}
	return nil
}

// dropKeys removes every key matching pattern.
func dropKeys(ctx context.Context, client *redis.Client, pattern string) error {
	iter := client.Scan(ctx, 0, pattern, 1000).Iterator()
	var keys []string
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
	}
	if err := iter.Err(); err != nil || len(keys) == 0 {
		return err
	}
	return client.Unlink(ctx, keys...).Err()
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
