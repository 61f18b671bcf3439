-- ack: a slot reports the outcomes of the batch it was handed and, in the same step, either gets
-- the next batch (it keeps its token), or gives the token back, or learns that the request is
-- finished.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] token k   ARGV[3] epoch   ARGV[4] holder   ARGV[5] consumer
-- ARGV[6] 1 = continue with this request, 0 = give the token back (quantum used up, shutting down)
-- ARGV[7] retention (ms) of results once finished   ARGV[8] completion channel
-- ARGV[9] next batch: how many entries at most, "<n>" or "<n>|flat" (flat entries in a `run` reply, sg_next)
-- ARGV[10..] one group of five per entry of the batch, in the order it was handed out:
--   entry id, outcome, body, retry delay (ms), attempt
--   outcome 'ok': body = result bytes; 'retry' / 'dead': body = the error record (JSON: error,
--   attempts, permanent); 'skip': the entry did not run (shutdown, or a first batch past its
--   budget), it is handed out again first.
--   A dead letter stays pending, in the retry set at +inf, until requeue_dead or the retention.
-- Returns {'run', entry, ...} as acquire (without the policy; flat entries with "<n>|flat"); {'requeue', element, priority}:
--         push element back (give_back) onto the list of the request's priority now (an operator
--         may have changed it since the token was taken: reprioritize); {'park', wake} as
--         acquire; {'finished', state, lifecycle, sweep elements...}: the request just turned
--         terminal (completed, failed, or failed at its deadline: meta `dl`, `why` =
--         `deadline`); {'fenced'}: this slot no longer holds the token with exactly these
--         entries, so nothing was recorded (its worker was declared dead and the work moved on, or the
--         request was cancelled).
-- A windowed request (meta `window` W > 0), or one whose results are being taken (`taken` > 0,
-- results_from), acks its `ok` entries one by one, so that it knows which this call settled: only
-- those store their result, and not when the results are discarded or the part's outcome was
-- taken already (a requeued dead letter): they count in `discarded` instead. One that only
-- discards its results (`discard`) acks them together, as any request does, and counts in
-- `discarded` what that `XACK` settled. A windowed request also trims its stream every W/4
-- settled acks (meta `acks`), see window_trim.

-- The last entry id delivered to the group (`0-0` if none).
local function window_delivered(keys)
  local group = redis.call('XINFO', 'GROUPS', keys[2])[1]
  for i = 1, #group, 2 do
    if group[i] == 'last-delivered-id' then return group[i + 1] end
  end
  return '0-0'
end

-- Trims a windowed request's stream below its oldest pending entry (or, with none pending, past
-- the last one delivered): never an entry that is pending (running, waiting for a retry, an
-- orphan, a dead letter) or not yet delivered. When a pending entry holds the trim back (a dead
-- letter, a retry, a slow part) and more than W/2 acked entries stay above it, meta `xdel` = 1
-- tells the acks to XDEL the entries they settle one by one until a later trim finds the stream
-- short again.
local function window_trim(keys, window)
  local pending = redis.call('XPENDING', keys[2], 'g')
  local delivered = window_delivered(keys)
  local oldest = pending[2]
  if not oldest and delivered ~= '0-0' then oldest = '0-' .. (sg_index(delivered) + 2) end
  if oldest then redis.call('XTRIM', keys[2], 'MINID', oldest) end
  local undelivered = tonumber(redis.call('HGET', keys[1], 'total') or '0')
  if delivered ~= '0-0' then undelivered = undelivered - sg_index(delivered) - 1 end
  local stuck = redis.call('XLEN', keys[2]) - tonumber(pending[1]) - math.max(undelivered, 0)
  local xdel = 0
  if stuck > window / 2 then xdel = 1 end
  redis.call('HSET', keys[1], 'xdel', xdel)
end

local function ack(keys, args)
  local k, epoch, holder = args[2], args[3], args[4]
  local m = redis.call('HMGET', keys[1], 't' .. k, 'extra', 'window', 'discard', 'taken', 'xdel', 'prio', 'dl', 'rate', 'tat')
  local tok = m[1]
  if not tok then return {'fenced'} end
  local ids = {}
  for i = 10, #args, 5 do ids[#ids + 1] = args[i] end
  -- The token check is the fence: XACK alone would accept entries that were claimed by another.
  if not sg_holds(tok, epoch, holder, table.concat(ids, ',')) then
    return {'fenced'}
  end
  local now = sg_now()
  local extra = tonumber(m[2] or '0')
  local acked, results, errors, cleared = {}, {}, {}, {}
  local failed = 0
  local window, discard, taken = tonumber(m[3] or '0'), m[4] == '1', tonumber(m[5] or '0')
  local one_by_one = window > 0 or taken > 0
  local settled_ok, discarded, deleted = 0, 0, {}
  -- A part that succeeds clears the error record an earlier attempt left, if there is any: with
  -- no errors hash, there is none to clear.
  local errored = redis.call('EXISTS', keys[4]) == 1
  for i = 10, #args, 5 do
    local id, outcome, body, index = args[i], args[i + 1], args[i + 2], sg_index(args[i])
    -- The part's field in the results and errors hashes, as text: Redis would format a Lua
    -- number as a double (%.17g), the costliest step of an argument. Small indices are
    -- remembered (sg_str).
    local name = sg_str(index)
    -- The outcome of a part below `taken` was handed to the reader already (a requeued dead
    -- letter that ran again): nothing more is recorded for it.
    local past = index < taken
    if outcome == 'ok' then
      if not one_by_one then
        acked[#acked + 1] = id
        if not discard then
          results[#results + 1] = name
          results[#results + 1] = body
        end
      elseif redis.call('XACK', keys[2], 'g', id) == 1 then
        settled_ok = settled_ok + 1
        if discard or past then
          discarded = discarded + 1
        else
          results[#results + 1] = name
          results[#results + 1] = body
        end
        if m[6] == '1' then deleted[#deleted + 1] = id end
      end
      if errored and not past then cleared[#cleared + 1] = name end
      if args[i + 4] ~= '1' then
        -- Succeeded after retries: kept in the record, which the error record no longer is.
        redis.call('HINCRBY', keys[1], 'retried', 1)
        if tonumber(args[i + 4]) > tonumber(redis.call('HGET', keys[1], 'maxseen') or '1') then
          redis.call('HSET', keys[1], 'maxseen', args[i + 4])
        end
      end
    elseif outcome == 'dead' then
      -- A dead letter stays pending, parked in the retry set at +inf (never due), so that
      -- requeue_dead can hand it out again with its payload. It counts as done once: only if it is
      -- pending and was not a dead letter already.
      local pending = redis.call('XPENDING', keys[2], 'g', id, id, 1)[1]
      if pending and redis.call('ZADD', keys[6], 'inf', id) == 1 then failed = failed + 1 end
      if not past then
        errors[#errors + 1] = name
        errors[#errors + 1] = body
      end
    elseif outcome == 'retry' then
      -- Stays pending (its payload with it) until sg_take_work claims it again when due.
      redis.call('ZADD', keys[6], now + tonumber(args[i + 3]), id)
      if not past then
        errors[#errors + 1] = name
        errors[#errors + 1] = body
      end
      extra = extra + 1
    else
      -- Skipped: it did not run, so the delivery it had does not count as an attempt.
      redis.call('XCLAIM', keys[2], 'g', args[5], 0, id, 'RETRYCOUNT', math.max(tonumber(args[i + 4]) - 1, 0), 'JUSTID')
      redis.call('RPUSH', keys[5], id)
      extra = extra + 1
    end
  end
  if extra ~= tonumber(m[2] or '0') then redis.call('HSET', keys[1], 'extra', extra) end
  if #results > 0 then redis.call('HSET', keys[3], unpack(results)) end
  if #cleared > 0 then redis.call('HDEL', keys[4], unpack(cleared)) end
  if #errors > 0 then redis.call('HSET', keys[4], unpack(errors)) end
  if failed > 0 then redis.call('HINCRBY', keys[1], 'failed', failed) end
  -- `left` counts down by what this call really settled: entries acknowledged now (XACK counts
  -- only those still pending) and new dead letters.
  local settled = failed + settled_ok
  if #acked > 0 then
    -- Acked entries stay in the stream until census trims it (XTRIM MINID): cheaper than XDEL.
    local n = redis.call('XACK', keys[2], 'g', unpack(acked))
    settled = settled + n
    -- (Only `ok` entries are in `acked`: what a discarding request settled of them is discarded.)
    if discard then discarded = discarded + n end
  end
  if discarded > 0 then redis.call('HINCRBY', keys[1], 'discarded', discarded) end
  if #deleted > 0 then redis.call('XDEL', keys[2], unpack(deleted)) end
  if window > 0 and settled_ok > 0 then
    -- Every W/4 settled acks, the stream is trimmed: it holds about W entries whatever the
    -- request's size.
    local acks = redis.call('HINCRBY', keys[1], 'acks', settled_ok)
    local every = math.max(math.floor(window / 4), 1)
    if math.floor(acks / every) ~= math.floor((acks - settled_ok) / every) then window_trim(keys, window) end
  end
  if settled > 0 then
    if redis.call('HINCRBY', keys[1], 'left', -settled) <= 0
      and redis.call('HGET', keys[1], 'open') ~= '1' then
      local state = 'completed'
      if tonumber(redis.call('HGET', keys[1], 'failed')) > 0 then state = 'failed' end
      return sg_finish(keys, args[1], state, args[7], args[8], now, tonumber(k))
    end
  end
  if failed > 0 and redis.call('HGET', keys[1], 'failfast') == '1' then
    -- Fail fast: the first dead letter ends the request; the parts not yet run never will
    -- (unless its dead letters are requeued: then they run too).
    return sg_finish(keys, args[1], 'failed', args[7], args[8], now, tonumber(k))
  end
  if sg_past_deadline(m[8], now) then
    -- Past the request's deadline: what this batch settled is recorded; nothing more starts, and
    -- the last holder's ack finishes the request.
    return sg_deadline_wait(keys, k, epoch) or sg_finish_deadline(keys, args[1], args[7], args[8], now, tonumber(k))
  end
  if args[6] == '1' then
    local want, flat = sg_want(args[9])
    return sg_next(keys, k, epoch, holder, args[5], now, extra, want, m[9], m[10], flat)
  end
  return {'requeue', sg_requeue(keys, args[1], k, epoch, now), tonumber(m[7])}
end
