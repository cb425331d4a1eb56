-- External effects for github.com/babelqueue/watermill-idempotency/stores/postgresstore (Effects).
-- (*Effects).Migrate runs these same statements, with the table names it was given.
-- Run them yourself if you manage migrations with your own tool.
CREATE TABLE IF NOT EXISTS "watermill_idempotency_effects" (
    key         bytea   PRIMARY KEY,       -- the provider key
    name        bytea   NOT NULL,          -- the effect's name ("charge")
    scope       bytea   NOT NULL,          -- the message's scope (handler name)
    message_id  bytea   NOT NULL,          -- the message's identity (meta.id)
    fingerprint bigint  NOT NULL DEFAULT 0, -- of the request; 0: none
    state       text    NOT NULL CHECK (state IN ('pending', 'unknown', 'succeeded', 'failed')),
    result      bytea,                     -- succeeded: the provider's result
    note        bytea   NOT NULL DEFAULT ''::bytea, -- the last reason given
    evidence    text    NOT NULL DEFAULT '', -- what moved it last: call, lookup, callback, operator, …
    attempts    integer NOT NULL,          -- how many times it was taken to be sent
    holder      text    NOT NULL DEFAULT '', -- pending: the attempt holding it
    lease_until bigint  NOT NULL DEFAULT 0, -- pending: Unix ms until which its holder may be calling; unknown: its last attempt's lease
    created_at  bigint  NOT NULL,          -- Unix ms, the database clock
    state_since bigint  NOT NULL,
    updated_at  bigint  NOT NULL,
    expires_at  bigint,                    -- final effects under a TTL; NULL: kept
    result_expires_at bigint               -- succeeded under a result lifetime: Unix ms when result is dropped; NULL: kept with the row
);
-- Tables created by earlier releases lack the result lifetime's column.
ALTER TABLE "watermill_idempotency_effects" ADD COLUMN IF NOT EXISTS result_expires_at bigint;
CREATE INDEX IF NOT EXISTS "watermill_idempotency_effects_state" ON "watermill_idempotency_effects" (state, state_since);
-- The results a purge drops (past their lifetime, still held).
CREATE INDEX IF NOT EXISTS "watermill_idempotency_effects_result" ON "watermill_idempotency_effects" (result_expires_at)
    WHERE result IS NOT NULL AND result_expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS "watermill_idempotency_effects_events" (
    event_id    bytea  PRIMARY KEY,        -- the provider's event identity
    key         bytea  NOT NULL,           -- the effect it was about
    received_at bigint NOT NULL,
    expires_at  bigint
);
