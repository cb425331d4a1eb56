package idempotency_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestLogsWithoutConfiguration: a Guard built without WithLogger logs
// through slog.Default() as it is when each line is written (the default is
// replaced after the Guard was built), at the level each decision deserves;
// WithLogger(watermill.NopLogger{}) is silent. It replaces the process's
// slog default: not parallel.
func TestLogsWithoutConfiguration(t *testing.T) {
	h := idempotency.Middleware(memstore.New())(counting(new(int), nil))
	quiet := idempotency.Middleware(memstore.New(), idempotency.WithLogger(watermill.NopLogger{}))(counting(new(int), nil))
	logs := testenv.CaptureSlog(t)

	deliver := func(h message.HandlerFunc, msg *message.Message) {
		t.Helper()
		_, _ = h(msg.Copy())
	}
	levels := func(key, value string) []string {
		t.Helper()
		var out []string
		for _, line := range logs.Where(t, key, value) {
			out = append(out, line["level"].(string)+" "+line["decision"].(string))
		}
		return out
	}
	expect := func(what string, got []string, want ...string) {
		t.Helper()
		if len(got) != len(want) {
			t.Fatalf("%s: logged %q, want %q; every line:\n%s", what, got, want, logs)
		}
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("%s: logged %q, want %q; every line:\n%s", what, got, want, logs)
			}
		}
	}

	// Run, then a duplicate: the run is not logged, the skip at debug.
	dup := msgOf(envelopeWithID(t, "logs-dup"))
	deliver(h, dup)
	deliver(h, dup)
	expect("duplicate", levels("message_id", "logs-dup"), "DEBUG skip")

	// The same meta.id with other content: a conflict, at warning.
	other := []byte(`{"job":"urn:babel:orders:created","trace_id":"t","data":{"order_id":7},"meta":{"id":"logs-dup","schema_version":1},"attempts":0}`)
	conflict := msgOf(other)
	deliver(h, conflict)
	expect("conflict", levels("message_uuid", conflict.UUID), "WARN conflict")

	// An envelope of a schema this version cannot read: rejected, at
	// warning, with the error.
	reject := msgOf([]byte(`{"job":"j","trace_id":"t","data":{},"meta":{"id":"logs-reject","schema_version":2},"attempts":0}`))
	deliver(h, reject)
	expect("reject", levels("message_uuid", reject.UUID), "WARN reject")
	if line := logs.Where(t, "message_uuid", reject.UUID)[0]; line["error"] == nil {
		t.Fatalf("the rejection's line has no error: %v", line)
	}

	// A message without identity, delivered three times: info once, then
	// debug (a redelivery storm is not a storm of lines).
	plain := message.NewMessage(watermill.NewUUID(), []byte("plain text"))
	for range 3 {
		deliver(h, plain)
	}
	expect("fail open", levels("message_uuid", plain.UUID), "INFO fail_open", "DEBUG fail_open", "DEBUG fail_open")

	// Silence is asked for.
	silent := message.NewMessage(watermill.NewUUID(), []byte(`{"job":"j","trace_id":"t","data":{},"meta":{"id":"x","schema_version":2},"attempts":0}`))
	deliver(quiet, silent)
	expect("WithLogger(watermill.NopLogger{})", levels("message_uuid", silent.UUID))
}

// TestAStoreOutageIsLoggedOnceWithACount: deliveries that fail because the
// store is down are logged once (then once per period, with the count in
// between), not once per redelivery, and the store's return is logged
// with how many deliveries the outage failed. It replaces the process's
// slog default: not parallel.
func TestAStoreOutageIsLoggedOnceWithACount(t *testing.T) {
	store := &faultyStore{Store: memstore.New(), failClaim: errors.New("dial tcp 127.0.0.1:6379: connect: connection refused")}
	h := idempotency.Middleware(store)(counting(new(int), nil))
	logs := testenv.CaptureSlog(t)
	for i := range 20 {
		_, _ = h(msgOf(envelopeWithID(t, fmt.Sprintf("outage-%d", i))))
	}
	if lines := logs.Where(t, "decision", string(idempotency.OutcomeStoreError)); len(lines) != 1 {
		t.Fatalf("20 deliveries failed by one outage logged %d lines, want 1:\n%s", len(lines), logs)
	}
	store.failClaim = nil
	if _, err := h(msgOf(envelopeWithID(t, "outage-over"))); err != nil {
		t.Fatal(err)
	}
	back := logs.Where(t, "msg", "Idempotency store answers again")
	if len(back) != 1 || back[0]["failed_deliveries"] != float64(20) {
		t.Fatalf("the store's return logged %v, want one line counting 20 failed deliveries:\n%s", back, logs)
	}
}
