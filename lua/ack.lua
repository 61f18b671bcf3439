-- ack: a slot reports the outcome of one sub-request and, in the same step, either gets the next
-- one (it keeps its token), or gives the token back, or learns that the request is finished.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] token k   ARGV[3] epoch   ARGV[4] holder   ARGV[5] consumer
-- ARGV[6] lease (ms)   ARGV[7] entry id   ARGV[8] outcome: 'ok', 'retry' or 'dead'
-- ARGV[9] 'ok': result bytes; 'retry' and 'dead': the error record (JSON: error, attempts, permanent)
-- ARGV[10] 1 = continue with this request, 0 = give the token back (quantum used up, shutting down)
-- ARGV[11] retention (ms) of results once finished   ARGV[12] completion channel
-- ARGV[13] 'retry': delay (ms) before the entry is handed out again   ARGV[14] the attempt number
-- Returns {'run', ...} as acquire (without the policy); {'requeue', element}: push element onto
--         the priority list; {'park'}; {'finished', state, sweep elements...}: the request just
--         turned terminal; {'fenced'}: this slot no longer holds the token for that entry, so
--         nothing was recorded (its lease ran out and the work moved on).
local function ack(keys, args)
  local k, epoch, holder, entry = args[2], args[3], args[4], args[7]
  local m = redis.call('HMGET', keys[1], 't' .. k, 'extra')
  local tok = m[1]
  if not tok then return {'fenced'} end
  local f = sg_split(tok)
  -- The token check is the fence: XACK alone would accept an entry that was claimed by another.
  if f[1] ~= 'h' or f[2] ~= epoch or f[3] ~= holder or f[5] ~= entry then return {'fenced'} end
  local now = sg_now()
  local index = sg_index(entry)
  local extra = m[2]
  if args[8] == 'retry' then
    -- Stays pending (its payload with it) until sg_take_work claims it again when due.
    redis.call('ZADD', keys[6], now + tonumber(args[13]), entry)
    redis.call('HSET', keys[4], index, args[9])
    extra = redis.call('HINCRBY', keys[1], 'extra', 1)
  else
    -- Acked entries stay in the stream until census trims it (XTRIM MINID): cheaper than an
    -- XDEL per entry.
    redis.call('XACK', keys[2], 'g', entry)
    if args[8] == 'ok' then
      redis.call('HSET', keys[3], index, args[9])
      if args[14] ~= '1' then redis.call('HDEL', keys[4], index) end
    else
      redis.call('HSET', keys[4], index, args[9])
      redis.call('HINCRBY', keys[1], 'failed', 1)
    end
    if redis.call('HINCRBY', keys[1], 'left', -1) <= 0 then
      local state = 'completed'
      if tonumber(redis.call('HGET', keys[1], 'failed')) > 0 then state = 'failed' end
      return sg_finish(keys, args[1], state, args[11], args[12], now)
    end
  end
  if args[10] == '1' then
    return sg_next(keys, args[1], k, epoch, holder, args[5], tonumber(args[6]), now, extra)
  end
  return {'requeue', sg_requeue(keys, args[1], k, epoch, now)}
end
