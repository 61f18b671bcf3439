-- reopen: before requeue_dead reopens a failed request, enter it in recovery's index again and
-- mark the new lifecycle, so that a late `unindex` of the failed lifecycle leaves it there. Run on
-- the home shard, after the failed lifecycle's own steps (finish_index, seal, unindex) are done.
-- KEYS[1] active-request index   KEYS[2] registration times   KEYS[3] the request's finish marks
-- ARGV[1] request key id   ARGV[2] delay (ms) before recovery first looks at it
-- ARGV[3] the lifecycle about to start (the failed one's plus one)
-- Returns 1 if this call entered the request in the index, 0 if it was there.
local function reopen(keys, args)
  local now = sg_now()
  -- Kept (no expiry) while the reopened request runs; its own finish_index sets one.
  redis.call('HSET', keys[3], 'o', args[3])
  redis.call('PERSIST', keys[3])
  -- Its downstreams (if any) wait for this lifecycle's end: their set is kept while it runs.
  redis.call('PERSIST', sg_shard_key(keys[1], 'dn:' .. args[1]))
  redis.call('HSETNX', keys[2], args[1], now)
  sg_ix_reopen(sg_ix(keys[1]), args[1])
  return redis.call('ZADD', keys[1], 'NX', now + tonumber(args[2]), args[1])
end
