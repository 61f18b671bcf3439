-- drop_gone: what recovery does with an index entry whose request does not exist (census said
-- 'gone'): its producer died before creating it, or it was never created (the id was in use), or
-- its keys expired (a loading ttl, or the retention of a finish nobody sealed). The entry is
-- dropped only once the loading ttl has passed since it was registered, so that no producer can
-- still create the request (its deadline, register.lua, is half that); until then the next look
-- is set to that time.
-- KEYS[1] active-request index   KEYS[2] registration times   KEYS[3] the request's finish marks
-- KEYS[4] the looks armed before a step (arm)
-- ARGV[1] request key id   ARGV[2] the loading ttl (ms)   ARGV[3] the score recovery's claim wrote
-- (sg_rearm: a push that came since keeps the look it set)   ARGV[4] the grace (ms)
-- Returns 1 when the entry was dropped, 0 when it was kept.
local function drop_gone(keys, args)
  local now = sg_now()
  local registered = tonumber(redis.call('HGET', keys[2], args[1]) or '0')
  local ttl, grace = tonumber(args[2]), tonumber(args[4])
  local drop_at = registered + ttl
  if drop_at > now then
    -- Until its deadline (half the ttl, plus a grace for clocks) the request may still be created,
    -- its creator dying before it pushes: look again soon. After it, only the drop is left.
    local next = drop_at
    if now < registered + ttl / 2 + grace then next = now + grace end
    sg_rearm(keys[1], args[1], next, args[3], keys[4])
    return 0
  end
  redis.call('ZREM', keys[1], args[1])
  redis.call('ZREM', keys[4], args[1])
  redis.call('HDEL', keys[2], args[1])
  -- A downstream linked to it was refused at its submit (it was not created): its set goes too.
  redis.call('DEL', keys[3], sg_shard_key(keys[1], 'dn:' .. args[1]))
  sg_ix_remove(sg_ix(keys[1]), args[1], now)
  return 1
end
