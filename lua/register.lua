-- register: enter a request in recovery's index before it is created, so that whatever happens to
-- its producer afterwards, recovery finds it. Run on the request's home shard.
-- KEYS[1] the active-request index (sorted set, score = when recovery should next look)
-- KEYS[2] the registration times (hash: key id -> ms)
-- KEYS[3] the id's lane request record on this shard (prelude.lua, "Lanes")
-- ARGV[1] request key id   ARGV[2] delay (ms) before recovery first looks at it   ARGV[3] its row in
-- the listing index (prelude.lua, "The listing index"; '' or absent: not listed)
-- Returns {added, now}, or the error "SGDUPLICATE ..." when a lane request has the id: added is 1 if this call entered it (0 if it was there), now the Redis time
-- (ms) of the registration. The producer must create the request before now + half the loading
-- ttl (the deadline it passes to submit_open, submit_small or stream_open): recovery drops a
-- registration whose request does not exist only once the loading ttl has passed since it was
-- registered (by any producer: each registration restarts that time), so a request can never be
-- created after its registration was dropped. Producers never take a registration back: it may
-- be another producer's (the same id submitted twice).
local function register(keys, args)
  if keys[3] and redis.call('EXISTS', keys[3]) == 1 then
    return redis.error_reply('SGDUPLICATE request id is already in use')
  end
  local now = sg_now()
  local added = redis.call('ZADD', keys[1], 'NX', now + tonumber(args[2]), args[1])
  -- The latest registration's time, not the first's: a producer's deadline counts from its own
  -- registration, and recovery must not drop the entry before that deadline has passed.
  redis.call('HSET', keys[2], args[1], now)
  sg_ix_add(sg_ix(keys[1]), args[1], args[3], now)
  return {added, now}
end
