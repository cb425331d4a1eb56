// Package redrive moves dead-lettered BabelQueue messages from a
// dead-letter topic back to where they came from, once the fault that sent
// them there is fixed. It works with any Watermill subscriber and publisher.
//
//	report, err := redrive.Run(ctx, subscriber, publisher, "orders.dlq",
//		redrive.WithReasons(envelope.ReasonFailed), redrive.WithMax(500))
//
// Each redriven message goes to its dead_letter.original_queue (or the topic
// of WithTarget) with the dead_letter block stripped and attempts reset to 0;
// job, trace_id, data, meta (so its identity) and unknown fields are kept. A
// dead-letter message is acked only after its re-publication succeeded, so an
// interrupted run loses nothing: at worst a message is published twice, and
// the idempotency middleware skips the second copy.
//
// Messages a run does not move (not selected, a dry run, an undecodable body,
// no original queue) are put back: re-published to the dead-letter topic,
// unchanged, then acked. The run ends when the topic has been idle for
// WithIdleTimeout, when it meets a message it put back itself (it has gone
// round the whole topic), at WithMax, or when ctx is done.
//
// Give Run a subscriber of its own and close it when Run returns: the
// subscription lasts until then (or until ctx is done). Some subscribers
// drop an ack that races with Close; give them a moment first, or the last
// message may be redriven again later (the idempotency middleware skips the
// copy). A subscriber in a consumer group may have read one message ahead
// when a run stops; it stays pending for the group. With
// watermill-redisstream, set MaxIdleTime to a millisecond and ClaimInterval
// to hours on the redrive subscriber: the next run then takes such messages
// first, and no run takes back a message it is still working on.
//
// WithReplayBypass stamps the bq-replay-bypass marker: the handler's
// idempotent core runs again (after the operator forgot the ids), but its
// external effects wrapped in idempotency.BypassExternalEffects do not.
package redrive

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
)

// Entry reports what a run did with one dead-letter message.
type Entry struct {
	ID     string // meta.id, if the body is an envelope
	URN    string // job
	Reason string // dead_letter.reason
	From   string // the dead-letter topic
	To     string // where it went, or would go
	Moved  bool
	Note   string // why it was not moved
}

// Report is the outcome of a run.
type Report struct {
	Entries []Entry
	Moved   int // re-published to their target and acked
	PutBack int // returned to the dead-letter topic
}

// Option configures a run.
type Option func(*config)

type config struct {
	target   string
	dryRun   bool
	max      int
	reasons  []string
	urns     []string
	ids      []string
	minAge   time.Duration
	maxAge   time.Duration
	interval time.Duration
	bypass   bool
	idle     time.Duration
	progress func(Entry)
	now      func() time.Time
}

// WithTarget sends every moved message to topic instead of its
// dead_letter.original_queue.
func WithTarget(topic string) Option { return func(c *config) { c.target = topic } }

// WithDryRun moves nothing: the report says what would move, and every
// message is put back.
func WithDryRun() Option { return func(c *config) { c.dryRun = true } }

// WithMax stops the run after n messages were moved (0: no limit).
func WithMax(n int) Option { return func(c *config) { c.max = n } }

// WithReasons selects messages whose dead_letter.reason is one of reasons.
func WithReasons(reasons ...string) Option { return func(c *config) { c.reasons = reasons } }

// WithURNs selects messages whose job is one of urns.
func WithURNs(urns ...string) Option { return func(c *config) { c.urns = urns } }

// WithIDs selects messages whose meta.id is one of ids.
func WithIDs(ids ...string) Option { return func(c *config) { c.ids = ids } }

// WithMinAge selects messages dead-lettered at least d ago.
func WithMinAge(d time.Duration) Option { return func(c *config) { c.minAge = d } }

// WithMaxAge selects messages dead-lettered at most d ago.
func WithMaxAge(d time.Duration) Option { return func(c *config) { c.maxAge = d } }

// WithRate moves at most perSecond messages a second.
func WithRate(perSecond float64) Option {
	return func(c *config) {
		if perSecond > 0 {
			c.interval = time.Duration(float64(time.Second) / perSecond)
		}
	}
}

// WithReplayBypass stamps envelope.MetadataReplayBypass "1" on every moved
// message.
func WithReplayBypass() Option { return func(c *config) { c.bypass = true } }

// WithIdleTimeout ends the run when no message arrived for d (default 2s).
func WithIdleTimeout(d time.Duration) Option { return func(c *config) { c.idle = d } }

// WithProgress calls f after each message is dealt with.
func WithProgress(f func(Entry)) Option { return func(c *config) { c.progress = f } }

// Run redrives the messages of the dead-letter topic from, read with sub,
// publishing with pub. It returns the report of what it did, and an error
// when it could not go on (a publish failed, ctx was done); the report is
// complete up to that point either way.
func Run(ctx context.Context, sub message.Subscriber, pub message.Publisher, from string, opts ...Option) (Report, error) {
	c := config{idle: 2 * time.Second, now: time.Now}
	for _, opt := range opts {
		opt(&c)
	}
	var report Report
	// The subscription lives as long as ctx or until sub is closed, so
	// that the last ack is not cut short when Run returns.
	msgs, err := sub.Subscribe(ctx, from)
	if err != nil {
		return report, fmt.Errorf("redrive: subscribe to %s: %w", from, err)
	}
	putBack := map[string]bool{} // Watermill UUIDs this run returned to the topic
	idle := time.NewTimer(c.idle)
	defer idle.Stop()
	var lastMove time.Time
	for {
		var msg *message.Message
		select {
		case <-ctx.Done():
			return report, ctx.Err()
		case <-idle.C:
			return report, nil
		case m, ok := <-msgs:
			if !ok {
				return report, nil
			}
			msg = m
		}
		idle.Reset(c.idle)
		if putBack[msg.UUID] {
			// Round the whole topic: return this one to the end too, and
			// stop. Every message not moved is unread again.
			if err := republish(pub, from, msg); err != nil {
				msg.Nack()
				return report, err
			}
			msg.Ack()
			return report, nil
		}

		entry, out := c.plan(msg, from)
		if out != nil && c.interval > 0 {
			if wait := c.interval - time.Since(lastMove); wait > 0 {
				select {
				case <-ctx.Done():
					msg.Nack()
					return report, ctx.Err()
				case <-time.After(wait):
				}
			}
		}
		if out != nil {
			if err := pub.Publish(entry.To, out); err != nil {
				msg.Nack()
				return report, fmt.Errorf("redrive: publish %s to %s: %w", entry.ID, entry.To, err)
			}
			lastMove = time.Now()
			entry.Moved = true
			report.Moved++
		} else {
			if err := republish(pub, from, msg); err != nil {
				msg.Nack()
				return report, err
			}
			putBack[msg.UUID] = true
			report.PutBack++
		}
		msg.Ack()
		report.Entries = append(report.Entries, entry)
		if c.progress != nil {
			c.progress(entry)
		}
		if c.max > 0 && report.Moved >= c.max {
			return report, nil
		}
	}
}

// plan decides what to do with one dead-letter message: the redriven
// message to publish, or nil to put it back (entry.Note says why).
func (c config) plan(msg *message.Message, from string) (Entry, *message.Message) {
	entry := Entry{From: from}
	e, err := envelope.Parse(msg.Payload)
	if err != nil {
		entry.Note = "undecodable: " + err.Error()
		return entry, nil
	}
	entry.ID, entry.URN = e.Meta.ID, e.Job
	if e.DeadLetter != nil {
		entry.Reason = e.DeadLetter.Reason
		entry.To = e.DeadLetter.OriginalQueue
	}
	if entry.To == "" {
		entry.To = msg.Metadata.Get(middleware.PoisonedTopicKey)
	}
	if c.target != "" {
		entry.To = c.target
	}
	switch {
	case entry.To == "":
		entry.Note = "no original queue; use a target topic"
		return entry, nil
	case !c.selects(e):
		entry.Note = "not selected"
		return entry, nil
	case c.dryRun:
		entry.Note = "dry run"
		return entry, nil
	}
	e.DeadLetter = nil
	e.Attempts = 0
	payload, err := e.Marshal()
	if err != nil {
		entry.Note = "cannot re-encode: " + err.Error()
		return entry, nil
	}
	out := message.NewMessage(msg.UUID, payload)
	for k, v := range msg.Metadata {
		if !slices.Contains(deadLetterKeys, k) && !envelope.TransportHeader(k) {
			out.Metadata.Set(k, v)
		}
	}
	out.Metadata.Set(envelope.MetadataMessageID, e.Meta.ID)
	out.Metadata.Set(envelope.MetadataTraceID, e.TraceID)
	out.Metadata.Set(envelope.MetadataJob, e.Job)
	if c.bypass {
		out.Metadata.Set(envelope.MetadataReplayBypass, "1")
	}
	return entry, out
}

// deadLetterKeys are the metadata keys dead-lettering added; a redriven
// message leaves them behind.
var deadLetterKeys = []string{
	deadletter.MetadataReason, deadletter.MetadataError, deadletter.MetadataOriginalTopic, deadletter.MetadataVerbatim,
	middleware.ReasonForPoisonedKey, middleware.PoisonedTopicKey, middleware.PoisonedHandlerKey, middleware.PoisonedSubscriberKey,
}

func (c config) selects(e envelope.Envelope) bool {
	var reason string
	var failedAt time.Time
	if e.DeadLetter != nil {
		reason = e.DeadLetter.Reason
		failedAt = time.UnixMilli(e.DeadLetter.FailedAt)
	}
	if len(c.reasons) > 0 && !slices.Contains(c.reasons, reason) {
		return false
	}
	if len(c.urns) > 0 && !slices.Contains(c.urns, e.Job) {
		return false
	}
	if len(c.ids) > 0 && !slices.Contains(c.ids, e.Meta.ID) {
		return false
	}
	age := c.now().Sub(failedAt)
	if c.minAge > 0 && (failedAt.IsZero() || age < c.minAge) {
		return false
	}
	if c.maxAge > 0 && (failedAt.IsZero() || age > c.maxAge) {
		return false
	}
	return true
}

// republish returns msg, unchanged, to the end of topic.
func republish(pub message.Publisher, topic string, msg *message.Message) error {
	back := message.NewMessage(msg.UUID, msg.Payload)
	for k, v := range msg.Metadata {
		back.Metadata.Set(k, v)
	}
	if err := pub.Publish(topic, back); err != nil {
		return fmt.Errorf("redrive: put back %s: %w", msg.UUID, err)
	}
	return nil
}
