-- lane_submit: a whole small request in one call, on its home shard's lane of its priority
-- (prelude.lua, "Lanes"): its record, its first parts in the lane (as many as its limit), its
-- other parts waiting in the record, and a wake-up of a parked lane token per part fed. Creates
-- the lane (its meta hash, group and L parked tokens, its entry in recovery's index) on first use,
-- and revives an idle one (sg_lane_open).
-- KEYS[1..6] the lane's keys (as a request's, prelude.lua)   KEYS[7] the request's record
-- KEYS[8] the lane's priority list   KEYS[9] the shard's bell   KEYS[10] the shard's active index
-- KEYS[11] the shard's registration times   KEYS[12] the request id's finish marks on the shard
-- ARGV[1] the lane's key id   ARGV[2] request key id   ARGV[3] request id as the producer gave it
-- ARGV[4] submission nonce, '' when the producer generated the id   ARGV[5] priority
-- ARGV[6] concurrency limit   ARGV[7] max attempts
-- ARGV[8] per-attempt timeout (ms, 0 = none)   ARGV[9] retry backoff base (ms)   ARGV[10] backoff
-- cap (ms)   ARGV[11] '1' = fail fast   ARGV[12] the lane's tokens L (used when it is created)
-- ARGV[13] the lane's first look by recovery (ms from now)   ARGV[14] the request's row in the
-- listing index (prelude.lua, "The listing index"; '' : not listed)   ARGV[15] trace context ('' =
-- none; as submit_open's ARGV[14], stored as the record's `trace`)   ARGV[16..] payloads (1 to 64)
-- Returns {lifecycle, woken}: woken is how many lane tokens were pushed. The same call re-sent
-- after a reconnect (same nonce) answers as the first did and writes nothing. Errors
-- "SGDUPLICATE ..." when the id is in use (a lane request's record, or, for an id the producer
-- named, a request of the stream path registered or retained on this shard), "SGINVALID ..."
-- when an argument is out of range.
local SG_LANE_MAX_PARTS = 64

local function lane_submit(keys, args)
  local prio, limit, lanes = tonumber(args[5]), tonumber(args[6]), tonumber(args[12])
  local invalid = sg_check_new(prio, limit, args, 7, 10)
  if invalid then return invalid end
  if tonumber(args[7]) < 1 then return redis.error_reply('SGINVALID max attempts must be at least 1') end
  if not lanes or lanes < 1 or lanes > 10000 or lanes % 1 ~= 0 then
    return redis.error_reply('SGINVALID lane tokens must be an integer from 1 to 10000')
  end
  local n = #args - 15
  if n < 1 or n > SG_LANE_MAX_PARTS then
    return redis.error_reply('SGINVALID a lane request has 1 to ' .. SG_LANE_MAX_PARTS .. ' parts')
  end
  invalid = sg_check_trace(args[15])
  if invalid then return invalid end
  local record = keys[7]
  local seen = redis.call('HMGET', record, 'lc', 'nonce')
  if seen[1] then
    -- A record under a generated id (no nonce) can only be this submit's, re-sent.
    if (seen[2] or '') ~= args[4] then return redis.error_reply('SGDUPLICATE request id is already in use') end
    return {seen[1], 0}
  end
  -- A named id may be in use on the stream path; a generated one (no nonce) is unique.
  if args[4] ~= '' and (redis.call('HGET', keys[11], args[2]) or redis.call('ZSCORE', keys[10], args[2])
    or redis.call('EXISTS', keys[12]) == 1) then
    return redis.error_reply('SGDUPLICATE request id is already in use')
  end
  local now = sg_now()
  local parked = sg_lane_open(keys, args[1], prio, lanes, now, tonumber(args[13]), keys[10])
  local fed = math.min(limit, n)
  local lc = sg_int(now * 1000)
  local fields = {'state', 'queued', 'lc', lc, 'left', n,
    'pol', sg_lane_pol(prio, limit, n, args[7], args[8], args[9], args[10], args[11] == '1')}
  if args[4] ~= '' then
    fields[#fields + 1] = 'nonce'
    fields[#fields + 1] = args[4]
  end
  if args[3] ~= args[2] then
    fields[#fields + 1] = 'id'
    fields[#fields + 1] = args[3]
  end
  if args[15] ~= '' then
    fields[#fields + 1] = 'trace'
    fields[#fields + 1] = args[15]
  end
  if fed < n then
    fields[#fields + 1] = 'nf'
    fields[#fields + 1] = fed
  end
  local from = fed
  if args[11] == '1' then from = 0 end
  for i = from, n - 1 do
    fields[#fields + 1] = 'w' .. i
    fields[#fields + 1] = args[16 + i]
  end
  redis.call('HSET', record, unpack(fields))
  -- An id the producer generated (no nonce) whose record is absent was never listed.
  sg_ix_add(sg_ix(keys[10]), args[2], args[14], now, true, args[4] == '')
  for i = 0, fed - 1 do sg_lane_add(keys, args[2], i, lc, args[16 + i]) end
  local woken = sg_unpark(keys, args[1], fed, now, parked)
  sg_push(keys[8], keys[9], woken)
  return {lc, #woken}
end
