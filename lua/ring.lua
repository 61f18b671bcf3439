-- ring: register a request with recovery, or put its token elements on its priority list.
-- KEYS[1] the priority list   KEYS[2] the active-request index (sorted set, score = next check ms)
-- ARGV[1] request key id   ARGV[2] delay (ms) before recovery looks at it
-- ARGV[3] 'register' (before loading: add to the index, unless it is there already) or 'push'
-- (after commit: push the elements, only while the request is still in the index, so that a call
-- re-sent after the request finished neither re-registers it nor leaves elements behind; the
-- next check only ever moves earlier)   ARGV[4..] elements
-- Returns, for 'register', 1 if this call added the request to the index (0 if it was there);
-- for 'push', the number of elements pushed.
local function ring(keys, args)
  local due = sg_now() + tonumber(args[2])
  if args[3] == 'register' then
    return redis.call('ZADD', keys[2], 'NX', due, args[1])
  end
  if not redis.call('ZSCORE', keys[2], args[1]) then return 0 end
  redis.call('ZADD', keys[2], 'XX', 'LT', due, args[1])
  local n = 0
  for i = 4, #args do
    redis.call('LPUSH', keys[1], args[i])
    n = n + 1
  end
  return n
end
