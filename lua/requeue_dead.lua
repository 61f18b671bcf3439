-- requeue_dead: hand a request's dead letters out again, each with a fresh set of attempts. A
-- running request simply gets the work back; a failed one is reopened (state `running`, keys
-- persisted again, its full set of tokens re-created under epochs above any earlier one) and will
-- end with a new terminal record and event.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] the lifecycle to reopen a failed request as ('' when the caller
-- has not marked one yet, see below)   ARGV[3] the deadline of the caller's arm (sg_step_late)
-- ARGV[4] 'resume' (recovery): complete a requeue whose caller died after `reopen` marked ARGV[2],
-- only if the request is still the failed lifecycle just before it; otherwise do nothing ({0, 0})
-- Returns {n, reopened, elements...}: how many were requeued; the new lifecycle when a failed
-- request was reopened, else 0; and token elements to push (re-created or woken tokens). A
-- downstream that failed because of an upstream (`why` = `upstream:<ukid>`) has no dead letter:
-- it is reopened (n = 0) once its gate is open again (prelude.lua, "Dependencies between
-- requests"), and is otherwise left as it is ({0, 0}). For a
-- failed request, nothing changes and the reply says what to do first:
--   {-1, lifecycle}: its finish is not sealed yet (its event may be unwritten): complete the steps
--   after that finish (finish_index, seal, unindex) and call again;
--   {-2, next lifecycle}: call `reopen` on the home shard with that lifecycle (it indexes the
--   request again and marks the lifecycle, so that no late unindex of the failed one removes it),
--   then call again with ARGV[2] set to it.
-- Errors "SGSTATE ..." when the request cannot be requeued (unknown, loading, completed,
-- cancelled, failed at its deadline, or its retention ran out), "SGLATE ..." past the deadline.
local function requeue_dead(keys, args)
  local late = sg_step_late(args[3])
  if late then return late end
  local m = redis.call('HMGET', keys[1], 'state', 'ntok', 'limit', 'sealed', 'total', 'maxep', 'why', 'upw',
    'upf', 'onup', 'open')
  local state = m[1]
  if state == 'failed' and m[7] == 'deadline' then
    -- It would end again at once: its deadline has passed for good.
    return redis.error_reply('SGSTATE the request ended at its deadline: submit it again instead')
  end
  if args[4] == 'resume' then
    if state ~= 'failed' then return {0, 0} end
    local lifecycle = sg_lifecycle(keys)
    if m[4] ~= lifecycle or args[2] ~= sg_int(tonumber(lifecycle) + 1) then return {0, 0} end
  end
  if state ~= 'failed' and state ~= 'running' and state ~= 'queued' then
    return redis.error_reply('SGSTATE only a failed, running or queued request has dead letters to requeue')
  end
  local dead = redis.call('ZRANGEBYSCORE', keys[6], 'inf', 'inf')
  local n = #dead
  -- A downstream failed because of an upstream has no dead letter, and reopens once its gate is
  -- open again (the upstream was requeued and completed). With nothing to requeue, nothing is
  -- asked of the caller either (a reopen asked for and not carried out would keep it indexed).
  if n == 0 and not (state == 'failed' and sg_dag_reopenable(m[7], m[8], m[9], m[10])) then return {0, 0} end
  local lifecycle = sg_lifecycle(keys)
  if state == 'failed' then
    if m[4] ~= lifecycle then return {-1, lifecycle} end
    local next = sg_int(tonumber(lifecycle) + 1)
    if args[2] ~= next then return {-2, next} end
  end
  local now = sg_now()
  for _, id in ipairs(dead) do
    -- RETRYCOUNT 0: the next delivery counts as attempt 1 again.
    redis.call('XCLAIM', keys[2], 'g', 'requeue', 0, id, 'RETRYCOUNT', 0, 'JUSTID')
    redis.call('ZADD', keys[6], now, id)
  end
  if n > 0 then
    redis.call('HINCRBY', keys[1], 'extra', n)
    redis.call('HINCRBY', keys[1], 'left', n)
    redis.call('HINCRBY', keys[1], 'failed', -n)
  end
  if state == 'failed' then
    redis.call('HINCRBY', keys[1], 'gen', 1)
    -- Elements of the earlier lifecycle may linger in a list: start the epochs above them.
    local epoch = sg_next_epoch(m[6], now)
    local ntok = math.min(tonumber(m[3]), tonumber(m[5]))
    for i = 1, 6 do redis.call('PERSIST', keys[i]) end
    redis.call('HSET', keys[1], 'state', 'running', 'ntok', ntok, 'npark', 0)
    -- A streamed request that failed before its finalize (fail fast) had its producer's adds and
    -- finalize refused from then on: reopened, it runs the parts it has and finishes with them,
    -- as if finalized, rather than waiting for a finalize that will not come.
    if m[11] == '1' then redis.call('HSET', keys[1], 'open', 0) end
    redis.call('HDEL', keys[1], 'finished', 'sealed', 'why')
    local out, fields = {n, args[2]}, {}
    for k = 0, ntok - 1 do
      fields[#fields + 1] = 't' .. k
      fields[#fields + 1] = 'q|' .. epoch .. '|' .. now
      out[#out + 1] = sg_element(args[1], k, epoch)
    end
    sg_hset_many(keys[1], fields)
    return out
  end
  -- Running: parked tokens come back for the work.
  local out = {n, 0}
  for _, e in ipairs(sg_unpark(keys, args[1], n, now)) do out[#out + 1] = e end
  return out
end
