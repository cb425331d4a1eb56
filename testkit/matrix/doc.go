// Package matrix runs the kit's production wiring on every broker it
// documents, each set up as its page under docs/brokers shows it (Redis
// Streams, RabbitMQ, NATS JetStream, Kafka on kfake with and without topic
// auto-creation, watermill-sql on PostgreSQL, GoChannel), against the
// scenarios its users meet: duplicates, a poison message and a flaky one,
// a graceful restart and a SIGKILL (right after dead letters, and while a
// message is held), a handler slower than the broker's deadline, a slow
// failing handler, and bq-idempotency redrive. A ledger in Redis counts
// every run and every effect, across the consumer processes the test
// starts (the test binary, run again).
//
// Only its tests live here: go test ./testkit/matrix, or one broker with
// -run 'Matrix/nats'.
package matrix
