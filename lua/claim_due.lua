-- claim_due: take the requests whose census is due, so that concurrent workers spread the work
-- and do not census the same request at once (a double census would still be safe: every
-- restore is a compare-and-set on the token's epoch).
-- KEYS[1] the active-request index   KEYS[2] the looks armed before a step (arm)
-- ARGV[1] at most this many requests   ARGV[2] claim (ms): others skip them for this long
-- Returns {key id, claim, key id, claim, ...}: the claimed requests, each with the score its claim
-- set (ms), which recovery's re-arm compares (prelude.lua, sg_rearm). An armed look that is due
-- is served by this census (its step ran before it fell due); one that is not due yet stays, and
-- the next look is set no later than it. Also drops finished requests whose retention has passed
-- from the shard's listing index (prelude.lua, "The listing index"), a hundred at most.
local function claim_due(keys, args)
  local now = sg_now()
  local due = redis.call('ZRANGEBYSCORE', keys[1], '-inf', now, 'LIMIT', 0, tonumber(args[1]))
  local out = {}
  local claim = now + tonumber(args[2])
  for _, rid in ipairs(due) do
    redis.call('ZADD', keys[1], claim, rid)
    local armed = redis.call('ZSCORE', keys[2], rid)
    if armed and tonumber(armed) <= now then redis.call('ZREM', keys[2], rid) end
    out[#out + 1] = rid
    out[#out + 1] = claim
  end
  sg_ix_trim(sg_ix(keys[1]), now, SG_IX_TRIM_CLAIM)
  return out
end
