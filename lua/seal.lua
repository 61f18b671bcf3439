-- seal: start a finished request's retention, once its event is recorded (finish_index). Until
-- then its keys are held (prelude.lua, SG_FINISH_HOLD_MS), so that a finish whose token side is
-- delayed (the finishing worker died or stalled) is neither lost nor left unannounced.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] the lifecycle that finished   ARGV[2] retention (ms)
-- Returns 1 when the request is that finished lifecycle, now sealed (again: a repeat never extends
-- the retention); 0 when it is not (reopened by requeue_dead, or gone).
local function seal(keys, args)
  local state = redis.call('HGET', keys[1], 'state')
  if state ~= 'completed' and state ~= 'failed' and state ~= 'cancelled' then return 0 end
  if sg_lifecycle(keys) ~= args[1] then return 0 end
  redis.call('HSET', keys[1], 'sealed', args[1])
  -- LT: only ever shortens (a key without expiry counts as infinite).
  for _, i in ipairs(sg_kept(state)) do redis.call('PEXPIRE', keys[i], args[2], 'LT') end
  return 1
end
