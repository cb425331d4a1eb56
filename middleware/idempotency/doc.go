// Package idempotency is Watermill router middleware that turns at-least-once
// delivery into an exactly-once effect: it recognises a redelivery of a
// BabelQueue envelope by its meta.id and skips it, so the handler's side
// effect happens once.
//
//	router.AddMiddleware(idempotency.Middleware(store))
//
// # The decision
//
// The mode is chosen once, by New: the claim mode (the default), the
// seen-set (WithoutClaim) or the transactional mode (WithTransaction, or
// WithPgxTransaction on a pgx pool); each reads top to bottom in one
// function (Guard.claimed, Guard.seenSet in middleware.go;
// Guard.inTransaction and Guard.inPgxTransaction in transaction.go). For every delivery
// the middleware reads meta.id without decoding the body (see
// envelope.ReadIdentity), then:
//
//   - body not a JSON object, or no meta.id: the handler runs, without
//     deduplication (fail open; reported as OutcomeFailOpen, logged once
//     per message), or, under WithRequireIdentity, the message is rejected
//     with ErrNoIdentity;
//   - meta.schema_version present and not 1, or a meta.id unusable as a key
//     (over MaxIDBytes, invalid UTF-8, control characters): rejected with an
//     error matching ErrPermanent; the handler does not run;
//   - claim taken (or, in the seen-set, not remembered): the handler runs;
//   - remembered already: skipped; nil, nil is returned so the router acks
//     and the broker stops redelivering;
//   - in flight in another delivery: the delivery waits for it
//     (WithParkWait), then is skipped or runs, or, if the other still runs,
//     is parked with ErrInFlight (transient: the broker redelivers it);
//   - otherwise the handler runs. On error the message stays unmarked and the
//     error propagates (Retry and dead-lettering still apply). On success it
//     is remembered; when the handler returned messages for the router to
//     publish, only once the router acked the delivery, that is once those
//     messages were published, so a failed publication never loses them.
//
// A store that cannot be read fails the delivery with ErrStore, to be retried;
// the middleware never guesses. Remembering that fails after a successful run
// is retried (WithRememberRetry) and then logged and acked: the handler ran,
// and a redelivery in that window would run it again.
//
// # Keys
//
// Records are scoped by the Watermill handler name: a fleet running the same
// handler shares one record per message, while a second handler on the same
// topic keeps its own. On a direct call with no handler name in the context
// (unit tests) the key is meta.id itself. See WithScope and Key.
//
// # Messages that are not envelopes
//
// WithKeySource keys Watermill messages that are not BabelQueue envelopes on
// their UUID (KeyFromUUID), a metadata field (KeyFromMetadata) or a
// function (KeyFromFunc), tried in the order given after or instead of the
// envelope's meta.id (KeyFromEnvelope, the default); the rest of the
// decision is the same. Their
// content fingerprint covers the payload and the metadata fields named by
// WithFingerprintMetadata, and the replay horizon applies only with a
// creation time from WithCreatedAtMetadata. For components/cqrs, the
// envelope/cqrsenvelope marshaler puts commands and events into envelopes
// instead, so that no key source is needed.
//
// # Fields the SDKs encrypt
//
// The BabelQueue SDKs can encrypt the data fields a schema marks
// x-gdpr-sensitive, with a random nonce on every call, so that a producer's
// retry carries other ciphertext than the message it repeats. Given the
// jobs' sensitive paths, the consumer's field cipher and a fingerprint key
// (WithSensitiveFields), the content fingerprint counts each such field by
// its cleartext through a keyed hash: the retry is a duplicate, the id
// reused with another value a conflict, and no record holds a cleartext.
//
// # Concurrent duplicates
//
// Claims are on by default with every store that can claim (every shipped
// store can): the first of two deliveries of one message arriving at the
// same time (two workers, a visibility timeout lapsing mid-run) takes an
// atomic claim in the store; the second waits for it, looking again with
// growing pauses for up to WithParkWait (one second by default), and is then
// skipped (the first succeeded) or runs (the first failed and released its
// claim). If the first still runs, the second is parked with ErrInFlight,
// nacked and redelivered later. WithoutClaim turns claims off: the
// post-success seen-set of the BabelQueue contract, where two such
// deliveries may both run; it is the only mode for a store of your own with
// just Seen, Remember and Forget (stores.FromSeenSet).
//
// # Time
//
// Four durations bound what the guard promises:
//
//   - Retention: a record lives for the store's TTL (redisstore and
//     postgresstore: WithTTL; memstore: WithTTL), and a redelivery after it
//     expired is not recognised. Keep records longer than any broker can
//     redeliver or an operator may replay.
//   - Replay horizon (WithReplayHorizon, by default the store's TTL): a
//     delivery whose meta.created_at is older than the horizon less the clock
//     skew is rejected with ErrTooOld, a permanent error, instead of running
//     again after its record may have expired. A message without a creation
//     time is not checked (for plain Watermill messages, name one with
//     WithCreatedAtMetadata); a deliberate replay carrying the replay marker
//     (forget, then redrive with WithReplayBypass) is exempt.
//   - Clock skew (WithClockSkew, default one minute): how far a producer's
//     clock may run ahead of the consumer's. It only ever shortens the
//     horizon; New refuses a skew not shorter than the horizon.
//   - Claim lease (WithClaim, default 5s): how long the claim of a
//     delivery that died (a crashed or killed worker, a lost connection)
//     keeps its message from running elsewhere. It does not bound the
//     handler: the claim is renewed every third of the lease while the
//     handler runs and while its produced messages await the ack, however
//     long that takes, and dropped when the delivery ends. A delivery that
//     loses its claim anyway (another delivery took it, or the store could
//     not be reached before the lease ran out) has its handler's context
//     cancelled with a cause matching ErrClaimLost, is reported as
//     OutcomeClaimLost, and never writes its record over the other
//     holder's claim.
//
// Durations too large to add to a time saturate rather than wrap.
//
// # Middleware order and retries
//
// Give the guard the message's retry budget and put the dead-letter topic
// outside it (package middleware/deadletter writes envelopes every
// BabelQueue SDK reads, and never dead-letters a transient failure):
//
//	dlq, _ := deadletter.Middleware(pub) // to "<topic>.dlq"
//	router.AddMiddleware(
//		dlq,
//		idempotency.Middleware(store, idempotency.WithRetries(idempotency.Retries{Max: 3})),
//	)
//
// The budget is one per message, not one per delivery: the guard counts a
// message's failed runs in the store (stores.Store.Fail), across
// deliveries, processes and restarts, and retries in place with a growing
// wait and jitter while the budget lasts. Every broker takes a message
// back on its own schedule (after a lost ack, its own deadline, a
// rebalance, a restart, a crash); whatever it does, a failing message runs
// at most 1+Max times in all and is dead-lettered once. A panic is a
// failed run like an error. The waits and retries of one delivery stay
// within the time the broker gives it (WithDeliveryLimit, or a deadline on
// the message's context): when the next run would not fit, the delivery
// ends with ErrRetryLater, transient, and the next one goes on.
//
// A message that failed for good (its budget spent: ErrExhausted; a
// permanent rejection; a conflict; a message older than the replay
// horizon) is remembered as ended once the router acked its dead letter:
// a redelivery of it is acked without running and without a second dead
// letter (OutcomeEnded). The guard holds the message's claim until that
// ack, so a concurrent copy is parked, not dead-lettered too. A redrive
// (package redrive, bq-idempotency redrive) marks the copies it sends back
// (envelope.MetadataRedrive): a marked copy reopens the end and runs with a
// fresh budget. Forget clears an end too.
//
// Watermill's Retry, Recoverer and deadletter.CountAttempts around the
// guard were the wiring before WithRetries; they still work, the budget
// then being Retry's, per delivery (Retryable is its ShouldRetry). Even
// then, a message dead-lettered and acked is remembered as ended.
//
// Without a dead-letter topic a message that fails for good is nacked on
// every delivery and comes back for ever (under WithRetries without
// running again).
//
// # Transactional mode: inbox and outbox
//
// For effects that live in PostgreSQL, WithTransaction runs each identified
// delivery in one database transaction holding the message's record, the
// handler's writes (through postgresstore.TxFromContext) and, with WithOutbox,
// the messages the handler produces, written to an outbox table instead of
// being handed to the router. The transaction commits before the middleware
// returns, so the router acks only a committed delivery; a relay (Watermill's
// components/forwarder, see watermillsql.Outbox) publishes the outbox rows to
// the broker after the commit, outside it. What is atomic: record, writes and
// produced messages, all or nothing. A handler error, a panic or a failed
// commit leaves none of them and the delivery is redelivered. The relay
// publishes each produced message at least once; derive its id from the
// consumed message (envelope.NewChild) so a second copy is skipped. A
// message without identity that fails open runs in a transaction too,
// without a record.
//
//	outbox, _ := watermillsql.NewOutbox(ctx, db, watermillsql.OutboxConfig{Topic: "orders_outbox"})
//	router.AddMiddleware(idempotency.Middleware(store,
//		idempotency.WithTransaction(db), idempotency.WithOutbox(outbox.Publisher)))
//	relay, _ := outbox.NewForwarder(brokerPublisher) // relay.Run(ctx) beside the router
//
// Handlers that use pgx natively (a pgxpool.Pool, no database/sql) get the
// same with WithPgxTransaction(pool) and PgxTxFromContext, without the
// outbox and WithSubscriberTx (watermill-sql's are database/sql's). There
// the record costs no round trip of its own: it is sent with the
// transaction's BEGIN, so a delivery costs the round trips of the handler's
// own transaction (docs/benchmarks.md: per delivery, 97% of the
// throughput of the handler's transaction alone, where WithTransaction,
// one round trip more, keeps 82%).
//
//	router.AddMiddleware(idempotency.Middleware(store, idempotency.WithPgxTransaction(pool)))
//	// in the handler:
//	tx, _ := idempotency.PgxTxFromContext(msg.Context())
//	_, err := tx.Exec(msg.Context(), "INSERT INTO payments ...")
//
// With WithSubscriberTx the transaction is the one watermill-sql's subscriber
// consumes the message in, so consuming it commits atomically too. Each
// attempt then runs in a savepoint: Retry's next attempt, a resend after a
// nack or a dead-lettered failure find nothing of a failed attempt. An
// attempt checks its deferred constraints before its savepoint is released,
// so a violation fails that attempt, not the subscriber's commit of the
// batch; a serialization failure or deadlock rolls the subscriber's
// transaction back, and the message is read again in a fresh one (see
// WithSubscriberTx).
//
// # Logs, traces and metrics
//
// Without configuration the middleware logs through slog.Default(), read at
// each line: rejections, payload conflicts and lost claims at warning, a
// message without identity at info once (its redeliveries at debug), skips
// and parked deliveries at debug, store failures at error (WithLogger;
// WithLogger(watermill.NopLogger{}) silences it). Each delivery is an
// OpenTelemetry span, SpanDelivery, continuing the trace the message
// carries, with the decision and the store calls as events; the handler's
// spans are its children. The metrics (MetricDeliveries,
// MetricStoreDuration, MetricClaimsInProgress, MetricOldestClaimAge) are
// recorded with the OpenTelemetry metric API; docs/operating.md lists them
// with their Prometheus names, and deploy/prometheus holds alerting rules
// on them.
//
// # What it does not promise
//
// It is exactly-once effect, not exactly-once delivery: the handler may see
// a message more than once if it fails, and an effect outside the store's
// reach (an email, a payment API) can repeat in the narrow window between a
// successful run and its record being written, or when a run outlives its
// claim lease: package effects keeps such an effect from repeating (a stable
// provider key, the intent before the call, unknown outcomes reconciled),
// keyed on the identity DeliveryFromContext gives the handler. Records kept
// with a TTL protect only for that long.
package idempotency
