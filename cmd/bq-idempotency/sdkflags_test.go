package main

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/sdkstore"
	"github.com/babelqueue/watermill-idempotency/testkit/testenv"
)

// TestMySQLDSNWithoutDialect: an operator points php-pdo at MariaDB
// with --mysql-dsn but forgets --dialect mysql. The command must not
// silently read PostgreSQL instead (the --mysql-dsn it was given is
// ignored): either it reads MariaDB, or it is a usage error (as a --prefix
// the store has no use for is). The same for --mysql-dsn with a store that
// never uses MariaDB.
func TestMySQLDSNWithoutDialect(t *testing.T) {
	t.Parallel()
	db := testenv.MariaDB(t)
	table := "bq_idem_flags_" + testenv.RandomHex(4)
	t.Cleanup(func() { _, _ = db.Exec(`DROP TABLE IF EXISTS ` + table) })
	store, err := sdkstore.NewPHPPDO(db, sdkstore.MariaDB, sdkstore.WithTable(table))
	must(t, err)
	must(t, store.Migrate(context.Background()))
	id := "flags-" + testenv.RandomHex(4)
	must(t, store.Remember(context.Background(), id, 0, nil))

	r := run1(t, "inspect", "--store", "php-pdo", "--mysql-dsn", mariaDBDSN(), "--table", table, id)
	if !(r.code == 2 || (r.code == 0 && strings.Contains(r.stdout, "remembered"))) {
		t.Errorf("inspect --store php-pdo --mysql-dsn (no --dialect): exit %d, want the MariaDB record or a usage error (2)\n%s%s", r.code, r.stdout, r.stderr)
	}
	r = run1(t, "forget", "--store", "php-pdo", "--mysql-dsn", mariaDBDSN(), "--table", table, id)
	if !(r.code == 2 || (r.code == 0 && strings.Contains(r.stdout, "forgot 1 of 1"))) {
		t.Errorf("forget --store php-pdo --mysql-dsn (no --dialect): exit %d, want the MariaDB record forgotten or a usage error (2)\n%s%s", r.code, r.stdout, r.stderr)
	}
	r = run1(t, "inspect", "--store", "go-postgres", "--mysql-dsn", mariaDBDSN(), id)
	if r.code != 2 {
		t.Errorf("inspect --store go-postgres --mysql-dsn: exit %d, want a usage error (2) for a flag the store has no use for\n%s%s", r.code, r.stdout, r.stderr)
	}
}

// TestGoPostgresClaimTableTypo: the kit's store was given
// WithClaimTable; the operator names that table with a typo, or forgets
// --claim-table. A --claim-table that does not exist is an error; without
// it, the default claim table being missing, the records alone answer and
// the command says on standard error that claims kept elsewhere go unseen.
func TestGoPostgresClaimTableTypo(t *testing.T) {
	t.Parallel()
	dsn, db := postgresSchema(t)
	run := testenv.RandomHex(4)
	claims := "kit_claims_" + run
	store, err := sdkstore.NewGoPostgres(db, sdkstore.WithTTL(time.Hour), sdkstore.WithClaimTable(claims))
	must(t, err)
	must(t, store.Migrate(context.Background()))
	id := "inflight-" + run
	claim(t, store, id)

	r := run1(t, "inspect", "--store", "go-postgres", "--postgres-dsn", dsn, "--claim-table", claims, id)
	if r.code != 0 || !strings.Contains(r.stdout, "in flight") {
		t.Fatalf("inspect with the right --claim-table: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	// A --claim-table that does not exist is an error, not "nothing in
	// flight".
	r = run1(t, "inspect", "--store", "go-postgres", "--postgres-dsn", dsn, "--claim-table", claims+"x", id)
	if r.code == 0 {
		t.Errorf("inspect with a --claim-table that does not exist: exit 0, want an error\n%s%s", r.stdout, r.stderr)
	}
	// Without --claim-table the default claim table is missing: the records
	// alone answer, and the command says so.
	r = run1(t, "inspect", "--store", "go-postgres", "--postgres-dsn", dsn, id)
	if r.code != 0 || !strings.Contains(r.stderr, "--claim-table") {
		t.Errorf("inspect without --claim-table, default claim table missing: exit %d, want 0 and a note naming --claim-table on stderr\n%s%s", r.code, r.stdout, r.stderr)
	}
}

// unusualIDs are meta.ids an operator may have to inspect: spaces,
// non-Latin scripts, characters outside the BMP, ids at and over the
// VARCHAR(255) column's limit.
func unusualIDs(run string) []string {
	return []string{
		"order 42 " + run,
		"заказ-订单-" + run,
		strings.Repeat("😀", 255-len(run)) + run, // 255 characters, 4 bytes each
		strings.Repeat("é", 300) + run,          // over the column: a digest
		strings.Repeat("x", 300) + run,
	}
}

func inspectUnusualIDs(t *testing.T, store stores.Store, flags ...string) {
	t.Helper()
	run := testenv.RandomHex(4)
	ids := unusualIDs(run)
	for _, id := range ids {
		must(t, store.Remember(context.Background(), id, 0, nil))
	}
	r := cli(t, nil, "", append(append([]string{"inspect"}, flags...), ids...)...)
	if r.code != 0 {
		t.Fatalf("inspect: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	for _, id := range ids {
		found := false
		for _, line := range strings.Split(r.stdout, "\n") {
			if strings.HasPrefix(line, id+" ") && strings.Contains(line, "remembered") {
				found = true
			}
		}
		if !found {
			t.Errorf("inspect does not report %.40q… (%d chars) remembered:\n%s", id, len([]rune(id)), r.stdout)
		}
	}
	// The ids on standard input, one a line.
	r = cli(t, nil, strings.Join(ids, "\n")+"\n", append([]string{"forget"}, flags...)...)
	if r.code != 0 || !strings.Contains(r.stdout, "forgot "+strconv.Itoa(len(ids))+" of "+strconv.Itoa(len(ids))) {
		t.Errorf("forget from stdin: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
}

func TestUnusualIDsPHPPDOPostgres(t *testing.T) {
	t.Parallel()
	dsn, db := postgresSchema(t)
	store, err := sdkstore.NewPHPPDO(db, sdkstore.PostgreSQL)
	must(t, err)
	must(t, store.Migrate(context.Background()))
	inspectUnusualIDs(t, store, "--store", "php-pdo", "--postgres-dsn", dsn)
}

func TestUnusualIDsPHPPDOMariaDB(t *testing.T) {
	t.Parallel()
	db := testenv.MariaDB(t)
	table := "bq_idem_flags_" + testenv.RandomHex(4)
	t.Cleanup(func() { _, _ = db.Exec(`DROP TABLE IF EXISTS ` + table) })
	store, err := sdkstore.NewPHPPDO(db, sdkstore.MariaDB, sdkstore.WithTable(table))
	must(t, err)
	must(t, store.Migrate(context.Background()))
	inspectUnusualIDs(t, store, "--store", "php-pdo", "--dialect", "mysql", "--mysql-dsn", mariaDBDSN(), "--table", table)
}

func TestUnusualIDsGoPostgres(t *testing.T) {
	t.Parallel()
	dsn, db := postgresSchema(t)
	store, err := sdkstore.NewGoPostgres(db, sdkstore.WithTTL(time.Hour))
	must(t, err)
	must(t, store.Migrate(context.Background()))
	inspectUnusualIDs(t, store, "--store", "go-postgres", "--postgres-dsn", dsn)
}

func TestUnusualIDsRedisLayouts(t *testing.T) {
	t.Parallel()
	client := testenv.Redis(t)
	php, err := sdkstore.NewPHPRedis(client)
	must(t, err)
	inspectUnusualIDs(t, php, "--store", "php-redis", "--redis-url", redisURL())
	goStore, err := sdkstore.NewGoRedis(client, sdkstore.WithTTL(time.Hour))
	must(t, err)
	inspectUnusualIDs(t, goStore, "--store", "go-redis", "--redis-url", redisURL())
}
