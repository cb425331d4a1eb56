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

	// laravelPop pops the ready list, reserves the job until ARGV[1] with
	// "attempts" one higher and its member ARGV[3] (LaravelReservationKey)
	// set to the token ARGV[2], so that no two reservations are one member
	// of the set, and takes a notify entry. KEYS[1] ready, KEYS[2]
	// reserved, KEYS[3] notify. Returns {job, reserved member}. A value
	// that is not a JSON object with a numeric "attempts" is reserved
	// wrapped, as a Laravel job that carries it base64-encoded: ARGV[4]
	// (FrameKey) 1 and ARGV[5] (FrameBodyBase64Key), instead of being lost
	// in a script error, and so that it comes back, should the reservation
	// lapse, as a job Laravel's pop takes.
	laravelPopScript = redis.NewScript(`
local job = redis.call('LPOP', KEYS[1])
local reserved = false
if job ~= false then
  local ok, decoded = pcall(cjson.decode, job)
  if not (ok and type(decoded) == 'table' and type(decoded['attempts']) == 'number') then
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
    decoded = {attempts = 0}
    decoded[ARGV[4]] = 1
    decoded[ARGV[5]] = table.concat(out)
  end
  decoded['attempts'] = decoded['attempts'] + 1
  decoded[ARGV[3]] = ARGV[2]
  reserved = cjson.encode(decoded)
  redis.call('ZADD', KEYS[2], ARGV[1], reserved)
  redis.call('LPOP', KEYS[3])
end
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
