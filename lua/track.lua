-- track: marks a listed request as tracked (qless's tracking: `list --tracked` shows it), or
-- unmarks it. Run on its home shard.
-- KEYS[1] the shard's index rows (prelude.lua, "The listing index")
-- ARGV[1] request key id   ARGV[2] '1' to track, '0' to stop
-- Returns 1 when the request is listed (tracked or not as asked), 0 when it is not (unknown, or
-- gone with its retention).
local function track(keys, args)
  local ix = string.sub(keys[1], 1, -4)
  local kid = args[1]
  if not sg_ix_row(ix, kid) then return 0 end
  local mark = {SG_IX_TRACKED, ix .. 'tracked'}
  local live = redis.call('ZSCORE', ix .. 'live', kid)
  if not live and args[2] == '1' then
    -- A live lane request listed from its lane (sg_ix_add_kept) is listed in `live` once
    -- tracked, so that the tracked set counts it live.
    local rec = redis.call('HMGET', sg_ix_record(ix, kid), 'state', 'ix', 'lc')
    if (rec[1] == 'queued' or rec[1] == 'running') and rec[2] then
      sg_ix_live_kept(ix, kid, rec[2], rec[3])
      live = redis.call('ZSCORE', ix .. 'live', kid)
    end
  end
  local was = redis.call('ZSCORE', mark[2], kid)
  local now = sg_now()
  if args[2] ~= '1' then
    if was then
      redis.call('ZREM', mark[2], kid)
      if live then sg_ix_mark_done(ix, mark, nil, now) end
    end
    return 1
  end
  if was then return 1 end
  local score = live
  for i = 2, #SG_IX_STATES do score = score or redis.call('ZSCORE', ix .. SG_IX_STATES[i], kid) end
  if not score then
    -- A finished lane request listed in a group of its terminal set gets a member of its own
    -- there, as a tracked one has (prelude.lua, "The listing index").
    local state, at = sg_ix_kept_terminal(ix, kid)
    if state and sg_ix_ungroup(ix, state, at, kid) then
      redis.call('ZADD', ix .. state, at, kid)
      score = at
    end
  end
  if not score then return 0 end
  redis.call('ZADD', mark[2], score, kid)
  if live then
    sg_ix_mark_live(ix, mark)
  else
    -- A finished request: the set expires with it, unless a live one keeps it.
    local expires = sg_ix_expiry(ix, kid, now) or 0
    if expires == math.huge then expires = 0 end
    local latest = tonumber(redis.call('HGET', ix .. 'tx', mark[1]) or '0')
    if expires > latest then redis.call('HSET', ix .. 'tx', mark[1], expires) end
    -- With no live request on the shard, `tx` expires with the latest finished one: one this
    -- call created (HSET) must too.
    sg_ix_settle(ix, now)
    if not redis.call('HGET', ix .. 'tl', mark[1]) then sg_ix_expire_at(mark[2], math.max(expires, latest), now) end
  end
  return 1
end
