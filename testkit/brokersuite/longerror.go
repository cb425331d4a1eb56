package brokersuite

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// upstreamErrorPage is an error as long as an upstream's HTML error page
// (about 70 KB, lines and all), the kind a handler wraps and returns.
func upstreamErrorPage() error {
	var b strings.Builder
	b.WriteString("charge: upstream answered 502: <!DOCTYPE html>\n<html><head><title>502 Bad Gateway</title></head><body>\n")
	for i := 0; b.Len() < 70<<10; i++ {
		fmt.Fprintf(&b, "<p class=\"trace\">frame %d: gateway → acquirer → issuer – «timeout» ✗</p>\n", i)
	}
	b.WriteString("</body></html>")
	return fmt.Errorf("%s", b.String())
}

// longErrorUnderTimeout: payments whose handler fails for good with a
// 70 KB error, under the README's wiring plus Watermill's Timeout between
// the dead-letter middleware and the guard, land on the dead-letter topic
// once each after Retry's 3 runs, with the error there (bounded); every
// delivery is acked and nothing runs again.
func longErrorUnderTimeout(t testing.TB, b Broker, s settings) {
	longErrorDeadLetters(t, b, s, 0)
}

// nearLimitOriginal: the same with originals that fill the broker's
// message limit but for 4 KiB. The dead letter carrying the whole bounded
// error does not fit; the broker refuses it, and the dead letter goes out
// again with the error cut short instead of the original coming back for
// ever.
func nearLimitOriginal(t testing.TB, b Broker, s settings) {
	longErrorDeadLetters(t, b, s, b.MaxMessage-4<<10)
}

// longErrorDeadLetters publishes originals of about size bytes (small
// ones for 0) that fail for good with a 70 KB error.
func longErrorDeadLetters(t testing.TB, b Broker, s settings, size int) {
	env := b.Setup(t)
	const n = 3
	fail := upstreamErrorPage()
	var mu sync.Mutex
	runs := map[string]int{}
	d := newDeliveries(t)
	r := newRouter(t)
	r.AddMiddleware(d.middleware)
	retry := middleware.Retry{MaxRetries: 2, InitialInterval: 5 * time.Millisecond,
		ShouldRetry: func(p middleware.RetryParams) bool { return idempotency.Retryable(p.Err) }}
	if s.withoutKit {
		r.AddMiddleware(middleware.Timeout(30*time.Second), retry.Middleware)
	} else {
		dlq, err := deadletter.Middleware(env.NewPublisher(t), deadletter.WithTopic(func(string) string { return env.DeadLetterTopic }))
		if err != nil {
			t.Fatal(err)
		}
		r.AddMiddleware(dlq, middleware.Timeout(30*time.Second), retry.Middleware, deadletter.CountAttempts, idempotency.Middleware(memstore.New()))
	}
	r.AddConsumerHandler("charge", env.Topic, env.NewSubscriber(t), func(msg *message.Message) error {
		mu.Lock()
		runs[idOf(msg)]++
		mu.Unlock()
		return fail
	})
	stop := testenv.RunRouter(t, r)
	var ids []string
	entries := n
	if size == 0 {
		ids, entries = testenv.PublishCopies(t, env.NewPublisher(t), env.Topic, job, n, func(int) int { return 1 })
	} else {
		ids = publishSized(t, env.NewPublisher(t), env.Topic, n, size)
	}
	report := func() string {
		mu.Lock()
		defer mu.Unlock()
		return fmt.Sprintf("runs per payment %v, %d deliveries acked, %d nacked", runs, d.acked.Load(), d.nacked.Load())
	}
	var dead []*message.Message
	s.eventually(t, fmt.Sprintf("%d dead letters on %s", n, env.DeadLetterTopic), func() bool {
		dead = env.Browse(t, env.DeadLetterTopic)
		return len(dead) >= n
	}, func() string { return fmt.Sprintf("%d found; %s", len(dead), report()) })
	s.eventually(t, "every delivery acked", func() bool { return d.acked.Load() >= int64(entries) }, report)
	s.drained(t, env, env.Topic)
	stop()
	if dead = env.Browse(t, env.DeadLetterTopic); len(dead) != n {
		t.Fatalf("%d dead letters, want %d; %s", len(dead), n, report())
	}
	for _, id := range ids {
		if runs[id] != 3 {
			t.Fatalf("payment %s ran %d times, want 3 (Retry's runs, then the dead letter); %s", id, runs[id], report())
		}
	}
	for _, msg := range dead {
		e, err := envelope.Parse(msg.Payload)
		if err != nil || e.DeadLetter == nil || e.DeadLetter.Error == nil {
			t.Fatalf("dead letter without its block (parse: %v): %.300s", err, msg.Payload)
		}
		dl := e.DeadLetter
		if dl.Reason != envelope.ReasonFailed || dl.Attempts != 3 || !strings.HasPrefix(*dl.Error, "charge: upstream answered 502") {
			t.Fatalf("dead letter %s: reason %q, %d attempts, error %.80q; want failed, 3 and the handler's error", e.Meta.ID, dl.Reason, dl.Attempts, *dl.Error)
		}
		// Laravel's layout carries no headers: the body alone says it.
		if h, ok := msg.Metadata[deadletter.MetadataError]; ok && !strings.HasPrefix(h, "charge: upstream answered 502") {
			t.Fatalf("dead letter %s: header %s = %.80q, want the start of the handler's error", e.Meta.ID, deadletter.MetadataError, h)
		}
	}
	t.Logf("%s: %d payments failing with a %d-byte error dead-lettered once each after 3 runs, in letters of %d bytes; error kept in %d bytes of body, %d of header",
		b.Name, n, len(fail.Error()), len(dead[0].Payload), len(*mustParse(t, dead[0]).DeadLetter.Error), len(dead[0].Metadata.Get(deadletter.MetadataError)))
}

func mustParse(t testing.TB, msg *message.Message) envelope.Envelope {
	e, err := envelope.Parse(msg.Payload)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// publishSized publishes n envelopes whose payloads are size bytes (a
// filler in their data), and returns their ids.
func publishSized(t testing.TB, pub message.Publisher, topic string, n, size int) []string {
	t.Helper()
	ids := make([]string, n)
	for i := range ids {
		e, err := envelope.New(job, map[string]any{"i": i, "filler": ""}, envelope.WithQueue(topic))
		if err != nil {
			t.Fatal(err)
		}
		small, err := e.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		e.Data = json.RawMessage(fmt.Sprintf(`{"i":%d,"filler":%q}`, i, strings.Repeat("x", max(size-len(small), 0))))
		payload, err := e.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			t.Fatalf("publish an original of %d bytes: %v", len(payload), err)
		}
		ids[i] = e.Meta.ID
	}
	return ids
}
