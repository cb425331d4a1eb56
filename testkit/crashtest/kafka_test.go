package crashtest

import (
	"bytes"
	"context"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/testkit/kafkatest"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

const kafkaKills = 4

// TestKafkaConsumerKilledMidBatch: two consumer processes in one Kafka
// consumer group apply a ledger of 1,000 messages (a fifth produced twice)
// through the transactional inbox on PostgreSQL, produced in four batches.
// One consumer runs throughout; for each batch another joins, applies some
// of it and is SIGKILLed mid-batch; the last one is not replaced. A killed consumer's partitions go to
// the others once its session times out, with the deliveries it had
// applied but not committed to Kafka: those come again elsewhere and are
// skipped. The ledger ends exact: every message once, nothing lost.
func TestKafkaConsumerKilledMidBatch(t *testing.T) {
	if testing.Short() {
		t.Skip("kills consumer processes and waits out the group's session timeout each time")
	}
	t.Parallel()
	k := kafkatest.Start(t)
	db := testenv.Postgres(t)
	ctx := context.Background()
	suffix := testenv.RandomHex(4)
	topic := "bq_crash_kafka_" + suffix
	ledger, table := "crash_kafka_ledger_"+suffix, "crash_kafka_idem_"+suffix
	k.Topic(t, topic, 6)
	group := k.Group(t, "ledger")
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+ledger+` (message_id text NOT NULL, amount bigint NOT NULL, consumer text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS `+ledger+`, `+table) })
	store, err := postgresstore.New(db, postgresstore.WithTable(table))
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	const perRound = 250
	var want int64

	env := append(os.Environ(), "CRASHTEST_ROLE=kafka-consumer", kafkatest.EnvBrokers+"="+strings.Join(k.Brokers, ","),
		"CRASHTEST_TOPIC="+topic, "CRASHTEST_GROUP="+group, "CRASHTEST_LEDGER="+ledger, "CRASHTEST_STORE="+table)
	consumer := func(name string, logs *bytes.Buffer) *exec.Cmd {
		cmd := exec.Command(os.Args[0], "-test.run=^TestConsumerProcess$", "-test.count=1", "-test.v")
		cmd.Env = append(env, "CRASHTEST_CONSUMER="+name)
		cmd.Stdout, cmd.Stderr = logs, logs
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		return cmd
	}
	applied := func(who string) (n int64) {
		_ = db.QueryRowContext(ctx, `SELECT count(*) FROM `+ledger+` WHERE consumer = $1`, who).Scan(&n)
		return n
	}
	var stableLogs, victimLogs bytes.Buffer
	stable := consumer("stable", &stableLogs)
	defer func() {
		_ = stable.Process.Signal(syscall.SIGTERM)
		_ = stable.Wait()
	}()
	deadline := time.Now().Add(3 * time.Minute)
	var messages int64
	publish := func() {
		want += kafkaPublish(t, k, topic, int(messages), perRound)
		messages += perRound
	}
	for kill := 0; kill < kafkaKills; kill++ {
		// A batch for both: the victim joins, the group rebalances (once
		// the last victim's session timed out), and both apply it.
		publish()
		victim := consumer("victim", &victimLogs)
		// Kill it mid-batch: once it has applied something since it
		// started. On a slow machine the stable consumer may finish the
		// batch before the group gave the victim partitions: then another
		// batch, until the victim has some of its own.
		before := applied("victim")
		for applied("victim") == before && time.Now().Before(deadline) {
			if k.Backlog(t, group, topic) == 0 {
				publish()
			}
			time.Sleep(20 * time.Millisecond)
		}
		time.Sleep(time.Duration(mrand.IntN(200)) * time.Millisecond)
		_ = victim.Process.Signal(syscall.SIGKILL)
		_ = victim.Wait()
		if time.Now().After(deadline) {
			t.Fatalf("the victim applied nothing after %d kills; its output:\n%s", kill, tail(victimLogs.Bytes()))
		}
	}
	afterKills := applied("stable")
	for k.Backlog(t, group, topic) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("backlog %d after the kills; the stable consumer's output:\n%s", k.Backlog(t, group, topic), tail(stableLogs.Bytes()))
		}
		time.Sleep(50 * time.Millisecond)
	}
	var sum, rows, distinct int64
	if err := db.QueryRowContext(ctx, `SELECT coalesce(sum(amount), 0), count(*), count(DISTINCT message_id) FROM `+ledger).Scan(&sum, &rows, &distinct); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: %d messages, %d SIGKILLs of one of two consumers; ledger: %d entries (%d by the victim, %d by the consumer that stayed, %d of them after the last kill), total %d (exact %d)",
		k.Name, messages, kafkaKills, rows, applied("victim"), applied("stable"), applied("stable")-afterKills, sum, want)
	if distinct != messages {
		t.Fatalf("%d of %d messages reached the ledger: messages were lost", distinct, messages)
	}
	if sum != want || rows != messages {
		t.Fatalf("ledger total %d over %d entries, want exactly %d over %d", sum, rows, want, messages)
	}
}

// kafkaPublish produces the ledger credits from+1 to from+n, a fifth of
// them twice, and returns their total.
func kafkaPublish(t *testing.T, k *kafkatest.Cluster, topic string, from, n int) (total int64) {
	t.Helper()
	pub := k.Publisher(t)
	var batch []*message.Message
	for i := from; i < from+n; i++ {
		amount := int64(i + 1)
		total += amount
		e, err := envelope.New("urn:babel:ledger:credit", map[string]any{"amount": amount})
		if err != nil {
			t.Fatal(err)
		}
		payload, _ := e.Marshal()
		batch = append(batch, message.NewMessage(e.Meta.ID, payload))
		if i%5 == 0 {
			batch = append(batch, message.NewMessage(e.Meta.ID, payload))
		}
	}
	if err := pub.Publish(topic, batch...); err != nil {
		t.Fatal(err)
	}
	return total
}

// consumeKafka is the consumer TestKafkaConsumerKilledMidBatch kills.
func consumeKafka(ctx context.Context) error {
	topic, group, ledger, name := os.Getenv("CRASHTEST_TOPIC"), os.Getenv("CRASHTEST_GROUP"), os.Getenv("CRASHTEST_LEDGER"), os.Getenv("CRASHTEST_CONSUMER")
	db, store, err := openStore()
	if err != nil {
		return err
	}
	defer db.Close()
	logger := watermill.NopLogger{}
	sub, err := kafka.NewSubscriber(kafkatest.SubscriberConfig(strings.Split(os.Getenv(kafkatest.EnvBrokers), ","), group), logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		return err
	}
	router.AddMiddleware(idempotency.Middleware(store, idempotency.WithTransaction(db)))
	router.AddConsumerHandler("ledger", topic, sub, func(msg *message.Message) error {
		id, amount, err := credit(msg)
		if err != nil {
			return err
		}
		tx, ok := postgresstore.TxFromContext(msg.Context())
		if !ok {
			return fmt.Errorf("no transaction in the transactional mode")
		}
		time.Sleep(2 * time.Millisecond) // the effect takes a moment: kills land mid-batch
		_, err = tx.ExecContext(msg.Context(), `INSERT INTO `+ledger+` (message_id, amount, consumer) VALUES ($1, $2, $3)`,
			id, strconv.FormatInt(amount, 10), name)
		return err
	})
	return router.Run(ctx)
}
