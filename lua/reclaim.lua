-- reclaim: recovery's step for a token a dead worker's slot had taken (its `held` record named
-- element "<rid>|<k>|<epoch>"): put the token back in circulation if the slot's death left it out.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] k   ARGV[3] the epoch the slot took   ARGV[4] its holder
-- ARGV[5] (a slot's own reclaim) the deadline of its arm (sg_step_late: errors "SGLATE ..." past it;
--         0 or '': none)
-- ARGV[6] (optional) the tenant group whose queue the token was taken from ('' for none: a shard's
--         list or a lane's). A request whose group differs is another request under the same id
--         (a request's group never changes; an id is free again after a purge): the record does
--         not name its tokens, and it is left alone ({'none'}). Without this check, its queued token
--         would be re-issued onto a list of the record's kind: a grouped request's element on a
--         shard's list is taken without a group token, past its group's limit.
-- Returns {'push', element, priority}: push it (give_back, which also ends the record) onto the
--         list of the request's priority now (reprioritize may have changed it since the take) —
--         the token was taken and never acquired, or held by that slot (its batch becomes orphans,
--         run again first), or re-queued by the slot's last ack whose push (give_back) never ran
--         (a higher epoch, still queued: a newer element is issued, so that a push of the older
--         one that did happen is merely refused when taken);
--         {'finished', state, priority, shards, lifecycle, sealed, group}: the request is terminal (the
--         slot may have died between its finish and the steps after it: census's reply);
--         {'wake', in ms}: the token is parked (its slot parked it, then died before it asked for the
--         wake-up of a retry that falls due in that many ms): recovery is to look then (arm); a
--         parked token with work waiting now is woken at once ('push');
--         {'none'}: nothing to do (parked with no retry waiting, held by another, the request is
--         gone, or it is another request under the same id: ARGV[6]).
local function reclaim(keys, args)
  local late = sg_step_late(args[5])
  if late then return late end
  local rid, k, epoch, holder = args[1], args[2], args[3], args[4]
  local t = redis.call('HMGET', keys[1], 't' .. k, 'grp', 'prio')
  if args[6] and (t[2] or '') ~= args[6] then return {'none'} end
  local tok = t[1]
  if not tok then
    local m = redis.call('HMGET', keys[1], 'state', 'prio', 'shards', 'sealed', 'grp')
    if m[1] == 'completed' or m[1] == 'failed' or m[1] == 'cancelled' then
      local lifecycle = sg_lifecycle(keys)
      local sealed = 0
      if m[4] == lifecycle then sealed = 1 end
      return {'finished', m[1], m[2], m[3] or '1', lifecycle, sealed, m[5] or ''}
    end
    return {'none'}
  end
  local f = sg_split(tok)
  local now = sg_now()
  local prio = tonumber(t[3])
  if f[1] == 'h' and f[2] == epoch and f[3] == holder then
    for _, id in ipairs(sg_ids(f[5])) do sg_orphan(keys, id) end
    -- A lane token's running marks (sg_lane_marks) went with its batch.
    redis.call('HDEL', keys[1], 'm' .. k)
    return {'push', sg_requeue(keys, rid, k, f[2], now), prio}
  end
  if f[1] == 'q' and tonumber(f[2]) >= tonumber(epoch) then
    return {'push', sg_requeue(keys, rid, k, f[2], now), prio}
  end
  if f[1] == 'p' then
    -- Parked by the slot, which died before it asked for a wake-up: wake it now if work waits (an
    -- orphan, a retry due), else when the next retry falls due.
    if redis.call('LLEN', keys[5]) + redis.call('ZCOUNT', keys[6], '-inf', now) > 0 then
      redis.call('HINCRBY', keys[1], 'npark', -1)
      return {'push', sg_requeue(keys, rid, k, f[2], now), prio}
    end
    local due = sg_next_retry(keys, now)
    if due then return {'wake', math.max(due - now, 1)} end
  end
  return {'none'}
end
