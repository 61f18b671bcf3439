-- results_from: a page of a streamed request's outcomes, in part order, read while it runs; the
-- outcomes of the parts before the page are deleted, so that a reader that keeps up keeps the
-- results in Redis bounded (a windowed request's bounded memory, docs/protocol.md §6.14).
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] first: the index of the first part wanted. Asking from `first` says that the reader
-- holds every outcome below it: those records are deleted now. It must be at least the `first` of
-- the previous call (meta `tfirst`) and at most the meta `taken`   ARGV[2] at most this many parts
-- Returns {state, total, first, tag, body, tag, body, ...}: state as in the meta hash; total the
-- number of parts once no more can be added (finalized, or terminal), else -1; then per part from
-- `first`, in order: 'ok' and the result bytes, 'err' and the error record of a dead letter (or
-- of a terminal request's last failure), 'none' and '' for a part of a terminal request that
-- never ended (cancelled, or fail fast). The page stops before the first part not settled yet
-- (running, waiting for a retry, not yet delivered), so it may be empty. Meta `taken` becomes
-- the index after the page (never lower); the page stays readable until a call asks from past it,
-- so a call re-sent after a lost reply answers the same.
-- Errors "SGSTATE ..." when the request is unknown, or `first` is below records already deleted;
-- "SGINVALID ..." when it is not a streamed request or its results are discarded; "SGGAP ..."
-- when `first` is past `taken`.
local function results_from(keys, args)
  local m = redis.call('HMGET', keys[1], 'state', 'total', 'open', 'taken', 'tfirst', 'discard')
  local state = m[1]
  if not state then
    return redis.error_reply('SGSTATE the request is unknown (never submitted, or its retention ran out)')
  end
  if not m[3] then
    return redis.error_reply('SGINVALID results_from is for streamed requests (opened with open())')
  end
  if m[6] == '1' then
    return redis.error_reply('SGINVALID the results of this request are discarded (discard_results)')
  end
  local first, count = tonumber(args[1]), tonumber(args[2])
  if not first or first < 0 or first % 1 ~= 0 or not count or count < 1 then
    return redis.error_reply('SGINVALID first must be a whole number and count at least 1')
  end
  local taken, tfirst = tonumber(m[4] or '0'), tonumber(m[5] or '0')
  if first < tfirst then
    return redis.error_reply('SGSTATE results below index ' .. tfirst .. ' were taken and deleted already')
  end
  if first > taken then
    return redis.error_reply('SGGAP results from index ' .. taken .. ' were not taken before index ' .. first)
  end
  if first > tfirst then
    -- The reader holds every outcome below `first`: they go (a dead letter keeps its entry,
    -- pending, so that it can still be requeued; only its record goes).
    local fields = {}
    for i = tfirst, first - 1 do fields[#fields + 1] = i end
    local deleted = 0
    local i = 1
    while i <= #fields do
      local last = math.min(i + 999, #fields)
      deleted = deleted + redis.call('HDEL', keys[3], unpack(fields, i, last))
      redis.call('HDEL', keys[4], unpack(fields, i, last))
      i = last + 1
    end
    if deleted > 0 then redis.call('HINCRBY', keys[1], 'ntaken', deleted) end
    redis.call('HSET', keys[1], 'tfirst', first)
  end
  local terminal = state == 'completed' or state == 'failed' or state == 'cancelled'
  local total = tonumber(m[2] or '0')
  local known = -1
  if terminal or m[3] ~= '1' then known = total end
  local out = {state, known, first}
  local i = first
  while i < first + count and i < total do
    local r = redis.call('HGET', keys[3], i)
    if r then
      out[#out + 1] = 'ok'
      out[#out + 1] = r
    else
      local e = redis.call('HGET', keys[4], i)
      -- An error record is final for a dead letter (in the retry set at +inf) or once the request
      -- is terminal; otherwise the part still waits for a retry, or runs again.
      if e and (terminal or redis.call('ZSCORE', keys[6], '0-' .. (i + 1)) == 'inf') then
        out[#out + 1] = 'err'
        out[#out + 1] = e
      elseif terminal then
        out[#out + 1] = 'none'
        out[#out + 1] = ''
      else
        break
      end
    end
    i = i + 1
  end
  if i > taken then redis.call('HSET', keys[1], 'taken', i) end
  return out
end
