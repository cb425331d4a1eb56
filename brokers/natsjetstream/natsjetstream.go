// Package natsjetstream holds what a watermill-nats deployment on JetStream
// needs beside the kit: dead-letter topics JetStream accepts, checked (and
// created) before the first message, and durable consumers that outlive
// their subscribers.
//
// watermill-nats maps a topic to a stream of the same name and a subject of
// the same name (its DefaultSubjectCalculator); with
// JetStreamConfig.AutoProvision it creates that stream on Subscribe and
// before every Publish. A stream name may not hold a dot, whitespace, '*',
// '>', a slash or a backslash, so the kit's default dead-letter topic,
// "<topic>.dlq", is no stream name: every dead letter fails to publish and
// its message comes back for ever. Name dead-letter topics with
// DeadLetterTopic ("<topic>_dlq"), and let the dead-letter middleware
// check them with Streams:
//
//	streams := natsjetstream.NewStreams(js, jsConfig, nil)
//	dlq, err := deadletter.Middleware(publisher,
//		deadletter.WithTopic(natsjetstream.DeadLetterTopic), deadletter.WithTopicCheck(streams))
//
// nats.go deletes a JetStream consumer it created itself when its
// subscription ends: a watermill-nats subscriber that created its durable
// consumer deletes it on Close, and the next subscriber reads the whole
// stream again. WithDurableConsumers creates the consumer beforehand, so
// that the subscription binds to it and leaves it in place.
package natsjetstream

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"

	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
)

// DeadLetterSuffix ends the dead-letter topic of a topic (DeadLetterTopic).
const DeadLetterSuffix = "_dlq"

// DeadLetterTopic returns the dead-letter topic of topic on JetStream,
// topic + "_dlq": a valid stream name whenever topic is one. Give it to
// deadletter.WithTopic.
func DeadLetterTopic(topic string) string { return topic + DeadLetterSuffix }

// MaxStreamName is the longest stream name the NATS server accepts. Its
// documentation advises under 32 characters: the name is a directory of
// the server's store, beside the account's and the consumer's.
const MaxStreamName = 255

// ErrInvalidStreamName is matched by CheckStreamName's error, and by a
// check (Streams) of a topic whose stream watermill-nats would create
// under a name JetStream refuses.
var ErrInvalidStreamName = errors.New("natsjetstream: not a valid JetStream stream name")

// ErrNoStream is matched by a check (Streams) of a topic no stream
// captures, where watermill-nats does not create streams.
var ErrNoStream = errors.New("natsjetstream: no JetStream stream captures the topic's subject")

// CheckStreamName returns nil when name is a stream name JetStream
// accepts: not empty, at most MaxStreamName bytes, and no whitespace,
// '.', '*', '>', '/', '\' or unprintable character.
func CheckStreamName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: empty", ErrInvalidStreamName)
	case len(name) > MaxStreamName:
		return fmt.Errorf("%w: %q is %d bytes, over %d", ErrInvalidStreamName, name, len(name), MaxStreamName)
	}
	for _, r := range name {
		if unicode.IsSpace(r) || !unicode.IsPrint(r) || strings.ContainsRune(".*>/\\", r) {
			return fmt.Errorf("%w: %q holds %q (no whitespace, '.', '*', '>', '/', '\\' or unprintable characters)", ErrInvalidStreamName, name, r)
		}
	}
	return nil
}

// Streams checks topics for the dead-letter middleware
// (deadletter.TopicChecker) as a watermill-nats publisher with the same
// JetStreamConfig and SubjectCalculator publishes to them.
type Streams struct {
	js       nats.JetStreamManager
	config   wnats.JetStreamConfig
	subjects wnats.SubjectCalculator
}

// NewStreams returns the checker of topics published with config and
// subjects (nil: watermill-nats's DefaultSubjectCalculator) through js.
func NewStreams(js nats.JetStreamManager, config wnats.JetStreamConfig, subjects wnats.SubjectCalculator) *Streams {
	if subjects == nil {
		subjects = wnats.DefaultSubjectCalculator
	}
	return &Streams{js: js, config: config, subjects: subjects}
}

// CheckTopic returns nil when a message published to topic is kept: a
// stream captures its subject, or, with AutoProvision, its stream was
// created now (as watermill-nats would on the first publish). It fails
// with ErrInvalidStreamName when AutoProvision would create a stream of a
// name JetStream refuses, and with ErrNoStream when no stream captures the
// subject and AutoProvision is off.
func (s *Streams) CheckTopic(ctx context.Context, topic string) error {
	if s.config.ShouldAutoProvision() {
		// watermill-nats looks the stream up by the topic's name before
		// every publish: a name JetStream refuses fails every one.
		if err := CheckStreamName(topic); err != nil {
			return fmt.Errorf("topic %q: watermill-nats's AutoProvision makes it a stream name: %w; "+
				"name dead-letter topics with deadletter.WithTopic(natsjetstream.DeadLetterTopic) (\"<topic>%s\")", topic, err, DeadLetterSuffix)
		}
		return ensureStream(ctx, s.js, topic, s.subjects("", topic).All())
	}
	subject := s.subjects("", topic).Primary
	if _, err := s.js.StreamNameBySubject(subject, nats.Context(ctx)); err != nil {
		if errors.Is(err, nats.ErrNoMatchingStream) {
			return fmt.Errorf("topic %q: %w %q: create a stream for it (nats stream add --subjects %q), or set JetStreamConfig.AutoProvision",
				topic, ErrNoStream, subject, subject)
		}
		return fmt.Errorf("topic %q: find the stream of subject %q: %w", topic, subject, err)
	}
	return nil
}

// ensureStream creates stream name over subjects unless it exists.
func ensureStream(ctx context.Context, js nats.JetStreamManager, name string, subjects []string) error {
	_, err := js.StreamInfo(name, nats.Context(ctx))
	if err == nil {
		return nil
	}
	if !errors.Is(err, nats.ErrStreamNotFound) {
		return fmt.Errorf("stream %q: %w", name, err)
	}
	if _, err := js.AddStream(&nats.StreamConfig{Name: name, Subjects: subjects}, nats.Context(ctx)); err != nil {
		return fmt.Errorf("create stream %q: %w", name, err)
	}
	return nil
}

// ErrNoDurable is returned by WithDurableConsumers's Subscribe when the
// configuration names no durable consumer for the topic.
var ErrNoDurable = errors.New("natsjetstream: no durable name: set JetStreamConfig.DurablePrefix and DurableCalculator")

// Consumer holds the settings of the durable consumers
// WithDurableConsumers creates; the others follow the subscriber's
// configuration.
type Consumer struct {
	// MaxAckPending bounds the messages the server has handed out and not
	// had acked, over every subscriber of the consumer. Messages the
	// server handed to a subscriber that is still busy with another wait
	// in its buffer while their AckWait runs; keep it near the number of
	// handlers running at once (processes × SubscribersCount). 0: the
	// server's default (1,000).
	MaxAckPending int
	// MaxDeliver bounds the deliveries of a message (0: no bound). The
	// kit counts a message's runs itself; leave it unbounded, or the
	// server drops a message silently once it is reached.
	MaxDeliver int
}

// WithDurableConsumers returns sub (a watermill-nats subscriber made with
// config) with a Subscribe that first creates the topic's stream (with
// AutoProvision) and its durable consumer, unless they exist, as the
// subscription would: a durable push consumer of the queue group, with
// explicit acks, the subscriber's AckWaitTimeout as its AckWait (the
// server's redelivery deadline) and every message of the stream to begin
// with. nats.go then binds the subscription to that consumer instead of
// creating one, and does not delete it when the subscriber closes: a
// restarted subscriber goes on from the consumer's acks instead of
// reading the stream from its start. A consumer that exists is used as it
// is. config must name a durable (DurablePrefix and DurableCalculator),
// or Subscribe fails with ErrNoDurable.
func WithDurableConsumers(sub message.Subscriber, js nats.JetStreamManager, config wnats.SubscriberSubscriptionConfig, consumer Consumer) message.Subscriber {
	return durable{Subscriber: sub, js: js, config: config, consumer: consumer}
}

type durable struct {
	message.Subscriber
	js       nats.JetStreamManager
	config   wnats.SubscriberSubscriptionConfig
	consumer Consumer
}

func (d durable) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := d.provision(ctx, topic); err != nil {
		return nil, err
	}
	return d.Subscriber.Subscribe(ctx, topic)
}

// provision creates topic's stream and durable consumer unless they exist.
func (d durable) provision(ctx context.Context, topic string) error {
	name := d.config.JetStream.CalculateDurableName(topic)
	if name == "" {
		return fmt.Errorf("topic %q: %w", topic, ErrNoDurable)
	}
	subjects := d.config.SubjectCalculator
	if subjects == nil {
		subjects = wnats.DefaultSubjectCalculator
	}
	detail := subjects(d.config.QueueGroupPrefix, topic)
	if d.config.JetStream.ShouldAutoProvision() {
		if err := ensureStream(ctx, d.js, topic, detail.All()); err != nil {
			return err
		}
	}
	stream, err := d.js.StreamNameBySubject(detail.Primary, nats.Context(ctx))
	if err != nil {
		return fmt.Errorf("topic %q: the stream of subject %q: %w", topic, detail.Primary, err)
	}
	_, err = d.js.ConsumerInfo(stream, name, nats.Context(ctx))
	if err == nil {
		return nil
	}
	if !errors.Is(err, nats.ErrConsumerNotFound) {
		return fmt.Errorf("topic %q: consumer %q of stream %q: %w", topic, name, stream, err)
	}
	ackWait := d.config.AckWaitTimeout
	if ackWait <= 0 {
		ackWait = 30 * time.Second // watermill-nats's default
	}
	maxDeliver := d.consumer.MaxDeliver
	if maxDeliver == 0 {
		maxDeliver = -1
	}
	_, err = d.js.AddConsumer(stream, &nats.ConsumerConfig{
		Durable: name, DeliverSubject: nats.NewInbox(), DeliverGroup: detail.QueueGroup,
		DeliverPolicy: nats.DeliverAllPolicy, AckPolicy: nats.AckExplicitPolicy, AckWait: ackWait,
		MaxAckPending: d.consumer.MaxAckPending, MaxDeliver: maxDeliver, FilterSubject: detail.Primary,
	}, nats.Context(ctx))
	if err != nil {
		// Another subscriber may have created it meanwhile.
		if _, again := d.js.ConsumerInfo(stream, name, nats.Context(ctx)); again == nil {
			return nil
		}
		return fmt.Errorf("topic %q: create durable consumer %q on stream %q: %w", topic, name, stream, err)
	}
	return nil
}
