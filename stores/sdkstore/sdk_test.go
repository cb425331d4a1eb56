package sdkstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/redis/go-redis/v9"
)

// This file holds faithful implementations of the BabelQueue SDK stores'
// operations, written from their documented layouts, and of the consumer
// loop around them, so that tests can run the kit and an SDK consumer side
// by side on one store.

// errParked is what an SDK consumer returns when another delivery holds the
// message's claim: the broker redelivers the message later.
var errParked = errors.New("sdk: message in flight elsewhere, redeliver later")

// sdkConsumer runs one delivery of a message the way an SDK consumer does:
// it skips a message already done, runs effect otherwise and records it.
type sdkConsumer interface {
	handle(ctx context.Context, id string, effect func() error) (ran bool, err error)
}

// PHP RedisStore: claim = SET key 1 NX PX ttl; remember = SET key 2;
// seen ⇔ value "2"; release = delete only while the value is "1".
type phpRedisSDK struct {
	client redis.UniversalClient
	prefix string
	ttl    time.Duration
}

var phpRelease = redis.NewScript(`if redis.call('GET', KEYS[1]) == '1' then return redis.call('DEL', KEYS[1]) end return 0`)

func (p phpRedisSDK) handle(ctx context.Context, id string, effect func() error) (bool, error) {
	key := p.prefix + id
	v, err := p.client.Get(ctx, key).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return false, err
	}
	if v == "2" {
		return false, nil // seen
	}
	ok, err := p.client.SetNX(ctx, key, "1", p.ttl).Result()
	if err != nil {
		return false, err
	}
	if !ok {
		return false, errParked
	}
	if err := effect(); err != nil {
		if rerr := phpRelease.Run(ctx, p.client, []string{key}).Err(); rerr != nil && !errors.Is(rerr, redis.Nil) {
			return true, rerr
		}
		return true, err
	}
	return true, p.client.Set(ctx, key, "2", 0).Err()
}

// PHP PdoStore: bq_idempotency(message_id, state 'claimed'/'seen',
// expires_at epoch seconds, NULL once seen). The PHP process uses its own
// clock (time()).
type phpPDOSDK struct {
	db      *sql.DB
	mariaDB bool
	table   string
	ttl     time.Duration
}

// q rewrites ? placeholders as $n for PostgreSQL.
func (p phpPDOSDK) q(query string) string {
	if p.mariaDB {
		return query
	}
	var b strings.Builder
	n := 0
	for _, r := range query {
		if r == '?' {
			n++
			fmt.Fprintf(&b, "$%d", n)
			continue
		}
		b.WriteRune(r)
	}
	return b.String()
}

func (p phpPDOSDK) handle(ctx context.Context, id string, effect func() error) (bool, error) {
	var state string
	err := p.db.QueryRowContext(ctx, p.q(`SELECT state FROM `+p.table+` WHERE message_id = ?`), id).Scan(&state)
	if err != nil && !errors.Is(err, sql.ErrNoRows) {
		return false, err
	}
	if state == "seen" {
		return false, nil
	}
	claimed, err := p.claim(ctx, id)
	if err != nil {
		return false, err
	}
	if !claimed {
		// A row that is not claimable: seen a moment ago, or claimed.
		if err := p.db.QueryRowContext(ctx, p.q(`SELECT state FROM `+p.table+` WHERE message_id = ?`), id).Scan(&state); err == nil && state == "seen" {
			return false, nil
		}
		return false, errParked
	}
	if err := effect(); err != nil {
		if _, rerr := p.db.ExecContext(ctx, p.q(`DELETE FROM `+p.table+` WHERE message_id = ? AND state = 'claimed'`), id); rerr != nil {
			return true, rerr
		}
		return true, err
	}
	_, err = p.db.ExecContext(ctx, p.q(`UPDATE `+p.table+` SET state = 'seen', expires_at = NULL WHERE message_id = ?`), id)
	return true, err
}

func (p phpPDOSDK) claim(ctx context.Context, id string) (bool, error) {
	now := time.Now().Unix()
	expires := now + int64(p.ttl/time.Second)
	_, err := p.db.ExecContext(ctx, p.q(`INSERT INTO `+p.table+` (message_id, state, expires_at) VALUES (?, 'claimed', ?)`), id, expires)
	if err == nil {
		return true, nil
	}
	var me *mysql.MySQLError
	if !(errors.As(err, &me) && me.Number == 1062) && !strings.Contains(err.Error(), "23505") {
		return false, err
	}
	// Taken: take it over if it is a claim whose expiry has passed.
	res, err := p.db.ExecContext(ctx, p.q(`UPDATE `+p.table+` SET expires_at = ? WHERE message_id = ? AND state = 'claimed' AND expires_at < ?`), expires, id, now)
	if err != nil {
		return false, err
	}
	n, err := res.RowsAffected()
	return n == 1, err
}

// Go SDK idempotency-redis: claim and remember are both SET key 1 NX with
// the TTL; seen ⇔ the key exists.
type goRedisSDK struct {
	client redis.UniversalClient
	prefix string
	ttl    time.Duration
}

func (g goRedisSDK) handle(ctx context.Context, id string, effect func() error) (bool, error) {
	key := g.prefix + id
	n, err := g.client.Exists(ctx, key).Result()
	if err != nil {
		return false, err
	}
	if n == 1 {
		return false, nil
	}
	ok, err := g.client.SetNX(ctx, key, "1", g.ttl).Result()
	if err != nil {
		return false, err
	}
	if !ok {
		return false, nil // any live key is done
	}
	if err := effect(); err != nil {
		if derr := g.client.Del(ctx, key).Err(); derr != nil {
			return true, derr
		}
		return true, err
	}
	return true, g.client.SetNX(ctx, key, "1", g.ttl).Err()
}

// Go SDK idempotency-postgres: babelqueue_idempotency(message_id,
// created_at, expires_at); seen ⇔ a row whose expires_at is NULL or in the
// future. A claim inserts the row (or takes over an expired one).
type goPostgresSDK struct {
	db    *sql.DB
	table string
	ttl   time.Duration
}

func (g goPostgresSDK) handle(ctx context.Context, id string, effect func() error) (bool, error) {
	var seen bool
	if err := g.db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM `+g.table+` WHERE message_id = $1 AND (expires_at IS NULL OR expires_at > now()))`, id).Scan(&seen); err != nil {
		return false, err
	}
	if seen {
		return false, nil
	}
	var one int
	err := g.db.QueryRowContext(ctx, `INSERT INTO `+g.table+` AS r (message_id, created_at, expires_at) VALUES ($1, now(), now() + $2 * interval '1 second')
ON CONFLICT (message_id) DO UPDATE SET created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
WHERE r.expires_at IS NOT NULL AND r.expires_at <= now() RETURNING 1`, id, int64(g.ttl/time.Second)).Scan(&one)
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil // a live row: done
	}
	if err != nil {
		return false, err
	}
	if err := effect(); err != nil {
		if _, derr := g.db.ExecContext(ctx, `DELETE FROM `+g.table+` WHERE message_id = $1`, id); derr != nil {
			return true, derr
		}
		return true, err
	}
	return true, nil // the row written by the claim is the record
}

// phpPDODDL is the statement the PHP SDK's PdoStore::ddl($table) returns and
// its README has the PHP side run: the table name unquoted, and no
// collation, so on MariaDB message_id takes the database's default.
func phpPDODDL(table string) string {
	return `CREATE TABLE IF NOT EXISTS ` + table + ` (
    message_id VARCHAR(255) NOT NULL,
    state      VARCHAR(16)  NOT NULL,
    expires_at BIGINT       NULL,
    PRIMARY KEY (message_id)
)`
}

// goPostgresDDL is the table the Go SDK idempotency-postgres's Migrate
// creates, with the table name unquoted as it writes it.
func goPostgresDDL(table string) string {
	return `CREATE TABLE IF NOT EXISTS ` + table + ` (
	message_id  TEXT        NOT NULL PRIMARY KEY,
	created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
	expires_at  TIMESTAMPTZ NULL
)`
}

// phpIdempotentWrap is a PHP consumer whose handler is wrapped with
// Idempotent::wrap (the lead example of the PHP SDK's README) instead of
// ClaimingDispatch::wrap: it skips a message the store's seen() reports,
// runs the handler otherwise and then calls remember(). It takes no claim.
type phpIdempotentWrap struct {
	seen     func(ctx context.Context, id string) (bool, error)
	remember func(ctx context.Context, id string) error
}

func (p phpIdempotentWrap) handle(ctx context.Context, id string, effect func() error) (bool, error) {
	seen, err := p.seen(ctx, id)
	if err != nil || seen {
		return false, err
	}
	if err := effect(); err != nil {
		return true, err
	}
	return true, p.remember(ctx, id)
}

// seen and remember are the PHP RedisStore's: the value "2"; SET key 2.
func (p phpRedisSDK) seen(ctx context.Context, id string) (bool, error) {
	v, err := p.client.Get(ctx, p.prefix+id).Result()
	if errors.Is(err, redis.Nil) {
		return false, nil
	}
	return v == "2", err
}

func (p phpRedisSDK) remember(ctx context.Context, id string) error {
	return p.client.Set(ctx, p.prefix+id, "2", 0).Err()
}

// seen and remember are the PHP PdoStore's: state 'seen'; an UPDATE to
// 'seen', else an INSERT of a 'seen' row (a duplicate key is ignored).
func (p phpPDOSDK) seen(ctx context.Context, id string) (bool, error) {
	var state string
	err := p.db.QueryRowContext(ctx, p.q(`SELECT state FROM `+p.table+` WHERE message_id = ?`), id).Scan(&state)
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	return state == "seen", err
}

func (p phpPDOSDK) remember(ctx context.Context, id string) error {
	res, err := p.db.ExecContext(ctx, p.q(`UPDATE `+p.table+` SET state = 'seen', expires_at = NULL WHERE message_id = ?`), id)
	if err != nil {
		return err
	}
	if n, err := res.RowsAffected(); err != nil || n == 1 {
		return err
	}
	_, err = p.db.ExecContext(ctx, p.q(`INSERT INTO `+p.table+` (message_id, state, expires_at) VALUES (?, 'seen', NULL)`), id)
	var me *mysql.MySQLError
	if err != nil && ((errors.As(err, &me) && me.Number == 1062) || strings.Contains(err.Error(), "23505")) {
		return nil
	}
	return err
}
