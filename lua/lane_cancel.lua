-- lane_cancel: cancel for a lane request (prelude.lua, "Lanes"): its one terminal record and
-- event now. Its parts still in the lane are acked away unrun when handed out, and the acks of
-- those running record nothing (their lifecycle is no longer live).
-- KEYS[1] the request's record   KEYS[2] the shard's events stream
-- ARGV[1] request key id   ARGV[2] retention (ms)   ARGV[3] completion channel
-- Returns {'finished', 'cancelled', lifecycle}, {'already', state} when it was terminal, or
-- {'unknown'}.
local function lane_cancel(keys, args)
  local state = redis.call('HGET', keys[1], 'state')
  if not state then return {'unknown'} end
  if state ~= 'queued' and state ~= 'running' then return {'already', state} end
  local lc = sg_lane_finish(keys[1], args[1], 'cancelled', args[2], args[3], keys[2], sg_now())
  return {'finished', 'cancelled', lc}
end
