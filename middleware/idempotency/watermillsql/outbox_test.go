package watermillsql_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency/watermillsql"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// collector is the broker the relay publishes to.
type collector struct {
	mu   sync.Mutex
	msgs map[string][]string // payloads by topic
}

func (c *collector) Publish(topic string, msgs ...*message.Message) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, m := range msgs {
		c.msgs[topic] = append(c.msgs[topic], string(m.Payload))
	}
	return nil
}

func (c *collector) Close() error { return nil }

func (c *collector) got(topic string) []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.msgs[topic]...)
}

// TestOutboxRelaysOnlyCommittedRows: rows written in a transaction that
// rolls back are never relayed; rows of a committed one are, to their
// destination topics, with their payloads.
func TestOutboxRelaysOnlyCommittedRows(t *testing.T) {
	t.Parallel()
	db := testenv.PostgresForSubscriber(t)
	ctx := context.Background()
	topic := "bq_test_outbox_" + testenv.RandomHex(4)
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), fmt.Sprintf(`DROP TABLE IF EXISTS "watermill_%s", "watermill_offsets_%s"`, topic, topic))
	})
	if _, err := watermillsql.NewOutbox(ctx, db, watermillsql.OutboxConfig{}); !errors.Is(err, watermillsql.ErrNoTopic) {
		t.Fatalf("no topic: %v", err)
	}
	outbox, err := watermillsql.NewOutbox(ctx, db, watermillsql.OutboxConfig{Topic: topic, PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if outbox.Topic() != topic {
		t.Fatalf("Topic() = %q", outbox.Topic())
	}
	write := func(commit bool, dest, payload string) {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		pub, err := outbox.Publisher(tx)
		if err != nil {
			t.Fatal(err)
		}
		if err := pub.Publish(dest, message.NewMessage(watermill.NewUUID(), []byte(payload))); err != nil {
			t.Fatal(err)
		}
		if commit {
			err = tx.Commit()
		} else {
			err = tx.Rollback()
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	write(false, "a", `{"n":0}`)
	write(true, "a", `{"n":1}`)
	write(false, "b", `{"n":2}`)
	write(true, "b", `{"n":3}`)

	broker := &collector{msgs: map[string][]string{}}
	relay, err := outbox.NewForwarder(broker)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	defer func() {
		if err := relay.Close(); err != nil {
			t.Error(err)
		}
		<-done
	}()
	deadline := time.Now().Add(20 * time.Second)
	for !testenv.SQLTopicDrained(ctx, db, topic, "forwarder") {
		if time.Now().After(deadline) {
			t.Fatal("the relay did not drain the outbox")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if a, b := broker.got("a"), broker.got("b"); len(a) != 1 || a[0] != `{"n":1}` || len(b) != 1 || b[0] != `{"n":3}` {
		t.Fatalf("relayed a=%v b=%v: want only the committed rows", a, b)
	}
}
