package main

import (
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"

	"github.com/babelqueue/watermill-idempotency/internal/kafkasession"
	"github.com/babelqueue/watermill-idempotency/marshal/kafkamarshal"
	"github.com/babelqueue/watermill-idempotency/redrive"
)

// kafkaJoinWait bounds how long a run waits for its consumer group to hand
// it the dead-letter topic's partitions before --idle starts counting.
const kafkaJoinWait = time.Minute

// kafkaConfig is the sarama configuration of a redrive on Kafka: the
// protocol of Kafka 2.1 (the oldest Kafka 4 still speaks), and a group
// that has no offset yet reads the dead-letter topic from its oldest
// record.
func kafkaConfig() *sarama.Config {
	c := sarama.NewConfig()
	c.Version = sarama.V2_1_0_0
	c.ClientID = "bq-idempotency"
	c.Net.DialTimeout = 10 * time.Second
	c.Producer.Return.Successes = true // watermill-kafka's SyncProducer
	c.Consumer.Return.Errors = true
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	return c
}

// openKafka opens Kafka with watermill-kafka and the BabelQueue Kafka
// binding (kafkamarshal): the dead-letter topic is read by consumer group
// --group, which commits what the run acked, and browsed from the group's
// committed offsets for a dry run, which joins and commits nothing. A run
// reads what the group had not committed when it began, every partition to
// its end (redrive.KafkaRound), and stops there: what it puts back waits for
// the next run.
func openKafka(cfg brokerConfig) (*broker, error) {
	addrs := cfg.conn.kafka()
	if len(addrs) == 0 {
		return nil, usageErr("--kafka-brokers: no address")
	}
	client, err := sarama.NewClient(addrs, kafkaConfig())
	if err != nil {
		return nil, fmt.Errorf("kafka at %v: %w", addrs, err)
	}
	b := &broker{browser: redrive.KafkaBrowser(client, cfg.group, kafkamarshal.Marshaler{}), close: func() { _ = client.Close() }}
	if cfg.dryRun {
		return b, nil
	}
	logger := watermill.NopLogger{}
	joined := kafkasession.New()
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers: addrs, ConsumerGroup: cfg.group, Unmarshaler: kafkamarshal.Marshaler{},
		OverwriteSaramaConfig: kafkaConfig(), Tracer: joined,
	}, logger)
	if err != nil {
		b.close()
		return nil, fmt.Errorf("kafka: %w", err)
	}
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: addrs, Marshaler: kafkamarshal.Marshaler{}, OverwriteSaramaConfig: kafkaConfig()}, logger)
	if err != nil {
		_ = sub.Close()
		b.close()
		return nil, fmt.Errorf("kafka: %w", err)
	}
	round := redrive.KafkaRound(sub, client, cfg.group)
	// --idle counts from the group's first assignment.
	b.sub, b.pub = kafkasession.Joining(round, joined, kafkaJoinWait), pub
	b.close = func() { _ = round.Close(); _ = pub.Close(); _ = client.Close() }
	return b, nil
}
