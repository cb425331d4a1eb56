// Package kafkasession watches the consumer group sessions of a
// watermill-kafka subscriber: when the group first gave it its partitions,
// and when that first session ended (the group began a rebalance: a member
// joined or left). What the subscriber acks once its session ended is not
// committed.
package kafkasession

import (
	"context"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Watch is a watermill-kafka tracer (SubscriberConfig.Tracer) that traces
// nothing and reports the subscriber's first session. Give each subscriber
// a Watch of its own.
type Watch struct {
	once         sync.Once
	setUp, ended chan struct{}
}

var _ kafka.SaramaTracer = (*Watch)(nil)

// New returns a Watch.
func New() *Watch { return &Watch{setUp: make(chan struct{}), ended: make(chan struct{})} }

// FirstSetUp is closed when the group first gave the subscriber its
// partitions (none, maybe).
func (w *Watch) FirstSetUp() <-chan struct{} { return w.setUp }

// FirstEnded is closed when the first session has ended.
func (w *Watch) FirstEnded() <-chan struct{} { return w.ended }

// WrapConsumer returns c.
func (w *Watch) WrapConsumer(c sarama.Consumer) sarama.Consumer { return c }

// WrapPartitionConsumer returns pc.
func (w *Watch) WrapPartitionConsumer(pc sarama.PartitionConsumer) sarama.PartitionConsumer {
	return pc
}

// WrapSyncProducer returns p.
func (w *Watch) WrapSyncProducer(_ *sarama.Config, p sarama.SyncProducer) sarama.SyncProducer {
	return p
}

// WrapConsumerGroupHandler watches the sessions h is set up for.
func (w *Watch) WrapConsumerGroupHandler(h sarama.ConsumerGroupHandler) sarama.ConsumerGroupHandler {
	return watched{ConsumerGroupHandler: h, w: w}
}

type watched struct {
	sarama.ConsumerGroupHandler
	w *Watch
}

func (h watched) Setup(session sarama.ConsumerGroupSession) error {
	h.w.once.Do(func() {
		close(h.w.setUp)
		// Ends with the session, at the latest when the subscriber closes.
		go func() { <-session.Context().Done(); close(h.w.ended) }()
	})
	return h.ConsumerGroupHandler.Setup(session)
}

// Joining returns sub, a watermill-kafka subscriber whose tracer is w, as a
// subscriber whose Subscribe returns once the group first gave it its
// partitions, after wait at the latest, or when ctx ends. A Kafka may take
// seconds to hand a new member its partitions (a rebalance waits for every
// member to finish what it holds; group.initial.rebalance.delay.ms holds a
// new group's first one back): a caller that counts idle time from
// Subscribe (redrive.Run) then counts from the assignment. Close closes
// sub.
func Joining(sub message.Subscriber, w *Watch, wait time.Duration) message.Subscriber {
	return joining{Subscriber: sub, w: w, wait: wait}
}

type joining struct {
	message.Subscriber
	w    *Watch
	wait time.Duration
}

func (j joining) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	msgs, err := j.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	timer := time.NewTimer(j.wait)
	defer timer.Stop()
	select {
	case <-j.w.FirstSetUp():
	case <-timer.C:
	case <-ctx.Done():
	}
	return msgs, nil
}
