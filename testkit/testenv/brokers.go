package testenv

import (
	"context"
	"database/sql"
	"errors"
	"net/url"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/go-sql-driver/mysql" // the "mysql" database/sql driver (MariaDB)
	"github.com/nats-io/nats.go"
	amqp "github.com/rabbitmq/amqp091-go"
)

// Defaults for the broker and MariaDB environment variables.
const (
	DefaultAMQPURL    = "amqp://guest:guest@localhost:5672/"
	DefaultNATSURL    = "nats://localhost:4222"
	DefaultMariaDBDSN = "root@tcp(127.0.0.1:3306)/test"
)

// AMQPURL returns AMQP_URL after checking that RabbitMQ answers there.
func AMQPURL(t testing.TB) string {
	t.Helper()
	u := Getenv("AMQP_URL", DefaultAMQPURL)
	conn, err := amqp.DialConfig(u, amqp.Config{Dial: amqp.DefaultDial(3 * time.Second)})
	if err != nil {
		Unavailable(t, "RabbitMQ at "+Redact(u), err, "start it with `docker compose up -d rabbitmq` or set AMQP_URL")
		return ""
	}
	_ = conn.Close()
	return u
}

// AMQP returns a connection to AMQP_URL, closed when the test ends.
func AMQP(t testing.TB) *amqp.Connection {
	t.Helper()
	u := AMQPURL(t)
	conn, err := amqp.Dial(u)
	if err != nil {
		t.Fatalf("RabbitMQ at %s: %v", Redact(u), err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// BrowseAMQP returns the messages ready on queue, in order, without
// consuming them: each is got without an ack on a channel of its own,
// which is then closed, so RabbitMQ puts every one back. A queue that does
// not exist holds none. unmarshal reads a delivery (amqpmarshal.Marshaler's
// Unmarshal for the BabelQueue binding).
func BrowseAMQP(t testing.TB, conn *amqp.Connection, queue string, unmarshal func(amqp.Delivery) (*message.Message, error)) []*message.Message {
	t.Helper()
	ch, ok := passiveQueue(t, conn, queue)
	if !ok {
		return nil
	}
	defer ch.Close()
	var msgs []*message.Message
	for {
		d, ok, err := ch.Get(queue, false)
		if err != nil {
			t.Fatalf("get from %s: %v", queue, err)
		}
		if !ok {
			return msgs
		}
		msg, err := unmarshal(d)
		if err != nil {
			t.Fatalf("a message on %s: %v", queue, err)
		}
		msgs = append(msgs, msg)
	}
}

// AMQPReady returns how many messages are ready on queue (0 when it does
// not exist). A message a consumer holds unacknowledged is counted only
// once that consumer is gone.
func AMQPReady(t testing.TB, conn *amqp.Connection, queue string) int {
	t.Helper()
	ch, ok := passiveQueue(t, conn, queue)
	if !ok {
		return 0
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		t.Fatalf("queue %s: %v", queue, err)
	}
	return q.Messages
}

// passiveQueue opens a channel on conn and checks that the durable queue
// exists; a missing queue closes its channel, so each call has one of its
// own. ok is false, and no channel open, when the queue does not exist.
func passiveQueue(t testing.TB, conn *amqp.Connection, queue string) (*amqp.Channel, bool) {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	_, err = ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.NotFound {
		return nil, false
	}
	if err != nil {
		_ = ch.Close()
		t.Fatalf("queue %s: %v", queue, err)
	}
	return ch, true
}

// NATSURL returns NATS_URL after checking that a NATS server with JetStream
// answers there.
func NATSURL(t testing.TB) string {
	t.Helper()
	u := Getenv("NATS_URL", DefaultNATSURL)
	nc, err := nats.Connect(u, nats.Timeout(3*time.Second))
	if err == nil {
		defer nc.Close()
		var js nats.JetStreamContext
		if js, err = nc.JetStream(); err == nil {
			_, err = js.AccountInfo()
		}
	}
	if err != nil {
		Unavailable(t, "NATS (JetStream) at "+Redact(u), err, "start it with `docker compose up -d nats` or set NATS_URL")
		return ""
	}
	return u
}

// JetStream returns NATS_URL and a JetStream context on a connection of
// its own; the streams named are deleted when the test ends, then the
// connection is closed.
func JetStream(t testing.TB, streams ...string) (string, nats.JetStreamContext) {
	t.Helper()
	u := NATSURL(t)
	nc, err := nats.Connect(u)
	if err != nil {
		t.Fatal(err)
	}
	js, err := nc.JetStream()
	if err != nil {
		nc.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		defer nc.Close()
		for _, s := range streams {
			if err := js.DeleteStream(s); err != nil && !errors.Is(err, nats.ErrStreamNotFound) {
				t.Errorf("delete stream %s: %v", s, err)
			}
		}
	})
	return u, js
}

// streamStoreFailed is the code of a NATS server that could not create a
// stream's store. nats-server 2.9 returns it for a stream created while
// another stream of the same account is being deleted: the deletion
// removed the account's directory ("mkdir …/jetstream/$G/streams: no such
// file or directory") under the creation. The next try succeeds.
const streamStoreFailed nats.ErrorCode = 10077

// AddStream creates a stream for a test. While the server reports that it
// could not create the stream's store (streamStoreFailed, a race of the
// server's with a concurrent deletion), it tries again, for up to 10
// seconds; any other error fails the test.
func AddStream(t testing.TB, js nats.JetStreamManager, cfg *nats.StreamConfig) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := js.AddStream(cfg)
		var apiErr *nats.APIError
		switch {
		case err == nil:
			return
		case errors.As(err, &apiErr) && apiErr.ErrorCode == streamStoreFailed && time.Now().Before(deadline):
			t.Logf("create stream %s: %v; trying again", cfg.Name, err)
			time.Sleep(20 * time.Millisecond)
		default:
			t.Fatalf("create stream %s: %v", cfg.Name, err)
		}
	}
}

// NATSSubscriber is a watermill-nats subscriber on a connection of its
// own, closed when the test ends. Subscriber.Close only drains its
// connection, which closes in the background: the cleanup waits for that.
// Closing the connection while the drain runs would leave the drain's
// goroutine behind for its 5 s flush (it flips the closed connection back
// to draining, then waits for a PONG that never comes), for goleak to find.
func NATSSubscriber(t testing.TB, url string, config wnats.SubscriberConfig) *wnats.Subscriber {
	t.Helper()
	closed := make(chan struct{})
	nc, err := nats.Connect(url, nats.ClosedHandler(func(*nats.Conn) { close(closed) }))
	if err != nil {
		t.Fatal(err)
	}
	sub, err := wnats.NewSubscriberWithNatsConn(nc, config.GetSubscriberSubscriptionConfig(), watermill.NopLogger{})
	if err != nil {
		nc.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = sub.Close()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Errorf("the NATS connection did not close within 10 s of the subscriber's drain")
			nc.Close()
		}
	})
	return sub
}

// MariaDB returns a database for MARIADB_DSN (go-sql-driver/mysql syntax),
// closed when the test ends.
func MariaDB(t testing.TB) *sql.DB {
	t.Helper()
	dsn := Getenv("MARIADB_DSN", DefaultMariaDBDSN)
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatalf("MARIADB_DSN: %v", err)
	}
	t.Cleanup(func() { _ = db.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		Unavailable(t, "MariaDB", err, "start it with `docker compose up -d mariadb` or set MARIADB_DSN")
	}
	return db
}

// Redact returns a URL with its password replaced by "xxxxx", for messages.
// A string that is not a URL is returned as "<unparsable URL>".
func Redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "<unparsable URL>"
	}
	return u.Redacted()
}
