-- stream_append: add parts to an open streamed request; parked tokens wake up for them.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] the nonce given at stream_open   ARGV[3] index of the first
-- part   ARGV[4..] payloads
-- Returns the token elements to push. The same call re-sent after a reconnect adds nothing
-- twice (parts below the request's total are skipped). Errors "SGSTATE ..." when the request is
-- not open (finalized, cancelled, unknown) or not this producer's.
local function stream_append(keys, args)
  local m = redis.call('HMGET', keys[1], 'open', 'nonce', 'total', 'ntok', 'state')
  if m[1] ~= '1' or m[2] ~= args[2] or m[5] == 'cancelled' or m[5] == 'failed' or m[5] == 'completed' then
    return redis.error_reply('SGSTATE the request is not open for parts (finalized, cancelled or unknown)')
  end
  local total = tonumber(m[3])
  local first = tonumber(args[3])
  if first > total then
    return redis.error_reply('SGGAP parts from index ' .. total .. ' are missing before index ' .. first)
  end
  local added = 0
  for i = 4, #args do
    local index = first + i - 4
    if index >= total then
      redis.call('XADD', keys[2], '0-' .. (index + 1), 'p', args[i])
      added = added + 1
    end
  end
  redis.call('HINCRBY', keys[1], 'total', added)
  redis.call('HINCRBY', keys[1], 'left', added)
  local out = {}
  local now = sg_now()
  for k = 0, tonumber(m[4]) - 1 do
    if #out >= added then break end
    local tok = redis.call('HGET', keys[1], 't' .. k)
    local f = tok and sg_split(tok)
    if f and f[1] == 'p' then out[#out + 1] = sg_requeue(keys, args[1], k, f[2], now) end
  end
  return out
end
