package idempotencytest_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.uber.org/goleak"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency/idempotencytest"
)

// Every harness closes what it started: no goroutine outlives the tests.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func payment(id string) []byte {
	return idempotencytest.MustEnvelope("urn:babel:payments:requested", map[string]any{"order_id": id}, envelope.WithID(id))
}

// waitFor polls cond until it holds, failing the test with what it saw
// when it still does not after a deadline.
func waitFor(t *testing.T, what string, cond func() (bool, any)) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ok, saw := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: still not so after 10s; saw %v", what, saw)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Two copies of one message delivered at once: one runs, the other waits
// for it, is parked while it holds the claim, and is skipped once it is
// done. The handler runs once.
func TestConcurrentCopiesParkThenSkip(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	var runs atomic.Int32
	h := idempotencytest.New(t, func(*message.Message) error {
		runs.Add(1)
		<-release
		return nil
	}, idempotencytest.WithMiddlewareOptions(idempotency.WithParkWait(time.Millisecond)))
	p := payment("payment-7")
	done := make(chan []idempotencytest.Result, 1)
	go func() { done <- h.DeliverAll(p, p) }()
	waitFor(t, "a copy parked", func() (bool, any) {
		rs := h.Results()
		return len(rs) == 2 && (rs[0].Parked > 0 || rs[1].Parked > 0), rs
	})
	// While parked and unfinished, the copy shows as Parked: once its
	// delivery returned ErrInFlight, which comes a moment after the park
	// counted above (a loaded machine can make that moment long).
	waitFor(t, "a copy was parked, and one shows as Parked", func() (bool, any) {
		rs := h.Results()
		for _, r := range rs {
			if r.Outcome == idempotencytest.Parked && errors.Is(r.Err, idempotency.ErrInFlight) {
				return true, rs
			}
		}
		return false, rs
	})
	close(release)
	rs := <-done
	outcomes := map[idempotencytest.Outcome]int{}
	for _, r := range rs {
		outcomes[r.Outcome]++
		if r.ID != "payment-7" {
			t.Errorf("id %q, want payment-7", r.ID)
		}
	}
	if outcomes[idempotencytest.Ran] != 1 || outcomes[idempotencytest.Skipped] != 1 || runs.Load() != 1 {
		t.Fatalf("want one ran and one skipped, the handler run once; got %v, %d run(s)", rs, runs.Load())
	}
	for _, r := range rs {
		if r.Outcome == idempotencytest.Skipped && (r.Parked == 0 || r.Deliveries < 1 || r.Runs != 0) {
			t.Errorf("the skipped copy: %v; want parked at least once, no run", r)
		}
	}
}

// A message the middleware refuses (an unknown schema_version) is rejected
// without running the handler and goes to the dead-letter topic.
func TestRejected(t *testing.T) {
	t.Parallel()
	h := idempotencytest.New(t, func(*message.Message) error {
		t.Error("the handler ran on a rejected message")
		return nil
	})
	r := h.Deliver([]byte(`{"job":"urn:babel:payments:requested","data":{},"meta":{"id":"payment-9","schema_version":2}}`))
	if r.Outcome != idempotencytest.Rejected || r.Runs != 0 || r.DeadLetter == nil || !idempotency.IsPermanent(r.Err) || r.ID != "payment-9" {
		t.Fatalf("got %v, want rejected, no run, dead-lettered with a permanent error", r)
	}
	if got := r.DeadLetter.Metadata.Get(deadletter.MetadataReason); got != "poison" {
		t.Errorf("dead-letter reason %q, want poison", got)
	}
}

var errDeclined = errors.New("card declined")

// A handler that fails, then succeeds on a retry, ran; one that panics
// every time is dead-lettered after its retries, with the panic as error.
func TestRetriesAndPanics(t *testing.T) {
	t.Parallel()
	var calls atomic.Int32
	h := idempotencytest.New(t, func(msg *message.Message) error {
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			return err
		}
		switch e.Meta.ID {
		case "panics":
			panic("boom")
		case "declined":
			return errDeclined
		}
		if calls.Add(1) == 1 {
			return errors.New("flaky")
		}
		return nil
	}, idempotencytest.WithRetries(2, time.Millisecond))
	flaky := h.Deliver(payment("flaky"))
	if flaky.Outcome != idempotencytest.Ran || flaky.Runs != 2 || flaky.Err != nil {
		t.Errorf("flaky: %v, want ran after 2 runs", flaky)
	}
	panics := h.Deliver(payment("panics"))
	if panics.Outcome != idempotencytest.DeadLettered || panics.Runs != 3 || panics.Err == nil || !strings.Contains(panics.Err.Error(), "boom") {
		t.Errorf("panics: %v, want dead-lettered after 3 runs, the panic as error", panics)
	}
	if got := panics.DeadLetter.Metadata.Get(deadletter.MetadataReason); got != "failed" {
		t.Errorf("dead-letter reason %q, want failed", got)
	}
	declined := h.Deliver(payment("declined"))
	if declined.Outcome != idempotencytest.DeadLettered || declined.Runs != 3 || !errors.Is(declined.Err, errDeclined) {
		t.Errorf("declined: %v, want dead-lettered after 3 runs with the handler's error", declined)
	}
	if rs := h.Results(); len(rs) != 3 || rs[0].Outcome != flaky.Outcome || rs[1].Outcome != panics.Outcome {
		t.Errorf("Results: %v", rs)
	}
}

// A handler still running when the wait ends: Deliver returns Unfinished,
// saying why; Close then waits for the handler and stops everything, and a
// second Close does nothing.
func TestUnfinishedAndClose(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	h, err := idempotencytest.Start(context.Background(), func(*message.Message) error {
		<-release
		return nil
	}, idempotencytest.WithTimeout(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	r := h.Deliver(payment("slow"))
	if r.Outcome != idempotencytest.Unfinished || r.Err == nil || !strings.Contains(r.Err.Error(), "no outcome within 50ms") {
		t.Errorf("got %v, want unfinished: no outcome within 50ms", r)
	}
	close(release)
	waitFor(t, "the slow message ran", func() (bool, any) {
		rs := h.Results()
		return rs[0].Outcome == idempotencytest.Ran, rs
	})
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if err := h.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if r := h.Deliver(payment("after")); r.Outcome != idempotencytest.Unfinished || r.Err == nil || !strings.Contains(r.Err.Error(), "publish") {
		t.Errorf("after Close: %v, want unfinished with the reason", r)
	}
}

// The store and the middleware's options are the test's: a message whose
// record the test wrote beforehand is skipped.
func TestPlainMessageWithKeySource(t *testing.T) {
	t.Parallel()
	h := idempotencytest.New(t, func(*message.Message) error { return nil },
		idempotencytest.WithHandlerName("charge"),
		idempotencytest.WithMiddlewareOptions(idempotency.WithKeySource(idempotency.KeyFromMetadata("order"))))
	msg := func() *message.Message {
		m := message.NewMessage("uuid-1", []byte("plain"))
		m.Metadata.Set("order", "o-1")
		return m
	}
	first, again := h.DeliverMessage(msg()), h.DeliverMessage(msg())
	if first.Outcome != idempotencytest.Ran || again.Outcome != idempotencytest.Skipped || first.ID != "o-1" {
		t.Fatalf("first %v, again %v; want ran then skipped, id o-1", first, again)
	}
}
