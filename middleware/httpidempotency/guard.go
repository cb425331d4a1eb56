package httpidempotency

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/keepalive"
	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// TenantFunc returns the tenant a request acts for, from the authenticated
// caller (a verified token's claim, a session, a client certificate): never
// from the request body or a header the caller chooses freely, or one tenant
// could read another's saved responses. An error or an empty tenant is
// answered with 401 and the handler does not run.
type TenantFunc func(r *http.Request) (string, error)

// Guard is the Idempotency-Key middleware for net/http: it keeps, in a
// stores.Store shared with the kit's consumers, one record per (tenant,
// operation, key), claims it while the first request runs and saves its
// response for the retries. Wrap, WrapTx and Middleware guard one
// operation each. A Guard is safe for concurrent use.
type Guard struct {
	store   stores.Store
	txStore stores.TxStore
	caps    stores.Capabilities
	// responses keeps the full responses when they are kept in two tiers
	// (WithResponseStore); nil: one tier, the full response in store.
	responses    stores.Store
	responseCaps stores.Capabilities
	tenant       TenantFunc
	cfg          config
	log          *slog.Logger      // nil: slog.Default() at each line
	keeper       *keepalive.Keeper // keeps the claims of the requests running alive, renewing those due together
}

// logger returns where the Guard logs now.
func (g *Guard) logger() *slog.Logger {
	if g.log == nil {
		return slog.Default()
	}
	return g.log
}

type config struct {
	lease        time.Duration
	storeTimeout time.Duration
	retryAfter   time.Duration
	subject      func(*http.Request) string
	logger       *slog.Logger
	quiet        bool
	problemBase  string
	txDB         *sql.DB
	txOptions    *sql.TxOptions
	txRetries    int
	responses    stores.Store
	responsesSet bool
}

// Option configures a Guard.
type Option func(*config)

// WithLease sets the lease of a request's claim on its key (default 30s).
// The claim is renewed every third of the lease while the request runs,
// however long its handler takes (the Guard renews together every claim
// due within half a renewal period, so a store that groups concurrent calls
// carries the renewals of many requests in a round trip or two), so a
// concurrent retry gets 409 until it ends; the lease only bounds how long the key of a server that died
// holding it stays claimed (a retry gets 409 until then). A claim that
// cannot be renewed (the store unreachable for a whole lease, or the key
// taken by another request meanwhile) is lost: the handler's context ends
// (see Wrap), and the request's response is not saved over the other
// request's claim.
func WithLease(d time.Duration) Option { return func(c *config) { c.lease = d } }

// WithStoreTimeout bounds every store call (default 5s).
func WithStoreTimeout(d time.Duration) Option { return func(c *config) { c.storeTimeout = d } }

// WithRetryAfter sets the Retry-After of a 409 (a retry while the first
// request runs) and of a 503 (the store unavailable): default 1s, or the
// time left on the first request's lease when the store tells it and it
// is sooner. It is sent in whole seconds, at least one.
func WithRetryAfter(d time.Duration) Option { return func(c *config) { c.retryAfter = d } }

// WithSubject names who a request is made for (a user id, within the
// tenant): it is saved with the response, as Response.Subject, for an
// Operation's Authorize hook to compare with the caller of a retry.
func WithSubject(fn func(r *http.Request) string) Option {
	return func(c *config) { c.subject = fn }
}

// WithLogger sets where the Guard logs what the caller cannot be told: a
// response it could not save, a claim it could not release, a record it
// cannot read. Without WithLogger it logs through slog.Default(), read at
// each line (so a later slog.SetDefault applies); nil silences it.
func WithLogger(l *slog.Logger) Option {
	return func(c *config) { c.logger, c.quiet = l, l == nil }
}

// WithProblemBase sets what the "type" of the middleware's problem answers
// starts with (default DefaultProblemBase): your API's documentation, to
// which the Problem* names are appended.
func WithProblemBase(base string) Option { return func(c *config) { c.problemBase = base } }

// WithTransaction turns on the transactional mode for the operations
// guarded with WrapTx: the record, the handler's writes (through the
// transaction it is given) and, written through the same transaction, an
// outbox's rows commit together in db. The store must be a stores.TxStore
// on the same database (postgresstore).
func WithTransaction(db *sql.DB) Option { return func(c *config) { c.txDB = db } }

// WithTxOptions sets the options of the transactions WrapTx opens (default:
// the database's, usually READ COMMITTED).
func WithTxOptions(opts *sql.TxOptions) Option { return func(c *config) { c.txOptions = opts } }

// WithTxRetries sets how many fresh transactions WrapTx tries after a
// serialization failure, a deadlock or a uniqueness conflict (SQLSTATE
// 40001, 40P01, 23505) before it answers 503 (default 3).
func WithTxRetries(n int) Option { return func(c *config) { c.txRetries = n } }

// ErrInvalidOption is matched by the error New returns for an unusable
// store or option.
var ErrInvalidOption = errors.New("httpidempotency: invalid option")

// New returns a Guard keeping its records in store, with tenants from
// tenant. The store must take claims and keep values (memstore, redisstore
// and postgresstore do); with WithTransaction it must be a stores.TxStore.
func New(store stores.Store, tenant TenantFunc, opts ...Option) (*Guard, error) {
	cfg := config{lease: 30 * time.Second, storeTimeout: 5 * time.Second, retryAfter: time.Second,
		problemBase: DefaultProblemBase, txRetries: 3}
	for _, opt := range opts {
		opt(&cfg)
	}
	if store == nil {
		return nil, fmt.Errorf("%w: nil store", ErrInvalidOption)
	}
	if tenant == nil {
		return nil, fmt.Errorf("%w: nil tenant function (records are kept per tenant)", ErrInvalidOption)
	}
	caps := store.Capabilities()
	switch {
	case !caps.Claims:
		return nil, fmt.Errorf("%w: the store takes no claims: a retry while the first request runs would run too", ErrInvalidOption)
	case caps.MaxValue <= 0:
		return nil, fmt.Errorf("%w: the store keeps no values: a retry could not be given the saved response", ErrInvalidOption)
	case cfg.lease < time.Millisecond:
		return nil, fmt.Errorf("%w: lease %v: want at least 1ms", ErrInvalidOption, cfg.lease)
	case cfg.storeTimeout <= 0:
		return nil, fmt.Errorf("%w: store timeout %v: want a positive duration", ErrInvalidOption, cfg.storeTimeout)
	case cfg.retryAfter <= 0:
		return nil, fmt.Errorf("%w: Retry-After %v: want a positive duration", ErrInvalidOption, cfg.retryAfter)
	case cfg.txRetries < 0:
		return nil, fmt.Errorf("%w: %d transaction retries", ErrInvalidOption, cfg.txRetries)
	}
	g := &Guard{store: store, caps: caps, tenant: tenant, cfg: cfg, log: cfg.logger, keeper: new(keepalive.Keeper)}
	if cfg.responsesSet {
		rc, err := checkResponses(store, cfg.responses, caps)
		if err != nil {
			return nil, err
		}
		g.responses, g.responseCaps = cfg.responses, rc
	}
	if cfg.txDB != nil {
		tx, ok := store.(stores.TxStore)
		if !ok {
			return nil, fmt.Errorf("%w: WithTransaction needs a stores.TxStore (postgresstore) on the same database, not %T", ErrInvalidOption, store)
		}
		g.txStore = tx
	}
	if cfg.quiet {
		g.log = slog.New(slog.DiscardHandler)
	}
	return g, nil
}

// ExpiredPolicy says what a key whose saved response has expired means.
// Every Operation declares one: a record that went away must never be
// reused silently.
type ExpiredPolicy int

const (
	expiredUndeclared ExpiredPolicy = iota
	// ExpiredIsNew: a key is replayed for as long as the store keeps its
	// record (the store's TTL; Operation.ExpiresAfter must be 0), and a
	// key without a record is a new request, as payment APIs do after 24
	// hours. Run Redis with an eviction policy that never evicts these
	// records (noeviction), or a key evicted early runs again.
	ExpiredIsNew
	// ExpiredReject: a saved response older than Operation.ExpiresAfter is
	// not replayed and the key cannot be used again: 422 (ProblemKeyExpired).
	// The store must keep records longer than ExpiresAfter (its TTL 0 or
	// above it); a key the store no longer holds at all is new.
	ExpiredReject
	// ExpiredResolve: a key the store does not hold (never seen, expired,
	// evicted, forgotten), or whose saved response is older than
	// Operation.ExpiresAfter when that is set, is looked up in the
	// longer-lived business record by Operation.Resolve: what it returns is
	// replayed, and when it finds nothing the request is new (or, for a
	// record past ExpiresAfter, refused with ProblemKeyExpired).
	ExpiredResolve
)

// Ref names an API record: the tenant, the operation and the client's key.
type Ref struct {
	Tenant, Operation, Key string
}

// Operation declares how one route is guarded.
type Operation struct {
	// Name names the operation in its records ("orders.create"):
	// required, at most MaxKeyBytes, no control characters. Two routes
	// sharing a name share records.
	Name string

	// KeyOptional lets a request without an Idempotency-Key header run
	// without the guarantee; by default it is answered with 400
	// (ProblemKeyMissing), as the IETF draft says for an operation that
	// documents the header.
	KeyOptional bool

	// Body says how the request body enters the fingerprint: BodyJSON
	// (the default: JSON by its meaning) or BodyBytes. The method, path
	// and query always enter it byte for byte.
	Body BodyMode
	// Headers names the request headers that are part of the request's
	// intent (say, a currency or an account header): a retry with other
	// values is another intent (422). Other headers do not count.
	Headers []string

	// SaveHeaders names the response headers saved and replayed besides
	// Content-Type, which always is (say, Location).
	SaveHeaders []string
	// Keep says which statuses are saved and replayed; a response it
	// refuses is sent, not saved, and the key is freed for a retry to run
	// again. Default: every status but 429 and 5xx (a failure that a
	// retry may fix). In the transactional mode a refused status also
	// rolls the transaction back.
	Keep func(status int) bool

	// MaxRequestBody is the longest request body read, in bytes (default
	// 1 MiB): a longer one is answered with 413 (ProblemBodyTooLarge).
	MaxRequestBody int64
	// MaxResponseBody is the longest response body saved (default, and at
	// most: what the store keeps with a record less 16 KiB for the status
	// and headers). A longer response is still sent to the first caller,
	// but a retry gets 500 (ProblemResponseTooLarge); in the
	// transactional mode it is rolled back and answered with that problem
	// instead.
	MaxResponseBody int

	// Lease, when set, overrides the Guard's WithLease for this operation.
	Lease time.Duration

	// Expired declares what an expired key means (required; see
	// ExpiredPolicy).
	Expired ExpiredPolicy
	// ExpiresAfter is how long a saved response is replayed, with
	// ExpiredReject (required) and ExpiredResolve (optional); 0 with
	// ExpiredIsNew, whose window is the store's TTL.
	ExpiresAfter time.Duration
	// Resolve looks a key up in a longer-lived business record (say, the
	// orders table keeps each order's idempotency key) for ExpiredResolve:
	// the response to replay, or nil when there is none. It runs with the
	// key claimed, so a concurrent request with the key cannot create the
	// record meanwhile. Its response goes through Authorize, not through
	// the fingerprint check (the business record keeps no fingerprint).
	Resolve func(ctx context.Context, r *http.Request, ref Ref) (*Response, error)

	// Authorize, when set, is asked before a saved response is replayed
	// whether the current caller may still see it (evaluated at retry
	// time, with the Subject saved by WithSubject): false answers 403
	// (ProblemReplayForbidden) and the saved response is not sent.
	Authorize func(r *http.Request, saved *Response) bool

	// Reference, with WithResponseStore, returns the resource a response
	// names (say, the order it created), kept in the identity record for
	// a compact replay once the full response is no longer kept. Default:
	// the Location header, else Content-Location. At most 2 KiB is kept.
	Reference func(status int, header http.Header, body []byte) string
	// Compact, with WithResponseStore, builds the answer to a retry whose
	// full response is no longer kept (or cannot be read), from the
	// identity record: say, the order re-read by its reference. It runs
	// instead of the handler (never as a second run), after the
	// fingerprint matched; its response goes through Authorize, and is
	// sent with Idempotent-Replayed and Idempotency-Response. nil, or an
	// error (logged), gives the default compact replay: the original
	// status, the reference as Location, and a small JSON body.
	Compact func(r *http.Request, id Identity) (*Response, error)

	headers, save []string
	maxResponse   int
	lease         time.Duration
}

// DefaultMaxRequestBody is Operation.MaxRequestBody's default: 1 MiB.
const DefaultMaxRequestBody = 1 << 20

// headroom is what a record keeps besides the response body by default:
// the status, the saved headers, the subject, the save time.
const headroom = 16 << 10

// check validates op for g and fills its defaults.
func (g *Guard) check(op *Operation) error {
	if op.Name == "" {
		return errors.New("an operation needs a Name")
	}
	if err := idempotency.ValidateID(op.Name); err != nil {
		return fmt.Errorf("operation name %q: %w", op.Name, err)
	}
	ttl := g.caps.TTL
	switch op.Expired {
	case expiredUndeclared:
		return fmt.Errorf("operation %q declares no Expired policy (ExpiredIsNew, ExpiredReject or ExpiredResolve)", op.Name)
	case ExpiredIsNew:
		if op.ExpiresAfter != 0 {
			return fmt.Errorf("operation %q: ExpiredIsNew replays for as long as the store keeps a record (its TTL, %v); ExpiresAfter must be 0", op.Name, ttl)
		}
	case ExpiredReject:
		if op.ExpiresAfter <= 0 {
			return fmt.Errorf("operation %q: ExpiredReject needs ExpiresAfter, how long a saved response is replayed", op.Name)
		}
	case ExpiredResolve:
		if op.Resolve == nil {
			return fmt.Errorf("operation %q: ExpiredResolve needs a Resolve function", op.Name)
		}
	default:
		return fmt.Errorf("operation %q: unknown Expired policy %d", op.Name, op.Expired)
	}
	if op.ExpiresAfter < 0 {
		return fmt.Errorf("operation %q: negative ExpiresAfter", op.Name)
	}
	if op.ExpiresAfter > 0 && ttl > 0 && ttl <= op.ExpiresAfter {
		return fmt.Errorf("operation %q: the store keeps records for %v, not longer than ExpiresAfter (%v): an expired key would be gone, not refused", op.Name, ttl, op.ExpiresAfter)
	}
	if g.tiered() && op.ExpiresAfter > 0 && op.ExpiresAfter < g.responseCaps.TTL {
		return fmt.Errorf("operation %q: ExpiresAfter (%v) is shorter than the response store's TTL (%v): responses would be kept that are never replayed; lower the response store's TTL", op.Name, op.ExpiresAfter, g.responseCaps.TTL)
	}
	if !g.tiered() && (op.Compact != nil || op.Reference != nil) {
		return fmt.Errorf("operation %q: Compact and Reference are used with WithResponseStore only", op.Name)
	}
	if g.tiered() && op.Reference == nil {
		op.Reference = defaultReference
	}
	if op.Resolve != nil && op.Expired != ExpiredResolve {
		return fmt.Errorf("operation %q: Resolve is used with ExpiredResolve only", op.Name)
	}
	if op.MaxRequestBody < 0 || op.MaxResponseBody < 0 || op.Lease < 0 {
		return fmt.Errorf("operation %q: negative size or lease", op.Name)
	}
	if op.MaxRequestBody == 0 {
		op.MaxRequestBody = DefaultMaxRequestBody
	}
	kept := g.caps.MaxValue // what the store keeping full responses keeps
	if g.tiered() {
		kept = g.responseCaps.MaxValue
	}
	most := kept - headroom
	if most < 0 {
		most = kept / 2
	}
	op.maxResponse = op.MaxResponseBody
	switch {
	case op.maxResponse == 0:
		op.maxResponse = most
	case op.maxResponse > most:
		return fmt.Errorf("operation %q: MaxResponseBody %d: the store keeps at most %d bytes with a record, %d with the status and headers", op.Name, op.maxResponse, kept, most)
	}
	op.lease = g.cfg.lease
	if op.Lease > 0 {
		op.lease = op.Lease
	}
	if op.Keep == nil {
		op.Keep = defaultKeep
	}
	op.headers = canonical(op.Headers)
	op.save = canonical(append([]string{"Content-Type"}, op.SaveHeaders...))
	return nil
}

func defaultKeep(status int) bool { return status < 500 && status != http.StatusTooManyRequests }

func canonical(names []string) []string {
	out := make([]string, 0, len(names))
	for _, n := range names {
		c := http.CanonicalHeaderKey(strings.TrimSpace(n))
		if c != "" && !contains(out, c) {
			out = append(out, c)
		}
	}
	return out
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// Wrap guards next as op: see the package documentation for what each
// request gets. next runs with a context that the client going away does
// not cancel (the work finishes, and a retry finds its response), but
// that ends if the request loses its claim on the key (see WithLease). It panics when op is not usable (no
// name, no Expired policy, sizes beyond what the store keeps), as
// http.ServeMux does for a bad pattern: a wiring mistake, found at start.
func (g *Guard) Wrap(op Operation, next http.Handler) http.Handler {
	if next == nil {
		panic("httpidempotency: Wrap: nil handler")
	}
	return g.guard(op, next, nil)
}

// Middleware returns op's guard as the func(http.Handler) http.Handler
// routers take (chi's Use and With, gorilla/mux's Use; echo's
// echo.WrapMiddleware).
func (g *Guard) Middleware(op Operation) func(http.Handler) http.Handler {
	g.mustCheck(&op)
	return func(next http.Handler) http.Handler { return g.Wrap(op, next) }
}

// TxHandlerFunc is a handler of the transactional mode: it writes its
// business rows (and outbox rows) through tx, and its response to w. An
// error rolls everything back: a serialization failure, a deadlock or a
// uniqueness conflict (SQLSTATE 40001, 40P01, 23505) is retried in a fresh
// transaction once the winner is known; any other is answered with 500
// (ProblemHandlerFailed). A status the operation does not keep (5xx by
// default) rolls back too, and the response is sent as written.
type TxHandlerFunc func(w http.ResponseWriter, r *http.Request, tx *sql.Tx) error

// WrapTx guards h as op in the transactional mode (WithTransaction): the
// key is claimed, h runs in a transaction, the record with the saved
// response is written in that transaction (stores.TxStore.RememberTx) and
// it commits before the response is sent. A concurrent request whose
// transaction meets the record waits for it to commit or roll back, then
// replays what committed, or goes on. See the package documentation. It
// panics when the Guard has no WithTransaction, or op is not usable.
func (g *Guard) WrapTx(op Operation, h TxHandlerFunc) http.Handler {
	if g.txStore == nil {
		panic("httpidempotency: WrapTx needs a Guard made with WithTransaction")
	}
	if h == nil {
		panic("httpidempotency: WrapTx: nil handler")
	}
	return g.guard(op, nil, h)
}

func (g *Guard) mustCheck(op *Operation) {
	if err := g.check(op); err != nil {
		panic("httpidempotency: " + err.Error())
	}
}

func (g *Guard) guard(op Operation, next http.Handler, tx TxHandlerFunc) http.Handler {
	g.mustCheck(&op)
	return &guarded{g: g, op: op, next: next, tx: tx}
}

// guarded is one guarded operation.
type guarded struct {
	g    *Guard
	op   Operation
	next http.Handler  // Wrap
	tx   TxHandlerFunc // WrapTx
}

// call is the state of one guarded request.
type call struct {
	ref     Ref
	key     string // the store key
	fp      uint64
	body    []byte
	subject string
	base    context.Context  // detached from the client, with the claim token
	lease   *keepalive.Lease // the claim kept alive while the request runs; nil when not claimed
	taken   time.Time        // when the Claim that took it was sent
}

func (h *guarded) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	g, op := h.g, &h.op
	key, err := ParseKey(r.Header)
	switch {
	case errors.Is(err, ErrKeyMissing) && op.KeyOptional:
		h.unguarded(w, r)
		return
	case errors.Is(err, ErrKeyMissing):
		g.problem(w, http.StatusBadRequest, ProblemKeyMissing, "Idempotency-Key is missing",
			fmt.Sprintf("This operation (%s) needs an Idempotency-Key header: a unique value (a UUID) the client sends again on every retry of one request.", op.Name), 0)
		return
	case err != nil:
		g.problem(w, http.StatusBadRequest, ProblemKeyInvalid, "Idempotency-Key is not usable", err.Error(), 0)
		return
	}
	tenant, err := g.tenant(r)
	if err != nil || tenant == "" {
		g.problem(w, http.StatusUnauthorized, ProblemNoTenant, "No tenant for the caller",
			"Saved responses are kept per tenant, and this request's caller has none.", 0)
		return
	}
	if err := idempotency.ValidateID(tenant); err != nil {
		g.logger().Error("httpidempotency: the tenant function returned a tenant that cannot be part of a key", "operation", op.Name, "error", err)
		g.problem(w, http.StatusInternalServerError, ProblemTenantUnusable, "The caller's tenant cannot key a record", "", 0)
		return
	}
	body, err := readBody(w, r, op.MaxRequestBody)
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			g.problem(w, http.StatusRequestEntityTooLarge, ProblemBodyTooLarge, "Request body too large",
				fmt.Sprintf("This operation reads at most %d bytes of request body.", op.MaxRequestBody), 0)
			return
		}
		g.problem(w, http.StatusBadRequest, ProblemKeyInvalid, "The request body could not be read", "", 0)
		return
	}
	c := &call{ref: Ref{Tenant: tenant, Operation: op.Name, Key: key}, body: body,
		base: stores.WithClaimToken(context.WithoutCancel(r.Context()), stores.NewClaimToken())}
	c.key = RecordKey(tenant, op.Name, key)
	c.fp = op.fingerprint(r, body)
	if g.cfg.subject != nil {
		c.subject = g.cfg.subject(r)
	}
	if !h.claim(w, r, c) {
		return
	}
	c.lease = h.keep(c)
	defer c.lease.Stop()
	released := false
	defer func() {
		if p := recover(); p != nil {
			if !released {
				g.release(c)
			}
			panic(p)
		}
	}()
	if op.Expired == ExpiredResolve {
		resp, err := h.resolve(r, c)
		if err != nil || resp != nil {
			released = true
			g.release(c)
			if err != nil {
				h.storeUnavailable(w, "resolve the key in the business record", err)
				return
			}
			h.answer(w, r, c, resp, 0)
			return
		}
	}
	if h.tx != nil {
		released = h.runTx(w, r, c)
		return
	}
	released = h.run(w, r, c)
}

// readBody reads the request body, at most max bytes, and puts it back for
// the handler.
func readBody(w http.ResponseWriter, r *http.Request, max int64) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	if r.ContentLength > max {
		return nil, &http.MaxBytesError{Limit: max}
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, max))
	_ = r.Body.Close()
	return body, err
}

// request returns r for the handler: ctx, and the body read again.
func (c *call) request(r *http.Request, ctx context.Context) *http.Request {
	r2 := r.WithContext(ctx)
	if c.body == nil {
		r2.Body = http.NoBody
	} else {
		r2.Body = io.NopCloser(strings.NewReader(string(c.body)))
	}
	r2.ContentLength = int64(len(c.body))
	return r2
}

// storeCtx bounds a store call.
func (g *Guard) storeCtx(c *call) (context.Context, context.CancelFunc) {
	return context.WithTimeout(c.base, g.cfg.storeTimeout)
}

// claim takes the key, or answers the request from the record in its way.
// It reports whether the key is claimed and the handler is to run.
func (h *guarded) claim(w http.ResponseWriter, r *http.Request, c *call) bool {
	g := h.g
	for attempt := 1; ; attempt++ {
		ctx, cancel := g.storeCtx(c)
		taken := time.Now()
		claimed, found, err := g.store.Claim(ctx, c.key, h.op.lease)
		cancel()
		switch {
		case err != nil:
			h.storeUnavailable(w, "claim the key", err)
			return false
		case claimed:
			c.taken = taken
			return true
		case found.State == stores.StateRemembered:
			h.replay(w, r, c, found)
			return false
		case found.State == stores.StateInFlight || attempt == 3:
			h.inProgress(w, found)
			return false
		}
		// Released or remembered a moment ago: look again.
	}
}

func (h *guarded) inProgress(w http.ResponseWriter, found stores.Record) {
	wait := h.g.cfg.retryAfter
	if !found.ExpiresAt.IsZero() {
		if left := time.Until(found.ExpiresAt); left > 0 && left < wait {
			wait = left
		}
	}
	h.g.problem(w, http.StatusConflict, ProblemInProgress, "A request with this Idempotency-Key is in progress",
		"The first request with this key is still running. Retry after the time Retry-After gives: you will get its response.", wait)
}

func (h *guarded) storeUnavailable(w http.ResponseWriter, what string, err error) {
	h.g.logger().Error("httpidempotency: could not "+what, "operation", h.op.Name, "error", err)
	h.g.problem(w, http.StatusServiceUnavailable, ProblemStoreUnavailable, "Idempotency records unavailable",
		"The request did not run. Retry it with the same Idempotency-Key.", h.g.cfg.retryAfter)
}

// release frees the call's claim, so that a retry runs at once.
func (g *Guard) release(c *call) {
	ctx, cancel := g.storeCtx(c)
	defer cancel()
	if err := g.store.Release(ctx, c.key); err != nil {
		g.logger().Warn("httpidempotency: could not release a claim; a retry is refused until its lease lapses",
			"operation", c.ref.Operation, "error", err)
	}
}

// resolve asks the operation's Resolve for the key's business record:
// under the request's claim while it holds one, else within a lease.
func (h *guarded) resolve(r *http.Request, c *call) (*Response, error) {
	ctx, cancel := context.WithTimeout(c.base, h.op.lease)
	if c.lease != nil {
		ctx, cancel = context.WithCancel(c.lease.Context())
	}
	defer cancel()
	return h.op.Resolve(ctx, c.request(r, ctx), c.ref)
}

// keep keeps the call's claim alive until its Stop, renewing it every third
// of the lease. Its Context, which the handler runs with, is not cancelled
// when the client goes away, and ends when the claim is lost.
func (h *guarded) keep(c *call) *keepalive.Lease {
	g := h.g
	return g.keeper.KeepFrom(c.base, c.taken, h.op.lease, func(ctx context.Context, lease time.Duration) (bool, error) {
		ctx, cancel := context.WithTimeout(ctx, g.cfg.storeTimeout)
		defer cancel()
		return g.store.Extend(ctx, c.key, lease)
	})
}

// claimLost logs a request that lost its claim while it ran: another
// request may run the operation too, and this one's response is not saved.
func (g *Guard) claimLost(c *call, status int, cause error) {
	g.logger().Error("httpidempotency: the request lost its claim on its key while it ran (another request with the key may run too); its response is sent to its caller, not saved",
		"operation", c.ref.Operation, "status", status, "error", cause)
}

// run runs the handler of Wrap with the key claimed, saves its response
// and sends it. It reports whether the claim was settled (released or
// replaced by the record).
func (h *guarded) run(w http.ResponseWriter, r *http.Request, c *call) bool {
	g, op := h.g, &h.op
	cw := newCapture(w, op.maxResponse, true)
	h.next.ServeHTTP(cw, c.request(r, c.lease.Context()))
	if lost := c.lease.Lost(); lost != nil {
		g.claimLost(c, cw.statusCode(), lost)
		cw.flush()
		return true
	}
	if !op.Keep(cw.statusCode()) {
		g.release(c)
		cw.flush()
		return true
	}
	var err error
	if g.tiered() {
		// The full response first, then the identity record, whose
		// Remember ends the claim: a retry never finds the identity
		// record before the response it replays was offered.
		full, identity := h.tieredValues(c, cw)
		g.saveResponse(c, full)
		err = g.remember(c, identity)
	} else {
		err = g.remember(c, h.encode(c, cw))
	}
	switch {
	case errors.Is(err, stores.ErrClaimTaken):
		g.claimLost(c, cw.statusCode(), err)
	case err != nil:
		g.logger().Error("httpidempotency: the response was sent but could not be saved: a retry after the lease runs the operation again",
			"operation", op.Name, "status", cw.statusCode(), "error", err)
	}
	cw.flush()
	return true
}

// rememberAttempts is how many times a response is offered to the store
// before the Guard gives up saving it.
const rememberAttempts = 3

// remember saves the response in the record, trying again after a failure
// (a store failing over): once the handler ran, a record not written lets
// a retry after the lease run the operation again.
func (g *Guard) remember(c *call, value []byte) error {
	var err error
	backoff := 50 * time.Millisecond
	for attempt := 1; ; attempt++ {
		ctx, cancel := g.storeCtx(c)
		err = g.store.Remember(ctx, c.key, c.fp, value)
		cancel()
		if err == nil || attempt == rememberAttempts || errors.Is(err, stores.ErrClaimTaken) {
			return err
		}
		time.Sleep(backoff)
		backoff *= 2
	}
}

// encode returns the record's value for the captured response: the body
// kept, or marked not kept when it went past the limit.
func (h *guarded) encode(c *call, cw *capture) []byte {
	value, _ := h.encodeResponse(c, cw, h.g.caps.MaxValue)
	return value
}

// encodeResponse returns the saved response of the captured response, and
// its encoding within maxValue bytes.
func (h *guarded) encodeResponse(c *call, cw *capture, maxValue int) ([]byte, *Response) {
	resp := &Response{Status: cw.statusCode(), SavedAt: time.Now(), Subject: c.subject}
	for _, name := range h.op.save {
		if v, ok := cw.header[name]; ok {
			if resp.Header == nil {
				resp.Header = make(http.Header, len(h.op.save))
			}
			resp.Header[name] = v
		}
	}
	if cw.overflow {
		resp.BodyNotKept = true
	} else {
		resp.Body = cw.body
	}
	value := EncodeResponse(resp)
	if len(value) > maxValue && !resp.BodyNotKept {
		resp.Body, resp.BodyNotKept = nil, true
		value = EncodeResponse(resp)
	}
	return value, resp
}

// replay answers a request whose key has a record.
func (h *guarded) replay(w http.ResponseWriter, r *http.Request, c *call, found stores.Record) {
	if len(found.Value) > 0 && found.Value[0] == identityVersion {
		if id, err := decodeIdentity(found.Value); err == nil {
			h.replayIdentity(w, r, c, id, found.Fingerprint)
			return
		}
	}
	resp, err := DecodeResponse(found.Value)
	if err != nil {
		h.g.logger().Error("httpidempotency: a record holds no saved response", "operation", h.op.Name, "error", err)
		h.g.problem(w, http.StatusInternalServerError, ProblemRecordUnreadable, "The saved response cannot be read",
			"This Idempotency-Key has a record, but no response this server can replay.", 0)
		return
	}
	if h.op.ExpiresAfter > 0 && !resp.SavedAt.IsZero() && time.Since(resp.SavedAt) > h.op.ExpiresAfter {
		h.expired(w, r, c, resp)
		return
	}
	h.answer(w, r, c, resp, found.Fingerprint) // 0: kept without one, nothing to compare
}

// expired answers a key whose saved response is past ExpiresAfter.
func (h *guarded) expired(w http.ResponseWriter, r *http.Request, c *call, saved *Response) {
	if h.op.Expired == ExpiredResolve {
		resp, err := h.resolve(r, c)
		if err != nil {
			h.storeUnavailable(w, "resolve the key in the business record", err)
			return
		}
		if resp != nil {
			h.answer(w, r, c, resp, 0)
			return
		}
	}
	h.g.problem(w, http.StatusUnprocessableEntity, ProblemKeyExpired, "Idempotency-Key has expired",
		fmt.Sprintf("The response to this key was saved %s ago and is replayed for %s only; the key cannot be used again. Send a new request with a new key.",
			time.Since(saved.SavedAt).Round(time.Second), h.op.ExpiresAfter), 0)
}

// answer sends a saved (or resolved) response to a retry, once the caller
// is allowed to see it and its request is the same intent (keptFP 0: not
// compared).
func (h *guarded) answer(w http.ResponseWriter, r *http.Request, c *call, resp *Response, keptFP uint64) {
	g, op := h.g, &h.op
	if op.Authorize != nil && !op.Authorize(r, resp) {
		g.problem(w, http.StatusForbidden, ProblemReplayForbidden, "Not allowed to see the saved response",
			"A request with this Idempotency-Key ran, and the caller may not see its response.", 0)
		return
	}
	if !g.caps.Matches(keptFP, c.fp) {
		g.problem(w, http.StatusUnprocessableEntity, ProblemKeyReused, "Idempotency-Key is already used",
			"This Idempotency-Key was used with another request for this operation (another body, path or declared header). A key stands for one request: send a new one with a new key.", 0)
		return
	}
	if resp.BodyNotKept {
		g.problem(w, http.StatusInternalServerError, ProblemResponseTooLarge, "The saved response has no body",
			fmt.Sprintf("The request with this Idempotency-Key ran once and was answered with status %d, but its body was over the %d bytes this operation saves.", resp.Status, op.maxResponse), 0)
		return
	}
	dst := w.Header()
	for k, v := range resp.Header {
		dst[k] = v
	}
	dst.Set(HeaderReplayed, "true")
	w.WriteHeader(resp.Status)
	if len(resp.Body) > 0 {
		_, _ = w.Write(resp.Body)
	}
}

// unguarded runs a request without a key, for an operation with
// KeyOptional: as is, or in a transaction of its own without a record.
func (h *guarded) unguarded(w http.ResponseWriter, r *http.Request) {
	if h.tx == nil {
		h.next.ServeHTTP(w, r)
		return
	}
	h.unguardedTx(w, r)
}
