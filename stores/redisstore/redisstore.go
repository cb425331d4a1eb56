// Package redisstore keeps idempotency records in Redis, shared by every
// worker of a fleet. It implements [stores.Store] (claims, a TTL,
// fingerprints, values and failures) with go-redis v9 and works with any
// redis.UniversalClient: a *redis.Client, a *redis.ClusterClient or a
// failover client. It needs Redis 6.2 or later.
//
// # Records
//
// Every call touches one Redis key, so the store works unchanged on a Redis
// Cluster. The key is the prefix followed by an 11-byte digest (the first 88
// bits of SHA-256) of the store key, whatever the length of the handler name
// and meta.id. With the default 3-byte prefix the whole key is 14 bytes,
// which Redis keeps in a 16-byte allocation. The value of a remembered record
// is "1", which Redis stores as a shared integer, so a record costs its key,
// its expiry and the dictionary entries: 96.5 bytes measured while Redis's
// hash tables are nearly full and 113.5 bytes at 5 and 10 million records
// (Redis 7.0 with Debian's jemalloc; docs/benchmarks.md, "Record size"). A claim's value is "c" followed by the
// holder's token: the delivery's (stores.WithClaimToken), or a random token
// of the Store instance for calls that name none. Use [Store.RedisKey] to
// find a record with redis-cli.
//
// With a fingerprint of the message's content the value is the
// fingerprint reduced to a number from 2 to 9999: Redis keeps
// those as shared integers too, so the check against a reused meta.id costs
// no memory. What that costs: a meta.id reused for other content goes
// unnoticed with a chance of 1 in 9,998, and the reuse is then skipped as a
// duplicate instead of being rejected as a conflict.
//
// 88 bits keep collisions out of reach at the scale the kit is sized for:
// among 604.8 million live records (1,000 new ids/s kept 7 days) the chance
// that any two distinct keys share a digest is about 6 in 10 billion, and a
// collision costs one message skipped as a duplicate.
//
// A record that keeps a value (an HTTP answer saved for a retry, say) is
// "v", the whole 64-bit fingerprint in decimal, ":" and the value, up to
// MaxValue bytes: a value is replayed to whoever reuses the key, and a
// reduced fingerprint would hand 1 request in 9,998 that reuses a key with
// another payload someone else's answer. A record written with the reduced
// form by an earlier release still matches its own retries
// (stores.Capabilities.Matches takes either form).
//
// # Failures
//
// A message whose runs failed (Store.Fail) is kept under the same Redis
// key, so every call still touches one key and a Redis Cluster never sees
// two slots: a failing record is "f" and a JSON object (the kept
// fingerprint "fp", the failed runs "n", the first failure "first" and the
// next run's earliest start "next", in Unix milliseconds); an ended one is
// "e", the length of its end's redrive marker, ":", the marker, and the
// JSON with the end's "reason", "at" and "topic". Both expire with the
// store's TTL. A holder's Fail without an end keeps its claim and makes it
// carry the count: "k", the lease's end and the failing record's expiry
// (Unix milliseconds of the server's clock, 0 for none), the length of the
// claim's value, ":", the claim's value and the failing record whole; the
// key expires at the later of the two, so a holder that dies leaves the
// count behind when its lease lapses, and the next delivery's Claim takes
// the key over with the count. Every call that meets such a record reads
// it in its one script (the server's clock decides whether the lease
// lasts); Reopen is a compare-and-delete of an ended record with the
// marker's prefix, so one of concurrent Reopens wins.
//
// A key that never failed costs what it did before: a claim is the same
// SET NX PX GET, and only a claim that finds a failing record (or a claim
// carrying a count) sends a second command, a script that takes it over.
// The scripts of Lookup and Remember compare the first byte of the value
// they find once more; they read the server's clock only for a claim that
// carries a count.
//
// Commands: Lookup is one EVALSHA of a script reading the value and its
// time to live; Remember one EVALSHA of a script that SETs the record
// (with PX under a TTL) unless another holder's claim is there; Claim one
// SET NX PX GET, which returns the record in its way; Extend one EVALSHA
// of a compare-and-expire script, and Release one of a compare-and-delete
// script; Forget one DEL; Fail and Reopen one EVALSHA each. Commands of
// concurrent deliveries that meet are sent together in one pipeline (see
// WithoutPipelining); a command never waits for company. A first delivery
// under the middleware costs two round trips (check or claim, then
// remember); a duplicate one, or two under a claim.
//
// # Faults
//
// Every call returns by its context's deadline, pipelined or not, whatever
// the client's options: a caller whose deadline passes while its command
// waits or is on the wire gets its error then, and never another caller's
// answer. Without a deadline, the client's own timeouts bound a call
// (go-redis defaults to 3s reads and writes); a context cancelled without
// a deadline (Watermill's message contexts) ends a command still waiting
// for a pipeline at once, and one on the wire within those timeouts, as
// go-redis itself does.
//
// A caller finding nothing in flight sends its command itself, the
// cheapest path, when its context has no deadline or the client was
// created with ContextTimeoutEnabled (go-redis then ends a command at its
// context's deadline itself). With a deadline and go-redis's default,
// which ignores deadlines, the store hands such a command to a goroutine
// and waits for the answer or the deadline: a goroutine switch per round
// trip, which costs latency when deliveries come one at a time
// (docs/benchmarks.md); so give the client ContextTimeoutEnabled when
// store calls carry deadlines (idempotency.WithStoreTimeout, say). The
// effects store (NewEffects) returns by its calls' deadlines the same way.
// Either way, a round trip to a server that stalls runs until the client gives up
// on it, and the commands queued behind it wait (their callers leave at
// their deadlines).
//
// Errors from Redis are returned as they are (wrapped with context), so the
// middleware retries the delivery. A panic inside the client (a hook's)
// fails the commands it interrupted with ErrClientPanic and the store keeps
// serving.
//
// A claim whose reply was lost (the client sends the command again, as
// go-redis does with MaxRetries) finds its holder's own claim and reports it
// taken. A claim its caller gave up on (its context ended while the command
// was on the wire, or the reply was cut off by a timeout or a closed
// connection) may have been taken all the same, for a holder that is gone:
// when the command's answer comes back after its caller left and says the
// claim was taken, the store releases it then; when no answer will come
// (ContextTimeoutEnabled: the client cut the call), it releases it at
// once. Either release names the claim's holder and is bounded by 10 s (or
// the lease, if shorter), so a redelivery runs instead of being parked for
// the lease behind a claim nobody holds. One caveat: a command delayed on
// its way to the server may still take the claim after that release; it
// then lapses with its lease. The release drops the holder's claim
// whichever call of that holder took it: a holder whose Claim failed holds
// nothing afterwards (the middleware gives every delivery a token of its
// own, and a delivery whose Claim failed ends). Retentions and leases of any length are kept as given: the largest
// time.Duration (292 years) is within what Redis accepts.
package redisstore

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/internal/ctxerr"
	"github.com/babelqueue/watermill-idempotency/internal/failrec"
	"github.com/babelqueue/watermill-idempotency/internal/redisdeadline"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// DefaultPrefix starts every key the store writes, unless WithPrefix says
// otherwise.
const DefaultPrefix = "bq:"

// remembered is the value of a remembered record.
const remembered = "1"

// claimMark starts the value of a claim.
const claimMark = "c"

// valueMark starts the value of a record that keeps a value: "v", the kept
// fingerprint, ":", the value.
const valueMark = "v"

// The scripts on a claim, a failing or an ended record, and a claim that
// carries a count, shared with sdkstore's Redis layouts.
var (
	releaseScript, releaseSource = failrec.ReleaseScript, failrec.ReleaseSource
	extendScript, extendSource   = failrec.ExtendScript, failrec.ExtendSource
	lookupScript, lookupSource   = failrec.InspectScript, failrec.InspectSource
)

// rememberSource sets the record's value ARGV[1] (with an expiry of ARGV[3]
// milliseconds unless it is "0"), unless the key holds a live claim of a
// holder other than ARGV[2] (the caller's claim value): it then writes
// nothing and returns 0. A lapsed claim is gone (or, carrying a count,
// past its lease), so it never stands in the way; a failing or ended
// record is replaced.
// (The hot path: the count's parsing is inlined, not the prelude of
// failrec.LuaCounts, whose functions every run would create.)
const rememberSource = `
local v = redis.call('GET', KEYS[1])
if v then
	local m = string.byte(v, 1)
	if m == 99 and v ~= ARGV[2] then return 0 end
	if m == 107 then
		local lease, exp, n, at = string.match(v, '^k(%d+):(%d+):(%d+):()')
		n = tonumber(n)
		if string.sub(v, at, at + n - 1) ~= ARGV[2] then
			local t = redis.call('TIME')
			if tonumber(lease) > tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) then return 0 end
		end
	end
end
if ARGV[3] == '0' then
	redis.call('SET', KEYS[1], ARGV[1])
else
	redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
end
return 1`

var rememberScript = redis.NewScript(rememberSource)

// Store is a Redis-backed store, safe for concurrent use.
type Store struct {
	client    redis.UniversalClient
	prefix    string
	ttl       time.Duration
	ttlArg    any // ttl in milliseconds, boxed once (nil: no expiry)
	unbatched bool
	batch     *batcher
	noSetGet  atomic.Bool // the server rejected SET … NX … GET (before Redis 7.0)
	// instance is the claim holder of calls whose context names none.
	instance string
}

var _ stores.Store = (*Store)(nil)

// Option configures a Store.
type Option func(*Store)

// WithPrefix sets the prefix of every key (default DefaultPrefix). It must
// be 1 to 32 printable ASCII characters without spaces or braces (braces
// would make a Redis Cluster hash tag and put every record in one slot).
// Prefixes of up to 3 characters keep records smallest (see above).
func WithPrefix(prefix string) Option { return func(s *Store) { s.prefix = prefix } }

// WithoutPipelining sends every command on its own. By default the store
// sends the commands of concurrent deliveries together when they meet (one
// pipeline instead of one round trip each); a command never waits for
// company, so at low load nothing changes.
func WithoutPipelining() Option { return func(s *Store) { s.unbatched = true } }

// WithTTL makes remembered records expire after ttl, natively in Redis.
// Zero (the default) keeps them until forgotten. Any ttl is kept as given
// (the largest time.Duration is within what Redis accepts).
func WithTTL(ttl time.Duration) Option { return func(s *Store) { s.ttl = ttl } }

// New returns a Store using client. The client is the caller's: the Store
// never closes it. New panics with a clear message when an option is
// invalid (a bad prefix, a negative or sub-millisecond TTL); see Validate.
func New(client redis.UniversalClient, opts ...Option) *Store {
	s := &Store{client: client, prefix: DefaultPrefix}
	for _, opt := range opts {
		opt(s)
	}
	if err := s.Validate(); err != nil {
		panic(err)
	}
	if s.ttl > 0 {
		s.ttlArg = s.ttl.Milliseconds()
	}
	s.batch = &batcher{client: client, inline: redisdeadline.Honoured(client)}
	s.instance = stores.NewClaimToken()
	return s
}

// ErrClientPanic is matched by the error of a command during which the
// redis client panicked (in a hook, say): the store recovers, fails the
// commands of that round trip with it, and keeps serving.
var ErrClientPanic = errors.New("redisstore: the redis client panicked")

// process runs cmd, sharing a round trip with concurrent commands unless
// WithoutPipelining was given. It returns by ctx's deadline; when it returns
// ctx's error, cmd may still be in flight and must not be read.
func (s *Store) process(ctx context.Context, cmd redis.Cmder) error {
	return s.send(ctx, cmd, nil)
}

// send runs cmd as process does; when its caller leaves while cmd is on
// the wire, late (if not nil) is told the answer when it comes, and the
// error matches both ctx's and abandonedError. An error other than
// redis.Nil matches ctx's once ctx is past its deadline: a client that
// honours contexts' deadlines reads under ctx's, and reports a network
// timeout, a moment before ctx reports done, when it does not retry.
func (s *Store) send(ctx context.Context, cmd redis.Cmder, late lateAnswer) error {
	var err error
	if s.unbatched {
		err = processOwn(ctx, s.client, s.batch.inline, cmd, late)
	} else {
		err = s.batch.do(ctx, cmd, late)
	}
	if err == nil || errors.Is(err, redis.Nil) {
		return err
	}
	return ctxerr.Match(ctx, err)
}

// fail is the error of an operation op of the store whose command, run
// under ctx, failed with err: it matches ctx's error once ctx is done or
// past its deadline (ctxerr.Match), whatever the client reported.
func fail(ctx context.Context, op string, err error) error {
	return fmt.Errorf("redisstore: %s: %w", op, ctxerr.Match(ctx, err))
}

// claimValue is the value of a claim taken with ctx: the claim mark and the
// holder's token, the store instance's when ctx names none.
func (s *Store) claimValue(ctx context.Context) string {
	if token := stores.ClaimToken(ctx); token != "" {
		return claimMark + token
	}
	return claimMark + s.instance
}

// setArgs returns the arguments of SET key value with an expiry of px
// milliseconds (none when px is nil). The value and expiry come boxed, so
// that constants and the store's own TTL cost no allocation per command.
func setArgs(key string, value, px any, extra ...any) []any {
	args := make([]any, 0, 5+len(extra))
	args = append(args, "set", key, value)
	if px != nil {
		args = append(args, "px", px)
	}
	return append(args, extra...)
}

// ErrInvalidOption is matched by the error Validate returns.
var ErrInvalidOption = errors.New("redisstore: invalid option")

// Validate reports whether the Store's configuration is usable.
func (s *Store) Validate() error {
	if s.client == nil {
		return fmt.Errorf("%w: nil client", ErrInvalidOption)
	}
	if err := ValidatePrefix(s.prefix); err != nil {
		return err
	}
	if s.ttl < 0 || (s.ttl > 0 && s.ttl < time.Millisecond) {
		return fmt.Errorf("%w: TTL %v: want 0 (forever) or at least 1ms", ErrInvalidOption, s.ttl)
	}
	return nil
}

// ValidatePrefix reports whether p is usable as a key prefix (see
// WithPrefix); the error matches ErrInvalidOption.
func ValidatePrefix(p string) error {
	if len(p) == 0 || len(p) > 32 {
		return fmt.Errorf("%w: prefix %q: want 1 to 32 characters", ErrInvalidOption, p)
	}
	for i := 0; i < len(p); i++ {
		if c := p[i]; c <= ' ' || c > '~' || c == '{' || c == '}' {
			return fmt.Errorf("%w: prefix %q: character %q at %d is not allowed (printable ASCII without spaces or braces)",
				ErrInvalidOption, p, c, i)
		}
	}
	return nil
}

// Prefix returns the prefix of every key the store writes.
func (s *Store) Prefix() string { return s.prefix }

// TTL returns the retention of remembered records; 0 means forever.
func (s *Store) TTL() time.Duration { return s.ttl }

// digestBytes is how much of the SHA-256 of a key the Redis key keeps.
const digestBytes = 11

// RedisKey returns the Redis key holding the record of key.
func (s *Store) RedisKey(key string) string {
	var buf [128]byte // keys up to 128 bytes are hashed without an allocation
	sum := sha256.Sum256(append(buf[:0], key...))
	return s.prefix + string(sum[:digestBytes])
}

// Capabilities reports claims, the TTL, fingerprints kept as a number from
// 2 to 9999 with a record without a value (all 64 bits with a value),
// values of up to MaxValue bytes and failures.
func (s *Store) Capabilities() stores.Capabilities {
	return stores.Capabilities{Claims: true, TTL: s.ttl, Fingerprint: keptFingerprint, MaxValue: MaxValue, Failures: true}
}

// MaxValue is the longest value the store keeps with a record: 1 MiB.
const MaxValue = 1 << 20

// Lookup returns the record held for key, with its expiry: one EVALSHA of a
// script reading the value and its time to live.
func (s *Store) Lookup(ctx context.Context, key string) (stores.Record, error) {
	rk := s.RedisKey(key)
	cmd := redis.NewSliceCmd(ctx, "evalsha", lookupScript.Hash(), 1, rk)
	err := s.process(ctx, cmd)
	if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") { // loads it for the next time
		cmd = redis.NewSliceCmd(ctx, "eval", lookupSource, 1, rk)
		err = s.process(ctx, cmd)
	}
	if err != nil {
		return stores.Record{}, fmt.Errorf("redisstore: lookup: %w", err)
	}
	v := cmd.Val()
	if len(v) < 2 {
		return stores.Record{}, nil
	}
	value, _ := v[0].(string)
	if len(v) == 3 { // a claim that carries a count, and the server's clock
		now, _ := v[2].(int64)
		return failrec.LookupCount(value, now), nil
	}
	r := s.parseValue(value)
	if ms, _ := v[1].(int64); ms > 0 {
		r.ExpiresAt = time.Now().Add(time.Duration(ms) * time.Millisecond)
	}
	return r, nil
}

// parseValue reads a record's value: a claim is in flight (with the count
// it carries, if any: a claim that carries one is read here as live);
// "1" is remembered with no fingerprint; a number is remembered with that
// kept fingerprint; "v" is remembered with a fingerprint (whole, or
// reduced when an earlier release wrote it) and a value; "f" is failing
// and "e" ended.
func (s *Store) parseValue(v string) stores.Record {
	switch {
	case v == "":
		return stores.Record{}
	case v[:1] == claimMark:
		return stores.Record{State: stores.StateInFlight}
	case v[:1] == failrec.FailingMark || v[:1] == failrec.EndedMark:
		return failrec.Parse(v)
	case v[:1] == failrec.CountMark:
		if c, ok := failrec.ParseCountClaim(v); ok {
			return c.InFlight()
		}
		return stores.Record{State: stores.StateInFlight}
	case v == remembered:
		return stores.Record{State: stores.StateRemembered}
	case v[:1] == valueMark:
		fp, value, _ := strings.Cut(v[1:], ":")
		kept, _ := strconv.ParseUint(fp, 10, 64)
		return stores.Record{State: stores.StateRemembered, Fingerprint: kept, Value: []byte(value)}
	}
	fp, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		return stores.Record{State: stores.StateRemembered} // not a value this store writes: no fingerprint
	}
	return stores.Record{State: stores.StateRemembered, Fingerprint: fp}
}

// Remember records key with the fingerprint of its message, kept as a
// number from 2 to 9999 (all 64 bits with a value), and value, replacing
// any claim on it: one SET.
func (s *Store) Remember(ctx context.Context, key string, fingerprint uint64, value []byte) error {
	var v any = remembered
	switch {
	case len(value) > MaxValue:
		return fmt.Errorf("redisstore: remember: a value of %d bytes: %w (at most %d)", len(value), stores.ErrValueTooLarge, MaxValue)
	case value != nil:
		v = valueMark + strconv.FormatUint(fingerprint, 10) + ":" + string(value)
	case fingerprint != 0:
		v = int64(keptFingerprint(fingerprint)) // sent as its decimal digits
	}
	ttl := s.ttlArg
	if ttl == nil {
		ttl = noExpiry
	}
	cmd, err := s.eval(ctx, rememberScript, rememberSource, s.RedisKey(key), v, s.claimValue(ctx), ttl)
	switch {
	case err != nil:
		return fmt.Errorf("redisstore: remember: %w", err)
	case cmd.Val() == int64(0):
		return fmt.Errorf("redisstore: remember: %w", stores.ErrClaimTaken)
	}
	return nil
}

// noExpiry is the expiry argument of rememberScript for a record kept until
// forgotten.
var noExpiry any = "0"

// eval runs script (whose source is source) on the one key rk with args,
// by its hash, and by its source when the server does not have it yet
// (which loads it for the next time).
func (s *Store) eval(ctx context.Context, script *redis.Script, source, rk string, args ...any) (*redis.Cmd, error) {
	return s.evalLate(ctx, nil, script, source, rk, args...)
}

// evalLate is eval, telling late the answer of a command its caller left
// on the wire (see send).
func (s *Store) evalLate(ctx context.Context, late lateAnswer, script *redis.Script, source, rk string, args ...any) (*redis.Cmd, error) {
	cmd := redis.NewCmd(ctx, append([]any{"evalsha", script.Hash(), 1, rk}, args...)...)
	err := s.send(ctx, cmd, late)
	if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		cmd = redis.NewCmd(ctx, append([]any{"eval", source, 1, rk}, args...)...)
		err = s.send(ctx, cmd, late)
	}
	if errors.Is(err, redis.Nil) {
		err = nil
	}
	return cmd, err
}

// keptFingerprint reduces fingerprint to the number from 2 to 9999 the
// store keeps with a record without a value (0 stays 0).
func keptFingerprint(fingerprint uint64) uint64 {
	if fingerprint == 0 {
		return 0
	}
	return 2 + fingerprint%9998
}

// Forget deletes the record of key, remembered, claimed, failing or ended.
func (s *Store) Forget(ctx context.Context, key string) error {
	if err := s.process(ctx, redis.NewIntCmd(ctx, "del", s.RedisKey(key))); err != nil {
		return fmt.Errorf("redisstore: forget: %w", err)
	}
	return nil
}

// Claim takes the claim on key for lease, for the holder named by
// stores.ClaimToken(ctx) (the Store itself when ctx names none), or returns
// the record in its way, in one round trip: SET key value NX PX lease GET
// returns the value it found. A live claim of the same holder counts as
// taken by it, so a command the client sent again after losing its reply
// finds the claim its first sending took, and reports it. On a server older
// than Redis 7.0, which rejects NX with GET, it falls back to SET NX PX
// and, when that fails, a GET. A claim the call may have taken when it
// fails (its caller gave up, its reply was cut off) is released: see
// Faults in the package documentation.
func (s *Store) Claim(ctx context.Context, key string, lease time.Duration) (bool, stores.Record, error) {
	if lease < time.Millisecond {
		return false, stores.Record{}, fmt.Errorf("redisstore: claim lease %v: want at least 1ms", lease)
	}
	rk, holder := s.RedisKey(key), s.claimValue(ctx)
	if !s.noSetGet.Load() {
		cmd := redis.NewStringCmd(ctx, setArgs(rk, holder, lease.Milliseconds(), "nx", "get")...)
		err := s.send(ctx, cmd, s)
		switch {
		case errors.Is(err, redis.Nil): // nothing was there: the claim is ours
			return true, stores.Record{}, nil
		case err == nil:
			return s.claimFound(ctx, rk, cmd.Val(), holder, lease)
		case !strings.Contains(err.Error(), "syntax error"):
			s.gaveUp(ctx, err, rk, holder, lease)
			return false, stores.Record{}, fmt.Errorf("redisstore: claim: %w", err)
		}
		s.noSetGet.Store(true)
	}
	set := redis.NewBoolCmd(ctx, setArgs(rk, holder, lease.Milliseconds(), "nx")...)
	if err := s.send(ctx, set, s); err != nil {
		s.gaveUp(ctx, err, rk, holder, lease)
		return false, stores.Record{}, fmt.Errorf("redisstore: claim: %w", err)
	}
	if set.Val() {
		return true, stores.Record{}, nil
	}
	get := redis.NewStringCmd(ctx, "get", rk)
	err := s.process(ctx, get)
	if errors.Is(err, redis.Nil) { // gone since: in flight a moment ago
		return false, stores.Record{}, nil
	}
	if err != nil {
		return false, stores.Record{}, fmt.Errorf("redisstore: claim: %w", err)
	}
	return s.claimFound(ctx, rk, get.Val(), holder, lease)
}

// claimFound reads the value v a claim of rk found in its way: the
// caller's own claim (taken by an earlier sending of the same command),
// another holder's, or a record. A failing record, or a claim that
// carries a count, is claimed by a script of its own: the first failure
// of a message moves it off the hot path.
func (s *Store) claimFound(ctx context.Context, rk, v, holder string, lease time.Duration) (bool, stores.Record, error) {
	switch {
	case v == holder:
		return true, stores.Record{}, nil
	case v != "" && (v[:1] == failrec.FailingMark || v[:1] == failrec.CountMark):
		return s.claimCount(ctx, rk, holder, lease)
	}
	return false, s.parseValue(v), nil
}

// Extend extends the caller's live claim on key (the Store's own when ctx
// names no holder) to lease from now, in one EVALSHA of a compare-and-expire
// script; held is false when key holds no live claim of this holder.
func (s *Store) Extend(ctx context.Context, key string, lease time.Duration) (bool, error) {
	if lease < time.Millisecond {
		return false, fmt.Errorf("redisstore: extend lease %v: want at least 1ms", lease)
	}
	cmd, err := s.eval(ctx, extendScript, extendSource, s.RedisKey(key), s.claimValue(ctx), lease.Milliseconds())
	if err != nil {
		return false, fmt.Errorf("redisstore: extend: %w", err)
	}
	return cmd.Val() == int64(1), nil
}

// Release drops the caller's claim on key (the Store's own when ctx names
// no holder); see stores.Store.
func (s *Store) Release(ctx context.Context, key string) error {
	if _, err := s.eval(ctx, releaseScript, releaseSource, s.RedisKey(key), s.claimValue(ctx)); err != nil {
		return fmt.Errorf("redisstore: release: %w", err)
	}
	return nil
}
