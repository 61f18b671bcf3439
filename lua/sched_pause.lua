-- sched_pause: pause or resume a schedule. Ticks after the pause and up to the resume are not
-- owed; ticks due before the pause still are (the next firing owes them, computing them from the
-- pause time it reads here), so a pause leaves the due set alone, unless nothing is left to do
-- before the pause (the next tick is after it, and nothing is owed): then the schedule leaves it.
-- A resume records the gap and asks for a look at the next tick (or now, when the firing is
-- behind).
-- KEYS[1] the due set   KEYS[2] the schedule's state   KEYS[3] the schedules' counter (sched_add)
-- ARGV[1] name   ARGV[2] '1' pause, '0' resume
-- Returns {'paused', gen}, {'resumed', gen}, {'already', gen} (it was paused, or not paused,
-- already: nothing changed) or {'unknown'} (no such schedule).
local function sched_pause(keys, args)
  local s = redis.call('HMGET', keys[2], 'gen', 'paused', 'gaps', 'next', 'owe')
  if not s[1] then return {'unknown'} end
  local pause = args[2] == '1'
  if (pause and s[2]) or (not pause and not s[2]) then return {'already', tonumber(s[1])} end
  local now = sg_now()
  local gen = redis.call('HINCRBY', keys[3], 'n', 1)
  redis.call('HSET', keys[2], 'gen', gen)
  if pause then
    redis.call('HSET', keys[2], 'paused', now)
    if s[4] and tonumber(s[4]) > now and not s[5] then redis.call('ZREM', keys[1], args[1]) end
    return {'paused', gen}
  end
  local gap = s[2] .. ':' .. now
  if s[3] and s[3] ~= '' then gap = s[3] .. ',' .. gap end
  redis.call('HSET', keys[2], 'gaps', gap, 'resumed', now)
  redis.call('HDEL', keys[2], 'paused')
  local look = now
  if s[4] and tonumber(s[4]) > now then look = tonumber(s[4]) end
  redis.call('ZADD', keys[1], 'LT', look, args[1])
  return {'resumed', gen}
end
