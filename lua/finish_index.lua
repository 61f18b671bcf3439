-- finish_index: the token side of a request turning terminal, done once whoever calls it.
-- KEYS[1] active-request index   KEYS[2] events stream   KEYS[3] the request's priority list
-- ARGV[1] request key id   ARGV[2] terminal state   ARGV[3] event retention (ms)
-- ARGV[4..] stale token elements to remove from the priority list
-- Returns 1 when this call recorded the event, 0 when it had been recorded already.
local function finish_index(keys, args)
  for i = 4, #args do redis.call('LREM', keys[3], 0, args[i]) end
  if redis.call('ZREM', keys[1], args[1]) == 0 then return 0 end
  local now = sg_now()
  local retention = tonumber(args[3])
  redis.call('XADD', keys[2], 'MINID', '~', math.max(now - retention, 0), '*',
    'rid', args[1], 'state', args[2])
  redis.call('PEXPIRE', keys[2], retention)
  return 1
end
