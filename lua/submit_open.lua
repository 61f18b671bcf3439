-- submit_open: create a request in state `loading`, invisible to workers (no token exists yet).
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request id as the producer gave it   ARGV[2] priority   ARGV[3] concurrency limit
-- ARGV[4] loading ttl (ms): a producer that dies mid-submit leaves keys that expire by themselves
-- ARGV[5] max attempts per sub-request   ARGV[6] per-attempt timeout (ms, 0 = none)
-- ARGV[7] retry backoff base (ms)   ARGV[8] retry backoff cap (ms)
-- ARGV[9] submission nonce: a random value of this submit, so that the same call re-sent after
-- a reconnect is recognised, and only its own producer can abort or commit it
-- ARGV[10] delay (ms, 0 = none): the request becomes eligible that long after its commit
-- ARGV[11] flags (sg_flags): '1' = fail fast: the first dead letter ends the request as failed;
-- then 'd' = its results are discarded: successful parts' results are never stored (meta `discard`)
-- ARGV[12] token shards S the request is submitted with: its token k lives on shard (home + k) % S,
-- home = FNV-1a(key id) % S (docs/protocol.md, "Token shards")
-- ARGV[13] deadline (Redis ms): the registration time plus half the loading ttl (register.lua)
-- ARGV[14] trace context (optional; '' or absent = none): the producer's send span as its
-- propagator writes it, a JSON object, stored as `trace` for workers to parent their spans on
-- ARGV[15] the request's deadline, in ms from now (optional; '' or 0 = none): stored as `dl`, the
-- Redis time (ms) past which no part starts and the request ends `failed`, `why` = `deadline`
-- ARGV[16] the request's rate limit, "<R>/<interval ms>" (optional; '' = none): at most R parts
-- start per interval, across all workers (stored as `rate`; prelude, sg_rate_room)
-- ARGV[17] the policy for a failed upstream (optional; '' = 'fail'): 'fail' or 'run'
-- ARGV[18] the upstreams (optional; '' = none): key ids, comma-separated, at most 1,000: the
-- request is a downstream, committed `waiting` until they end (prelude.lua, "Dependencies between
-- requests"); its producer links it to each (dag_link) before submit_commit. Not with a delay.
-- ARGV[19] the tenant group (optional; '' = none): stored as `grp`; the request's tokens then all
-- live on the group's shard and wait in its queues (prelude.lua, "Tenant groups")
-- Returns 1, or the errors "SGDUPLICATE ..." when the id is already in use (live or retained),
-- "SGINVALID ..." when an argument is out of range, "SGLATE ..." after the deadline.
local SG_MAX_DELAY_MS = 10 * 365 * 24 * 3600 * 1000

local function submit_open(keys, args)
  local prio, limit = tonumber(args[2]), tonumber(args[3])
  local invalid = sg_check_new(prio, limit, args, 4, 8)
  if invalid then return invalid end
  local delay = tonumber(args[10] or '0')
  if not delay or delay < 0 or delay % 1 ~= 0 or delay > SG_MAX_DELAY_MS then
    return redis.error_reply('SGINVALID delay must be a whole number of ms from 0 to ten years')
  end
  local shards = tonumber(args[12] or '1')
  if not shards or shards < 1 or shards > 1024 or shards % 1 ~= 0 then
    return redis.error_reply('SGINVALID token shards must be an integer from 1 to 1024')
  end
  if tonumber(args[5]) < 1 then return redis.error_reply('SGINVALID max attempts must be at least 1') end
  local failfast, discard
  failfast, discard, invalid = sg_flags(args[11])
  if invalid then return invalid end
  local trace = args[14] or ''
  invalid = sg_check_trace(trace)
  if invalid then return invalid end
  local within
  within, invalid = sg_check_deadline(args[15])
  if invalid then return invalid end
  local rate
  rate, invalid = sg_check_rate(args[16])
  if invalid then return invalid end
  local grp = args[19] or ''
  invalid = sg_check_group(grp)
  if invalid then return invalid end
  local ups, onup = args[18] or '', args[17] or ''
  if onup == '' then onup = 'fail' end
  if onup ~= 'fail' and onup ~= 'run' then
    return redis.error_reply('SGINVALID the policy for a failed upstream is fail or run')
  end
  if ups ~= '' then
    local n = 0
    for ukid in string.gmatch(ups .. ',', '([^,]*),') do
      if ukid == '' then return redis.error_reply('SGINVALID an upstream key id is empty') end
      n = n + 1
    end
    if n > 1000 then return redis.error_reply('SGINVALID a request has at most 1000 upstreams') end
    if delay > 0 then return redis.error_reply('SGINVALID a request submitted after others cannot be delayed') end
  end
  if redis.call('EXISTS', keys[1]) == 1 then
    if redis.call('HGET', keys[1], 'nonce') == args[9] then return 1 end
    return redis.error_reply('SGDUPLICATE request id is already in use')
  end
  if redis.call('EXISTS', keys[2]) == 1 then
    return redis.error_reply('SGDUPLICATE request id is already in use')
  end
  local now = sg_now()
  if sg_late(args[13], now) then
    return redis.error_reply('SGLATE the submit came too long after its registration; nothing was written')
  end
  redis.call('HSET', keys[1], 'v', 2, 'id', args[1], 'nonce', args[9], 'state', 'loading',
    'prio', args[2], 'limit', args[3], 'total', 0, 'left', 0, 'failed', 0, 'ntok', 0, 'extra', 0,
    'npark', 0, 'created', now, 'maxatt', args[5], 'timeout', args[6], 'bbase', args[7],
    'bmax', args[8], 'delay', delay, 'failfast', failfast and '1' or '0', 'shards', shards)
  -- Only a discarding request carries the field: ack reads it in its one HMGET.
  if discard then redis.call('HSET', keys[1], 'discard', 1) end
  -- Only a traced request carries the field.
  if trace ~= '' then redis.call('HSET', keys[1], 'trace', trace) end
  if within > 0 then redis.call('HSET', keys[1], 'dl', now + within) end
  if rate ~= '' then redis.call('HSET', keys[1], 'rate', rate) end
  if grp ~= '' then redis.call('HSET', keys[1], 'grp', grp) end
  if ups ~= '' then redis.call('HSET', keys[1], 'ups', ups, 'onup', onup, 'upw', 0, 'upf', 0) end
  -- The group starts at 0 so that every entry added afterwards is delivered once.
  redis.call('XGROUP', 'CREATE', keys[2], 'g', '0', 'MKSTREAM')
  redis.call('PEXPIRE', keys[1], args[4])
  redis.call('PEXPIRE', keys[2], args[4])
  return 1
end
