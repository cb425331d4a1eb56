package main

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/nats-io/nats.go"

	"github.com/babelqueue/watermill-idempotency/redrive"
)

// natsConnectTimeout bounds the connection to NATS.
const natsConnectTimeout = 10 * time.Second

// natsRedriveAckWait is the AckWait of the consumer a run reads with: a
// run that died holding a message leaves it to the next run that long.
const natsRedriveAckWait = 30 * time.Second

// openNATS opens NATS JetStream as watermill-nats uses it: a topic is a
// subject, kept by the stream that captures it. The dead-letter topic is
// read through the durable pull consumer --group of its stream (created on
// the first run and left in place: the next run goes on from its acks),
// one message fetched at a time (redrive.NATSSubscriber), and browsed by stream sequence from that
// consumer's ack floor for a dry run, which creates no consumer. Moved
// messages are published to their topic's stream; a topic no stream
// captures is an error (no stream is created).
func openNATS(cfg brokerConfig) (*broker, error) {
	url := cfg.conn.nats()
	admin, err := nats.Connect(url, nats.Timeout(natsConnectTimeout), nats.Name("bq-idempotency"))
	if err != nil {
		return nil, fmt.Errorf("nats at %s: %w", url, err)
	}
	js, err := admin.JetStream()
	if err != nil {
		admin.Close()
		return nil, fmt.Errorf("nats at %s: %w", url, err)
	}
	b := &broker{browser: redrive.NATSBrowser(js, cfg.group, nil), close: admin.Close}
	b.count = func(ctx context.Context, topic string) (int64, error) { return browseCount(ctx, b.browser, topic) }
	if cfg.dryRun {
		return b, nil
	}
	pubConn, err := nats.Connect(url, nats.Timeout(natsConnectTimeout), nats.Name("bq-idempotency redrive"))
	if err != nil {
		b.close()
		return nil, fmt.Errorf("nats at %s: %w", url, err)
	}
	// No AutoProvision: a topic no stream captures fails the publish
	// rather than getting a stream of its own.
	pub, err := wnats.NewPublisherWithNatsConn(pubConn, wnats.PublisherPublishConfig{
		Marshaler: &wnats.NATSMarshaler{}, SubjectCalculator: wnats.DefaultSubjectCalculator,
	}, watermill.NopLogger{})
	if err != nil {
		pubConn.Close()
		b.close()
		return nil, fmt.Errorf("nats: %w", err)
	}
	sub := redrive.NATSSubscriber(js, cfg.group, natsRedriveAckWait, nil)
	b.sub, b.pub = sub, pub
	b.close = func() { _ = sub.Close(); _ = pub.Close(); admin.Close() }
	return b, nil
}
