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
-- KEYS[13..15] (optional) the shard's held records, looks armed before a step, and hand-off
-- offers (prelude.lua, "Hand-offs"): given, a lane token this call wakes goes to a reserved slot
-- that waits for one of its priority, rather than onto the list.
-- Returns {lifecycle, woken}: woken is how many lane tokens were pushed or handed. The same call re-sent
-- after a reconnect (same nonce) answers as the first did and writes nothing. Errors
-- "SGDUPLICATE ..." when the id is in use (a lane request's record, or, for an id the producer
-- named, a request of the stream path registered or retained on this shard), "SGINVALID ..."
-- when an argument is out of range.
-- Hands lane token elements `woken` to the slots that offered to take their priority `prio`
-- (prelude.lua, "Hand-offs"), as many as there are offers; returns the elements left to push.
-- KEYS as lane_submit's; `records`: the records' key prefix.
local function lane_hand(keys, prio, woken, now, records)
  if not keys[15] or #woken == 0 or redis.call('EXISTS', keys[15]) == 0 then return woken end
  local shard = sg_shard_key(keys[15], '')
  -- (Paused, by an operator: the token waits on its list, where no slot takes it until resumed.)
  local paused = redis.call('HMGET', shard .. 'paused', 'all', sg_str(prio))
  if paused[1] or paused[2] then return woken end
  local offers = sg_hand_offers(shard, prio, now)
  local left, next = {}, 1
  for _, element in ipairs(woken) do
    local offer = offers[next]
    -- (A slot that offers holds nothing on the shard: its take ended its record. One that does is
    -- passed over, its offer ended.)
    while offer and redis.call('HEXISTS', keys[13], offer[1]) == 1 do
      redis.call('HDEL', keys[15], offer[1])
      next = next + 1
      offer = offers[next]
    end
    if not offer then
      left[#left + 1] = element
    else
      next = next + 1
      local holder, f = offer[1], offer[2]
      local e = sg_split(element)
      redis.call('HDEL', keys[15], holder)
      redis.call('HSET', keys[13], holder, element .. '|' .. f[2] .. '|' .. keys[8])
      redis.call('PEXPIRE', keys[13], SG_HELD_TTL_MS)
      local acquired = lane_acquire({keys[1], keys[2], keys[3], keys[4], keys[5], keys[6], keys[10], keys[14]},
        {e[1], e[2], e[3], holder, f[3], f[4], records})
      local hand = shard .. 'hand:' .. holder
      redis.call('RPUSH', hand, cmsgpack.pack({keys[8], element, acquired}))
      redis.call('PEXPIRE', hand, math.max(tonumber(f[5]) - now, 1))
    end
  end
  return left
end

local function lane_submit(keys, args)
  local prio, limit, lanes = tonumber(args[5]), tonumber(args[6]), tonumber(args[12])
  local n = #args - 15
  local invalid = sg_lane_check(prio, limit, args, 7, n, args[15]) or sg_lane_check_tokens(lanes)
  if invalid then return invalid end
  local r = {kid = args[2], id = args[3], nonce = args[4], record = keys[7], marks = keys[12], prio = prio,
    limit = limit, maxatt = args[7], timeout = args[8], bbase = args[9], bmax = args[10],
    failfast = args[11] == '1', row = args[14], trace = args[15]}
  local taken = sg_lane_taken(r, keys[11], keys[10])
  if taken == SG_LANE_DUPLICATE then return redis.error_reply(taken) end
  if taken then return {taken, 0} end
  local now = sg_now()
  local parked = sg_lane_open(keys, args[1], prio, lanes, now, tonumber(args[13]), keys[10])
  local lc = sg_int(now * 1000)
  local ix = sg_ix(keys[10])
  local fed, queued = sg_lane_write(keys, r, args, 16, n, now, lc, ix)
  sg_ix_queued(ix, queued)
  local woken = sg_unpark(keys, args[1], fed, now, parked)
  sg_push(keys[8], keys[9], lane_hand(keys, prio, woken, now, string.sub(keys[7], 1, #keys[7] - #args[2])))
  return {lc, #woken}
end
