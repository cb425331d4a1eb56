// Package httpidempotency is Idempotency-Key middleware for net/http: the
// kit's exactly-once effect at the API, where a payment or an order enters
// the system before it becomes a message. It keeps its records in the same
// stores as the consumers (memstore, redisstore, postgresstore, through
// stores.Store), and in the transactional mode commits the record with the
// handler's business rows and outbox rows in one PostgreSQL transaction.
//
//	guard, err := httpidempotency.New(store, tenantOf) // tenantOf: from the authenticated caller
//	mux.Handle("POST /orders", guard.Wrap(httpidempotency.Operation{
//		Name:        "orders.create",
//		SaveHeaders: []string{"Location"},
//		Expired:     httpidempotency.ExpiredIsNew,
//	}, createOrder))
//
// It follows the IETF HTTPAPI working group's Idempotency-Key header draft
// and the conventions of payment APIs: the key is a structured-field
// string ("…", quoted) or a bare value; a replay carries
// Idempotent-Replayed: true; errors are RFC 9457 problem details whose
// "type" ends with one of the Problem* names.
//
// # Scope
//
// A record is keyed by (tenant, operation, key) (RecordKey): the tenant
// from the TenantFunc given to New, which reads the authenticated caller
// (never the body alone), the operation from Operation.Name, the key from
// the Idempotency-Key header (at most MaxKeyBytes, UTF-8, no control
// characters, one header: 400 otherwise). Two tenants using one key get two
// records and never see each other's response.
//
// # What a request gets
//
//   - No key: 400 (ProblemKeyMissing), unless Operation.KeyOptional.
//   - A key never seen: the key is claimed (WithLease: the claim is renewed
//     while the request runs, however long), the handler runs, and its
//     response (status, Content-Type and the headers
//     Operation.SaveHeaders names, body) is saved with the request's
//     fingerprint before it is sent. Statuses Operation.Keep refuses (5xx
//     and 429 by default) are sent and not saved: the key is freed and a
//     retry runs again.
//   - A retry with the same fingerprint: the saved response, with
//     Idempotent-Replayed: true; the handler does not run.
//   - A retry while the first request runs: 409 (ProblemInProgress) with
//     Retry-After, never a second run.
//   - The key with another intent (another body, path, query or declared
//     header): 422 (ProblemKeyReused). The fingerprint compares a JSON body
//     by its meaning (BodyJSON: member order, white space and number
//     spelling do not count; another currency does) and the headers
//     Operation.Headers declares; nothing else is taken as equivalent.
//     Every store keeps the saved response's fingerprint whole (64 bits;
//     redisstore reduces only the fingerprints of message records, which
//     keep no value), so another intent is never answered with the saved
//     response but for a 64-bit hash collision.
//   - A caller that may no longer see the saved response
//     (Operation.Authorize, asked at retry time with the Subject saved by
//     WithSubject): 403 (ProblemReplayForbidden), without it.
//   - The store unavailable: 503 (ProblemStoreUnavailable) with
//     Retry-After; the handler does not run.
//   - A body over Operation.MaxRequestBody: 413, read no further.
//
// The handler runs with a context that the client going away does not
// cancel, so that a request whose client timed out still finishes and its
// retry is answered from the record. The request's claim is renewed every
// third of its lease for as long as it runs, so a handler slower than the
// lease keeps its key: a retry gets 409, then the replay. A server that
// dies mid-request stops renewing: its claim lapses with its lease, until
// then a retry gets 409, after it a fresh run. A request that loses its
// claim (the store unreachable for a whole lease, or the key taken by
// another request meanwhile) is told: its handler's context ends (its
// transaction, in the transactional mode, rolls back), the loss is logged,
// and its response is never saved over the other request's claim.
//
// # Expired keys
//
// Every Operation declares what a key whose saved response expired means
// (ExpiredPolicy): a new request once the store's TTL let the record go
// (ExpiredIsNew); a 422 past Operation.ExpiresAfter while the store still
// holds the record (ExpiredReject); or a look-up in a longer-lived business
// record through Operation.Resolve (ExpiredResolve), which also covers a
// record the store lost (evicted, forgotten). None of them reuses a key
// silently because a cache dropped an entry: on Redis, keep API records
// under an eviction policy that never evicts them, or use ExpiredResolve.
//
// # Two retention tiers
//
// A saved response is kept whole for as long as the store keeps records,
// so a long replay horizon costs a long horizon of response bodies.
// WithResponseStore splits the two: full responses go to a second store
// whose TTL is the response lifetime (hours, a day), and the Guard's own
// store keeps, for its TTL (the identity lifetime: weeks), a compact
// identity record per key: the request's 64-bit fingerprint, the status,
// the save time, the subject and the resource reference the response
// named (Location, else Content-Location, or Operation.Reference).
//
//	identities := redisstore.New(c, redisstore.WithPrefix("api-id:"), redisstore.WithTTL(30*24*time.Hour))
//	responses := redisstore.New(c, redisstore.WithPrefix("api-resp:"), redisstore.WithTTL(24*time.Hour))
//	guard, err := httpidempotency.New(identities, tenantOf, httpidempotency.WithResponseStore(responses))
//
// The first request claims its key on the identity store, runs, and writes
// the full response, then the identity record (whose write ends the
// claim). A retry with the same fingerprint gets the full response while
// the response store holds it (Idempotent-Replayed: true); after that, the
// compact replay: the original status, the reference as Location,
// Idempotent-Replayed: true, Idempotency-Response: expired (HeaderResponse)
// and a small JSON body, or what Operation.Compact builds from the
// Identity (say, the order re-read). A response store that cannot be read
// gives the compact replay with Idempotency-Response: unavailable, within
// the store timeout: never a second run. Another intent is 422 for the
// whole identity lifetime; the tenant scopes both tiers alike. A response
// is replayed in full only if it is the one of the run the identity
// record names (the same fingerprint, and the digest of the response's
// value the identity record keeps): a response left
// by a server killed between the two writes, whose claim then lapsed and
// whose retry ran again, is never handed to that retry. A response body
// over what is kept is replayed compactly.
//
// New checks that the response store keeps values for a positive TTL no
// longer than the identity store's (0, forever, is allowed there). The
// Expired policies apply once the identity record is gone: ExpiredIsNew
// past the identity lifetime; ExpiresAfter, counted from the save time the
// identity record keeps, must be shorter than the identity store's TTL and
// at least the response store's (a response kept beyond it would never be
// replayed). Records saved with one tier are still replayed in full by a
// Guard with two; identity records are answered compactly by a Guard
// without WithResponseStore, but a release before this one answers them
// 500 (ProblemRecordUnreadable): turn the tiers on once every instance
// runs this release.
//
// In the transactional mode, when the response store is a stores.TxStore
// on the WithTransaction database (a postgresstore), the full response is
// written in the handler's transaction, under a savepoint, with the
// identity record: all commit together. Otherwise (another kind of store,
// or that write failing in the transaction) it is written before the
// commit, outside it, on a best-effort basis: a failure leaves a retry the
// compact replay, and a response written by a transaction that then rolls
// back is never replayed (the run that follows writes its own save time).
//
// # The transactional mode
//
// With WithTransaction(db) and a postgresstore on db, WrapTx runs a
// TxHandlerFunc in a transaction it is given: the handler writes its
// business rows and outbox rows (watermillsql.Outbox's Publisher(tx))
// through it, and the record with the saved response is written in the same
// transaction (stores.TxStore.RememberTx) before it commits; the response
// is sent after the commit. Either the order, its outbox row and the record
// exist, or none does. The key is claimed first, so a concurrent retry gets
// 409 without running. If two requests still reach the database together
// (the first lost its claim), the second's record waits for the first
// transaction: when it commits, the second rolls back and replays its
// response; when it rolls back, the second goes on. A serialization
// failure, a deadlock or a uniqueness conflict the handler returns rolls
// back, then the key is looked at again (the winner has committed by then)
// and its response replayed, or the request runs in a fresh transaction,
// at most WithTxRetries more times. No placeholder is ever committed apart
// from the order: a claim is the only thing outside the transaction, and
// it lapses.
//
// Without the transactional mode, the handler's effect and the record are
// two writes: a server killed between them leaves the claim, which lapses,
// and a retry runs again (the narrow window the consumer middleware has
// too). Effects in PostgreSQL close it with WrapTx.
//
// # Routers
//
// Guard.Middleware returns the func(http.Handler) http.Handler chi and
// gorilla/mux take (r.With(guard.Middleware(op)).Post("/orders", h));
// echo takes it through echo.WrapMiddleware.
//
// # Operating it
//
// Records are ordinary records of the store: bq-idempotency inspect and
// forget find one with --api-tenant and --operation and the client's key.
package httpidempotency
