package crashtest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/envelope"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// The chaos modes: two consumers on Redis Streams (a Redis of the test's
// own) write a ledger on PostgreSQL; the idempotency records are kept
const (
	chaosTx       = "chaos-tx"       // the transactional inbox (postgresstore, WithTransaction)
	chaosRedis    = "chaos-redis"    // redisstore claims, renewed while held
	chaosPostgres = "chaos-postgres" // postgresstore claims, renewed while held
	chaosTxClaims = "chaos-txclaims" // postgresstore claims held in a transaction (WithTransactionClaims)
	chaosSession  = "chaos-session"  // postgresstore claims held as advisory locks of the Store's session (WithSessionClaims)
)

// chaosLease is the claim modes' lease: short, so that renewals run every
// third of a second and a dead consumer's claims lapse quickly.
const chaosLease = time.Second

// chaosSlowEvery: one message in chaosSlowEvery runs for chaosSlow, longer
// than the lease and than the broker's idle time, so the broker hands it
// to the other consumer while it runs: only the renewed claim (or, in the
// transactional mode, the record's row lock) keeps it from running twice.
const (
	chaosSlowEvery = 40
	chaosSlow      = 1500 * time.Millisecond
)

// TestChaosTransactional, TestChaosRedisClaims, TestChaosPostgresClaims,
// TestChaosTxClaims (claims held in a transaction) and TestChaosSessionClaims
// (claims held as advisory locks of the Store's session, whose backend
// carries the consumers' application_name too) run two consumers while
// messages are published, and meanwhile SIGKILL a consumer every 1 to 3
// seconds (at least 10 times; each is restarted at once), SIGKILL and restart the Redis that holds the stream (and, with
// redisstore, the claims and records) twice, and terminate the consumers'
// PostgreSQL backends (pg_terminate_backend on their application_name)
// every 1.5 to 3.5 seconds. Then the faults stop and the consumers drain
// the stream. Nothing may be lost in any mode; in the transactional mode
// nothing may be applied twice. With claims, a kill between the ledger
// write and the record repeats that message: reported, with how many of
// the repeats followed a kill of the first run's process; any other repeat
// is logged with what the consumers said about that message.
//
// The faults last CHAOS_SECONDS (default 20) seconds, and at least until
// the tenth kill; a mode takes about 50 seconds of wall time in all, with
// -race or without. The modes run in parallel with each other and with the
// package's other tests (each has its own Redis, tables and
// application_name), unless -short.
func TestChaosTransactional(t *testing.T)  { chaos(t, chaosTx) }
func TestChaosRedisClaims(t *testing.T)    { chaos(t, chaosRedis) }
func TestChaosPostgresClaims(t *testing.T) { chaos(t, chaosPostgres) }
func TestChaosTxClaims(t *testing.T)       { chaos(t, chaosTxClaims) }
func TestChaosSessionClaims(t *testing.T)  { chaos(t, chaosSession) }

// chaosFigures is what a chaos run did and found.
type chaosFigures struct {
	published, entries                       int
	kills, redisRestarts, terminated, rounds int
	exits, stallRestarts                     int
	rows, distinct                           int64
	sum, want                                int64
	doubled, doubledAfterKill                int64
	took                                     time.Duration
}

func chaos(t *testing.T, mode string) {
	if testing.Short() {
		t.Skip("kills consumers, restarts Redis and terminates PostgreSQL backends for half a minute")
	}
	t.Parallel()
	chaosFor := 20 * time.Second
	if v := os.Getenv("CHAOS_SECONDS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			t.Fatalf("CHAOS_SECONDS=%q: want a positive number of seconds", v)
		}
		chaosFor = time.Duration(n) * time.Second
	}
	began := time.Now()
	db := testenv.Postgres(t)
	srv := testenv.StartRedisServer(t)
	ctx := context.Background()
	suffix := testenv.RandomHex(4)
	s := setup{mode: mode, topic: "bq_chaos_" + suffix, group: "ledger", ledger: "chaos_ledger_" + suffix, store: "chaos_idem_" + suffix}
	appName := "bqchaos_" + suffix
	s.createTables(t, db, `message_id text NOT NULL, amount bigint NOT NULL, pid int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp()`)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr(), MaxRetries: -1})
	defer rdb.Close()

	logs, err := os.Create(filepath.Join(t.TempDir(), "consumers.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logs.Close()
	env := []string{"REDIS_URL=redis://" + srv.Addr() + "/0", "CRASHTEST_APPNAME=" + appName}
	var fig chaosFigures
	killed := map[int]time.Time{} // the consumers SIGKILLed, by pid, and when
	consumers := [2]*proc{}
	start := func(i int) {
		cmd := s.consumer(fmt.Sprintf("c%d", i), nil)
		cmd.Env = append(cmd.Env, env...)
		cmd.Stdout, cmd.Stderr = logs, logs
		p, err := startProc(cmd)
		if err != nil {
			t.Fatal(err)
		}
		consumers[i] = p
	}
	// keepUp restarts a consumer that exited by itself.
	keepUp := func() {
		for i, p := range consumers {
			if p.exited() {
				fig.exits++
				start(i)
			}
		}
	}
	for i := range consumers {
		start(i)
	}
	defer func() {
		for _, p := range consumers {
			p.stop(syscall.SIGTERM)
		}
	}()

	// Publish while the faults run: ten messages every 200 ms, a fifth of
	// them twice; a batch that fails (Redis restarting) is sent again, the
	// same messages, so that nothing published is unknown to the ledger.
	// The pace is a ticker's, not a wait after each batch: the batch's own
	// round trips (each fsynced by the test's Redis) do not slow it down
	// when other tests load the disk.
	pubCtx, stopPublishing := context.WithCancel(ctx)
	var published atomic.Int64
	var want atomic.Int64
	var pubWG sync.WaitGroup
	pubWG.Go(func() {
		pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: rdb}, watermill.NopLogger{})
		if err != nil {
			t.Error(err)
			return
		}
		pace := time.NewTicker(200 * time.Millisecond)
		defer pace.Stop()
		for n := 0; pubCtx.Err() == nil; {
			var batch []*message.Message
			for range 10 {
				n++
				e, err := envelope.New("urn:babel:ledger:credit", map[string]any{"amount": n})
				if err != nil {
					t.Error(err)
					return
				}
				payload, _ := e.Marshal()
				copies := 1
				if n%5 == 0 {
					copies = 2
				}
				for range copies {
					batch = append(batch, message.NewMessage(watermill.NewUUID(), payload))
				}
				want.Add(int64(n))
			}
			for pub.Publish(s.topic, batch...) != nil {
				time.Sleep(100 * time.Millisecond) // Redis restarting: the same batch again
			}
			published.Add(10)
			select {
			case <-pubCtx.Done():
			case <-pace.C:
			}
		}
	})

	// The faults.
	between := func(lo, hi time.Duration) time.Duration { return lo + mrand.N(hi-lo) }
	faultsFrom := time.Now()
	nextKill := time.Now().Add(between(time.Second, 3*time.Second))
	nextTerminate := time.Now().Add(between(1500*time.Millisecond, 3500*time.Millisecond))
	restarts := []time.Time{faultsFrom.Add(chaosFor / 3), faultsFrom.Add(2 * chaosFor / 3)}
	for time.Since(faultsFrom) < chaosFor || fig.kills < minKills {
		time.Sleep(50 * time.Millisecond)
		keepUp()
		now := time.Now()
		if now.After(nextKill) {
			i := mrand.IntN(len(consumers))
			killed[consumers[i].cmd.Process.Pid] = time.Now()
			consumers[i].stop(syscall.SIGKILL)
			fig.kills++
			start(i)
			nextKill = now.Add(between(time.Second, 3*time.Second))
		}
		if len(restarts) > 0 && now.After(restarts[0]) {
			srv.Kill()
			srv.Start()
			fig.redisRestarts++
			restarts = restarts[1:]
		}
		if now.After(nextTerminate) {
			var n int
			if err := db.QueryRowContext(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1`, appName).Scan(&n); err != nil {
				t.Fatalf("terminating the consumers' backends: %v", err)
			}
			fig.terminated += n
			fig.rounds++
			nextTerminate = now.Add(between(1500*time.Millisecond, 3500*time.Millisecond))
		}
	}
	stopPublishing()
	pubWG.Wait()
	fig.published, fig.want = int(published.Load()), want.Load()

	// Drain, faults over. A consumer whose subscriber gave up on the
	// restarted Redis would stall the drain: after 20 s without progress
	// both consumers are restarted (counted).
	ledger := func() (rows, distinct, sum int64) {
		_ = db.QueryRowContext(ctx, `SELECT count(*), count(DISTINCT message_id), coalesce(sum(amount), 0) FROM `+s.ledger).Scan(&rows, &distinct, &sum)
		return rows, distinct, sum
	}
	drained := func() bool {
		n, err := rdb.XLen(ctx, s.topic).Result()
		if err != nil {
			return false
		}
		fig.entries = int(n)
		return testenv.StreamDrained(ctx, rdb, s.topic, s.group, int(n))
	}
	deadline := time.Now().Add(2 * time.Minute)
	lastProgress, lastRows := time.Now(), int64(-1)
	for !drained() {
		if time.Now().After(deadline) {
			rows, distinct, _ := ledger()
			t.Fatalf("%s: not drained 2 minutes after the faults ended (%d of %d messages in the ledger, %d rows); consumers' output:\n%s",
				mode, distinct, fig.published, rows, tailFile(logs.Name()))
		}
		keepUp()
		if rows, _, _ := ledger(); rows != lastRows {
			lastProgress, lastRows = time.Now(), rows
		} else if time.Since(lastProgress) > 20*time.Second {
			for i, p := range consumers {
				p.stop(syscall.SIGTERM)
				start(i)
			}
			fig.stallRestarts++
			lastProgress = time.Now()
		}
		time.Sleep(100 * time.Millisecond)
	}

	fig.rows, fig.distinct, fig.sum = ledger()
	fig.doubled = fig.rows - fig.distinct
	// A repeat whose first run was in a process killed within chaosSlow and
	// a second more of that run's ledger write: the kill window between the
	// write and the record. (A message that ran three times counts twice.)
	rows, err := db.QueryContext(ctx, `SELECT message_id, count(*) - 1, (array_agg(pid ORDER BY at))[1], min(at), string_agg(pid || ' at ' || to_char(at, 'HH24:MI:SS.MS'), ', ' ORDER BY at)
FROM `+s.ledger+` GROUP BY message_id HAVING count(*) > 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id, runs string
		var extra int64
		var pid int
		var first time.Time
		if err := rows.Scan(&id, &extra, &pid, &first, &runs); err != nil {
			t.Fatal(err)
		}
		if at, ok := killed[pid]; ok && at.After(first) && at.Sub(first) < chaosSlow+time.Second {
			fig.doubledAfterKill += extra
			continue
		}
		t.Logf("%s: message %s ran twice (%s), the first run's process not SIGKILLed right after it; its consumers said:\n%s", mode, id, runs, grepFile(logs.Name(), id))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	_ = rows.Close()
	fig.took = time.Since(began)
	t.Logf("%s: %v of faults (%v in all): %d SIGKILLs, %d Redis restarts, %d backends terminated in %d rounds, %d consumer exits, %d stall restarts; "+
		"%d messages published as %d entries; ledger: %d rows for %d messages (lost %d), total %d (exact %d), doubled %d (%d of them first run by a process SIGKILLed within %v of that run)",
		mode, chaosFor, fig.took.Round(time.Second), fig.kills, fig.redisRestarts, fig.terminated, fig.rounds, fig.exits, fig.stallRestarts,
		fig.published, fig.entries, fig.rows, fig.distinct, int64(fig.published)-fig.distinct, fig.sum, fig.want, fig.doubled, fig.doubledAfterKill, chaosSlow+time.Second)
	if fig.distinct != int64(fig.published) {
		t.Fatalf("%s: %d of %d messages reached the ledger: messages were lost", mode, fig.distinct, fig.published)
	}
	if mode == chaosTx && (fig.doubled != 0 || fig.sum != fig.want) {
		t.Fatalf("%s: ledger total %d over %d rows, want exactly %d over %d", mode, fig.sum, fig.rows, fig.want, fig.published)
	}
	if fig.redisRestarts < 2 || fig.terminated == 0 {
		t.Fatalf("%s: the faults did not all happen (%d Redis restarts, %d backends terminated)", mode, fig.redisRestarts, fig.terminated)
	}
}

// proc is a consumer process and the end of its Wait.
type proc struct {
	cmd  *exec.Cmd
	done chan struct{}
}

func startProc(cmd *exec.Cmd) (*proc, error) {
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &proc{cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop signals the process and waits for it (SIGKILL after 10 s).
func (p *proc) stop(sig syscall.Signal) {
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// grepFile returns the lines of the file name that contain what.
func grepFile(name, what string) string {
	b, _ := os.ReadFile(name)
	var out []string
	for line := range strings.Lines(string(b)) {
		if strings.Contains(line, what) {
			out = append(out, line)
		}
	}
	return strings.Join(out, "")
}

func tailFile(name string) string {
	b, _ := os.ReadFile(name)
	return tail(b)
}

// chaosConsume is the consumer of the chaos tests: the mode's store on a
// Redis Streams subscriber; the handler writes the message to the ledger
// (in the delivery's transaction in the transactional mode), with its
// process id, then works a little (one message in chaosSlowEvery for
// longer than the lease).
func chaosConsume(ctx context.Context, db *sql.DB, pgStore *postgresstore.Store) error {
	mode, ledger := os.Getenv("CRASHTEST_MODE"), os.Getenv("CRASHTEST_LEDGER")
	redisOpts, err := redis.ParseURL(testenv.Getenv("REDIS_URL", testenv.DefaultRedisURL))
	if err != nil {
		return err
	}
	rdb := redis.NewClient(redisOpts)
	defer rdb.Close()
	pid := os.Getpid()
	// What went wrong for a delivery, for the parent to explain a double.
	obs := idempotency.WithObserver(idempotency.ObserverFunc(func(_ context.Context, e idempotency.Event) {
		if e.Err != nil && e.Outcome != idempotency.OutcomePark {
			fmt.Printf("chaos pid=%d id=%s outcome=%s err=%v\n", pid, e.MessageID, e.Outcome, e.Err)
		}
	}))
	var guard message.HandlerMiddleware
	switch mode {
	case chaosTx:
		guard = idempotency.Middleware(pgStore, idempotency.WithTransaction(db), obs)
	case chaosRedis:
		guard = idempotency.Middleware(redisstore.New(rdb, redisstore.WithPrefix("chaos:"), redisstore.WithTTL(time.Hour)),
			idempotency.WithClaim(chaosLease), obs)
	case chaosPostgres:
		guard = idempotency.Middleware(pgStore, idempotency.WithClaim(chaosLease), obs)
	case chaosTxClaims:
		// The same table, each claim a transaction held open on a
		// connection of db: a SIGKILL or a terminated backend ends it.
		txStore, err := postgresstore.New(db, postgresstore.WithTable(os.Getenv("CRASHTEST_STORE")), postgresstore.WithTransactionClaims())
		if err != nil {
			return err
		}
		guard = idempotency.Middleware(txStore, idempotency.WithClaim(chaosLease), obs)
	case chaosSession:
		// The same table, each claim an advisory lock of the Store's own
		// session: a SIGKILL or a terminated backend frees them all.
		sessStore, err := postgresstore.New(db, postgresstore.WithTable(os.Getenv("CRASHTEST_STORE")), postgresstore.WithSessionClaims())
		if err != nil {
			return err
		}
		defer func() { _ = sessStore.ReleaseAll(context.Background()) }()
		guard = idempotency.Middleware(sessStore, idempotency.WithClaim(chaosLease), obs)
	}
	sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client: redis.NewClient(redisOpts), ConsumerGroup: os.Getenv("CRASHTEST_GROUP"), Consumer: os.Getenv("CRASHTEST_CONSUMER"), OldestId: "0",
		BlockTime: 100 * time.Millisecond, DisableIndefiniteInitialBlock: true,
		ClaimInterval: 100 * time.Millisecond, MaxIdleTime: 500 * time.Millisecond,
	}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	router.AddMiddleware(guard)
	router.AddConsumerHandler("ledger", os.Getenv("CRASHTEST_TOPIC"), sub, func(msg *message.Message) error {
		id, amount, err := credit(msg)
		if err != nil {
			return err
		}
		var exec interface {
			ExecContext(context.Context, string, ...any) (sql.Result, error)
		} = db
		if tx, ok := postgresstore.TxFromContext(msg.Context()); ok {
			exec = tx
		} else if mode == chaosTx {
			return errors.New("no transaction in the transactional mode")
		}
		if _, err := exec.ExecContext(msg.Context(), `INSERT INTO `+ledger+` (message_id, amount, pid) VALUES ($1, $2, $3)`, id, amount, pid); err != nil {
			return err
		}
		work := 5 * time.Millisecond
		if amount%chaosSlowEvery == 0 {
			work = chaosSlow
		}
		select {
		case <-time.After(work):
			return nil
		case <-msg.Context().Done():
			return context.Cause(msg.Context())
		}
	})
	return router.Run(ctx)
}

// withApplicationName names the connections of dsn (a URL or keyword/value
// DSN) so that the chaos test can terminate the consumers' backends.
func withApplicationName(dsn, name string) string {
	if name == "" {
		return dsn
	}
	if strings.Contains(dsn, "://") {
		u, err := url.Parse(dsn)
		if err == nil {
			q := u.Query()
			q.Set("application_name", name)
			u.RawQuery = q.Encode()
			return u.String()
		}
	}
	return dsn + " application_name=" + name
}
