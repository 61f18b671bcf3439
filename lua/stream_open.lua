-- stream_open: start a streamed request: runnable at once, its parts added over time with
-- stream_append, complete only after stream_finalize and every part done.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2..10] as submit_open's ARGV[1..9] (id, priority, limit, ttl,
-- max attempts, timeout, backoff base, backoff cap, nonce)   ARGV[11] expiry (ms, 0 = none): a
-- request still open this long after it was opened is cancelled by recovery   ARGV[12] '1' =
-- fail fast   ARGV[13] token shards (submit_open's ARGV[12])   ARGV[14] deadline (submit_open's
-- ARGV[13])   ARGV[15] window W (optional; 0 or absent = none): the producer keeps at most W
-- parts unsettled, and acks trim the stream as they go (stored as `window`)   ARGV[16] '1' =
-- discard results: `ok` results are never stored (stored as `discard`)   ARGV[17] trace context
-- (optional; '' or absent = none; submit_open's ARGV[14])   ARGV[18] deadline in ms from now
-- (optional; '' or 0 = none; submit_open's ARGV[15])   ARGV[19] rate limit (optional; '' = none;
-- submit_open's ARGV[16])   ARGV[20] group (optional; '' = none; submit_open's ARGV[19])
-- Returns the token elements to push (its tokens start parked, so none until parts arrive), or
-- submit_open's errors.
local function stream_open(keys, args)
  local expiry = tonumber(args[11])
  if not expiry or expiry < 0 or expiry % 1 ~= 0 or expiry > SG_MAX_DELAY_MS then
    return redis.error_reply('SGINVALID open expiry must be a whole number of ms from 0 to ten years')
  end
  local window = tonumber(args[15] or '0')
  if not window or window < 0 or window % 1 ~= 0 or window > 1e15 then
    return redis.error_reply('SGINVALID window must be a whole number of parts of at least 0')
  end
  local opened = submit_open(keys, {args[2], args[3], args[4], args[5], args[6], args[7], args[8],
    args[9], args[10], '0', args[12] or '0', args[13] or '1', args[14] or '', args[17] or '', args[18] or '', args[19] or '', '', '', args[20] or ''})
  if type(opened) == 'table' and opened.err then return opened end
  if redis.call('HGET', keys[1], 'state') ~= 'loading' then return {} end
  local now = sg_now()
  local ntok = tonumber(args[4])
  local deadline = 0
  if expiry > 0 then deadline = now + expiry end
  redis.call('PERSIST', keys[1])
  redis.call('PERSIST', keys[2])
  redis.call('HSET', keys[1], 'state', 'queued', 'open', 1, 'open_deadline', deadline, 'ntok', ntok,
    'queued', now, 'npark', ntok)
  -- Only a windowed or discarding request carries the fields: ack reads them in its one HMGET.
  if window > 0 then redis.call('HSET', keys[1], 'window', window) end
  if args[16] == '1' then redis.call('HSET', keys[1], 'discard', 1) end
  local fields = {}
  for k = 0, ntok - 1 do
    fields[#fields + 1] = 't' .. k
    fields[#fields + 1] = 'p|' .. now
  end
  sg_hset_many(keys[1], fields)
  return {}
end
