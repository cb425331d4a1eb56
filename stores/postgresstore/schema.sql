-- Idempotency records for github.com/babelqueue/watermill-idempotency/stores/postgresstore.
-- (*Store).Migrate runs these same statements, with the table name it was given.
-- Run them yourself if you manage migrations with your own tool.
CREATE TABLE IF NOT EXISTS watermill_idempotency (
    key         uuid   PRIMARY KEY, -- the first 128 bits of SHA-256 of the scoped key
    expires_at  bigint,             -- Unix milliseconds; NULL: kept until forgotten
    claim       text,               -- the in-flight claim holder's token; NULL once remembered
    fingerprint bigint,             -- envelope.Fingerprint of the remembered message; NULL: none
    value       bytea               -- a value kept with the record (a saved response); NULL: none
);
-- Tables created before the fingerprint and value columns existed:
ALTER TABLE watermill_idempotency ADD COLUMN IF NOT EXISTS fingerprint bigint;
ALTER TABLE watermill_idempotency ADD COLUMN IF NOT EXISTS value bytea;
