-- ring: register a request with recovery, or put its token elements on its priority list.
-- KEYS[1] the priority list   KEYS[2] the active-request index (sorted set, score = next check ms)
-- ARGV[1] request key id   ARGV[2] delay (ms) before recovery looks at it
-- ARGV[3] 'register' (before loading: add to the index) or 'push' (after commit: push the
-- elements, only while the request is still in the index, so that a call re-sent after the
-- request finished neither re-registers it nor leaves elements behind)   ARGV[4..] elements
-- Returns the number of elements pushed.
local function ring(keys, args)
  local due = sg_now() + tonumber(args[2])
  if args[3] == 'register' then
    redis.call('ZADD', keys[2], due, args[1])
    return 0
  end
  if not redis.call('ZSCORE', keys[2], args[1]) then return 0 end
  redis.call('ZADD', keys[2], 'XX', due, args[1])
  local n = 0
  for i = 4, #args do
    redis.call('LPUSH', keys[1], args[i])
    n = n + 1
  end
  return n
end
