-- census: recovery's look at one request, in chunks of tokens: run by any worker for a request it
-- claimed (claim_due), when the request asked to be looked at (registration, arm, a retry or a
-- delay falling due) and at least once per census interval.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] grace (ms): how long a token may be queued before recovery
-- checks that its element is in the list   ARGV[3] retention (ms)   ARGV[4] completion channel
-- (for a streamed request that expired unfinalized: it is cancelled here)   ARGV[5] first token
-- of this chunk   ARGV[6] tokens per chunk   ARGV[7] the next look (ms) when nothing in this
-- chunk is due sooner: the census interval for the first chunk, the previous chunk's look for
-- the others
-- Returns {'gone'}: no such request (expired, or not created yet: drop_gone); {'loading'};
--         {'finished', state, priority, shards, lifecycle, sealed, group}: the request is terminal but
--         still indexed, so the steps after its finish (finish_index, seal, unindex) are to be
--         completed; sealed is 1 when only unindex is left;
--         {'waiting', shards, look, ukid...}: a downstream waiting for its upstreams (its tokens parked,
--         nothing of it can be lost): look again in `look` ms (at its deadline, or an hour), and
--         check that the upstreams listed (those not ended, by its fields) still exist: their
--         releases open it, and one that vanished without a release is settled as gone;
--         or {'ok', priority, shards, next, look, push, check, held}: next: the first token of the
--         next chunk (-1 after the last); look: in how many ms the request wants its next look,
--         counting this chunk and ARGV[7] (the last chunk's is the request's); push: elements of
--         woken tokens, to push now; check: elements queued longer than the grace, whose presence
--         in their list must be verified (verify; the look comes again after as long as the
--         oldest has waited, since verify may not be able to tell yet); held: {k, epoch, holder}
--         of every held token, for recovery to check that the holder's worker lives. Token k's
--         elements belong on shard (home + k) % shards; with a tenant group (the last item, ''
--         for none), on the group's shard, in the group's queue.
-- In the first chunk: a request past its deadline (meta `dl`) ends `failed`, `why` = `deadline`,
-- and one before it asks to be looked at then; a scheduled request whose time has come turns
-- queued; a streamed request past its expiry is cancelled; parked tokens are woken while work
-- waits for them; the stream is trimmed.
local function census(keys, args)
  local state = redis.call('HGET', keys[1], 'state')
  if not state then return {'gone'} end
  if state == 'loading' then return {'loading'} end
  local rid, grace = args[1], tonumber(args[2])
  local shards = redis.call('HGET', keys[1], 'shards') or '1'
  local prio = redis.call('HGET', keys[1], 'prio')
  local grp = redis.call('HGET', keys[1], 'grp') or ''
  if state == 'completed' or state == 'failed' or state == 'cancelled' then
    local lifecycle = sg_lifecycle(keys)
    local sealed = 0
    if redis.call('HGET', keys[1], 'sealed') == lifecycle then sealed = 1 end
    return {'finished', state, prio, shards, lifecycle, sealed, grp}
  end
  local now = sg_now()
  local from, count = tonumber(args[5]), tonumber(args[6])
  local look = tonumber(args[7])
  local push, check, held = {}, {}, {}
  local m = redis.call('HMGET', keys[1], 'eligible', 'open', 'open_deadline', 'ntok', 'npark', 'dl', 'rate', 'tat')
  if from == 0 then
    if m[6] then
      -- A request with a deadline: past it, it ends here if no hand-out ended it first (its
      -- tokens all parked, its parts all running long, or no worker at all); before it, the
      -- request is looked at no later than then.
      if sg_past_deadline(m[6], now) then
        -- Slots still holding batches ack within ms (their timers cancel their handlers), and
        -- the last of them finishes it; a grace after the deadline it ends here regardless. Held
        -- tokens are listed meanwhile, for the check that their holders live.
        if now < tonumber(m[6]) + grace then
          sg_each_token(keys, 0, tonumber(m[4] or '0'), function(k, tok)
            local f = sg_split(tok)
            if f[1] == 'h' then held[#held + 1] = {k, f[2], f[3]} end
          end)
        end
        if #held == 0 then
          local f = sg_finish_deadline(keys, rid, args[3], args[4], now)
          return {'finished', 'failed', prio, shards, f[3], 0, grp}
        end
        return {'ok', prio, shards, -1, math.max(tonumber(m[6]) + grace - now, 1), {}, {}, held, grp}
      end
      look = math.min(look, tonumber(m[6]) - now)
    end
    if state == 'waiting' then
      local ups = redis.call('HGET', keys[1], 'ups') or ''
      local wait_look = SG_WAITING_LOOK_MS
      if m[6] then wait_look = math.min(wait_look, tonumber(m[6]) - now) end
      local out = {'waiting', shards, math.max(wait_look, 1)}
      for ukid in string.gmatch(ups, '[^,]+') do
        local f = sg_dag_field(redis.call('HGET', keys[1], 'u:' .. ukid))
        if f and f[1] == 'w' then out[#out + 1] = ukid end
      end
      return out
    end
    if state == 'scheduled' then
      -- A delayed request waits with parked tokens; the first census after its time promotes it.
      local eligible = tonumber(m[1] or '0')
      if eligible > now then
        return {'ok', prio, shards, -1, eligible - now, {}, {}, {}, grp}
      end
      redis.call('HSET', keys[1], 'state', 'queued')
    end
    if m[2] == '1' and tonumber(m[3] or '0') > 0 then
      if tonumber(m[3]) < now then
        -- A streamed request whose producer never finalized it within its expiry: its input is
        -- incomplete, so it ends cancelled.
        redis.call('DEL', keys[6])
        local f = sg_finish(keys, rid, 'cancelled', args[3], args[4], now)
        return {'finished', 'cancelled', prio, shards, f[3], 0, grp}
      end
      look = math.min(look, tonumber(m[3]) - now)
    end
    -- Acked entries are not deleted one by one; drop every stream node older than the oldest
    -- entry still pending (or, with none pending, than the last one delivered).
    local group = redis.call('XINFO', 'GROUPS', keys[2])[1]
    local delivered = '0-0'
    for i = 1, #group, 2 do
      if group[i] == 'last-delivered-id' then delivered = group[i + 1] end
    end
    local oldest = redis.call('XPENDING', keys[2], 'g')[2]
    if not oldest and delivered ~= '0-0' then oldest = '0-' .. (sg_index(delivered) + 2) end
    if oldest then redis.call('XTRIM', keys[2], 'MINID', '~', oldest) end
    -- Parked tokens go back into circulation while there is work they could take: orphans, due
    -- retries, and entries never delivered (the stream's newest id past the group's last
    -- delivered one; XINFO's lag is unknown once entries were deleted, so compare ids).
    local work = redis.call('LLEN', keys[5]) + redis.call('ZCOUNT', keys[6], '-inf', now)
    local newest = redis.call('XREVRANGE', keys[2], '+', '-', 'COUNT', 1)[1]
    if newest and sg_index(newest[1]) > sg_index(delivered) then
      work = work + sg_index(newest[1]) - sg_index(delivered)
    end
    local woken = work
    if m[7] then
      -- Rate-limited: wake only as many tokens as parts may start now, and come back when more
      -- may (each woken token's hand-out takes what the limit then allows).
      local room, t, base, tau = sg_rate_room(m[7], m[8], now)
      woken = math.min(work, room)
      if work > woken then look = math.min(look, math.max(math.ceil(base + woken * t - tau - now), 1)) end
    end
    push = sg_unpark(keys, rid, woken, now)
    if tonumber(redis.call('HGET', keys[1], 'npark') or '0') > 0 then
      -- Still parked tokens: wake them when the next retry falls due.
      local due = sg_next_retry(keys, now)
      if due then look = math.min(look, due - now) end
    end
  end
  local ntok = tonumber(m[4] or '0')
  local to = math.min(from + count, ntok)
  sg_each_token(keys, from, to, function(k, tok)
    local f = sg_split(tok)
    if f[1] == 'q' then
      local since = tonumber(f[3] or '0')
      if since + grace <= now then
        check[#check + 1] = sg_element(rid, k, f[2])
        -- verify can only tell for sure that an element is missing once its list's tail has moved
        -- a grace past it; until then it may be there, or may never have been pushed (its pusher
        -- died). Look again after as long again as it has waited: a token never pushed is found
        -- within about twice the time its element would have waited in the list, at a cost of
        -- one look per doubling of that wait (at most one per census interval).
        look = math.min(look, math.max(grace, now - since))
      else
        look = math.min(look, since + grace - now)
      end
    elseif f[1] == 'h' then
      held[#held + 1] = {k, f[2], f[3]}
    end
  end)
  local next = to
  if to >= ntok then next = -1 end
  return {'ok', prio, shards, next, math.max(look, 1), push, check, held, grp}
end
