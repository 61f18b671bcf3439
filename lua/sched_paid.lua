-- sched_paid: an owed tick's request was submitted (the submit answered Ok, or SGDUPLICATE: it
-- exists already), so the tick leaves the debt. With nothing left owed, the schedule is next
-- looked at for its next tick (while it is paused, only if that tick fell before the pause).
-- KEYS[1] the due set   KEYS[2] the schedule's state
-- ARGV[1] name   ARGV[2] the tick (ms)
-- Returns 1 when the tick was owed, 0 when not (paid already, or the schedule was removed).
local function sched_paid(keys, args)
  local s = redis.call('HMGET', keys[2], 'gen', 'owe', 'next', 'paused', 'last')
  if not s[1] or not s[2] then return 0 end
  local tick = tonumber(args[2])
  local left, found = {}, false
  for t in string.gmatch(s[2], '[^,]+') do
    if tonumber(t) == tick then found = true else left[#left + 1] = t end
  end
  if not found then return 0 end
  if not s[5] or tonumber(s[5]) < tick then redis.call('HSET', keys[2], 'last', args[2]) end
  if #left > 0 then
    redis.call('HSET', keys[2], 'owe', table.concat(left, ','))
    return 1
  end
  redis.call('HDEL', keys[2], 'owe')
  local next = tonumber(s[3] or sg_now())
  if s[4] and next > tonumber(s[4]) then
    redis.call('ZREM', keys[1], args[1])
  else
    redis.call('ZADD', keys[1], next, args[1])
  end
  return 1
end
