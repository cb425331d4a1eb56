package deadletter_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
	"github.com/babelqueue/watermill-idempotency/testkit/conformance"
)

// TestLongErrorsAreBounded: a handler error of 70 KB (an upstream's HTML
// page, multi-byte characters at every cut) is carried in the headers in
// at most MaxHeaderErrorBytes, on one line, and in the body in at most
// MaxBodyErrorBytes, both valid UTF-8, starting as the error does and
// ending with the marker and the full length. The brokers' own tests
// (testkit/brokersuite, LongErrorUnderTimeoutDeadLettersOnce) publish
// such a dead letter on RabbitMQ and NATS.
func TestLongErrorsAreBounded(t *testing.T) {
	t.Parallel()
	var b strings.Builder
	b.WriteString("charge: upstream 502:\r\n<html>")
	for b.Len() < 70<<10 {
		b.WriteString("é€𝄞\n")
	}
	long := b.String()
	h := newHarness(t, func(*message.Message) error { return errors.New(long) })
	if err := h.pubSub.Publish("orders", message.NewMessage(watermill.NewUUID(), conformance.Fixture(t, "order-created.json"))); err != nil {
		t.Fatal(err)
	}
	dead := h.next(t)
	e, err := envelope.Parse(dead.Payload)
	if err != nil || e.DeadLetter == nil || e.DeadLetter.Error == nil {
		t.Fatalf("dead letter %.200s (%v)", dead.Payload, err)
	}
	marker := deadletter.TruncatedMarker + "71" // 70 KB and a few bytes
	for _, c := range []struct {
		where, text string
		limit       int
		oneLine     bool
	}{
		{"header " + deadletter.MetadataError, dead.Metadata.Get(deadletter.MetadataError), deadletter.MaxHeaderErrorBytes, true},
		{"header " + middleware.ReasonForPoisonedKey, dead.Metadata.Get(middleware.ReasonForPoisonedKey), deadletter.MaxHeaderErrorBytes, true},
		{"dead_letter.error", *e.DeadLetter.Error, deadletter.MaxBodyErrorBytes, false},
	} {
		switch {
		case len(c.text) > c.limit || len(c.text) < c.limit-8:
			t.Errorf("%s: %d bytes, want at most %d and close to it", c.where, len(c.text), c.limit)
		case !utf8.ValidString(c.text):
			t.Errorf("%s: not valid UTF-8 (cut inside a character): %q", c.where, c.text[len(c.text)-60:])
		case !strings.HasPrefix(c.text, "charge: upstream 502:") || !strings.Contains(c.text, marker) || !strings.HasSuffix(c.text, " bytes in all]"):
			t.Errorf("%s: %.40q … %q, want the error's start and the marker %q with the full length", c.where, c.text, c.text[len(c.text)-60:], marker)
		case c.oneLine && strings.ContainsAny(c.text, "\r\n"):
			t.Errorf("%s: a line break in a header", c.where)
		case !c.oneLine && !strings.Contains(c.text, "\r\n<html>"):
			t.Errorf("%s: the body lost the error's line breaks", c.where)
		}
	}
}

// refusing is a publisher that refuses every message weighing more than
// limit bytes (payload and metadata), as a broker's message limit does,
// or every message when limit is 0 (a broker that is down).
type refusing struct {
	limit     int
	attempts  []int
	published []*message.Message
}

func (p *refusing) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		n := len(m.Payload)
		for k, v := range m.Metadata {
			n += len(k) + len(v)
		}
		p.attempts = append(p.attempts, n)
		if p.limit == 0 || n > p.limit {
			return fmt.Errorf("message of %d bytes refused", n)
		}
		p.published = append(p.published, m)
	}
	return nil
}

func (p *refusing) Close() error { return nil }

// TestRefusedDeadLetterGoesOutWithTheErrorCutShort: a dead letter the
// broker refuses because the handler's long error made it too large goes
// out again with the error cut to ShortErrorBytes (the delivery is then
// done); a short error refused, or a broker refusing everything, is not
// sent twice to no purpose and the delivery fails (nacked, back later).
func TestRefusedDeadLetterGoesOutWithTheErrorCutShort(t *testing.T) {
	t.Parallel()
	original := conformance.Fixture(t, "order-created.json")
	long := errors.New("charge: upstream 502: " + strings.Repeat("<p>gateway timeout</p>", 3000))
	for _, c := range []struct {
		name          string
		limit         int
		err           error
		wantAttempts  int
		wantPublished bool
	}{
		{"too large with the whole error", len(original) + 4<<10, long, 2, true},
		{"broker down, long error", 0, long, 2, false},
		{"broker down, short error", 0, errors.New("card declined"), 1, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			pub := &refusing{limit: c.limit}
			mw, err := deadletter.Middleware(pub, deadletter.WithLogger(watermill.NopLogger{}))
			if err != nil {
				t.Fatal(err)
			}
			_, got := mw(func(*message.Message) ([]*message.Message, error) { return nil, c.err })(message.NewMessage(watermill.NewUUID(), original))
			if len(pub.attempts) != c.wantAttempts || (len(pub.published) == 1) != c.wantPublished || (got == nil) != c.wantPublished {
				t.Fatalf("publish attempts %v (bytes), published %d, delivery error %v; want %d attempts, published %v",
					pub.attempts, len(pub.published), got, c.wantAttempts, c.wantPublished)
			}
			if !c.wantPublished {
				return
			}
			e, err := envelope.Parse(pub.published[0].Payload)
			if err != nil || e.DeadLetter == nil || len(*e.DeadLetter.Error) > deadletter.ShortErrorBytes ||
				len(pub.published[0].Metadata.Get(deadletter.MetadataError)) > deadletter.ShortErrorBytes ||
				!strings.Contains(*e.DeadLetter.Error, deadletter.TruncatedMarker) {
				t.Fatalf("the letter published again: %v, %.300s", err, pub.published[0].Payload)
			}
		})
	}
}
