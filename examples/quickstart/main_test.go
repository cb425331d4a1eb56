package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func TestQuickStartExample(t *testing.T) {
	t.Parallel()
	testenv.Redis(t)
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := run(ctx, &out, testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL)); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	for _, want := range []string{"dead-lettered after 4 runs", "3 orders, each charged once"} {
		if !strings.Contains(out.String(), want) {
			t.Fatalf("output lacks %q:\n%s", want, out.String())
		}
	}
}

// TestNewcomersRun is the run a newcomer makes with the README's first
// wiring (wire, as the README shows it): two consumers in one Redis
// Streams consumer group, redisstore, a handler that inserts a charge into
// PostgreSQL, 800 payments with 200 of them sent twice right after their
// originals, and one body that is not an envelope. Every payment is
// charged once (with the wiring the README showed first before, 88 of the
// 200 duplicates were charged twice), and the unreadable body is
// dead-lettered after its bounded retries instead of coming back for ever
// (287 redeliveries in 45 s before).
func TestNewcomersRun(t *testing.T) {
	t.Parallel()
	redisClient := testenv.Redis(t)
	db := testenv.Postgres(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	payments, duplicates := 800, 200
	if testing.Short() {
		payments, duplicates = 200, 50
	}
	run := testenv.RandomHex(4)
	topic, prefix, table := "bq-newcomer-"+run, "bq-newcomer-"+run+":", "charges_"+run
	t.Cleanup(func() { cleanup(context.Background(), redisClient, topic, prefix) })
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+table+` (order_id text NOT NULL, amount_cents bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP TABLE `+table) })

	store := redisstore.New(redisClient, redisstore.WithPrefix(prefix), redisstore.WithTTL(time.Hour))
	// The broker's client: watermill-redisstream closes it with the
	// subscribers.
	brokerClient := redis.NewClient(redisClient.Options())
	logger := watermill.NopLogger{}
	publisher, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: brokerClient}, logger)
	if err != nil {
		t.Fatal(err)
	}
	var unreadableRuns atomic.Int32
	charge := func(msg *message.Message) error {
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			unreadableRuns.Add(1)
			return fmt.Errorf("unreadable payment: %w", err)
		}
		var p payment
		if err := json.Unmarshal(e.Data, &p); err != nil {
			return err
		}
		_, err = db.ExecContext(msg.Context(), `INSERT INTO `+table+` VALUES ($1, $2)`, p.OrderID, p.AmountCents)
		return err
	}
	for consumer := range 2 {
		subscriber, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
			Client: brokerClient, ConsumerGroup: "payments", Consumer: fmt.Sprintf("consumer-%d", consumer), OldestId: "0",
		}, logger)
		if err != nil {
			t.Fatal(err)
		}
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
		if err != nil {
			t.Fatal(err)
		}
		if err := wire(router, publisher, store); err != nil {
			t.Fatal(err)
		}
		router.AddConsumerHandler("charge", topic, subscriber, charge)
		testenv.RunRouter(t, router)
	}
	dlqSubscriber, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client: brokerClient, ConsumerGroup: "triage", OldestId: "0"}, logger)
	if err != nil {
		t.Fatal(err)
	}
	defer dlqSubscriber.Close()
	letters, err := dlqSubscriber.Subscribe(ctx, topic+".dlq")
	if err != nil {
		t.Fatal(err)
	}

	for i := range payments {
		p := payment{OrderID: fmt.Sprint(10000 + i), AmountCents: int64(100 + i), Currency: "EUR"}
		for range 1 + boolInt(i < duplicates) { // a duplicate right after its original
			if err := send(publisher, topic, p); err != nil {
				t.Fatal(err)
			}
		}
		if i == payments/2 {
			if err := publisher.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("{not json"))); err != nil {
				t.Fatal(err)
			}
		}
	}

	select {
	case letter := <-letters:
		letter.Ack()
		if !bytes.Equal(letter.Payload, []byte("{not json")) {
			t.Fatalf("dead letter %q, want the unreadable body verbatim", letter.Payload)
		}
	case <-ctx.Done():
		t.Fatal("the unreadable body was never dead-lettered")
	}
	var rows, orders int
	for ctx.Err() == nil {
		if err := db.QueryRowContext(ctx, `SELECT count(*), count(DISTINCT order_id) FROM `+table).Scan(&rows, &orders); err != nil {
			t.Fatal(err)
		}
		if orders == payments && testenv.StreamDrained(ctx, redisClient, topic, "payments", payments+duplicates+1) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if orders != payments || rows != payments {
		t.Fatalf("%d charges for %d orders of %d payments: %d charged twice", rows, orders, payments, rows-orders)
	}
	if runs := unreadableRuns.Load(); runs != 4 {
		t.Fatalf("the unreadable body ran %d times, want 4 (one run and three retries)", runs)
	}
	select {
	case letter := <-letters:
		t.Fatalf("a second dead letter: %q", letter.Payload)
	case <-time.After(200 * time.Millisecond):
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestREADMEShowsTheWiring: the README's quick start shows wire as this
// example has it, so that TestNewcomersRun runs what a newcomer copies.
func TestREADMEShowsTheWiring(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	source, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	wireFunc := regexp.MustCompile(`(?ms)^func wire\(.*?^}\n`)
	example := wireFunc.Find(source)
	if example == nil {
		t.Fatal("main.go has no func wire")
	}
	if !bytes.Contains(readme, example) {
		t.Fatalf("the README does not show func wire as examples/quickstart/main.go has it:\n%s", example)
	}
}
