-- rel_done: the release of upstream U's finished lifecycle has reached every downstream U names
-- (dag_settle, and what each reply asked for): U leaves the release outbox, unless a later
-- lifecycle of U has finished since (a requeue), whose release is then still owed. From now on U's
-- set of downstreams expires a retention after this, as U's marks do, unless U runs again (a link
-- or a reopen keeps it then).
-- KEYS[1] the shard's release outbox   KEYS[2] U's finish marks   KEYS[3] U's lane record (its home
-- is this shard)   KEYS[4] U's downstreams
-- ARGV[1] U's key id   ARGV[2] the lifecycle released ('': none, the caller found U running
-- again)   ARGV[3] retention (ms)
-- Returns 1 when U left the outbox, 0 when it stays (a later finish owes another release).
local function rel_done(keys, args)
  local r = redis.call('HMGET', keys[3], 'state', 'lc')
  local latest, live
  if r[1] then
    live = r[1] == 'queued' or r[1] == 'running'
    if not live then latest = r[2] end
  else
    local m = redis.call('HMGET', keys[2], 'e', 'o')
    latest = m[1]
    live = m[2] and (not m[1] or tonumber(m[2]) > tonumber(m[1]))
  end
  if args[2] == '' then
    -- The caller found U running again (requeued since that finish): its next finish owes the next
    -- release, if it still runs (a finish since then owes this one).
    if not live then return 0 end
    redis.call('ZREM', keys[1], args[1])
    return 1
  end
  if latest and tonumber(latest) > tonumber(args[2]) then return 0 end
  redis.call('ZREM', keys[1], args[1])
  if not live then redis.call('PEXPIRE', keys[4], args[3]) end
  return 1
end
