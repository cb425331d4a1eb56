package sdkstore_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/sdkstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// dropAfter drops the tables (names as SQL spells them: quoted or not)
// when the test ends.
func dropAfter(t *testing.T, db *sql.DB, tables ...string) {
	t.Helper()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for _, n := range tables {
			if _, err := db.ExecContext(ctx, "DROP TABLE IF EXISTS "+n); err != nil {
				t.Errorf("drop %s: %v", n, err)
			}
		}
	})
}

// sdkRuns has an SDK consumer handle id and returns whether it ran the
// handler (false: it skipped the message as done).
func sdkRuns(ctx context.Context, t *testing.T, sdk sdkConsumer, id string) bool {
	t.Helper()
	ran, err := sdk.handle(ctx, id, func() error { return nil })
	if err != nil {
		t.Fatalf("SDK consumer, %s: %v", id, err)
	}
	return ran
}

// TestPostgresTableNameIsTheSDKs: the BabelQueue SDKs write the table name
// unquoted, so PostgreSQL reads "Orders_Idem" as orders_idem. The kit
// refuses a name with capitals, naming the SDKs' table, instead of quoting
// it into a second table where a message handled on both sides runs twice;
// with that name both sides skip what the other handled. Before, the kit
// took WithTable("Orders_Idem_…") as its own table "Orders_Idem_…" and did
// not see the SDK's record.
func TestPostgresTableNameIsTheSDKs(t *testing.T) {
	t.Parallel()
	db := testenv.Postgres(t)
	for _, tc := range []struct {
		name string
		ddl  func(table string) string
		sdk  func(table string) sdkConsumer
		kit  func(opts ...sdkstore.Option) (stores.Store, error)
	}{
		{
			"PHPPdoStore", phpPDODDL,
			func(table string) sdkConsumer { return phpPDOSDK{db, false, table, sdkTTL} },
			func(opts ...sdkstore.Option) (stores.Store, error) {
				return sdkstore.NewPHPPDO(db, sdkstore.PostgreSQL, opts...)
			},
		},
		{
			"GoSDKPostgres", goPostgresDDL,
			func(table string) sdkConsumer { return goPostgresSDK{db, table, sdkTTL} },
			func(opts ...sdkstore.Option) (stores.Store, error) {
				return sdkstore.NewGoPostgres(db, append(opts, sdkstore.WithTTL(sdkTTL))...)
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			given := "Orders_Idem_" + testenv.RandomHex(4)
			folded := strings.ToLower(given)
			dropAfter(t, db, folded, folded+"_claims", `"`+given+`"`, `"`+given+`_claims"`)
			// The SDK side creates its table as it does, and handles a message.
			if _, err := db.ExecContext(ctx, tc.ddl(given)); err != nil {
				t.Fatal(err)
			}
			sdk, run := tc.sdk(given), testenv.RandomHex(4)
			if !sdkRuns(ctx, t, sdk, "sdk-"+run) {
				t.Fatal("the SDK consumer skipped a new message")
			}

			kit, err := tc.kit(sdkstore.WithTable(given))
			if err == nil {
				migrate(t, kit)
				seen, serr := stores.Seen(ctx, kit, "sdk-"+run)
				t.Fatalf("WithTable(%q) accepted: the SDK's table is %s, and the kit reads the SDK's record as seen %v (%v)", given, folded, seen, serr)
			}
			if !errors.Is(err, sdkstore.ErrInvalidOption) || !strings.Contains(err.Error(), " "+folded+":") {
				t.Fatalf("WithTable(%q): %v; want ErrInvalidOption naming %s", given, err, folded)
			}
			t.Logf("WithTable(%q): %v", given, err)

			kit = ok(t)(tc.kit(sdkstore.WithTable(folded)))
			migrate(t, kit)
			if seen, err := stores.Seen(ctx, kit, "sdk-"+run); err != nil || !seen {
				t.Fatalf("kit on %s: Seen(the SDK's message) = %v, %v; want true", folded, seen, err)
			}
			if err := kit.Remember(ctx, "kit-"+run, 0, nil); err != nil {
				t.Fatal(err)
			}
			if sdkRuns(ctx, t, sdk, "kit-"+run) {
				t.Fatal("the SDK consumer ran a message the kit handled")
			}
		})
	}
	t.Run("ClaimTable", func(t *testing.T) {
		t.Parallel()
		_, err := sdkstore.NewGoPostgres(db, sdkstore.WithClaimTable("Kit_Claims"))
		if !errors.Is(err, sdkstore.ErrInvalidOption) || !strings.Contains(err.Error(), "kit_claims") {
			t.Fatalf("WithClaimTable(\"Kit_Claims\"): %v; want ErrInvalidOption naming kit_claims", err)
		}
		_, err = sdkstore.NewGoPostgres(db, sdkstore.WithTable("public.Orders"))
		if !errors.Is(err, sdkstore.ErrInvalidOption) || !strings.Contains(err.Error(), "public.orders") {
			t.Fatalf("WithTable(\"public.Orders\"): %v; want ErrInvalidOption naming public.orders", err)
		}
	})
}

// TestMariaDBTableNameAsGiven: on MariaDB quoting does not change how a
// name is read, so a name with capitals is accepted, and the kit and the
// PHP SDK, which writes it unquoted, share the one table.
func TestMariaDBTableNameAsGiven(t *testing.T) {
	t.Parallel()
	db := testenv.MariaDB(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	given := "Orders_Idem_" + testenv.RandomHex(4)
	dropAfter(t, db, "`"+given+"`")
	kit := ok(t)(sdkstore.NewPHPPDO(db, sdkstore.MariaDB, sdkstore.WithTable(given)))
	migrate(t, kit)
	if _, err := db.ExecContext(ctx, phpPDODDL(given)); err != nil { // a no-op: the kit created it
		t.Fatal(err)
	}
	php, run := phpPDOSDK{db, true, given, sdkTTL}, testenv.RandomHex(4)
	if !sdkRuns(ctx, t, php, "php-"+run) {
		t.Fatal("the PHP consumer skipped a new message")
	}
	if seen, err := stores.Seen(ctx, kit, "php-"+run); err != nil || !seen {
		t.Fatalf("Seen(the PHP consumer's message) = %v, %v; want true", seen, err)
	}
	if err := kit.Remember(ctx, "kit-"+run, 0, nil); err != nil {
		t.Fatal(err)
	}
	if sdkRuns(ctx, t, php, "kit-"+run) {
		t.Fatal("the PHP consumer ran a message the kit handled")
	}
}

// TestMariaDBTableMadeByThePHPSDK: the table created as the PHP SDK's
// README does (PdoStore::ddl(), the database's default collation) is
// refused by Migrate with ErrKeyCollation; the error ends with the one
// ALTER TABLE statement to run; once it has run, Migrate accepts the table,
// the PHP consumer's records are still there, and two ids differing only in
// case and a trailing space are two records on both sides.
func TestMariaDBTableMadeByThePHPSDK(t *testing.T) {
	t.Parallel()
	db := testenv.MariaDB(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	table := sqlTable(t, db, "bq_idempotency")
	if _, err := db.ExecContext(ctx, phpPDODDL(table)); err != nil {
		t.Fatal(err)
	}
	var collation string
	if err := db.QueryRowContext(ctx, `SELECT COLLATION_NAME FROM information_schema.COLUMNS
WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND COLUMN_NAME = 'message_id'`, table).Scan(&collation); err != nil {
		t.Fatal(err)
	}
	if strings.HasSuffix(collation, "_nopad_bin") || strings.HasSuffix(collation, "_0900_bin") {
		t.Skipf("the database's default collation, %s, compares ids byte for byte", collation)
	}
	php, run := phpPDOSDK{db, true, table, sdkTTL}, testenv.RandomHex(4)
	id := "order-" + run
	twin := strings.ToUpper(id) + " "
	if !sdkRuns(ctx, t, php, id) {
		t.Fatal("the PHP consumer skipped a new message")
	}
	kit := ok(t)(sdkstore.NewPHPPDO(db, sdkstore.MariaDB, sdkstore.WithTable(table))).(*sdkstore.PHPPDOStore)
	if seen, err := stores.Seen(ctx, kit, twin); err == nil {
		t.Logf("message_id in %s: before the ALTER TABLE, the kit reads %q as the record of %q: seen %v", collation, twin, id, seen)
	}

	err := kit.Migrate(ctx)
	if !errors.Is(err, sdkstore.ErrKeyCollation) {
		t.Fatalf("Migrate on the PHP SDK's table (message_id in %s): %v; want ErrKeyCollation", collation, err)
	}
	t.Logf("Migrate: %v", err)
	i := strings.Index(err.Error(), "ALTER TABLE ")
	if i < 0 {
		t.Fatalf("the error names no ALTER TABLE: %v", err)
	}
	if _, err := db.ExecContext(ctx, err.Error()[i:]); err != nil {
		t.Fatalf("the statement the error names: %v", err)
	}
	if err := kit.Migrate(ctx); err != nil {
		t.Fatalf("Migrate after the statement: %v", err)
	}

	if seen, err := stores.Seen(ctx, kit, id); err != nil || !seen {
		t.Fatalf("Seen(the PHP consumer's message) after the ALTER = %v, %v; want true", seen, err)
	}
	if seen, err := stores.Seen(ctx, kit, twin); err != nil || seen {
		t.Fatalf("Seen(%q) = %v, %v; want false: another id than %q", twin, seen, err, id)
	}
	if !sdkRuns(ctx, t, php, twin) {
		t.Fatalf("the PHP consumer skipped %q as %q", twin, id)
	}
	if err := kit.Remember(ctx, "kit-"+run, 0, nil); err != nil {
		t.Fatal(err)
	}
	if sdkRuns(ctx, t, php, "kit-"+run) {
		t.Fatal("the PHP consumer ran a message the kit handled")
	}
	claimed, _, err := kit.Claim(ctx, strings.ToUpper("kit-"+run), time.Minute)
	if err != nil || !claimed {
		t.Fatalf("Claim(%q) = %v, %v; want true: another id than kit-%s", strings.ToUpper("kit-"+run), claimed, err, run)
	}
}
