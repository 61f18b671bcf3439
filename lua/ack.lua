-- ack: a slot reports the outcome of one sub-request and, in the same step, either gets the next
-- one (it keeps its token), or gives the token back, or learns that the request is finished.
-- KEYS[1] meta hash   KEYS[2] parts stream   KEYS[3] results hash   KEYS[4] errors hash
-- ARGV[1] request key id   ARGV[2] token k   ARGV[3] epoch   ARGV[4] holder   ARGV[5] consumer
-- ARGV[6] lease (ms)   ARGV[7] entry id   ARGV[8] 'ok' or 'err'   ARGV[9] result bytes or error text
-- ARGV[10] 1 = continue with this request, 0 = give the token back (quantum used up, shutting down)
-- ARGV[11] retention (ms) of results once finished   ARGV[12] completion channel
-- Returns {'run', ...} as acquire; {'requeue', element}: push element onto the priority list;
--         {'park'}; {'finished', state, sweep elements...}: the request just turned terminal;
--         {'fenced'}: this slot no longer holds the token for that entry; nothing was recorded.
local function ack(keys, args)
  local k, epoch, holder, entry = args[2], args[3], args[4], args[7]
  local tok = redis.call('HGET', keys[1], 't' .. k)
  if not tok then return {'fenced'} end
  local f = sg_split(tok)
  if f[1] ~= 'h' or f[2] ~= epoch or f[3] ~= holder or f[5] ~= entry then return {'fenced'} end
  -- The token check above is the fence: XACK alone would accept an entry claimed by another.
  if redis.call('XACK', keys[2], 'g', entry) == 0 then return {'fenced'} end
  redis.call('XDEL', keys[2], entry)
  local index = sg_index(entry)
  if args[8] == 'ok' then
    redis.call('HSET', keys[3], index, args[9])
  else
    redis.call('HSET', keys[4], index, args[9])
    redis.call('HINCRBY', keys[1], 'failed', 1)
  end
  local done = redis.call('HINCRBY', keys[1], 'done', 1)
  local now = sg_now()
  if done >= tonumber(redis.call('HGET', keys[1], 'total')) then
    local failed = tonumber(redis.call('HGET', keys[1], 'failed'))
    local state = 'completed'
    if failed > 0 then state = 'failed' end
    return sg_finish(keys, args[1], state, args[11], args[12], now)
  end
  if args[10] == '1' then
    return sg_next(keys, args[1], k, epoch, holder, args[5], tonumber(args[6]), now)
  end
  local next_epoch = tonumber(epoch) + 1
  redis.call('HSET', keys[1], 't' .. k, 'q|' .. next_epoch .. '|' .. now)
  return {'requeue', sg_element(args[1], k, next_epoch)}
end
