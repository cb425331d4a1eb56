// Command ordersapi is an orders API and a Watermill consumer sharing one
// PostgreSQL database and one record authority. The API guards POST /orders
// with the Idempotency-Key middleware in the transactional mode: the order,
// its "order created" message (an outbox row) and the key's record with the
// saved response commit in one transaction. Watermill's forwarder relays
// the outbox to a watermill-sql topic, where a consumer ships each order,
// with the transactional inbox: the shipment and the message's record
// commit together, so a message relayed twice ships once.
//
//	docker compose up -d --wait postgres   # or your own PostgreSQL; POSTGRES_DSN overrides
//	go run ./examples/ordersapi
//
// A client that times out before the API answers (the API answers slowly,
// after its commit) retries every order with the same key, three copies at
// once; the relay is made to send one message twice. The output shows one
// order and one shipment per key, and it exits 0 when that holds.
package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/httpidempotency"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency/watermillsql"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
)

func main() {
	dsn := os.Getenv("POSTGRES_DSN")
	if dsn == "" {
		dsn = "postgres://postgres@localhost:5432/test?sslmode=disable"
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := run(ctx, os.Stdout, dsn); err != nil {
		fmt.Fprintln(os.Stderr, "ordersapi:", err)
		os.Exit(1)
	}
}

type orderIn struct {
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
}

func run(ctx context.Context, out io.Writer, dsn string) error {
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(32)
	db.SetMaxIdleConns(32)
	if err := db.PingContext(ctx); err != nil {
		return fmt.Errorf("postgres: %w (start it with `docker compose up -d postgres`)", err)
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	run := hex.EncodeToString(b)
	orders, shipments, records := "example_orders_"+run, "example_shipments_"+run, "example_idempotency_"+run
	outboxTopic, createdTopic := "api_outbox_"+run, "orders_created_"+run
	defer db.ExecContext(context.WithoutCancel(ctx), fmt.Sprintf( //nolint:errcheck
		`DROP TABLE IF EXISTS %s, %s, %s, "watermill_%s", "watermill_offsets_%s", "watermill_%s", "watermill_offsets_%s"`,
		orders, shipments, records, outboxTopic, outboxTopic, createdTopic, createdTopic))

	// 1. Business tables, and one table of records for the API and the
	//    consumer alike.
	if _, err := db.ExecContext(ctx, `CREATE TABLE `+orders+` (id bigserial PRIMARY KEY, tenant text NOT NULL, idem_key text NOT NULL, amount bigint NOT NULL, currency text NOT NULL);
		CREATE TABLE `+shipments+` (id bigserial PRIMARY KEY, order_id text NOT NULL)`); err != nil {
		return err
	}
	store, err := postgresstore.New(db, postgresstore.WithTable(records))
	if err != nil {
		return err
	}
	defer store.Close() // ends the session its claims are held on (the pgx driver's default)
	if err := store.Migrate(ctx); err != nil {
		return err
	}

	// 2. The outbox the API writes its messages to, relayed to the
	//    orders-created topic (watermill-sql) after each commit.
	logger := watermill.NopLogger{}
	pub, err := wsql.NewPublisher(wsql.BeginnerFromStdSQL(db), wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, logger)
	if err != nil {
		return err
	}
	outbox, err := watermillsql.NewOutbox(ctx, db, watermillsql.OutboxConfig{Topic: outboxTopic, PollInterval: 20 * time.Millisecond})
	if err != nil {
		return err
	}
	relayed := &countingPublisher{Publisher: pub, topic: createdTopic}
	relay, err := outbox.NewForwarder(relayed)
	if err != nil {
		return err
	}

	// 3. The API: POST /orders in the transactional mode.
	guard, err := httpidempotency.New(store, func(r *http.Request) (string, error) {
		// A real API reads the tenant from the verified caller (a token's
		// claim); this example trusts a header its own client sets.
		if t := r.Header.Get("X-Tenant"); t != "" {
			return t, nil
		}
		return "", errors.New("not authenticated")
	}, httpidempotency.WithTransaction(db), httpidempotency.WithLease(10*time.Second), httpidempotency.WithLogger(nil))
	if err != nil {
		return err
	}
	var runs atomic.Int64
	createOrder := func(w http.ResponseWriter, r *http.Request, tx *sql.Tx) error {
		runs.Add(1)
		var in orderIn
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Amount <= 0 {
			http.Error(w, "an order needs a positive amount", http.StatusBadRequest)
			return nil
		}
		key, _ := httpidempotency.ParseKey(r.Header) // validated by the guard
		var id int64
		if err := tx.QueryRowContext(r.Context(), `INSERT INTO `+orders+` (tenant, idem_key, amount, currency) VALUES ($1, $2, $3, $4) RETURNING id`,
			r.Header.Get("X-Tenant"), key, in.Amount, in.Currency).Scan(&id); err != nil {
			return err
		}
		orderID := "ord_" + strconv.FormatInt(id, 10)
		// The message's meta.id derives from the order: a second relay of
		// it carries the same id, and the consumer's inbox skips it.
		e, err := envelope.New("urn:babel:orders:created", map[string]any{"order_id": orderID, "amount": in.Amount},
			envelope.WithID("order-created-"+orderID), envelope.WithQueue(createdTopic))
		if err != nil {
			return err
		}
		payload, err := e.Marshal()
		if err != nil {
			return err
		}
		outboxPub, err := outbox.Publisher(tx)
		if err != nil {
			return err
		}
		if err := outboxPub.Publish(createdTopic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
			return err
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/orders/"+orderID)
		w.WriteHeader(http.StatusCreated)
		return json.NewEncoder(w).Encode(map[string]string{"order_id": orderID})
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", slowAfterCommit(guard.WrapTx(httpidempotency.Operation{
		Name:        "orders.create",
		SaveHeaders: []string{"Location"},
		Expired:     httpidempotency.ExpiredIsNew,
	}, createOrder)))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	server := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = server.Serve(ln) }()
	defer server.Close()

	// 4. The consumer: ships each created order, with the transactional
	//    inbox on the same record table.
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db), wsql.SubscriberConfig{
		ConsumerGroup: "shipping", PollInterval: 20 * time.Millisecond,
		SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
	}, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		return err
	}
	var skipped atomic.Int64
	router.AddMiddleware(idempotency.Middleware(store, idempotency.WithTransaction(db), idempotency.WithSubscriberTx(watermillsql.Tx),
		idempotency.WithObserver(idempotency.ObserverFunc(func(_ context.Context, e idempotency.Event) {
			if e.Outcome == idempotency.OutcomeSkip {
				skipped.Add(1)
			}
		}))))
	router.AddConsumerHandler("ship", createdTopic, sub, func(msg *message.Message) error {
		tx, _ := postgresstore.TxFromContext(msg.Context())
		e, err := envelope.Parse(msg.Payload)
		if err != nil {
			return err
		}
		var data struct {
			OrderID string `json:"order_id"`
		}
		if err := json.Unmarshal(e.Data, &data); err != nil {
			return err
		}
		_, err = tx.ExecContext(msg.Context(), `INSERT INTO `+shipments+` (order_id) VALUES ($1)`, data.OrderID)
		return err
	})
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	routerDone, relayDone := make(chan error, 1), make(chan error, 1)
	go func() { routerDone <- router.Run(runCtx) }()
	go func() { relayDone <- relay.Run(runCtx) }()
	<-router.Running()

	// 5. The client: every order three times at once, each copy retrying
	//    until answered; a first attempt times out before the API answers.
	keys := []string{"7f1c-order-1", "7f1c-order-2", "7f1c-order-3", "7f1c-order-4", "7f1c-order-5"}
	var mu sync.Mutex
	got := map[string]map[string]int{} // key → order id → clients that got it
	attempts := 0
	var wg sync.WaitGroup
	var clientErr error
	for i, key := range keys {
		got[key] = map[string]int{}
		for range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				id, n, err := placeOrder(ctx, "http://"+ln.Addr().String()+"/orders", key, orderIn{Amount: int64(1000 * (i + 1)), Currency: "EUR"})
				mu.Lock()
				defer mu.Unlock()
				attempts += n
				if err != nil {
					clientErr = errors.Join(clientErr, err)
					return
				}
				got[key][id]++
			}()
		}
	}
	wg.Wait()
	if clientErr != nil {
		return clientErr
	}

	// 6. A relay that dies after publishing and before marking its row sends
	//    the message again: do that to the first order's message.
	var first []byte
	if err := db.QueryRowContext(ctx, fmt.Sprintf(`SELECT payload FROM "watermill_%s" ORDER BY "offset" LIMIT 1`, outboxTopic)).Scan(&first); err != nil {
		return err
	}
	var again struct {
		Payload []byte `json:"payload"`
	}
	_ = json.Unmarshal(first, &again) // the forwarder's envelope around the message
	if err := pub.Publish(createdTopic, message.NewMessage(watermill.NewUUID(), again.Payload)); err != nil {
		return err
	}

	// 7. Wait for the consumer to have consumed every message, then count.
	want := len(keys) + 1
	for relayed.n.Load() < int64(len(keys)) || !drained(ctx, db, createdTopic, "shipping") {
		select {
		case <-ctx.Done():
			return fmt.Errorf("the consumer did not catch up: %w", ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	stop()
	if err := errors.Join(<-routerDone, <-relayDone); err != nil {
		return err
	}
	fmt.Fprintf(out, "%d clients sent %d orders in %d requests (timeouts and 409s retried); the handler ran %d times\n\n", 3*len(keys), len(keys), attempts, runs.Load())
	fmt.Fprintln(out, "key            orders  order id  clients  shipments")
	ok := true
	for _, key := range keys {
		var n int
		var id string
		if err := db.QueryRowContext(ctx, `SELECT count(*), coalesce('ord_' || min(id)::text, '') FROM `+orders+` WHERE idem_key = $1`, key).Scan(&n, &id); err != nil {
			return err
		}
		var shipped int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM `+shipments+` WHERE order_id = $1`, id).Scan(&shipped); err != nil {
			return err
		}
		fmt.Fprintf(out, "%-14s %6d  %-8s  %7d  %9d\n", key, n, id, got[key][id], shipped)
		ok = ok && n == 1 && got[key][id] == 3 && len(got[key]) == 1 && shipped == 1
	}
	fmt.Fprintf(out, "\n%d messages consumed (one relayed twice), %d skipped by the inbox\n", want, skipped.Load())
	if !ok || skipped.Load() != 1 {
		return errors.New("not one order and one shipment per key")
	}
	fmt.Fprintln(out, "one order and one shipment per key; every client got its key's order")
	return nil
}

// placeOrder posts the order until it is answered: after a timeout at
// once, after a 409 or 503 when Retry-After says. The first attempt gives
// up after 100 ms, before the API answers.
func placeOrder(ctx context.Context, url, key string, in orderIn) (orderID string, attempts int, err error) {
	body, _ := json.Marshal(in)
	timeout := 100 * time.Millisecond
	for attempts = 1; ctx.Err() == nil; attempts++ {
		actx, cancel := context.WithTimeout(ctx, timeout)
		req, _ := http.NewRequestWithContext(actx, http.MethodPost, url, strings.NewReader(string(body)))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Tenant", "acme")
		req.Header.Set(httpidempotency.HeaderKey, `"`+key+`"`)
		resp, err := http.DefaultClient.Do(req)
		timeout = 5 * time.Second
		if err != nil {
			cancel()
			continue // timed out: the order may have been made; the key makes the retry safe
		}
		var out struct {
			OrderID string `json:"order_id"`
		}
		decodeErr := json.NewDecoder(resp.Body).Decode(&out)
		_ = resp.Body.Close()
		cancel()
		switch resp.StatusCode {
		case http.StatusCreated:
			return out.OrderID, attempts, decodeErr
		case http.StatusConflict, http.StatusServiceUnavailable:
			wait, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
			time.Sleep(time.Duration(max(wait, 1)) * time.Second)
		default:
			return "", attempts, fmt.Errorf("%s: status %d", key, resp.StatusCode)
		}
	}
	return "", attempts, ctx.Err()
}

// slowAfterCommit holds a new order's response for 300 ms (a slow
// network): the client's first attempt times out after the commit.
func slowAfterCommit(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(&slowWriter{ResponseWriter: w}, r)
	})
}

type slowWriter struct{ http.ResponseWriter }

func (s *slowWriter) WriteHeader(status int) {
	if status == http.StatusCreated && s.Header().Get(httpidempotency.HeaderReplayed) == "" {
		time.Sleep(300 * time.Millisecond)
	}
	s.ResponseWriter.WriteHeader(status)
}

// countingPublisher counts what the relay published to topic.
type countingPublisher struct {
	message.Publisher
	topic string
	n     atomic.Int64
}

func (c *countingPublisher) Publish(topic string, msgs ...*message.Message) error {
	err := c.Publisher.Publish(topic, msgs...)
	if err == nil && topic == c.topic {
		c.n.Add(int64(len(msgs)))
	}
	return err
}

// drained reports whether group has acked every message of topic.
func drained(ctx context.Context, db *sql.DB, topic, group string) bool {
	var done bool
	err := db.QueryRowContext(ctx, fmt.Sprintf(`SELECT coalesce((SELECT offset_acked FROM "watermill_offsets_%s" WHERE consumer_group = $1), 0)
		>= coalesce((SELECT max("offset") FROM "watermill_%s"), 0)`, topic, topic), group).Scan(&done)
	return err == nil && done
}
