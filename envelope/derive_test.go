package envelope_test

import (
	"reflect"
	"testing"

	"github.com/babelqueue/watermill-idempotency/envelope"
)

func TestCarriedHeaders(t *testing.T) {
	got := envelope.CarriedHeaders(map[string]string{
		"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "k=v",
		envelope.MetadataReplayBypass: "1", "tenant": "eu", "blank": " ", " ": "x",
		envelope.MetadataMessageID: "m", envelope.MetadataTraceID: "t", envelope.MetadataJob: "j",
		"x-attempts": "2", "x-schema-version": "1", "x-source-lang": "php",
		"bq-attempts": "2", "bq-schema-version": "1", "bq-source-lang": "php", "bq-created-at": "1",
		"_watermill_redelivered": "true", "bq-dead-letter-reason": "failed", "reason_poisoned": "x", "topic_poisoned": "orders",
	})
	want := map[string]string{
		"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "k=v",
		envelope.MetadataReplayBypass: "1", "tenant": "eu",
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("CarriedHeaders = %v, want %v", got, want)
	}
	if envelope.CarriedHeaders(map[string]string{"x-attempts": "0"}) != nil || envelope.CarriedHeaders(nil) != nil {
		t.Fatal("want nil when nothing travels")
	}
}
