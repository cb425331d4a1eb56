package deadletter

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// TopicChecker makes sure a dead-letter topic takes messages before the
// first one is published to it: a topic the broker does not create on
// publish (Kafka with auto-creation off), a name the broker refuses (a
// JetStream stream name with a dot), a queue that does not exist yet
// (RabbitMQ). A publisher implements it (amqpmarshal.Publisher does), or a
// helper for the broker does (package brokers/natsjetstream,
// brokers/kafkatopics), given with WithTopicCheck.
type TopicChecker interface {
	// CheckTopic returns nil when a message published to topic is kept,
	// after creating topic where it is allowed to; otherwise an error
	// that names the topic and says how to fix it. It returns by ctx's
	// deadline.
	CheckTopic(ctx context.Context, topic string) error
}

// ErrTopicUnusable is matched by the error of a delivery the middleware
// did not hand to its handler because the dead-letter topic of its topic
// failed its check (TopicChecker), and by the error CheckOnSubscribe's
// Subscribe returns then. The error names both topics and the checker's
// reason.
var ErrTopicUnusable = errors.New("deadletter: the dead-letter topic cannot take messages")

// MetricTopicCheckFailures counts failed checks of a dead-letter topic
// (TopicChecker), by "topic" (consumed from) and "dead_letter_topic".
const MetricTopicCheckFailures = "bq.deadletter.topic_check_failures"

// MetricPublishFailures counts dead letters that could not be published
// (the original is nacked and comes back), by "topic" (consumed from) and
// "dead_letter_topic".
const MetricPublishFailures = "bq.deadletter.publish_failures"

// DefaultTopicRecheck is how long a failed check of a dead-letter topic
// stands before it is run again (WithTopicRecheck): meanwhile deliveries
// of its topic wait for the next check (at most this long, by their
// context) and then go back to the broker unhandled, so that a topic whose
// dead letters have nowhere to go stalls, counted and logged, instead of
// spinning.
const DefaultTopicRecheck = 5 * time.Second

// topicCheckTimeout bounds one check.
const topicCheckTimeout = 30 * time.Second

// WithTopicCheck checks each dead-letter topic with checker before the
// first message of the topic it serves is handled (see TopicChecker).
// Without it, the publisher is the checker when it implements
// TopicChecker; WithTopicCheck(nil) turns the check off.
func WithTopicCheck(checker TopicChecker) Option {
	return func(c *config) { c.checker, c.checkerSet = checker, true }
}

// WithTopicRecheck sets how long a failed check of a dead-letter topic
// stands before it is run again (default DefaultTopicRecheck).
func WithTopicRecheck(d time.Duration) Option {
	return func(c *config) {
		if d > 0 {
			c.recheck = d
		}
	}
}

// topicChecks runs the checks of dead-letter topics once each, for the
// middleware's life: a topic that passed is never checked again; one that
// failed is checked again after the recheck interval.
type topicChecks struct {
	checker  TopicChecker
	logger   watermill.LoggerAdapter
	failures metric.Int64Counter
	recheck  time.Duration
	now      func() time.Time

	mu     sync.Mutex
	topics map[string]*topicState
}

type topicState struct {
	mu     sync.Mutex // held while the topic is being checked
	ok     bool
	err    error     // the last failure
	retry  time.Time // when a failed check may run again
	logged string    // the failure last logged
}

func newTopicChecks(checker TopicChecker, logger watermill.LoggerAdapter, failures metric.Int64Counter, recheck time.Duration) *topicChecks {
	return &topicChecks{checker: checker, logger: logger, failures: failures, recheck: recheck, now: time.Now, topics: map[string]*topicState{}}
}

func (t *topicChecks) state(topic string) *topicState {
	t.mu.Lock()
	defer t.mu.Unlock()
	s, ok := t.topics[topic]
	if !ok {
		s = &topicState{}
		t.topics[topic] = s
	}
	return s
}

// ensure checks the dead-letter topic to (serving original) unless it
// passed already. wait says whether the caller waits for a failed check's
// retry (a delivery) rather than getting the standing failure at once.
func (t *topicChecks) ensure(ctx context.Context, original, to string, wait bool) error {
	s := t.state(to)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ok {
		return nil
	}
	if s.err != nil {
		pause := s.retry.Sub(t.now())
		if pause > 0 && !wait {
			return s.err
		}
		if pause > 0 {
			timer := time.NewTimer(pause)
			select {
			case <-ctx.Done():
				timer.Stop()
				return s.err
			case <-timer.C:
			}
		}
	}
	checkCtx, cancel := context.WithTimeout(ctx, topicCheckTimeout)
	defer cancel()
	err := t.checker.CheckTopic(checkCtx, to)
	fields := watermill.LogFields{"topic": original, "dead_letter_topic": to}
	if err == nil {
		if s.err != nil {
			t.logger.Info("Dead-letter topic checked: it takes messages now", fields)
		}
		s.ok, s.err = true, nil
		return nil
	}
	if t.failures.Enabled(ctx) {
		t.failures.Add(ctx, 1, metric.WithAttributes(attribute.String("topic", original), attribute.String("dead_letter_topic", to)))
	}
	s.err = fmt.Errorf("%w: %s (the dead-letter topic of %s): %w", ErrTopicUnusable, to, original, err)
	s.retry = t.now().Add(t.recheck)
	// Logged once per distinct failure, not once per delivery.
	if text := err.Error(); text != s.logged {
		s.logged = text
		t.logger.Error("Dead-letter topic cannot take messages: no message of its topic is handled until it can", err, fields)
	}
	return s.err
}

// CheckOnSubscribe returns a subscriber decorator that checks the
// dead-letter topic of each topic when a handler subscribes to it, before
// any message is consumed: a topic whose dead letters would have nowhere
// to go makes Router.Run fail with an error matching ErrTopicUnusable that
// names the topics and the fix. Give it the publisher and options given
// to Middleware (the same WithTopic, WithTopicCheck):
//
//	opts := []deadletter.Option{deadletter.WithTopic(natsjetstream.DeadLetterTopic)}
//	dlq, err := deadletter.Middleware(publisher, opts...)
//	...
//	router.AddSubscriberDecorators(deadletter.CheckOnSubscribe(publisher, opts...))
//
// Without a checker (the publisher is no TopicChecker and no
// WithTopicCheck was given) it checks nothing.
func CheckOnSubscribe(pub message.Publisher, opts ...Option) message.SubscriberDecorator {
	c := newConfigFor(pub, opts)
	checks, err := c.topicChecks()
	return func(sub message.Subscriber) (message.Subscriber, error) {
		if err != nil {
			return nil, err
		}
		if checks == nil {
			return sub, nil
		}
		return checkingSubscriber{Subscriber: sub, checks: checks, topic: c.topic}, nil
	}
}

type checkingSubscriber struct {
	message.Subscriber
	checks *topicChecks
	topic  func(string) string
}

func (s checkingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.checks.ensure(ctx, topic, s.topic(topic), false); err != nil {
		return nil, err
	}
	return s.Subscriber.Subscribe(ctx, topic)
}
