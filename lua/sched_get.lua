-- sched_get: a schedule's spec and state (read-only). The
-- schedules live on shard 0 (docs/protocol.md §3, "Schedules"); the state fields are explained in
-- sched_add.lua.
-- KEYS[1] the schedules (hash: name -> spec JSON)   KEYS[2] the schedule's state (hash)
-- ARGV[1] the schedule's name
-- Returns {spec, gen, from, next, paused, gaps, owe, last}: each as stored (nil where absent; a
-- removed schedule has neither spec nor state).
local function sched_get(keys, args)
  local spec = redis.call('HGET', keys[1], args[1])
  local s = redis.call('HMGET', keys[2], 'gen', 'from', 'next', 'paused', 'gaps', 'owe', 'last')
  return {spec, s[1], s[2], s[3], s[4], s[5], s[6], s[7]}
end
