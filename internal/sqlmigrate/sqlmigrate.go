// Package sqlmigrate runs the kit's schema statements one migration at a
// time in a database, so that replicas starting together never race on
// CREATE TABLE IF NOT EXISTS (PostgreSQL lets two such statements both
// find the table missing, and the second then fails with a unique
// violation on its catalog).
//
// A migration's lock is named after the table it migrates: replicas
// migrating one table wait for one another, other tables do not.
//
// On PostgreSQL the statements run in one transaction holding a
// transaction-scoped advisory lock (pg_advisory_xact_lock), released by
// the commit or rollback, or by the server when the connection dies. On
// MariaDB and MySQL they run on one connection holding a named lock
// (GET_LOCK), released at the end or when the connection closes. Waiting
// for the lock ends with the caller's context.
package sqlmigrate

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"time"

	"github.com/babelqueue/watermill-idempotency/internal/ctxerr"
)

// LockPrefix starts the name of every migration lock; the rest names what
// is migrated (the table), so that migrations of different tables do not
// wait for one another.
const LockPrefix = "watermill-idempotency:migrate:"

// lockKey is the 64-bit FNV-1a hash of the lock's name: the PostgreSQL
// advisory lock key.
func lockKey(name string) int64 {
	h := uint64(14695981039346656037)
	for _, b := range []byte(LockPrefix + name) {
		h ^= uint64(b)
		h *= 1099511628211
	}
	return int64(h)
}

// LockName returns the MariaDB lock name of the migration of name (GET_LOCK
// names are at most 64 characters).
func LockName(name string) string { return fmt.Sprintf("bq-migrate:%016x", uint64(lockKey(name))) }

// Postgres runs stmts in order in one transaction on db, under the
// migration lock of name (the table migrated).
func Postgres(ctx context.Context, db *sql.DB, name string, stmts ...string) (err error) {
	defer func() { err = ctxerr.Match(ctx, err) }()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback()
		}
	}()
	if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock($1)`, lockKey(name)); err != nil {
		return fmt.Errorf("take the migration lock: %w", err)
	}
	for _, stmt := range stmts {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return err
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// ErrLockTimeout is returned by MariaDB when the lock stayed held by
// another migration until ctx ended.
var ErrLockTimeout = errors.New("migration lock still held by another migration")

// MariaDB runs migrate on one connection of db holding the migration lock
// of name (the table migrated). The lock is asked for a second at a time,
// so that the wait ends with ctx even where the driver cannot cancel a
// statement.
func MariaDB(ctx context.Context, db *sql.DB, name string, migrate func(ctx context.Context, conn *sql.Conn) error) (err error) {
	lock := LockName(name)
	conn, err := db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close()
	for {
		var got sql.NullInt64
		if err := conn.QueryRowContext(ctx, `SELECT GET_LOCK(?, 1)`, lock).Scan(&got); err != nil {
			return fmt.Errorf("take the migration lock: %w", err)
		}
		if got.Valid && got.Int64 == 1 {
			break
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("%w: %w", ErrLockTimeout, err)
		}
	}
	defer func() {
		// A lock left by a failed release goes with the connection.
		release, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, rerr := conn.ExecContext(release, `DO RELEASE_LOCK(?)`, lock); rerr != nil {
			_ = conn.Raw(func(any) error { return driver.ErrBadConn }) // drop the connection, and the lock with it
		}
	}()
	return migrate(ctx, conn)
}
