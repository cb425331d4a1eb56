package main

import (
	"context"
	"database/sql"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/sdkstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

func mariaDBDSN() string { return testenv.Getenv("MARIADB_DSN", testenv.DefaultMariaDBDSN) }

// sdkRecords are the records a test wrote in an SDK layout, by id: the
// state inspect must report for each.
type sdkRecords map[string]stores.State

// inspectAndForgetSDK runs inspect and forget on an SDK layout, where
// records are keyed on meta.id alone: no --handler (refused), no
// --unscoped needed; forget removes the remembered records and the
// in-flight claims, names the ids that had none, exits as for the kit's
// stores. store is the kit's store on the same layout, to check what
// forget left.
func inspectAndForgetSDK(t *testing.T, store stores.Store, records sdkRecords, flags ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := func(stdin, name string, args ...string) result {
		return cli(t, nil, stdin, append(append([]string{name}, flags...), args...)...)
	}
	unknown := "none-" + testenv.RandomHex(4)
	var remembered, inFlight, lapsed []string
	all := []string{unknown}
	for id, state := range records {
		all = append(all, id)
		switch state {
		case stores.StateRemembered:
			remembered = append(remembered, id)
		case stores.StateInFlight:
			inFlight = append(inFlight, id)
		default:
			lapsed = append(lapsed, id)
		}
	}
	r := cmd("", "inspect", all...)
	if r.code != 0 || !strings.HasPrefix(r.stderr, "bq-idempotency inspect: ") || !strings.Contains(r.stderr, " layout, ") {
		t.Fatalf("inspect: exit %d, or it does not say where it looked for the unknown ids\n%s%s", r.code, r.stdout, r.stderr)
	}
	out := strings.Join(strings.Fields(r.stdout), " ")
	for id, state := range records {
		if !strings.Contains(out, id+" "+state.String()) {
			t.Fatalf("inspect output lacks %q:\n%s", id+" "+state.String(), r.stdout)
		}
	}
	if !strings.Contains(out, unknown+" unknown -") {
		t.Fatalf("inspect output lacks %q:\n%s", unknown+" unknown -", r.stdout)
	}
	// A handler would scope the key: not the SDK's record.
	for _, name := range []string{"inspect", "forget"} {
		if r = cmd("", name, "--handler", "charge", remembered[0]); r.code != 2 || !strings.Contains(r.stderr, "--handler does not apply") {
			t.Fatalf("%s --handler: exit %d\n%s%s", name, r.code, r.stdout, r.stderr)
		}
	}
	if seen, err := stores.Seen(ctx, store, remembered[0]); err != nil || !seen {
		t.Fatalf("a refused forget removed the record: seen %v, %v", seen, err)
	}
	// No --handler, no --unscoped: the remembered records go, the id
	// without one (and a lapsed claim) is named, exit 3 (partial).
	none := append([]string{unknown}, lapsed...)
	r = cmd("", "forget", append(append([]string{}, remembered...), none...)...)
	if r.code != 3 || !strings.Contains(r.stdout, "forgot "+strconv.Itoa(len(remembered))+" of "+strconv.Itoa(len(remembered)+len(none))+" record(s)") {
		t.Fatalf("forget: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	for _, id := range none {
		if !strings.Contains(r.stderr, id) {
			t.Fatalf("forget does not name %s, which had no record:\n%s", id, r.stderr)
		}
	}
	for _, id := range remembered {
		if strings.Contains(r.stderr, id) {
			t.Fatalf("forget names %s, whose record it removed:\n%s", id, r.stderr)
		}
		if seen, err := stores.Seen(ctx, store, id); err != nil || seen {
			t.Fatalf("Seen(%s) after forget = %v, %v; want false", id, seen, err)
		}
	}
	// Ids on standard input; an in-flight claim is a record too; --unscoped
	// is accepted, and changes nothing.
	r = cmd(strings.Join(inFlight, "\n")+"\n\n", "forget", "--unscoped")
	if r.code != 0 || !strings.Contains(r.stdout, "forgot "+strconv.Itoa(len(inFlight))+" of "+strconv.Itoa(len(inFlight))+" record(s)") {
		t.Fatalf("forget from stdin: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	r = cmd("", "inspect", all...)
	if r.code != 0 || strings.Count(r.stdout, " unknown ") != len(all) {
		t.Fatalf("inspect after forget: exit %d, want every id unknown\n%s%s", r.code, r.stdout, r.stderr)
	}
	if r = cmd("", "forget", remembered[0]); r.code != 3 || !strings.Contains(r.stdout, "forgot none of 1") || strings.Contains(r.stdout, "runs the handler again") {
		t.Fatalf("forget again: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func claim(t *testing.T, store stores.Store, id string) {
	t.Helper()
	ok, _, err := store.Claim(context.Background(), id, time.Minute)
	if err != nil || !ok {
		t.Fatalf("Claim(%s) = %v, %v", id, ok, err)
	}
}

// TestInspectAndForgetPHPRedis: the PHP SDK's "2" and "1" as it writes
// them, the kit's record and claim, under the default prefix bq:idem:.
func TestInspectAndForgetPHPRedis(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t) // every key written through it is removed when the test ends
	ctx := context.Background()
	store, err := sdkstore.NewPHPRedis(client)
	must(t, err)
	run := testenv.RandomHex(4)
	must(t, store.Remember(ctx, "kit-seen-"+run, 0, nil))
	claim(t, store, "kit-claim-"+run)
	must(t, client.Set(ctx, sdkstore.DefaultPHPPrefix+"php-seen-"+run, "2", 0).Err())
	must(t, client.SetNX(ctx, sdkstore.DefaultPHPPrefix+"php-claim-"+run, "1", time.Minute).Err())
	inspectAndForgetSDK(t, store, sdkRecords{
		"kit-seen-" + run: stores.StateRemembered, "kit-claim-" + run: stores.StateInFlight,
		"php-seen-" + run: stores.StateRemembered, "php-claim-" + run: stores.StateInFlight,
	}, "--store", "php-redis", "--redis-url", redisURL())
}

// TestInspectAndForgetGoRedis: the Go SDK's record as it writes it (SET NX
// with its TTL), the kit's record and its claim under the claim prefix,
// under the default prefix bq:idemp:.
func TestInspectAndForgetGoRedis(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	ctx := context.Background()
	store, err := sdkstore.NewGoRedis(client, sdkstore.WithTTL(time.Hour))
	must(t, err)
	run := testenv.RandomHex(4)
	must(t, store.Remember(ctx, "kit-seen-"+run, 0, nil))
	claim(t, store, "kit-claim-"+run)
	must(t, client.SetNX(ctx, sdkstore.DefaultGoPrefix+"go-seen-"+run, "1", time.Hour).Err())
	inspectAndForgetSDK(t, store, sdkRecords{
		"kit-seen-" + run: stores.StateRemembered, "kit-claim-" + run: stores.StateInFlight,
		"go-seen-" + run: stores.StateRemembered,
	}, "--store", "go-redis", "--redis-url", redisURL())
	if n, _ := client.Exists(ctx, sdkstore.DefaultGoPrefix+"go-seen-"+run, "bq:idemp-claim:kit-claim-"+run).Result(); n != 0 {
		t.Fatalf("forget left %d of the record and the claim", n)
	}
}

// withSearchPath returns the PostgreSQL DSN with schema first on its
// search path, so that an unqualified table (the SDK's default) is the
// test's own.
func withSearchPath(dsn, schema string) string {
	if !strings.Contains(dsn, "://") {
		return dsn + " search_path=" + schema
	}
	if strings.Contains(dsn, "?") {
		return dsn + "&search_path=" + schema
	}
	return dsn + "?search_path=" + schema
}

// postgresSchema creates a schema of the test's own, dropped with
// everything in it when the test ends, and returns a DSN putting it first
// on the search path and a database connected with that DSN.
func postgresSchema(t *testing.T) (dsn string, db *sql.DB) {
	t.Helper()
	admin := testenv.Postgres(t)
	schema := "bq_cli_" + testenv.RandomHex(4)
	if _, err := admin.Exec(`CREATE SCHEMA ` + schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec(`DROP SCHEMA ` + schema + ` CASCADE`); err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
		}
	})
	dsn = withSearchPath(postgresDSN(), schema)
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() }) // before the schema is dropped
	return dsn, db
}

// phpPDOSeed writes the PdoStore rows the test inspects: the kit's 'seen'
// and 'claimed' rows, and the PHP SDK's, written as it writes them
// (placeholders in the dialect's form).
func phpPDOSeed(t *testing.T, db *sql.DB, store stores.Store, table, placeholder1, placeholder2 string) sdkRecords {
	t.Helper()
	ctx := context.Background()
	run := testenv.RandomHex(4)
	must(t, store.Remember(ctx, "kit-seen-"+run, 0, nil))
	claim(t, store, "kit-claim-"+run)
	insert := `INSERT INTO ` + table + ` (message_id, state, expires_at) VALUES (` + placeholder1 + `, 'claimed', ` + placeholder2 + `)`
	_, err := db.ExecContext(ctx, insert, "php-claim-"+run, time.Now().Unix()+60)
	must(t, err)
	_, err = db.ExecContext(ctx, insert, "php-lapsed-"+run, time.Now().Unix()-60)
	must(t, err)
	_, err = db.ExecContext(ctx, `UPDATE `+table+` SET state = 'seen', expires_at = NULL WHERE message_id = `+placeholder1, "php-claim-"+run)
	must(t, err)
	_, err = db.ExecContext(ctx, insert, "php-claim-"+run+"b", time.Now().Unix()+60)
	must(t, err)
	return sdkRecords{
		"kit-seen-" + run: stores.StateRemembered, "kit-claim-" + run: stores.StateInFlight,
		"php-claim-" + run: stores.StateRemembered, "php-claim-" + run + "b": stores.StateInFlight,
		"php-lapsed-" + run: stores.StateUnknown,
	}
}

// TestInspectAndForgetPHPPDOPostgres: the PdoStore table on PostgreSQL,
// under its default name (in a schema of the test's own).
func TestInspectAndForgetPHPPDOPostgres(t *testing.T) {
	t.Parallel()
	dsn, db := postgresSchema(t)
	store, err := sdkstore.NewPHPPDO(db, sdkstore.PostgreSQL)
	must(t, err)
	must(t, store.Migrate(context.Background()))
	records := phpPDOSeed(t, db, store, sdkstore.DefaultPHPTable, "$1", "$2")
	inspectAndForgetSDK(t, store, records, "--store", "php-pdo", "--postgres-dsn", dsn)
}

// TestInspectAndForgetPHPPDOMariaDB: the PdoStore table on MariaDB, through
// --dialect mysql and --mysql-dsn.
func TestInspectAndForgetPHPPDOMariaDB(t *testing.T) {
	t.Parallel()
	db := testenv.MariaDB(t)
	table := "bq_idempotency_cli_" + testenv.RandomHex(4)
	t.Cleanup(func() { _, _ = db.Exec(`DROP TABLE IF EXISTS ` + table) })
	store, err := sdkstore.NewPHPPDO(db, sdkstore.MariaDB, sdkstore.WithTable(table))
	must(t, err)
	must(t, store.Migrate(context.Background()))
	records := phpPDOSeed(t, db, store, table, "?", "?")
	inspectAndForgetSDK(t, store, records, "--store", "php-pdo", "--dialect", "mysql", "--mysql-dsn", mariaDBDSN(), "--table", table)
}

// TestInspectAndForgetGoPostgres: the Go SDK's rows (expiring, kept
// forever, expired) as it writes them, the kit's record and its claim in
// the claim table, under the default table names (in a schema of the
// test's own).
func TestInspectAndForgetGoPostgres(t *testing.T) {
	t.Parallel()
	dsn, db := postgresSchema(t)
	store, err := sdkstore.NewGoPostgres(db, sdkstore.WithTTL(time.Hour))
	must(t, err)
	ctx := context.Background()
	must(t, store.Migrate(ctx))
	run := testenv.RandomHex(4)
	must(t, store.Remember(ctx, "kit-seen-"+run, 0, nil))
	claim(t, store, "kit-claim-"+run)
	insert := `INSERT INTO ` + sdkstore.DefaultGoTable + ` (message_id, created_at, expires_at) VALUES ($1, now(), $2)`
	for id, expires := range map[string]any{"go-seen-" + run: time.Now().Add(time.Hour), "go-forever-" + run: nil, "go-expired-" + run: time.Now().Add(-time.Hour)} {
		_, err := db.ExecContext(ctx, insert, id, expires)
		must(t, err)
	}
	inspectAndForgetSDK(t, store, sdkRecords{
		"kit-seen-" + run: stores.StateRemembered, "kit-claim-" + run: stores.StateInFlight,
		"go-seen-" + run: stores.StateRemembered, "go-forever-" + run: stores.StateRemembered,
		"go-expired-" + run: stores.StateUnknown,
	}, "--store", "go-postgres", "--postgres-dsn", dsn)
	var left int
	must(t, db.QueryRowContext(ctx, `SELECT (SELECT count(*) FROM `+sdkstore.DefaultGoTable+` WHERE expires_at IS NULL OR expires_at > now())
	+ (SELECT count(*) FROM `+sdkstore.DefaultGoTable+`_claims)`).Scan(&left))
	if left != 0 {
		t.Fatalf("forget left %d live rows and claims", left)
	}
}

// TestInspectAndForgetGoRedisClaimPrefix: a store given WithClaimPrefix
// keeps its claims elsewhere; --claim-prefix finds them, and forget drops
// them there.
func TestInspectAndForgetGoRedisClaimPrefix(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	run := testenv.RandomHex(4)
	claims := "bq:test-claim-" + run + ":"
	store, err := sdkstore.NewGoRedis(client, sdkstore.WithTTL(time.Hour), sdkstore.WithClaimPrefix(claims))
	must(t, err)
	must(t, store.Remember(context.Background(), "kit-seen-"+run, 0, nil))
	claim(t, store, "kit-claim-"+run)
	inspectAndForgetSDK(t, store, sdkRecords{"kit-seen-" + run: stores.StateRemembered, "kit-claim-" + run: stores.StateInFlight},
		"--store", "go-redis", "--redis-url", redisURL(), "--claim-prefix", claims)
	if n, _ := client.Exists(context.Background(), claims+"kit-claim-"+run).Result(); n != 0 {
		t.Fatal("forget left the claim under --claim-prefix")
	}
}

// TestTableWithCapitalsNamesTheSDKsTable: the BabelQueue SDKs write a table
// name unquoted, so on PostgreSQL Orders_Idem is their table orders_idem.
// --table or --claim-table with capitals is a usage error naming the
// lower-case table (before: inspect read a table "Orders_Idem" of its own
// and failed); with that name inspect reads the SDK's records.
func TestTableWithCapitalsNamesTheSDKsTable(t *testing.T) {
	t.Parallel()
	dsn, db := postgresSchema(t)
	ctx := context.Background()
	run := testenv.RandomHex(4)
	// The PHP SDK's table and record, and the Go SDK's, as they write them.
	_, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS Orders_Idem (message_id VARCHAR(255) NOT NULL, state VARCHAR(16) NOT NULL, expires_at BIGINT NULL, PRIMARY KEY (message_id))`)
	must(t, err)
	_, err = db.ExecContext(ctx, `INSERT INTO Orders_Idem (message_id, state, expires_at) VALUES ($1, 'seen', NULL)`, "php-"+run)
	must(t, err)
	_, err = db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS Babel_Idem (message_id TEXT NOT NULL PRIMARY KEY, created_at TIMESTAMPTZ NOT NULL DEFAULT now(), expires_at TIMESTAMPTZ NULL)`)
	must(t, err)
	_, err = db.ExecContext(ctx, `INSERT INTO Babel_Idem (message_id) VALUES ($1)`, "go-"+run)
	must(t, err)
	for _, tc := range []struct {
		refused []string
		want    string   // the table the error names
		lower   []string // the flags naming it, reading id as remembered
		id      string
	}{
		{[]string{"--store", "php-pdo", "--table", "Orders_Idem"}, "orders_idem", []string{"--store", "php-pdo", "--table", "orders_idem"}, "php-" + run},
		{[]string{"--store", "go-postgres", "--table", "Babel_Idem"}, "babel_idem", []string{"--store", "go-postgres", "--table", "babel_idem"}, "go-" + run},
		{[]string{"--store", "go-postgres", "--table", "babel_idem", "--claim-table", "Kit_Claims"}, "kit_claims", nil, ""},
	} {
		r := cli(t, nil, "", append(append([]string{"inspect", "--postgres-dsn", dsn}, tc.refused...), "x-"+run)...)
		if r.code != 2 || !strings.Contains(r.stderr, " "+tc.want+":") {
			t.Fatalf("inspect %v: exit %d, want 2 naming %s\n%s%s", tc.refused, r.code, tc.want, r.stdout, r.stderr)
		}
		if tc.lower == nil {
			continue
		}
		r = cli(t, nil, "", append(append([]string{"inspect", "--postgres-dsn", dsn}, tc.lower...), tc.id)...)
		if r.code != 0 || !strings.Contains(strings.Join(strings.Fields(r.stdout), " "), tc.id+" remembered") {
			t.Fatalf("inspect %v: exit %d, want %s remembered\n%s%s", tc.lower, r.code, tc.id, r.stdout, r.stderr)
		}
	}
}
