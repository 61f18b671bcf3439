-- sched_del: remove a schedule: its spec, its state and its due entry. Ticks it owes and has not
-- submitted yet are dropped (a firing under way may still submit one); its requests stay.
-- KEYS[1] the schedules   KEYS[2] the due set   KEYS[3] the schedule's state
-- ARGV[1] name
-- Returns 1 when it existed, 0 when not.
local function sched_del(keys, args)
  local existed = redis.call('HDEL', keys[1], args[1])
  redis.call('ZREM', keys[2], args[1])
  redis.call('DEL', keys[3])
  return existed
end
