-- submit_commit: make a fully loaded request runnable, atomically.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id (encoded, as in the keys)   ARGV[2] number of parts the producer added
-- ARGV[3] the submission nonce given to submit_open
-- For a downstream (submit_open's ARGV[18]): ARGV[4] retention (ms)   ARGV[5] completion channel
-- ARGV[6..] one group of four per upstream, as its
-- link answered (dag_link, and the upstream's meta): upstream key id, lifecycle, 'w' (not ended),
-- 'c' (completed) or 'f' (ended otherwise), and the state it ended in ('' for 'w'). A release that
-- came before the commit (dag_settle while loading) is kept if it is news of the same upstream.
-- Returns the token elements "<rid>|<k>|<epoch>" to push onto the request's priority list (none
-- for a delayed request, or for a downstream left `waiting`, its tokens parked until its upstreams
-- end), {'finished', 'failed', lifecycle} for a downstream whose upstream failed (its policy
-- 'fail': it ends at once, `why` = `upstream:<ukid>`, and the steps after its finish follow), or
-- an error "SGSTATE ..." (not loading: its loading ttl ran out, or
-- another producer's request) or "SGINCOMPLETE ..." (parts missing). The same call re-sent after
-- a reconnect returns the elements of the tokens still queued.
local function submit_commit(keys, args)
  local m = redis.call('HMGET', keys[1], 'state', 'nonce', 'ntok')
  if m[2] ~= args[3] then
    return redis.error_reply('SGSTATE request is not loading (its loading time ran out?)')
  end
  if m[1] ~= 'loading' then
    if m[1] == 'failed' and redis.call('HGET', keys[1], 'ups') then
      return {'finished', 'failed', sg_lifecycle(keys)}
    end
    local out = {}
    sg_each_token(keys, 0, tonumber(m[3]), function(k, tok)
      local f = sg_split(tok)
      if f[1] == 'q' then out[#out + 1] = sg_element(args[1], k, f[2]) end
    end)
    return out
  end
  local total = tonumber(args[2])
  if not total or total < 1 then
    return redis.error_reply('SGINVALID a request needs at least one part')
  end
  if redis.call('XLEN', keys[2]) ~= total then
    return redis.error_reply('SGINCOMPLETE the stream does not hold every part')
  end
  local ups = redis.call('HGET', keys[1], 'ups')
  if ups then
    local linked = {}
    for i = 6, #args, 4 do linked[args[i]] = true end
    for ukid in string.gmatch(ups, '[^,]+') do
      if not linked[ukid] and redis.call('HEXISTS', keys[1], 'u:' .. ukid) == 0 then
        return redis.error_reply('SGINVALID upstream ' .. ukid .. ' was not linked before the commit')
      end
    end
  end
  local now = sg_now()
  local ntok = math.min(tonumber(redis.call('HGET', keys[1], 'limit')), total)
  redis.call('PERSIST', keys[1])
  redis.call('PERSIST', keys[2])
  redis.call('HSET', keys[1], 'state', 'queued', 'total', total, 'left', total, 'ntok', ntok, 'queued', now)
  local delay = tonumber(redis.call('HGET', keys[1], 'delay') or '0')
  local fields, out = {}, {}
  local gate = 'open'
  if ups then
    for i = 6, #args, 4 do
      local ukid, lc = args[i], tonumber(args[i + 1])
      local old = sg_dag_field(redis.call('HGET', keys[1], 'u:' .. ukid))
      if not string.find(',' .. ups .. ',', ',' .. ukid .. ',', 1, true) then
        -- Not one of its upstreams: ignored.
      elseif not old or math.floor(old[2] / 1000) ~= math.floor(lc / 1000) or old[2] < lc
        or (old[2] == lc and old[1] == 'w') then
        sg_dag_set(keys, ukid, old, args[i + 2], lc, args[i + 3])
      end
    end
    local c = redis.call('HMGET', keys[1], 'upw', 'upf', 'onup')
    gate = sg_dag_gate(c[1], c[2], c[3])
  end
  if gate ~= 'open' then
    -- A downstream whose upstreams have not all ended waits with parked tokens: dag_settle opens
    -- it. One whose upstream failed (policy 'fail') ends now.
    redis.call('HSET', keys[1], 'state', 'waiting', 'npark', ntok)
    for k = 0, ntok - 1 do
      fields[#fields + 1] = 't' .. k
      fields[#fields + 1] = 'p|' .. now
    end
    sg_hset_many(keys[1], fields)
    if gate == 'fail' then
      return sg_dag_fail(keys, args[1], sg_dag_failed_one(keys, ups), args[4], args[5], now)
    end
    return out
  elseif delay > 0 then
    -- Scheduled: tokens wait parked, and no worker can see the request until recovery promotes
    -- it (census) once its time has come.
    redis.call('HSET', keys[1], 'state', 'scheduled', 'eligible', now + delay, 'npark', ntok)
    for k = 0, ntok - 1 do
      fields[#fields + 1] = 't' .. k
      fields[#fields + 1] = 'p|' .. now
    end
  else
    for k = 0, ntok - 1 do
      fields[#fields + 1] = 't' .. k
      fields[#fields + 1] = 'q|' .. now .. '|' .. now
      out[#out + 1] = sg_element(args[1], k, now)
    end
  end
  sg_hset_many(keys[1], fields)
  return out
end
