-- stream_open: start a streamed request: runnable at once, its parts added over time with
-- stream_append, complete only after stream_finalize and every part done.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2..10] as submit_open's ARGV[1..9] (id, priority, limit, ttl,
-- max attempts, timeout, backoff base, backoff cap, nonce)   ARGV[11] expiry (ms, 0 = none): a
-- request still open this long after it was opened is cancelled by recovery   ARGV[12] '1' =
-- fail fast   ARGV[13] token shards (submit_open's ARGV[12])   ARGV[14] deadline (submit_open's
-- ARGV[13])
-- Returns the token elements to push (its tokens start parked, so none until parts arrive), or
-- submit_open's errors.
local function stream_open(keys, args)
  local expiry = tonumber(args[11])
  if not expiry or expiry < 0 or expiry % 1 ~= 0 or expiry > SG_MAX_DELAY_MS then
    return redis.error_reply('SGINVALID open expiry must be a whole number of ms from 0 to ten years')
  end
  local opened = submit_open(keys, {args[2], args[3], args[4], args[5], args[6], args[7], args[8],
    args[9], args[10], '0', args[12] or '0', args[13] or '1', args[14] or ''})
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
  local fields = {}
  for k = 0, ntok - 1 do
    fields[#fields + 1] = 't' .. k
    fields[#fields + 1] = 'p|' .. now
  end
  sg_hset_many(keys[1], fields)
  return {}
end
