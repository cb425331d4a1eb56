// Package sqlmigrate runs the kit's schema statements one migration at a
// time in a database, so that replicas starting together never race on
// CREATE TABLE IF NOT EXISTS (PostgreSQL lets two such statements both
// find the table missing, and the second then fails with a unique
// violation on its catalog).
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
)

// LockName is the lock every migration of the kit takes: one for the whole
// database (PostgreSQL) or server (MariaDB), since migrations are rare and
// short.
const LockName = "watermill-idempotency:migrate"

// lockKey is LockName's 64-bit FNV-1a hash, the PostgreSQL advisory lock key.
var lockKey = func() int64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(LockName); i++ {
		h ^= uint64(LockName[i])
		h *= 1099511628211
	}
	return int64(h)
}()

// Postgres runs stmts in order in one transaction on db, under the
// migration lock.
func Postgres(ctx context.Context, db *sql.DB, stmts ...string) (err error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback()
		}
	}()
	if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock($1)`, lockKey); err != nil {
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

// MariaDB runs migrate on one connection of db holding the migration lock.
// The lock is asked for a second at a time, so that the wait ends with
// ctx even where the driver cannot cancel a statement.
func MariaDB(ctx context.Context, db *sql.DB, migrate func(ctx context.Context, conn *sql.Conn) error) (err error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close()
	for {
		var got sql.NullInt64
		if err := conn.QueryRowContext(ctx, `SELECT GET_LOCK(?, 1)`, LockName).Scan(&got); err != nil {
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
		if _, rerr := conn.ExecContext(release, `DO RELEASE_LOCK(?)`, LockName); rerr != nil {
			_ = conn.Raw(func(any) error { return driver.ErrBadConn }) // drop the connection, and the lock with it
		}
	}()
	return migrate(ctx, conn)
}
