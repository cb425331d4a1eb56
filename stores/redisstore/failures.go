package redisstore

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/babelqueue/watermill-idempotency/stores"
)

// A message that failed is kept under its record's one Redis key, like
// every other state of it, so that every call stays one key and one
// script (a Redis Cluster never sees two slots):
//
//	f{json}                                   failing: the count (Store.Fail without an end)
//	e<n>:<marker>{json}                       ended: the end's redrive marker (n bytes), then the rest
//	k<lease>:<expires>:<n>:<holder>f{json}    a claim that carries a count
//
// The JSON keeps the kept fingerprint ("fp"), the failed runs ("n"), the
// first failure and the next run's earliest start (Unix milliseconds,
// "first" and "next") and, ended, the reason, when and the dead-letter
// topic ("reason", "at", "topic"). A failing or ended record expires with
// the store's TTL (PX). A claim that carries a count names its holder (the
// claim value, n bytes) and keeps the failing record it carries whole;
// its lease and the failing record's expiry are Unix milliseconds of the
// server's clock (0: never), and the key expires at the later of the two,
// so a holder that dies leaves the count behind when its lease lapses: the
// scripts read such a claim past its lease as the failing record it
// carries.
const (
	failingMark = "f"
	endedMark   = "e"
	countMark   = "k"
)

// luaCounts is the prelude of the scripts that read or write a claim that
// carries a count.
const luaCounts = `
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

// failSource records a failure: ARGV[1] is the caller's claim value,
// ARGV[2] "f" (failing) or "e" (ended), ARGV[3] the record, ARGV[4] the
// store's TTL in milliseconds ("0": none). It returns 0, writing nothing,
// over another holder's live claim; 2, writing nothing, over a remembered
// record; 1 when it wrote. Without an end, the caller's live claim stays
// (its lease kept) and carries the count; otherwise the record replaces
// what is there.
const failSource = luaCounts + `
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

var failScript = redis.NewScript(failSource)

// claimCountSource claims a key whose SET NX found a failing record or a
// claim that carries a count (ARGV[1] the caller's claim value, ARGV[2]
// the lease in milliseconds). It returns {1} for a claim taken over
// nothing (the record went meanwhile) or the caller's own plain claim;
// {1, failing} for a claim that carries failing (taken over a failing
// record or a lapsed claim, or the caller's own, its lease kept); {0, v}
// with what stood in the way otherwise.
const claimCountSource = luaCounts + `
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

var claimCountScript = redis.NewScript(claimCountSource)

// reopenSource drops an ended record whose value starts with ARGV[1] (the
// mark, the marker's length and the marker), and returns 1 if it did.
const reopenSource = `
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, #ARGV[1]) == ARGV[1] then
	return redis.call('DEL', KEYS[1])
end
return 0`

var reopenScript = redis.NewScript(reopenSource)

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

// unixMilli is t in Unix milliseconds, 0 for the zero time.
func unixMilli(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixMilli()
}

// fromUnixMilli is the time of ms, the zero time for 0.
func fromUnixMilli(ms int64) time.Time {
	if ms == 0 {
		return time.Time{}
	}
	return time.UnixMilli(ms)
}

// endedPrefix is the start of an ended record whose end has marker.
func endedPrefix(marker string) string {
	return endedMark + strconv.Itoa(len(marker)) + ":" + marker
}

// failureValue is the value of the failing or ended record f, with the kept
// fingerprint kept.
func failureValue(kept uint64, f stores.Failure) string {
	doc := failureDoc{Fingerprint: kept, Attempts: f.Attempts, First: unixMilli(f.FirstFailure), Next: unixMilli(f.NotBefore)}
	prefix := failingMark
	if f.End != nil {
		doc.Reason, doc.At, doc.Topic = f.End.Reason, unixMilli(f.End.At), f.End.Topic
		prefix = endedPrefix(f.End.Marker)
	}
	b, _ := json.Marshal(doc) // never fails: numbers and strings
	return prefix + string(b)
}

// parseFailure reads a failing ("f") or ended ("e") record's value.
func parseFailure(v string) stores.Record {
	r := stores.Record{State: stores.StateFailing}
	var marker string
	body := v[1:]
	if v[:1] == endedMark {
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
	r.Failure = stores.Failure{Attempts: doc.Attempts, FirstFailure: fromUnixMilli(doc.First), NotBefore: fromUnixMilli(doc.Next)}
	if r.State == stores.StateEnded {
		r.Failure.NotBefore = time.Time{}
		r.Failure.End = &stores.End{Reason: doc.Reason, At: fromUnixMilli(doc.At), Topic: doc.Topic, Marker: marker}
	}
	return r
}

// countClaim is a claim that carries a count, read.
type countClaim struct {
	lease, expires int64  // Unix milliseconds of the server's clock; expires 0: never
	holder         string // the claim value
	failing        string // the failing record it carries
}

// parseCountClaim reads the value of a claim that carries a count ("k").
func parseCountClaim(v string) (countClaim, bool) {
	var c countClaim
	fields := strings.SplitN(v[1:], ":", 4)
	if len(fields) != 4 {
		return c, false
	}
	var err1, err2, err3 error
	var n int
	c.lease, err1 = strconv.ParseInt(fields[0], 10, 64)
	c.expires, err2 = strconv.ParseInt(fields[1], 10, 64)
	n, err3 = strconv.Atoi(fields[2])
	rest := fields[3]
	if err1 != nil || err2 != nil || err3 != nil || n < 0 || n > len(rest) || !strings.HasPrefix(rest[n:], failingMark) {
		return c, false
	}
	c.holder, c.failing = rest[:n], rest[n:]
	return c, true
}

// inFlight is the record of c while its lease lasts: in flight, with the
// count it carries.
func (c countClaim) inFlight() stores.Record {
	r := parseFailure(c.failing)
	r.State = stores.StateInFlight
	return r
}

// lookupCount is the record of the claim that carries a count v, as
// Lookup reports it at now (Unix milliseconds of the server's clock): in
// flight while its lease lasts, then the failing record it carries.
func lookupCount(v string, now int64) stores.Record {
	c, ok := parseCountClaim(v)
	if !ok {
		return stores.Record{State: stores.StateInFlight}
	}
	if c.lease > now {
		r := c.inFlight()
		r.ExpiresAt = time.Now().Add(time.Duration(c.lease-now) * time.Millisecond)
		return r
	}
	if c.expires != 0 && c.expires <= now {
		return stores.Record{}
	}
	r := parseFailure(c.failing)
	if c.expires != 0 {
		r.ExpiresAt = time.Now().Add(time.Duration(c.expires-now) * time.Millisecond)
	}
	return r
}

// claimCount claims rk, whose SET NX found a failing record or a claim
// that carries a count, for holder: one EVALSHA of a script that takes the
// failing record over, or reports what is in the way.
func (s *Store) claimCount(ctx context.Context, rk, holder string, lease time.Duration) (bool, stores.Record, error) {
	cmd, err := s.evalLate(ctx, s, claimCountScript, claimCountSource, rk, holder, lease.Milliseconds())
	if err != nil {
		s.gaveUp(ctx, err, rk, holder, lease)
		return false, stores.Record{}, fmt.Errorf("redisstore: claim: %w", err)
	}
	reply, _ := cmd.Val().([]any)
	if len(reply) == 0 {
		return false, stores.Record{}, fmt.Errorf("redisstore: claim: unexpected reply %v", cmd.Val())
	}
	claimed := reply[0] == int64(1)
	if len(reply) < 2 {
		return claimed, stores.Record{}, nil
	}
	v, _ := reply[1].(string)
	if claimed {
		return true, parseFailure(v), nil
	}
	return false, s.parseValue(v), nil
}

// Fail records that key's runs failed (and, with f.End, that it ended); see
// [stores.Store]: one EVALSHA of a script. Without an end, the caller's
// live claim stays, its lease kept, and carries the count. It returns an
// error matching stores.ErrClaimTaken, writing nothing, when another
// holder's live claim is on key, and writes nothing over a remembered
// record. The record expires with the store's TTL.
func (s *Store) Fail(ctx context.Context, key string, fingerprint uint64, f stores.Failure) error {
	kind := failingMark
	if f.End != nil {
		kind = endedMark
	}
	ttl := s.ttlArg
	if ttl == nil {
		ttl = noExpiry
	}
	cmd, err := s.eval(ctx, failScript, failSource, s.RedisKey(key), s.claimValue(ctx), kind,
		failureValue(keptFingerprint(fingerprint), f), ttl)
	switch {
	case err != nil:
		return fmt.Errorf("redisstore: fail: %w", err)
	case cmd.Val() == int64(0):
		return fmt.Errorf("redisstore: fail: %w", stores.ErrClaimTaken)
	}
	return nil
}

// Reopen drops key's ended record when its end's marker is marker, and
// reports whether it did; see [stores.Store]. One EVALSHA of a
// compare-and-delete script: of concurrent Reopens, one drops it.
func (s *Store) Reopen(ctx context.Context, key string, marker string) (bool, error) {
	cmd, err := s.eval(ctx, reopenScript, reopenSource, s.RedisKey(key), endedPrefix(marker))
	if err != nil {
		return false, fmt.Errorf("redisstore: reopen: %w", err)
	}
	return cmd.Val() == int64(1), nil
}
