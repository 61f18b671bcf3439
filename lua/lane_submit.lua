-- lane_submit: a whole small request in one call, on its home shard's lane of its priority
-- (prelude.lua, "Lanes"): its record, its first parts in the lane (as many as its limit), its
-- other parts waiting in the record, and a wake-up of a parked lane token per part fed. Creates
-- the lane (its meta hash, group and L parked tokens, its entry in recovery's index) on first use,
-- and revives an idle one (sg_lane_open).
-- KEYS[1..6] the lane's keys (as a request's, prelude.lua)   KEYS[7] the request's record
-- KEYS[8] the lane's priority list   KEYS[9] the shard's bell   KEYS[10] the shard's active index
-- KEYS[11] the shard's registration times   KEYS[12] the request id's finish marks on the shard
-- ARGV[1] the lane's key id   ARGV[2] request key id   ARGV[3] request id as the producer gave it
-- ARGV[4] submission nonce   ARGV[5] priority   ARGV[6] concurrency limit   ARGV[7] max attempts
-- ARGV[8] per-attempt timeout (ms, 0 = none)   ARGV[9] retry backoff base (ms)   ARGV[10] backoff
-- cap (ms)   ARGV[11] '1' = fail fast   ARGV[12] the lane's tokens L (used when it is created)
-- ARGV[13] the lane's first look by recovery (ms from now)   ARGV[14..] payloads (1 to 64)
-- Returns {lifecycle, woken}: woken is how many lane tokens were pushed. The same call re-sent
-- after a reconnect (same nonce) answers as the first did and writes nothing. Errors
-- "SGDUPLICATE ..." when the id is in use (a lane request's record, or a request of the stream
-- path registered or retained on this shard), "SGINVALID ..." when an argument is out of range.
local SG_LANE_MAX_PARTS = 64

local function lane_submit(keys, args)
  local prio, limit, lanes = tonumber(args[5]), tonumber(args[6]), tonumber(args[12])
  if not prio or prio < 0 or prio > 99 or prio % 1 ~= 0 then
    return redis.error_reply('SGINVALID priority must be an integer from 0 to 99')
  end
  if not limit or limit < 1 or limit > 10000 or limit % 1 ~= 0 then
    return redis.error_reply('SGINVALID concurrency must be an integer from 1 to 10000')
  end
  for i = 7, 10 do
    local v = tonumber(args[i])
    if not v or v < 0 or v % 1 ~= 0 then
      return redis.error_reply('SGINVALID argument ' .. i .. ' must be a whole number of at least 0')
    end
  end
  if tonumber(args[7]) < 1 then return redis.error_reply('SGINVALID max attempts must be at least 1') end
  if not lanes or lanes < 1 or lanes > 10000 or lanes % 1 ~= 0 then
    return redis.error_reply('SGINVALID lane tokens must be an integer from 1 to 10000')
  end
  local n = #args - 13
  if n < 1 or n > SG_LANE_MAX_PARTS then
    return redis.error_reply('SGINVALID a lane request has 1 to ' .. SG_LANE_MAX_PARTS .. ' parts')
  end
  local record = keys[7]
  local seen = redis.call('HMGET', record, 'nonce', 'created', 'gen')
  if seen[1] then
    if seen[1] ~= args[4] then return redis.error_reply('SGDUPLICATE request id is already in use') end
    return {sg_record_lifecycle(record), 0}
  end
  if redis.call('HGET', keys[11], args[2]) or redis.call('ZSCORE', keys[10], args[2])
    or redis.call('EXISTS', keys[12]) == 1 then
    return redis.error_reply('SGDUPLICATE request id is already in use')
  end
  local now = sg_now()
  sg_lane_open(keys, args[1], prio, lanes, now, tonumber(args[13]), keys[10])
  local fed = math.min(limit, n)
  local lc = sg_int(now * 1000)
  local fields = {'v', 2, 'id', args[3], 'nonce', args[4], 'state', 'queued', 'prio', prio,
    'limit', limit, 'total', n, 'left', n, 'failed', 0, 'created', now, 'gen', 0, 'maxatt', args[7],
    'timeout', args[8], 'bbase', args[9], 'bmax', args[10], 'failfast', args[11], 'nf', fed}
  local from = fed
  if args[11] == '1' then from = 0 end
  for i = from, n - 1 do
    fields[#fields + 1] = 'w' .. i
    fields[#fields + 1] = args[14 + i]
  end
  redis.call('HSET', record, unpack(fields))
  for i = 0, fed - 1 do sg_lane_add(keys, args[2], i, lc, args[14 + i]) end
  local woken = sg_unpark(keys, args[1], fed, now)
  sg_push(keys[8], keys[9], woken)
  return {lc, #woken}
end
