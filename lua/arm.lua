-- arm: ask recovery to look at a request by a given time (only ever earlier than planned): before a
-- step whose follow-up (a push) its caller might not live to make, and when a parked token should
-- be woken for a retry.
-- KEYS[1] the active-request index (home shard)   KEYS[2] the looks armed before a step
-- ARGV[1] request key id   ARGV[2] in how long (ms; relative, so no client clock is involved)
-- ARGV[3] (recovery only, optional) the score its claim wrote: if it is still there, the look is
-- set to ARGV[2] even if that is later (sg_rearm)   ARGV[4] (optional) 'step': the look comes
-- before a step, which is to run before it is due; it is kept in KEYS[2] too, so that a census
-- that begins before it is due (and so maybe before the step) does not cancel it (claim_due,
-- sg_rearm)
-- Returns when the look is due (ms, Redis time) if the request is indexed, else 0.
local function arm(keys, args)
  local due = sg_now() + tonumber(args[2])
  if sg_rearm(keys[1], args[1], due, args[3], keys[2]) == 0 then return 0 end
  if args[4] == 'step' then redis.call('ZADD', keys[2], 'GT', due, args[1]) end
  return due
end
