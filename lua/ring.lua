-- ring: put token elements on a priority list and register the request as active.
-- KEYS[1] the priority list   KEYS[2] the active-request index (sorted set, score = next check ms)
-- ARGV[1] request key id   ARGV[2] delay (ms) before recovery first looks at it   ARGV[3..] elements
-- Returns the number of elements pushed.
local function ring(keys, args)
  redis.call('ZADD', keys[2], sg_now() + tonumber(args[2]), args[1])
  local n = 0
  for i = 3, #args do
    redis.call('LPUSH', keys[1], args[i])
    n = n + 1
  end
  return n
end
