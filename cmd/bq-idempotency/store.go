package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/babelqueue/watermill-idempotency/middleware/idempotency"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
)

// storeArgs are the flags forget and inspect share.
type storeArgs struct {
	kind, scope, prefix, table string
	unscoped                   bool
}

func (a *storeArgs) register(fs *flag.FlagSet, forget bool) {
	fs.StringVar(&a.scope, "handler", "", "the Watermill handler `name` the records are kept under (or the WithScope value)")
	if forget {
		fs.BoolVar(&a.unscoped, "unscoped", false, "the records are kept under no scope (the middleware was given WithScope(\"\"))")
	}
	fs.StringVar(&a.kind, "store", "redis", "the `store`: redis (redisstore) or postgres (postgresstore)")
	fs.StringVar(&a.prefix, "prefix", redisstore.DefaultPrefix, "redisstore key `prefix`")
	fs.StringVar(&a.table, "table", postgresstore.DefaultTable, "postgresstore `table`")
}

// noScopeNote explains why an unscoped lookup may find nothing.
const noScopeNote = "the middleware keeps a record under the Watermill handler name (or its WithScope value) " +
	"and the meta.id; without --handler only records kept under no scope (WithScope(\"\")) are found"

func forgetFlags(fs *flag.FlagSet, conn *connection) func(context.Context, []string, streams) error {
	a := &storeArgs{}
	a.register(fs, true)
	return func(ctx context.Context, ids []string, s streams) error {
		switch {
		case a.scope == "" && !a.unscoped:
			return usageErr("--handler is required: %s; give --unscoped if the middleware was given WithScope(\"\")", noScopeNote)
		case a.scope != "" && a.unscoped:
			return usageErr("--handler and --unscoped exclude each other")
		}
		store, inspector, closeStore, ids, err := a.open(ctx, ids, s, conn)
		if err != nil {
			return err
		}
		defer closeStore()
		var none []string
		removed := 0
		for _, id := range ids {
			key := idempotency.Key(a.scope, id)
			r, err := inspector.Inspect(ctx, key)
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
		fmt.Fprintf(s.stdout, "forgot %d of %d record(s) kept under %s; their next delivery runs the handler again\n", removed, len(ids), a.scopeName())
		if len(none) > 0 {
			fmt.Fprintf(s.stderr, "bq-idempotency forget: no record under %s for %d id(s): %s\n"+
				"(expired, never processed, or kept under another --handler)\n", a.scopeName(), len(none), strings.Join(none, " "))
			return errIncomplete
		}
		return nil
	}
}

func inspectFlags(fs *flag.FlagSet, conn *connection) func(context.Context, []string, streams) error {
	a := &storeArgs{}
	a.register(fs, false)
	return func(ctx context.Context, ids []string, s streams) error {
		_, inspector, closeStore, ids, err := a.open(ctx, ids, s, conn)
		if err != nil {
			return err
		}
		defer closeStore()
		if a.scope == "" {
			fmt.Fprintf(s.stderr, "bq-idempotency inspect: no --handler: %s\n", noScopeNote)
		}
		tw := tabwriter.NewWriter(s.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tSTATE\tEXPIRES")
		for _, id := range ids {
			r, err := inspector.Inspect(ctx, idempotency.Key(a.scope, id))
			if err != nil {
				_ = tw.Flush()
				return fmt.Errorf("%s: %w", id, err)
			}
			expires := "-"
			if !r.ExpiresAt.IsZero() {
				expires = r.ExpiresAt.UTC().Format(time.RFC3339)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\n", id, r.State, expires)
		}
		return tw.Flush()
	}
}

func (a *storeArgs) scopeName() string {
	if a.scope == "" {
		return "no scope"
	}
	return fmt.Sprintf("handler %q", a.scope)
}

// open reads the ids (arguments, else standard input) and connects to the
// store.
func (a *storeArgs) open(ctx context.Context, ids []string, s streams, conn *connection) (stores.Store, stores.Inspector, func(), []string, error) {
	if len(ids) == 0 && s.stdinPiped {
		var err error
		if ids, err = readIDs(s.stdin); err != nil {
			return nil, nil, nil, nil, err
		}
	}
	if len(ids) == 0 {
		return nil, nil, nil, nil, usageErr("no message ids given (as arguments or on standard input)")
	}
	store, closeStore, err := a.openStore(ctx, conn)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	inspector, ok := store.(stores.Inspector)
	if !ok {
		closeStore()
		return nil, nil, nil, nil, fmt.Errorf("%T cannot be inspected", store)
	}
	return store, inspector, closeStore, ids, nil
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

func (a *storeArgs) openStore(ctx context.Context, conn *connection) (stores.Store, func(), error) {
	switch a.kind {
	case "redis":
		if err := redisstore.ValidatePrefix(a.prefix); err != nil {
			return nil, nil, usageErr("--prefix: %v", err)
		}
		client, err := conn.openRedis(ctx)
		if err != nil {
			return nil, nil, err
		}
		return redisstore.New(client, redisstore.WithPrefix(a.prefix)), func() { _ = client.Close() }, nil
	case "postgres":
		db, err := conn.openPostgres(ctx)
		if err != nil {
			return nil, nil, err
		}
		s, err := postgresstore.New(db, postgresstore.WithTable(a.table))
		if err != nil {
			_ = db.Close()
			return nil, nil, usageErr("%v", err)
		}
		return s, func() { _ = db.Close() }, nil
	}
	return nil, nil, usageErr("--store %q: want redis or postgres", a.kind)
}
