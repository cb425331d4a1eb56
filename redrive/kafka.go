package redrive

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
)

// KafkaBrowser reads a Kafka topic through client as a subscriber of
// consumer group group would receive it, without joining the group or
// committing anything: partition by partition, from the group's committed
// offset (the partition's oldest record where the group has none) to the
// end the partition had when Browse began. unmarshaler turns each record
// into a message (kafkamarshal.Marshaler for the BabelQueue binding); a
// record it cannot read is shown as an undecodable body.
//
// Whether the topic exists is asked with a metadata request that does not
// create topics, whatever the broker's auto.create.topics.enable. A
// partition whose last records are no messages (a transaction's markers)
// ends after two seconds without a record.
func KafkaBrowser(client sarama.Client, group string, unmarshaler kafka.Unmarshaler) Browser {
	return kafkaBrowser{client: client, group: group, unmarshaler: unmarshaler, idle: 2 * time.Second}
}

type kafkaBrowser struct {
	client      sarama.Client
	group       string
	unmarshaler kafka.Unmarshaler
	idle        time.Duration
}

func (b kafkaBrowser) Browse(ctx context.Context, topic string, visit func(*message.Message) bool) error {
	partitions, err := b.partitions(topic)
	if err != nil {
		return err
	}
	starts, err := b.committed(topic, partitions)
	if err != nil {
		return err
	}
	consumer, err := sarama.NewConsumerFromClient(b.client)
	if err != nil {
		return fmt.Errorf("redrive: kafka consumer: %w", err)
	}
	defer consumer.Close()
	for _, p := range partitions {
		more, err := b.browsePartition(ctx, consumer, topic, p, starts[p], visit)
		if err != nil || !more {
			return err
		}
	}
	return nil
}

// partitions returns the topic's partitions, in order, or ErrTopicNotFound.
// The metadata request names the topic and does not allow its creation.
func (b kafkaBrowser) partitions(topic string) ([]int32, error) {
	broker, err := b.client.Controller()
	if err != nil {
		return nil, fmt.Errorf("redrive: kafka: %w", err)
	}
	resp, err := broker.GetMetadata(sarama.NewMetadataRequest(b.client.Config().Version, []string{topic}))
	if err != nil {
		return nil, fmt.Errorf("redrive: kafka metadata of %s: %w", topic, err)
	}
	for _, tm := range resp.Topics {
		if tm.Name != topic {
			continue
		}
		switch {
		case errors.Is(tm.Err, sarama.ErrUnknownTopicOrPartition):
			return nil, fmt.Errorf("%w: no Kafka topic %q", ErrTopicNotFound, topic)
		case !errors.Is(tm.Err, sarama.ErrNoError):
			return nil, fmt.Errorf("redrive: kafka topic %s: %w", topic, tm.Err)
		}
		ps := make([]int32, 0, len(tm.Partitions))
		for _, pm := range tm.Partitions {
			ps = append(ps, pm.ID)
		}
		slices.Sort(ps)
		return ps, nil
	}
	return nil, fmt.Errorf("%w: no Kafka topic %q", ErrTopicNotFound, topic)
}

// committed returns the group's committed offset of each partition, -1
// where it has none.
func (b kafkaBrowser) committed(topic string, partitions []int32) (map[int32]int64, error) {
	coordinator, err := b.client.Coordinator(b.group)
	if err != nil {
		return nil, fmt.Errorf("redrive: coordinator of kafka group %s: %w", b.group, err)
	}
	resp, err := coordinator.FetchOffset(sarama.NewOffsetFetchRequest(b.client.Config().Version, b.group, map[string][]int32{topic: partitions}))
	if err != nil {
		return nil, fmt.Errorf("redrive: offsets of kafka group %s: %w", b.group, err)
	}
	out := make(map[int32]int64, len(partitions))
	for _, p := range partitions {
		out[p] = -1
	}
	// A group that never committed: Kafka answers -1 offsets, some
	// servers (kfake) that the group does not exist.
	switch {
	case errors.Is(resp.Err, sarama.ErrGroupIDNotFound):
		return out, nil
	case !errors.Is(resp.Err, sarama.ErrNoError):
		return nil, fmt.Errorf("redrive: offsets of kafka group %s: %w", b.group, resp.Err)
	}
	for _, p := range partitions {
		if blk := resp.GetBlock(topic, p); blk != nil {
			if errors.Is(blk.Err, sarama.ErrGroupIDNotFound) {
				continue
			}
			if !errors.Is(blk.Err, sarama.ErrNoError) {
				return nil, fmt.Errorf("redrive: offset of kafka group %s on %s/%d: %w", b.group, topic, p, blk.Err)
			}
			out[p] = blk.Offset
		}
	}
	return out, nil
}

// browsePartition visits the records of one partition from committed (or
// its oldest) to the end it has now; more is false once visit said stop.
func (b kafkaBrowser) browsePartition(ctx context.Context, consumer sarama.Consumer, topic string, p int32, committed int64, visit func(*message.Message) bool) (more bool, err error) {
	newest, err := b.client.GetOffset(topic, p, sarama.OffsetNewest)
	if err != nil {
		return false, fmt.Errorf("redrive: end of %s/%d: %w", topic, p, err)
	}
	oldest, err := b.client.GetOffset(topic, p, sarama.OffsetOldest)
	if err != nil {
		return false, fmt.Errorf("redrive: start of %s/%d: %w", topic, p, err)
	}
	start := max(committed, oldest)
	if start >= newest {
		return true, nil
	}
	pc, err := consumer.ConsumePartition(topic, p, start)
	if err != nil {
		return false, fmt.Errorf("redrive: read %s/%d: %w", topic, p, err)
	}
	defer func() { _ = pc.Close() }()
	idle := time.NewTimer(b.idle)
	defer idle.Stop()
	for {
		select {
		case <-ctx.Done():
			return false, context.Cause(ctx)
		case <-idle.C:
			return true, nil // the rest are no messages
		case cerr := <-pc.Errors():
			if cerr != nil {
				return false, fmt.Errorf("redrive: read %s/%d: %w", topic, p, cerr.Err)
			}
		case rec, ok := <-pc.Messages():
			if !ok {
				return true, nil
			}
			idle.Reset(b.idle)
			msg, err := b.unmarshaler.Unmarshal(rec)
			if err != nil {
				msg = message.NewMessage("", nil)
			}
			if !visit(msg) {
				return false, nil
			}
			if rec.Offset+1 >= newest {
				return true, nil
			}
		}
	}
}

// KafkaRound returns sub, a watermill-kafka subscriber of consumer group
// group, as a subscriber for Run on a Kafka dead-letter topic of several
// partitions. Its Subscribe notes, through client, the records of the
// topic the group has not committed yet; it hands those out, holds back
// (unacked, so uncommitted) the records produced after that, which include
// the ones the run puts back, and closes its channel once it has handed out
// every noted record. Run then reads every partition round whole: without
// it, a run stops at the first message it put back that comes round on one
// partition, maybe before it read the others to their end. A partition the
// group gives another member is not waited for: the run then ends at its
// idle timeout. Close closes sub.
func KafkaRound(sub message.Subscriber, client sarama.Client, group string) message.Subscriber {
	return &kafkaRound{sub: sub, b: kafkaBrowser{client: client, group: group}, closing: make(chan struct{})}
}

type kafkaRound struct {
	sub     message.Subscriber
	b       kafkaBrowser
	once    sync.Once
	closing chan struct{}
}

func (r *kafkaRound) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	pending, err := r.pending(topic)
	if err != nil {
		return nil, err
	}
	in, err := r.sub.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for len(pending) > 0 {
			var msg *message.Message
			select {
			case m, ok := <-in:
				if !ok {
					return
				}
				msg = m
			case <-ctx.Done():
				return
			case <-r.closing:
				return
			}
			p, okp := kafka.MessagePartitionFromCtx(msg.Context())
			offset, oko := kafka.MessagePartitionOffsetFromCtx(msg.Context())
			end, noted := pending[p]
			if okp && oko && (!noted || offset >= end) {
				continue // produced after Subscribe: held back
			}
			select {
			case out <- msg:
			case <-ctx.Done():
				return
			case <-r.closing:
				return
			}
			if okp && oko && offset+1 >= end {
				delete(pending, p)
			}
		}
	}()
	return out, nil
}

// pending returns, for each partition with records the group has not
// committed, the end offset it has now.
func (r *kafkaRound) pending(topic string) (map[int32]int64, error) {
	partitions, err := r.b.partitions(topic)
	if err != nil {
		return nil, err
	}
	committed, err := r.b.committed(topic, partitions)
	if err != nil {
		return nil, err
	}
	pending := map[int32]int64{}
	for _, p := range partitions {
		newest, err := r.b.client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return nil, fmt.Errorf("redrive: end of %s/%d: %w", topic, p, err)
		}
		oldest, err := r.b.client.GetOffset(topic, p, sarama.OffsetOldest)
		if err != nil {
			return nil, fmt.Errorf("redrive: start of %s/%d: %w", topic, p, err)
		}
		if newest > max(committed[p], oldest) {
			pending[p] = newest
		}
	}
	return pending, nil
}

func (r *kafkaRound) Close() error {
	r.once.Do(func() { close(r.closing) })
	return r.sub.Close()
}
