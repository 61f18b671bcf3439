-- sched_add: create a schedule, or replace one. A schedule is a spec (its cron, time zone, missed
-- policy and request template, as JSON) and a state hash, both on shard 0, and its entry in the
-- due set. Cron is never read here: the ticks are computed by the worker that fires it (Rust,
-- from a Redis time), so a new schedule's first tick is left to the first firing, which takes
-- the first tick after `from`.
-- The state: `gen` (a new value of the schedules' counter at every add, replace, pause and
-- resume, never one a schedule of this name had before it was removed: a firing computed from an
-- older state is refused), `from` (ticks at or before it are not owed: when the schedule was added
-- or replaced), `next` (the first tick not yet owed; absent until the first firing), `paused`
-- (when it was paused, while it is), `gaps` (the pauses since `next`: "<paused>:<resumed>,...";
-- a tick within one is not owed; a firing drops those it has passed), `resumed` (when it was last
-- resumed), `owe` (ticks owed and not yet submitted: "<ms>,<ms>,...", oldest first), `last` (the
-- latest tick paid).
-- KEYS[1] the schedules (hash: name -> spec)   KEYS[2] the due set (sorted set: name -> ms when
-- a worker should look at it)   KEYS[3] the schedule's state   KEYS[4] the schedules' counter
-- (hash: field `n`, the last gen given)
-- ARGV[1] name   ARGV[2] spec (JSON)   ARGV[3] '1': replace a schedule of this name whose spec
-- differs
-- Returns {'added', gen}, {'replaced', gen}, {'same', gen} (it is there with this very spec: a
-- re-sent add; nothing changed) or {'exists', gen} (with another spec, and ARGV[3] is not '1':
-- nothing changed). A replaced schedule is active (not paused) from now; ticks it owes are kept,
-- and paid with the new spec.
local function sched_add(keys, args)
  local name, spec = args[1], args[2]
  local old = redis.call('HGET', keys[1], name)
  if old == spec then
    return {'same', tonumber(redis.call('HGET', keys[3], 'gen') or '0')}
  end
  if old and args[3] ~= '1' then
    return {'exists', tonumber(redis.call('HGET', keys[3], 'gen') or '0')}
  end
  local now = sg_now()
  redis.call('HSET', keys[1], name, spec)
  local gen = redis.call('HINCRBY', keys[4], 'n', 1)
  redis.call('HSET', keys[3], 'gen', gen, 'from', now)
  redis.call('HDEL', keys[3], 'next', 'paused', 'gaps', 'resumed')
  -- Looked at now: the first firing sets `next`.
  redis.call('ZADD', keys[2], now, name)
  if old then return {'replaced', gen} end
  return {'added', gen}
end
