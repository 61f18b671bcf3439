-- beat: a worker's heartbeat in the worker registry (shard 0), and its share of noticing dead
-- workers. A worker is alive while its registration has not expired (Redis time: no client clock
-- is involved); one not heard from for a lease is dead, and the beat of any other worker claims it
-- for reaping: recovery then reclaims every token its slots had taken (their `held` records).
-- KEYS[1] the registry (sorted set: worker id -> expiry ms)   KEYS[2] worker descriptions (hash:
-- worker id -> JSON; and "<worker id>|lapsed" -> when its registration was last found lapsed)
-- KEYS[3] workers being reaped (sorted set: worker id -> claim expiry ms)
-- ARGV[1] worker id   ARGV[2] lease (ms)   ARGV[3] its description (JSON, stored on the first
-- beat)   ARGV[4] '1' on the worker's first beat   ARGV[5] at most this many dead workers to claim
-- ARGV[6] claim (ms): a dead worker claimed by a reaper that dies is claimed again after this
-- Returns {alive, dead id, dead description, ...}: alive is 0 when this worker had been declared
-- dead (it must take a new id: its tokens are being, or were, reclaimed), else 1.
local function beat(keys, args)
  local now = sg_now()
  local id, lease = args[1], tonumber(args[2])
  local alive = 1
  -- A beat that finds its own registration expired (this worker, or the registry, could not be
  -- reached for a lease: a stalled process, a partition, the registry's master restarting) does
  -- not reap: the other workers were most likely cut off alike, and get a lease to beat again.
  local lapsed = false
  if args[4] == '1' then
    redis.call('ZADD', keys[1], now + lease, id)
    redis.call('HSET', keys[2], id, args[3])
  else
    local own = redis.call('ZSCORE', keys[1], id)
    if own then
      lapsed = tonumber(own) < now
      redis.call('ZADD', keys[1], 'XX', now + lease, id)
    else
      alive = 0
    end
  end
  -- The registry goes when no worker is left to beat (a namespace whose workers were all killed
  -- leaves nothing); dead workers' take records are then found by recovery's scan of them.
  for i = 1, 3 do redis.call('PEXPIRE', keys[i], lease * 6) end
  local out = {alive}
  -- For a lease after its lapse, a worker does not reap: the others get that long to come back
  -- (their own beats meet the same outage, and their reconnects take time).
  local quiet = id .. '|lapsed'
  if lapsed then
    redis.call('HSET', keys[2], quiet, now)
    return out
  end
  local since = redis.call('HGET', keys[2], quiet)
  if since then
    if tonumber(since) + lease > now then return out end
    redis.call('HDEL', keys[2], quiet)
  end
  local max, claim = tonumber(args[5]), tonumber(args[6])
  local dead = redis.call('ZRANGEBYSCORE', keys[1], '-inf', now, 'LIMIT', 0, max)
  local stuck = redis.call('ZRANGEBYSCORE', keys[3], '-inf', now, 'LIMIT', 0, max)
  for _, list in ipairs({dead, stuck}) do
    for _, w in ipairs(list) do
      redis.call('ZREM', keys[1], w)
      redis.call('ZADD', keys[3], now + claim, w)
      -- Outlives the claim by a lease, so a stuck claim is found again; no longer, so a claim
      -- whose reaper was killed along with every other worker does not outstay them for long.
      redis.call('PEXPIRE', keys[3], math.max(lease * 6, claim + lease))
      out[#out + 1] = w
      out[#out + 1] = redis.call('HGET', keys[2], w) or ''
    end
  end
  return out
end
