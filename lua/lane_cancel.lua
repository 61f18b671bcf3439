-- lane_cancel: cancel for a lane request (prelude.lua, "Lanes"): its one terminal record and
-- event now. Its parts still in the lane are acked away unrun when handed out, and the acks of
-- those running record nothing (their lifecycle is no longer live).
-- KEYS[1] the request's record   KEYS[2] the shard's events stream
-- ARGV[1] request key id   ARGV[2] retention (ms)   ARGV[3] completion channel
-- Returns {'finished', 'cancelled', lifecycle}, with a fourth item 'rel' when it has downstreams
-- (its release is owed, and for the caller to run), {'already', state} when it was terminal, or
-- {'unknown'}.
local function lane_cancel(keys, args)
  local m = redis.call('HMGET', keys[1], 'state', 'lc', 'pol', 'dn', 'ix')
  if not m[1] then return {'unknown'} end
  if m[1] ~= 'queued' and m[1] ~= 'running' then return {'already', m[1]} end
  local now = sg_now()
  local policy = sg_lane_policy(m[3])
  local waiting = {}
  for i = 0, policy.total - 1 do waiting[#waiting + 1] = 'w' .. i end
  sg_hdel_many(keys[1], waiting)
  local fields = {'state', 'cancelled', 'finished', now}
  if m[1] == 'queued' and policy.total == 1 then
    -- A request of one part whose record says queued: its entry was handed out without the record
    -- (sg_lane_entry), and a lane token's running marks name it (its part runs since then), or
    -- its entry waits in the lane, and "<kid>|<lc>" goes to the lane's set of cancelled requests'
    -- entries, so that the hand-out that meets it drops it.
    local lane = string.sub(keys[1], 1, #keys[1] - #args[1] - 3) .. ':lane:' .. policy.prio
    local since = sg_lane_marked(lane, args[1], m[2])
    if since then
      fields[#fields + 1] = 'started'
      fields[#fields + 1] = since
    elseif redis.call('EXISTS', lane) == 1 then
      redis.call('SADD', lane .. ':err', args[1] .. '|' .. m[2])
    end
  end
  redis.call('HSET', keys[1], unpack(fields))
  local line = sg_lane_announce(keys[1], args[1], 'cancelled', args[2], now, keys[2], m[4])
  local ix = sg_ix(keys[2])
  -- One whose record keeps its row may be listed from its lane, not in `live` (sg_ix_add_kept).
  if m[5] then sg_ix_live_kept(ix, args[1], m[5], m[2]) end
  sg_ix_finish(ix, args[1], 'cancelled', now + tonumber(args[2]), now)
  sg_lane_events(keys[2], {line}, args[2], now, args[3])
  if m[4] then return {'finished', 'cancelled', m[2], 'rel'} end
  return {'finished', 'cancelled', m[2]}
end
