// Package deadletter is Watermill router middleware that moves a message
// whose handling failed for good to a dead-letter topic, as a plain
// BabelQueue envelope any SDK can read: the original job, trace_id, data,
// meta and unknown fields, plus a dead_letter block (reason,
// error, exception, failed_at, original_queue, attempts, lang "go").
//
// Put it outside the idempotency middleware, which retries a failing
// message in place within its budget (idempotency.WithRetries), so that
// the errors it sees are final:
//
//	dlq, _ := deadletter.Middleware(publisher)
//	router.AddMiddleware(
//		dlq,
//		idempotency.Middleware(store, idempotency.WithRetries(idempotency.Retries{Max: 3})),
//	)
//
// dead_letter.attempts then counts the message's runs across deliveries
// (idempotency.Attempts). Once the dead letter is published, the original
// is acked and the middleware notes on it where the letter went
// (envelope.MetadataDeadLetterTopic and envelope.MetadataDeadLetterReason):
// the idempotency middleware remembers the message's end with them, so
// that a redelivery of it is acked without running and without a second
// dead letter.
//
// With Watermill's Retry instead (the wiring before budgets), put this
// middleware outside Retry and CountAttempts inside it, so that
// dead_letter.attempts counts the runs of the delivery:
//
//	router.AddMiddleware(
//		dlq,
//		middleware.Retry{MaxRetries: 3, InitialInterval: 100 * time.Millisecond,
//			ShouldRetry: func(p middleware.RetryParams) bool { return idempotency.Retryable(p.Err) }}.Middleware,
//		deadletter.CountAttempts,
//		idempotency.Middleware(store),
//	)
//
// Watermill's Timeout may go anywhere inside the middleware; inside Retry,
// set Retry's ResetContextOnRetry, or Watermill runs the later attempts on
// the context the first attempt's Timeout cancelled (they fail as
// interrupted and the message comes back for ever).
//
// A dead-lettered message is published to "<topic>.dlq" (WithTopic) and the
// original is acked. If publishing fails, the original is nacked and comes
// back. Transient failures (idempotency.IsTransient: the store is down, or
// another delivery holds the message's claim) and failures of a delivery
// whose context was cancelled (the consumer is shutting down; Retry then
// returns context.Canceled) are never dead-lettered. That context is the one
// the delivery came in with: a context a middleware inside installed and
// cancelled on its way out (Watermill's Timeout does) is not a shutdown, nor
// is a deadline that passed (a Timeout outside): a handler cut by a timeout
// failed like any other: they propagate, the original
// is nacked and the broker redelivers it. A body that is not a valid envelope is dead-lettered verbatim, with
// the reason in metadata: nothing is dropped. Watermill's poison metadata
// keys are set as well, so Watermill tooling understands the message.
//
// Each dead-lettered message is logged at warning (through slog.Default()
// unless WithLogger says otherwise) and counted in MetricMessages by topic
// and reason; a dead letter that could not be published is logged at error
// and counted in MetricPublishFailures.
//
// A dead-letter topic the broker would refuse (a JetStream stream name
// with a dot, a Kafka topic that does not exist where topics are not
// created on publish) turns every final failure into a redelivery. With a
// TopicChecker (the publisher, or WithTopicCheck) the middleware checks
// each dead-letter topic, creating it where that is allowed, before the
// first message of its topic is handled; CheckOnSubscribe does it when the
// router subscribes, so that Router.Run fails with the reason. A topic
// whose dead-letter topic fails its check is not handled (its deliveries
// go back to the broker, one check every WithTopicRecheck), and each
// failed check is counted in MetricTopicCheckFailures and logged at error.
package deadletter

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/internal/kitlog"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
)

// Metadata keys set on every dead-lettered message, envelope or not.
const (
	// MetadataReason holds the dead_letter reason.
	MetadataReason = envelope.MetadataDeadLetterReason
	// MetadataError holds the handler's error text.
	MetadataError = "bq-dead-letter-error"
	// MetadataOriginalTopic holds the topic the message was consumed from.
	MetadataOriginalTopic = "bq-dead-letter-original-topic"
	// MetadataVerbatim is "1" when the body is not a valid envelope and was
	// dead-lettered unchanged.
	MetadataVerbatim = "bq-dead-letter-verbatim"
)

// Bounds of the handler's error text a dead letter carries. A handler may
// fail with a whole upstream error page; headers are limited by every broker
// (RabbitMQ drops the connection when a message's headers outgrow its
// frame_max, 128 KiB by default; NATS and Kafka bound a whole message to
// 1 MB by default), and a dead letter that cannot be published sends the
// original back for ever. Longer text is cut at a character boundary and
// ends with TruncatedMarker and the full length.
const (
	// MaxHeaderErrorBytes bounds the error text in MetadataError and in
	// Watermill's ReasonForPoisonedKey: one line (line breaks and other
	// control characters become spaces), valid UTF-8.
	MaxHeaderErrorBytes = 4 << 10
	// MaxBodyErrorBytes bounds dead_letter.error in the body.
	MaxBodyErrorBytes = 32 << 10
	// ShortErrorBytes bounds the error text, in the headers and in the
	// body, of the dead letter published again when the broker refused
	// the first one (a message limit the original nearly filled: NATS's
	// max_payload, Kafka's message.max.bytes).
	ShortErrorBytes = 512
	// TruncatedMarker starts the note ending an error text that was cut,
	// e.g. "… [truncated: 71680 bytes in all]".
	TruncatedMarker = "… [truncated: "
)

// ErrUnknownURN is what a handler returns (wrapped or not) for a message
// whose URN it has no handler for; such a message is dead-lettered with the
// reason envelope.ReasonUnknownURN.
var ErrUnknownURN = errors.New("no handler for the message's URN")

// ErrNoPublisher is returned by Middleware without a publisher.
var ErrNoPublisher = errors.New("deadletter: nil publisher")

// Option configures the middleware.
type Option func(*config)

type config struct {
	topic         func(original string) string
	filter        func(error) bool
	reason        func(error) string
	now           func() time.Time
	logger        watermill.LoggerAdapter
	meterProvider metric.MeterProvider
	checker       TopicChecker
	checkerSet    bool // WithTopicCheck was given, maybe nil
	recheck       time.Duration
}

// newConfigFor returns the configuration opts make for a middleware
// publishing with pub: its defaults, and pub as the topic checker when it
// is one and WithTopicCheck did not say otherwise.
func newConfigFor(pub message.Publisher, opts []Option) config {
	c := config{
		topic:   func(original string) string { return original + ".dlq" },
		filter:  func(error) bool { return true },
		reason:  Reason,
		now:     time.Now,
		logger:  kitlog.Default(),
		recheck: DefaultTopicRecheck,
	}
	for _, opt := range opts {
		opt(&c)
	}
	if checker, ok := pub.(TopicChecker); ok && !c.checkerSet {
		c.checker = checker
	}
	return c
}

func (c config) meter() metric.Meter {
	mp := c.meterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	return mp.Meter("github.com/babelqueue/watermill-idempotency/middleware/deadletter")
}

// topicChecks returns the checks of dead-letter topics, nil without a
// checker.
func (c config) topicChecks() (*topicChecks, error) {
	if c.checker == nil {
		return nil, nil
	}
	failures, err := c.meter().Int64Counter(MetricTopicCheckFailures, metric.WithUnit("{check}"),
		metric.WithDescription("Failed checks of a dead-letter topic: its topic's messages are not handled."))
	if err != nil {
		return nil, fmt.Errorf("deadletter: metric %s: %w", MetricTopicCheckFailures, err)
	}
	return newTopicChecks(c.checker, c.logger, failures, c.recheck), nil
}

// MetricMessages counts the messages dead-lettered, by "topic" (the topic
// consumed from) and "reason" (the dead_letter reason), recorded with the
// OpenTelemetry metric API.
const MetricMessages = "bq.deadletter.messages"

// WithLogger sets where the middleware logs: each message it dead-letters
// at warning (its UUID, meta.id, topics, reason and error), a dead letter
// it could not publish at error. Watermill's adapters have no warning
// level: warnings go to their Error. Without WithLogger (or with a nil
// logger) it logs through slog.Default(), read at each line;
// WithLogger(watermill.NopLogger{}) silences it.
func WithLogger(logger watermill.LoggerAdapter) Option {
	return func(c *config) { c.logger = kitlog.Or(logger) }
}

// WithMeterProvider records MetricMessages with mp instead of the global
// meter provider.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) { c.meterProvider = mp }
}

// WithTopic sets the dead-letter topic for a topic consumed from (default:
// the topic with ".dlq" appended).
func WithTopic(topic func(original string) string) Option {
	return func(c *config) { c.topic = topic }
}

// WithFilter limits dead-lettering to the errors filter accepts; the others
// propagate (nack). By default every error reaching the middleware is
// dead-lettered, since it sits outside Retry, except the transient ones
// (idempotency.IsTransient) and those of a delivery whose context is done
// (shutdown): a store outage, a parked concurrent duplicate or an
// interrupted delivery always propagates, whatever the filter, so that the
// broker redelivers the message once the fault passed.
func WithFilter(filter func(error) bool) Option {
	return func(c *config) { c.filter = filter }
}

// WithReason replaces the classification of errors into dead_letter
// reasons (default: Reason).
func WithReason(reason func(error) string) Option {
	return func(c *config) { c.reason = reason }
}

// Reason is the default classification, one reason per cause (checked in
// this order):
//
//   - envelope.ReasonUnknownURN: the error matches ErrUnknownURN;
//   - the reason an error in the chain names with a method
//     DeadLetterReason() string: effects.ErrUnknownOutcome names
//     envelope.ReasonUnknownOutcome (a charge whose reply was lost, parked
//     until Retry gave up, its budget exhausted, or dead-lettered by its
//     policy), effects.ErrPayloadConflict envelope.ReasonConflict;
//   - envelope.ReasonConflict: the message's identity was used for another
//     intent (idempotency.ErrConflict);
//   - envelope.ReasonTooOld: older than the replay horizon
//     (idempotency.ErrTooOld);
//   - envelope.ReasonPoison: the message cannot be read (envelope.ErrInvalid,
//     idempotency.ErrUnsupportedSchemaVersion, ErrInvalidID, ErrNoIdentity,
//     ErrUndecryptable);
//   - envelope.ReasonRejected: any other permanent error
//     (idempotency.IsPermanent), such as a handler's own rejection;
//   - envelope.ReasonFailed: everything else (the handler failed after
//     Retry's runs).
//
// BabelQueue SDKs know failed, unknown_urn and poison; where a reader of the
// dead-letter topic must see only those, use WithReason(CoarseReason).
func Reason(err error) string {
	var named interface{ DeadLetterReason() string }
	switch {
	case errors.Is(err, ErrUnknownURN):
		return envelope.ReasonUnknownURN
	case errors.As(err, &named) && named.DeadLetterReason() != "":
		return named.DeadLetterReason()
	case errors.Is(err, idempotency.ErrConflict):
		return envelope.ReasonConflict
	case errors.Is(err, idempotency.ErrTooOld):
		return envelope.ReasonTooOld
	case errors.Is(err, envelope.ErrInvalid), errors.Is(err, envelope.ErrUnsupportedSchemaVersion),
		errors.Is(err, idempotency.ErrInvalidID), errors.Is(err, idempotency.ErrNoIdentity),
		errors.Is(err, idempotency.ErrUndecryptable):
		return envelope.ReasonPoison
	case idempotency.IsPermanent(err):
		return envelope.ReasonRejected
	}
	return envelope.ReasonFailed
}

// CoarseReason classifies err into the three reasons every BabelQueue SDK
// knows, for a fleet whose dead-letter readers accept no other: what Reason
// calls failed and unknown_urn stay so, and everything a redrive in bulk must
// not take (conflict, too_old, rejected, and unknown_outcome, which an
// operator settles first) is poison, as it was before the finer reasons.
func CoarseReason(err error) string {
	switch r := Reason(err); r {
	case envelope.ReasonUnknownURN, envelope.ReasonFailed:
		return r
	}
	return envelope.ReasonPoison
}

// Middleware returns the dead-letter middleware publishing with pub.
func Middleware(pub message.Publisher, opts ...Option) (message.HandlerMiddleware, error) {
	if pub == nil {
		return nil, ErrNoPublisher
	}
	c := newConfigFor(pub, opts)
	meter := c.meter()
	dead, err := meter.Int64Counter(MetricMessages,
		metric.WithUnit("{message}"), metric.WithDescription("Messages moved to a dead-letter topic, by reason."))
	if err != nil {
		return nil, fmt.Errorf("deadletter: metric %s: %w", MetricMessages, err)
	}
	publishFailures, err := meter.Int64Counter(MetricPublishFailures, metric.WithUnit("{message}"),
		metric.WithDescription("Dead letters that could not be published: the original went back to the broker."))
	if err != nil {
		return nil, fmt.Errorf("deadletter: metric %s: %w", MetricPublishFailures, err)
	}
	checks, err := c.topicChecks()
	if err != nil {
		return nil, err
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if checks != nil {
				// Before the topic's first message is handled: a failure
				// could not be dead-lettered.
				original := message.SubscribeTopicFromCtx(msg.Context())
				if err := checks.ensure(msg.Context(), original, c.topic(original), true); err != nil {
					return nil, err
				}
			}
			runs := new(atomic.Int32)
			// The delivery's own context, as it came in: middleware inside
			// (Watermill's Timeout) installs contexts of its own and cancels
			// them when it returns, which says nothing of a shutdown.
			delivery := context.WithValue(msg.Context(), attemptsKey{}, runs)
			msg.SetContext(delivery)
			produced, err := h(msg)
			// A delivery interrupted by shutdown (its context cancelled) did
			// not fail for good, nor did one that met a transient fault. A
			// deadline on the delivery (a Timeout outside) that passed is a
			// failure like any other.
			if err == nil || idempotency.IsTransient(err) || errors.Is(delivery.Err(), context.Canceled) || !c.filter(err) {
				return produced, err
			}
			msg.SetContext(delivery)
			original := message.SubscribeTopicFromCtx(delivery)
			letter, buildErr := c.build(msg, err, original, int(runs.Load()), MaxHeaderErrorBytes, MaxBodyErrorBytes)
			if buildErr != nil {
				return nil, errors.Join(err, buildErr)
			}
			to := c.topic(original)
			reason := letter.Metadata.Get(MetadataReason)
			fields := watermill.LogFields{"message_uuid": msg.UUID, "message_id": letter.Metadata.Get(envelope.MetadataMessageID),
				"topic": original, "dead_letter_topic": to, "reason": reason, "handler": message.HandlerNameFromCtx(msg.Context())}
			if pubErr := c.publish(pub, to, letter, func() (*message.Message, error) {
				return c.build(msg, err, original, int(runs.Load()), ShortErrorBytes, ShortErrorBytes)
			}, fields); pubErr != nil {
				if ctx := msg.Context(); publishFailures.Enabled(ctx) {
					publishFailures.Add(ctx, 1, metric.WithAttributes(attribute.String("topic", original), attribute.String("dead_letter_topic", to)))
				}
				c.logger.Error("Could not publish a dead letter; the message is nacked and comes back", pubErr, fields)
				return nil, errors.Join(err, pubErr)
			}
			// The original tells the idempotency middleware, which remembers
			// the message's end once the router acked it, where it went.
			msg.Metadata.Set(envelope.MetadataDeadLetterTopic, to)
			msg.Metadata.Set(envelope.MetadataDeadLetterReason, reason)
			// Counted before it is logged: whoever reads the line finds it
			// counted.
			if ctx := msg.Context(); dead.Enabled(ctx) {
				dead.Add(ctx, 1, metric.WithAttributes(attribute.String("topic", original), attribute.String("reason", reason)))
			}
			kitlog.Warn(c.logger, "Message dead-lettered", err, fields)
			return nil, nil
		}
	}, nil
}

type attemptsKey struct{}

// CountAttempts counts the runs of the handler it wraps for a delivery, so
// that Middleware can report them in dead_letter.attempts. Put it inside
// Retry; without it a delivery counts as one run.
func CountAttempts(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if runs, ok := msg.Context().Value(attemptsKey{}).(*atomic.Int32); ok {
			runs.Add(1)
		}
		return h(msg)
	}
}

// publish publishes letter to topic. When the broker refuses it and the
// handler's error made it longer than short would be (a message limit
// the original nearly filled, which no redelivery changes), it publishes
// short's letter instead, the error cut to ShortErrorBytes, rather than
// send the original back for ever. A letter short would not make smaller
// is not sent twice: the refusal was not its size.
func (c config) publish(pub message.Publisher, topic string, letter *message.Message, short func() (*message.Message, error), fields watermill.LogFields) error {
	first := pub.Publish(topic, letter)
	if first == nil {
		return nil
	}
	first = fmt.Errorf("deadletter: publish to %s: %w", topic, first)
	smaller, err := short()
	if err != nil {
		return errors.Join(first, err)
	}
	if size(smaller) >= size(letter) {
		return first
	}
	if err := pub.Publish(topic, smaller); err != nil {
		return errors.Join(first, fmt.Errorf("deadletter: publish to %s with the error cut to %d bytes: %w", topic, ShortErrorBytes, err))
	}
	c.logger.Info("Dead letter published with the error cut short, the broker refused the whole one", fields.Add(watermill.LogFields{
		"refused": first.Error(), "refused_bytes": size(letter), "published_bytes": size(smaller)}))
	return nil
}

// size is what a message weighs on the wire, near enough: its payload and
// its metadata.
func size(msg *message.Message) int {
	n := len(msg.Payload)
	for k, v := range msg.Metadata {
		n += len(k) + len(v)
	}
	return n
}

// build makes the dead-letter message for msg failed with err, its error
// text bounded to headerLimit bytes in the headers and bodyLimit in the
// body.
func (c config) build(msg *message.Message, err error, original string, runs, headerLimit, bodyLimit int) (*message.Message, error) {
	reason := c.reason(err)
	dead := message.NewMessage(msg.UUID, msg.Payload)
	for k, v := range msg.Metadata {
		if !envelope.TransportHeader(k) { // out-of-band headers travel; the hop's own do not
			dead.Metadata.Set(k, v)
		}
	}
	full := err.Error()
	header := boundErrorText(strings.Map(oneLine, full), headerLimit, len(full))
	dead.Metadata.Set(MetadataReason, reason)
	dead.Metadata.Set(MetadataError, header)
	dead.Metadata.Set(MetadataOriginalTopic, original)
	dead.Metadata.Set(middleware.ReasonForPoisonedKey, header)
	dead.Metadata.Set(middleware.PoisonedTopicKey, original)
	dead.Metadata.Set(middleware.PoisonedHandlerKey, message.HandlerNameFromCtx(msg.Context()))
	dead.Metadata.Set(middleware.PoisonedSubscriberKey, message.SubscriberNameFromCtx(msg.Context()))

	e, parseErr := envelope.Parse(msg.Payload)
	if parseErr != nil {
		dead.Metadata.Set(MetadataVerbatim, "1")
		return dead, nil
	}
	attempts := e.Attempts
	if counted, ok := idempotency.Attempts(err); ok {
		runs = counted // the guard's count, across deliveries (WithRetries)
	}
	if add := max(runs, 1); attempts <= math.MaxInt-add {
		attempts += add
	} else {
		attempts = math.MaxInt // saturates: a wrapped count would be negative
	}
	errText, exception := boundErrorText(full, bodyLimit, len(full)), exceptionName(err)
	e.Attempts = attempts
	e.DeadLetter = &envelope.DeadLetter{
		Reason:        reason,
		Error:         &errText,
		Exception:     &exception,
		FailedAt:      c.now().UnixMilli(),
		OriginalQueue: original,
		Attempts:      attempts,
		Lang:          envelope.Lang,
	}
	payload, marshalErr := e.Marshal()
	if marshalErr != nil {
		return nil, fmt.Errorf("deadletter: encode envelope: %w", marshalErr)
	}
	dead.Payload = payload
	dead.Metadata.Set(envelope.MetadataMessageID, e.Meta.ID)
	dead.Metadata.Set(envelope.MetadataTraceID, e.TraceID)
	dead.Metadata.Set(envelope.MetadataJob, e.Job)
	return dead, nil
}

// oneLine maps the control characters of an error text to spaces, for a
// header (NATS headers, like HTTP's, end at a line break).
func oneLine(r rune) rune {
	if unicode.IsControl(r) {
		return ' '
	}
	return r
}

// boundErrorText returns text as valid UTF-8 of at most limit bytes: cut
// at a character boundary and ended with TruncatedMarker and total (the
// length of the original error) when it is longer.
func boundErrorText(text string, limit, total int) string {
	text = strings.ToValidUTF8(text, "\uFFFD")
	if len(text) <= limit {
		return text
	}
	note := TruncatedMarker + strconv.Itoa(total) + " bytes in all]"
	cut := max(limit-len(note), 0)
	for cut > 0 && !utf8.RuneStart(text[cut]) {
		cut--
	}
	return text[:cut] + note
}

// exceptionName names the Go type of the innermost error of err's first
// chain, the nearest thing Go has to an exception class.
func exceptionName(err error) string {
	for {
		var next error
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			next = u.Unwrap()
		case interface{ Unwrap() []error }:
			if errs := u.Unwrap(); len(errs) > 0 {
				next = errs[0]
			}
		}
		if next == nil {
			return fmt.Sprintf("%T", err)
		}
		err = next
	}
}
