-- finish_index: record a finished request's one event on the token side. It is the first of three
-- steps after a request turns terminal (then `seal` on the request's keys, then `unindex`), each
-- repeatable: whoever runs them (the finishing slot, or recovery when that slot died) the event is
-- written once per lifecycle, and the request stays in the index until it is sealed.
-- KEYS[1] active-request index   KEYS[2] events stream   KEYS[3] the request's priority list
-- KEYS[4] the request's finish marks (hash: `e` last lifecycle whose event was written, `o` last
-- lifecycle reopened by requeue_dead), kept for the retention after unindex   KEYS[5] the home
-- shard's bell (its downstreams `dn:<kid>` and the release outbox `rel` are the shard's too,
-- named from KEYS[1]: prelude.lua, "Dependencies between requests")
-- ARGV[1] request key id   ARGV[2] terminal state   ARGV[3] retention (ms)   ARGV[4] lifecycle
-- that finished   ARGV[5..] stale token elements to remove from the priority list
-- Returns 1 when this call recorded the event, 2 when it did and the request has downstreams (its
-- release is owed: in the outbox, for recovery to run if the caller does not, see rel_done), 0
-- when it had been recorded already (or the request has left the index, which it does only after
-- its event). The marks also keep the state the lifecycle ended in (`s`), for the release.
local function finish_index(keys, args)
  sg_sweep(keys[3], keys[5], args, 5)
  if not redis.call('ZSCORE', keys[1], args[1]) then return 0 end
  local lifecycle = tonumber(args[4])
  local written = redis.call('HGET', keys[4], 'e')
  if written and tonumber(written) >= lifecycle then return 0 end
  local retention = tonumber(args[3])
  redis.call('HSET', keys[4], 'e', args[4], 's', args[2])
  -- Until unindex shortens it, the marks must outlive the request's keys, which are held as long.
  redis.call('PEXPIRE', keys[4], retention + SG_FINISH_HOLD_MS)
  local now = sg_now()
  redis.call('XADD', keys[2], 'MINID', '~', math.max(now - retention, 0), '*',
    'rid', args[1], 'state', args[2])
  redis.call('PEXPIRE', keys[2], retention)
  local ix = sg_ix(keys[1])
  -- A request that ended before any push (a downstream failed at its commit by a failed upstream)
  -- never took the listing entry of a purged request of its id that its registration found
  -- (sg_ix_takeover): it takes it here, then moves to its terminal set.
  sg_ix_takeover(ix, args[1], now)
  sg_ix_finish(ix, args[1], args[2], now + retention, now)
  if redis.call('EXISTS', sg_shard_key(keys[1], 'dn:' .. args[1])) == 1 then
    redis.call('ZADD', sg_shard_key(keys[1], 'rel'), now + SG_REL_DELAY_MS, args[1])
    return 2
  end
  return 1
end
