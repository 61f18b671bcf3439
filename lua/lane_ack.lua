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
-- ARGV[11..] one group of eight per entry, in the order handed out: entry id, outcome ('ok',
--   'retry', 'dead', 'skip' as for ack), body, retry delay (ms), attempt, request key id,
--   lifecycle, index
-- Returns {'run', entry, ...} as lane_acquire; {'requeue', element}; {'park', wake};
--         {'fenced'} as ack. Requests that finished are announced by this call itself; when some
--         did, the reply ends with one more item {'done', state, lifecycle, state, lifecycle,
--         ...}, one pair per request finished, for the stats by stage.
local function lane_ack(keys, args)
  local k, epoch, holder = args[2], args[3], args[4]
  local m = redis.call('HMGET', keys[1], 't' .. k, 'extra')
  local tok = m[1]
  if not tok then return {'fenced'} end
  local f = sg_split(tok)
  local ids = {}
  for i = 11, #args, 8 do ids[#ids + 1] = args[i] end
  if f[1] ~= 'h' or f[2] ~= epoch or f[3] ~= holder or f[5] ~= table.concat(ids, ',') then
    return {'fenced'}
  end
  -- The token holds exactly these entries under this epoch, so each is pending and is settled
  -- here once: they are acked and freed together at the end (sg_lane_drop).
  local now = sg_now()
  local extra = tonumber(m[2] or '0')
  local prefix, retention = args[10], args[7]
  -- The listing index's changes of the requests this call finishes (sg_ix_finish's batch).
  local settled, finished, announced, listed = {}, {}, {}, {}
  -- The requests this call finished, for the caller's stats by stage: {'done', state, lc, ...}.
  local done = {'done'}
  for i = 11, #args, 8 do
    local id, outcome, body, attempt, kid, lc, index = args[i], args[i + 1], args[i + 2], args[i + 4],
      args[i + 5], args[i + 6], args[i + 7]
    local record = prefix .. kid
    local r = redis.call('HMGET', record, 'state', 'lc', 'pol', 'left', 'failed', 'rq', 'nf')
    if not sg_lane_live(r, lc) or finished[kid] then
      settled[#settled + 1] = id
    elseif outcome == 'retry' then
      redis.call('ZADD', keys[6], now + tonumber(args[i + 3]), id)
      extra = extra + 1
      redis.call('HSET', record, 'e' .. index, body)
    elseif outcome == 'skip' then
      redis.call('XCLAIM', keys[2], 'g', args[5], 0, id, 'RETRYCOUNT', math.max(tonumber(attempt) - 1, 0), 'JUSTID')
      redis.call('RPUSH', keys[5], id)
      extra = extra + 1
    else
      settled[#settled + 1] = id
      local failfast = sg_lane_failfast(r[3])
      local left, failed = tonumber(r[4]) - 1, tonumber(r[5] or '0')
      local fields = {'left', left}
      if outcome == 'ok' then
        fields[3], fields[4] = 'o' .. index, body
        if attempt ~= '1' then
          redis.call('HDEL', record, 'e' .. index)
          redis.call('HINCRBY', record, 'retried', 1)
          if tonumber(attempt) > tonumber(redis.call('HGET', record, 'maxseen') or '1') then
            redis.call('HSET', record, 'maxseen', attempt)
          end
        end
      else
        failed = failed + 1
        local entry = redis.call('XRANGE', keys[2], id, id)[1]
        local payload = entry and sg_lane_fields(entry[2]).p or ''
        fields[3], fields[4], fields[5], fields[6], fields[7], fields[8] =
          'e' .. index, body, 'x' .. index, payload, 'failed', failed
      end
      if failfast then redis.call('HDEL', record, 'w' .. index) end
      local last = left <= 0 or (outcome == 'dead' and failfast)
      local state, feed
      if last then
        state = 'completed'
        if failed > 0 then state = 'failed' end
        fields[#fields + 1] = 'state'
        fields[#fields + 1] = state
        fields[#fields + 1] = 'finished'
        fields[#fields + 1] = now
      else
        -- A settled part makes room for the request's next waiting part, if any.
        local fed
        feed, fed = sg_lane_pick(r[6], r[7], r[3])
        if feed then
          fields[#fields + 1] = fed[1]
          fields[#fields + 1] = fed[2]
        end
      end
      redis.call('HSET', record, unpack(fields))
      if last then
        -- A failed request keeps its waiting parts: its dead letters may be requeued, and its
        -- parts not yet run then run too.
        announced[#announced + 1] = sg_lane_announce(record, kid, state, retention, keys[7], now, listed)
        finished[kid] = true
        done[#done + 1] = state
        done[#done + 1] = lc
      elseif feed then
        sg_lane_feed_part(keys, record, kid, lc, r[3], feed)
      end
    end
  end
  if #announced > 0 then
    sg_ix_finished(sg_ix(keys[7]), now, listed)
    redis.call('PEXPIRE', keys[7], retention)
    redis.call('PUBLISH', args[8], table.concat(announced, '\n'))
  end
  if extra ~= tonumber(m[2] or '0') then redis.call('HSET', keys[1], 'extra', extra) end
  sg_lane_drop(keys, settled)
  local reply
  if args[6] == '1' then
    reply = sg_lane_next(keys, k, epoch, holder, args[5], now, extra, tonumber(args[9]), prefix, keys[8], keys[9])
  else
    reply = {'requeue', sg_requeue(keys, args[1], k, epoch, now)}
  end
  if #done > 1 then reply[#reply + 1] = done end
  return reply
end
