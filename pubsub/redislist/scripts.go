package redislist

import "github.com/redis/go-redis/v9"

// Scripts of the reliable-list layout. KEYS[1] <queue>, KEYS[2]
// <queue>:processing, KEYS[3] <queue>:processing:leases. Lease deadlines
// are Redis server time in milliseconds, so hosts' clocks do not matter.
// A lease member is a 16-character token followed by the stored value.
const leaseTokenLen = 16

var (
	// reserve first settles the previous message of the consumer, when
	// ARGV[3] is "ack" or "nack" (removes its lease and its reserved copy
	// ARGV[4] and, for a nack of a copy still reserved, pushes ARGV[6] on
	// the queue), then moves the head of the queue to the processing list
	// and leases it, all atomically and in one round trip. ARGV[1]
	// visibility ms, ARGV[2] token, ARGV[5] the previous lease member.
	// Returns {copies settled, value or nil}.
	reserveScript = redis.NewScript(`
local settled = 0
if ARGV[3] ~= '' then
  redis.call('ZREM', KEYS[3], ARGV[5])
  settled = redis.call('LREM', KEYS[2], 1, ARGV[4])
  if settled == 1 and ARGV[3] == 'nack' then
    redis.call('RPUSH', KEYS[1], ARGV[6])
  end
end
local v = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
if v then
  local t = redis.call('TIME')
  redis.call('ZADD', KEYS[3], t[1] * 1000 + math.floor(t[2] / 1000) + tonumber(ARGV[1]), ARGV[2] .. v)
end
return {settled, v}
`)

	// lease sets (ARGV[3] = "NX": adds; "XX": only extends) a lease.
	// KEYS[1] leases; ARGV[1] visibility ms, ARGV[2] member.
	leaseScript = redis.NewScript(`
local t = redis.call('TIME')
return redis.call('ZADD', KEYS[1], ARGV[3], t[1] * 1000 + math.floor(t[2] / 1000) + tonumber(ARGV[1]), ARGV[2])
`)

	// ack removes the reserved copy and its lease. ARGV[1] value,
	// ARGV[2] member. Returns the number of copies removed (0 when the
	// lease lapsed and the value went back to the queue).
	ackScript = redis.NewScript(`
redis.call('ZREM', KEYS[3], ARGV[2])
return redis.call('LREM', KEYS[2], 1, ARGV[1])
`)

	// requeue removes the reserved copy and its lease and, only when the
	// copy was still reserved, pushes ARGV[3] on the queue: at the tail
	// when ARGV[4] is "RPUSH" (a nack), at the head when "LPUSH" (a
	// message no handler took). ARGV[1] value, ARGV[2] member.
	requeueScript = redis.NewScript(`
redis.call('ZREM', KEYS[3], ARGV[2])
if redis.call('LREM', KEYS[2], 1, ARGV[1]) == 1 then
  redis.call(ARGV[4], KEYS[1], ARGV[3])
  return 1
end
return 0
`)

	// reclaim moves back to the queue the values whose lease lapsed, at
	// most ARGV[1] of them; only values leased by this package, never a
	// value an SDK worker reserved.
	reclaimScript = redis.NewScript(`
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local n = 0
for _, m in ipairs(due) do
  redis.call('ZREM', KEYS[3], m)
  local v = string.sub(m, 17)
  if redis.call('LREM', KEYS[2], 1, v) == 1 then
    redis.call('RPUSH', KEYS[1], v)
    n = n + 1
  end
end
return n
`)
)

// Scripts of the Laravel layout, as in Laravel's Illuminate\Queue\LuaScripts.
// KEYS[1] queues:<name>, KEYS[2] :reserved, KEYS[3] :delayed, KEYS[4]
// :notify unless said otherwise. Times are Unix seconds of the caller, as
// Laravel's.
var (
	// laravelPush pushes each ARGV onto the ready list with one notify
	// entry each. KEYS[1] ready, KEYS[2] notify.
	laravelPushScript = redis.NewScript(`
for i = 1, #ARGV do
  redis.call('RPUSH', KEYS[1], ARGV[i])
  redis.call('RPUSH', KEYS[2], 1)
end
return #ARGV
`)

	// laravelMigrate moves the members of KEYS[1] (the delayed or the
	// reserved set) scored at or before ARGV[1] to the ready list KEYS[2],
	// with a notify entry each on KEYS[3].
	laravelMigrateScript = redis.NewScript(`
local val = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if next(val) ~= nil then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, #val - 1)
  for i = 1, #val, 100 do
    redis.call('RPUSH', KEYS[2], unpack(val, i, math.min(i + 99, #val)))
    for j = i, math.min(i + 99, #val) do
      redis.call('RPUSH', KEYS[3], 1)
    end
  end
end
return #val
`)

	// laravelPop reserves the head of the ready list until ARGV[1] and
	// takes a notify entry. KEYS[1] ready, KEYS[2] reserved, KEYS[3]
	// notify; ARGV[2] the reservation's token, ARGV[3]
	// (LaravelReservationKey) the member that carries it, ARGV[4]
	// (FrameKey) and ARGV[5] (FrameBodyBase64Key) the members of a
	// wrapper. Returns {job, reserved member}, or nils with nothing ready.
	//
	// The reserved member is the job with byte edits only, never a
	// re-encoding (Lua's JSON library keeps 14 significant digits, writes
	// [] as {} and refuses numbers beyond float64): the digits of each
	// top-level "attempts" one higher, and the token as the value of the
	// member ARGV[3], written in place when the job has one (a reservation
	// that lapsed) and else as the object's first member, as the Go side's
	// withMember does. A value that is not a JSON object with an integer
	// "attempts" (what the Go side's isLaravelJob accepts) is reserved
	// wrapped, as a Laravel job carrying it base64-encoded, so that it
	// comes back, should the reservation lapse, as a job Laravel's pop
	// takes. Working out the member cannot fail the script (it runs under
	// pcall, and anything it does not follow is wrapped), and the job
	// leaves the ready list (LINDEX first, LPOP last) only once its
	// reservation is written: no job is lost to an error.
	laravelPopScript = redis.NewScript(`
local job = redis.call('LINDEX', KEYS[1], 0)
if not job then
  return {false, false}
end
local token = '"' .. ARGV[2] .. '"'

local function ws(s, i)
  return string.find(s, '[^ \t\r\n]', i) or #s + 1
end
-- the index after the JSON string that starts at i
local function strend(s, i)
  local j = i + 1
  while true do
    local k = string.find(s, '["\\]', j)
    if not k then error('unterminated string') end
    if string.byte(s, k) == 34 then return k + 1 end
    j = k + 2
  end
end
-- the index after the JSON value that starts at i
local function valend(s, i)
  local c = string.byte(s, i)
  if c == 34 then return strend(s, i) end
  if c == 123 or c == 91 then
    local depth, j = 0, i
    while true do
      local k = string.find(s, '["{}%[%]]', j)
      if not k then error('unbalanced') end
      local b = string.byte(s, k)
      if b == 34 then
        j = strend(s, k)
      else
        if b == 123 or b == 91 then depth = depth + 1 else depth = depth - 1 end
        j = k + 1
        if depth == 0 then return j end
      end
    end
  end
  local k = string.find(s, '[,}%] \t\r\n]', i) or #s + 1
  if k == i then error('no value') end
  return k
end
-- a member name as decoded, as far as telling ASCII names apart needs
local escapes = {b = '\b', f = '\f', n = '\n', r = '\r', t = '\t'}
local function name(raw)
  if not string.find(raw, '\\', 1, true) then return raw end
  local out, i = {}, 1
  while i <= #raw do
    local c = string.sub(raw, i, i)
    if c ~= '\\' then
      out[#out + 1] = c
      i = i + 1
    elseif string.sub(raw, i + 1, i + 1) == 'u' then
      local n = tonumber(string.sub(raw, i + 2, i + 5), 16)
      out[#out + 1] = (n and n < 128) and string.char(n) or '\255'
      i = i + 6
    else
      local e = string.sub(raw, i + 1, i + 1)
      out[#out + 1] = escapes[e] or e
      i = i + 2
    end
  end
  return table.concat(out)
end
-- the decimal integer d plus one, as Go's strconv counts it (saturating at
-- the largest int64); nil when d is not a JSON integer within int64
local function incr(d)
  local neg, digits = string.match(d, '^(%-?)(%d+)$')
  if not digits or (#digits > 1 and string.sub(digits, 1, 1) == '0') then return nil end
  local limit = neg == '-' and '9223372036854775808' or '9223372036854775807'
  if #digits > 19 or (#digits == 19 and digits > limit) then return nil end
  if neg == '' and digits == limit then return digits end
  local b = {string.byte(digits, 1, -1)}
  if neg == '' then
    local i = #b
    while i > 0 and b[i] == 57 do b[i] = 48; i = i - 1 end
    if i == 0 then return '1' .. string.char(unpack(b)) end
    b[i] = b[i] + 1
    return string.char(unpack(b))
  end
  if digits == '0' or digits == '1' then return digits == '0' and '1' or '0' end
  local i = #b
  while b[i] == 48 do b[i] = 57; i = i - 1 end
  b[i] = b[i] - 1
  local s = string.char(unpack(b))
  if string.sub(s, 1, 1) == '0' then s = string.sub(s, 2) end
  return '-' .. s
end
-- the reserved member of a Laravel job, or nil when job is not one
local function reserve()
  local ok, decoded = pcall(cjson.decode, job)
  if not ok or type(decoded) ~= 'table' then return nil end
  local i = ws(job, 1)
  if string.byte(job, i) ~= 123 then return nil end
  local open = i
  local edits, counted, placed = {}, false, false
  i = ws(job, i + 1)
  if string.byte(job, i) ~= 125 then
    while true do
      if string.byte(job, i) ~= 34 then return nil end
      local e = strend(job, i)
      local n = name(string.sub(job, i + 1, e - 2))
      i = ws(job, e)
      if string.byte(job, i) ~= 58 then return nil end
      local vs = ws(job, i + 1)
      local ve = valend(job, vs)
      if n == 'attempts' then
        local v = incr(string.sub(job, vs, ve - 1))
        if not v then return nil end
        edits[#edits + 1] = {vs, ve, v}
        counted = true
      elseif n == ARGV[3] then
        edits[#edits + 1] = {vs, ve, token}
        placed = true
      end
      i = ws(job, ve)
      local c = string.byte(job, i)
      if c == 125 then break end
      if c ~= 44 then return nil end
      i = ws(job, i + 1)
    end
  end
  if not counted or ws(job, i + 1) <= #job then return nil end
  local out, last = {}, 1
  if not placed then
    out[1] = string.sub(job, 1, open) .. '"' .. ARGV[3] .. '":' .. token .. ','
    last = open + 1
  end
  for _, e in ipairs(edits) do
    out[#out + 1] = string.sub(job, last, e[1] - 1)
    out[#out + 1] = e[3]
    last = e[2]
  end
  out[#out + 1] = string.sub(job, last)
  return table.concat(out)
end
-- the job wrapped: a Laravel job carrying it base64-encoded
local function wrap()
  local alphabet = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/'
  local out = {}
  for i = 1, #job, 3 do
    local a, b, c = string.byte(job, i, i + 2)
    local n = a * 65536 + (b or 0) * 256 + (c or 0)
    local d1, d2 = math.floor(n / 262144) + 1, math.floor(n / 4096) % 64 + 1
    local d3, d4 = math.floor(n / 64) % 64 + 1, n % 64 + 1
    out[#out + 1] = string.sub(alphabet, d1, d1) .. string.sub(alphabet, d2, d2) ..
      (b and string.sub(alphabet, d3, d3) or '=') .. (c and string.sub(alphabet, d4, d4) or '=')
  end
  return '{"' .. ARGV[3] .. '":' .. token .. ',"attempts":1,"' .. ARGV[4] .. '":1,"' .. ARGV[5] .. '":"' .. table.concat(out) .. '"}'
end

local ok, reserved = pcall(reserve)
if not ok or not reserved then
  reserved = wrap()
end
redis.call('ZADD', KEYS[2], ARGV[1], reserved)
redis.call('LPOP', KEYS[1])
redis.call('LPOP', KEYS[3])
return {job, reserved}
`)

	// laravelRelease removes the reserved member ARGV[1] and, when it was
	// still reserved, adds ARGV[3] to the delayed set at ARGV[2]. KEYS[1]
	// delayed, KEYS[2] reserved.
	laravelReleaseScript = redis.NewScript(`
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
  return 1
end
return 0
`)
)

// laravelGiveBackScript puts a job no handler took back at the head of the
// ready list, as it was before the pop, with a notify entry. KEYS[1]
// ready, KEYS[2] reserved, KEYS[3] notify; ARGV[1] reserved member,
// ARGV[2] job.
var laravelGiveBackScript = redis.NewScript(`
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('LPUSH', KEYS[1], ARGV[2])
  redis.call('RPUSH', KEYS[3], 1)
  return 1
end
return 0
`)
