// Command bq-idempotency is the operator's tool for the idempotency kit.
//
//	bq-idempotency redrive --from orders.dlq [flags]       # move dead letters back to their queue
//	bq-idempotency forget  --handler charge [flags] ID...  # a planned replay: the next delivery runs again
//	bq-idempotency inspect --handler charge [flags] ID...  # remembered, in flight, failing, ended, or unknown
//	bq-idempotency inspect --store php-redis [flags] ID... # the same, in a BabelQueue SDK store's layout
//	bq-idempotency effects list [--state unknown] [flags]  # external effects by state and age, oldest first
//	bq-idempotency effects resolve --state S --note T KEY  # an operator's resolution of an unknown effect
//	bq-idempotency effects show KEY                        # every field of an effect
//	bq-idempotency effects purge --older-than D            # remove final effects older than D
//	bq-idempotency effects migrate-keys [flags]            # rename effect keys of earlier releases (Redis)
//	bq-idempotency help [command]
//
// "bq-idempotency <command> -h" and "bq-idempotency help <command>" print a
// command's flags. Each error is printed once, on standard error.
// Passwords in connection URLs and DSNs are never printed: every line the
// command writes has them replaced by "xxxxx".
//
// # Exit status
//
//	0  success
//	1  failure: the command failed, or stopped on an error (a redrive that
//	   stopped part way still reports what it moved)
//	2  bad usage: an unknown command or flag, a missing or invalid value, a
//	   connection URL or DSN that does not parse; nothing was done
//	3  partial: the command finished, but not all it was asked could be
//	   done: redrive left messages it selected on the dead-letter topic (no
//	   queue to go to, the broker refused them, or they failed again after
//	   the run sent them back), forget found no record for some ids, effects resolve could not resolve some effects (none,
//	   final already, or in flight without --force), effects show found no
//	   effect for some keys
//
// # Output
//
// Results go to standard output: tables for people by default, or, with
// --output json (redrive, inspect, forget, effects list, effects show), one JSON object
// written when the command ends, with the field names below, which are
// stable: fields may be added, none renamed or removed. Times are RFC 3339
// in UTC, or null. Progress, notes and errors go to standard error, in
// either format.
//
//	redrive       {"from", "dry_run", "read", "moved", "would_move" (a dry run: it
//	               moves nothing), "kept", "not_moved", "skipped", "unknown_age",
//	               "emptied", "error" (when it stopped on one), "messages" (with
//	               --verbose): [{"id", "urn", "reason", "from", "to", "moved",
//	               "would_move", "note"}]}
//	inspect       {"records": [{"id", "state" (remembered, in_flight, failing, ended or unknown),
//	               "expires_at", "response" (API records: {"status", "bytes",
//	               "body_kept", "saved_at", "reference" (identity records of
//	               two tiers)})}], "unknown"}
//	forget        {"forgotten", "requested", "missing": [ids with no record]}
//	effects list  {"effects": [{"provider_key", "state", "lease" (live, landing, lapsed
//	               or none), "lease_until" (null for none), "lease_lapsed", "state_since",
//	               "age_seconds", "attempts", "effect", "handler", "message_id",
//	               "evidence", "note", "result_dropped", "result_expires_at"}],
//	               "more" (more match than --limit showed)}
//	effects show  {"effects": [{"provider_key", "state", "lease", "lease_until", "holder",
//	               "effect", "handler", "message_id", "fingerprint", "attempts",
//	               "evidence", "note", "result" (text, or null), "result_dropped",
//	               "result_expires_at", "created_at", "state_since", "updated_at",
//	               "expires_at"}], "missing": [keys with no effect]}
//
// # Connections
//
// Every command takes:
//
//	--redis-url URL      Redis to use (default $REDIS_URL, else redis://localhost:6379/0).
//	                     Repeat it, or add addr=HOST:PORT query parameters, for a Redis
//	                     Cluster; a single URL of a cluster node is recognised as a
//	                     Cluster too. A master_name=NAME query parameter makes the URL's
//	                     addresses Sentinels watching master NAME.
//	--postgres-dsn DSN   PostgreSQL to use, URL or key=value form (default $POSTGRES_DSN,
//	                     else postgres://postgres@localhost:5432/test?sslmode=disable).
//
// # redrive
//
// redrive moves dead-lettered envelopes from a dead-letter topic back to the
// queue they came from (see package redrive): each goes to its
// dead_letter.original_queue with the dead_letter block stripped and
// attempts reset to 0; the others stay on the dead-letter topic. A topic
// that does not exist is an error, and nothing is created; what each
// broker can tell:
//
//   - redis, postgres, amqp, kafka, nats: a stream, table, durable queue or
//     topic outlives its last message, so a missing one was never created
//     (or was deleted): an error. On Kafka the check asks without creating
//     the topic, whatever the broker's auto.create.topics.enable; on NATS a
//     topic is a subject, and missing means no JetStream stream captures
//     it.
//   - redis-list, redis-laravel: Redis deletes an empty list, so a list
//     that was emptied and one never written look the same. A real run that
//     finds the list leaves a marker, the key
//     <key-prefix>bq-redrive:seen:<reliable-list|laravel>:<topic>; a later
//     run that finds no list but the marker has nothing to move and says so
//     (exit 0), a dry run too. No list and no marker (a typo, or a list no
//     run has found yet) is an error. Delete the marker with the queue.
//
// A dead letter the broker refuses for good is skipped: it stays on the
// dead-letter topic, the report says why, and the summary counts it; the
// run goes on with the others. The one such refusal is an original queue
// that is no watermill-sql topic name (ErrInvalidTopicName), with postgres:
// the Redis lists carry every body (one that is not UTF-8 base64-encoded in
// a frame, one that is not a Laravel job wrapped in one, see package
// pubsub/redislist). Any other failure to publish (the
// broker cannot be reached, a timeout) stops the run: exit 1, the message
// left on the topic. A run that waited --idle for nothing then reads the
// topic once more: a broker that went down is an error, not an empty topic.
//
// On Redis Streams one run at a time reads a stream in a group: a run holds
// the lock <topic>:bq-redrive-lock:<group> (a lease of 10s, renewed while
// it runs, deleted when it ends), and a second run exits 1 without moving
// anything while it is held. A run that died leaves the lock to lapse: the
// next run, at most 10s later, takes the lock and what the dead run had
// read and not acked.
//
// On Kafka, --group is a consumer group: a run commits what it acked, and
// --idle counts from the group's first assignment (a broker may hold that
// back for group.initial.rebalance.delay.ms). A run reads what the group
// had not committed when it began, every partition to its end, and stops
// there; what it put back waits for the next run.
//
// On NATS JetStream, --group names a durable pull consumer on the stream
// that captures the dead-letter topic (created by the first run, left in
// place: each run goes on from the last one's acks). A run fetches one
// message at a time, so it reads nothing ahead of what it moves; a message
// it held when it died comes back to the next run after 30 s (the
// consumer's AckWait). A dry run reads the stream by sequence from that
// consumer's ack floor and creates nothing. Moved messages go to the
// stream that captures their topic; one no stream captures fails the run
// (no stream is created).
//
//	--from TOPIC        the dead-letter topic to read (required), e.g. orders.dlq; one that does not
//	                    exist is an error, but for a Redis list an earlier run found (see above)
//	--broker NAME       redis (Redis Streams, the default), redis-list (the BabelQueue SDKs' Redis
//	                    list), redis-laravel (Laravel's Redis queue), postgres (watermill-sql on
//	                    PostgreSQL), amqp (RabbitMQ in the BabelQueue SDKs' layout; no --dry-run)
//	                    kafka (watermill-kafka with the BabelQueue Kafka binding) or nats (NATS
//	                    JetStream with watermill-nats: a stream per topic)
//	--amqp-url URL      RabbitMQ to use with --broker amqp (default $AMQP_URL, else
//	                    RabbitMQ on localhost:5672 with its stock user)
//	--kafka-brokers A   Kafka bootstrap addresses, host:port separated by commas, to use with
//	                    --broker kafka (default $KAFKA_BROKERS, else localhost:9092)
//	--nats-url URL      NATS to use with --broker nats (default $NATS_URL, else
//	                    nats://localhost:4222)
//	--group NAME        the consumer group the dead-letter topic is read with (default bq-redrive)
//	--key-prefix P      redis-list and redis-laravel: the prefix before every Redis key of the
//	                    queues, as a Laravel connection's prefix option (e.g. laravel_database_)
//	--dry-run           report what would move, and change nothing anywhere: the topic is read
//	                    without consuming it (no publish, no ack, no group or offset created),
//	                    from where --group's next run would start (all of it for a new group)
//	--to TOPIC          send every moved message to TOPIC instead of its original queue
//	--reason R          only messages dead-lettered for reason R; repeatable. The reasons: failed
//	                    (the handler failed after its retries), unknown_urn (no handler for the
//	                    URN), poison (unreadable: not an envelope, an unsupported schema version,
//	                    an unusable or missing meta.id), rejected (the handler rejected it for good),
//	                    conflict (its meta.id was used for another message, or an effect's request
//	                    differs from the one recorded), too_old (older than the replay horizon),
//	                    unknown_outcome (an external effect's outcome is unknown: settle it first)
//	--urn URN           only messages of job URN; repeatable
//	--id ID             only the message with meta.id ID; repeatable
//	--min-age D         only messages dead-lettered at least D ago (e.g. 1h)
//	--max-age D         only messages dead-lettered at most D ago; with either age filter, a message
//	                    whose dead-letter time is unknown (no dead_letter.failed_at) stays, and the
//	                    summary says how many did
//	--max N             move at most N messages (0: all)
//	--rate R            move R messages a second, at most (0: no limit): the moves keep to a
//	                    schedule counted from the first, so the time each takes does not slow
//	                    the run; a run that fell behind (a stall, no message for a while) makes
//	                    up for a tenth of a second of it at most
//	--move-verbatim     also move bodies that are not envelopes (dead-lettered verbatim), unchanged,
//	                    to the original topic the dead-letter middleware recorded (or --to); without
//	                    it they stay on the dead-letter topic
//	--replay-bypass     stamp bq-replay-bypass: 1 on moved messages: the handler runs again (after
//	                    forget) but its external effects wrapped in BypassExternalEffects do not
//	--idle D            stop when the run waited D for a message (default 2s); the wait --rate
//	                    imposes does not count
//	--quiet             no progress reports on standard error
//	--progress-every D  off a terminal, a status line every D (default 5s)
//	--verbose           also report each message read: a table row, or the messages array
//	                    of --output json; without it only the summary
//	--output FORMAT     text (the default) or json (see Output)
//
// Progress goes to standard error. On a terminal it is a bar redrawn in
// place: messages read of the total, moved and kept, the rate and the time
// left; when the run ends it is drawn a last time, with the final counts
// (full when the run read the whole topic), and left on the terminal.
// Otherwise (a log, a pipe) it is a status line every --progress-every in
// which messages came: "redrive: 1200 of 5000 read, 1190 moved, 10 kept,
// 250 msg/s, about 15s left, 5s elapsed". The rate is the run's, from the
// first message it dealt with to the last (the time it took to connect and
// to read the first is not counted); it shows once two messages measure
// it. The total is what the topic held
// for the run when it began, where the broker can tell: Redis Streams (what
// the group has pending and not yet delivered, or XLEN without the group),
// the Redis lists (LLEN), RabbitMQ (the ready messages of a passive queue
// declaration), PostgreSQL (the rows after the group's offset). The summary
// (and with --verbose the table of every message: ID, URN, REASON, FROM, TO,
// RESULT) goes to standard output. A run that left messages it selected on
// the dead-letter topic (no original queue, a broker that refused them)
// exits 3.
//
// # forget and inspect
//
// forget drops the records of the given message ids (or ids read from
// standard input, one a line), so that their next delivery runs the handler
// again; inspect tells whether each id is remembered, in flight, or unknown,
// and when its record or claim expires.
//
// The kit's own stores (--store redis or postgres) key a record by the
// Watermill handler name and meta.id (or by the scope given to WithScope),
// so both commands need --handler there; forget refuses to run without it
// (or --unscoped), and inspect without it looks only for records kept under
// no scope, and says so.
//
// The BabelQueue SDK layouts of package sdkstore (--store php-redis,
// php-pdo, go-redis, go-postgres) key a record on meta.id alone, for SDK
// consumers and kit consumers (wired with WithScope("")) alike: there both
// commands take no --handler (a record kept under a handler would not be
// the SDK's, so --handler is a usage error) and forget needs no --unscoped.
// They read the records as each side does: on the PHP layouts the SDK's
// claim and the kit's are in flight; on the Go SDK layouts a record is
// remembered, whoever wrote it (a Go SDK consumer's claim is its record),
// and only the kit's claims, kept where the Go SDK never reads, are in
// flight. forget there drops the record and any claim in flight, on the PHP
// layouts a PHP consumer's too: forget an id once its delivery is over, or
// a redelivery may run beside the delivery still holding the claim.
//
//	--handler NAME      the handler name (or WithScope value) the records are kept under;
//	                    not with the SDK layouts
//	--unscoped          forget: the records are kept under no scope (WithScope("")); implied
//	                    with the SDK layouts
//	--store KIND        redis (redisstore, the default), postgres (postgresstore), or an SDK
//	                    layout: php-redis (PHP RedisStore), php-pdo (PHP PdoStore), go-redis
//	                    (Go SDK idempotency-redis), go-postgres (Go SDK idempotency-postgres)
//	--prefix P          Redis key prefix: default bq: (redis), bq:idem: (php-redis), bq:idemp:
//	                    (go-redis, whose kit claims are under bq:idemp-claim:, the prefix
//	                    without its final colon followed by -claim:)
//	--table T           SQL table: default watermill_idempotency (postgres), bq_idempotency
//	                    (php-pdo), babelqueue_idempotency (go-postgres, whose kit claims are in
//	                    babelqueue_idempotency_claims, the table followed by _claims)
//	--claim-prefix P    go-redis: where the kit's claims are, when the store was given
//	                    WithClaimPrefix
//	--claim-table T     go-postgres: where the kit's claims are, when the store was given
//	                    WithClaimTable (a database without that table: the records alone)
//	--dialect D         php-pdo's database: postgres (the default, through --postgres-dsn)
//	                    or mysql (MariaDB, through --mysql-dsn)
//	--mysql-dsn DSN     MariaDB to use with --dialect mysql, in go-sql-driver/mysql form
//	                    (default $MARIADB_DSN, else root@tcp(localhost:3306)/test)
//
// A --prefix, --table, --claim-prefix or --claim-table that the chosen
// store has no use for is a usage error, as is --dialect with any store but
// php-pdo. The SDK layouts'
// prefixes and tables are the SDKs' defaults: give the ones your SDK
// consumers were configured with. On PostgreSQL give --table and
// --claim-table in lower case, as PostgreSQL reads the unquoted names the
// SDKs write (Orders_Idem is their table orders_idem): a name with capitals
// is a usage error naming the table the SDKs use, as the store refuses it.
//
// The API records of package httpidempotency (Idempotency-Key on
// net/http) live in the kit's stores too: --api-tenant and --operation name
// them, and the ids given are the clients' keys. inspect then also shows
// the saved response's status and size.
//
//	--api-tenant T      the tenant of API records; with --operation
//	--operation O       the operation of API records (Operation.Name)
//
// forget reports how many records it removed and lists the ids that had
// none (expired, never processed, kept under another handler, prefix or
// table, or a claim whose lease lapsed); it exits 3 when any id had none.
// An id given twice is looked up, forgotten and counted once, by inspect
// too.
//
// A table that does not exist (a --table naming another, a --postgres-dsn
// pointing at another database, a store never migrated) is an error that
// says so and how to fix it: name the table with --table, or create it
// with the store's Migrate (or the .sql file beside its package).
//
//	--output FORMAT     text (the default) or json (see Output), forget and inspect
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/redis/go-redis/v9"
)

func main() {
	// go-redis logs its connection retries on its own; the command reports
	// the error it returns, once.
	redis.SetLogger(quietLogger{})
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], streams{
		stdin: os.Stdin, stdout: os.Stdout, stderr: os.Stderr,
		stdinPiped: !isTerminal(os.Stdin), stderrTerminal: isTerminal(os.Stderr), stderrFile: os.Stderr,
	}))
}

type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

// streams are the command's standard files.
type streams struct {
	stdin          io.Reader
	stdout, stderr io.Writer
	stdinPiped     bool // ids may come from stdin
	stderrTerminal bool // progress may redraw a line
	// stderrFile is standard error unwrapped (nil in tests): the progress
	// bar, which prints counts alone, writes to it to fit the terminal's
	// width.
	stderrFile *os.File
}

func isTerminal(f *os.File) bool {
	info, err := f.Stat()
	return err == nil && info.Mode()&os.ModeCharDevice != 0
}

// errUsage marks a usage error (exit status 2).
var errUsage = errors.New("usage")

// errIncomplete marks a command that did what it could but not all it was
// asked (exit status 3, exitPartial: the output already said what).
var errIncomplete = errors.New("incomplete")

func usageErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errUsage, fmt.Sprintf(format, args...))
}

// command is one subcommand.
type command struct {
	name, synopsis, summary string
	// flags registers the command's flags and returns the function that
	// runs it once they are parsed.
	flags func(fs *flag.FlagSet, conn *connection) func(ctx context.Context, args []string, io streams) error
}

var commands = []command{
	{"redrive", "redrive --from TOPIC [flags]", "move dead-lettered messages back to their queue", redriveFlags},
	{"forget", "forget (--handler NAME | --unscoped | --store SDK-LAYOUT) [flags] ID... (or IDs on standard input, one a line)", "drop message records, so that the next delivery runs the handler again", forgetFlags},
	{"inspect", "inspect [--handler NAME] [--store KIND] [flags] ID... (or IDs on standard input, one a line)", "tell whether messages are remembered, in flight, or unknown", inspectFlags},
	{"effects list", "effects list [--state S]... [--min-age D] [--store KIND] [flags]", "list external effects (package effects) by state, oldest in its state first", effectsListFlags},
	{"effects resolve", "effects resolve --state succeeded|failed --note TEXT [--result R] [flags] (PROVIDER-KEY... | --handler NAME --effect NAME ID...)", "record an operator's resolution of pending or unknown external effects", effectsResolveFlags},
	{"effects show", "effects show [--handler NAME --effect NAME] KEY... [--store KIND] [flags]", "print every field of external effects, their result kept or dropped", effectsShowFlags},
	{"effects migrate-keys", "effects migrate-keys [--prefix P] [flags]", "rename the Redis keys of effects written by earlier releases ({prefix}e:…) to the layout that starts with the prefix", effectsMigrateKeysFlags},
	{"effects purge", "effects purge --older-than D [--store KIND] [flags]", "remove final external effects (succeeded, failed) older than D, never a pending or unknown one", effectsPurgeFlags},
}

func findCommand(name string) *command {
	for i := range commands {
		if commands[i].name == name {
			return &commands[i]
		}
	}
	return nil
}

// subcommands lists the commands of two words whose first is name
// ("effects list", "effects resolve").
func subcommands(name string) []string {
	var subs []string
	for _, c := range commands {
		if first, _, ok := strings.Cut(c.name, " "); ok && first == name {
			subs = append(subs, c.name)
		}
	}
	return subs
}

func topUsage(w io.Writer) {
	fmt.Fprint(w, "usage: bq-idempotency <command> [flags]\n\ncommands:\n")
	width := len("help")
	for _, c := range commands {
		width = max(width, len(c.name))
	}
	for _, c := range commands {
		fmt.Fprintf(w, "  %-*s %s\n", width, c.name, c.summary)
	}
	fmt.Fprintf(w, "  %-*s %s\n\n", width, "help", "print a command's flags: bq-idempotency help <command>")
	fmt.Fprint(w, "Output: tables on standard output (--output json: one JSON object instead, for scripts);\n"+
		"progress, notes and errors on standard error.\n\n"+exitStatuses)
}

func run(ctx context.Context, args []string, s streams) int {
	r := newRedactor()
	s.stdout, s.stderr = r.writer(s.stdout), r.writer(s.stderr)
	if len(args) == 0 {
		topUsage(s.stderr)
		return 2
	}
	name := args[0]
	switch name {
	case "-h", "-help", "--help":
		topUsage(s.stdout)
		return 0
	case "help":
		if len(args) == 1 {
			topUsage(s.stdout)
			return 0
		}
		c := findCommand(strings.Join(args[1:], " "))
		if c == nil {
			fmt.Fprintf(s.stderr, "bq-idempotency help: unknown command %q; run \"bq-idempotency help\" for the list\n", strings.Join(args[1:], " "))
			return 2
		}
		fs, conn, _ := c.flagSet(r)
		conn.addSecrets() // as "<command> -h" does: the two print the same
		c.usage(s.stdout, fs)
		return 0
	}
	if len(args) > 1 && findCommand(name+" "+args[1]) != nil { // a command of two words: effects list
		name, args = name+" "+args[1], args[1:]
	}
	c := findCommand(name)
	if c == nil {
		if subs := subcommands(name); len(subs) > 0 { // "effects" alone, or an unknown second word
			fmt.Fprintf(s.stderr, "bq-idempotency %s: name a subcommand: %s\n", name, strings.Join(subs, ", "))
			return 2
		}
		fmt.Fprintf(s.stderr, "bq-idempotency: unknown command %q; run \"bq-idempotency help\" for the list\n", name)
		return 2
	}
	fs, conn, runCmd := c.flagSet(r)
	err := fs.Parse(args[1:])
	conn.addSecrets()
	switch {
	case errors.Is(err, flag.ErrHelp):
		c.usage(s.stdout, fs)
		return 0
	case err != nil:
		err = usageErr("%v", err)
	default:
		err = runCmd(ctx, fs.Args(), s)
	}
	switch {
	case err == nil:
		return 0
	case errors.Is(err, errUsage):
		fmt.Fprintf(s.stderr, "bq-idempotency %s: %s\nRun \"bq-idempotency help %s\" for its flags.\n",
			name, strings.TrimPrefix(err.Error(), errUsage.Error()+": "), name)
		return 2
	case errors.Is(err, errIncomplete):
		return exitPartial
	default:
		fmt.Fprintf(s.stderr, "bq-idempotency %s: %v\n", name, err)
		if table, ok := missingTable(err); ok {
			fmt.Fprintf(s.stderr, "There is no table %q in that database: name the table the store uses with --table (--claim-table for\n"+
				"the kit's claims beside a Go SDK layout), point --postgres-dsn (or --mysql-dsn) at the database that\n"+
				"holds it, or create it first (the store's Migrate, or the .sql file beside the store's package).\n", table)
		}
		return 1
	}
}

// flagSet returns the command's flags, quiet on errors (run prints them
// once), and the function running it.
func (c *command) flagSet(r *redactor) (*flag.FlagSet, *connection, func(context.Context, []string, streams) error) {
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	conn := &connection{redactor: r}
	runCmd := c.flags(fs, conn)
	conn.register(fs)
	return fs, conn, runCmd
}

// usage prints the command's help, in the one style every command shares.
func (c *command) usage(w io.Writer, fs *flag.FlagSet) {
	fmt.Fprintf(w, "usage: bq-idempotency %s\n\n%s.\n\nflags:\n", c.synopsis, strings.ToUpper(c.summary[:1])+c.summary[1:])
	fs.VisitAll(func(f *flag.Flag) {
		value, text := flag.UnquoteUsage(f)
		if value != "" {
			value = " " + value
		}
		fmt.Fprintf(w, "  --%s%s\n", f.Name, value)
		for _, line := range strings.Split(text, "\n") {
			fmt.Fprintf(w, "        %s\n", line)
		}
		if def := f.DefValue; def != "" && def != "0" && def != "false" && def != "0s" {
			fmt.Fprintf(w, "        (default %s)\n", def)
		}
	})
	fmt.Fprint(w, jsonHelp(c.name)+"\n"+exitStatuses)
}

// listFlag collects a repeatable, comma-separable flag.
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }

func (l *listFlag) Set(v string) error {
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			*l = append(*l, s)
		}
	}
	return nil
}
