package kafkamarshal_test

import (
	"context"
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/marshal/kafkamarshal"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/memstore"
)

// A router consuming Kafka through watermill-kafka and the binding, with
// the kit: an order produced twice (a producer that did not get its
// acknowledgement sends again) is charged once. Here the Kafka is franz-go's
// in-process kfake; give a real one's addresses as Brokers. The sarama
// Version is the oldest protocol Kafka 4 still speaks (watermill-kafka's
// default is older); a new group reads the topic from its oldest record.
func Example_router() {
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.AllowAutoTopicCreation())
	if err != nil {
		panic(err)
	}
	defer cluster.Close()
	brokers := cluster.ListenAddrs()
	config := sarama.NewConfig()
	config.Version = sarama.V2_1_0_0
	config.Producer.Return.Successes = true
	config.Consumer.Offsets.Initial = sarama.OffsetOldest
	logger := watermill.NopLogger{}

	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: kafkamarshal.Marshaler{}, OverwriteSaramaConfig: config}, logger)
	if err != nil {
		panic(err)
	}
	defer pub.Close()
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers: brokers, ConsumerGroup: "orders-workers", Unmarshaler: kafkamarshal.Marshaler{}, OverwriteSaramaConfig: config,
	}, logger)
	if err != nil {
		panic(err)
	}

	skipped := make(chan string, 1)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		panic(err)
	}
	router.AddMiddleware(idempotency.Middleware(memstore.New(), idempotency.WithObserver(idempotency.ObserverFunc(
		func(_ context.Context, e idempotency.Event) {
			if e.Outcome == idempotency.OutcomeSkip {
				skipped <- "the copy skipped"
			}
		}))))
	router.AddConsumerHandler("charge", "orders", sub, func(msg *message.Message) error {
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			return err
		}
		fmt.Println("charged", e.Meta.ID)
		return nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	go func() { _ = router.Run(ctx) }()
	<-router.Running()

	order, _ := envelope.New("urn:babel:orders:charge", map[string]int{"order": 1042},
		envelope.WithID("f1e2d3c4-b5a6-4789-90ab-cdef01234567"))
	body, _ := order.Marshal()
	if err := pub.Publish("orders", message.NewMessage(order.Meta.ID, body), message.NewMessage(order.Meta.ID, body)); err != nil {
		panic(err)
	}
	select {
	case s := <-skipped:
		fmt.Println(s)
	case <-ctx.Done():
		fmt.Println("timed out")
	}
	_ = router.Close()
	// Output:
	// charged f1e2d3c4-b5a6-4789-90ab-cdef01234567
	// the copy skipped
}
