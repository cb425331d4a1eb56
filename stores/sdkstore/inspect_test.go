package sdkstore_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/sdkstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// wantRecord fails the test unless Inspect(key) reports state, with an
// expiry between from and to after now (both zero: no expiry).
func wantRecord(t *testing.T, s stores.Store, key string, state stores.State, from, to time.Duration, when string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := s.Lookup(ctx, key)
	if err != nil {
		t.Fatalf("Inspect(%q) %s: %v", key, when, err)
	}
	if r.State != state {
		t.Fatalf("Inspect(%q) %s = %v, want %v", key, when, r.State, state)
	}
	if from == 0 && to == 0 {
		if !r.ExpiresAt.IsZero() {
			t.Fatalf("Inspect(%q) %s expires at %v, want no expiry", key, when, r.ExpiresAt)
		}
		return
	}
	now := time.Now()
	if r.ExpiresAt.Before(now.Add(from)) || r.ExpiresAt.After(now.Add(to)) {
		t.Fatalf("Inspect(%q) %s expires in %v, want between %v and %v", key, when, r.ExpiresAt.Sub(now), from, to)
	}
}

// sdkDelivery runs one delivery of id through the SDK consumer, calling
// during while its handler runs, and fails the test unless it ran.
func sdkDelivery(t *testing.T, sdk sdkConsumer, id string, during func()) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ran, err := sdk.handle(ctx, id, func() error { during(); return nil })
	if !ran || err != nil {
		t.Fatalf("SDK delivery of %q: ran %v, %v", id, ran, err)
	}
}

func mustDo(t *testing.T, err error, what string) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// TestInspectPHPRedis: the PHP SDK's "1" (claim, SET NX PX) and "2"
// (remembered) as the SDK writes them, the kit's "1:<token>" claim and its
// record, and keys absent or lapsed.
func TestInspectPHPRedis(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	p := redisPrefix(t, client) + ":idem:"
	kit := ok(t)(sdkstore.NewPHPRedis(client, sdkstore.WithPrefix(p)))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sdk := phpRedisSDK{client, p, time.Minute}

	wantRecord(t, kit, "absent", stores.StateUnknown, 0, 0, "of an absent key")
	// The PHP SDK's own delivery: "1" with its lease while the handler
	// runs, "2" with no expiry after.
	sdkDelivery(t, sdk, "php-1", func() {
		wantRecord(t, kit, "php-1", stores.StateInFlight, 50*time.Second, time.Minute, "while the PHP SDK handles it")
	})
	wantRecord(t, kit, "php-1", stores.StateRemembered, 0, 0, "after the PHP SDK recorded it")
	// Raw writes, exactly as the SDK's commands write them.
	mustDo(t, client.Set(ctx, p+"raw-2", "2", 0).Err(), "SET 2")
	wantRecord(t, kit, "raw-2", stores.StateRemembered, 0, 0, `of "2"`)
	mustDo(t, client.SetNX(ctx, p+"raw-1", "1", 30*time.Second).Err(), "SET 1 NX PX")
	wantRecord(t, kit, "raw-1", stores.StateInFlight, 20*time.Second, 30*time.Second, `of "1"`)
	mustDo(t, client.SetNX(ctx, p+"lapsed", "1", 20*time.Millisecond).Err(), "SET 1 NX PX")
	time.Sleep(60 * time.Millisecond)
	wantRecord(t, kit, "lapsed", stores.StateUnknown, 0, 0, "of a lapsed claim")
	// The kit's own claim and record.
	c := kit
	if claimed, _, err := c.Claim(stores.WithClaimToken(ctx, "tok"), "kit-1", 45*time.Second); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	if v, _ := client.Get(ctx, p+"kit-1").Result(); v != "1:tok" {
		t.Fatalf("the kit's claim is %q, want 1:tok", v)
	}
	wantRecord(t, kit, "kit-1", stores.StateInFlight, 35*time.Second, 45*time.Second, "while the kit holds its claim")
	mustDo(t, kit.Remember(stores.WithClaimToken(ctx, "tok"), "kit-1", 0, nil), "Remember")
	wantRecord(t, kit, "kit-1", stores.StateRemembered, 0, 0, "after Remember")
	// The kit's records expire when WithTTL bounds them.
	bounded := ok(t)(sdkstore.NewPHPRedis(client, sdkstore.WithPrefix(p), sdkstore.WithTTL(time.Hour)))
	mustDo(t, bounded.Remember(ctx, "kit-2", 0, nil), "Remember under a TTL")
	wantRecord(t, kit, "kit-2", stores.StateRemembered, 59*time.Minute, time.Hour, "under a TTL")
	mustDo(t, kit.Forget(ctx, "kit-2"), "Forget")
	wantRecord(t, kit, "kit-2", stores.StateUnknown, 0, 0, "after Forget")
}

// TestInspectGoRedis: the Go SDK's record (written by its claim, kept with
// its TTL) is remembered; the kit's claim under the claim prefix is in
// flight; a record beside a claim is remembered.
func TestInspectGoRedis(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	p := redisPrefix(t, client) + ":idemp:"
	kit := ok(t)(sdkstore.NewGoRedis(client, sdkstore.WithPrefix(p), sdkstore.WithTTL(time.Hour)))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sdk := goRedisSDK{client, p, time.Hour}

	wantRecord(t, kit, "absent", stores.StateUnknown, 0, 0, "of an absent key")
	// The Go SDK's claim is its record: done from the start, for the
	// SDK's TTL.
	sdkDelivery(t, sdk, "go-1", func() {
		wantRecord(t, kit, "go-1", stores.StateRemembered, 59*time.Minute, time.Hour, "while the Go SDK handles it")
	})
	wantRecord(t, kit, "go-1", stores.StateRemembered, 59*time.Minute, time.Hour, "after the Go SDK handled it")
	// A record kept with no TTL (a Go SDK configured without one).
	mustDo(t, client.Set(ctx, p+"raw", "1", 0).Err(), "SET 1")
	wantRecord(t, kit, "raw", stores.StateRemembered, 0, 0, "of a record with no TTL")
	// The kit's claim, then its record.
	c := kit
	if claimed, _, err := c.Claim(ctx, "kit-1", 45*time.Second); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	if n, _ := client.Exists(ctx, p+"kit-1").Result(); n != 0 {
		t.Fatal("the kit's claim wrote a record the Go SDK reads")
	}
	wantRecord(t, kit, "kit-1", stores.StateInFlight, 35*time.Second, 45*time.Second, "while the kit holds its claim")
	mustDo(t, kit.Remember(ctx, "kit-1", 0, nil), "Remember")
	wantRecord(t, kit, "kit-1", stores.StateRemembered, 59*time.Minute, time.Hour, "after Remember")
	// A record and a claim at once (a Go SDK consumer recorded the message
	// while the kit held a claim): remembered.
	if claimed, _, err := c.Claim(ctx, "both", time.Minute); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	mustDo(t, client.Set(ctx, p+"both", "1", 0).Err(), "SET 1")
	wantRecord(t, kit, "both", stores.StateRemembered, 0, 0, "of a record beside a claim")
	// A claim whose lease lapsed.
	if claimed, _, err := c.Claim(ctx, "lapsed", 20*time.Millisecond); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	time.Sleep(60 * time.Millisecond)
	wantRecord(t, kit, "lapsed", stores.StateUnknown, 0, 0, "of a lapsed claim")
	mustDo(t, kit.Forget(ctx, "both"), "Forget")
	wantRecord(t, kit, "both", stores.StateUnknown, 0, 0, "after Forget")
}

// TestInspectPHPPDO: the PHP SDK's rows ('claimed' with expires_at in Unix
// seconds, 'seen' with NULL) as it writes them, on PostgreSQL and MariaDB;
// a lapsed claim is unknown.
func TestInspectPHPPDO(t *testing.T) {
	t.Parallel()
	for _, d := range databases(t) {
		t.Run(d.dialect.String(), func(t *testing.T) {
			table := sqlTable(t, d.db, "bq_idempotency")
			kit := ok(t)(sdkstore.NewPHPPDO(d.db, d.dialect, sdkstore.WithTable(table)))
			migrate(t, kit)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			sdk := phpPDOSDK{d.db, d.dialect == sdkstore.MariaDB, table, time.Minute}

			wantRecord(t, kit, "absent", stores.StateUnknown, 0, 0, "of an absent row")
			// The PHP SDK's own delivery: 'claimed' until now + 60s (by
			// the PHP clock) while the handler runs, 'seen' after.
			sdkDelivery(t, sdk, "php-1", func() {
				wantRecord(t, kit, "php-1", stores.StateInFlight, 59*time.Second, 62*time.Second, "while the PHP SDK handles it")
			})
			wantRecord(t, kit, "php-1", stores.StateRemembered, 0, 0, "after the PHP SDK recorded it")
			// A claim whose expiry has passed: any claimer may take it.
			_, err := d.db.ExecContext(ctx, sdk.q(`INSERT INTO `+table+` (message_id, state, expires_at) VALUES (?, 'claimed', ?)`), "lapsed", time.Now().Unix()-10)
			mustDo(t, err, "insert a lapsed claim")
			wantRecord(t, kit, "lapsed", stores.StateUnknown, 0, 0, "of a lapsed claim")
			// The kit's claim and record.
			c := kit
			if claimed, _, err := c.Claim(ctx, "kit-1", 30*time.Second); err != nil || !claimed {
				t.Fatalf("Claim = %v, %v", claimed, err)
			}
			wantRecord(t, kit, "kit-1", stores.StateInFlight, 29*time.Second, 33*time.Second, "while the kit holds its claim")
			mustDo(t, kit.Remember(ctx, "kit-1", 0, nil), "Remember")
			wantRecord(t, kit, "kit-1", stores.StateRemembered, 0, 0, "after Remember")
			// An id longer than the column holds is kept under a digest,
			// and inspected under it.
			long := strings.Repeat("x", sdkstore.PHPMaxIDChars+1)
			wantRecord(t, kit, long, stores.StateUnknown, 0, 0, "of a long id never remembered")
			mustDo(t, kit.Remember(ctx, long, 0, nil), "Remember a long id")
			wantRecord(t, kit, long, stores.StateRemembered, 0, 0, "of a long id")
			mustDo(t, kit.Forget(ctx, long), "Forget a long id")
			wantRecord(t, kit, long, stores.StateUnknown, 0, 0, "of a long id after Forget")
		})
	}
}

// TestInspectGoPostgres: the Go SDK's rows (expires_at NULL, future or
// past) and the kit's claims in its own table.
func TestInspectGoPostgres(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	table := sqlTable(t, db, "babelqueue_idempotency")
	kit := ok(t)(sdkstore.NewGoPostgres(db, sdkstore.WithTable(table), sdkstore.WithTTL(time.Hour)))
	migrate(t, kit)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sdk := goPostgresSDK{db, table, time.Hour}
	insert := func(id string, expires any) {
		t.Helper()
		_, err := db.ExecContext(ctx, `INSERT INTO `+table+` (message_id, created_at, expires_at) VALUES ($1, now(), $2)`, id, expires)
		mustDo(t, err, "insert a Go SDK row")
	}

	wantRecord(t, kit, "absent", stores.StateUnknown, 0, 0, "of an absent row")
	sdkDelivery(t, sdk, "go-1", func() {
		wantRecord(t, kit, "go-1", stores.StateRemembered, 59*time.Minute, time.Hour, "while the Go SDK handles it")
	})
	wantRecord(t, kit, "go-1", stores.StateRemembered, 59*time.Minute, time.Hour, "after the Go SDK handled it")
	insert("forever", nil)
	wantRecord(t, kit, "forever", stores.StateRemembered, 0, 0, "of a row with a NULL expires_at")
	insert("expired", time.Now().Add(-time.Minute))
	wantRecord(t, kit, "expired", stores.StateUnknown, 0, 0, "of an expired row")
	// The kit's claim over an expired row is in flight; its Remember
	// makes a live record.
	c := kit
	if claimed, _, err := c.Claim(ctx, "expired", 45*time.Second); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	wantRecord(t, kit, "expired", stores.StateInFlight, 35*time.Second, 45*time.Second, "of an expired row under the kit's claim")
	mustDo(t, kit.Remember(ctx, "expired", 0, nil), "Remember")
	wantRecord(t, kit, "expired", stores.StateRemembered, 59*time.Minute, time.Hour, "after Remember")
	// A claim whose lease lapsed.
	if claimed, _, err := c.Claim(ctx, "lapsed", 20*time.Millisecond); err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	time.Sleep(60 * time.Millisecond)
	wantRecord(t, kit, "lapsed", stores.StateUnknown, 0, 0, "of a lapsed claim")
	// A long id, kept verbatim in the TEXT column.
	long := strings.Repeat("y", 1000)
	mustDo(t, kit.Remember(ctx, long, 0, nil), "Remember a long id")
	wantRecord(t, kit, long, stores.StateRemembered, 59*time.Minute, time.Hour, "of a long id")
	mustDo(t, kit.Forget(ctx, "go-1"), "Forget")
	wantRecord(t, kit, "go-1", stores.StateUnknown, 0, 0, "after Forget")
}

// TestInspectKeyChecksAndTimeout: Inspect refuses a scoped key as every
// method does (unless WithScopedKeys), and the SQL layouts bound it by the
// query timeout.
func TestInspectKeyChecksAndTimeout(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	key := idempotency.Key("orders-handler", "scoped-"+testenv.RandomHex(8))
	for name, s := range allStores(t) {
		if _, err := s.Lookup(ctx, key); !errors.Is(err, sdkstore.ErrScopedKey) {
			t.Errorf("%s: Inspect of a scoped key: %v, want ErrScopedKey", name, err)
		}
	}
	for name, s := range allStores(t, sdkstore.WithScopedKeys()) {
		mustDo(t, s.Remember(ctx, key, 0, nil), name+": Remember of a scoped key")
		wantRecord(t, s, key, stores.StateRemembered, 0, 0, name+": with WithScopedKeys")
		mustDo(t, s.Forget(ctx, key), name+": Forget")
	}
	pg, maria := testenv.Postgres(t), testenv.MariaDB(t)
	for name, s := range map[string]stores.Store{
		"PHPPDO/PG":    ok(t)(sdkstore.NewPHPPDO(pg, sdkstore.PostgreSQL, sdkstore.WithQueryTimeout(time.Nanosecond))),
		"PHPPDO/Maria": ok(t)(sdkstore.NewPHPPDO(maria, sdkstore.MariaDB, sdkstore.WithQueryTimeout(time.Nanosecond))),
		"GoPostgres":   ok(t)(sdkstore.NewGoPostgres(pg, sdkstore.WithQueryTimeout(time.Nanosecond))),
	} {
		if _, err := s.Lookup(ctx, "id"); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("%s: Inspect under a 1ns query timeout: %v, want a deadline exceeded", name, err)
		}
	}
}

// TestInspectGoPostgresWithoutClaimTable: on a database only Go SDK
// consumers used (the kit's Migrate never created its claim table), an
// operator can still inspect and forget records: nothing is in flight
// there, so the record alone answers.
func TestInspectGoPostgresWithoutClaimTable(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	table := sqlTable(t, db, "babelqueue_idempotency")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := db.ExecContext(ctx, `CREATE TABLE `+table+` (message_id TEXT PRIMARY KEY, created_at TIMESTAMPTZ NOT NULL DEFAULT now(), expires_at TIMESTAMPTZ NULL)`)
	mustDo(t, err, "create the Go SDK's table")
	_, err = db.ExecContext(ctx, `INSERT INTO `+table+` (message_id, expires_at) VALUES ('done', now() + interval '1 hour')`)
	mustDo(t, err, "insert a Go SDK row")
	kit := ok(t)(sdkstore.NewGoPostgres(db, sdkstore.WithTable(table), sdkstore.WithTTL(time.Hour)))
	wantRecord(t, kit, "done", stores.StateRemembered, 59*time.Minute, time.Hour, "of the Go SDK's row")
	wantRecord(t, kit, "absent", stores.StateUnknown, 0, 0, "of an absent row")
	mustDo(t, kit.Forget(ctx, "done"), "Forget")
	wantRecord(t, kit, "done", stores.StateUnknown, 0, 0, "after Forget")
}
