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
