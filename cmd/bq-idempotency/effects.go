package main

// # effects list and effects resolve
//
// The records of external effects (package effects: charges, refunds,
// emails) are finite work for an operator: an effect whose outcome is
// unknown waits for someone to find out what happened, once no attempt
// may still act on it.
//
//	bq-idempotency effects list [--state unknown] [--min-age 10m] [flags]
//	bq-idempotency effects resolve --state succeeded --result ch_123 --note "found in the dashboard" PROVIDER-KEY...
//	bq-idempotency effects resolve --state failed --note "not in the provider's ledger" --handler charge --effect charge ID...
//	bq-idempotency effects resolve --force --state failed --note "declined in the dashboard" PROVIDER-KEY...
//
// list prints the effects in the given states (default: pending and
// unknown), oldest in its state first, with their age, attempts, evidence,
// lease and last note. resolve records a manual resolution with a note: it
// moves only a pending or unknown effect, to succeeded (with the provider's
// result, which later attempts get back) or failed; the message's next
// delivery (a redrive of its dead letter) then finds it settled and sends
// nothing. It leaves an effect an attempt may still act on (LEASE live or
// landing, below) as it is, and says until when: resolve it then, or give
// --force. A forced resolution does not stop a call under way: if the
// provider then answers that the effect happened (the call's answer, a
// callback, a status lookup), that answer overrules the resolution, and
// the effect becomes succeeded with the provider's result (see
// effects.Runner.Resolve). resolve exits 3 when an effect could not be
// resolved (none, final already, or in flight without --force).
//
// purge removes the final effects (succeeded, failed) that entered their
// state more than --older-than ago, and the provider events received as
// long ago; never a pending or unknown effect. The stores keep final
// effects 7 days by default (their WithEffectsTTL); purge frees them
// earlier, or cleans a store kept without a retention. Keep them at least
// as long as the replay horizon of their messages.
//
//	bq-idempotency effects purge --older-than 720h [flags]
//
// migrate-keys (Redis) renames the keys an effect store of an earlier
// release wrote ({prefix}e:…, which did not start with the prefix) to the
// current layout (prefix{prefix}e:…). Run it once every worker runs the
// current release: until then a worker of it finds each such effect where
// it is when it acts on it (a rolling upgrade never begins one afresh),
// but list, purge and the stats see only the current layout.
//
//	bq-idempotency effects migrate-keys [--prefix P] [flags]
//
// list's table has one word in each column but the last, NOTE, so that
// scripts can split it on white space. Its LEASE column says what may
// still act on the effect: "live" for a pending effect whose holder's
// lease runs (its call may be under way; the lease is renewed while it
// runs), "landing" for an unknown effect whose request may still reach the
// provider (its last attempt's lease runs), "lapsed" for a pending effect
// whose holder's lease ran out (the attempt died with the call in flight),
// and "-" otherwise; its UNTIL column the lease's end for the first three
// (RFC 3339 in UTC, to the millisecond), "-" otherwise. Live and landing
// effects are in flight, not waiting for someone: the count on standard
// error says how many. Its RESULT column says, of a succeeded effect,
// whether its result is "kept" or was "dropped" (the store's result
// lifetime passed: the effect stays final, never sent again), and "-" for
// the other states.
//
// show prints every field of the effects named by provider key (or, with
// --handler and --effect, by message id), one "field: value" line each,
// the result as it is kept (quoted) or "dropped", the lease as list's
// LEASE; it exits 3 when one does not exist.
//
//	bq-idempotency effects show [--handler NAME --effect NAME] [--output json] KEY... [flags]
//
// A key (or message id) given twice is resolved or shown once.
//
//	--output FORMAT     list and show: text (the default) or json, one JSON object (see
//	                    Output in the command's doc)
//	--force             resolve: also resolve effects in flight (LEASE live or landing)
//
//	--store KIND        redis (redisstore.NewEffects, the default) or postgres (postgresstore.NewEffects)
//	--prefix P          the Redis key prefix (default bq:fx)
//	--table T           the PostgreSQL table (default watermill_idempotency_effects)

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/babelqueue/watermill-idempotency/effects"
	"github.com/babelqueue/watermill-idempotency/stores"
	"github.com/babelqueue/watermill-idempotency/stores/postgresstore"
	"github.com/babelqueue/watermill-idempotency/stores/redisstore"
)

// effectsArgs are the flags both effects commands share.
type effectsArgs struct{ kind, prefix, table string }

func (a *effectsArgs) register(fs *flag.FlagSet) {
	fs.StringVar(&a.kind, "store", "redis", "the effect `store`: redis (redisstore.NewEffects) or postgres (postgresstore.NewEffects)")
	fs.StringVar(&a.prefix, "prefix", "", "Redis key `prefix` of the effects (default "+redisstore.DefaultEffectsPrefix+")")
	fs.StringVar(&a.table, "table", "", "PostgreSQL `table` of the effects (default "+postgresstore.DefaultEffectsTable+")")
}

func (a *effectsArgs) open(ctx context.Context, conn *connection) (stores.EffectStore, func(), error) {
	switch a.kind {
	case "redis":
		if a.table != "" {
			return nil, nil, usageErr("--table is for --store postgres")
		}
		prefix := orDefault(a.prefix, redisstore.DefaultEffectsPrefix)
		if err := redisstore.ValidatePrefix(prefix); err != nil {
			return nil, nil, usageErr("--prefix: %v", err)
		}
		client, err := conn.openRedis(ctx)
		if err != nil {
			return nil, nil, err
		}
		return redisstore.NewEffects(client, redisstore.WithEffectsPrefix(prefix)), func() { _ = client.Close() }, nil
	case "postgres":
		if a.prefix != "" {
			return nil, nil, usageErr("--prefix is for --store redis")
		}
		db, err := conn.openPostgres(ctx)
		if err != nil {
			return nil, nil, err
		}
		s, err := postgresstore.NewEffects(db, postgresstore.WithEffectsTable(orDefault(a.table, postgresstore.DefaultEffectsTable)))
		if err != nil {
			_ = db.Close()
			return nil, nil, usageErr("--table: %v", err)
		}
		return s, func() { _ = db.Close() }, nil
	}
	return nil, nil, usageErr("--store %q: want redis or postgres", a.kind)
}

// parseStates reads --state values.
func parseStates(values []string) ([]stores.EffectState, error) {
	var out []stores.EffectState
	for _, v := range values {
		s := stores.EffectState(v)
		if !s.Valid() {
			return nil, usageErr("--state %q: want pending, unknown, succeeded or failed", v)
		}
		out = append(out, s)
	}
	return out, nil
}

func effectsListFlags(fs *flag.FlagSet, conn *connection) func(context.Context, []string, streams) error {
	a := &effectsArgs{}
	a.register(fs)
	var states listFlag
	fs.Var(&states, "state", "only effects in `state` (pending, unknown, succeeded, failed); repeatable\n(default: pending and unknown, the ones not settled; LEASE tells those an attempt\nmay still act on, live or landing, from those waiting for someone)")
	minAge := fs.Duration("min-age", 0, "only effects in their state for at least `D` (e.g. 10m)")
	limit := fs.Int("limit", 100, "list at most `N` effects, the oldest first; when more match, the count on\nstderr says so (and \"more\": true in --output json)")
	output := registerOutput(fs)
	return func(ctx context.Context, rest []string, s streams) error {
		if len(rest) > 0 {
			return usageErr("unexpected arguments %q", strings.Join(rest, " "))
		}
		if *limit < 1 || *minAge < 0 {
			return usageErr("--limit must be positive and --min-age not negative")
		}
		wanted, err := parseStates(states)
		if err != nil {
			return err
		}
		if len(wanted) == 0 {
			wanted = []stores.EffectState{stores.EffectPending, stores.EffectUnknown}
		}
		store, closeStore, err := a.open(ctx, conn)
		if err != nil {
			return err
		}
		defer closeStore()
		// One more than asked, to tell a list cut at --limit from one
		// that is whole.
		q := stores.EffectQuery{States: wanted, Limit: *limit + 1}
		if *minAge > 0 {
			q.EnteredBefore = time.Now().Add(-*minAge)
		}
		list, err := store.List(ctx, q)
		if err != nil {
			return err
		}
		more := len(list) > *limit
		if more {
			list = list[:*limit]
		}
		inFlight := 0
		for _, e := range list {
			if w := leaseWord(e); w == leaseLive || w == leaseLanding {
				inFlight++
			}
		}
		if *output == outputJSON {
			doc := effectsJSON{Effects: make([]effectJSON, 0, len(list)), More: more}
			for _, e := range list {
				doc.Effects = append(doc.Effects, effectJSON{ProviderKey: e.Key, State: string(e.State), LeaseLapsed: e.LeaseLapsed,
					Lease: leaseJSON(e), LeaseUntil: jsonTime(leaseUntil(e)),
					StateSince: jsonTime(e.StateSince), AgeSeconds: time.Since(e.StateSince).Seconds(), Attempts: e.Attempts,
					Effect: e.Name, Handler: e.Scope, MessageID: e.MessageID, Evidence: e.Evidence, Note: e.Note,
					ResultDropped: e.ResultDropped, ResultExpiresAt: jsonTime(e.ResultExpiresAt)})
			}
			if err := writeJSON(s.stdout, doc); err != nil {
				return err
			}
		} else {
			tw := tabwriter.NewWriter(s.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "PROVIDER-KEY\tSTATE\tLEASE\tAGE\tATTEMPTS\tEFFECT\tHANDLER\tMESSAGE-ID\tEVIDENCE\tRESULT\tUNTIL\tNOTE")
			for _, e := range list {
				until := "-"
				if at := leaseUntil(e); !at.IsZero() {
					until = at.UTC().Format(effects.TimeFormat)
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", oneWord(e.Key), e.State, leaseWord(e), time.Since(e.StateSince).Round(time.Second),
					e.Attempts, oneWord(e.Name), oneWord(e.Scope), oneWord(e.MessageID), oneWord(e.Evidence), resultWord(e), until, orDash(oneLine(e.Note)))
			}
			if err := tw.Flush(); err != nil {
				return err
			}
		}
		summary := fmt.Sprintf("%d effect(s)", len(list))
		if more {
			summary += ", the oldest first; more match (--limit)"
		}
		if inFlight > 0 {
			summary += fmt.Sprintf("; %d of them in flight (LEASE live or landing): an attempt may still act on them until UNTIL, "+
				"and effects resolve waits for it (or --force)", inFlight)
		}
		fmt.Fprintln(s.stderr, summary)
		return nil
	}
}

func effectsResolveFlags(fs *flag.FlagSet, conn *connection) func(context.Context, []string, streams) error {
	a := &effectsArgs{}
	a.register(fs)
	state := fs.String("state", "", "the resolution: succeeded or failed (required)")
	result := fs.String("result", "", "succeeded: the provider's `result` (a charge id), which later attempts get back")
	note := fs.String("note", "", "who checked what (required), kept with the effect")
	force := fs.Bool("force", false, "also resolve an effect an attempt may still act on (LEASE live: its call may be\n"+
		"under way; landing: its request may still reach the provider), which is otherwise\n"+
		"left, saying until when; the provider's success that still comes overrules the\n"+
		"resolution (the effect becomes succeeded with its result)")
	var named effectNames
	named.register(fs)
	return func(ctx context.Context, args []string, s streams) error {
		to := stores.EffectState(*state)
		switch {
		case !to.Final():
			return usageErr("--state %q: want succeeded or failed", *state)
		case strings.TrimSpace(*note) == "":
			return usageErr("--note is required: say who checked what")
		case *result != "" && to != stores.EffectSucceeded:
			return usageErr("--result goes with --state succeeded")
		}
		args, err := named.args(args, s)
		if err != nil {
			return err
		}
		store, closeStore, err := a.open(ctx, conn)
		if err != nil {
			return err
		}
		defer closeStore()
		fx, err := effects.New(store)
		if err != nil {
			return err
		}
		defer fx.Close()
		outcome := effects.Failed(*note)
		if to == stores.EffectSucceeded {
			outcome = effects.Succeeded([]byte(*result))
		}
		var opts []effects.ResolveOption
		if *force {
			opts = append(opts, effects.WithForce())
		}
		failed := 0
		for _, arg := range args {
			key := named.key(arg)
			e, err := fx.Resolve(ctx, key, outcome, *note, opts...)
			switch {
			case errors.Is(err, effects.ErrEffectInFlight):
				failed++
				fmt.Fprintf(s.stderr, "%s: not resolved: %s (--force resolves it anyway)\n", arg, strings.TrimPrefix(err.Error(), "effects: resolve "+key+": "))
			case errors.Is(err, effects.ErrNotResolved):
				failed++
				fmt.Fprintf(s.stderr, "%s: not resolved: %s\n", arg, strings.TrimPrefix(err.Error(), "effects: resolve "+key+": "))
			case err != nil:
				return fmt.Errorf("%s: %w", arg, err)
			default:
				fmt.Fprintf(s.stdout, "%s: %s by operator (%s of message %s)\n", arg, e.State, e.Name, e.MessageID)
			}
		}
		if failed > 0 {
			return errIncomplete
		}
		return nil
	}
}

func effectsPurgeFlags(fs *flag.FlagSet, conn *connection) func(context.Context, []string, streams) error {
	a := &effectsArgs{}
	a.register(fs)
	olderThan := fs.Duration("older-than", 0, "remove final effects in their state for more than `D` (e.g. 720h), and\nprovider events received as long ago (required); never a pending or unknown effect")
	return func(ctx context.Context, rest []string, s streams) error {
		if len(rest) > 0 {
			return usageErr("unexpected arguments %q", strings.Join(rest, " "))
		}
		if *olderThan <= 0 {
			return usageErr("--older-than is required and must be positive")
		}
		store, closeStore, err := a.open(ctx, conn)
		if err != nil {
			return err
		}
		defer closeStore()
		n, err := store.Purge(ctx, time.Now().Add(-*olderThan))
		if err != nil {
			return err
		}
		fmt.Fprintf(s.stdout, "purged %d final effect(s) and event(s) older than %v\n", n, *olderThan)
		return nil
	}
}

func effectsMigrateKeysFlags(fs *flag.FlagSet, conn *connection) func(context.Context, []string, streams) error {
	a := &effectsArgs{}
	a.register(fs)
	return func(ctx context.Context, rest []string, s streams) error {
		if len(rest) > 0 {
			return usageErr("unexpected arguments %q", strings.Join(rest, " "))
		}
		if a.kind != "redis" {
			return usageErr("--store %q: migrate-keys is for redis", a.kind)
		}
		store, closeStore, err := a.open(ctx, conn)
		if err != nil {
			return err
		}
		defer closeStore()
		moved, left, err := store.(*redisstore.Effects).MigrateKeys(ctx)
		if err != nil {
			return err
		}
		fmt.Fprintf(s.stdout, "moved %d key(s) to the current layout; %d left (the current layout held them already)\n", moved, left)
		return nil
	}
}

// effectsJSON is effects list's --output json document.
type effectsJSON struct {
	Effects []effectJSON `json:"effects"`
	// More says that more effects match than --limit let through.
	More bool `json:"more"`
}

// effectJSON is one effect of effects list's --output json.
type effectJSON struct {
	ProviderKey string  `json:"provider_key"`
	State       string  `json:"state"`
	LeaseLapsed bool    `json:"lease_lapsed"`
	StateSince  *string `json:"state_since"`
	AgeSeconds  float64 `json:"age_seconds"`
	Attempts    int     `json:"attempts"`
	Effect      string  `json:"effect"`
	Handler     string  `json:"handler"`
	MessageID   string  `json:"message_id"`
	Evidence    string  `json:"evidence"`
	Note        string  `json:"note"`
	// ResultDropped: succeeded, its result dropped after the store's
	// result lifetime (the effect is still final).
	ResultDropped   bool    `json:"result_dropped"`
	ResultExpiresAt *string `json:"result_expires_at"` // null: kept as long as the record
	// Lease is live (pending, its holder's lease running: a call may be
	// under way), landing (unknown, its request may still reach the
	// provider), lapsed (pending, its holder's lease passed) or none.
	Lease      string  `json:"lease"`
	LeaseUntil *string `json:"lease_until"` // the lease's end, when Lease is not none
}

// effectsShowJSON is effects show's --output json document.
type effectsShowJSON struct {
	Effects []effectShowJSON `json:"effects"`
	Missing []string         `json:"missing"` // the keys (or ids) with no effect
}

// effectShowJSON is one effect of effects show's --output json: every
// field of its record.
type effectShowJSON struct {
	ProviderKey string  `json:"provider_key"`
	State       string  `json:"state"`
	Lease       string  `json:"lease"`       // as effects list's
	LeaseUntil  *string `json:"lease_until"` // as effects list's
	Holder      string  `json:"holder"`      // pending: the attempt holding it
	Effect      string  `json:"effect"`
	Handler     string  `json:"handler"`
	MessageID   string  `json:"message_id"`
	Fingerprint string  `json:"fingerprint"` // of the request, 16 hex digits
	Attempts    int     `json:"attempts"`
	Evidence    string  `json:"evidence"`
	Note        string  `json:"note"`
	// Result is the provider's result of a succeeded effect, as text; null
	// for the other states, and when dropped.
	Result          *string `json:"result"`
	ResultDropped   bool    `json:"result_dropped"`
	ResultExpiresAt *string `json:"result_expires_at"`
	CreatedAt       *string `json:"created_at"`
	StateSince      *string `json:"state_since"`
	UpdatedAt       *string `json:"updated_at"`
	ExpiresAt       *string `json:"expires_at"` // a final effect's lapse; null: kept
}

// The words of effects list's LEASE column (and "lease" of its JSON).
const (
	leaseLive    = "live"    // pending, its holder's lease running: a call may be under way
	leaseLanding = "landing" // unknown, its request may still reach the provider
	leaseLapsed  = "lapsed"  // pending, its holder's lease passed: the attempt died
)

// leaseWord is e's LEASE column: live, landing, lapsed or "-".
func leaseWord(e stores.Effect) string {
	switch {
	case e.State == stores.EffectPending && e.LeaseLapsed:
		return leaseLapsed
	case e.State == stores.EffectPending:
		return leaseLive
	case e.State == stores.EffectUnknown && e.Landing:
		return leaseLanding
	}
	return "-"
}

// leaseJSON is leaseWord for --output json: "none" for "-".
func leaseJSON(e stores.Effect) string {
	if w := leaseWord(e); w != "-" {
		return w
	}
	return "none"
}

// leaseUntil is the end of e's lease when its LEASE says one (live,
// landing, lapsed), else zero.
func leaseUntil(e stores.Effect) time.Time {
	if leaseWord(e) == "-" {
		return time.Time{}
	}
	return e.LeaseUntil
}

// resultWord says what is kept of an effect's result: "kept" (succeeded,
// its result held), "dropped" (succeeded, its result dropped after the
// store's result lifetime), "-" (not succeeded).
func resultWord(e stores.Effect) string {
	switch {
	case e.State != stores.EffectSucceeded:
		return "-"
	case e.ResultDropped:
		return "dropped"
	}
	return "kept"
}

// oneWord makes s one word for a table column scripts split on white
// space: "-" when empty, its white space runs replaced by "_".
func oneWord(s string) string {
	if s = strings.Join(strings.Fields(s), "_"); s == "" {
		return "-"
	}
	return s
}

func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 80 {
		s = s[:77] + "..."
	}
	return s
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func effectsShowFlags(fs *flag.FlagSet, conn *connection) func(context.Context, []string, streams) error {
	a := &effectsArgs{}
	a.register(fs)
	var named effectNames
	named.register(fs)
	output := registerOutput(fs)
	return func(ctx context.Context, args []string, s streams) error {
		args, err := named.args(args, s)
		if err != nil {
			return err
		}
		store, closeStore, err := a.open(ctx, conn)
		if err != nil {
			return err
		}
		defer closeStore()
		doc := effectsShowJSON{Effects: []effectShowJSON{}, Missing: []string{}}
		shown := 0 // in text
		for _, arg := range args {
			e, err := store.Lookup(ctx, named.key(arg))
			if err != nil {
				return fmt.Errorf("%s: %w", arg, err)
			}
			if e.State == stores.EffectNone {
				doc.Missing = append(doc.Missing, arg)
				fmt.Fprintf(s.stderr, "%s: no such effect\n", arg)
				continue
			}
			if *output == outputJSON {
				doc.Effects = append(doc.Effects, showJSON(e))
				continue
			}
			if shown > 0 {
				fmt.Fprintln(s.stdout)
			}
			shown++
			printEffect(s, e)
		}
		if *output == outputJSON {
			if err := writeJSON(s.stdout, doc); err != nil {
				return err
			}
		}
		if len(doc.Missing) > 0 {
			return errIncomplete
		}
		return nil
	}
}

// showJSON is every field of e, for effects show --output json.
func showJSON(e stores.Effect) effectShowJSON {
	out := effectShowJSON{ProviderKey: e.Key, State: string(e.State), Lease: leaseJSON(e), LeaseUntil: jsonTime(leaseUntil(e)),
		Holder: e.Holder, Effect: e.Name, Handler: e.Scope, MessageID: e.MessageID, Fingerprint: fmt.Sprintf("%016x", e.Fingerprint),
		Attempts: e.Attempts, Evidence: e.Evidence, Note: e.Note, ResultDropped: e.ResultDropped,
		ResultExpiresAt: jsonTime(e.ResultExpiresAt), CreatedAt: jsonTime(e.CreatedAt), StateSince: jsonTime(e.StateSince),
		UpdatedAt: jsonTime(e.UpdatedAt), ExpiresAt: jsonTime(e.ExpiresAt)}
	if e.State == stores.EffectSucceeded && !e.ResultDropped {
		result := string(e.Result)
		out.Result = &result
	}
	return out
}

// printEffect writes every field of e, one "field: value" line each.
func printEffect(s streams, e stores.Effect) {
	at := func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return t.UTC().Format(time.RFC3339Nano)
	}
	result := "-"
	switch {
	case e.ResultDropped:
		result = "dropped (its lifetime passed " + at(e.ResultExpiresAt) + "; the effect stays " + string(e.State) + ")"
	case e.State == stores.EffectSucceeded:
		result = fmt.Sprintf("%q", e.Result)
	}
	tw := tabwriter.NewWriter(s.stdout, 0, 4, 1, ' ', 0)
	for _, f := range [][2]string{
		{"provider-key", e.Key}, {"state", string(e.State)}, {"effect", e.Name}, {"handler", e.Scope}, {"message-id", e.MessageID},
		{"fingerprint", fmt.Sprintf("%016x", e.Fingerprint)}, {"attempts", fmt.Sprint(e.Attempts)}, {"evidence", orDash(e.Evidence)},
		{"note", orDash(oneLine(e.Note))}, {"result", result}, {"result-expires", at(e.ResultExpiresAt)},
		{"holder", orDash(e.Holder)}, {"lease", leaseWord(e)}, {"lease-until", at(e.LeaseUntil)}, {"created", at(e.CreatedAt)},
		{"state-since", at(e.StateSince)}, {"updated", at(e.UpdatedAt)}, {"expires", at(e.ExpiresAt)},
	} {
		fmt.Fprintf(tw, "%s:\t%s\n", f[0], f[1])
	}
	_ = tw.Flush()
}

// effectNames are the flags that name effects by handler, effect and
// message id instead of by provider key.
type effectNames struct{ handler, effect string }

func (n *effectNames) register(fs *flag.FlagSet) {
	fs.StringVar(&n.handler, "handler", "", "with --effect: the arguments are message ids handled by the handler `name`\n(or WithScope value); without, they are provider keys")
	fs.StringVar(&n.effect, "effect", "", "with --handler: the effect's `name`")
}

// args returns the command's arguments, or the ids piped to it when it has
// none; a usage error when there are none, or the flags are half given.
func (n *effectNames) args(args []string, s streams) ([]string, error) {
	if (n.handler == "") != (n.effect == "") {
		return nil, usageErr("--handler and --effect go together")
	}
	if len(args) == 0 && s.stdinPiped {
		var err error
		if args, err = readIDs(s.stdin); err != nil {
			return nil, err
		}
	}
	if len(args) == 0 {
		return nil, usageErr("no provider keys (or, with --handler and --effect, message ids) given")
	}
	return distinct(args), nil
}

// key returns the provider key arg names.
func (n *effectNames) key(arg string) string {
	if n.handler != "" {
		return effects.ProviderKey(n.handler, arg, n.effect)
	}
	return arg
}
