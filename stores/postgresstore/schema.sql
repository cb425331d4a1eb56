-- Idempotency records for github.com/babelqueue/watermill-idempotency/stores/postgresstore.
-- (*Store).Migrate runs these same statements, with the table name it was given.
-- Run them yourself if you manage migrations with your own tool.
CREATE TABLE IF NOT EXISTS watermill_idempotency (
    key         uuid   PRIMARY KEY, -- the first 128 bits of SHA-256 of the scoped key
    expires_at  bigint,             -- Unix milliseconds; NULL: kept until forgotten
    claim       text,               -- the in-flight claim holder's token; NULL once remembered
    fingerprint bigint,             -- envelope.Fingerprint of the remembered message; NULL: none
    value       bytea,              -- a value kept with the record (a saved response); NULL: none
    failure     jsonb               -- how often the message failed, and how it ended; NULL: it never failed
);
-- Tables created before the fingerprint, value and failure columns existed
-- (adding a column without a default rewrites nothing: a moment's lock):
ALTER TABLE watermill_idempotency ADD COLUMN IF NOT EXISTS fingerprint bigint;
ALTER TABLE watermill_idempotency ADD COLUMN IF NOT EXISTS value bytea;
ALTER TABLE watermill_idempotency ADD COLUMN IF NOT EXISTS failure jsonb;
