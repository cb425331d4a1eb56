package sdkstore

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"
	"unicode/utf8"
)

// Errors returned by the stores. Branch on them with errors.Is.
var (
	// ErrInvalidOption is matched by the error a constructor returns for an
	// option that is malformed or does not apply to the layout.
	ErrInvalidOption = errors.New("sdkstore: invalid option")

	// ErrScopedKey is matched when a key carries a handler scope (the
	// middleware's default, handler name + U+001F + meta.id). The SDK
	// consumers key their records on meta.id alone and would never read
	// such a record, so the store refuses it instead of silently splitting
	// the fleet in two. Wire the middleware with idempotency.WithScope(""),
	// or allow scoped keys with WithScopedKeys for handlers only the kit
	// runs. The error is not permanent: the delivery is retried, and runs
	// once the wiring is fixed.
	ErrScopedKey = errors.New("sdkstore: key is scoped by handler; BabelQueue SDK consumers would never read its record (wire the middleware with idempotency.WithScope(\"\"))")

	// ErrKeyCollation is matched by Migrate when an existing MariaDB table
	// compares message ids case-insensitively or ignoring trailing spaces
	// (as one made by the PHP SDK's PdoStore::ddl() does on a database
	// whose default collation ignores case): two distinct meta.ids would
	// then share one record. The error ends with the ALTER TABLE statement
	// that fixes the column.
	ErrKeyCollation = errors.New("sdkstore: message_id column does not compare ids byte for byte")
)

// scopeSeparator is what the middleware puts between a scope and a meta.id
// (idempotency.Key). A meta.id never holds it: control characters are
// rejected.
const scopeSeparator = "\x1f"

// Option configures a store.
type Option func(*config)

type config struct {
	prefix       string
	claimPrefix  string
	table        string
	claimTable   string
	ttl          time.Duration
	ttlSet       bool
	scoped       bool
	queryTimeout time.Duration
}

// WithPrefix sets the key prefix of a Redis layout: the SDK's own
// (DefaultPHPPrefix, DefaultGoPrefix) unless the SDK consumers were
// configured with another one.
func WithPrefix(prefix string) Option { return func(c *config) { c.prefix = prefix } }

// WithClaimPrefix sets where the Go SDK Redis layout keeps the kit's
// in-flight claims (default: the prefix without its final colon, followed
// by "-claim:", so "bq:idemp-claim:"). It must not start with the record
// prefix, so that no record key of the Go SDK is ever a claim.
func WithClaimPrefix(prefix string) Option { return func(c *config) { c.claimPrefix = prefix } }

// WithTable sets the table of an SQL layout (default: the SDK's own,
// DefaultPHPTable or DefaultGoTable): letters, digits and underscores,
// optionally qualified by a schema. On PostgreSQL it follows PostgreSQL's
// case folding as the SDKs do (they write the name unquoted, which
// PostgreSQL reads in lower case), so a name with capitals is refused with
// an error naming the table the SDKs use: give "orders_idem", not
// "Orders_Idem". On MariaDB a name is the same table to both sides as given.
func WithTable(name string) Option { return func(c *config) { c.table = name } }

// WithClaimTable sets the table where the Go SDK PostgreSQL layout keeps the
// kit's in-flight claims (default: the record table followed by "_claims").
// Like WithTable's, a name with capitals is refused.
func WithClaimTable(name string) Option { return func(c *config) { c.claimTable = name } }

// WithTTL makes the kit's records expire after ttl, as the SDK's own do when
// it is configured with one. Give the SDK's value. It applies to the PHP
// RedisStore layout (which the PHP SDK keeps forever, so a TTL only bounds
// the kit's records) and to both Go SDK layouts; the PHP PdoStore layout
// has no expiry for records, and the option is an error there.
func WithTTL(ttl time.Duration) Option { return func(c *config) { c.ttl, c.ttlSet = ttl, true } }

// WithScopedKeys lets the store hold keys scoped by handler. Their records
// are the kit's alone: SDK consumers never read them. Use it for a second
// handler on the same topic that only the kit runs.
func WithScopedKeys() Option { return func(c *config) { c.scoped = true } }

// WithQueryTimeout bounds every SQL statement (default 5s) when the caller's
// context has no earlier deadline. Zero disables it.
func WithQueryTimeout(d time.Duration) Option { return func(c *config) { c.queryTimeout = d } }

func newConfig(opts []Option) config {
	c := config{queryTimeout: 5 * time.Second}
	for _, opt := range opts {
		opt(&c)
	}
	return c
}

func (c *config) checkTTL() error {
	if c.ttl < 0 || (c.ttl > 0 && c.ttl < time.Millisecond) {
		return fmt.Errorf("%w: TTL %v: want 0 (forever) or at least 1ms", ErrInvalidOption, c.ttl)
	}
	return nil
}

// checkKey refuses a scoped key unless the store allows them.
func (c *config) checkKey(key string) error {
	if !c.scoped && strings.Contains(key, scopeSeparator) {
		return fmt.Errorf("%w: %q", ErrScopedKey, key)
	}
	return nil
}

// bound gives ctx the query timeout when it has no earlier deadline.
func (c *config) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if c.queryTimeout <= 0 {
		return ctx, func() {}
	}
	if d, ok := ctx.Deadline(); ok && time.Until(d) <= c.queryTimeout {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, c.queryTimeout)
}

var prefixPattern = regexp.MustCompile(`^[!-~]{1,64}$`)

func checkPrefix(what, p string) error {
	if !prefixPattern.MatchString(p) {
		return fmt.Errorf("%w: %s %q: want 1 to 64 printable ASCII characters without spaces", ErrInvalidOption, what, p)
	}
	return nil
}

var identifier = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$`)

func checkTable(name string) error {
	if !identifier.MatchString(name) {
		return fmt.Errorf("%w: table %q: want letters, digits and underscores, optionally schema-qualified", ErrInvalidOption, name)
	}
	return nil
}

// digestMark starts the form under which an SQL layout keeps a key it cannot
// hold verbatim. It is a control character, which no meta.id holds, so the
// form never equals a record an SDK consumer wrote.
const digestMark = "\x1d"

// columnKey returns the value kept in an SQL layout's message_id column for
// key: key itself when the column can hold it (valid UTF-8, no NUL, at most
// maxChars characters when maxChars > 0), otherwise a digest. An SDK
// consumer cannot store such an id at all, so it never has a record of it to
// share.
func columnKey(key string, maxChars int) string {
	if utf8.ValidString(key) && !strings.Contains(key, "\x00") && (maxChars <= 0 || utf8.RuneCountInString(key) <= maxChars) {
		return key
	}
	sum := sha256.Sum256([]byte(key))
	return digestMark + "sha256:" + hex.EncodeToString(sum[:])
}
