// Package failrec is the layout of the failing and ended records, and of
// the claims that carry a count, that the Redis stores keep in one Redis
// key per message (redisstore in its record's key, sdkstore's Go SDK
// layout in the kit's claim key, its PHP layout beside the SDK's key), and
// the Lua scripts that read and write them, so that every call on one
// message is one script on one key (a Redis Cluster never sees two
// slots):
//
//	c<holder>                                 a claim (the holder's token after the mark)
//	f{json}                                   failing: the count (Store.Fail without an end)
//	e<n>:<marker>{json}                       ended: the end's redrive marker (n bytes), then the rest
//	k<lease>:<expires>:<n>:<holder>f{json}    a claim that carries a count
//
// The JSON keeps the kept fingerprint ("fp"), the failed runs ("n"), the
// first failure and the next run's earliest start (Unix milliseconds,
// "first" and "next") and, ended, the reason, when and the dead-letter
// topic ("reason", "at", "topic"). A failing or ended record expires with
// its store's TTL (PX). A claim that carries a count names its holder (the
// claim value "c<token>", n bytes) and keeps the failing record it carries
// whole; its lease and the failing record's expiry are Unix milliseconds
// of the server's clock (0: never), and the key expires at the later of
// the two, so a holder that dies leaves the count behind when its lease
// lapses: the scripts read such a claim past its lease as the failing
// record it carries.
package failrec

import (
	"encoding/json"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// The marks that start a value.
const (
	ClaimMark   = "c"
	FailingMark = "f"
	EndedMark   = "e"
	CountMark   = "k"
)

// LuaCounts is the prelude of the scripts that read or write a claim that
// carries a count: now_ms() (the server's clock), count_claim(v) (lease,
// expiry, holder and failing record of such a claim), put_count and
// put_failing (write one, with the key's expiry), expires_at(now, ttl).
const LuaCounts = `
local function now_ms()
	local t = redis.call('TIME')
	return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function count_claim(v)
	local lease, exp, n, at = string.match(v, '^k(%d+):(%d+):(%d+):()')
	n = tonumber(n)
	return tonumber(lease), tonumber(exp), string.sub(v, at, at + n - 1), string.sub(v, at + n)
end
local function put_count(key, lease, exp, holder, failing)
	local v = 'k' .. string.format('%d', lease) .. ':' .. string.format('%d', exp) .. ':' .. string.format('%d', #holder) .. ':' .. holder .. failing
	if exp == 0 then
		return redis.call('SET', key, v)
	end
	return redis.call('SET', key, v, 'PXAT', string.format('%d', math.max(lease, exp)))
end
local function put_failing(key, failing, exp, now)
	if exp == 0 then
		return redis.call('SET', key, failing)
	end
	if exp <= now then
		return redis.call('DEL', key)
	end
	return redis.call('SET', key, failing, 'PXAT', string.format('%d', exp))
end
local function expires_at(now, ttl)
	if ttl == '0' then return 0 end
	return now + tonumber(ttl)
end
`

// FailSource records a failure on KEYS[1]: ARGV[1] is the caller's claim
// value, ARGV[2] "f" (failing) or "e" (ended), ARGV[3] the record (Value),
// ARGV[4] the TTL in milliseconds ("0": none). It returns 0, writing
// nothing, over another holder's live claim; 2, writing nothing, over a
// value that is none of the above (a remembered record of redisstore); 1
// when it wrote. Without an end, the caller's live claim stays (its lease
// kept) and carries the count; otherwise the record replaces what is
// there.
const FailSource = LuaCounts + `
local v = redis.call('GET', KEYS[1])
if v then
	local m = string.sub(v, 1, 1)
	if m == 'c' then
		if v ~= ARGV[1] then return 0 end
		if ARGV[2] == 'f' then
			local now = now_ms()
			put_count(KEYS[1], now + math.max(redis.call('PTTL', KEYS[1]), 0), expires_at(now, ARGV[4]), v, ARGV[3])
			return 1
		end
	elseif m == 'k' then
		local lease, exp, holder = count_claim(v)
		local now = now_ms()
		if lease > now then
			if holder ~= ARGV[1] then return 0 end
			if ARGV[2] == 'f' then
				put_count(KEYS[1], lease, expires_at(now, ARGV[4]), holder, ARGV[3])
				return 1
			end
		end
	elseif m ~= 'f' and m ~= 'e' then
		return 2
	end
end
if ARGV[4] == '0' then
	redis.call('SET', KEYS[1], ARGV[3])
else
	redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
end
return 1`

// FailScript runs FailSource.
var FailScript = redis.NewScript(FailSource)

// ClaimSource claims KEYS[1] (ARGV[1] the caller's claim value, ARGV[2] the
// lease in milliseconds), taking a failing record or a lapsed claim that
// carries a count over. It returns {1} for a claim taken over nothing or
// the caller's own plain claim; {1, failing} for a claim that carries
// failing (taken over a failing record or a lapsed claim, or the caller's
// own, its lease kept); {0, v} with what stood in the way otherwise.
const ClaimSource = LuaCounts + `
local v = redis.call('GET', KEYS[1])
if not v then
	redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
	return {1}
end
if v == ARGV[1] then return {1} end
local m = string.sub(v, 1, 1)
local now, exp, failing
if m == 'f' then
	now = now_ms()
	local ttl = redis.call('PTTL', KEYS[1])
	exp, failing = 0, v
	if ttl > 0 then exp = now + ttl end
elseif m == 'k' then
	local lease, holder
	lease, exp, holder, failing = count_claim(v)
	now = now_ms()
	if lease > now then
		if holder == ARGV[1] then return {1, failing} end
		return {0, v}
	end
	if exp ~= 0 and exp <= now then
		redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
		return {1}
	end
else
	return {0, v}
end
put_count(KEYS[1], now + tonumber(ARGV[2]), exp, ARGV[1], failing)
return {1, failing}`

// ClaimScript runs ClaimSource.
var ClaimScript = redis.NewScript(ClaimSource)

// ReopenSource drops an ended record whose value starts with ARGV[1]
// (EndedPrefix of the marker), and returns 1 if it did.
const ReopenSource = `
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, #ARGV[1]) == ARGV[1] then
	return redis.call('DEL', KEYS[1])
end
return 0`

// ReopenScript runs ReopenSource.
var ReopenScript = redis.NewScript(ReopenSource)

// ReleaseSource deletes a claim only if the caller holds it (ARGV[1], the
// claim's value, which no record has). A claim of the caller's that
// carries a count leaves the failing record it carries behind.
const ReleaseSource = LuaCounts + `
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
	return redis.call('DEL', KEYS[1])
end
if v and string.byte(v, 1) == 107 then
	local lease, exp, holder, failing = count_claim(v)
	if holder == ARGV[1] then
		put_failing(KEYS[1], failing, exp, now_ms())
		return 1
	end
end
return 0`

// ReleaseScript runs ReleaseSource.
var ReleaseScript = redis.NewScript(ReleaseSource)

// ExtendSource sets the expiry of a claim to ARGV[2] milliseconds from now
// only if the caller holds it (ARGV[1], the claim's value): never another
// holder's claim, never a record. A lapsed claim is gone, so not held; a
// claim that carries a count is held while its lease lasts.
const ExtendSource = LuaCounts + `
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
	return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if v and string.byte(v, 1) == 107 then
	local lease, exp, holder, failing = count_claim(v)
	local now = now_ms()
	if holder == ARGV[1] and lease > now then
		put_count(KEYS[1], now + tonumber(ARGV[2]), exp, holder, failing)
		return 1
	end
end
return 0`

// ExtendScript runs ExtendSource.
var ExtendScript = redis.NewScript(ExtendSource)

// InspectSource returns a key's value and its remaining time to live in
// milliseconds, or nothing when the key does not exist; with a claim that
// carries a count, the server's clock too (in Unix milliseconds), to tell
// whether its lease lasts.
const InspectSource = `
local v = redis.call('GET', KEYS[1])
if not v then return {} end
if string.byte(v, 1) == 107 then
	local t = redis.call('TIME')
	return {v, redis.call('PTTL', KEYS[1]), tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}
end
return {v, redis.call('PTTL', KEYS[1])}`

// InspectScript runs InspectSource.
var InspectScript = redis.NewScript(InspectSource)

// failureDoc is the JSON of a failing or ended record.
type failureDoc struct {
	Fingerprint uint64 `json:"fp,omitempty"`
	Attempts    int    `json:"n"`
	First       int64  `json:"first,omitempty"`
	Next        int64  `json:"next,omitempty"`
	Reason      string `json:"reason,omitempty"`
	At          int64  `json:"at,omitempty"`
	Topic       string `json:"topic,omitempty"`
}

// UnixMilli is t in Unix milliseconds, 0 for the zero time: how the
// failure records of every store keep their times.
func UnixMilli(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixMilli()
}

// FromUnixMilli is the time of ms, the zero time for 0 (the inverse of
// UnixMilli).
func FromUnixMilli(ms int64) time.Time {
	if ms == 0 {
		return time.Time{}
	}
	return time.UnixMilli(ms)
}

// EndedPrefix is the start of an ended record whose end has marker.
func EndedPrefix(marker string) string {
	return EndedMark + strconv.Itoa(len(marker)) + ":" + marker
}

// Value is the value of the failing or ended record f, with the kept
// fingerprint kept.
func Value(kept uint64, f stores.Failure) string {
	doc := failureDoc{Fingerprint: kept, Attempts: f.Attempts, First: UnixMilli(f.FirstFailure), Next: UnixMilli(f.NotBefore)}
	prefix := FailingMark
	if f.End != nil {
		doc.Reason, doc.At, doc.Topic = f.End.Reason, UnixMilli(f.End.At), f.End.Topic
		prefix = EndedPrefix(f.End.Marker)
	}
	b, _ := json.Marshal(doc) // never fails: numbers and strings
	return prefix + string(b)
}

// Parse reads a failing ("f") or ended ("e") record's value.
func Parse(v string) stores.Record {
	r := stores.Record{State: stores.StateFailing}
	var marker string
	body := v[1:]
	if v[:1] == EndedMark {
		r.State = stores.StateEnded
		n, rest, _ := strings.Cut(body, ":")
		size, err := strconv.Atoi(n)
		if err != nil || size < 0 || size > len(rest) {
			return r // not a value this store writes
		}
		marker, body = rest[:size], rest[size:]
	}
	var doc failureDoc
	_ = json.Unmarshal([]byte(body), &doc) // a damaged record keeps its state, without a count
	r.Fingerprint = doc.Fingerprint
	r.Failure = stores.Failure{Attempts: doc.Attempts, FirstFailure: FromUnixMilli(doc.First), NotBefore: FromUnixMilli(doc.Next)}
	if r.State == stores.StateEnded {
		r.Failure.NotBefore = time.Time{}
		r.Failure.End = &stores.End{Reason: doc.Reason, At: FromUnixMilli(doc.At), Topic: doc.Topic, Marker: marker}
	}
	return r
}

// CountClaim is a claim that carries a count, read.
type CountClaim struct {
	Lease, Expires int64  // Unix milliseconds of the server's clock; Expires 0: never
	Holder         string // the claim value
	Failing        string // the failing record it carries
}

// ParseCountClaim reads the value of a claim that carries a count ("k").
func ParseCountClaim(v string) (CountClaim, bool) {
	var c CountClaim
	fields := strings.SplitN(v[1:], ":", 4)
	if len(fields) != 4 {
		return c, false
	}
	var err1, err2, err3 error
	var n int
	c.Lease, err1 = strconv.ParseInt(fields[0], 10, 64)
	c.Expires, err2 = strconv.ParseInt(fields[1], 10, 64)
	n, err3 = strconv.Atoi(fields[2])
	rest := fields[3]
	if err1 != nil || err2 != nil || err3 != nil || n < 0 || n > len(rest) || !strings.HasPrefix(rest[n:], FailingMark) {
		return c, false
	}
	c.Holder, c.Failing = rest[:n], rest[n:]
	return c, true
}

// InFlight is the record of c while its lease lasts: in flight, with the
// count it carries.
func (c CountClaim) InFlight() stores.Record {
	r := Parse(c.Failing)
	r.State = stores.StateInFlight
	return r
}

// LookupCount is the record of the claim that carries a count v, as
// Lookup reports it at now (Unix milliseconds of the server's clock): in
// flight while its lease lasts, then the failing record it carries.
func LookupCount(v string, now int64) stores.Record {
	c, ok := ParseCountClaim(v)
	if !ok {
		return stores.Record{State: stores.StateInFlight}
	}
	if c.Lease > now {
		r := c.InFlight()
		r.ExpiresAt = time.Now().Add(time.Duration(c.Lease-now) * time.Millisecond)
		return r
	}
	if c.Expires != 0 && c.Expires <= now {
		return stores.Record{}
	}
	r := Parse(c.Failing)
	if c.Expires != 0 {
		r.ExpiresAt = time.Now().Add(time.Duration(c.Expires-now) * time.Millisecond)
	}
	return r
}
