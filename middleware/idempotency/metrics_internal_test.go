package idempotency

import (
	"context"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
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
			b.ReportAllocs()
			for b.Loop() {
				start := m.startStore(ctx)
				m.endStore(ctx, start, "charge", "seen")
				m.count(ctx, "charge", OutcomeSkip)
			}
		})
	}
}
