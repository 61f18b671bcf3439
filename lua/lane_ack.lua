-- lane_ack: ack for a lane token (prelude.lua, "Lanes"): a slot reports the outcomes of the lane
-- batch it was handed and, in the same step, gets the next batch or gives the token back. Each
-- outcome is recorded in its request's record if that request is still live with the entry's
-- lifecycle (else it is dropped: the request was cancelled, failed fast or reopened); a settled
-- part feeds the lane its request's next waiting part; a request whose last part is settled
-- finishes here, and the requests the call finished share one entry of the events stream
-- (sg_lane_events).
-- KEYS[1..6] the lane's keys (as a request's, prelude.lua)   KEYS[7] the shard's events stream
-- KEYS[8] the shard's active index   KEYS[9] the shard's looks armed before a step
-- ARGV[1] the lane's key id   ARGV[2] token k   ARGV[3] epoch   ARGV[4] holder   ARGV[5] consumer
-- ARGV[6] 1 = continue, 0 = give the token back   ARGV[7] retention (ms)   ARGV[8] completion
-- channel   ARGV[9] next batch: how many entries at most ("<n>|flat": flat entries)   ARGV[10] the records' key prefix
-- KEYS[10] (optional) the prefix of the shard's downstream sets ("<ns>:{<ns>.q<s>}:dn:"): given,
--   the reply names the downstreams of each request it releases, when they are few (below)
-- ARGV[11..] one group of eight per entry, in the order handed out: entry id, outcome ('ok',
--   'retry', 'dead', 'skip' as for ack), body, retry delay (ms), attempt, request key id,
--   lifecycle, index
-- Returns {'run', entry, ...} as lane_acquire; {'requeue', element}; {'park', wake};
--         {'fenced'} as ack. Requests that finished are announced by this call itself; when some
--         did, the reply ends with one more item {'done', state, lifecycle, state, lifecycle,
--         ...}, one pair per request finished, for the stats by stage; and when some of them have
--         downstreams, with {'rel', key id, state, lifecycle, ...}: their releases, owed (in the
--         outbox) and for the caller to run. With KEYS[10], one more item after it, {'dn', key id,
--         n, downstream entry * n, ...}: the whole set of downstreams of each request released
--         whose set holds at most SG_DN_PAGE (the release then reads none of it).
local function lane_ack(keys, args)
  local k, epoch, holder = args[2], args[3], args[4]
  local m = redis.call('HMGET', keys[1], 't' .. k, 'extra', 'm' .. k)
  local tok = m[1]
  if not tok then return {'fenced'} end
  local ids = {}
  for i = 11, #args, 8 do ids[#ids + 1] = args[i] end
  if not sg_holds(tok, epoch, holder, table.concat(ids, ',')) then
    return {'fenced'}
  end
  -- The token holds exactly these entries under this epoch, so each is pending and is settled
  -- here once: they are acked and freed together at the end (sg_lane_drop).
  local now = sg_now()
  -- `now` as text, converted once for every record this call finishes.
  local finished_at = sg_int(now)
  local extra = tonumber(m[2] or '0')
  local prefix, retention = args[10], args[7]
  -- Each request's record is read once and written once however many of its parts the batch
  -- holds: `recs` keeps, by key id, the record as read and then updated here (`r`: state, lc,
  -- pol, left, failed, rq, nf, dn, ix, rqd, discard), which of its counters changed (`settled`:
  -- left, `dead`: failed, `fed`: rq or nf, `discarded`: discard), the parts' own fields to write (`out`, flat) and to delete (`del`),
  -- the parts to feed the lane (`feed`) and, once its last part is settled, its terminal state;
  -- `order` lists the key ids as first seen. Fields written and deleted never overlap, nor does a
  -- part's field repeat: each part is in the batch once.
  local recs, order, settled = {}, {}, {}
  -- The requests this call finished, for the caller's stats by stage: {'done', state, lc, ...}.
  local done = {'done'}
  for i = 11, #args, 8 do
    local id, outcome, body, attempt, kid, lc, index = args[i], args[i + 1], args[i + 2], args[i + 4],
      args[i + 5], args[i + 6], args[i + 7]
    local rec = recs[kid]
    if not rec then
      rec = {r = redis.call('HMGET', prefix .. kid, 'state', 'lc', 'pol', 'left', 'failed', 'rq', 'nf', 'dn', 'ix', 'rqd', 'discard'),
        out = {}}
      recs[kid] = rec
      order[#order + 1] = kid
    end
    local r, out = rec.r, rec.out
    if rec.state or not sg_lane_live(r, lc) then
      settled[#settled + 1] = id
    elseif r[1] == 'queued' then
      -- Handed out without its record (sg_lane_entry): it reads running from now on, since the
      -- batch's hand-out (the token's running marks go below).
      rec.marked = true
    end
    if rec.state or not sg_lane_live(r, lc) then
    elseif outcome == 'retry' then
      redis.call('ZADD', keys[6], now + tonumber(args[i + 3]), id)
      extra = extra + 1
      out[#out + 1] = 'e' .. index
      out[#out + 1] = body
    elseif outcome == 'skip' then
      redis.call('XCLAIM', keys[2], 'g', args[5], 0, id, 'RETRYCOUNT', math.max(tonumber(attempt) - 1, 0), 'JUSTID')
      redis.call('RPUSH', keys[5], id)
      extra = extra + 1
    else
      settled[#settled + 1] = id
      local failfast = sg_lane_failfast(r[3])
      r[4] = tonumber(r[4]) - 1
      rec.settled = true
      if outcome == 'ok' then
        if r[11] then
          -- Its results are discarded: counted, not stored.
          r[11] = tonumber(r[11]) + 1
          rec.discarded = true
        else
          out[#out + 1] = 'o' .. index
          out[#out + 1] = body
        end
        -- An error record is left by an earlier attempt, or by a run before a requeue (`rqd`).
        if attempt ~= '1' or r[10] then
          rec.del = rec.del or {}
          rec.del[#rec.del + 1] = 'e' .. index
        end
        if attempt ~= '1' then
          redis.call('HINCRBY', prefix .. kid, 'retried', 1)
          if tonumber(attempt) > tonumber(redis.call('HGET', prefix .. kid, 'maxseen') or '1') then
            redis.call('HSET', prefix .. kid, 'maxseen', attempt)
          end
        end
      else
        r[5] = tonumber(r[5] or '0') + 1
        rec.dead = true
        local entry = redis.call('XRANGE', keys[2], id, id)[1]
        out[#out + 1] = 'e' .. index
        out[#out + 1] = body
        out[#out + 1] = 'x' .. index
        -- The payload, as sg_lane_add placed it.
        out[#out + 1] = entry and entry[2][2] or ''
      end
      if failfast then
        rec.del = rec.del or {}
        rec.del[#rec.del + 1] = 'w' .. index
      end
      if r[4] <= 0 or (outcome == 'dead' and failfast) then
        rec.state = 'completed'
        if tonumber(r[5] or '0') > 0 then rec.state = 'failed' end
      else
        -- A settled part makes room for the request's next waiting part, if any.
        local feed, fed = sg_lane_pick(r[6], r[7], r[3])
        if feed then
          rec.feed = rec.feed or {}
          rec.feed[#rec.feed + 1] = feed
          if fed[1] == 'rq' then
            r[6], rec.fed_rq = fed[2], true
          else
            r[7], rec.fed_nf = fed[2], true
          end
        end
      end
    end
  end
  -- The records' writes, then the finished requests' announcements and the fed parts.
  -- Finished requests whose records keep their index rows (sg_ix_add_kept) apart: `kept`, with
  -- their states and submission times.
  local announced, finished, states, released = {}, {}, {}, {'rel'}
  local kept, kept_states, kept_ats = {}, {}, {}
  for _, kid in ipairs(order) do
    local rec, record = recs[kid], prefix .. kid
    local fields, r = rec.out, rec.r
    if rec.settled then
      fields[#fields + 1] = 'left'
      fields[#fields + 1] = sg_str(r[4])
    end
    if rec.dead then
      fields[#fields + 1] = 'failed'
      fields[#fields + 1] = sg_str(r[5])
    end
    if rec.discarded then
      fields[#fields + 1] = 'discard'
      fields[#fields + 1] = sg_str(r[11])
    end
    if rec.fed_rq then
      fields[#fields + 1] = 'rq'
      fields[#fields + 1] = r[6]
    end
    if rec.fed_nf then
      fields[#fields + 1] = 'nf'
      fields[#fields + 1] = sg_str(r[7])
    end
    if rec.marked then
      if not rec.state then
        fields[#fields + 1] = 'state'
        fields[#fields + 1] = 'running'
      end
      fields[#fields + 1] = 'started'
      fields[#fields + 1] = sg_held_since(tok)
    end
    if rec.state then
      fields[#fields + 1] = 'state'
      fields[#fields + 1] = rec.state
      fields[#fields + 1] = 'finished'
      fields[#fields + 1] = finished_at
    end
    if #fields > 0 then redis.call('HSET', record, unpack(fields)) end
    if rec.del then redis.call('HDEL', record, unpack(rec.del)) end
    if rec.feed then sg_lane_feed_parts(keys, record, kid, r[2], r[3], rec.feed) end
    if rec.state then
      -- A failed request keeps its waiting parts: its dead letters may be requeued, and its
      -- parts not yet run then run too.
      announced[#announced + 1] = sg_lane_announce(record, kid, rec.state, retention, now, keys[7], r[8])
      if r[8] then
        released[#released + 1] = kid
        released[#released + 1] = rec.state
        released[#released + 1] = r[2]
      end
      if r[9] then
        kept[#kept + 1] = kid
        kept_states[#kept_states + 1] = rec.state
        kept_ats[#kept_ats + 1] = sg_ix_kept_at(r[9], r[2])
      else
        finished[#finished + 1] = kid
        states[#states + 1] = rec.state
      end
      done[#done + 1] = rec.state
      done[#done + 1] = r[2]
    end
  end
  if #announced > 0 then
    local ix, listed, expires = sg_ix(keys[7]), {}, now + tonumber(retention)
    sg_ix_finish_many(ix, finished, states, expires, now, listed)
    sg_ix_finish_kept(ix, kept, kept_states, kept_ats, expires, now, listed)
    sg_ix_finished(ix, now, listed)
    sg_lane_events(keys[7], announced, retention, now, args[8])
  end
  -- The batch's running marks (sg_lane_marks): its records say running now.
  if m[3] then redis.call('HDEL', keys[1], 'm' .. k) end
  if extra ~= tonumber(m[2] or '0') then redis.call('HSET', keys[1], 'extra', extra) end
  sg_lane_drop(keys, settled)
  local reply
  if args[6] == '1' then
    local want, flat = sg_want(args[9])
    reply = sg_lane_next(keys, k, epoch, holder, args[5], now, extra, want, prefix, keys[8], keys[9], flat)
  else
    reply = {'requeue', sg_requeue(keys, args[1], k, epoch, now)}
  end
  if #done > 1 then reply[#reply + 1] = done end
  if #released > 1 then
    reply[#reply + 1] = released
    if keys[10] then reply[#reply + 1] = sg_lane_downstreams(keys[10], released) end
  end
  return reply
end
