-- lane_requeue: requeue_dead for a lane request (prelude.lua, "Lanes"): a failed one reopens
-- under a new lifecycle (its old entries still in the lane are then dropped unrun), and its dead
-- parts are fed again, with its parts not yet run, within its limit; a live one gets its dead
-- parts back in line. Each runs with a fresh set of attempts.
-- KEYS[1..6] the lane's keys (as a request's, prelude.lua)   KEYS[7] the request's record
-- KEYS[8] the lane's priority list   KEYS[9] the shard's bell   KEYS[10] the shard's active index
-- ARGV[1] the lane's key id   ARGV[2] request key id   ARGV[3] the lane's tokens L (if it is
-- created again)   ARGV[4] the lane's first look (ms from now) if so
-- Returns {n, woken}: n dead letters requeued, woken lane tokens pushed. Errors "SGSTATE ..." when
-- the request is unknown, or finished other than failed.
local function lane_requeue(keys, args)
  local record = keys[7]
  local m = redis.call('HMGET', record, 'state', 'pol', 'nf', 'rq', 'ix', 'lc')
  if not m[1] or (m[1] ~= 'failed' and m[1] ~= 'queued' and m[1] ~= 'running') then
    return redis.error_reply('SGSTATE the request is unknown, or finished without dead letters')
  end
  local pol = sg_lane_policy(m[2])
  local fed = tonumber(m[3] or pol.total)
  local flat = redis.call('HGETALL', record)
  local dead, inflight = {}, {}
  for j = 1, #flat, 2 do
    local i = string.match(flat[j], '^x(%d+)$')
    if i then dead[#dead + 1] = tonumber(i) end
    i = string.match(flat[j], '^w(%d+)$')
    if i and tonumber(i) < fed then inflight[#inflight + 1] = tonumber(i) end
  end
  table.sort(dead)
  table.sort(inflight)
  if #dead == 0 then return {0, 0} end
  local now = sg_now()
  local moves, rq = {}, {}
  for _, i in ipairs(dead) do
    moves[#moves + 1] = 'w' .. i
    moves[#moves + 1] = redis.call('HGET', record, 'x' .. i)
    rq[#rq + 1] = i
  end
  local xs = {}
  for _, i in ipairs(dead) do xs[#xs + 1] = 'x' .. i end
  redis.call('HDEL', record, unpack(xs))
  -- `rqd`: parts of this request run again with a fresh set of attempts, so lane_ack clears the
  -- error record of a part that succeeds at its first attempt too.
  moves[#moves + 1] = 'rqd'
  moves[#moves + 1] = '1'
  redis.call('HSET', record, unpack(moves))
  if m[1] == 'failed' then
    -- Failed fast: its parts that were in the lane then are dropped unrun under the old lifecycle;
    -- their payloads were kept (sg_lane_feed), and they are fed again.
    for _, i in ipairs(inflight) do rq[#rq + 1] = i end
  else
    if m[4] and m[4] ~= '' then table.insert(rq, 1, m[4]) end
    -- Its requeued parts join the lane's tail, out of submission order: one listed from its lane
    -- (sg_ix_add_kept) is listed in `live` from now on.
    if m[5] then sg_ix_live_kept(sg_ix(keys[10]), args[2], m[5], m[6]) end
  end
  redis.call('HSET', record, 'rq', table.concat(rq, ','))
  redis.call('HINCRBY', record, 'failed', -#dead)
  local left = redis.call('HINCRBY', record, 'left', #dead)
  local feed = 0
  if m[1] == 'failed' then
    -- Reopened: nothing of the new lifecycle is in the lane yet.
    -- Its lifecycle's generation: `lc` does not tell it (sg_lane_clock).
    redis.call('HINCRBY', record, 'lc', 1)
    redis.call('HINCRBY', record, 'gen', 1)
    redis.call('HSET', record, 'state', 'running')
    redis.call('HDEL', record, 'finished')
    redis.call('PERSIST', record)
    -- Its downstreams (if any) wait for this lifecycle's end: their set is kept while it runs.
    redis.call('PERSIST', sg_shard_key(keys[10], 'dn:' .. args[2]))
    sg_ix_reopen(sg_ix(keys[10]), args[2], m[5] and sg_ix_kept_at(m[5], m[6]))
    feed = math.min(pol.limit, left)
  end
  local lc = redis.call('HGET', record, 'lc')
  sg_lane_open(keys, args[1], pol.prio, tonumber(args[3]), now, tonumber(args[4]), keys[10])
  for _ = 1, feed do sg_lane_feed(keys, record, args[2], lc, m[2]) end
  local woken = sg_unpark(keys, args[1], feed, now)
  sg_push(keys[8], keys[9], woken)
  return {#dead, #woken}
end
