-- dag_link: a downstream D being submitted links itself to upstream U, on U's home shard, between
-- D's submit_open and its submit_commit (prelude.lua, "Dependencies between requests"): D joins
-- U's downstreams, so that U's finish owes D a release, and the reply says where U stands now.
-- Atomic with U's finish on this shard (finish_index, a lane finish): a finish before it is in the
-- reply, a finish after it finds D in the set.
-- KEYS[1] U's downstreams (dn:<ukid>)   KEYS[2] U's finish marks   KEYS[3] U's lane record (its
-- home is this shard)   KEYS[4] the shard's active index   KEYS[5] the shard's release outbox
-- ARGV[1] U's key id   ARGV[2] D's entry "<dkid>|<D's token shards>"   ARGV[3] retention (ms)
-- ARGV[4] (optional) U's lifecycle as its meta hash says, read by the caller before this call ('':
--   none read): marks of another created ms are an earlier request's under the id, left a moment
--   past its keys (a purge whose unlist found the id registered again, or the steps between its
--   seal and its unindex), not this one's end; U is then live
-- Returns {'live', lc} when U has not ended (lc: a lane request's lifecycle; '' for a request of
-- its own stream, whose meta says), {'done', lc, state} when U's latest lifecycle lc has ended in
-- state, or {'unknown'} when there is no request U (never created, or gone with its retention);
-- then nothing is written. The set keeps no expiry while U may still end or a release of it is
-- owed; once U has ended it lives a retention past its last link or release, as U's marks do.
local function dag_link(keys, args)
  local r = redis.call('HMGET', keys[3], 'state', 'lc')
  local state, lc = r[1], r[2]
  local live
  if state then
    redis.call('HSET', keys[3], 'dn', 1)
    live = state == 'queued' or state == 'running'
  else
    local m = redis.call('HMGET', keys[2], 'e', 's', 'o')
    local indexed = redis.call('ZSCORE', keys[4], args[1])
    local stale = m[1] and (args[4] or '') ~= ''
      and math.floor(tonumber(m[1]) / 1000) ~= math.floor(tonumber(args[4]) / 1000)
    if m[1] and not stale and not (m[3] and tonumber(m[3]) > tonumber(m[1])) then
      lc, state, live = m[1], m[2] or 'completed', false
    elseif indexed or stale then
      lc, live = '', true
    else
      return {'unknown'}
    end
  end
  redis.call('SADD', keys[1], args[2])
  if live then
    redis.call('PERSIST', keys[1])
    return {'live', lc}
  end
  -- Ended: D learns it here. A release still owed (the outbox holds U) may or may not reach D too
  -- (dag_settle records a lifecycle once), and sets the set's expiry when it is done.
  if not redis.call('ZSCORE', keys[5], args[1]) then redis.call('PEXPIRE', keys[1], args[3]) end
  return {'done', lc, state}
end
