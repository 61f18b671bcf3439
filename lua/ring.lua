-- ring: register a request with recovery, or put its token elements on its priority list.
-- KEYS[1] the priority list   KEYS[2] the active-request index (sorted set, score = next check ms)
-- ARGV[1] request key id   ARGV[2] delay (ms) before recovery looks at it
-- ARGV[3] 'register' (before loading: add to the index, unless it is there already), 'reopen'
-- (after requeue_dead reopened a failed request: as register, and marks the new lifecycle ARGV[4]
-- in KEYS[3], the finish marks, so that the old lifecycle's unindex leaves it be), or 'push'
-- (after commit: push the elements, only while the request is still in the index, so that a call
-- re-sent after the request finished neither re-registers it nor leaves elements behind; the
-- next check only ever moves earlier)   ARGV[4..] elements
-- KEYS[3] (reopen only) the request's finish marks (finish_index)
-- Returns, for 'register' and 'reopen', 1 if this call added the request to the index (0 if it was there);
-- for 'push', the number of elements pushed.
local function ring(keys, args)
  local due = sg_now() + tonumber(args[2])
  if args[3] == 'register' then
    return redis.call('ZADD', keys[2], 'NX', due, args[1])
  end
  if args[3] == 'reopen' then
    -- Kept (no expiry) while the reopened request runs; its own finish_index sets one.
    redis.call('HSET', keys[3], 'o', args[4])
    redis.call('PERSIST', keys[3])
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
