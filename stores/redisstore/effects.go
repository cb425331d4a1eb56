package redisstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/internal/redisdeadline"
	"github.com/babelqueue/watermill-idempotency/stores"
)

// DefaultEffectsPrefix starts every key an Effects store writes, unless
// WithEffectsPrefix says otherwise.
const DefaultEffectsPrefix = "bq:fx"

// Effects keeps the records of external effects ([stores.EffectStore]) in
// Redis, shared by every worker of a fleet. Build it with [NewEffects].
//
// An effect is a hash (its intent, state, result, note, evidence, attempts,
// holder and lease); one sorted set per state indexes the effects in it by
// the time they entered it, for List and Stats; a provider event is a
// string. Every call is one script, so each transition, with its index
// entries, is atomic, and times come from the Redis server's clock. Every
// key starts with the prefix as given (a "prefix*" SCAN or a Redis ACL key
// pattern covers them), followed by the prefix again as a Cluster hash
// tag, {prefix}: on a Redis Cluster an Effects store lives on one shard
// (effects are far fewer than messages), and its scripts never cross
// slots.
//
//	bq:fx{bq:fx}e:<provider key>   hash, the effect
//	bq:fx{bq:fx}s:<state>          sorted set, the effects in that state
//	bq:fx{bq:fx}ev:<event id>      string, a provider event applied (when, in Unix ms)
//	bq:fx{bq:fx}r:<provider key>   string, the result of a succeeded effect under WithResultTTL
//
// Releases before this layout wrote the same keys without the leading
// prefix ({bq:fx}e:…), in the same slot; MigrateKeys renames them. Until
// it ran, a call on one effect (Begin, Transition, ApplyEvent, Extend,
// Lookup, Forget) that finds it only under that layout finds it there
// (see WithLegacyKeys), so a rolling upgrade never begins afresh an
// effect an earlier worker recorded.
//
// Pending and unknown effects never expire. A final effect's hash and a
// recorded event expire natively after the store's retention
// (stores.DefaultEffectsTTL unless WithEffectsTTL says otherwise), and
// their index entries are pruned by the calls that read the index. Purge
// removes final effects and events older than a time.
type Effects struct {
	client   redis.UniversalClient
	prefix   string // as given
	tag      string // "prefix{prefix}", the start of every key
	ttl      time.Duration
	rttl     time.Duration // the result lifetime; 0: the record's
	legacy   string        // legacyStay or legacyMove
	instance string
	inline   bool // the client ends a command at its context's deadline (ContextTimeoutEnabled)
}

var _ stores.EffectStore = (*Effects)(nil)

// EffectsOption configures an Effects store.
type EffectsOption func(*Effects)

// WithEffectsPrefix sets the prefix of the store's keys (default
// DefaultEffectsPrefix), with the rules of ValidatePrefix. It becomes the
// Cluster hash tag of every key.
func WithEffectsPrefix(prefix string) EffectsOption {
	return func(e *Effects) { e.tag = prefix }
}

// WithEffectsTTL makes final effects (succeeded, failed) and recorded
// provider events expire ttl after they were written (at least 1ms; default
// stores.DefaultEffectsTTL). Zero keeps them until Purge or Forget removes
// them. Keep them at least as long as a message may be redelivered or
// replayed (the replay horizon): an attempt that finds no record starts the
// effect afresh (under the same provider key).
func WithEffectsTTL(ttl time.Duration) EffectsOption { return func(e *Effects) { e.ttl = ttl } }

// WithResultTTL keeps the provider's result of a succeeded effect for d
// after it succeeded, and the rest of its record for the effects TTL. The
// result is then a string of its own beside the effect's hash, in the same
// slot (prefix{prefix}r:<provider key>), expiring natively after d and
// written and read by the same scripts as the hash: past d Redis has freed
// it, and the store reports the effect with Result nil and ResultDropped
// set, still final. Zero (the default) keeps the result in the hash, as
// long as the record. d may not be longer than the effects TTL (see
// stores.ValidResultTTL).
func WithResultTTL(d time.Duration) EffectsOption { return func(e *Effects) { e.rttl = d } }

// WithLegacyKeys says what a call on one effect does when the effect is
// found only under the key layout of earlier releases ({prefix}e:…, before
// MigrateKeys ran), which shares the slot of the current one. With move
// false (the default) the call reads and writes the effect where it is,
// with that layout's indexes, so that workers of the earlier release,
// still running beside this one during a rolling upgrade, keep seeing it.
// With move true the call first renames it (with its expiry and its index
// entry) to the current layout, in the same script: use it once no worker
// of the earlier release runs and MigrateKeys has not. Either way the
// effect is found, never begun afresh; List, Stats and Purge see only the
// current layout until MigrateKeys moved the rest.
func WithLegacyKeys(move bool) EffectsOption {
	return func(e *Effects) {
		e.legacy = legacyStay
		if move {
			e.legacy = legacyMove
		}
	}
}

// NewEffects returns an Effects store using client, which stays the
// caller's. It panics on an invalid option (a bad prefix, a negative or
// sub-millisecond TTL, a result lifetime longer than the TTL).
func NewEffects(client redis.UniversalClient, opts ...EffectsOption) *Effects {
	e := &Effects{client: client, tag: DefaultEffectsPrefix, ttl: stores.DefaultEffectsTTL, legacy: legacyStay, instance: stores.NewClaimToken(), inline: redisdeadline.Honoured(client)}
	for _, opt := range opts {
		opt(e)
	}
	if err := ValidatePrefix(e.tag); err != nil {
		panic(err)
	}
	if e.ttl < 0 || (e.ttl > 0 && e.ttl < time.Millisecond) {
		panic(fmt.Errorf("%w: effects TTL %v: want 0 (forever) or at least 1ms", ErrInvalidOption, e.ttl))
	}
	if err := stores.ValidResultTTL(e.rttl, e.ttl); err != nil {
		panic(fmt.Errorf("%w: %w", ErrInvalidOption, err))
	}
	e.prefix = e.tag
	e.tag = e.prefix + "{" + e.prefix + "}"
	return e
}

// EffectKey returns the Redis key of the effect key, for redis-cli.
func (e *Effects) EffectKey(key string) string { return e.tag + "e:" + key }

func (e *Effects) eventKey(id string) string { return e.tag + "ev:" + id }

// ResultKey returns the Redis key holding the result of the effect key
// under a result lifetime (WithResultTTL), for redis-cli.
func (e *Effects) ResultKey(key string) string { return e.tag + "r:" + key }

// legacyTag starts the keys of the layout of earlier releases.
func (e *Effects) legacyTag() string { return "{" + e.prefix + "}" }

// effectKeys returns the keys of a script acting on the effect key (see
// nEffectKeys).
func (e *Effects) effectKeys(key string) []string {
	out := make([]string, 0, nEffectKeys+2)
	out = append(append(out, e.EffectKey(key)), e.indexKeys()...)
	out = append(out, e.ResultKey(key), e.legacyTag()+"e:"+key)
	for _, s := range stores.EffectStates {
		out = append(out, e.legacyTag()+"s:"+string(s))
	}
	return out
}

// indexKeys returns the sorted sets of the states, in stores.EffectStates
// order.
func (e *Effects) indexKeys() []string {
	out := make([]string, len(stores.EffectStates))
	for i, s := range stores.EffectStates {
		out[i] = e.tag + "s:" + string(s)
	}
	return out
}

func (e *Effects) holder(ctx context.Context) string {
	if token := stores.ClaimToken(ctx); token != "" {
		return token
	}
	return e.instance
}

// maxMS bounds the milliseconds handed to scripts: Lua numbers are doubles,
// exact to 2^53. 2^50 ms is 35,000 years.
const maxMS = 1 << 50

func ms(d time.Duration) int64 { return min(d.Milliseconds(), maxMS) }

// The keys of the scripts that act on one effect (effectKeys), all in the
// store's slot: KEYS[1] the effect's hash, KEYS[2..5] the state indexes
// (stores.EffectStates order), KEYS[6] its result (under a result
// lifetime), KEYS[7] its hash in the layout of earlier releases
// ({prefix}e:…), KEYS[8..11] that layout's indexes. Their last ARGV is the
// legacy mode: "move" or "stay" (see WithLegacyKeys).
const (
	nEffectKeys = 11
	legacyStay  = "stay"
	legacyMove  = "move"
)

// luaNow is the server's clock in milliseconds, and the state indexes by
// name. In a script acting on one effect, E is the hash to act on: KEYS[1],
// or the earlier layout's KEYS[7] when only that one exists, which is then
// moved to KEYS[1] (mode "move"), or acted on where it is, with its own
// indexes ("stay"; legacy is then true).
const luaNow = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local states = {'pending', 'unknown', 'succeeded', 'failed'}
local index = {}
local E, legacy, base = KEYS[1], false, 1
if #KEYS >= 11 and redis.call('EXISTS', KEYS[1]) == 0 and redis.call('EXISTS', KEYS[7]) == 1 then
	if ARGV[#ARGV] == 'move' then
		redis.call('RENAME', KEYS[7], KEYS[1]) -- its expiry kept
		local h = redis.call('HMGET', KEYS[1], 'state', 'since', 'key')
		for i, s in ipairs(states) do
			redis.call('ZREM', KEYS[i + 7], h[3])
			if s == h[1] then redis.call('ZADD', KEYS[i + 1], tonumber(h[2]), h[3]) end
		end
	else
		E, legacy, base = KEYS[7], true, 7
	end
end
for i, s in ipairs(states) do index[s] = KEYS[i + base] end
local function result()
	if #KEYS >= 11 then return redis.call('GET', KEYS[6]) end
	return false
end
`

// luaMove moves the effect E (member ARGV[1]) as ARGV says: ARGV[2] the
// allowed sources (comma-separated), ARGV[3] the target, ARGV[4] result,
// ARGV[5] note, ARGV[6] evidence, ARGV[7] lease ms, ARGV[8] holder,
// ARGV[9] ttl ms, ARGV[10] result ttl ms, ARGV[11] the flags ("i": only
// if idle, "o": an overrule). It returns 1 or 0 for moved. A
// result under a lifetime goes to KEYS[6], expiring on its own; an effect
// of the earlier layout keeps it in its hash, where that layout reads it.
const luaMove = `
local function move()
	if redis.call('EXISTS', E) == 0 then return 0 end
	local st = redis.call('HGET', E, 'state')
	local allowed = false
	for s in string.gmatch(ARGV[2], '[^,]+') do if s == st then allowed = true end end
	if not allowed then return 0 end
	local to = ARGV[3]
	local lease = tonumber(redis.call('HGET', E, 'lease')) or 0
	local live = (st == 'pending' or st == 'unknown') and now < lease
	if st == 'pending' and (to == 'pending' or to == 'unknown') and live and redis.call('HGET', E, 'holder') ~= ARGV[8] then
		return 0 -- another attempt is still calling
	end
	if live and string.find(ARGV[11], 'i', 1, true) then return 0 end -- an attempt is calling, or its request may still land
	if string.find(ARGV[11], 'o', 1, true) and redis.call('HGET', E, 'ev') ~= '` + stores.EffectEvidenceOperator + `' then
		return 0 -- only an operator's resolution is overruled
	end
	if st ~= to then
		redis.call('ZREM', index[st], ARGV[1])
		redis.call('ZADD', index[to], now, ARGV[1])
		redis.call('HSET', E, 'since', now)
	end
	redis.call('HSET', E, 'state', to, 'updated', now, 'ev', ARGV[6])
	if ARGV[5] ~= '' then redis.call('HSET', E, 'note', ARGV[5]) end
	if to == 'pending' then
		redis.call('HSET', E, 'holder', ARGV[8], 'lease', now + tonumber(ARGV[7]))
		redis.call('HINCRBY', E, 'att', 1)
	elseif to == 'unknown' then
		redis.call('HSET', E, 'holder', '') -- the request sent may land until its lease passes
	else
		redis.call('HSET', E, 'holder', '', 'lease', 0)
	end
	local rttl = tonumber(ARGV[10])
	if to == 'succeeded' and rttl > 0 and not legacy then
		redis.call('SET', KEYS[6], ARGV[4], 'PX', rttl)
		redis.call('HSET', E, 'rexp', now + rttl)
	elseif to == 'succeeded' then
		redis.call('HSET', E, 'result', ARGV[4])
	end
	local ttl = tonumber(ARGV[9])
	if (to == 'succeeded' or to == 'failed') and ttl > 0 then
		redis.call('PEXPIRE', E, ttl)
		redis.call('HSET', E, 'expires', now + ttl)
	end
	return 1
end
`

var (
	effectBeginScript = redis.NewScript(luaNow + `
if redis.call('EXISTS', E) == 1 then
	return {0, now, redis.call('HGETALL', E), result()}
end
for _, s in ipairs(states) do redis.call('ZREM', index[s], ARGV[1]) end
redis.call('DEL', KEYS[6])
redis.call('HSET', E, 'key', ARGV[1], 'name', ARGV[2], 'scope', ARGV[3], 'mid', ARGV[4], 'fp', ARGV[5],
	'state', 'pending', 'att', 1, 'holder', ARGV[6], 'lease', now + tonumber(ARGV[7]),
	'created', now, 'since', now, 'updated', now, 'note', '', 'ev', '', 'expires', 0)
redis.call('ZADD', index['pending'], now, ARGV[1])
return {1, now, redis.call('HGETALL', E), false}`)

	effectMoveScript = redis.NewScript(luaNow + luaMove + `
local moved = move()
return {moved, now, redis.call('HGETALL', E), result()}`)

	// KEYS[12] is the event, KEYS[13] the event in the earlier layout;
	// ARGV[12] its id.
	effectEventScript = redis.NewScript(luaNow + luaMove + `
if redis.call('EXISTS', KEYS[12]) == 1 or redis.call('EXISTS', KEYS[13]) == 1 then
	return {0, now, redis.call('HGETALL', E), result(), 0}
end
local ttl = tonumber(ARGV[9])
if ttl > 0 then
	redis.call('SET', KEYS[12], now, 'PX', ttl)
else
	redis.call('SET', KEYS[12], now)
end
local moved = move()
return {moved, now, redis.call('HGETALL', E), result(), 1}`)

	// ARGV[1] the holder, ARGV[2] the lease in ms.
	effectExtendScript = redis.NewScript(luaNow + `
if redis.call('HGET', E, 'state') ~= 'pending' or redis.call('HGET', E, 'holder') ~= ARGV[1] then
	return 0
end
redis.call('HSET', E, 'lease', now + tonumber(ARGV[2]))
return 1`)

	effectLookupScript = redis.NewScript(luaNow + `
return {0, now, redis.call('HGETALL', E), result()}`)

	// ARGV[1] the states wanted (comma-separated), ARGV[2] entered before
	// (ms, or +inf), ARGV[3] limit, ARGV[4] ttl ms, ARGV[5] the hash
	// prefix, ARGV[6] the result prefix. Prunes the final states' lapsed
	// entries.
	effectListScript = redis.NewScript(luaNow + `
local ttl = tonumber(ARGV[4])
local out = {}
for s in string.gmatch(ARGV[1], '[^,]+') do
	if ttl > 0 and (s == 'succeeded' or s == 'failed') then
		redis.call('ZREMRANGEBYSCORE', index[s], '-inf', '(' .. (now - ttl))
	end
	local keys = redis.call('ZRANGE', index[s], '-inf', ARGV[2], 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[3]))
	for _, k in ipairs(keys) do
		local h = redis.call('HGETALL', ARGV[5] .. k)
		if #h > 0 then table.insert(out, {h, redis.call('GET', ARGV[6] .. k)}) end
	end
end
return {now, out}`)

	effectStatsScript = redis.NewScript(luaNow + `
local ttl = tonumber(ARGV[1])
local out = {}
for _, s in ipairs(states) do
	if ttl > 0 and (s == 'succeeded' or s == 'failed') then
		redis.call('ZREMRANGEBYSCORE', index[s], '-inf', '(' .. (now - ttl))
	end
	local n = redis.call('ZCARD', index[s])
	if n > 0 then
		local first = redis.call('ZRANGE', index[s], 0, 0, 'WITHSCORES')
		table.insert(out, s)
		table.insert(out, n)
		table.insert(out, first[2])
	end
end
return out`)

	// Removes the effect from both layouts.
	effectForgetScript = redis.NewScript(`
for i = 2, 5 do redis.call('ZREM', KEYS[i], ARGV[1]) end
for i = 8, 11 do redis.call('ZREM', KEYS[i], ARGV[1]) end
return redis.call('DEL', KEYS[1], KEYS[6], KEYS[7])`)
)

// run runs script on keys with args, and returns by ctx's deadline even
// when the client does not honour contexts' deadlines (watched): the
// script then goes on until its answer or the client's timeout, and the
// caller gets ctx's error, as unsure of what the script did as after a
// lost reply.
func (e *Effects) run(ctx context.Context, script *redis.Script, keys []string, args ...any) *redis.Cmd {
	cmd, err := watched(ctx, e.inline, func() (*redis.Cmd, error) {
		cmd := script.Run(ctx, e.client, keys, args...)
		return cmd, cmd.Err()
	}, nil)
	if cmd == nil { // the caller left first
		cmd = redis.NewCmd(ctx)
		cmd.SetErr(err)
	}
	return cmd
}

// Begin records intent as a pending effect held by the caller, or returns
// the effect that exists.
func (e *Effects) Begin(ctx context.Context, intent stores.EffectIntent, lease time.Duration) (bool, stores.Effect, error) {
	res, err := e.run(ctx, effectBeginScript, e.effectKeys(intent.Key), intent.Key, intent.Name, intent.Scope, intent.MessageID,
		strconv.FormatUint(intent.Fingerprint, 10), e.holder(ctx), ms(lease), e.legacy).Slice()
	if err != nil {
		return false, stores.Effect{}, fail(ctx, "begin effect", err)
	}
	return parseMoved(res)
}

// Transition moves the effect key as t says, when allowed.
func (e *Effects) Transition(ctx context.Context, key string, t stores.EffectTransition) (bool, stores.Effect, error) {
	args, err := e.moveArgs(ctx, key, t)
	if err != nil {
		return false, stores.Effect{}, err
	}
	res, err := e.run(ctx, effectMoveScript, e.effectKeys(key), append(args, e.legacy)...).Slice()
	if err != nil {
		return false, stores.Effect{}, fail(ctx, "effect transition", err)
	}
	return parseMoved(res)
}

func (e *Effects) moveArgs(ctx context.Context, key string, t stores.EffectTransition) ([]any, error) {
	sources := t.Sources()
	if len(sources) == 0 {
		return nil, fmt.Errorf("redisstore: %s to %s: %w", t.From, t.To, stores.ErrEffectTransition)
	}
	names := make([]string, len(sources))
	for i, s := range sources {
		names[i] = string(s)
	}
	flags := ""
	if t.IfIdle {
		flags += "i"
	}
	if t.Overrule {
		flags += "o"
	}
	return []any{key, strings.Join(names, ","), string(t.To), t.Result, t.Note, t.Evidence, ms(t.Lease), e.holder(ctx), ms(e.ttl), ms(e.rttl), flags}, nil
}

// Extend renews the caller's lease of the pending effect key.
func (e *Effects) Extend(ctx context.Context, key string, lease time.Duration) (bool, error) {
	held, err := e.run(ctx, effectExtendScript, e.effectKeys(key), e.holder(ctx), ms(lease), e.legacy).Int()
	if err != nil {
		return false, fail(ctx, "extend effect lease", err)
	}
	return held == 1, nil
}

// Lookup returns the effect key.
func (e *Effects) Lookup(ctx context.Context, key string) (stores.Effect, error) {
	res, err := e.run(ctx, effectLookupScript, e.effectKeys(key), e.legacy).Slice()
	if err != nil {
		return stores.Effect{}, fail(ctx, "look up effect", err)
	}
	_, found, err := parseMoved(res)
	return found, err
}

// ApplyEvent records eventID once and, the first time, applies t to key.
func (e *Effects) ApplyEvent(ctx context.Context, eventID, key string, t stores.EffectTransition) (stores.EventResult, error) {
	args, err := e.moveArgs(ctx, key, t)
	if err != nil {
		return stores.EventResult{}, err
	}
	keys := append(e.effectKeys(key), e.eventKey(eventID), e.legacyTag()+"ev:"+eventID)
	res, err := e.run(ctx, effectEventScript, keys, append(args, eventID, e.legacy)...).Slice()
	if err != nil {
		return stores.EventResult{}, fail(ctx, "apply effect event", err)
	}
	if len(res) < 5 {
		return stores.EventResult{}, errors.New("redisstore: apply effect event: short answer")
	}
	moved, now, err := parseMoved(res[:4])
	if err != nil {
		return stores.EventResult{}, err
	}
	first, _ := res[4].(int64)
	return stores.EventResult{First: first == 1, Moved: moved, Now: now}, nil
}

// List returns the effects q selects, oldest first.
func (e *Effects) List(ctx context.Context, q stores.EffectQuery) ([]stores.Effect, error) {
	q = q.Normalized()
	limit := q.Limit
	names := make([]string, len(q.States))
	for i, s := range q.States {
		names[i] = string(s)
	}
	before := "+inf"
	if !q.EnteredBefore.IsZero() {
		before = "(" + strconv.FormatInt(q.EnteredBefore.UnixMilli(), 10)
	}
	res, err := e.run(ctx, effectListScript, append([]string{e.tag}, e.indexKeys()...),
		strings.Join(names, ","), before, limit, ms(e.ttl), e.tag+"e:", e.tag+"r:").Slice()
	if err != nil {
		return nil, fail(ctx, "list effects", err)
	}
	now, _ := res[0].(int64)
	hashes, _ := res[1].([]any)
	out := make([]stores.Effect, 0, len(hashes))
	for _, h := range hashes {
		pair, _ := h.([]any)
		if len(pair) < 2 {
			return nil, errors.New("redisstore: list effects: short answer")
		}
		fields, _ := pair[0].([]any)
		eff, err := parseEffect(fields, pair[1], now)
		if err != nil {
			return nil, err
		}
		out = append(out, eff)
	}
	slices.SortStableFunc(out, func(a, b stores.Effect) int {
		if c := a.StateSince.Compare(b.StateSince); c != 0 {
			return c
		}
		return strings.Compare(a.Key, b.Key)
	})
	if len(out) > limit {
		out = out[:limit]
	}
	return out, nil
}

// Stats counts the effects in each state and finds the oldest.
func (e *Effects) Stats(ctx context.Context) (map[stores.EffectState]stores.EffectStat, error) {
	res, err := e.run(ctx, effectStatsScript, append([]string{e.tag}, e.indexKeys()...), ms(e.ttl)).Slice()
	if err != nil {
		return nil, fail(ctx, "effect stats", err)
	}
	out := map[stores.EffectState]stores.EffectStat{}
	for i := 0; i+2 < len(res); i += 3 {
		state, _ := res[i].(string)
		n, _ := res[i+1].(int64)
		oldest, _ := res[i+2].(string)
		at, err := strconv.ParseFloat(oldest, 64)
		if err != nil {
			return nil, fmt.Errorf("redisstore: effect stats: score %q: %w", oldest, err)
		}
		out[stores.EffectState(state)] = stores.EffectStat{Count: n, Oldest: time.UnixMilli(int64(at))}
	}
	return out, nil
}

// Forget removes the effect key.
func (e *Effects) Forget(ctx context.Context, key string) error {
	if err := e.run(ctx, effectForgetScript, e.effectKeys(key), key).Err(); err != nil {
		return fail(ctx, "forget effect", err)
	}
	return nil
}

// parseMoved reads a script's {moved, now, HGETALL, result} answer.
func parseMoved(res []any) (bool, stores.Effect, error) {
	if len(res) < 4 {
		return false, stores.Effect{}, errors.New("redisstore: effect script: short answer")
	}
	moved, _ := res[0].(int64)
	now, _ := res[1].(int64)
	fields, _ := res[2].([]any)
	eff, err := parseEffect(fields, res[3], now)
	return moved == 1, eff, err
}

// parseEffect reads an effect's hash fields (HGETALL) and its result
// string under a lifetime (nil: none, or expired) at the server time now
// (ms). No fields: no effect.
func parseEffect(fields []any, result any, now int64) (stores.Effect, error) {
	var e stores.Effect
	if len(fields) == 0 {
		return e, nil
	}
	var lease, rexp int64
	var err error
	num := func(s string) int64 {
		n, perr := strconv.ParseInt(s, 10, 64)
		if perr != nil && err == nil {
			err = fmt.Errorf("redisstore: effect field %q: %w", s, perr)
		}
		return n
	}
	at := func(s string) time.Time {
		if n := num(s); n > 0 {
			return time.UnixMilli(n)
		}
		return time.Time{}
	}
	for i := 0; i+1 < len(fields); i += 2 {
		name, _ := fields[i].(string)
		value, _ := fields[i+1].(string)
		switch name {
		case "key":
			e.Key = value
		case "name":
			e.Name = value
		case "scope":
			e.Scope = value
		case "mid":
			e.MessageID = value
		case "fp":
			e.Fingerprint, _ = strconv.ParseUint(value, 10, 64)
		case "state":
			e.State = stores.EffectState(value)
		case "result":
			e.Result = []byte(value)
		case "note":
			e.Note = value
		case "ev":
			e.Evidence = value
		case "att":
			e.Attempts = int(num(value))
		case "holder":
			e.Holder = value
		case "lease":
			lease = num(value)
		case "created":
			e.CreatedAt = at(value)
		case "since":
			e.StateSince = at(value)
		case "updated":
			e.UpdatedAt = at(value)
		case "expires":
			e.ExpiresAt = at(value)
		case "rexp":
			rexp = num(value)
		}
	}
	if rexp > 0 { // the result is a string of its own, gone once it expired
		e.ResultExpiresAt = time.UnixMilli(rexp)
		if r, ok := result.(string); ok && now < rexp {
			e.Result = []byte(r)
		} else {
			e.Result, e.ResultDropped = nil, true
		}
	}
	switch {
	case e.State == stores.EffectPending:
		e.LeaseUntil = time.UnixMilli(lease)
		e.LeaseLapsed = now >= lease
	case e.State == stores.EffectUnknown && lease > 0:
		e.LeaseUntil = time.UnixMilli(lease)
		e.Landing = now < lease
	}
	return e, err
}

// effectPurgeScript removes up to ARGV[3] final effects that entered
// their state before ARGV[1] (ms) with their index entries and results
// (ARGV[2] the hash prefix, ARGV[4] the result prefix), and reports {effects removed, entries looked at}.
var effectPurgeScript = redis.NewScript(luaNow + `
local removed, seen = 0, 0
for _, s in ipairs({'succeeded', 'failed'}) do
	local keys = redis.call('ZRANGE', index[s], '-inf', '(' .. ARGV[1], 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[3]))
	for _, k in ipairs(keys) do
		seen = seen + 1
		if redis.call('HGET', ARGV[2] .. k, 'state') == s then
			removed = removed + redis.call('DEL', ARGV[2] .. k)
			redis.call('DEL', ARGV[4] .. k)
		end
		redis.call('ZREM', index[s], k)
	end
end
return {removed, seen}`)

// eventPurgeScript deletes the event KEYS[1] when it was recorded before
// ARGV[1] (ms). An event recorded by a release that kept no time holds 1.
var eventPurgeScript = redis.NewScript(`
local at = tonumber(redis.call('GET', KEYS[1]))
if at and at < tonumber(ARGV[1]) then return redis.call('DEL', KEYS[1]) end
return 0`)

// Purge removes the final effects (succeeded, failed) that entered their
// state before before and the provider events recorded before it (those of
// a release that kept no time, whatever their age), and reports how many
// went. Pending and unknown effects stay, whatever their age. It works in
// batches (one script per thousand effects, a SCAN of the events), so a
// large purge never blocks the server for long.
func (e *Effects) Purge(ctx context.Context, before time.Time) (int64, error) {
	var total atomic.Int64
	keys := append([]string{e.tag}, e.indexKeys()...)
	for {
		res, err := e.run(ctx, effectPurgeScript, keys, before.UnixMilli(), e.tag+"e:", 1000, e.tag+"r:").Int64Slice()
		if err != nil {
			return total.Load(), fail(ctx, "purge effects", err)
		}
		total.Add(res[0])
		if res[1] == 0 {
			break
		}
	}
	scan := func(ctx context.Context, c redis.UniversalClient) error {
		err := e.scanKeys(ctx, c, globEscape(e.tag+"ev:")+"*", func(key string) error {
			n, err := e.run(ctx, eventPurgeScript, []string{key}, before.UnixMilli()).Int64()
			total.Add(n)
			return err
		})
		if err != nil {
			return fail(ctx, "purge effect events", err)
		}
		return nil
	}
	var err error
	if cc, ok := e.client.(*redis.ClusterClient); ok {
		err = cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return scan(ctx, c) })
	} else {
		err = scan(ctx, e.client)
	}
	return total.Load(), err
}

// effectRenameScript moves KEYS[1], an effect or an event of the old
// layout, to KEYS[2] (the same slot), its expiry kept, unless KEYS[2]
// exists (an effect begun again under the new layout is newer: the old one
// stays, and the answer is 0).
var effectRenameScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[1]) == 0 then return 1 end
return redis.call('RENAMENX', KEYS[1], KEYS[2])`)

// effectRenameIndexScript merges KEYS[1], the old index of state ARGV[2],
// into KEYS[2]: an entry is kept when the effect it names (ARGV[1] ..
// member, in the slot) is in that state, at the earlier of the two times.
var effectRenameIndexScript = redis.NewScript(`
local entries = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #entries, 2 do
	if redis.call('HGET', ARGV[1] .. entries[i], 'state') == ARGV[2] then
		redis.call('ZADD', KEYS[2], 'LT', entries[i + 1], entries[i])
	end
end
redis.call('DEL', KEYS[1])
return 1`)

// MigrateKeys renames the keys an Effects store of an earlier release
// wrote under this store's prefix ({prefix}e:…, {prefix}s:…,
// {prefix}ev:…, which did not start with the prefix) to the current layout
// (prefix{prefix}e:…), keeping their expiry; the two share a Cluster slot.
// Run it once, before workers of this release start, or with them stopped:
// until then they do not see the effects recorded before (a pending or
// unknown effect would be begun afresh, under the same provider key). It
// may run again; it reports the keys moved and those left because the new
// layout already held them (an effect begun again since).
func (e *Effects) MigrateKeys(ctx context.Context) (moved, left int64, err error) {
	old := "{" + e.prefix + "}"
	var nMoved, nLeft atomic.Int64 // the masters are scanned at once
	scan := func(ctx context.Context, c redis.UniversalClient) error {
		// Effects and events first: an index entry is kept only for an
		// effect already moved.
		for _, kind := range []string{"e:", "ev:", "s:"} {
			var failed string // the key whose script failed; "" for a SCAN
			err := e.scanKeys(ctx, c, globEscape(old+kind)+"*", func(key string) error {
				keys := []string{key, e.prefix + key}
				var ok int64
				var err error
				if kind == "s:" {
					ok, err = e.run(ctx, effectRenameIndexScript, keys, e.tag+"e:", strings.TrimPrefix(key, old+kind)).Int64()
				} else {
					ok, err = e.run(ctx, effectRenameScript, keys).Int64()
				}
				switch {
				case err != nil:
					failed = key
					return err
				case ok == 1:
					nMoved.Add(1)
				default:
					nLeft.Add(1)
				}
				return nil
			})
			switch {
			case err != nil && failed != "":
				return fail(ctx, fmt.Sprintf("migrate effect key %q", failed), err)
			case err != nil:
				return fail(ctx, "migrate effect keys", err)
			}
		}
		return nil
	}
	if cc, ok := e.client.(*redis.ClusterClient); ok {
		// The keys share one slot: only its master holds any.
		err = cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return scan(ctx, c) })
	} else {
		err = scan(ctx, e.client)
	}
	return nMoved.Load(), nLeft.Load(), err
}

// scanPage is a page of a SCAN: its keys, and the cursor of the next
// (0: the last).
type scanPage struct {
	keys []string
	next uint64
}

// scanKeys calls each with every key of c matching match, a SCAN page of
// up to a thousand at a time, and stops at each's first error. Every
// page's SCAN returns by ctx's deadline as a script does (see run), even
// when the client does not honour contexts' deadlines: the caller then
// gets ctx's error, and the SCAN goes on until its answer or the client's
// timeout.
func (e *Effects) scanKeys(ctx context.Context, c redis.UniversalClient, match string, each func(key string) error) error {
	var cursor uint64
	for {
		page, err := watched(ctx, e.inline, func() (scanPage, error) {
			keys, next, err := c.Scan(ctx, cursor, match, 1000).Result()
			return scanPage{keys, next}, err
		}, nil)
		if err != nil {
			return err
		}
		for _, key := range page.keys {
			if err := each(key); err != nil {
				return err
			}
		}
		if cursor = page.next; cursor == 0 {
			return nil
		}
	}
}

// globEscape escapes the characters SCAN's MATCH reads as a pattern.
func globEscape(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`*?[]\^`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}
