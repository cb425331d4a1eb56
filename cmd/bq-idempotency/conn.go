package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/go-sql-driver/mysql" // also the "mysql" database/sql driver (MariaDB)
	"github.com/jackc/pgx/v5"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
	"github.com/redis/go-redis/v9"
)

const (
	defaultRedisURL    = "redis://localhost:6379/0"
	defaultPostgresDSN = "postgres://postgres@localhost:5432/test?sslmode=disable"
	defaultAMQPURL     = "amqp://guest:guest@localhost:5672/"
	defaultMariaDBDSN  = "root@tcp(localhost:3306)/test"
	defaultKafka       = "localhost:9092"
	defaultNATSURL     = "nats://localhost:4222"
)

// connection holds the flags every command shares.
type connection struct {
	redisURLs   urlList
	postgresDSN string
	mariaDBDSN  string
	amqpURL     string
	kafkaAddrs  string
	natsURL     string
	redactor    *redactor
}

// urlList is a repeatable flag.
type urlList []string

func (l *urlList) String() string     { return strings.Join(*l, " ") }
func (l *urlList) Set(v string) error { *l = append(*l, v); return nil }

func (c *connection) register(fs *flag.FlagSet) {
	fs.Var(&c.redisURLs, "redis-url", "Redis `URL` (default $REDIS_URL, else "+defaultRedisURL+").\n"+
		"Repeat it, or add addr=HOST:PORT query parameters, for a Redis Cluster;\n"+
		"a single URL of a cluster node is recognised as a Cluster too.\n"+
		"A master_name=NAME query parameter makes its addresses Sentinels of master NAME.")
	fs.StringVar(&c.postgresDSN, "postgres-dsn", "", "PostgreSQL `DSN`, URL or key=value form\n(default $POSTGRES_DSN, else "+defaultPostgresDSN+")")
}

// registerAMQP adds --amqp-url, for the commands that can use RabbitMQ.
func (c *connection) registerAMQP(fs *flag.FlagSet) {
	fs.StringVar(&c.amqpURL, "amqp-url", "", "RabbitMQ `URL`, for --broker amqp\n(default $AMQP_URL, else RabbitMQ on localhost:5672 with its stock user)")
}

// registerKafka adds --kafka-brokers, for the commands that can use Kafka.
func (c *connection) registerKafka(fs *flag.FlagSet) {
	fs.StringVar(&c.kafkaAddrs, "kafka-brokers", "", "Kafka bootstrap `addresses`, host:port separated by commas, for --broker kafka\n(default $KAFKA_BROKERS, else "+defaultKafka+")")
}

// kafka returns the Kafka bootstrap addresses to use.
func (c *connection) kafka() []string {
	v := c.kafkaAddrs
	if v == "" {
		v = envOr("KAFKA_BROKERS", defaultKafka)
	}
	var addrs []string
	for _, a := range strings.Split(v, ",") {
		if a = strings.TrimSpace(a); a != "" {
			addrs = append(addrs, a)
		}
	}
	return addrs
}

// registerNATS adds --nats-url, for the commands that can use NATS.
func (c *connection) registerNATS(fs *flag.FlagSet) {
	fs.StringVar(&c.natsURL, "nats-url", "", "NATS `URL`, for --broker nats\n(default $NATS_URL, else "+defaultNATSURL+")")
}

// nats returns the NATS URL to use, its secrets registered.
func (c *connection) nats() string {
	u := c.natsURL
	if u == "" {
		u = envOr("NATS_URL", defaultNATSURL)
	}
	c.redactor.add(u)
	return u
}

// registerMariaDB adds --mysql-dsn, for the commands that can use MariaDB.
func (c *connection) registerMariaDB(fs *flag.FlagSet) {
	fs.StringVar(&c.mariaDBDSN, "mysql-dsn", "", "MariaDB `DSN`, go-sql-driver/mysql form, for --store php-pdo --dialect mysql\n(default $MARIADB_DSN, else "+defaultMariaDBDSN+")")
}

// mariaDB returns the MariaDB DSN to use, its password registered.
func (c *connection) mariaDB() string {
	dsn := c.mariaDBDSN
	if dsn == "" {
		dsn = envOr("MARIADB_DSN", defaultMariaDBDSN)
	}
	c.redactor.addMySQL(dsn)
	return dsn
}

// amqp returns the RabbitMQ URL to use, its password registered.
func (c *connection) amqp() string {
	u := c.amqpURL
	if u == "" {
		u = envOr("AMQP_URL", defaultAMQPURL)
	}
	if u != defaultAMQPURL { // the well-known default is no secret
		c.redactor.add(u)
	}
	return u
}

// urls returns the Redis URLs to use, each one's secrets registered.
func (c *connection) urls() []string {
	urls := []string(c.redisURLs)
	if len(urls) == 0 {
		urls = []string{envOr("REDIS_URL", defaultRedisURL)}
	}
	for _, u := range urls {
		c.redactor.add(u)
	}
	return urls
}

// addSecrets registers the passwords of every connection the flags and
// the environment name, before anything is printed.
func (c *connection) addSecrets() {
	c.urls()
	c.dsn()
	c.mariaDB()
	c.amqp()
	c.nats()
}

func (c *connection) dsn() string {
	dsn := c.postgresDSN
	if dsn == "" {
		dsn = envOr("POSTGRES_DSN", defaultPostgresDSN)
	}
	c.redactor.add(dsn)
	return dsn
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// openRedis connects to the Redis the flags name: a single server, a
// Cluster (several URLs, addr= parameters, or a single node that reports
// cluster mode), or a master behind Sentinels (master_name=).
func (c *connection) openRedis(ctx context.Context) (redis.UniversalClient, error) {
	urls := c.urls()
	first := urls[0]
	u, err := url.Parse(first)
	if err != nil {
		return nil, usageErr("--redis-url %s: %v", first, err)
	}
	q := u.Query()
	if len(urls) > 1 {
		for _, other := range urls[1:] {
			o, err := url.Parse(other)
			if err != nil || o.Host == "" {
				return nil, usageErr("--redis-url %s: not a redis:// URL", other)
			}
			q.Add("addr", o.Host)
		}
		u.RawQuery = q.Encode()
	}
	var client redis.UniversalClient
	switch {
	case q.Get("master_name") != "":
		opts, err := redis.ParseFailoverURL(u.String())
		if err != nil {
			return nil, usageErr("--redis-url: %v", err)
		}
		client = redis.NewFailoverClient(opts)
	case q.Has("addr"):
		opts, err := redis.ParseClusterURL(u.String())
		if err != nil {
			return nil, usageErr("--redis-url: %v", err)
		}
		client = redis.NewClusterClient(opts)
	default:
		opts, err := redis.ParseURL(first)
		if err != nil {
			return nil, usageErr("--redis-url: %v", err)
		}
		single := redis.NewClient(opts)
		info, err := single.Info(ctx, "cluster").Result()
		var reply redis.Error
		switch {
		case errors.As(err, &reply):
			// INFO refused (a managed Redis may rename it): not a cluster
			// the command can recognise; go on with the single server if
			// it answers.
			if err := single.Ping(ctx).Err(); err != nil {
				_ = single.Close()
				return nil, fmt.Errorf("redis at %s: %w", first, err)
			}
			info = ""
		case err != nil:
			_ = single.Close()
			return nil, fmt.Errorf("redis at %s: %w", first, err)
		}
		if !strings.Contains(info, "cluster_enabled:1") {
			return single, nil
		}
		_ = single.Close()
		copts, err := redis.ParseClusterURL(clusterURL(u))
		if err != nil {
			return nil, usageErr("--redis-url: %v", err)
		}
		client = redis.NewClusterClient(copts)
	}
	if err := client.Ping(ctx).Err(); err != nil {
		_ = client.Close()
		return nil, fmt.Errorf("redis at %s: %w", strings.Join(urls, " "), err)
	}
	return client, nil
}

// clusterURL drops the database number a cluster does not have.
func clusterURL(u *url.URL) string {
	c := *u
	if c.Path == "/0" || c.Path == "/" {
		c.Path = ""
	}
	return c.String()
}

// openPostgres connects to the PostgreSQL the flags name.
func (c *connection) openPostgres(ctx context.Context) (*sql.DB, error) {
	dsn := c.dsn()
	if _, err := pgx.ParseConfig(dsn); err != nil {
		return nil, usageErr("--postgres-dsn: %v", err)
	}
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return nil, usageErr("--postgres-dsn: %v", err)
	}
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("postgres at %s: %w", dsn, err)
	}
	return db, nil
}

// openMariaDB connects to the MariaDB the flags name.
func (c *connection) openMariaDB(ctx context.Context) (*sql.DB, error) {
	dsn := c.mariaDB()
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, usageErr("--mysql-dsn: %v", err)
	}
	connector, err := mysql.NewConnector(cfg)
	if err != nil {
		return nil, usageErr("--mysql-dsn: %v", err)
	}
	db := sql.OpenDB(connector)
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("mariadb at %s: %w", dsn, err)
	}
	return db, nil
}

// redactor replaces the passwords of the connection strings the command
// uses with "xxxxx" in everything it writes.
type redactor struct {
	mu       sync.Mutex
	secrets  []string
	replacer *strings.Replacer
}

func newRedactor() *redactor { return &redactor{replacer: strings.NewReplacer()} }

// keyValuePassword finds password=... in a key=value DSN.
var keyValuePassword = regexp.MustCompile(`(?i)\bpassword\s*=\s*('(?:[^'\\]|\\.)*'|[^\s]+)`)

// add registers the secrets of a connection URL or DSN.
func (r *redactor) add(conn string) {
	var found []string
	if u, err := url.Parse(conn); err == nil {
		if p, ok := u.User.Password(); ok {
			found = append(found, p, url.QueryEscape(p), url.PathEscape(p))
			if raw := u.User.String(); strings.Contains(raw, ":") {
				found = append(found, raw[strings.Index(raw, ":")+1:])
			}
		}
		for k, vs := range u.Query() {
			if strings.Contains(strings.ToLower(k), "password") {
				found = append(found, vs...)
			}
		}
	}
	// The password as written, read by hand: a URL the parser rejects (a
	// '%' the user did not encode) is quoted whole in error messages.
	if i := strings.Index(conn, "://"); i >= 0 {
		rest := conn[i+3:]
		if at := strings.LastIndex(rest, "@"); at >= 0 {
			if colon := strings.Index(rest[:at], ":"); colon >= 0 {
				p := rest[colon+1 : at]
				found = append(found, p, strings.Trim(strconv.Quote(p), `"`))
			}
		}
	}
	for _, m := range keyValuePassword.FindAllStringSubmatch(conn, -1) {
		v := m[1]
		found = append(found, v)
		if strings.HasPrefix(v, "'") && strings.HasSuffix(v, "'") && len(v) >= 2 {
			found = append(found, strings.ReplaceAll(v[1:len(v)-1], `\'`, `'`))
		}
	}
	r.addSecrets(found)
}

// addSecrets registers secrets, each replaced by "xxxxx" in what the
// command writes.
func (r *redactor) addSecrets(found []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range found {
		if s != "" && !slices.Contains(r.secrets, s) {
			r.secrets = append(r.secrets, s)
		}
	}
	// Longest first, so that a secret containing another is replaced whole.
	sorted := slices.Clone(r.secrets)
	sort.SliceStable(sorted, func(i, j int) bool { return len(sorted[i]) > len(sorted[j]) })
	pairs := make([]string, 0, 2*len(sorted))
	for _, s := range sorted {
		pairs = append(pairs, s, "xxxxx")
	}
	r.replacer = strings.NewReplacer(pairs...)
}

// addMySQL registers the password of a go-sql-driver/mysql DSN
// (user:password@net(addr)/db?params), which is no URL: the driver reads
// the password between the first ':' and the last '@' before the last '/',
// and so does this, whether or not the DSN parses.
func (r *redactor) addMySQL(dsn string) {
	var found []string
	if cfg, err := mysql.ParseDSN(dsn); err == nil && cfg.Passwd != "" {
		found = append(found, cfg.Passwd)
	}
	head := dsn
	if i := strings.LastIndex(head, "/"); i >= 0 {
		head = head[:i]
	}
	if at := strings.LastIndex(head, "@"); at >= 0 {
		if colon := strings.Index(head[:at], ":"); colon >= 0 {
			found = append(found, head[colon+1:at])
		}
	}
	r.addSecrets(found)
}

func (r *redactor) redact(s string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.replacer.Replace(s)
}

// writer returns w with every write redacted. The command writes whole
// lines (or progress updates) at a time, so a secret is never split.
func (r *redactor) writer(w io.Writer) io.Writer { return redactingWriter{r: r, w: w} }

type redactingWriter struct {
	r *redactor
	w io.Writer
}

func (rw redactingWriter) Write(p []byte) (int, error) {
	if _, err := io.WriteString(rw.w, rw.r.redact(string(p))); err != nil {
		return 0, err
	}
	return len(p), nil
}
