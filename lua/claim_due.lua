-- claim_due: take the requests whose census is due, so that concurrent workers spread the work
-- and do not census the same request at once (a double census would still be safe: every
-- restore is a compare-and-set on the token's epoch).
-- KEYS[1] the active-request index   KEYS[2] the looks armed before a step (arm)
-- KEYS[3] (optional) the shard's release outbox (prelude.lua, "Dependencies between requests")
-- KEYS[4] (optional, shard 0 only, with KEYS[3]) the schedules' due set (sched_add.lua)
-- ARGV[1] at most this many requests (and releases, and schedules)   ARGV[2] claim (ms): others
-- skip them for this long
-- Returns {key id, claim, key id, claim, ...}: the claimed requests, each with the score its claim
-- set (ms), which recovery's re-arm compares (prelude.lua, sg_rearm). An armed look that is due
-- is served by this census (its step ran before it fell due); one that is not due yet stays, and
-- the next look is set no later than it. Also drops finished requests whose retention has passed
-- from the shard's listing index (prelude.lua, "The listing index"), a hundred at most.
-- With KEYS[3], the reply goes on with '' (no key id is empty), the Redis time now (ms), the
-- number of releases claimed and their upstreams' key ids (each due again when the claim runs
-- out, unless rel_done took it out first); with KEYS[4] too, then the names of the due schedules
-- it claimed, from which and the time the caller computes their ticks (each due again when the
-- claim runs out, unless sched_fire or sched_paid set it first). With two keys the reply is the
-- requests' pairs alone.
local function claim_due(keys, args)
  local now = sg_now()
  local limit = tonumber(args[1])
  local due = redis.call('ZRANGEBYSCORE', keys[1], '-inf', now, 'LIMIT', 0, limit)
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
  if keys[3] then
    out[#out + 1] = ''
    out[#out + 1] = now
    local rels = redis.call('ZRANGEBYSCORE', keys[3], '-inf', now, 'LIMIT', 0, limit)
    out[#out + 1] = #rels
    for _, ukid in ipairs(rels) do
      redis.call('ZADD', keys[3], claim, ukid)
      out[#out + 1] = ukid
    end
  end
  if keys[4] then
    local names = redis.call('ZRANGEBYSCORE', keys[4], '-inf', now, 'LIMIT', 0, limit)
    for _, name in ipairs(names) do
      redis.call('ZADD', keys[4], claim, name)
      out[#out + 1] = name
    end
  end
  return out
end
