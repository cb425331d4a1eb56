package redislist

import (
	"errors"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/redis/go-redis/v9"
)

// Layout selects the Redis keys and scripts a Publisher or Subscriber uses.
type Layout int

const (
	// LayoutReliableList is the BabelQueue SDK runtimes' layout: <queue>
	// and <queue>:processing.
	LayoutReliableList Layout = iota
	// LayoutLaravel is Laravel's RedisQueue layout: queues:<name> with its
	// :reserved, :delayed and :notify keys.
	LayoutLaravel
)

// String returns the layout's name.
func (l Layout) String() string {
	switch l {
	case LayoutReliableList:
		return "reliable-list"
	case LayoutLaravel:
		return "laravel"
	}
	return "unknown"
}

// Errors callers branch on.
var (
	// ErrClosed is returned by Publish and Subscribe after Close.
	ErrClosed = errors.New("redislist: closed")
	// ErrNoHashTag is returned by Subscribe on a Redis Cluster client for a
	// reliable-list queue name without a {hash tag}.
	ErrNoHashTag = errors.New("redislist: queue name needs a {hash tag} on Redis Cluster")
	// ErrNotLaravelJob was returned by Publish in the Laravel layout for a
	// payload that is not a JSON object with an integer "attempts". Publish
	// now writes such a payload wrapped in a Laravel job that carries it
	// (see the package doc) and no longer returns it; it is kept so that
	// code matching it still compiles.
	ErrNotLaravelJob = errors.New("redislist: payload is not a Laravel job (a JSON object with an integer \"attempts\")")
	// ErrEmptyTopic is returned for an empty topic.
	ErrEmptyTopic = errors.New("redislist: empty topic")
	// ErrNotUTF8 was returned by Publish for a payload that is not UTF-8
	// and needed a frame. Publish now frames such a payload base64-encoded
	// under FrameBodyBase64Key and never returns it.
	//
	// Deprecated: nothing returns it; it is kept so that code matching it
	// still compiles.
	ErrNotUTF8 = errors.New("redislist: payload is not UTF-8 and cannot travel in a frame")
)

// Defaults of the options.
const (
	DefaultVisibilityTimeout = 5 * time.Minute
	DefaultBlockTime         = time.Second
	DefaultCloseTimeout      = 5 * time.Second
	DefaultOperationTimeout  = 10 * time.Second
)

// Option configures a Publisher or a Subscriber.
type Option func(*config)

type config struct {
	layout       Layout
	visibility   time.Duration
	block        time.Duration
	closeTimeout time.Duration
	opTimeout    time.Duration
	release      time.Duration
	prefix       string
	logger       watermill.LoggerAdapter
}

func newConfig(opts []Option) config {
	c := config{
		layout:       LayoutReliableList,
		visibility:   DefaultVisibilityTimeout,
		block:        DefaultBlockTime,
		closeTimeout: DefaultCloseTimeout,
		opTimeout:    DefaultOperationTimeout,
		logger:       watermill.NopLogger{},
	}
	for _, o := range opts {
		o(&c)
	}
	return c
}

// WithLayout selects the layout; the default is LayoutReliableList.
func WithLayout(l Layout) Option { return func(c *config) { c.layout = l } }

// WithVisibilityTimeout sets how long a reservation lasts without being
// extended before the message is delivered again: the lease of the
// reliable-list layout and Laravel's retry_after. While a handler runs the
// subscriber extends it every third of the timeout. Default 5 minutes;
// values under a second are raised to a second in the Laravel layout,
// whose deadlines are whole seconds.
func WithVisibilityTimeout(d time.Duration) Option {
	return func(c *config) {
		if d > 0 {
			c.visibility = d
		}
	}
}

// WithBlockTime sets how long one blocking wait on an empty queue lasts
// (BLMOVE, or BLPOP on the Laravel notify list). Close waits for the wait
// in progress, so it bounds how long Close takes. Default 1 second.
func WithBlockTime(d time.Duration) Option {
	return func(c *config) {
		if d > 0 {
			c.block = d
		}
	}
}

// WithCloseTimeout sets how long Close waits for the messages in flight to
// be acked or nacked. Default 5 seconds.
func WithCloseTimeout(d time.Duration) Option {
	return func(c *config) {
		if d > 0 {
			c.closeTimeout = d
		}
	}
}

// WithOperationTimeout bounds each Redis call that has no deadline of its
// own (Publish, ack, nack, lease upkeep). Default 10 seconds.
func WithOperationTimeout(d time.Duration) Option {
	return func(c *config) {
		if d > 0 {
			c.opTimeout = d
		}
	}
}

// WithReleaseDelay sets how long a nacked message waits in the Laravel
// delayed set before it is ready again (Laravel's release delay). Default 0.
// It does not apply to the reliable-list layout, which pushes a nacked
// message back at once, as the SDK runtimes do.
func WithReleaseDelay(d time.Duration) Option {
	return func(c *config) {
		if d >= 0 {
			c.release = d
		}
	}
}

// WithKeyPrefix sets a prefix put before every key, as a Laravel
// connection's "prefix" option does (for example "laravel_database_").
func WithKeyPrefix(p string) Option { return func(c *config) { c.prefix = p } }

// WithLogger sets the logger; the default logs nothing.
func WithLogger(l watermill.LoggerAdapter) Option {
	return func(c *config) {
		if l != nil {
			c.logger = l
		}
	}
}

// keys are the Redis keys of one topic.
type keys struct {
	ready      string // <queue> | queues:<name>
	processing string // <queue>:processing | queues:<name>:reserved
	leases     string // <queue>:processing:leases | queues:<name>:delayed
	notify     string // "" | queues:<name>:notify
}

func (c config) keys(client redis.UniversalClient, topic string) keys {
	if c.layout == LayoutLaravel {
		name := topic
		if _, ok := client.(*redis.ClusterClient); ok && !hasHashTag(name) {
			name = "{" + name + "}"
		}
		base := c.prefix + "queues:" + name
		return keys{ready: base, processing: base + ":reserved", leases: base + ":delayed", notify: base + ":notify"}
	}
	q := c.prefix + topic
	return keys{ready: q, processing: q + ":processing", leases: q + ":processing:leases"}
}

// hasHashTag reports whether Redis Cluster hashes only part of key: a "{"
// followed later by a "}" with something between them.
func hasHashTag(key string) bool {
	open := strings.IndexByte(key, '{')
	if open < 0 {
		return false
	}
	closing := strings.IndexByte(key[open+1:], '}')
	return closing > 0
}
