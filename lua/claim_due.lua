-- claim_due: take the requests whose census is due, so that concurrent workers spread the work
-- and do not census the same request at once (a double census would still be safe: every
-- restore is a compare-and-set on the token's epoch).
-- KEYS[1] the active-request index
-- ARGV[1] at most this many requests   ARGV[2] claim (ms): others skip them for this long
-- Returns the claimed request key ids.
local function claim_due(keys, args)
  local now = sg_now()
  local due = redis.call('ZRANGEBYSCORE', keys[1], '-inf', now, 'LIMIT', 0, tonumber(args[1]))
  for _, rid in ipairs(due) do redis.call('ZADD', keys[1], now + tonumber(args[2]), rid) end
  return due
end
