-- acquire: a worker slot presents a token element it took, and gets sub-requests to run.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] token number k   ARGV[3] token epoch   ARGV[4] holder (worker/slot)
-- ARGV[5] stream consumer name   ARGV[6] batch: how many entries at most, "<n>" or "<n>|flat",
-- and never more than the hold's share of the parts left: `left` / `limit`, rounded up (at least 1);
-- one for a rate-limited request
-- ARGV[7] retention (ms) and ARGV[8] completion channel, as ack's ARGV[7..8]: for a request this
-- call finishes at its deadline
-- ARGV[9] (optional) the tenant group whose queue the element was taken from ('' for none: a
-- shard's list). An element of a request of another group (or of none) is a copy left on a list by
-- an earlier request under the same id (purged since) whose epoch the token now has by chance
-- (epochs are Redis time, and run ahead of it by one per re-issue within a millisecond): 'stale'.
-- Accepted, a grouped request's copy on a shard's list would run without its group's token.
-- Returns {'run', policy, entry, ...}: the slot holds the token, with a batch of entries to run one
--          after another; policy = {max attempts, timeout ms, backoff base ms, backoff max ms,
--          token shards of the request[, queue wait ms[, deadline ms]]}: the queue wait is how
--          long the request waited since it became runnable (queued at its commit, or its
--          delay's end) when this call started it (state queued -> running), for the stats by
--          stage, else -1; the deadline, only for a request that has one, is in how many ms it
--          falls: the slot cancels the handlers still running then;
--          entry = {entry id, index, payload, attempt}, or with ARGV[6] "<n>|flat" the three items
--          entry id, payload, attempt in the reply itself (index = the id's sequence number - 1);
--         {'park', wake, S}: no work left to hand out (or none the request's rate limit lets
--          start now), the token waits in the request until there is (wake: in how many ms a retry
--          falls due or the rate limit has room, 0 if neither; S: the request's token shards, for
--          the slot's arm of that wake);
--         {'finished', state, lifecycle, sweep elements..., {'shards', S}}: as ack's, when the
--          request's deadline has passed and no other slot holds a batch of it: this call ended it
--          `failed` (`why` = `deadline`) and handed out nothing; S is its token shards, for the
--          steps after the finish ({'park', 0} while another slot holds one: its ack finishes);
--         {'drop'}: the request is finished, cancelled or unknown: forget the element;
--         {'stale'}: the element is not the token's current one (old epoch, or not queued, or
--          taken from a list of another group than the request's: ARGV[9]).
local function acquire(keys, args)
  local m = redis.call('HMGET', keys[1], 't' .. args[2], 'extra', 'state', 'maxatt', 'timeout', 'bbase', 'bmax', 'shards',
    'queued', 'eligible', 'dl', 'rate', 'tat', 'left', 'limit', 'grp')
  local tok = m[1]
  if not tok then return {'drop'} end
  if args[9] and (m[16] or '') ~= args[9] then return {'stale'} end
  local policy = {m[4] or '1', m[5] or '0', m[6] or '0', m[7] or '0', m[8] or '1'}
  local f = sg_split(tok)
  if f[1] == 'h' and f[2] == args[3] and f[3] == args[4] and f[5] ~= '' then
    -- The same slot presenting the same element again: a call re-sent after a reconnect whose
    -- first reply was lost. Hand out the entries it already holds instead of stranding them.
    if m[11] then policy[6], policy[7] = -1, tonumber(m[11]) - sg_now() end
    local reply = {'run', policy}
    local _, flat = sg_want(args[6])
    for _, id in ipairs(sg_ids(f[5])) do
      local entry = redis.call('XRANGE', keys[2], id, id)[1]
      local pending = redis.call('XPENDING', keys[2], 'g', id, id, 1)[1]
      if entry and pending and flat then
        reply[#reply + 1], reply[#reply + 2], reply[#reply + 3] = id, entry[2][2], tonumber(pending[4])
      elseif entry and pending then
        reply[#reply + 1] = {id, sg_index(id), entry[2][2], tonumber(pending[4])}
      end
    end
    if #reply > 2 then return reply end
  end
  if f[1] ~= 'q' or f[2] ~= args[3] then return {'stale'} end
  local now = sg_now()
  if sg_past_deadline(m[11], now) then
    local wait = sg_deadline_wait(keys, args[2], args[3])
    if wait then return wait end
    local out = sg_finish_deadline(keys, args[1], args[7] or '0', args[8] or '', now)
    out[#out + 1] = {'shards', m[8] or '1'}
    return out
  end
  local want, flat = sg_want(args[6])
  -- A hold's first batch is at most its share of the parts left: a slot that sized it from
  -- another request's handler times must not run a slow request's parts one after another while
  -- the request's other tokens find none.
  -- A rate-limited request's is one entry: an entry handed back unrun would stay spent from its rate.
  want = math.min(want or 1, math.max(math.ceil(tonumber(m[14] or '0') / tonumber(m[15] or '1')), 1))
  if m[12] then want = 1 end
  local next = sg_next(keys, args[2], args[3], args[4], args[5], now, m[2], want, m[12], m[13], flat)
  if next[1] == 'park' then
    -- The slot has no policy of the request yet: the shards tell it where to arm the wake.
    next[3] = m[8] or '1'
    return next
  end
  if next[1] ~= 'run' then return next end
  if m[3] == 'queued' then
    redis.call('HSET', keys[1], 'state', 'running', 'started', now)
    local since = math.max(tonumber(m[9] or now), tonumber(m[10] or '0'))
    policy[6] = math.max(now - since, 0)
  end
  if m[11] then
    policy[6] = policy[6] or -1
    policy[7] = tonumber(m[11]) - now
  end
  table.insert(next, 2, policy)
  return next
end
