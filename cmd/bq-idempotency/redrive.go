package main

import (
	"context"
	"database/sql"
	"flag"
	"fmt"
	"io"
	"net/url"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/marshal/amqpmarshal"
	"github.com/babelqueue/watermill-idempotency/pubsub/redislist"
	"github.com/babelqueue/watermill-idempotency/redrive"
)

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

func redriveCommand(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("redrive", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var conn connection
	conn.register(fs)
	var (
		from, to, broker, group string
		dryRun, bypass, quiet   bool
		max                     int
		rate                    float64
		minAge, maxAge, idle    time.Duration
		reasons, urns, ids      listFlag
	)
	fs.StringVar(&from, "from", "", "dead-letter topic to read (required), e.g. orders.dlq")
	fs.StringVar(&to, "to", "", "send every message to this topic instead of its original queue")
	fs.StringVar(&broker, "broker", "redis", "redis (Redis Streams) or postgres (watermill-sql)")
	fs.StringVar(&group, "group", "bq-redrive", "consumer group the redrive reads the dead-letter topic with")
	fs.BoolVar(&dryRun, "dry-run", false, "report what would move; move nothing")
	fs.BoolVar(&bypass, "replay-bypass", false, "stamp bq-replay-bypass: 1 (external effects are skipped)")
	fs.BoolVar(&quiet, "quiet", false, "no progress line")
	fs.IntVar(&max, "max", 0, "move at most this many messages (0: all)")
	fs.Float64Var(&rate, "rate", 0, "move at most this many messages per second (0: no limit)")
	fs.DurationVar(&minAge, "min-age", 0, "only messages dead-lettered at least this long ago")
	fs.DurationVar(&maxAge, "max-age", 0, "only messages dead-lettered at most this long ago")
	fs.DurationVar(&idle, "idle", 2*time.Second, "stop after the topic was idle this long")
	fs.Var(&reasons, "reason", "only these dead_letter reasons (failed, unknown_urn, poison); repeatable")
	fs.Var(&urns, "urn", "only these URNs (job); repeatable")
	fs.Var(&ids, "id", "only these meta.ids; repeatable")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if from == "" {
		return usageErr("--from is required")
	}
	if fs.NArg() > 0 {
		return usageErr("unexpected arguments %q", fs.Args())
	}
	if max < 0 || rate < 0 || minAge < 0 || maxAge < 0 || idle <= 0 {
		return usageErr("--max, --rate, --min-age and --max-age must not be negative, --idle must be positive")
	}

	sub, pub, closeAll, err := openBroker(ctx, broker, group, conn)
	if err != nil {
		return err
	}
	opts := []redrive.Option{redrive.WithIdleTimeout(idle)}
	if to != "" {
		opts = append(opts, redrive.WithTarget(to))
	}
	if dryRun {
		opts = append(opts, redrive.WithDryRun())
	}
	if bypass {
		opts = append(opts, redrive.WithReplayBypass())
	}
	if max > 0 {
		opts = append(opts, redrive.WithMax(max))
	}
	if rate > 0 {
		opts = append(opts, redrive.WithRate(rate))
	}
	if minAge > 0 {
		opts = append(opts, redrive.WithMinAge(minAge))
	}
	if maxAge > 0 {
		opts = append(opts, redrive.WithMaxAge(maxAge))
	}
	if len(reasons) > 0 {
		opts = append(opts, redrive.WithReasons(reasons...))
	}
	if len(urns) > 0 {
		opts = append(opts, redrive.WithURNs(urns...))
	}
	if len(ids) > 0 {
		opts = append(opts, redrive.WithIDs(ids...))
	}
	if !quiet {
		var seen, moved int
		last := time.Now()
		opts = append(opts, redrive.WithProgress(func(e redrive.Entry) {
			seen++
			if e.Moved {
				moved++
			}
			if time.Since(last) >= time.Second {
				fmt.Fprintf(stderr, "\rredrive: %d read, %d moved", seen, moved)
				last = time.Now()
			}
		}))
	}

	report, runErr := redrive.Run(ctx, sub, pub, from, opts...)
	time.Sleep(200 * time.Millisecond) // let the last ack reach the broker before closing
	closeAll()
	if !quiet {
		fmt.Fprint(stderr, "\r\033[K")
	}
	printReport(stdout, report, dryRun)
	if runErr != nil {
		return fmt.Errorf("stopped after %d moved: %w", report.Moved, runErr)
	}
	return nil
}

func printReport(w io.Writer, r redrive.Report, dryRun bool) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tURN\tREASON\tFROM\tTO\tRESULT")
	for _, e := range r.Entries {
		result := "moved"
		if !e.Moved {
			result = "kept: " + e.Note
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", dash(e.ID), dash(e.URN), dash(e.Reason), e.From, dash(e.To), result)
	}
	_ = tw.Flush()
	verb := "moved"
	if dryRun {
		verb = "moved (dry run)"
	}
	fmt.Fprintf(w, "\n%d read, %d %s, %d kept on the dead-letter topic\n", len(r.Entries), r.Moved, verb, r.PutBack)
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// openBroker returns a subscriber and publisher for the chosen broker, and a
// function closing them.
func openBroker(ctx context.Context, broker, group string, conn connection) (message.Subscriber, message.Publisher, func(), error) {
	logger := watermill.NopLogger{}
	switch broker {
	case "redis":
		opts, err := redis.ParseURL(conn.redisURL)
		if err != nil {
			return nil, nil, nil, usageErr("--redis-url: %v", err)
		}
		// redisstream closes its client on Close: one each.
		subClient, pubClient := redis.NewClient(opts), redis.NewClient(opts)
		if err := pubClient.Ping(ctx).Err(); err != nil {
			_ = subClient.Close()
			_ = pubClient.Close()
			return nil, nil, nil, fmt.Errorf("redis at %s: %w", conn.redisURL, err)
		}
		sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
			Client: subClient, ConsumerGroup: group, Consumer: "bq-idempotency", OldestId: "0",
			BlockTime: 200 * time.Millisecond, DisableIndefiniteInitialBlock: true,
			// Take what an earlier run left pending first; never take back
			// a message mid-run (see package redrive).
			MaxIdleTime: time.Millisecond, ClaimInterval: 24 * time.Hour,
		}, logger)
		if err != nil {
			return nil, nil, nil, err
		}
		pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: pubClient}, logger)
		if err != nil {
			return nil, nil, nil, err
		}
		return sub, pub, func() { _ = sub.Close(); _ = pub.Close() }, nil
	case "redis-list", "redis-laravel":
		// The BabelQueue SDKs' reliable list, or Laravel's RedisQueue layout.
		opts, err := redis.ParseURL(conn.redisURL)
		if err != nil {
			return nil, nil, nil, usageErr("--redis-url: %v", err)
		}
		client := redis.NewClient(opts)
		if err := client.Ping(ctx).Err(); err != nil {
			_ = client.Close()
			return nil, nil, nil, fmt.Errorf("redis: %w", err)
		}
		layout := redislist.LayoutReliableList
		if broker == "redis-laravel" {
			layout = redislist.LayoutLaravel
		}
		sub, _ := redislist.NewSubscriber(client, redislist.WithLayout(layout), redislist.WithBlockTime(200*time.Millisecond))
		pub, _ := redislist.NewPublisher(client, redislist.WithLayout(layout))
		return sub, pub, func() { _ = sub.Close(); _ = pub.Close(); _ = client.Close() }, nil
	case "postgres":
		db, err := sql.Open("pgx", conn.postgresDSN)
		if err != nil {
			return nil, nil, nil, usageErr("--postgres-dsn: %v", err)
		}
		if err := db.PingContext(ctx); err != nil {
			_ = db.Close()
			return nil, nil, nil, fmt.Errorf("postgres at %s: %w", conn.postgresDSN, err)
		}
		beginner := wsql.BeginnerFromStdSQL(db)
		sub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
			ConsumerGroup: group, PollInterval: 100 * time.Millisecond,
			SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
		}, logger)
		if err != nil {
			_ = db.Close()
			return nil, nil, nil, err
		}
		pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}}, logger)
		if err != nil {
			_ = db.Close()
			return nil, nil, nil, err
		}
		return sub, pub, func() { _ = sub.Close(); _ = pub.Close(); _ = db.Close() }, nil
	case "amqp":
		// RabbitMQ with the BabelQueue SDKs' topology and wire format: the
		// dead-letter topic is a durable queue, read with manual acks.
		url := envOr("AMQP_URL", "amqp://guest:guest@localhost:5672/")
		config := amqpmarshal.NewConfig(url)
		sub, err := wamqp.NewSubscriber(config, logger)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("rabbitmq at %s: %w", redactURL(url), err)
		}
		pub, err := amqpmarshal.NewPublisher(config, logger)
		if err != nil {
			_ = sub.Close()
			return nil, nil, nil, fmt.Errorf("rabbitmq at %s: %w", redactURL(url), err)
		}
		return sub, pub, func() { _ = sub.Close(); _ = pub.Close() }, nil
	}
	return nil, nil, nil, usageErr("--broker %q: want redis, redis-list, redis-laravel, postgres or amqp", broker)
}

// redactURL hides the password of a broker URL in messages.
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "<unparsable URL>"
	}
	return u.Redacted()
}
