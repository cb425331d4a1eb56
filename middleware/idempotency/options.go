package idempotency

import (
	"context"
	"database/sql"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/babelqueue/watermill-idempotency/internal/kitlog"
)

// Option configures the middleware.
type Option func(*config)

type config struct {
	lease            time.Duration
	leaseSet         bool // WithClaim was given
	noClaim          bool // WithoutClaim was given
	parkWait         time.Duration
	parkWaitSet      bool // WithParkWait was given
	requireIdentity  bool
	scope            string
	fixedScope       bool
	storeTimeout     time.Duration
	logger           watermill.LoggerAdapter
	rememberAttempts int
	rememberBackoff  time.Duration
	ackTimeout       time.Duration
	observers        []Observer
	meterProvider    metric.MeterProvider
	tracerProvider   trace.TracerProvider

	horizon    time.Duration
	horizonSet bool
	skew       time.Duration

	txDB            *sql.DB
	subscriberTx    func(context.Context) (*sql.Tx, bool)
	txRetries       int
	txRetriesSet    bool // WithTxRetries was given
	txOptions       *sql.TxOptions
	outbox          func(*sql.Tx) (message.Publisher, error)
	pgxPool         *pgxpool.Pool // WithPgxTransaction
	pgxTxOptions    pgx.TxOptions
	pgxTxOptionsSet bool // WithPgxTxOptions was given

	keys keyConfig // WithKeySource and its companions (keysource.go)

	retries       Retries       // WithRetries
	retriesSet    bool          // WithRetries was given
	deliveryLimit time.Duration // WithDeliveryLimit; 0: none
}

func defaultConfig() config {
	return config{
		logger:           kitlog.Default(),
		lease:            DefaultLease,
		parkWait:         DefaultParkWait,
		rememberAttempts: 3,
		rememberBackoff:  50 * time.Millisecond,
		ackTimeout:       time.Minute,
		txRetries:        3,
		skew:             time.Minute,
	}
}

// DefaultLease is the claim lease when WithClaim does not set one. The
// claim is renewed every third of it while its delivery holds it, so the
// lease bounds how long the claim of a delivery that died (a crashed or
// killed worker, a lost connection) keeps its message from running
// elsewhere, not how long a handler may run. 5 seconds lets a renewal fail
// twice in a row (a store hiccup, a long GC pause) before the claim is
// lost, and lets a killed worker's message run on another worker within
// about 10 seconds, counting the broker's own redelivery and the parked
// redeliveries that meet the dead claim meanwhile.
const DefaultLease = 5 * time.Second

// DefaultParkWait is how long a delivery that finds its message in flight
// waits for the other delivery before it is parked, unless WithParkWait
// says otherwise.
const DefaultParkWait = time.Second

// WithClaim sets the lease of the atomic in-flight claim the middleware
// takes on a message before running the handler (default DefaultLease), so
// that two concurrent deliveries of one message never both run. Claims are
// on by default; WithoutClaim turns them off.
//
// A delivery that finds the message claimed by another delivery waits for
// it (WithParkWait), and then, if it is still in flight, is parked: it
// returns an error matching ErrInFlight, the router nacks it and the broker
// redelivers it later, by which time the first delivery has either
// remembered the message (the redelivery is skipped) or failed and released
// its claim (the redelivery runs).
//
// The claim lives as long as its delivery: it is renewed every third of
// the lease (stores.Store.Extend) while the handler runs and while the
// messages it produced await the router's ack, however long that takes,
// and dropped when the delivery ends. The lease is how long a dead holder
// goes unnoticed: the claim of a worker that crashed lapses at most a lease
// after its last renewal, and another delivery then runs the message. A
// shorter lease hands a dead worker's messages on sooner and costs more
// renewals; a longer one rides out longer store outages. The Guard renews
// its claims together: when one is due, every claim due within half a
// renewal period goes with it (early, never late), each renewal a store
// call of its own sent at the same moment, so a store that groups
// concurrent calls (redisstore pipelines them, postgresstore runs them as
// one statement) carries the renewals of every claim in flight in a round
// trip or two, a few times a lease, however many claims are held. A delivery that loses its claim (the store says
// another holder has it, or no renewal got through before the lease ran
// out) has its handler's context cancelled (its cause matches
// ErrClaimLost), never writes its record over the other holder's claim, and
// is reported as OutcomeClaimLost. New refuses a lease under a millisecond,
// the stores' unit.
func WithClaim(lease time.Duration) Option {
	return func(c *config) { c.lease, c.leaseSet = lease, true }
}

// WithoutClaim turns claims off: the middleware is then the post-success
// seen-set of the BabelQueue contract. It looks the message's record up
// before the handler runs and writes it after a success; two deliveries of
// one message arriving at the same moment (two workers, a visibility
// timeout lapsing mid-run) may both run. It saves a store round trip per
// first delivery, and is the only mode for a store that cannot claim
// (stores.FromSeenSet).
func WithoutClaim() Option {
	return func(c *config) { c.noClaim = true }
}

// WithParkWait sets how long a delivery that finds its message claimed by
// another delivery waits for that delivery to end, looking at the claim
// again with growing pauses (20 ms up to 250 ms), before it is parked
// (default DefaultParkWait). The other delivery usually ends meanwhile:
// the waiting one is then skipped, or runs if the other failed. Parking
// nacks the delivery, and a broker that hands a nacked message straight
// back (RabbitMQ, GoChannel) would otherwise ask again at once, hundreds of
// times a second; the wait bounds that to about one redelivery per wait.
// While it waits, the delivery holds its place in the subscriber. Zero
// parks at once. It is an option of the claim mode: New refuses it with
// WithoutClaim, which never parks, and with WithTransaction, where the
// record's row lock makes a concurrent copy wait (a copy meeting a claim
// of the claim mode, during a rolling deploy, is parked at once).
func WithParkWait(d time.Duration) Option {
	return func(c *config) { c.parkWait, c.parkWaitSet = d, true }
}

// WithRequireIdentity rejects a message without a usable identity (a body
// that is not an envelope, no meta.id, no key from WithKeySource) with a
// permanent error matching ErrNoIdentity, instead of running it without
// deduplication (the default, fail open). Use it on topics where every
// message must run at most once: a plain message delivered twice is then
// dead-lettered rather than charged twice.
func WithRequireIdentity() Option {
	return func(c *config) { c.requireIdentity = true }
}

// WithScope sets the scope keys are remembered under, instead of the
// Watermill handler name. Handlers that share a scope share their records:
// a message handled by one is skipped by the others. An empty scope keys
// records on meta.id alone.
func WithScope(scope string) Option {
	return func(c *config) { c.scope, c.fixedScope = scope, true }
}

// WithStoreTimeout bounds every store call with a deadline. Zero (the
// default) adds none: the message context and the store client's own
// timeouts apply (go-redis has 3s read and write timeouts by default;
// postgresstore bounds its queries itself).
func WithStoreTimeout(d time.Duration) Option {
	return func(c *config) { c.storeTimeout = d }
}

// WithLogger sets the logger for decisions other than running the handler:
// at warning a rejection (permanent error), a payload conflict and a lost
// claim; at error a store that cannot be read or claimed, a record that
// could not be written after a success, a claim that could not be released
// and a handler that outlived its lease; at info a message without identity
// handled without deduplication, once per message (by UUID, among the last
// 1,024 such messages: its redeliveries are logged at debug); at debug a
// skipped duplicate and a parked delivery. Watermill's adapters have no
// warning level: warnings go to their Error.
//
// Without WithLogger (or with a nil logger) the middleware logs through
// slog.Default(), read at each line, so a slog.SetDefault made later
// applies. Watermill hands a middleware no logger (a HandlerMiddleware
// gets the handler only), so to log through the router's, pass
// WithLogger(router.Logger()); WithLogger(watermill.NopLogger{}) silences
// the middleware.
func WithLogger(logger watermill.LoggerAdapter) Option {
	return func(c *config) { c.logger = kitlog.Or(logger) }
}

// WithRememberRetry sets how often remembering a handled message is tried
// before giving up (default 3 attempts, 50ms apart, doubling). After the
// last failure the delivery is still acked, since the handler already ran;
// this is the narrow window in which a redelivery would run it again. Every
// attempt, the first included, runs detached from the message context's
// cancellation (a shutdown does not stop it), bounded by WithStoreTimeout.
func WithRememberRetry(attempts int, backoff time.Duration) Option {
	return func(c *config) { c.rememberAttempts, c.rememberBackoff = attempts, backoff }
}

// WithAckTimeout bounds how long the middleware waits for the router to ack
// or nack a delivery whose handler returned messages to publish (default
// one minute). The message is remembered only once the router acked it,
// that is once the produced messages were published; when the wait times
// out it is not remembered. The transactional mode does not wait for the
// ack: it commits first (see WithOutbox).
func WithAckTimeout(d time.Duration) Option {
	return func(c *config) { c.ackTimeout = d }
}

// WithObserver calls o once for every decision the middleware takes, after
// the metrics and the logger and after the observers given before it.
func WithObserver(o Observer) Option {
	return func(c *config) { c.observers = append(c.observers, o) }
}

// WithReplayHorizon rejects, with a permanent error matching ErrTooOld, a
// delivery that may be older than horizon: its meta.created_at is older
// than horizon less the clock skew (WithClockSkew). Its record may have
// expired, and running it again could repeat its effect. The default is the
// store's TTL when it has one (stores.Capabilities); zero turns the check off; a
// horizon of math.MaxInt64 never rejects. A message without
// meta.created_at is not checked, nor a deliberate replay: a message whose
// metadata carries envelope.MetadataReplayBypass "1" (redrive's
// WithReplayBypass, after the operator forgot its record).
func WithReplayHorizon(horizon time.Duration) Option {
	return func(c *config) { c.horizon, c.horizonSet = horizon, true }
}

// WithClockSkew sets how far producers' clocks may run ahead of this
// consumer's (default one minute). Skew makes the replay horizon stricter,
// never looser: a message stamped by a clock running ahead is older than it
// looks, so the horizon is shortened by the skew. New rejects a skew that is
// not shorter than the horizon.
func WithClockSkew(d time.Duration) Option {
	return func(c *config) { c.skew = d }
}

// Outcome names a decision the middleware took for one delivery.
type Outcome string

// The outcomes an Observer sees.
const (
	// OutcomeRun: the handler ran (Event.Err holds its error, if any).
	OutcomeRun Outcome = "run"
	// OutcomeSkip: the message was already remembered; the handler did not
	// run and the delivery is acked.
	OutcomeSkip Outcome = "skip"
	// OutcomePark: another delivery holds the claim; the delivery is nacked
	// with ErrInFlight and comes back later.
	OutcomePark Outcome = "park"
	// OutcomeFailOpen: the message has no usable identity (not a JSON
	// object, no meta.id, no key from WithKeySource); the handler ran
	// without deduplication.
	OutcomeFailOpen Outcome = "fail_open"
	// OutcomeReject: the message was rejected with a permanent error.
	OutcomeReject Outcome = "reject"
	// OutcomeConflict: the meta.id is remembered with different content;
	// the delivery is rejected with ErrConflict.
	OutcomeConflict Outcome = "conflict"
	// OutcomeStoreError: the store could not be read or claimed; the
	// delivery is retried.
	OutcomeStoreError Outcome = "store_error"
	// OutcomeRememberFailed: the handler succeeded but the message could not
	// be remembered after retries; the delivery is acked anyway.
	OutcomeRememberFailed Outcome = "remember_failed"
	// OutcomeClaimLost: the delivery lost its claim while its handler ran
	// or its produced messages awaited the ack (another holder took it, or
	// the claim could not be renewed before its lease ran out). The
	// handler's context is cancelled and no record is written over the
	// other holder's claim.
	OutcomeClaimLost Outcome = "claim_lost"
	// OutcomeEnded: the message ended earlier (dead-lettered for good: its
	// end is remembered); the handler did not run, no second dead letter
	// is made, and the delivery is acked.
	OutcomeEnded Outcome = "ended"
	// OutcomeReopen: an operator sent a message that had ended back on
	// purpose (a redrive): its end is dropped and it runs with a fresh
	// budget.
	OutcomeReopen Outcome = "reopen"
	// OutcomeExhausted: the message's retry budget is spent (WithRetries):
	// the delivery fails with ErrExhausted, for the dead-letter middleware.
	OutcomeExhausted Outcome = "exhausted"
	// OutcomeRetryLater: the delivery ended before the broker's deadline
	// with runs of its budget left; it is nacked with ErrRetryLater and
	// goes on at a later delivery.
	OutcomeRetryLater Outcome = "retry_later"
)

// Event describes one decision.
type Event struct {
	Outcome   Outcome
	Handler   string // the Watermill handler name, if any
	MessageID string // meta.id (or the WithKeySource key), if it could be read
	Err       error  // the error behind the outcome, if any
}

// Observer receives the middleware's decisions. It is called synchronously
// on the delivery's goroutine and must be safe for concurrent use.
type Observer interface {
	Observe(ctx context.Context, e Event)
}

// ObserverFunc adapts a function to an Observer.
type ObserverFunc func(ctx context.Context, e Event)

// Observe calls f.
func (f ObserverFunc) Observe(ctx context.Context, e Event) { f(ctx, e) }
