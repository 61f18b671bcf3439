-- acquire: a worker slot presents a token element it popped, and gets a sub-request to run.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] token number k   ARGV[3] token epoch   ARGV[4] holder (worker/slot)
-- ARGV[5] stream consumer name   ARGV[6] lease (ms)
-- Returns {'run', entry id, index, payload, attempt, max attempts, timeout ms, backoff base ms,
--          backoff max ms}: the slot holds the token, leased, and knows the request's policy;
--         {'park'}: no work left to hand out, the token waits in the request until work appears;
--         {'drop'}: the request is finished, cancelled or unknown: forget the element;
--         {'stale'}: the element is not the token's current one (old epoch, or not queued).
local function acquire(keys, args)
  local m = redis.call('HMGET', keys[1], 't' .. args[2], 'extra', 'state')
  local tok = m[1]
  if not tok then return {'drop'} end
  local f = sg_split(tok)
  if f[1] == 'h' and f[2] == args[3] and f[3] == args[4] and f[5] ~= '' then
    -- The same slot presenting the same element again: a call re-sent after a reconnect whose
    -- first reply was lost. Hand out the entry it already holds instead of stranding it.
    local entry = redis.call('XRANGE', keys[2], f[5], f[5])[1]
    local pending = redis.call('XPENDING', keys[2], 'g', f[5], f[5], 1)[1]
    if entry and pending then
      local policy = redis.call('HMGET', keys[1], 'maxatt', 'timeout', 'bbase', 'bmax')
      return {'run', f[5], sg_index(f[5]), entry[2][2], tonumber(pending[4]),
        policy[1] or '0', policy[2] or '0', policy[3] or '0', policy[4] or '0'}
    end
  end
  if f[1] ~= 'q' or f[2] ~= args[3] then return {'stale'} end
  local now = sg_now()
  local reply = sg_next(keys, args[1], args[2], args[3], args[4], args[5], tonumber(args[6]), now, m[2])
  if reply[1] == 'run' then
    if m[3] == 'queued' then redis.call('HSET', keys[1], 'state', 'running', 'started', now) end
    local policy = redis.call('HMGET', keys[1], 'maxatt', 'timeout', 'bbase', 'bmax')
    for i = 1, 4 do reply[#reply + 1] = policy[i] or '0' end
  end
  return reply
end
