// Package kafkatopics checks Kafka topics for the dead-letter middleware
// (deadletter.TopicChecker): the dead-letter topic exists, or is created,
// before the first message of the topic it serves is handled.
//
// A Kafka whose brokers create topics on first use (auto.create.topics.enable,
// Kafka's default) takes a dead letter to a new "<topic>.dlq" as it is. Most
// managed clusters turn that off: the dead letter's publish then fails
// after the producer's retries, the original is nacked and handled again,
// and its partition stalls behind it for ever. Topics finds that out before
// the first message, and creates the topic when given WithCreate:
//
//	client, err := sarama.NewClient(brokers, config)
//	...
//	topics := kafkatopics.NewTopics(client, kafkatopics.WithCreate(sarama.TopicDetail{NumPartitions: 3, ReplicationFactor: 3}))
//	dlq, err := deadletter.Middleware(publisher, deadletter.WithTopicCheck(topics))
package kafkatopics

import (
	"context"
	"errors"
	"fmt"

	"github.com/IBM/sarama"
)

// ErrNoTopic is matched by the check of a topic that does not exist and
// that the check may not create (no WithCreate, and the brokers do not
// create topics on first use).
var ErrNoTopic = errors.New("kafkatopics: the topic does not exist")

// Topics checks topics through a sarama client.
type Topics struct {
	client sarama.Client
	create *sarama.TopicDetail
}

// Option configures Topics.
type Option func(*Topics)

// WithCreate creates a missing topic with detail (its partitions,
// replication factor and configuration) instead of failing the check. The
// client's principal needs the right to create topics.
func WithCreate(detail sarama.TopicDetail) Option {
	return func(t *Topics) { t.create = &detail }
}

// NewTopics returns the checker of topics on client's cluster. It does
// not close client.
func NewTopics(client sarama.Client, opts ...Option) *Topics {
	t := &Topics{client: client}
	for _, opt := range opts {
		opt(t)
	}
	return t
}

// CheckTopic returns nil when topic exists: it did, the brokers created it
// on this first use (as for a producer, when the client's
// Metadata.AllowAutoTopicCreation and the brokers' auto.create.topics.enable
// allow it), or it was created with WithCreate's detail. Otherwise it
// fails with ErrNoTopic naming the topic and the fix. sarama takes no
// context: when ctx ends first, CheckTopic returns ctx's error and the
// request ends by the client's own timeouts.
func (t *Topics) CheckTopic(ctx context.Context, topic string) error {
	done := make(chan error, 1)
	go func() { done <- t.check(topic) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("kafka topic %q: %w", topic, context.Cause(ctx))
	}
}

func (t *Topics) check(topic string) error {
	err := t.client.RefreshMetadata(topic)
	if err == nil {
		return nil
	}
	if !errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
		return fmt.Errorf("kafka topic %q: %w", topic, err)
	}
	if t.create == nil {
		return fmt.Errorf("kafka topic %q: %w and the brokers do not create topics on first use: "+
			"create it (kafka-topics.sh --create --topic %s), or let the check create it with kafkatopics.WithCreate", topic, ErrNoTopic, topic)
	}
	admin, err := sarama.NewClusterAdminFromClient(t.client)
	if err != nil {
		return fmt.Errorf("kafka topic %q: %w", topic, err)
	}
	// Closing admin would close the client it shares: it holds nothing
	// else.
	err = admin.CreateTopic(topic, t.create, false)
	if err != nil && !errors.Is(err, sarama.ErrTopicAlreadyExists) {
		return fmt.Errorf("kafka topic %q: create it: %w", topic, err)
	}
	if err := t.client.RefreshMetadata(topic); err != nil {
		return fmt.Errorf("kafka topic %q: created, but its metadata: %w", topic, err)
	}
	return nil
}
