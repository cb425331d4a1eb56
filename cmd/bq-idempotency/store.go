package main

import (
	"bufio"
	"context"
	"database/sql"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
	"github.com/babelqueue/watermill-idempotency/stores/sdkstore"
)

// storeArgs are the flags forget and inspect share.
type storeArgs struct {
	kind, scope, prefix, table, dialect string
	claimPrefix, claimTable             string
	apiTenant, operation                string // API records (api.go)
	unscoped                            bool
	// note is said on standard error once the store is open: what the
	// answers will not cover.
	note string
}

// The stores the commands open: the kit's own, and the BabelQueue SDK
// layouts of package sdkstore, which key a record on meta.id alone.
var (
	kitKinds = []string{"redis", "postgres"}
	sdkKinds = []string{"php-redis", "php-pdo", "go-redis", "go-postgres"}
)

func (a *storeArgs) register(fs *flag.FlagSet, conn *connection, forget bool) {
	fs.StringVar(&a.scope, "handler", "", "the Watermill handler `name` the records are kept under (or the WithScope value);\n"+
		"not with the SDK layouts, which key a record on meta.id alone")
	if forget {
		fs.BoolVar(&a.unscoped, "unscoped", false, "the records are kept under no scope (the middleware was given WithScope(\"\"));\n"+
			"implied with the SDK layouts")
	}
	fs.StringVar(&a.kind, "store", "redis", "the `store`: redis (redisstore) or postgres (postgresstore), or a BabelQueue SDK\n"+
		"layout (sdkstore): php-redis (PHP RedisStore), php-pdo (PHP PdoStore),\n"+
		"go-redis (Go SDK idempotency-redis) or go-postgres (Go SDK idempotency-postgres)")
	fs.StringVar(&a.prefix, "prefix", "", "Redis key `prefix` (default: "+redisstore.DefaultPrefix+" for redis, "+
		sdkstore.DefaultPHPPrefix+" for php-redis,\n"+sdkstore.DefaultGoPrefix+" for go-redis, whose kit claims are under the prefix without\n"+
		"its final colon followed by -claim:)")
	fs.StringVar(&a.table, "table", "", "SQL `table` (default: "+postgresstore.DefaultTable+" for postgres, "+sdkstore.DefaultPHPTable+
		" for php-pdo,\n"+sdkstore.DefaultGoTable+" for go-postgres, whose kit claims are in the table\n"+
		"followed by _claims)")
	fs.StringVar(&a.claimPrefix, "claim-prefix", "", "go-redis: the `prefix` of the kit's claims, when the store was given WithClaimPrefix")
	fs.StringVar(&a.claimTable, "claim-table", "", "go-postgres: the `table` of the kit's claims, when the store was given WithClaimTable")
	fs.StringVar(&a.dialect, "dialect", "postgres", "the `database` of --store php-pdo: postgres (--postgres-dsn) or mysql (MariaDB, --mysql-dsn)")
	a.registerAPI(fs)
	conn.registerMariaDB(fs)
}

// storeKinds lists the --store values, for messages.
func storeKinds() string {
	all := append(slices.Clone(kitKinds), sdkKinds...)
	return strings.Join(all[:len(all)-1], ", ") + " or " + all[len(all)-1]
}

// sdk reports whether the store is an SDK layout.
func (a *storeArgs) sdk() bool { return slices.Contains(sdkKinds, a.kind) }

// redis reports whether the store keeps its records in Redis (under a key
// prefix) rather than in a SQL table.
func (a *storeArgs) redis() bool {
	return a.kind == "redis" || a.kind == "php-redis" || a.kind == "go-redis"
}

// check refuses flags that do not go together, before anything connects.
func (a *storeArgs) check(fs *flag.FlagSet, forget bool) error {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if !a.sdk() && !slices.Contains(kitKinds, a.kind) {
		return usageErr("--store %q: want %s", a.kind, storeKinds())
	}
	if err := a.checkAPI(); err != nil {
		return err
	}
	redisKind := a.redis()
	switch {
	case a.sdk() && a.scope != "":
		return usageErr("--handler does not apply to --store %s: the SDK layouts key a record on meta.id alone "+
			"(the middleware is wired with WithScope(\"\")), so a record kept under a handler is not the SDK's", a.kind)
	case set["dialect"] && a.kind != "php-pdo":
		return usageErr("--dialect applies to --store php-pdo only")
	case a.kind == "php-pdo" && a.dialect != "postgres" && a.dialect != "mysql":
		return usageErr("--dialect %q: want postgres or mysql", a.dialect)
	case set["prefix"] && !redisKind:
		return usageErr("--prefix applies to the Redis stores (redis, php-redis, go-redis), not --store %s", a.kind)
	case set["mysql-dsn"] && (a.kind != "php-pdo" || a.dialect != "mysql"):
		return usageErr("--mysql-dsn applies to --store php-pdo --dialect mysql only")
	case set["postgres-dsn"] && a.kind == "php-pdo" && a.dialect == "mysql":
		return usageErr("--postgres-dsn does not apply to --dialect mysql (give --mysql-dsn)")
	case set["claim-prefix"] && a.kind != "go-redis":
		return usageErr("--claim-prefix applies to --store go-redis only")
	case set["claim-table"] && a.kind != "go-postgres":
		return usageErr("--claim-table applies to --store go-postgres only")
	case set["table"] && redisKind:
		return usageErr("--table applies to the SQL stores (postgres, php-pdo, go-postgres), not --store %s", a.kind)
	}
	if forget && !a.sdk() && !a.api() {
		switch {
		case a.scope == "" && !a.unscoped:
			return usageErr("--handler is required: %s; give --unscoped if the middleware was given WithScope(\"\")", noScopeNote)
		case a.scope != "" && a.unscoped:
			return usageErr("--handler and --unscoped exclude each other")
		}
	}
	return nil
}

// noScopeNote explains why an unscoped lookup may find nothing.
const noScopeNote = "the middleware keeps a record under the Watermill handler name (or its WithScope value) " +
	"and the meta.id; without --handler only records kept under no scope (WithScope(\"\")) are found"

func forgetFlags(fs *flag.FlagSet, conn *connection) func(context.Context, []string, streams) error {
	a := &storeArgs{}
	a.register(fs, conn, true)
	output := registerOutput(fs)
	return func(ctx context.Context, ids []string, s streams) error {
		if err := a.check(fs, true); err != nil {
			return err
		}
		store, closeStore, ids, err := a.open(ctx, ids, s, conn)
		if err != nil {
			return err
		}
		defer closeStore()
		var none []string
		removed := 0
		for _, id := range ids {
			key := a.keyOf(id)
			r, err := store.Lookup(ctx, key)
			if err != nil {
				return fmt.Errorf("forgot %d of %d records; %s: %w", removed, len(ids), id, err)
			}
			if r.State == stores.StateUnknown {
				none = append(none, id)
				continue
			}
			if err := store.Forget(ctx, key); err != nil {
				return fmt.Errorf("forgot %d of %d records; %s: %w", removed, len(ids), id, err)
			}
			removed++
		}
		if *output == outputJSON {
			if err := writeJSON(s.stdout, forgetJSON{Forgotten: removed, Requested: len(ids), Missing: append([]string{}, none...)}); err != nil {
				return err
			}
		} else if removed > 0 {
			fmt.Fprintf(s.stdout, "forgot %d of %d record(s) kept %s; their next delivery runs the handler again\n", removed, len(ids), a.where())
		} else {
			fmt.Fprintf(s.stdout, "forgot none of %d record(s): none is kept %s\n", len(ids), a.where())
		}
		if len(none) > 0 {
			elsewhere := "kept under another --handler"
			if a.sdk() {
				elsewhere = "kept under another --prefix or --table"
			}
			fmt.Fprintf(s.stderr, "bq-idempotency forget: no record %s for %d id(s): %s\n"+
				"(expired, never processed, or %s)\n", a.where(), len(none), strings.Join(none, " "), elsewhere)
			return errIncomplete
		}
		return nil
	}
}

func inspectFlags(fs *flag.FlagSet, conn *connection) func(context.Context, []string, streams) error {
	a := &storeArgs{}
	a.register(fs, conn, false)
	output := registerOutput(fs)
	return func(ctx context.Context, ids []string, s streams) error {
		if err := a.check(fs, false); err != nil {
			return err
		}
		inspector, closeStore, ids, err := a.open(ctx, ids, s, conn)
		if err != nil {
			return err
		}
		defer closeStore()
		if a.scope == "" && !a.sdk() && !a.api() {
			fmt.Fprintf(s.stderr, "bq-idempotency inspect: no --handler: %s\n", noScopeNote)
		}
		tw := tabwriter.NewWriter(s.stdout, 0, 4, 2, ' ', 0)
		if a.api() {
			fmt.Fprintln(tw, "KEY\tSTATE\tEXPIRES\tRESPONSE")
		} else {
			fmt.Fprintln(tw, "ID\tSTATE\tEXPIRES")
		}
		unknown := 0
		defer func() {
			if unknown > 0 {
				fmt.Fprintf(s.stderr, "bq-idempotency inspect: %d of %d ids have no record %s "+
					"(expired, never processed, or kept elsewhere: check %s)\n", unknown, len(ids), a.where(), a.elsewhereFlags())
			}
		}()
		doc := inspectJSON{Records: make([]recordJSON, 0, len(ids))}
		for i, id := range ids {
			r, err := inspector.Lookup(ctx, a.keyOf(id))
			if err != nil {
				if *output == outputText && i > 0 { // the rows before it, under their header
					_ = tw.Flush()
				}
				return fmt.Errorf("%s: %w", id, err)
			}
			if r.State == stores.StateUnknown {
				unknown++
			}
			if *output == outputJSON {
				rec := recordJSON{ID: id, State: strings.ReplaceAll(r.State.String(), " ", "_"), ExpiresAt: jsonTime(r.ExpiresAt)}
				if f := r.Failure; f.Attempts > 0 || f.End != nil {
					rec.Attempts, rec.FirstFailure = f.Attempts, jsonTime(f.FirstFailure)
					if f.End != nil {
						rec.End = &endJSON{Reason: f.End.Reason, At: jsonTime(f.End.At), Topic: f.End.Topic, RedriveMark: f.End.Marker}
					}
				}
				if a.api() {
					rec.Response = responseOf(r)
				}
				doc.Records = append(doc.Records, rec)
				continue
			}
			expires := "-"
			if !r.ExpiresAt.IsZero() {
				expires = r.ExpiresAt.UTC().Format(time.RFC3339)
			}
			if a.api() {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", id, r.State, expires, savedResponse(r))
				continue
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\n", id, stateText(r), expires)
		}
		if *output == outputJSON {
			doc.Unknown = unknown
			return writeJSON(s.stdout, doc)
		}
		return tw.Flush()
	}
}

// forgetJSON is forget's --output json document.
type forgetJSON struct {
	Forgotten int      `json:"forgotten"`
	Requested int      `json:"requested"`
	Missing   []string `json:"missing"` // the ids with no record
}

// inspectJSON is inspect's --output json document.
type inspectJSON struct {
	Records []recordJSON `json:"records"`
	Unknown int          `json:"unknown"` // how many ids have no record
}

// recordJSON is one id of inspect's --output json.
type recordJSON struct {
	ID           string        `json:"id"`
	State        string        `json:"state"`
	ExpiresAt    *string       `json:"expires_at"`
	Attempts     int           `json:"attempts,omitempty"`      // failed runs counted (failing, ended)
	FirstFailure *string       `json:"first_failure,omitempty"` // when the first of them failed
	End          *endJSON      `json:"end,omitempty"`           // how an ended message ended
	Response     *responseJSON `json:"response,omitempty"`      // API records
}

// endJSON is how an ended message ended, in inspect's --output json.
type endJSON struct {
	Reason      string  `json:"reason"`
	At          *string `json:"at"`
	Topic       string  `json:"topic"`
	RedriveMark string  `json:"redrive_mark"`
}

// stateText is a record's state as inspect prints it: a failing message
// with its count, an ended one with how it ended.
func stateText(r stores.Record) string {
	f := r.Failure
	switch {
	case f.End != nil:
		to := ""
		if f.End.Topic != "" {
			to = " to " + f.End.Topic
		}
		return fmt.Sprintf("%s (%s%s at %s, after %d failed runs)", r.State, f.End.Reason, to, f.End.At.UTC().Format(time.RFC3339), f.Attempts)
	case f.Attempts > 0:
		return fmt.Sprintf("%s (%d failed runs since %s)", r.State, f.Attempts, f.FirstFailure.UTC().Format(time.RFC3339))
	}
	return r.State.String()
}

// where says where the records were looked for: under a handler's scope,
// under none, or in an SDK layout (keyed on meta.id alone), and under which
// key prefix or in which table.
// elsewhereFlags names the flags that choose where records are looked
// for in a's kind of store.
func (a *storeArgs) elsewhereFlags() string {
	scope := "--handler"
	switch {
	case a.api():
		scope = "--api-tenant, --operation"
	case a.sdk():
		scope = ""
	}
	place := "--table"
	if a.redis() {
		place = "--prefix"
	}
	if scope == "" {
		return place
	}
	return scope + " or " + place
}

func (a *storeArgs) where() string {
	var scope string
	switch {
	case a.api():
		scope = fmt.Sprintf("for tenant %q, operation %q", a.apiTenant, a.operation)
	case a.sdk():
		scope = fmt.Sprintf("in the %s layout", a.kind)
	case a.scope == "":
		scope = "under no scope"
	default:
		scope = fmt.Sprintf("under handler %q", a.scope)
	}
	switch a.kind {
	case "redis":
		return fmt.Sprintf("%s, Redis key prefix %q", scope, orDefault(a.prefix, redisstore.DefaultPrefix))
	case "php-redis":
		return fmt.Sprintf("%s, Redis key prefix %q", scope, orDefault(a.prefix, sdkstore.DefaultPHPPrefix))
	case "go-redis":
		return fmt.Sprintf("%s, Redis key prefix %q", scope, orDefault(a.prefix, sdkstore.DefaultGoPrefix))
	case "postgres":
		return fmt.Sprintf("%s, table %s", scope, orDefault(a.table, postgresstore.DefaultTable))
	case "php-pdo":
		return fmt.Sprintf("%s, table %s", scope, orDefault(a.table, sdkstore.DefaultPHPTable))
	case "go-postgres":
		return fmt.Sprintf("%s, table %s", scope, orDefault(a.table, sdkstore.DefaultGoTable))
	}
	return scope
}

// open reads the ids (arguments, else standard input) and connects to the
// store.
func (a *storeArgs) open(ctx context.Context, ids []string, s streams, conn *connection) (stores.Store, func(), []string, error) {
	if len(ids) == 0 && s.stdinPiped {
		var err error
		if ids, err = readIDs(s.stdin); err != nil {
			return nil, nil, nil, err
		}
	}
	if len(ids) == 0 {
		return nil, nil, nil, usageErr("no message ids given (as arguments or on standard input)")
	}
	ids = distinct(ids)
	store, closeStore, err := a.openStore(ctx, conn)
	if err != nil {
		return nil, nil, nil, err
	}
	if a.note != "" {
		fmt.Fprintf(s.stderr, "bq-idempotency: %s\n", a.note)
	}
	return store, closeStore, ids, nil
}

func readIDs(r io.Reader) ([]string, error) {
	var ids []string
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		if id := strings.TrimSpace(sc.Text()); id != "" {
			ids = append(ids, id)
		}
	}
	return ids, sc.Err()
}

// distinct returns ids without their repeats, in the order first given:
// an id named twice is acted on, and counted, once.
func distinct(ids []string) []string {
	seen := make(map[string]bool, len(ids))
	out := ids[:0:0]
	for _, id := range ids {
		if !seen[id] {
			seen[id] = true
			out = append(out, id)
		}
	}
	return out
}

// orDefault returns value, or def when it is empty.
func orDefault(value, def string) string {
	if value == "" {
		return def
	}
	return value
}

func (a *storeArgs) openStore(ctx context.Context, conn *connection) (stores.Store, func(), error) {
	switch a.kind {
	case "redis":
		prefix := orDefault(a.prefix, redisstore.DefaultPrefix)
		if err := redisstore.ValidatePrefix(prefix); err != nil {
			return nil, nil, usageErr("--prefix: %v", err)
		}
		client, err := conn.openRedis(ctx)
		if err != nil {
			return nil, nil, err
		}
		return redisstore.New(client, redisstore.WithPrefix(prefix)), func() { _ = client.Close() }, nil
	case "php-redis", "go-redis":
		client, err := conn.openRedis(ctx)
		if err != nil {
			return nil, nil, err
		}
		var s stores.Store
		if a.kind == "php-redis" {
			s, err = sdkstore.NewPHPRedis(client, sdkstore.WithPrefix(orDefault(a.prefix, sdkstore.DefaultPHPPrefix)))
		} else {
			opts := []sdkstore.Option{sdkstore.WithPrefix(orDefault(a.prefix, sdkstore.DefaultGoPrefix))}
			if a.claimPrefix != "" {
				opts = append(opts, sdkstore.WithClaimPrefix(a.claimPrefix))
			}
			s, err = sdkstore.NewGoRedis(client, opts...)
		}
		if err != nil {
			_ = client.Close()
			return nil, nil, usageErr("--prefix: %v", err)
		}
		return s, func() { _ = client.Close() }, nil
	}
	var (
		db  *sql.DB
		err error
	)
	if a.kind == "php-pdo" && a.dialect == "mysql" {
		db, err = conn.openMariaDB(ctx)
	} else {
		db, err = conn.openPostgres(ctx)
	}
	if err != nil {
		return nil, nil, err
	}
	var s stores.Store
	switch a.kind {
	case "postgres":
		s, err = postgresstore.New(db, postgresstore.WithTable(orDefault(a.table, postgresstore.DefaultTable)))
	case "php-pdo":
		dialect := sdkstore.PostgreSQL
		if a.dialect == "mysql" {
			dialect = sdkstore.MariaDB
		}
		s, err = sdkstore.NewPHPPDO(db, dialect, sdkstore.WithTable(orDefault(a.table, sdkstore.DefaultPHPTable)))
	case "go-postgres":
		opts := []sdkstore.Option{sdkstore.WithTable(orDefault(a.table, sdkstore.DefaultGoTable))}
		if a.claimTable != "" {
			opts = append(opts, sdkstore.WithClaimTable(a.claimTable))
		}
		s, err = sdkstore.NewGoPostgres(db, opts...)
		if err == nil && a.claimTable == "" {
			// Without the kit's claim table (only Go SDK consumers used the
			// database, or the kit's store named another) the records alone
			// answer: say so, since a claim kept elsewhere goes unseen.
			claims := orDefault(a.table, sdkstore.DefaultGoTable) + "_claims"
			var exists bool
			if qerr := db.QueryRowContext(ctx, `SELECT to_regclass($1) IS NOT NULL`, claims).Scan(&exists); qerr == nil && !exists {
				a.note = fmt.Sprintf("no table %s (the kit's claims): the records alone are read, and nothing shows as in flight; "+
					"if the kit's store was given WithClaimTable, name that table with --claim-table", claims)
			}
		}
	default:
		err = fmt.Errorf("--store %q: want %s", a.kind, storeKinds())
	}
	if err != nil {
		_ = db.Close()
		return nil, nil, usageErr("%v", err)
	}
	return s, func() { _ = db.Close() }, nil
}
