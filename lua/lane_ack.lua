-- lane_ack: ack for a lane token (prelude.lua, "Lanes"): a slot reports the outcomes of the lane
-- batch it was handed and, in the same step, gets the next batch or gives the token back. Each
-- outcome is recorded in its request's record if that request is still live with the entry's
-- lifecycle (else it is dropped: the request was cancelled, failed fast or reopened); a settled
-- part feeds the lane its request's next waiting part; a request whose last part is settled
-- finishes here (sg_lane_finish).
-- KEYS[1..6] the lane's keys (as a request's, prelude.lua)   KEYS[7] the shard's events stream
-- KEYS[8] the shard's active index   KEYS[9] the shard's looks armed before a step
-- ARGV[1] the lane's key id   ARGV[2] token k   ARGV[3] epoch   ARGV[4] holder   ARGV[5] consumer
-- ARGV[6] 1 = continue, 0 = give the token back   ARGV[7] retention (ms)   ARGV[8] completion
-- channel   ARGV[9] next batch: how many entries at most   ARGV[10] the records' key prefix
-- ARGV[11..] one group of seven per entry, in the order handed out: entry id, outcome ('ok',
--   'retry', 'dead', 'skip' as for ack), body, retry delay (ms), attempt, request key id, lifecycle
-- Returns {'run', entry, ...} as lane_acquire; {'requeue', element}; {'park', wake};
--         {'fenced'} as ack. Requests that finished are announced by this call itself.
local function lane_ack(keys, args)
  local k, epoch, holder = args[2], args[3], args[4]
  local m = redis.call('HMGET', keys[1], 't' .. k, 'extra')
  local tok = m[1]
  if not tok then return {'fenced'} end
  local f = sg_split(tok)
  local ids = {}
  for i = 11, #args, 7 do ids[#ids + 1] = args[i] end
  if f[1] ~= 'h' or f[2] ~= epoch or f[3] ~= holder or f[5] ~= table.concat(ids, ',') then
    return {'fenced'}
  end
  local now = sg_now()
  local extra = tonumber(m[2] or '0')
  local prefix = args[10]
  local gone, finished = {}, {}
  for i = 11, #args, 7 do
    local id, outcome, body, attempt, kid, lc = args[i], args[i + 1], args[i + 2], args[i + 4], args[i + 5], args[i + 6]
    local record = prefix .. kid
    local r = redis.call('HMGET', record, 'state', 'created', 'gen', 'failfast')
    if not sg_lane_live(r, lc) or finished[kid] then
      gone[#gone + 1] = id
    elseif outcome == 'retry' then
      redis.call('ZADD', keys[6], now + tonumber(args[i + 3]), id)
      extra = extra + 1
      local entry = redis.call('XRANGE', keys[2], id, id)[1]
      if entry then redis.call('HSET', record, 'e' .. sg_lane_fields(entry[2]).i, body) end
    elseif outcome == 'skip' then
      redis.call('XCLAIM', keys[2], 'g', args[5], 0, id, 'RETRYCOUNT', math.max(tonumber(attempt) - 1, 0), 'JUSTID')
      redis.call('RPUSH', keys[5], id)
      extra = extra + 1
    else
      local entry = redis.call('XRANGE', keys[2], id, id)[1]
      if entry and redis.call('XACK', keys[2], 'g', id) == 1 then
        local e = sg_lane_fields(entry[2])
        if outcome == 'ok' then
          redis.call('HSET', record, 'o' .. e.i, body)
          redis.call('HDEL', record, 'e' .. e.i)
          if attempt ~= '1' then
            redis.call('HINCRBY', record, 'retried', 1)
            if tonumber(attempt) > tonumber(redis.call('HGET', record, 'maxseen') or '1') then
              redis.call('HSET', record, 'maxseen', attempt)
            end
          end
        else
          redis.call('HSET', record, 'e' .. e.i, body, 'x' .. e.i, e.p)
          redis.call('HINCRBY', record, 'failed', 1)
        end
        if r[4] == '1' then redis.call('HDEL', record, 'w' .. e.i) end
        local left = redis.call('HINCRBY', record, 'left', -1)
        if left <= 0 or (outcome == 'dead' and r[4] == '1') then
          local state = 'completed'
          if tonumber(redis.call('HGET', record, 'failed')) > 0 then state = 'failed' end
          sg_lane_finish(record, kid, state, args[7], args[8], keys[7], now)
          finished[kid] = true
        else
          sg_lane_feed(keys, record, kid, lc)
        end
      end
      redis.call('XDEL', keys[2], id)
    end
  end
  if extra ~= tonumber(m[2] or '0') then redis.call('HSET', keys[1], 'extra', extra) end
  sg_lane_drop(keys, gone)
  if args[6] == '1' then
    return sg_lane_next(keys, k, epoch, holder, args[5], now, extra, tonumber(args[9]), prefix, keys[8], keys[9])
  end
  return {'requeue', sg_requeue(keys, args[1], k, epoch, now)}
end
