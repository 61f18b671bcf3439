-- census: recovery's look at one request; run by any worker, for requests it claimed (claim_due).
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] grace (ms): how long a token may be queued before recovery
-- checks that its element really is in the list   ARGV[3] retention (ms)   ARGV[4] completion
-- channel (for a streamed request that expired unfinalized: it is cancelled here)
-- A scheduled request whose time has come turns queued, and its parked tokens are pushed.
-- Returns {'gone'}: no such request (expired); {'loading'}; {'finished', state, priority, shards,
--         gen, sealed}: the request is terminal but still indexed, so the steps after its finish
--         (finish_index, seal, unindex) are to be completed; sealed is 1 when only unindex is left;
--         or {'ok', priority, push, check, reclaimed, shards}:
--         push: elements of restored or unparked tokens, to push now; check: elements queued
--         longer than the grace, whose presence in the list must be verified (verify_tokens);
--         reclaimed: how many leases had expired; shards: the token shards it was submitted with
--         (token k's elements belong on shard (home + k) % shards).
-- A holder whose lease expired loses its token: the entry it ran goes to the orphans list and the
-- token is re-queued under a new epoch, so the old holder is fenced and its element refused.
local function census(keys, args)
  local state = redis.call('HGET', keys[1], 'state')
  if not state then return {'gone'} end
  if state == 'loading' then return {'loading'} end
  local shards = redis.call('HGET', keys[1], 'shards') or '1'
  if state == 'completed' or state == 'failed' or state == 'cancelled' then
    local f = redis.call('HMGET', keys[1], 'prio', 'gen', 'sealed')
    local gen = f[2] or '0'
    local sealed = 0
    if f[3] == gen then sealed = 1 end
    return {'finished', state, f[1], shards, gen, sealed}
  end
  local rid, grace = args[1], tonumber(args[2])
  local now = sg_now()
  local m = redis.call('HMGET', keys[1], 'eligible', 'open', 'open_deadline')
  if state == 'scheduled' then
    -- A delayed request waits with parked tokens; the first census after its time promotes it.
    if tonumber(m[1] or '0') > now then return {'ok', redis.call('HGET', keys[1], 'prio'), {}, {}, 0, shards} end
    redis.call('HSET', keys[1], 'state', 'queued')
  end
  if m[2] == '1' and tonumber(m[3] or '0') > 0 and tonumber(m[3]) < now then
    -- A streamed request whose producer never finalized it within its expiry: its input is
    -- incomplete, so it ends cancelled.
    redis.call('DEL', keys[6])
    -- Its tokens were parked or queued; a queued element left in a list is refused at acquire.
    local gen = sg_finish(keys, rid, 'cancelled', args[3], args[4], now)[3]
    return {'finished', 'cancelled', redis.call('HGET', keys[1], 'prio'), shards, gen, 0}
  end
  local ntok = tonumber(redis.call('HGET', keys[1], 'ntok') or '0')
  local push, check, parked = {}, {}, {}
  local reclaimed = 0
  for k = 0, ntok - 1 do
    local tok = redis.call('HGET', keys[1], 't' .. k)
    if tok then
      local f = sg_split(tok)
      if f[1] == 'h' and tonumber(f[4]) < now then
        for _, id in ipairs(sg_ids(f[5])) do sg_orphan(keys, id) end
        push[#push + 1] = sg_requeue(keys, rid, k, f[2], now)
        reclaimed = reclaimed + 1
      elseif f[1] == 'q' and tonumber(f[3]) + grace < now then
        check[#check + 1] = sg_element(rid, k, f[2])
      elseif f[1] == 'p' then
        parked[#parked + 1] = {k, f[2]}
      end
    end
  end
  -- Acked entries are not deleted one by one; drop every stream node older than the oldest entry
  -- still pending (or, with none pending, than the last one delivered).
  local oldest = redis.call('XPENDING', keys[2], 'g')[2]
  if not oldest then
    local group = redis.call('XINFO', 'GROUPS', keys[2])[1]
    for i = 1, #group, 2 do
      if group[i] == 'last-delivered-id' then oldest = '0-' .. (sg_index(group[i + 1]) + 2) end
    end
  end
  if oldest then redis.call('XTRIM', keys[2], 'MINID', '~', oldest) end
  -- Parked tokens go back into circulation while there is work they could take.
  local work = redis.call('LLEN', keys[5]) + redis.call('ZCOUNT', keys[6], '-inf', now)
  -- Entries never delivered: the stream's newest id is past the group's last delivered id
  -- (ids are 0-<index+1>; XINFO's lag is unknown once entries were deleted, so compare ids).
  local newest = redis.call('XREVRANGE', keys[2], '+', '-', 'COUNT', 1)[1]
  if newest then
    local group = redis.call('XINFO', 'GROUPS', keys[2])[1]
    for i = 1, #group, 2 do
      if group[i] == 'last-delivered-id' and sg_index(newest[1]) > sg_index(group[i + 1]) then
        work = work + sg_index(newest[1]) - sg_index(group[i + 1])
      end
    end
  end
  work = work - reclaimed
  for _, p in ipairs(parked) do
    if work <= 0 then break end
    push[#push + 1] = sg_requeue(keys, rid, p[1], p[2], now)
    work = work - 1
  end
  return {'ok', redis.call('HGET', keys[1], 'prio'), push, check, reclaimed, shards}
end
