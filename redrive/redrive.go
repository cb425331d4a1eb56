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
// Every message sent back is marked (envelope.MetadataRedrive), so that a
// consumer that remembered the message's end (the idempotency middleware
// under WithRetries does: a redelivery of a message that was dead-lettered
// is acked without running) knows it was sent back on purpose and runs it
// again, with a fresh retry budget. Copies of one dead letter carry one
// mark.
//
// A run moves each message once. One it sent back that fails again and is
// dead-lettered anew while the run still reads the topic (the fault is not
// fixed) is not sent round again: its new dead letter is put back, selected
// but not moved, its Entry.Note saying it failed again, for a run after the
// fix. Dead letters of one message that were on the topic before the run
// sent it back (a redrive that crashed between its publish and its ack
// leaves the one it read beside its copy's) are each moved.
//
// Messages a run does not move (not selected, an undecodable body, no
// original queue, failed again) are put back: re-published to the
// dead-letter topic, unchanged, then acked. The run ends when it has waited
// WithIdleTimeout for a message (the wait WithRate imposes does not count),
// when it meets a message it put back itself (it has gone round the whole
// topic: the run marks what it puts back, see MetadataPutBack, so that
// identical dead letters are not taken for one another), at WithMax, or
// when ctx is done.
//
// A publish error ends the run, the message nacked, unless WithSkipErrors
// names it as permanent for that message (a body the wire format cannot
// carry): then the message is skipped (put back, or left where it is when
// it cannot be put back either), counted in Report.Skipped, and the run
// goes on. A broker that cannot be reached is never such an error.
//
// A dry run is Preview: it reads the topic through a Browser, which neither
// consumes nor writes anything (no publish, no ack, no consumer group or
// offset created), and reports what Run would move. RedisStreamBrowser,
// PostgresBrowser and KafkaBrowser read Redis Streams, watermill-sql topics
// and Kafka topics that way.
//
// The age filters (WithMinAge, WithMaxAge) match only messages whose
// dead_letter.failed_at is known; a message of unknown age is left where it
// is and counted in Report.UnknownAge.
//
// A body that is not an envelope was dead-lettered verbatim, with its
// original topic in the metadata. It stays on the dead-letter topic unless
// the run is given WithVerbatim, which moves it, unchanged, to that topic
// (or the WithTarget topic).
//
// Give Run a subscriber of its own and close it when Run returns: the
// subscription lasts until then (or until ctx is done). Some subscribers
// drop an ack that races with Close; give them a moment first, or the last
// message may be redriven again later (the idempotency middleware skips the
// copy). A subscriber in a consumer group may have read one message ahead
// when a run stops; it stays pending for the group. With
// watermill-redisstream, set MaxIdleTime to a millisecond and ClaimInterval
// to hours on the redrive subscriber: the next run then takes such messages
// first, and no run takes back a message it is still working on. Run one
// run at a time per stream and group: a run starting beside another would
// claim what the other has read and not yet acked, and move it twice.
// LockRedisStream holds the group's run lock for the length of a run
// (bq-idempotency redrive takes it).
// On a Kafka topic of several partitions, wrap the subscriber in
// KafkaRound, or a run may stop at a put-back message that came round on one
// partition before it read the others.
//
// WithReplayBypass stamps the bq-replay-bypass marker: the handler's
// idempotent core runs again (after the operator forgot the ids), but its
// external effects wrapped in idempotency.BypassExternalEffects do not.
package redrive

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/deadletter"
)

// Entry reports what a run did with one dead-letter message.
type Entry struct {
	ID     string // meta.id, if the body is an envelope
	URN    string // job
	Reason string // dead_letter.reason (or the dead-letter metadata of a verbatim body)
	From   string // the dead-letter topic
	To     string // where it went, or would go
	// Moved reports that the message was re-published to To (by Preview:
	// that Run would re-publish it).
	Moved bool
	// Selected reports that the run's filters chose the message: moved,
	// or left although asked for (no queue to go to, a body that cannot be
	// re-encoded, a publish refused for good, a message that failed again
	// after the run sent it back). A message the filters did not choose
	// (or, without WithVerbatim, a body that is not an envelope) is not
	// selected.
	Selected bool
	Note     string // why it was not moved
}

// Report is the outcome of a run.
type Report struct {
	Entries []Entry
	// Moved counts the messages re-published to their target and acked (by
	// Preview: the messages Run would move).
	Moved int
	// PutBack counts the messages left on the dead-letter topic: returned
	// to it, or (skipped) left where they were (by Preview: the messages
	// Run would leave there).
	PutBack int
	// UnknownAge counts the messages an age filter left on the topic
	// because their dead-letter time is unknown (no dead_letter.failed_at).
	UnknownAge int
	// Skipped counts the messages, among those PutBack counts, that the
	// run could not move because a publish refused them for good (see
	// WithSkipErrors); Entry.Note says which publish and why.
	Skipped int
	// DryRun is set on Preview's reports.
	DryRun bool
}

// Option configures a run.
type Option func(*config)

type config struct {
	noMark   bool
	target   string
	max      int
	reasons  []string
	urns     []string
	ids      []string
	minAge   time.Duration
	maxAge   time.Duration
	interval time.Duration
	bypass   bool
	verbatim bool
	idle     time.Duration
	skip     []error
	progress func(Entry)
	now      func() time.Time
}

// WithTarget sends every moved message to topic instead of its
// dead_letter.original_queue.
func WithTarget(topic string) Option { return func(c *config) { c.target = topic } }

// WithMax stops the run after n messages were moved (0: no limit).
func WithMax(n int) Option { return func(c *config) { c.max = n } }

// WithReasons selects messages whose dead_letter.reason is one of reasons
// (the envelope.Reason constants name those package deadletter writes, one
// per cause; other producers may write others).
func WithReasons(reasons ...string) Option { return func(c *config) { c.reasons = reasons } }

// WithURNs selects messages whose job is one of urns.
func WithURNs(urns ...string) Option { return func(c *config) { c.urns = urns } }

// WithIDs selects messages whose meta.id is one of ids.
func WithIDs(ids ...string) Option { return func(c *config) { c.ids = ids } }

// WithMinAge selects messages dead-lettered at least d ago. A message whose
// dead-letter time is unknown is not selected.
func WithMinAge(d time.Duration) Option { return func(c *config) { c.minAge = d } }

// WithMaxAge selects messages dead-lettered at most d ago. A message whose
// dead-letter time is unknown is not selected.
func WithMaxAge(d time.Duration) Option { return func(c *config) { c.maxAge = d } }

// WithRate moves at most perSecond messages a second, and keeps to that
// rate: the moves are due on a schedule counted from the first one, so the
// time each takes (its publish and ack, the read of the next message) does
// not slow the run below it; after a stall (no message came) at most one
// move is made up for, so no burst exceeds it by more than a message.
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

// WithVerbatim also moves bodies that are not envelopes (dead-lettered
// verbatim): unchanged, to the original topic the dead-letter middleware
// recorded in their metadata, or to the WithTarget topic. Only WithReasons
// can select them (their reason is in the metadata); a run with an id, URN
// or age filter leaves them. Without this option they stay where they are.
func WithVerbatim() Option { return func(c *config) { c.verbatim = true } }

// WithoutPutBackMark puts messages back without the run's mark
// (MetadataPutBack), for a pub/sub whose wire form changes when a message
// carries metadata, such as the BabelQueue SDKs' Redis lists (package
// pubsub/redislist), which write a message with headers as a frame: a put-back
// dead letter then stays byte for byte what it was. The run then knows its
// put-backs by their body and dead-letter metadata, so of identical dead
// letters (one message dead-lettered twice) the second ends the run as if it
// were the first come round; nothing is lost, and a second run goes on from
// there.
func WithoutPutBackMark() Option { return func(c *config) { c.noMark = true } }

// WithIdleTimeout ends the run when it has waited d for a message
// (default 2s). Only the wait for the next message counts: the wait
// WithRate imposes and the publishing do not.
func WithIdleTimeout(d time.Duration) Option { return func(c *config) { c.idle = d } }

// WithSkipErrors names the publish errors that are permanent for the
// message being published: the publisher refuses that message, and would
// refuse it again, whatever the state of the broker (a body the wire
// format cannot carry, or a topic name it does not accept, such as
// watermill-sql's ErrInvalidTopicName). A publish error matching one of
// errs (errors.Is) does not end the run: a message whose move is refused is
// put back and counted in Report.Skipped; one that cannot be put back
// either is left where it is (nacked: the subscriber keeps it), counted
// too, and the run goes on with the next. Every other publish error (a
// broker that cannot be reached, a timeout, a closed publisher) ends the
// run with an error, the message nacked. Without this option every
// publish error ends the run.
//
// How a nacked message is kept depends on the subscriber. The SDKs' Redis
// lists (pubsub/redislist) push it to the end of the list, so the run goes
// on with the others and stops when it meets it again (it has gone round).
// Subscribers that deliver a nacked message again at once (Redis Streams,
// watermill-sql, RabbitMQ) give it back to the run straight away: the run
// stops there, the messages behind it unread, and reports success with
// the skip counted.
func WithSkipErrors(errs ...error) Option {
	return func(c *config) { c.skip = append(c.skip, errs...) }
}

// skips reports whether err is permanent for the message (WithSkipErrors).
func (c config) skips(err error) bool {
	for _, target := range c.skip {
		if errors.Is(err, target) {
			return true
		}
	}
	return false
}

// WithProgress calls f after each message is dealt with.
func WithProgress(f func(Entry)) Option { return func(c *config) { c.progress = f } }

func newConfig(opts []Option) config {
	c := config{idle: 2 * time.Second, now: time.Now}
	for _, opt := range opts {
		opt(&c)
	}
	return c
}

// Run redrives the messages of the dead-letter topic from, read with sub,
// publishing with pub. It returns the report of what it did, and an error
// when it could not go on (a publish failed with an error WithSkipErrors
// does not name, ctx was done: then the error is ctx's cause); the report
// is complete up to that point either way.
func Run(ctx context.Context, sub message.Subscriber, pub message.Publisher, from string, opts ...Option) (Report, error) {
	c := newConfig(opts)
	var report Report
	// The subscription lives as long as ctx or until sub is closed, so
	// that the last ack is not cut short when Run returns.
	msgs, err := sub.Subscribe(ctx, from)
	if err != nil {
		return report, fmt.Errorf("redrive: subscribe to %s: %w", from, err)
	}
	// A message this run returns to the topic carries the run's mark
	// (MetadataPutBack): meeting its own mark means the run went round the
	// whole topic. Not bodies: one message dead-lettered twice leaves two
	// identical dead letters, the second of which is not the first come
	// round. Should a pub/sub not carry metadata, the mark never comes back;
	// the run then also stops at a message with the body, dead-letter
	// metadata and Watermill UUID of one it put back (a put-back keeps its
	// UUID; copies published apart have UUIDs of their own) and, among
	// messages without a UUID (other runtimes may send none), once it has
	// put back far more of them than it found distinct ones.
	// With WithoutPutBackMark nothing is marked: a message whose body and
	// dead-letter metadata match one the run put back is taken for it.
	mark := watermill.NewUUID()
	if c.noMark {
		mark = ""
	}
	putBack := map[[sha256.Size]byte]bool{} // without the mark
	type putBackID struct {
		sum  [sha256.Size]byte
		uuid string
	}
	putBackIDs := map[putBackID]bool{}
	anonymous := map[[sha256.Size]byte]bool{} // distinct messages without a UUID
	anonymousPutBacks := 0
	// The messages the run sent back, with the redrive marks of the dead
	// letters it sent and when it first sent one: another dead letter of
	// one of them (another mark) that may come from a copy the run sent is
	// the message failing again, and stays. A copy of a dead letter the
	// run sent (the same mark) is moved: the consumer takes it for the same
	// redrive. So is a dead letter that cannot come from the run's copies
	// (see sentCopies.fromRun): one already on the topic when the run began
	// (the message dead-lettered twice: by a redrive that crashed between
	// its publish and its ack, say), which the consumer would otherwise
	// never run again.
	moved := map[movedKey]*sentCopies{}
	// The idle timer runs only while the run waits for a message: stopped
	// when one arrives, started afresh when the run waits again, so the
	// rate's wait and the publishing never count as idle time.
	idle := time.NewTimer(c.idle)
	defer idle.Stop()
	pace := pacer{interval: c.interval}
	for {
		idle.Reset(c.idle)
		var msg *message.Message
		select {
		case <-ctx.Done():
			return report, context.Cause(ctx)
		case <-idle.C:
			return report, nil
		case m, ok := <-msgs:
			if !ok {
				// A subscriber closes its channel when ctx ends too: the
				// run was cut short, not done.
				if ctx.Err() != nil {
					return report, context.Cause(ctx)
				}
				return report, nil
			}
			msg = m
		}
		idle.Stop()
		sum := putBackKey(msg)
		var cameRound bool
		switch {
		case mark == "":
			cameRound = putBack[sum]
		case msg.UUID != "":
			cameRound = msg.Metadata.Get(MetadataPutBack) == mark || putBackIDs[putBackID{sum, msg.UUID}]
		default:
			anonymous[sum] = true
			cameRound = msg.Metadata.Get(MetadataPutBack) == mark || anonymousPutBacks > maxPutBackRatio*len(anonymous)+maxPutBackSlack
		}
		if cameRound {
			// Round the whole topic: return this one to the end too, and
			// stop. Every message not moved is unread again. A message
			// the run skipped is refused again: it stays where it is.
			if err := republish(pub, from, msg, mark); err != nil {
				msg.Nack()
				if c.skips(err) {
					return report, nil
				}
				return report, err
			}
			msg.Ack()
			return report, nil
		}

		entry, out, unknownAge := c.plan(msg, from)
		key, keyed := keyOf(entry, msg, out)
		if out != nil && keyed {
			if sent, ok := moved[key]; ok && !sent.marks[out.Metadata.Get(envelope.MetadataRedrive)] && sent.fromRun(msg) {
				entry.Note = "already sent back by this run, failed again: left for a run after the fix"
				out = nil
			}
		}
		if out != nil && c.interval > 0 {
			if wait := pace.delay(time.Now()); wait > 0 {
				select {
				case <-ctx.Done():
					msg.Nack()
					return report, context.Cause(ctx)
				case <-time.After(wait):
				}
			}
		}
		skipped := false
		if out != nil {
			err := pub.Publish(entry.To, out)
			switch {
			case err == nil:
				entry.Moved = true
				report.Moved++
				if keyed {
					if moved[key] == nil {
						moved[key] = &sentCopies{marks: map[string]bool{}, first: time.Now()}
					}
					moved[key].marks[out.Metadata.Get(envelope.MetadataRedrive)] = true
				}
			case c.skips(err):
				// Refused for good: the message stays on the topic.
				entry.Note = fmt.Sprintf("skipped, %s refused it: %v", entry.To, err)
				skipped = true
			default:
				msg.Nack()
				return report, fmt.Errorf("redrive: publish %s to %s: %w", dashID(entry.ID), entry.To, err)
			}
		}
		ack := true // false: nacked, left for the subscriber to keep
		if !entry.Moved {
			err := republish(pub, from, msg, mark)
			switch {
			case err == nil:
			case c.skips(err):
				// It cannot be put back either: the subscriber keeps it
				// (a nack), and the run goes on without it.
				entry.Note = joinNote(entry.Note, "skipped, left where it was (cannot be put back): "+err.Error())
				skipped, ack = true, false
			default:
				msg.Nack()
				return report, err
			}
			if mark == "" {
				putBack[sum] = true
			}
			if msg.UUID != "" {
				putBackIDs[putBackID{sum, msg.UUID}] = true
			} else {
				anonymousPutBacks++
			}
			report.PutBack++
			if skipped {
				report.Skipped++
			}
			if unknownAge {
				report.UnknownAge++
			}
		}
		if ack {
			msg.Ack()
		} else {
			msg.Nack()
		}
		report.Entries = append(report.Entries, entry)
		if c.progress != nil {
			c.progress(entry)
		}
		if c.max > 0 && report.Moved >= c.max {
			return report, nil
		}
	}
}

// movedKey identifies a message the run sent back: where it went, the
// handler that dead-lettered it (two handlers of one topic dead-letter it
// once each, and each dead letter is sent back), and its meta.id (or, for
// a body that is not an envelope, its Watermill UUID; for a message with
// neither, the body sent back, which every dead letter of it shares).
type movedKey struct {
	to, handler, id, uuid string
	body                  [sha256.Size]byte
}

// keyOf is the movedKey of the dead letter msg planned as entry, to be sent
// back as out; false when there is nothing to send.
func keyOf(entry Entry, msg *message.Message, out *message.Message) (movedKey, bool) {
	if out == nil {
		return movedKey{}, false
	}
	k := movedKey{to: entry.To, handler: msg.Metadata.Get(middleware.PoisonedHandlerKey)}
	switch {
	case entry.ID != "":
		k.id = entry.ID
	case msg.UUID != "":
		k.uuid = msg.UUID
	default:
		k.body = sha256.Sum256(out.Payload)
	}
	return k, true
}

// sentCopies are the copies of one message (one movedKey) a run sent
// back: their redrive marks, and when it sent the first.
type sentCopies struct {
	marks map[string]bool
	first time.Time
}

// clockSkew is how far the clock of the consumer that dead-lettered a
// message (dead_letter.failed_at) may be behind the run's: a dead letter
// failed more than this before the run sent its first copy of the message
// was on the topic before, and is no copy's failure.
const clockSkew = time.Second

// fromRun reports whether dead, a dead letter of a message the run sent
// back, may be the failure of one of the copies it sent: it carries one of
// their redrive marks (the dead-letter middleware keeps a message's
// metadata) or none (a consumer that drops it), and was not dead-lettered
// before the run sent the first (by dead_letter.failed_at, when known).
func (s *sentCopies) fromRun(dead *message.Message) bool {
	if mark := dead.Metadata.Get(envelope.MetadataRedrive); mark != "" && !s.marks[mark] {
		return false // the failure of another run's copy
	}
	if e, err := envelope.Parse(dead.Payload); err == nil && e.DeadLetter != nil && e.DeadLetter.FailedAt > 0 {
		return !time.UnixMilli(e.DeadLetter.FailedAt).Before(s.first.Add(-clockSkew))
	}
	return true
}

// joinNote appends b to the note a.
func joinNote(a, b string) string {
	if a == "" {
		return b
	}
	return a + "; " + b
}

func dashID(id string) string {
	if id == "" {
		return "(no meta.id)"
	}
	return id
}

// plan decides what to do with one dead-letter message: the redriven
// message to publish, or nil to put it back (entry.Note says why;
// unknownAge is set when an age filter left it because its age is unknown).
func (c config) plan(msg *message.Message, from string) (entry Entry, out *message.Message, unknownAge bool) {
	entry = Entry{From: from}
	e, err := envelope.Parse(msg.Payload)
	if err != nil {
		return c.planVerbatim(msg, entry, err)
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
	var failedAt int64
	if e.DeadLetter != nil {
		failedAt = e.DeadLetter.FailedAt
	}
	ok, unknown := c.selects(entry.Reason, e.Job, e.Meta.ID, failedAt)
	entry.Selected = ok
	if entry.To == "" {
		entry.Note = "no original queue; use a target topic"
		return entry, nil, false
	}
	if !ok {
		entry.Note = "not selected"
		if unknown {
			entry.Note = "unknown age (no dead_letter.failed_at)"
		}
		return entry, nil, unknown
	}
	e.DeadLetter = nil
	e.Attempts = 0
	payload, err := e.Marshal()
	if err != nil {
		entry.Note = "cannot re-encode: " + err.Error()
		return entry, nil, false
	}
	out = message.NewMessage(msg.UUID, payload)
	copyMetadata(out, msg)
	out.Metadata.Set(envelope.MetadataMessageID, e.Meta.ID)
	out.Metadata.Set(envelope.MetadataTraceID, e.TraceID)
	out.Metadata.Set(envelope.MetadataJob, e.Job)
	out.Metadata.Set(envelope.MetadataRedrive, redriveMark(msg))
	if c.bypass {
		out.Metadata.Set(envelope.MetadataReplayBypass, "1")
	}
	return entry, out, false
}

// planVerbatim decides for a body that is not an envelope.
func (c config) planVerbatim(msg *message.Message, entry Entry, parseErr error) (Entry, *message.Message, bool) {
	entry.Reason = msg.Metadata.Get(deadletter.MetadataReason)
	if !c.verbatim {
		entry.Note = "undecodable: " + parseErr.Error()
		return entry, nil, false
	}
	entry.To = msg.Metadata.Get(deadletter.MetadataOriginalTopic)
	if entry.To == "" {
		entry.To = msg.Metadata.Get(middleware.PoisonedTopicKey)
	}
	if c.target != "" {
		entry.To = c.target
	}
	entry.Selected = len(c.urns) == 0 && len(c.ids) == 0 && c.minAge <= 0 && c.maxAge <= 0 &&
		(len(c.reasons) == 0 || slices.Contains(c.reasons, entry.Reason))
	switch {
	case entry.To == "":
		entry.Note = "undecodable, no original topic recorded; use a target topic"
		return entry, nil, false
	case len(c.urns) > 0 || len(c.ids) > 0:
		entry.Note = "undecodable: has no URN or meta.id to select by"
		return entry, nil, false
	case c.minAge > 0 || c.maxAge > 0:
		entry.Note = "unknown age (undecodable body)"
		return entry, nil, true
	case len(c.reasons) > 0 && !slices.Contains(c.reasons, entry.Reason):
		entry.Note = "not selected"
		return entry, nil, false
	}
	out := message.NewMessage(msg.UUID, msg.Payload)
	copyMetadata(out, msg)
	out.Metadata.Set(envelope.MetadataRedrive, redriveMark(msg))
	if c.bypass {
		out.Metadata.Set(envelope.MetadataReplayBypass, "1")
	}
	return entry, out, false
}

// redriveMark is the mark (envelope.MetadataRedrive) of the copy sent back
// from the dead letter msg: derived from the dead letter itself, whose body
// says when it failed, so that sending one dead letter back twice (a run
// interrupted after its publish) marks both copies alike, while the next
// dead letter of the same message, once redriven, is marked anew.
func redriveMark(msg *message.Message) string {
	h := sha256.New()
	h.Write([]byte(msg.UUID))
	h.Write([]byte{0})
	h.Write(msg.Payload)
	return hex.EncodeToString(h.Sum(nil)[:12])
}

// copyMetadata copies msg's metadata to out, but for the keys
// dead-lettering added and the transport headers of the previous hop
// (envelope.TransportHeader), which would disagree with the new body.
func copyMetadata(out, msg *message.Message) {
	for k, v := range msg.Metadata {
		if !slices.Contains(deadLetterKeys, k) && !envelope.TransportHeader(k) {
			out.Metadata.Set(k, v)
		}
	}
}

// deadLetterKeys are the metadata keys dead-lettering added; a redriven
// message leaves them behind.
var deadLetterKeys = []string{
	deadletter.MetadataReason, deadletter.MetadataError, deadletter.MetadataOriginalTopic, deadletter.MetadataVerbatim,
	middleware.ReasonForPoisonedKey, middleware.PoisonedTopicKey, middleware.PoisonedHandlerKey, middleware.PoisonedSubscriberKey,
}

// selects reports whether the filters select a message; unknownAge is set
// when only its unknown age (failedAt 0) kept it out.
func (c config) selects(reason, job, id string, failedAt int64) (ok, unknownAge bool) {
	if len(c.reasons) > 0 && !slices.Contains(c.reasons, reason) {
		return false, false
	}
	if len(c.urns) > 0 && !slices.Contains(c.urns, job) {
		return false, false
	}
	if len(c.ids) > 0 && !slices.Contains(c.ids, id) {
		return false, false
	}
	if c.minAge <= 0 && c.maxAge <= 0 {
		return true, false
	}
	if failedAt <= 0 {
		return false, true
	}
	age := c.now().Sub(time.UnixMilli(failedAt))
	if c.minAge > 0 && age < c.minAge {
		return false, false
	}
	if c.maxAge > 0 && age > c.maxAge {
		return false, false
	}
	return true, false
}

// putBackKey identifies a message for the "went round the topic" check: its
// body and the dead-letter metadata its plan reads.
func putBackKey(msg *message.Message) [sha256.Size]byte {
	h := sha256.New()
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(msg.Payload)))
	h.Write(n[:])
	h.Write(msg.Payload)
	for _, k := range deadLetterKeys {
		v := msg.Metadata.Get(k)
		binary.BigEndian.PutUint64(n[:], uint64(len(v)))
		h.Write(n[:])
		h.Write([]byte(v))
	}
	var sum [sha256.Size]byte
	h.Sum(sum[:0])
	return sum
}

// MetadataPutBack is the metadata key of the mark a redrive run leaves on
// a dead letter it returns to its topic: the run's identifier, by which the
// run knows it has gone round the topic when it meets the message again.
// A later run has another identifier and reads the message afresh; a
// redriven message does not carry the key on (it is a dead-letter
// annotation).
const MetadataPutBack = "bq-dead-letter-put-back"

// Among messages without a Watermill UUID, a run also stops once it has put
// back more than maxPutBackRatio times as many as it found distinct ones,
// plus maxPutBackSlack: the guard for a pub/sub that carries neither
// metadata (the mark) nor UUIDs.
const (
	maxPutBackRatio = 16
	maxPutBackSlack = 64
)

// republish returns msg, its body unchanged, to the end of topic, marked as
// put back by the run mark (unless mark is empty).
func republish(pub message.Publisher, topic string, msg *message.Message, mark string) error {
	back := message.NewMessage(msg.UUID, msg.Payload)
	for k, v := range msg.Metadata {
		back.Metadata.Set(k, v)
	}
	if mark != "" {
		back.Metadata.Set(MetadataPutBack, mark)
	}
	if err := pub.Publish(topic, back); err != nil {
		return fmt.Errorf("redrive: put back %s: %w", dashID(msg.UUID), err)
	}
	return nil
}
