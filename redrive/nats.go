package redrive

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
)

// NATSBrowser reads a JetStream topic written by watermill-nats (the
// topic is the subject; the stream is the one that captures it) by stream
// sequence, with no consumer: the messages after the ack floor of the
// durable consumer named durable (every message of the stream when it
// does not exist), those of the topic's subject only, unmarshaled with
// unmarshaler (nil: watermill-nats's NATSMarshaler). A message acked out
// of order above the ack floor is read too.
func NATSBrowser(js nats.JetStreamManager, durable string, unmarshaler wnats.Unmarshaler) Browser {
	if unmarshaler == nil {
		unmarshaler = &wnats.NATSMarshaler{}
	}
	return natsBrowser{js: js, durable: durable, unmarshaler: unmarshaler}
}

type natsBrowser struct {
	js          nats.JetStreamManager
	durable     string
	unmarshaler wnats.Unmarshaler
}

func (b natsBrowser) Browse(ctx context.Context, topic string, visit func(*message.Message) bool) error {
	stream, err := b.js.StreamNameBySubject(topic, nats.Context(ctx))
	if errors.Is(err, nats.ErrNoMatchingStream) {
		return fmt.Errorf("%w: no JetStream stream captures subject %q", ErrTopicNotFound, topic)
	}
	if err != nil {
		return fmt.Errorf("the stream of %s: %w", topic, err)
	}
	info, err := b.js.StreamInfo(stream, nats.Context(ctx))
	if err != nil {
		return fmt.Errorf("stream %s: %w", stream, err)
	}
	from := info.State.FirstSeq
	consumer, err := b.js.ConsumerInfo(stream, b.durable, nats.Context(ctx))
	switch {
	case err == nil:
		from = max(from, consumer.AckFloor.Stream+1)
	case !errors.Is(err, nats.ErrConsumerNotFound):
		return fmt.Errorf("consumer %s of stream %s: %w", b.durable, stream, err)
	}
	for seq := from; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
		raw, err := b.js.GetMsg(stream, seq, nats.Context(ctx))
		if errors.Is(err, nats.ErrMsgNotFound) {
			continue // deleted
		}
		if err != nil {
			return fmt.Errorf("message %d of stream %s: %w", seq, stream, err)
		}
		if raw.Subject != topic {
			continue
		}
		msg, err := b.unmarshaler.Unmarshal(&nats.Msg{Subject: raw.Subject, Header: raw.Header, Data: raw.Data})
		if err != nil {
			return fmt.Errorf("message %d of stream %s: %w", seq, stream, err)
		}
		if !visit(msg) {
			return nil
		}
	}
	return nil
}

// NATSSubscriber returns a subscriber for Run on JetStream that reads a
// topic (a subject) through the durable pull consumer named durable on the
// stream that captures it, one message at a time: the next is fetched
// once Run acked or nacked the last, so that a run that stops has read
// nothing ahead, and a message handed out and neither acked nor nacked
// when the subscription ends is nacked (handed out again at once). The
// consumer is created on the first Subscribe unless it exists (explicit
// acks, ackWait, every message of the stream to begin with) and left in
// place: the next run goes on from its acks. Subscribe fails with
// ErrTopicNotFound when no stream captures the topic. Close ends the
// subscriptions; it does not close js's connection.
func NATSSubscriber(js nats.JetStreamContext, durable string, ackWait time.Duration, unmarshaler wnats.Unmarshaler) message.Subscriber {
	if unmarshaler == nil {
		unmarshaler = &wnats.NATSMarshaler{}
	}
	return &natsSubscriber{js: js, durable: durable, ackWait: ackWait, unmarshaler: unmarshaler, closing: make(chan struct{})}
}

type natsSubscriber struct {
	js          nats.JetStreamContext
	durable     string
	ackWait     time.Duration
	unmarshaler wnats.Unmarshaler
	closing     chan struct{}
	closeOnce   sync.Once
	wg          sync.WaitGroup
}

// natsFetchWait is how long one fetch waits for a message before it is
// asked again (and the subscription's end is noticed).
const natsFetchWait = 200 * time.Millisecond

func (s *natsSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	stream, err := s.js.StreamNameBySubject(topic, nats.Context(ctx))
	if errors.Is(err, nats.ErrNoMatchingStream) {
		return nil, fmt.Errorf("%w: no JetStream stream captures subject %q", ErrTopicNotFound, topic)
	}
	if err != nil {
		return nil, fmt.Errorf("the stream of %s: %w", topic, err)
	}
	if _, err := s.js.ConsumerInfo(stream, s.durable, nats.Context(ctx)); errors.Is(err, nats.ErrConsumerNotFound) {
		_, err = s.js.AddConsumer(stream, &nats.ConsumerConfig{
			Durable: s.durable, DeliverPolicy: nats.DeliverAllPolicy, AckPolicy: nats.AckExplicitPolicy,
			AckWait: s.ackWait, MaxAckPending: 1, FilterSubject: topic,
		}, nats.Context(ctx))
		if err != nil {
			return nil, fmt.Errorf("create consumer %s of stream %s: %w", s.durable, stream, err)
		}
	} else if err != nil {
		return nil, fmt.Errorf("consumer %s of stream %s: %w", s.durable, stream, err)
	}
	// Bound to the consumer made above: nats.go leaves it on Unsubscribe.
	sub, err := s.js.PullSubscribe(topic, s.durable, nats.Bind(stream, s.durable))
	if err != nil {
		return nil, fmt.Errorf("subscribe to %s: %w", topic, err)
	}
	out := make(chan *message.Message)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer close(out)
		defer func() { _ = sub.Unsubscribe() }()
		for {
			select {
			case <-ctx.Done():
				return
			case <-s.closing:
				return
			default:
			}
			fetchCtx, cancel := context.WithTimeout(ctx, natsFetchWait)
			raws, err := sub.Fetch(1, nats.Context(fetchCtx))
			cancel()
			if err != nil || len(raws) == 0 {
				continue // no message yet, or a passing error: ask again
			}
			if !s.handOut(ctx, out, raws[0]) {
				return
			}
		}
	}()
	return out, nil
}

// handOut gives raw to the reader of out and settles it as the reader did;
// false when the subscription ended meanwhile (raw was nacked).
func (s *natsSubscriber) handOut(ctx context.Context, out chan<- *message.Message, raw *nats.Msg) bool {
	msg, err := s.unmarshaler.Unmarshal(raw)
	if err != nil {
		_ = raw.Term() // cannot be read: never again
		return true
	}
	msgCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	msg.SetContext(msgCtx)
	select {
	case out <- msg:
	case <-ctx.Done():
		_ = raw.Nak()
		return false
	case <-s.closing:
		_ = raw.Nak()
		return false
	}
	select {
	case <-msg.Acked():
		_ = raw.AckSync(nats.Context(ctx))
		return true
	case <-msg.Nacked():
		_ = raw.Nak()
		return true
	case <-ctx.Done():
		_ = raw.Nak()
		return false
	case <-s.closing:
		_ = raw.Nak()
		return false
	}
}

// Close ends the subscriptions and waits for them.
func (s *natsSubscriber) Close() error {
	s.closeOnce.Do(func() { close(s.closing) })
	s.wg.Wait()
	return nil
}
