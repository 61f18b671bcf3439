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
-- cap (ms)   ARGV[11] flags: '1' = fail fast, then 'd' = results discarded (sg_flags)   ARGV[12] the lane's tokens L (used when it is created)
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
local function lane_submit(keys, args)
  local prio, limit, lanes = tonumber(args[5]), tonumber(args[6]), tonumber(args[12])
  local n = #args - 15
  local invalid = sg_lane_check(prio, limit, args, 7, n, args[15]) or sg_lane_check_tokens(lanes)
  if invalid then return invalid end
  local failfast, discard
  failfast, discard, invalid = sg_flags(args[11])
  if invalid then return invalid end
  local r = {kid = args[2], id = args[3], nonce = args[4], record = keys[7], marks = keys[12], prio = prio,
    limit = limit, maxatt = args[7], timeout = args[8], bbase = args[9], bmax = args[10],
    failfast = failfast, discard = discard, row = args[14], trace = args[15]}
  local taken = sg_lane_taken(r, keys[11], keys[10])
  if taken == SG_LANE_DUPLICATE then return redis.error_reply(taken) end
  if taken then return {taken, 0} end
  local now, lc = sg_lane_clock()
  local parked = sg_lane_open(keys, args[1], prio, lanes, now, tonumber(args[13]), keys[10])
  local ix = sg_ix(keys[10])
  local fed, queued = sg_lane_write(keys, r, args, 16, n, now, lc, ix)
  sg_ix_queued(ix, queued)
  local woken = sg_unpark(keys, args[1], fed, now, parked)
  -- A lane token it wakes goes to a slot that offered to take its priority, as that slot's take
  -- would have it: held, and its first batch acquired (prelude.lua, "Hand-offs").
  local handed = 0
  if keys[15] then
    local records = string.sub(keys[7], 1, #keys[7] - #args[2])
    handed = sg_hand(keys[15], keys[13], prio, keys[8], woken, 1, now, function(holder, f, element)
      local e = sg_split(element)
      return {keys[8], element, lane_acquire({keys[1], keys[2], keys[3], keys[4], keys[5], keys[6], keys[10], keys[14]},
        {e[1], e[2], e[3], holder, f[3], f[4], records})}
    end)
  end
  sg_push(keys[8], keys[9], woken, handed + 1)
  return {lc, #woken}
end
