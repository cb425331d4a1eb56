package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/babelqueue/watermill-idempotency/marshal/amqpmarshal"
	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/redrive"
)

// brokerNames is what --broker accepts (each a case of openBroker).
const brokerNames = "redis (Redis Streams), redis-list (the BabelQueue SDKs' Redis list),\n" +
	"redis-laravel (Laravel's Redis queue), postgres (watermill-sql on PostgreSQL)\n" +
	"amqp (RabbitMQ, the BabelQueue SDKs' layout; no --dry-run)\n" +
	"kafka (watermill-kafka with the BabelQueue Kafka binding)\n" +
	"or nats (NATS JetStream, watermill-nats: a stream per topic)"

// reasonList names every dead_letter.reason the dead-letter middleware
// writes, with its cause (BabelQueue SDKs write the first three).
const reasonList = `  failed           the handler failed after its retries
  unknown_urn      no handler for the message's URN
  poison           unreadable: not an envelope, an unsupported schema
                   version, an unusable or missing meta.id
  rejected         the handler rejected it for good (a permanent error)
  conflict         its meta.id was used for another message, or an
                   effect's request differs from the one recorded
  too_old          older than the replay horizon: check it did not run,
                   forget its id, then redrive it
  unknown_outcome  an external effect's outcome is unknown: settle it
                   (effects resolve) before redriving
Other producers may write reasons of their own; a dead letter written
with deadletter.CoarseReason carries only the first three.`

type redriveArgs struct {
	from, to, broker, group       string
	keyPrefix                     string
	dryRun, bypass, quiet, verbat bool
	verbose                       bool
	output                        *outputFormat
	max                           int
	rate                          float64
	minAge, maxAge, idle          time.Duration
	progressEvery                 time.Duration
	reasons, urns, ids            listFlag
}

func redriveFlags(fs *flag.FlagSet, conn *connection) func(context.Context, []string, streams) error {
	a := &redriveArgs{}
	conn.registerAMQP(fs)
	conn.registerKafka(fs)
	conn.registerNATS(fs)
	fs.StringVar(&a.from, "from", "", "the dead-letter `topic` to read (required), e.g. orders.dlq; one that does not\n"+
		"exist is an error, but for a Redis list an earlier run found: Redis deletes an\n"+
		"empty list, so that one has nothing to move (exit 0)")
	fs.StringVar(&a.broker, "broker", "redis", "the `broker`: "+brokerNames)
	fs.StringVar(&a.group, "group", "bq-redrive", "the consumer `group` the dead-letter topic is read with")
	fs.StringVar(&a.keyPrefix, "key-prefix", "", "redis-list and redis-laravel: the `prefix` before every Redis key of the queues,\nas a Laravel connection's prefix option (e.g. laravel_database_)")
	fs.BoolVar(&a.dryRun, "dry-run", false, "report what would move, and change nothing anywhere: the topic is read\nwithout consuming it (no publish, no ack, no group or offset created),\nfrom where --group's next run would start (all of it for a new group)")
	fs.StringVar(&a.to, "to", "", "send every moved message to `topic` instead of its original queue")
	fs.Var(&a.reasons, "reason", "only messages dead-lettered for this `reason`; repeatable. The reasons:\n"+reasonList)
	fs.Var(&a.urns, "urn", "only messages of this job `URN`; repeatable")
	fs.Var(&a.ids, "id", "only the message with this meta.`id`; repeatable")
	fs.DurationVar(&a.minAge, "min-age", 0, "only messages dead-lettered at least `duration` ago (e.g. 1h); a message of\nunknown age (no dead_letter.failed_at) stays")
	fs.DurationVar(&a.maxAge, "max-age", 0, "only messages dead-lettered at most `duration` ago; a message of unknown age stays")
	fs.IntVar(&a.max, "max", 0, "move at most `n` messages (0: all)")
	fs.Float64Var(&a.rate, "rate", 0, "move at most `r` messages a second (0: no limit)")
	fs.BoolVar(&a.verbat, "move-verbatim", false, "also move bodies that are not envelopes (dead-lettered verbatim), unchanged,\nto the original topic the dead-letter middleware recorded (or --to);\nwithout it they stay on the dead-letter topic")
	fs.BoolVar(&a.bypass, "replay-bypass", false, "stamp bq-replay-bypass: 1 on moved messages: the handler runs again\n(after forget) but its external effects wrapped in BypassExternalEffects do not")
	fs.DurationVar(&a.idle, "idle", 2*time.Second, "stop when the run waited `duration` for a message\n(the wait --rate imposes does not count)")
	fs.BoolVar(&a.quiet, "quiet", false, "no progress reports on standard error")
	fs.DurationVar(&a.progressEvery, "progress-every", 5*time.Second, "when standard error is no terminal, write a status line every `duration`\n"+
		"(read of total, moved, kept, rate, time left); on a terminal a bar is redrawn instead")
	fs.BoolVar(&a.verbose, "verbose", false, "also report each message read: a table row (ID, URN, REASON, FROM, TO, RESULT),\n"+
		"or with --output json the messages array; without it only the summary")
	a.output = registerOutput(fs)
	return func(ctx context.Context, rest []string, s streams) error { return a.run(ctx, rest, s, conn) }
}

func (a *redriveArgs) validate(rest []string) error {
	switch {
	case a.from == "":
		return usageErr("--from is required")
	case len(rest) > 0:
		return usageErr("unexpected arguments %q", rest)
	case a.max < 0:
		return usageErr("--max %d: must not be negative", a.max)
	case math.IsNaN(a.rate) || math.IsInf(a.rate, 0) || a.rate < 0:
		return usageErr("--rate %v: want a number of messages a second, 0 or more", a.rate)
	case a.minAge < 0 || a.maxAge < 0:
		return usageErr("--min-age and --max-age must not be negative")
	case a.minAge > 0 && a.maxAge > 0 && a.minAge > a.maxAge:
		return usageErr("--min-age %v is over --max-age %v: nothing would match", a.minAge, a.maxAge)
	case a.idle <= 0:
		return usageErr("--idle %v: must be positive", a.idle)
	case a.progressEvery <= 0:
		return usageErr("--progress-every %v: must be positive", a.progressEvery)
	case a.keyPrefix != "" && a.broker != "redis-list" && a.broker != "redis-laravel":
		return usageErr("--key-prefix: only with --broker redis-list or redis-laravel")
	}
	return nil
}

func (a *redriveArgs) options() []redrive.Option {
	opts := []redrive.Option{redrive.WithIdleTimeout(a.idle)}
	if a.to != "" {
		opts = append(opts, redrive.WithTarget(a.to))
	}
	if a.bypass {
		opts = append(opts, redrive.WithReplayBypass())
	}
	if a.verbat {
		opts = append(opts, redrive.WithVerbatim())
	}
	if a.max > 0 {
		opts = append(opts, redrive.WithMax(a.max))
	}
	if a.rate > 0 {
		opts = append(opts, redrive.WithRate(a.rate))
	}
	if a.minAge > 0 {
		opts = append(opts, redrive.WithMinAge(a.minAge))
	}
	if a.maxAge > 0 {
		opts = append(opts, redrive.WithMaxAge(a.maxAge))
	}
	if len(a.reasons) > 0 {
		opts = append(opts, redrive.WithReasons(a.reasons...))
	}
	if len(a.urns) > 0 {
		opts = append(opts, redrive.WithURNs(a.urns...))
	}
	if len(a.ids) > 0 {
		opts = append(opts, redrive.WithIDs(a.ids...))
	}
	return opts
}

func (a *redriveArgs) run(ctx context.Context, rest []string, s streams, conn *connection) error {
	if err := a.validate(rest); err != nil {
		return err
	}
	b, err := openBroker(ctx, a.broker, brokerConfig{conn: conn, group: a.group, dryRun: a.dryRun, keyPrefix: a.keyPrefix})
	if err != nil {
		return err
	}
	defer b.close()

	emptied, err := b.checkSource(ctx, a.from)
	if err != nil {
		return err
	}
	if !a.dryRun {
		if b.lock != nil {
			locked, err := b.lock(ctx, a.from)
			if err != nil {
				return fmt.Errorf("--from %s: %w; nothing was moved", a.from, err)
			}
			ctx = locked
		}
		if b.markSeen != nil && !emptied {
			if err := b.markSeen(ctx, a.from); err != nil {
				return fmt.Errorf("--from %s: %w", a.from, err)
			}
		}
	}
	opts := a.options()
	var p *progress
	if !a.quiet {
		total := int64(-1) // unknown
		if b.count != nil && !emptied {
			if n, err := b.count(ctx, a.from); err == nil {
				total = n
			}
		}
		w := s.stderr
		if s.stderrTerminal && s.stderrFile != nil {
			w = s.stderrFile // counts alone: nothing to redact, and the bar fits the terminal
		}
		p = newProgress(w, s.stderrTerminal, a.dryRun, total, a.progressEvery)
		opts = append(opts, redrive.WithProgress(p.add))
	}
	var report redrive.Report
	var runErr error
	if a.dryRun {
		if b.browser == nil {
			return usageErr("--dry-run: --broker %s cannot be read without consuming it", a.broker)
		}
		report = redrive.Report{DryRun: true}
		if !emptied {
			report, runErr = redrive.Preview(ctx, b.browser, a.from, opts...)
		}
	} else {
		report, runErr = redrive.Run(ctx, b.sub, b.pub, a.from, append(opts, b.runOpts...)...)
		time.Sleep(200 * time.Millisecond) // let the last ack reach the broker before closing
		if runErr == nil {
			// A run ends when no message came for --idle: so it does too
			// when the broker went down. Ask the broker: an outage is an
			// error, not an idle topic.
			if _, err := b.checkSource(ctx, a.from); err != nil {
				runErr = fmt.Errorf("the dead-letter topic cannot be read after the run: %w", err)
			}
		}
	}
	if p != nil {
		p.done(runErr == nil && (a.max == 0 || report.Moved < a.max))
	}
	if runErr != nil {
		verb := "moved"
		if a.dryRun {
			verb = "read"
		}
		runErr = fmt.Errorf("stopped after %d %s: %w", report.Moved, verb, runErr)
	}
	notMoved := countNotMoved(report)
	if *a.output == outputJSON {
		if err := writeJSON(s.stdout, newRedriveJSON(a, report, notMoved, emptied, runErr)); err != nil {
			return err
		}
	} else {
		printReport(s.stdout, report, a.verbose, notMoved)
		if emptied && len(report.Entries) == 0 {
			fmt.Fprintln(s.stdout, "nothing to move: the dead-letter list is empty (Redis deleted it when it emptied; an earlier redrive run saw it)")
		}
	}
	switch {
	case runErr != nil:
		return runErr
	case notMoved > 0:
		return errIncomplete
	}
	return nil
}

// countNotMoved counts the messages the run selected and could not move
// (exit status 3): a broker refused them, they have no queue to go to, or
// they failed again after the run sent them back.
// Those the filters left (not selected, unknown age, a body that is not an
// envelope without --move-verbatim) are not counted.
func countNotMoved(r redrive.Report) int {
	n := 0
	for _, e := range r.Entries {
		if e.Selected && !e.Moved {
			n++
		}
	}
	return n
}

// redriveJSON is redrive's --output json document.
type redriveJSON struct {
	From       string        `json:"from"`
	DryRun     bool          `json:"dry_run"`
	Read       int           `json:"read"`
	Moved      int           `json:"moved"`
	WouldMove  int           `json:"would_move"`
	Kept       int           `json:"kept"`
	NotMoved   int           `json:"not_moved"`
	Skipped    int           `json:"skipped"`
	UnknownAge int           `json:"unknown_age"`
	Emptied    bool          `json:"emptied"`
	Error      string        `json:"error,omitempty"`
	Messages   []messageJSON `json:"messages,omitempty"`
}

// messageJSON is one message of redrive's --output json --verbose.
type messageJSON struct {
	ID     string `json:"id"`
	URN    string `json:"urn"`
	Reason string `json:"reason"`
	From   string `json:"from"`
	To     string `json:"to"`
	Moved  bool   `json:"moved"`
	// WouldMove is true, in a dry run, for a message the run would move
	// (Moved is then false: a dry run moves nothing).
	WouldMove bool   `json:"would_move"`
	Note      string `json:"note,omitempty"`
}

func newRedriveJSON(a *redriveArgs, r redrive.Report, notMoved int, emptied bool, runErr error) redriveJSON {
	dry := r.DryRun || a.dryRun
	out := redriveJSON{From: a.from, DryRun: dry, Read: len(r.Entries), Kept: r.PutBack,
		NotMoved: notMoved, Skipped: r.Skipped, UnknownAge: r.UnknownAge, Emptied: emptied && len(r.Entries) == 0}
	// The report counts what a dry run would move as moved.
	if dry {
		out.WouldMove = r.Moved
	} else {
		out.Moved = r.Moved
	}
	if runErr != nil {
		out.Error = runErr.Error()
	}
	if a.verbose {
		out.Messages = make([]messageJSON, 0, len(r.Entries))
		for _, e := range r.Entries {
			out.Messages = append(out.Messages, messageJSON{ID: e.ID, URN: e.URN, Reason: e.Reason, From: e.From, To: e.To,
				Moved: e.Moved && !dry, WouldMove: e.Moved && dry, Note: e.Note})
		}
	}
	return out
}

// printReport writes the summary of a run, after the table of every
// message read when verbose.
func printReport(w io.Writer, r redrive.Report, verbose bool, notMoved int) {
	moved, kept, summary := "moved", "kept: ", "%d read, %d moved, %d kept on the dead-letter topic"
	if r.DryRun {
		moved, kept, summary = "would move", "would stay: ", "%d read, %d would move, %d would stay on the dead-letter topic"
	}
	if verbose {
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tURN\tREASON\tFROM\tTO\tRESULT")
		for _, e := range r.Entries {
			result := moved
			if !e.Moved {
				result = kept + e.Note
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", dash(e.ID), dash(e.URN), dash(e.Reason), e.From, dash(e.To), result)
		}
		_ = tw.Flush()
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, summary+"\n", len(r.Entries), r.Moved, r.PutBack)
	if notMoved > 0 {
		fmt.Fprintf(w, "%d selected but not moved: they have no queue to go to, the broker refused them, or they failed again after this run sent them back (exit status 3)\n", notMoved)
	}
	if r.Skipped > 0 {
		fmt.Fprintf(w, "%d skipped: the broker refused them for good (see RESULT); they stay on the dead-letter topic\n", r.Skipped)
	}
	if r.UnknownAge > 0 {
		fmt.Fprintf(w, "%d left for an unknown age (no dead_letter.failed_at): an age filter never matches them\n", r.UnknownAge)
	}
	if r.DryRun {
		fmt.Fprintln(w, "dry run: nothing was moved, acked or written")
	}
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// brokerConfig is what openBroker needs to know.
type brokerConfig struct {
	conn      *connection
	group     string
	dryRun    bool   // only the browser is needed
	keyPrefix string // redis-list, redis-laravel
}

// broker is one broker's connection for redrive.
type broker struct {
	sub message.Subscriber // nil in a dry run
	pub message.Publisher  // nil in a dry run
	// browser reads a topic without consuming it: the dry run, and the
	// check that the source exists. nil when the broker cannot do that
	// (then there is no dry run, and exists checks the source).
	browser redrive.Browser
	// exists returns redrive.ErrTopicNotFound when topic does not exist,
	// without creating it; for a broker without a browser.
	exists func(ctx context.Context, topic string) error
	// seen and markSeen tell a topic the broker deletes once it is empty
	// (a Redis list) from one that never existed: markSeen leaves a
	// marker when a run finds the topic, seen finds it. nil for brokers
	// whose topics outlive their last message.
	seen     func(ctx context.Context, topic string) (bool, error)
	markSeen func(ctx context.Context, topic string) error
	// lock takes the run lock of the topic (Redis Streams) until close,
	// which releases it once the subscriber is closed: the returned
	// context ends if the lock is lost. nil when concurrent runs cannot
	// take each other's messages.
	lock  func(ctx context.Context, topic string) (context.Context, error)
	close func() // closes all of the above
	// runOpts are the broker's own redrive options.
	runOpts []redrive.Option
	// count returns how many messages the topic holds for the run (for
	// the progress reports' total); nil when the broker cannot tell.
	count func(ctx context.Context, topic string) (int64, error)
}

// checkSource returns an error when the dead-letter topic does not exist
// (nothing gets created), and emptied when it does not exist but a marker
// says an earlier run found it: a Redis list Redis deleted once empty.
func (b *broker) checkSource(ctx context.Context, from string) (emptied bool, err error) {
	switch {
	case b.browser != nil:
		err = b.browser.Browse(ctx, from, func(*message.Message) bool { return false })
	case b.exists != nil:
		err = b.exists(ctx, from)
	}
	if errors.Is(err, redrive.ErrTopicNotFound) {
		if b.seen == nil {
			return false, fmt.Errorf("--from %s: the dead-letter topic does not exist (%w)", from, err)
		}
		seen, serr := b.seen(ctx, from)
		if serr != nil {
			return false, fmt.Errorf("--from %s: %w", from, serr)
		}
		if !seen {
			return false, fmt.Errorf("--from %s: the dead-letter topic does not exist (%w); Redis deletes an empty list, "+
				"so a list no redrive run has found yet looks the same as a misspelled one", from, err)
		}
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("--from %s: %w", from, err)
	}
	return false, nil
}

// openBroker connects to the --broker named. Each broker is one case: add a
// broker by adding a case, naming it in brokerNames and in the error below.
func openBroker(ctx context.Context, name string, cfg brokerConfig) (*broker, error) {
	switch name {
	case "redis":
		return openRedisStreams(ctx, cfg)
	case "postgres":
		return openPostgresTopics(ctx, cfg)
	case "redis-list":
		return openRedisList(ctx, cfg, redislist.LayoutReliableList)
	case "redis-laravel":
		return openRedisList(ctx, cfg, redislist.LayoutLaravel)
	case "amqp":
		return openAMQP(cfg)
	case "kafka":
		return openKafka(cfg)
	case "nats":
		return openNATS(cfg)
	}
	return nil, usageErr("--broker %q: want redis, redis-list, redis-laravel, postgres, amqp, kafka or nats", name)
}

func openRedisStreams(ctx context.Context, cfg brokerConfig) (*broker, error) {
	logger := watermill.NopLogger{}
	admin, err := cfg.conn.openRedis(ctx)
	if err != nil {
		return nil, err
	}
	b := &broker{browser: redrive.RedisStreamBrowser(admin, cfg.group), close: func() { _ = admin.Close() }}
	// The run reads what the group has pending, then what it has not been
	// delivered (its lag); without the group, the whole stream.
	b.count = func(ctx context.Context, topic string) (int64, error) {
		groups, err := admin.XInfoGroups(ctx, topic).Result()
		if err != nil {
			return 0, err
		}
		for _, g := range groups {
			if g.Name == cfg.group {
				if g.Lag < 0 { // Redis cannot tell (entries were deleted): read it
					return browseCount(ctx, b.browser, topic)
				}
				return g.Pending + g.Lag, nil
			}
		}
		return admin.XLen(ctx, topic).Result()
	}
	if cfg.dryRun {
		return b, nil
	}
	// redisstream closes its client on Close: one each.
	subClient, err := cfg.conn.openRedis(ctx)
	if err != nil {
		b.close()
		return nil, err
	}
	pubClient, err := cfg.conn.openRedis(ctx)
	if err != nil {
		_ = subClient.Close()
		b.close()
		return nil, err
	}
	sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client: subClient, ConsumerGroup: cfg.group, Consumer: "bq-idempotency", OldestId: "0",
		BlockTime: 200 * time.Millisecond, DisableIndefiniteInitialBlock: true,
		// Take what an earlier run left pending first; never take back
		// a message mid-run (see package redrive).
		MaxIdleTime: time.Millisecond, ClaimInterval: 24 * time.Hour,
	}, logger)
	if err != nil {
		_, _ = subClient.Close(), pubClient.Close()
		b.close()
		return nil, err
	}
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: pubClient}, logger)
	if err != nil {
		_, _ = sub.Close(), pubClient.Close()
		b.close()
		return nil, err
	}
	// One run at a time per stream and group: a second run claiming what
	// the group has pending would take what the first is moving.
	release := func() {}
	b.lock = func(ctx context.Context, topic string) (context.Context, error) {
		locked, unlock, err := redrive.LockRedisStream(ctx, admin, topic, cfg.group, redriveLockLease)
		if err == nil {
			release = unlock
		}
		return locked, err
	}
	b.sub, b.pub, b.close = sub, pub, func() { _ = sub.Close(); _ = pub.Close(); release(); _ = admin.Close() }
	return b, nil
}

// redriveLockLease is how long the run lock of a Redis stream outlives a
// run that stopped renewing it (it died): a later run waits at most that.
const redriveLockLease = 10 * time.Second

func openPostgresTopics(ctx context.Context, cfg brokerConfig) (*broker, error) {
	logger := watermill.NopLogger{}
	db, err := cfg.conn.openPostgres(ctx)
	if err != nil {
		return nil, err
	}
	b := &broker{browser: redrive.PostgresBrowser(db, cfg.group), close: func() { _ = db.Close() }}
	b.count = func(ctx context.Context, topic string) (int64, error) { return browseCount(ctx, b.browser, topic) }
	if cfg.dryRun {
		return b, nil
	}
	beginner := wsql.BeginnerFromStdSQL(db)
	// The subscriber creates the group's offsets table when it subscribes,
	// after the source was found to exist.
	sub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
		ConsumerGroup: cfg.group, PollInterval: 100 * time.Millisecond,
		SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
	}, logger)
	if err != nil {
		b.close()
		return nil, err
	}
	pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}}, logger)
	if err != nil {
		_ = sub.Close()
		b.close()
		return nil, err
	}
	b.sub, b.pub, b.close = sub, pub, func() { _ = sub.Close(); _ = pub.Close(); _ = db.Close() }
	// A dead letter whose queue is no watermill-sql topic name stays.
	b.runOpts = []redrive.Option{redrive.WithSkipErrors(wsql.ErrInvalidTopicName)}
	return b, nil
}

// openRedisList opens the BabelQueue SDKs' Redis list, or Laravel's Redis
// queue: a dead-letter topic is a list, read by reserving and acknowledging
// each value, and browsed with LRANGE for a dry run.
func openRedisList(ctx context.Context, cfg brokerConfig, layout redislist.Layout) (*broker, error) {
	client, err := cfg.conn.openRedis(ctx)
	if err != nil {
		return nil, err
	}
	opts := []redislist.Option{redislist.WithLayout(layout), redislist.WithKeyPrefix(cfg.keyPrefix)}
	sub, err := redislist.NewSubscriber(client, append(opts, redislist.WithBlockTime(200*time.Millisecond))...)
	if err != nil {
		_ = client.Close()
		return nil, err
	}
	// Redis deletes an empty list: a marker tells one a run found from
	// one never written.
	marker := func(topic string) string { return cfg.keyPrefix + "bq-redrive:seen:" + layout.String() + ":" + topic }
	b := &broker{
		browser: sub, close: func() { _ = sub.Close(); _ = client.Close() },
		seen: func(ctx context.Context, topic string) (bool, error) {
			n, err := client.Exists(ctx, marker(topic)).Result()
			return n > 0, err
		},
		markSeen: func(ctx context.Context, topic string) error {
			return client.Set(ctx, marker(topic), time.Now().UTC().Format(time.RFC3339), 0).Err()
		},
		count: sub.Len,
	}
	if cfg.dryRun {
		return b, nil
	}
	pub, err := redislist.NewPublisher(client, opts...)
	if err != nil {
		b.close()
		return nil, err
	}
	b.sub, b.pub, b.close = sub, pub, func() { _ = sub.Close(); _ = pub.Close(); _ = client.Close() }
	b.runOpts = []redrive.Option{
		// A list value with headers is written as a frame: put-backs stay bare.
		redrive.WithoutPutBackMark(),
	}
	return b, nil
}

// openAMQP opens RabbitMQ with the BabelQueue SDKs' topology and wire
// format: the dead-letter topic is a durable queue, read with manual acks.
// RabbitMQ cannot show a queue's messages without taking them, so there is
// no dry run.
func openAMQP(cfg brokerConfig) (*broker, error) {
	if cfg.dryRun {
		return nil, usageErr("--dry-run: RabbitMQ cannot read a queue without taking its messages; there is no dry run with --broker amqp")
	}
	logger := watermill.NopLogger{}
	url := cfg.conn.amqp()
	config := amqpmarshal.NewConfig(url)
	sub, err := wamqp.NewSubscriber(config, logger)
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: %w", err)
	}
	pub, err := amqpmarshal.NewPublisher(config, logger)
	if err != nil {
		_ = sub.Close()
		return nil, fmt.Errorf("rabbitmq: %w", err)
	}
	return &broker{
		sub: sub, pub: pub, close: func() { _ = sub.Close(); _ = pub.Close() },
		exists: func(ctx context.Context, queue string) error {
			_, err := amqpQueueDepth(ctx, url, queue)
			return err
		},
		count: func(ctx context.Context, queue string) (int64, error) { return amqpQueueDepth(ctx, url, queue) },
	}, nil
}

// amqpQueueDepth returns the number of messages ready on a queue, from a
// passive declaration, which creates nothing (the subscriber would declare
// the queue it is given); an error matching redrive.ErrTopicNotFound when
// there is no such queue.
func amqpQueueDepth(ctx context.Context, url, queue string) (int64, error) {
	conn, err := amqp.DialConfig(url, amqp.Config{Dial: func(network, addr string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, network, addr)
	}})
	if err != nil {
		return 0, fmt.Errorf("rabbitmq: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return 0, fmt.Errorf("rabbitmq: %w", err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	var amqpErr *amqp.Error
	if errors.As(err, &amqpErr) && amqpErr.Code == amqp.NotFound {
		return 0, fmt.Errorf("%w: no RabbitMQ queue %q", redrive.ErrTopicNotFound, queue)
	}
	if err != nil {
		return 0, fmt.Errorf("rabbitmq: %w", err)
	}
	return int64(q.Messages), nil
}

// browseCount counts the messages a Browser sees on topic: what a run of
// its group would read.
func browseCount(ctx context.Context, b redrive.Browser, topic string) (int64, error) {
	var n int64
	err := b.Browse(ctx, topic, func(*message.Message) bool { n++; return true })
	return n, err
}
