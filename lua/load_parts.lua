-- load_parts: add a chunk of parts to a request that is loading (between submit_open and
-- submit_commit). One call per chunk of parts is far cheaper than one XADD per part.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] the submission nonce given to submit_open   ARGV[2] index of the first part
-- ARGV[3..] payloads
-- Returns how many parts the stream holds. Parts already there (a call re-sent after a
-- reconnect) are skipped. Errors "SGSTATE ..." when the request is not this producer's loading
-- request (its loading ttl ran out, and maybe another producer took the id).
local function load_parts(keys, args)
  local m = redis.call('HMGET', keys[1], 'state', 'nonce')
  if m[1] ~= 'loading' or m[2] ~= args[1] then
    return redis.error_reply('SGSTATE request is not loading (its loading time ran out?)')
  end
  local have = redis.call('XLEN', keys[2])
  local first = tonumber(args[2])
  if first > have then
    return redis.error_reply('SGGAP parts from index ' .. have .. ' are missing before index ' .. first)
  end
  -- Part i is entry 0-<i+1>. The stream was created empty (submit_open) and its parts go in in
  -- order, here or by a client's plain XADD of the same ids (docs/protocol.md), so its last entry
  -- is 0-<XLEN> and `0-*` (the next sequence number) names each part's entry without formatting
  -- its number.
  for i = math.max(have - first, 0) + 3, #args do
    redis.call('XADD', keys[2], '0-*', 'p', args[i])
  end
  return redis.call('XLEN', keys[2])
end
