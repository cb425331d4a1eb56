// Command operating runs a small payment service that exports every signal
// the kit has, and provokes the conditions its alerts are for, so that the
// alerting rules of deploy/prometheus and the Grafana dashboard of
// deploy/grafana can be watched at work.
//
//	go run ./examples/operating          # metrics at http://127.0.0.1:2113/metrics
//
// It needs no server: the broker is Watermill's GoChannel and the stores
// are in memory. As it starts it handles payments (a third of them
// published twice), then provokes, in order: a burst of payload conflicts
// (one meta.id reused for other amounts), a charge whose outcome stays
// unknown (dead-lettered for an operator), a refund whose retry budget runs
// out, a handler that hangs holding its claim, and a claim taken over by
// another holder while its handler runs. Each leaves a warning in the log
// (the kit logs through slog.Default() unless told otherwise) and a trace
// in the metrics. It serves the metrics until interrupted; METRICS_ADDR
// changes the address. With OTEL_EXPORTER_OTLP_ENDPOINT set (say
// http://localhost:4318) it also sends its metrics and spans to an
// OpenTelemetry collector over OTLP/HTTP.
//
// See docs/operating.md for the metrics, the alerts and how to run
// Prometheus and Grafana against it.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/exporters/otlp/otlpmetric/otlpmetrichttp"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

func main() {
	addr := os.Getenv("METRICS_ADDR")
	if addr == "" {
		addr = "127.0.0.1:2113"
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		fmt.Fprintf(os.Stderr, "operating: metrics listener on %s: %v (set METRICS_ADDR)\n", addr, err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, os.Stdout, ln); err != nil {
		fmt.Fprintln(os.Stderr, "operating:", err)
		os.Exit(1)
	}
}

// The topic the service consumes, and the claim lease of its deliveries.
const (
	topic = "payments"
	lease = 2 * time.Second
)

// payment is a message's data; Mode tells the handler what to provoke.
type payment struct {
	Payment     int    `json:"payment"`
	AmountCents int    `json:"amount_cents"`
	Mode        string `json:"mode,omitempty"` // "", "unknown", "exhaust", "hang", "steal"
}

// run serves the metrics on ln, provokes every condition once and serves
// until ctx is done.
func run(ctx context.Context, out io.Writer, ln net.Listener) error {
	// Metrics: an OpenTelemetry meter provider exporting to Prometheus.
	registry := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(registry))
	if err != nil {
		return err
	}
	readers := []sdkmetric.Option{sdkmetric.WithReader(exporter)}
	tp := sdktrace.NewTracerProvider() // records spans, exports none
	if os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" {
		// And to an OpenTelemetry collector over OTLP/HTTP (the endpoint
		// and headers come from the standard OTEL_EXPORTER_OTLP_*
		// variables): the metrics every 10s, the spans in batches.
		metrics, err := otlpmetrichttp.New(ctx)
		if err != nil {
			return err
		}
		readers = append(readers, sdkmetric.WithReader(sdkmetric.NewPeriodicReader(metrics, sdkmetric.WithInterval(10*time.Second))))
		spans, err := otlptracehttp.New(ctx)
		if err != nil {
			return err
		}
		tp = sdktrace.NewTracerProvider(sdktrace.WithBatcher(spans))
		fmt.Fprintf(out, "exporting over OTLP to %s\n", os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT"))
	}
	mp := sdkmetric.NewMeterProvider(readers...)
	defer mp.Shutdown(context.WithoutCancel(ctx))
	defer tp.Shutdown(context.WithoutCancel(ctx))
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	fmt.Fprintf(out, "metrics at http://%s/metrics\n", ln.Addr())

	// The wiring of a production service: dead letters outside Retry, the
	// guard innermost, effects for the calls to the payment provider.
	logger := watermill.NopLogger{} // the router's; the kit's own lines go to slog.Default()
	pubSub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, logger)
	store := memstore.New(memstore.WithTTL(24 * time.Hour))
	fx, err := effects.New(memstore.NewEffects(), effects.WithCallTimeout(200*time.Millisecond),
		effects.WithLease(time.Second), effects.WithMeterProvider(mp), effects.WithTracerProvider(tp))
	if err != nil {
		return err
	}
	defer fx.Close()
	charge := fx.Effect("charge", effects.WithPolicy(effects.DeadLetter))
	refund := fx.Effect("refund", effects.WithPolicy(effects.Park), effects.WithParkLimit(time.Millisecond))
	dlq, err := deadletter.Middleware(pubSub, deadletter.WithMeterProvider(mp))
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		return err
	}
	router.AddMiddleware(
		dlq,
		middleware.Retry{MaxRetries: 2, InitialInterval: 20 * time.Millisecond,
			ShouldRetry: func(p middleware.RetryParams) bool { return idempotency.Retryable(p.Err) }}.Middleware,
		deadletter.CountAttempts,
		middleware.Recoverer,
		idempotency.Middleware(store, idempotency.WithClaim(lease), idempotency.WithMeterProvider(mp),
			idempotency.WithTracerProvider(tp)),
	)
	var handlers sync.WaitGroup
	defer handlers.Wait()
	router.AddConsumerHandler("charge-card", topic, pubSub, func(msg *message.Message) error {
		handlers.Add(1)
		defer handlers.Done()
		return handle(ctx, msg, store, charge, refund)
	})
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-routerDone:
		return err
	}

	// The provocations, each once.
	n := 0
	publish := func(id string, p payment) error {
		n++
		e, err := envelope.New("urn:babel:payments:requested", p, envelope.WithID(id), envelope.WithQueue(topic))
		if err != nil {
			return err
		}
		body, err := e.Marshal()
		if err != nil {
			return err
		}
		return pubSub.Publish(topic, message.NewMessage(watermill.NewUUID(), body))
	}
	steps := []struct {
		what string
		do   func() error
	}{
		{"30 payments, every third published twice", func() error {
			for i := 1; i <= 30; i++ {
				for range 1 + i%3/2 {
					if err := publish(fmt.Sprintf("pay-%d", i), payment{Payment: i, AmountCents: 100 * i}); err != nil {
						return err
					}
				}
			}
			return nil
		}},
		{"a burst of 12 payload conflicts (pay-1 reused for other amounts)", func() error {
			time.Sleep(200 * time.Millisecond) // pay-1 is remembered by then
			for i := range 12 {
				if err := publish("pay-1", payment{Payment: 1, AmountCents: 1 + i}); err != nil {
					return err
				}
			}
			return nil
		}},
		{"a charge whose outcome stays unknown", func() error { return publish("pay-unknown", payment{Payment: 101, Mode: "unknown"}) }},
		{"a refund whose retry budget runs out", func() error { return publish("pay-exhaust", payment{Payment: 102, Mode: "exhaust"}) }},
		{"a handler that hangs holding its claim", func() error { return publish("pay-hang", payment{Payment: 103, Mode: "hang"}) }},
		{"a claim taken over by another holder", func() error { return publish("pay-steal", payment{Payment: 104, Mode: "steal"}) }},
	}
	for _, s := range steps {
		if err := s.do(); err != nil {
			return fmt.Errorf("%s: %w", s.what, err)
		}
		fmt.Fprintf(out, "provoked: %s\n", s.what)
	}
	fmt.Fprintf(out, "published %d messages; serving the metrics until interrupted\n", n)
	<-ctx.Done()
	if err := <-routerDone; err != nil {
		return err
	}
	return nil
}

// handle is the service's handler: it charges the payment through the
// effect, or provokes what the payment's mode asks for.
func handle(ctx context.Context, msg *message.Message, store stores.Store, charge, refund *effects.Effect) error {
	e, err := envelope.Parse(msg.Payload)
	if err != nil {
		return err
	}
	var p payment
	if err := json.Unmarshal(e.Data, &p); err != nil {
		return err
	}
	switch p.Mode {
	case "unknown": // the provider never answers: the outcome is unknown
		_, err := charge.Do(msg.Context(), p, func(context.Context, string) (effects.Outcome, error) {
			return effects.Unknown("the payment gateway timed out"), nil
		})
		return err
	case "exhaust": // a refund nobody can settle, parked past its limit
		_, err := refund.Do(msg.Context(), p, func(context.Context, string) (effects.Outcome, error) {
			return effects.Unknown("the refund gateway timed out"), nil
		})
		return err
	case "hang": // holds its claim until the service stops
		<-ctx.Done()
		return ctx.Err()
	case "steal": // another holder takes the claim while the handler runs
		d, _ := idempotency.DeliveryFromContext(msg.Context())
		bg := context.WithoutCancel(ctx)
		_ = store.Release(msg.Context(), d.Key)
		if ok, _, err := store.Claim(stores.WithClaimToken(bg, "another-holder"), d.Key, lease); err != nil || !ok {
			return errors.Join(errors.New("could not take the claim over"), err)
		}
		// On a store shared by processes (Redis, PostgreSQL) the claim's
		// renewal finds the loss and cancels the run; memstore, whose
		// claims die with the process, renews nothing and is asked when
		// the handler returns. Either way the delivery is counted as
		// claim_lost, publishes nothing and is not acked.
		select {
		case <-msg.Context().Done():
		case <-time.After(lease / 2):
		case <-ctx.Done():
		}
		return nil
	}
	_, err = charge.Do(msg.Context(), p, func(context.Context, string) (effects.Outcome, error) {
		return effects.Succeeded([]byte(fmt.Sprintf("ch_%d", p.Payment))), nil
	})
	return err
}
