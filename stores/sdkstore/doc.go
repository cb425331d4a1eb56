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
// retention. The PHP stores are those of the PHP SDK 1.15.0 or later.
//
// On PostgreSQL a table name follows PostgreSQL's case folding: the SDKs
// write it unquoted, so a PHP or Go SDK consumer configured with
// "Orders_Idem" uses the table orders_idem. Give WithTable the name in
// lower case; a name with capitals is refused (ErrInvalidOption) with an
// error naming the table the SDKs use, rather than taken as a second table
// of the kit's own, where every message handled on both sides would run
// twice. (A table an earlier version of this package created under a name
// with capitals keeps them; rename it, ALTER TABLE "Orders_Idem" RENAME TO
// orders_idem, before the SDK consumers create theirs.) The same holds for
// WithClaimTable and for bq-idempotency's --table and --claim-table. On
// MariaDB a name is the same table to both sides, capitals or not.
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
// On the PHP side, run the handlers under the store's claim: wrap them with
// ClaimingDispatch::wrap($store, $handler). The Laravel adapter does when
// its idempotency store is a ClaimingStore (RedisStore and PdoStore are),
// and the Symfony middleware when it is given one. The PHP core has no
// consume loop of its own for Redis or RabbitMQ (its RedisTransport and
// AmqpTransport publish): the Laravel and Symfony adapters have theirs, and
// a loop of your own calls the wrapped handler. Idempotent::wrap, the
// lead example of the PHP SDK's README, takes no claim: copies handled at
// the same instant by it and by the kit can both run (see Limits).
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
// unless WithTTL bounds the kit's own records. The kit's claim is taken
// only where the key is absent, with the lease as its expiry, as the PHP
// SDK's SET NX PX is, with the value "1" followed by ":" and the holder's
// token (see Claim holders): PHP reads it as in flight (not "2") and its
// release, which deletes only the value "1", never drops a claim the kit
// holds. The kit's release drops only its holder's own claim: never the
// PHP SDK's "1", never another holder's claim, never a remembered message.
//
// PHP PdoStore. A row per meta.id, state 'claimed' (expires_at in Unix
// seconds) or 'seen' (expires_at NULL). Claims count whole seconds by the
// database clock (a claim lasts between its lease and a second more); keep
// the PHP hosts' clocks in sync with the database. The layout has no column
// for the claim's holder: the store instance that took a claim recognises
// it by the expiry it wrote (see Claim holders). The layout keeps records
// until they are deleted, so WithTTL is an error. On MariaDB leave
// go-sql-driver/mysql's clientFoundRows off (the default). A meta.id the
// VARCHAR(255) column cannot hold (over 255 characters) is kept under a
// digest instead; a PHP consumer cannot store such an id at all.
//
// On MariaDB the message_id column must compare ids byte for byte, or two
// meta.ids differing only in case or trailing spaces would share one
// record. Let the kit create the table: Migrate creates it with
// utf8mb4_nopad_bin, and the PHP side's PdoStore::ddl() (CREATE TABLE IF
// NOT EXISTS) then leaves it as it is. A table PdoStore::ddl() created
// first takes the database's default collation, usually one that ignores
// case (utf8mb4_general_ci): Migrate refuses it with an error matching
// ErrKeyCollation, which ends with the statement to run; for the default
// table:
//
//	ALTER TABLE `bq_idempotency` MODIFY message_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL
//
// Migrate then accepts the table, and the PHP SDK works on it unchanged.
// MariaDB copies the table to change the column: writes wait until it is
// done. So on MariaDB call Migrate even when the PHP side made the table:
// it is what checks the column.
//
// Go SDK idempotency-redis. Any live key counts as done, so the kit writes
// the record ("1", with the TTL) only after the handler succeeded, and keeps
// its in-flight claims under a prefix the Go SDK never reads
// (bq:idemp-claim:<meta.id>). A claim is taken first and the record looked
// up after it, and Remember writes the record before it drops the claim, so
// among kit consumers one delivery runs and a concurrent one is parked.
// Both Redis layouts work on a Redis Cluster: every command and script
// touches one key. Their calls return by their context's deadline, with
// its error, whether or not the client ends commands there itself
// (go-redis's ContextTimeoutEnabled); a claim taken after its caller left
// is released.
//
// Go SDK idempotency-postgres. A row counts as done while its expires_at is
// NULL or in the future. The kit's claims live in a second table
// (babelqueue_idempotency_claims, created by Migrate) that the Go SDK never
// reads; Remember writes the row and drops the claim in one statement.
// Expired rows count as absent; DeleteExpired removes them (and lapsed
// claims) in batches, for when no Go SDK consumer is left to clean up.
//
// # Claim holders
//
// Every layout keeps the holder of each of the kit's claims: the delivery's
// token (stores.WithClaimToken; the middleware gives every delivery one)
// or, for a call whose context names none, a random token of the store
// instance, so two workers' instances are two holders. A Release drops only
// its holder's claim: a worker whose lease lapsed cannot drop the claim
// another took after it, and a Release naming no holder never drops a
// delivery's claim nor an SDK consumer's. A Claim that finds its holder's
// own live claim (go-redis sent the command again after its reply was lost)
// reports it taken and keeps its lease. Remember replaces any claim on the
// key, whoever holds it: once the record is written no claim matters.
//
// On the Redis layouts the token is in the claim's value; on the Go SDK
// PostgreSQL layout, in the holder column of the kit's claim table. The PHP
// PdoStore's row has no room for it, and the kit adds nothing to the table
// the PHP consumers create: the store instance that took a claim keeps in
// memory the expiry it wrote, per holder and key, and the claim is that
// holder's while its row is still 'claimed' with that expiry (among the
// kit's claims a takeover always writes a later one). So a holder's Release
// or repeated Claim works on the instance that took the claim; on another
// instance it finds no claim of its own and changes nothing (the claim
// lapses after its lease). The middleware never moves a delivery's token
// between instances, so this changes nothing it does. What the layout
// cannot tell apart: a claim whose row was deleted behind the instance's
// back (a Forget, the PHP SDK's release after a failed handler, which
// deletes any 'claimed' row, a manual DELETE) and then claimed by someone
// else with the very same expiry (in the same second, for the same whole
// seconds of lease). A repeated Claim by the first holder then reads the
// new claim as its own, and its Release drops it: the row holds nothing
// else that tells the two claims apart.
//
// # Failures
//
// The Redis layouts keep failures (Capabilities().Failures is true): how
// often a message failed across deliveries, processes and restarts, and
// which messages ended (dead-lettered for good), so the middleware's retry
// budget is one per message and a redelivery of a message that ended is
// acked without running. The SDKs have no such records, so the kit keeps
// them where no SDK consumer looks, in the layout of package redisstore
// (a failing record "f" and JSON, an ended one "e", the redrive marker's
// length and the marker, then JSON; both expire with WithTTL):
//
//   - Go SDK idempotency-redis: in the kit's claim key
//     (bq:idemp-claim:<meta.id>), which also holds a claim that carries a
//     count. A claim, the count it carries and an end change together, in
//     one script on one key; the record key is read first (Fail writes
//     nothing over a live record).
//   - PHP RedisStore: under a failure key of the kit's own beside the PHP
//     SDK's (bq:idem-fail:<meta.id>: the prefix without its final colon
//     and "-fail:"; after a prefix without a final colon, U+001E and
//     "fail:"), since the claim lives in the PHP SDK's key, which the PHP
//     SDK reads (a value of the kit's there would make the message busy to
//     PHP consumers for as long as it stays). The two keys live in two
//     slots of a Redis Cluster, so Fail reads the claim and then writes the
//     record, and Claim and Lookup read both in one round trip.
//
// An SDK consumer reads neither: it runs a message the kit counted, or
// ended, like any other (its own retries are its own), and once it
// succeeded its record is what both sides read; the kit's next claim of
// the message drops the count or end it kept. A Remember by the kit drops
// them too.
//
// The SQL layouts keep no failures (Capabilities().Failures is false; Fail
// and Reopen return an error matching stores.ErrNotSupported), so under
// them the middleware's budget holds within one delivery and a redelivery
// of a dead-lettered message runs again. Their tables have no place for a
// count that outlives a claim: the PHP PdoStore row holds message_id,
// state and expires_at only, the kit adds nothing to a table the PHP
// consumers create, and what it keeps of a claim's holder lives in the
// store instance's memory, which a count must outlive; the Go SDK
// PostgreSQL layout's claim table holds a claim's holder and lease, and
// its row is deleted when the claim is released or remembered over, taken
// over once its lease lapsed and removed by DeleteExpired, so a count kept
// there would go with the claim. Keeping failures there takes a table (or
// columns) these layouts do not have, on databases where they are
// deployed already.
//
// # Limits
//
// The Go SDK cannot see an in-flight claim: its claim and its record are the
// same key or row. Two copies of one message handled at the same instant,
// one by a kit consumer holding its claim and one by a Go SDK consumer, can
// both run; copies that arrive one after the other (the redelivery after a
// crash, a lost ack or a duplicate publish) run once whichever side gets
// them. The PHP SDK stores do not have this gap when the PHP side runs its
// handlers under ClaimingDispatch::wrap (see Wiring): both sides then read
// each other's claims. A PHP handler wrapped with Idempotent::wrap takes
// no claim and looks for none, so it has the same gap as the Go SDK.
//
// The layouts have nowhere to keep a fingerprint of the message's content
// or a value, so these stores keep neither (their Capabilities say so): a
// meta.id reused for a different message is skipped as a duplicate, not
// reported as a conflict. Neither do they offer the transactional mode
// (they are not stores.TxStore). A Claim that finds the key held reads the
// record in its way with one more round trip.
//
// # Inspection
//
// Every layout's Lookup reports a key's record with its expiry, for the
// middleware and for operators (bq-idempotency
// inspect and forget, with --store php-redis, php-pdo, go-redis or
// go-postgres), reading the records of both sides as each side reads them:
//
//   - PHP RedisStore: the value "2" is remembered (expiring only when WithTTL
//     bounds the kit's records); "1" (the PHP SDK's claim) or "1:" and a
//     token (the kit's) is in flight until the key expires, with the count
//     of a failing record beside it; with no such key, the failing or
//     ended record beside it, if any.
//   - PHP PdoStore: state 'seen' is remembered; a 'claimed' row is in flight
//     until its expires_at has passed by the database clock (the reported
//     expiry is the second after it, when a claimer may take it over), and
//     unknown after.
//   - Go SDK idempotency-redis: a live record key is remembered, expiring
//     with it; else the kit's claim key tells: a live claim is in flight
//     (with the count it carries), a failing or ended record is that.
//   - Go SDK idempotency-postgres: a row whose expires_at is NULL or in the
//     future is remembered; else a live kit claim in the claim table is in
//     flight. On a database where the kit's Migrate never ran (no claim
//     table: only Go SDK consumers used it) Inspect and Forget read and
//     drop the record alone; a claim table named by WithClaimTable must
//     exist.
//
// A key with none of these is unknown. On the PHP layouts a value or state
// neither side writes reads as in flight: neither side takes it for done,
// nor can claim over it. A Go SDK consumer's claim is its record (see
// Limits), so it reads as remembered. Inspect refuses scoped keys as the
// other methods do.
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
