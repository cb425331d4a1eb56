// Package amqpmarshal speaks the BabelQueue RabbitMQ binding for
// watermill-amqp v3, so that a Watermill router consumes what the PHP,
// Python and Go BabelQueue SDKs publish over AMQP 0-9-1, and publishes what
// they consume.
//
//	config := amqpmarshal.NewConfig("amqp://guest:guest@localhost:5672/")
//	sub, _ := amqp.NewSubscriber(config, logger)
//	pub, _ := amqpmarshal.NewPublisher(config, logger)
//
// # The wire
//
// Topology: a durable queue named after the Watermill topic, the default
// exchange, routing key = queue, persistent delivery ([NewConfig]). Properties
// of a message whose body is an envelope: type = job, correlation_id =
// trace_id, message_id = meta.id, app_id = "babelqueue", content_type =
// "application/json"; headers with native AMQP types: x-schema-version and
// x-attempts as integers, x-source-lang as a string, beside the message's
// out-of-band metadata (a W3C traceparent, …), which never overrides them. The
// body is the envelope, byte for byte.
//
// On consume ([Marshaler.Unmarshal]), headers of any AMQP type are accepted
// and kept as metadata, integers and other values as their decimal or
// printed form; message_id becomes the Watermill UUID and, with type and
// correlation_id, the bq-message-id, bq-job and bq-trace-id metadata.
//
// # A message the marshaler cannot read
//
// There is none: Unmarshal never fails. watermill-amqp nacks with requeue a
// delivery its marshaler rejects, before any handler or middleware sees it,
// so one unreadable message is redelivered in a tight loop for ever (the
// stock marshaler does that to every SDK message, whose x-attempts is an
// integer). Here a header of any type is stringified, and a body that is not
// an envelope is handed to the handler as it is (Watermill UUID: message_id,
// else a fresh UUID). The kit's guard runs the handler for it without
// deduplication, the handler's decode fails, and the dead-letter middleware
// moves it to the dead-letter queue verbatim: the delivery is read once and
// acked once.
//
// # Failures
//
// A delivery the router nacks (its handler failed) is requeued by RabbitMQ
// and comes straight back. Put Watermill's Retry middleware (with a backoff)
// and the kit's dead-letter middleware in front of the handler, as the SDKs
// retry a few times and then dead-letter to "<queue>.dlq".
//
// # Dead letters are not lost
//
// RabbitMQ silently drops a message published to the default exchange with
// a routing key that names no queue, and confirms it. The dead-letter
// middleware would then ack the original: the message is gone. [Publisher]
// declares the destination queue (durable, as the SDKs do) before the first
// publication to a topic, and publishes every message mandatory and with
// publisher confirms. A queue deleted after that (an operator purging the
// dead-letter queue by deleting it) makes RabbitMQ return the message
// before confirming it: the publisher declares the queue again and
// publishes the message once more. So a dead letter is either on a queue
// the broker confirmed, or its publication fails ([ErrDeclareQueue],
// [ErrUnroutable], no confirm) and the middleware nacks the original for
// redelivery. What RabbitMQ loses after its confirm (a queue deleted with
// the dead letters on it, a broker that is not durable) is beyond a
// publisher.
//
// On the consuming side, use watermill-amqp's subscriber,
// github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp.NewSubscriber, with
// [NewConfig].
package amqpmarshal
