// Package sdkstore keeps idempotency records in the layouts of the
// BabelQueue SDK stores, so that a fleet mixing kit consumers and BabelQueue
// SDK consumers on one queue runs every message once: each side reads the
// other's records. It is the store for a migration in either direction and
// for running beside SDK consumers for good.
//
//	SDK store                     constructor     records
//	PHP RedisStore                NewPHPRedis     Redis key bq:idem:<meta.id>
//	PHP PdoStore                  NewPHPPDO       table bq_idempotency (PostgreSQL or MariaDB)
//	Go SDK idempotency-redis      NewGoRedis      Redis key bq:idemp:<meta.id>
//	Go SDK idempotency-postgres   NewGoPostgres   table babelqueue_idempotency (PostgreSQL)
//
// Prefixes and tables are the SDKs' defaults; WithPrefix and WithTable give
// the ones your SDK consumers were configured with, WithTTL their
// retention.
//
// # Wiring
//
// The SDKs key a record on meta.id alone. The middleware scopes keys by
// handler name unless told otherwise, so wire it with an empty scope, and
// with a claim so that concurrent copies are parked rather than run twice:
//
//	store, err := sdkstore.NewGoRedis(client, sdkstore.WithTTL(24*time.Hour))
//	…
//	router.AddMiddleware(idempotency.Middleware(store,
//		idempotency.WithScope(""), idempotency.WithClaim(time.Minute)))
//
// A key scoped by handler would hold a record no SDK consumer reads: every
// method refuses one with an error matching ErrScopedKey (a retryable error,
// so the messages wait for the wiring to be fixed rather than go to a dead
// letter). WithScopedKeys allows them, for a second handler on the same
// topic that only the kit runs.
//
// # What each side sees
//
// PHP RedisStore. A remembered message is the value "2", with no expiry
// unless WithTTL bounds the kit's own records. The kit's claim is set only
// when the key is free (with a lease, as the PHP SDK's SET NX PX), with the
// value "1" followed by ":" and the holder (the delivery's token, or the
// store instance's own for a caller that names none): PHP reads it as in
// flight (not "2") and its release, which deletes only the value "1", never
// drops a claim the kit holds. A claim by the holder of a live claim finds
// it taken by itself. The kit's release drops only its holder's claim;
// never another holder's, nor a remembered message.
//
// PHP PdoStore. A row per meta.id, state 'claimed' (expires_at in Unix
// seconds) or 'seen' (expires_at NULL). Claims count whole seconds by the
// database clock (a claim lasts between its lease and a second more); keep
// the PHP hosts' clocks in sync with the database. The layout has no column
// for the claim's holder: a store instance recognises its own claims by the
// expiry it wrote, so a release from another instance changes nothing and
// the claim lapses after its lease. The layout keeps records until they are
// deleted, so WithTTL is an error. On MariaDB the message_id column must
// compare ids byte for byte: Migrate creates it with utf8mb4_nopad_bin and
// refuses (ErrKeyCollation, naming the ALTER TABLE) an existing table whose
// collation ignores case or trailing spaces, since two meta.ids would then
// share a record. On MariaDB leave go-sql-driver/mysql's clientFoundRows
// off (the default). A meta.id the VARCHAR(255) column cannot hold (over 255
// characters) is kept under a digest instead; a PHP consumer cannot store
// such an id at all.
//
// Go SDK idempotency-redis. Any live key counts as done, so the kit writes
// the record ("1", with the TTL) only after the handler succeeded, and keeps
// its in-flight claims under a prefix the Go SDK never reads
// (bq:idemp-claim:<meta.id>). A claim is taken first and the record looked
// up after it, and Remember writes the record before it drops the claim, so
// among kit consumers one delivery runs and a concurrent one is parked.
// Both Redis layouts work on a Redis Cluster: every command touches one key.
//
// Go SDK idempotency-postgres. A row counts as done while its expires_at is
// NULL or in the future. The kit's claims live in a second table
// (babelqueue_idempotency_claims, created by Migrate) that the Go SDK never
// reads; Remember writes the row and drops the claim in one statement.
// Expired rows count as absent; DeleteExpired removes them (and lapsed
// claims) in batches, for when no Go SDK consumer is left to clean up.
//
// # Limits
//
// The Go SDK cannot see an in-flight claim: its claim and its record are the
// same key or row. Two copies of one message handled at the same instant,
// one by a kit consumer holding its claim and one by a Go SDK consumer, can
// both run; copies that arrive one after the other (the redelivery after a
// crash, a lost ack or a duplicate publish) run once whichever side gets
// them. The PHP SDK stores do not have this gap: both sides read each
// other's claims.
//
// The layouts have nowhere to keep a fingerprint of the message's content,
// so these stores do not implement stores.Fingerprinter: a meta.id reused
// for a different message is skipped as a duplicate, not reported as a
// conflict. Neither do they offer the transactional mode
// (stores.TxRememberer) nor operator inspection (stores.Inspector).
//
// # Migrating from SDK consumers to the kit
//
//  1. Create the store on the SDK's Redis or database with the SDK's prefix
//     or table and retention; wire the middleware with WithScope("") and
//     WithClaim.
//  2. Start kit consumers on the same queue (the same consumer group)
//     beside the SDK consumers. Every message already handled by either
//     side is skipped by the other. With the Go SDK, keep this overlap short
//     (see Limits).
//  3. Stop the SDK consumers. The kit keeps reading and writing their
//     records, so redeliveries of what they handled are skipped. On the
//     SQL layouts, run DeleteExpired on a schedule if the SDK's cleanup
//     went with them.
//  4. To move later to the kit's own stores (redisstore, postgresstore:
//     smaller records, fingerprints, the transactional mode), switch once
//     no redelivery can be older than the switch by more than the SDK's
//     retention, or set the middleware's replay horizon so such late
//     copies are rejected instead of run.
//
// # Migrating from the kit to SDK consumers
//
//  1. Switch the kit's consumers to this package's store first, alone: the
//     records of its previous store are not in the SDK layout. Keep them on
//     it until redeliveries of messages handled before the switch can no
//     longer arrive (the previous store's retention, or the replay horizon).
//  2. Start the SDK consumers on the same queue and records, then stop the
//     kit's consumers. Every message the kit handled is skipped by the SDK.
package sdkstore
