-- requeue_dead: hand a request's dead letters out again, each with a fresh set of attempts. A
-- running request simply gets the work back; a failed one is reopened (state `running`, keys
-- persisted again, tokens re-created under epochs above any earlier one) and will end with a new
-- terminal record and event.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id
-- Returns {n, reopened, elements...}: how many were requeued; the new lifecycle (`gen`) when a
-- failed request was reopened, else 0 (the caller then marks it with ring 'reopen'); and token
-- elements to push onto the request's priority list (re-created or unparked tokens). Or {-1, gen}:
-- the request failed but its finish is not sealed yet (its event may be unwritten): nothing
-- changed; the caller completes the steps after that finish (finish_index, seal, unindex) and
-- calls again, so that the failed lifecycle keeps its event. Errors "SGSTATE ..." when the
-- request cannot be requeued (unknown, loading, completed, cancelled, or its retention ran out).
local function requeue_dead(keys, args)
  local m = redis.call('HMGET', keys[1], 'state', 'ntok', 'limit', 'gen', 'sealed')
  local state = m[1]
  if state ~= 'failed' and state ~= 'running' and state ~= 'queued' then
    return redis.error_reply('SGSTATE only a failed or running request has dead letters to requeue')
  end
  if state == 'failed' and m[5] ~= (m[4] or '0') then return {-1, m[4] or '0'} end
  local dead = redis.call('ZRANGEBYSCORE', keys[6], 'inf', 'inf')
  local n = #dead
  if n == 0 then return {0, 0} end
  local now = sg_now()
  for _, id in ipairs(dead) do
    -- RETRYCOUNT 0: the next delivery counts as attempt 1 again.
    redis.call('XCLAIM', keys[2], 'g', 'requeue', 0, id, 'RETRYCOUNT', 0, 'JUSTID')
    redis.call('ZADD', keys[6], now, id)
  end
  redis.call('HINCRBY', keys[1], 'extra', n)
  redis.call('HINCRBY', keys[1], 'left', n)
  redis.call('HINCRBY', keys[1], 'failed', -n)
  local out = {n, 0}
  if state == 'failed' then
    -- Elements of the earlier lifecycle may linger in a list: start the epochs above them.
    local gen = redis.call('HINCRBY', keys[1], 'gen', 1)
    out[2] = gen
    local epoch = gen * 1000000000 + 1
    local ntok = math.min(tonumber(m[3]), n)
    for i = 1, 6 do redis.call('PERSIST', keys[i]) end
    redis.call('HSET', keys[1], 'state', 'running', 'ntok', ntok)
    redis.call('HDEL', keys[1], 'finished', 'sealed')
    for k = 0, ntok - 1 do
      redis.call('HSET', keys[1], 't' .. k, 'q|' .. epoch .. '|' .. now)
      out[#out + 1] = sg_element(args[1], k, epoch)
    end
    return out
  end
  -- Running: parked tokens come back for the work.
  local woken = 0
  for k = 0, tonumber(m[2]) - 1 do
    if woken >= n then break end
    local tok = redis.call('HGET', keys[1], 't' .. k)
    local f = tok and sg_split(tok)
    if f and f[1] == 'p' then
      out[#out + 1] = sg_requeue(keys, args[1], k, f[2], now)
      woken = woken + 1
    end
  end
  return out
end
