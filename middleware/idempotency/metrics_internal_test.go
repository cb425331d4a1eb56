package idempotency

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// BenchmarkMetricsPerDelivery measures what metrics add to one delivery (one
// outcome counted, one store call timed): with no SDK installed (the global
// provider records nothing) and with an SDK and a reader.
func BenchmarkMetricsPerDelivery(b *testing.B) {
	ctx := context.Background()
	sdk := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	defer sdk.Shutdown(ctx)
	for name, mp := range map[string]*sdkmetric.MeterProvider{"no-sdk": nil, "sdk": sdk} {
		b.Run(name, func(b *testing.B) {
			var m *metrics
			var err error
			if mp == nil {
				m, err = newMetrics(nil)
			} else {
				m, err = newMetrics(mp)
			}
			if err != nil {
				b.Fatal(err)
			}
			o := observers{metrics: m}
			b.ReportAllocs()
			for b.Loop() {
				start := o.startStore(ctx)
				o.endStore(ctx, start, "charge", "seen")
				m.count(ctx, "charge", OutcomeSkip)
			}
		})
	}
}

// TestStandInTracerProvider: OpenTelemetry's global tracer provider, before
// a program installs one, is recognised as recording nothing (the
// middleware then starts no span and allocates nothing for tracing), as is
// a no-op provider, and an SDK's is not. No test of this package installs
// a global provider.
func TestStandInTracerProvider(t *testing.T) {
	t.Parallel()
	if !standIn(otel.GetTracerProvider()) {
		t.Fatalf("the global provider's stand-in (%T) is not recognised: every delivery would pay for spans nobody records", otel.GetTracerProvider())
	}
	if !standIn(noop.NewTracerProvider()) {
		t.Fatal("a no-op provider is not recognised")
	}
	if standIn(sdktrace.NewTracerProvider()) {
		t.Fatal("the SDK's provider is taken for a stand-in")
	}
}
