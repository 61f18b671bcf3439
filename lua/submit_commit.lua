-- submit_commit: make a fully loaded request runnable, atomically.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id (encoded, as in the keys)   ARGV[2] number of parts the producer added
-- ARGV[3] the submission nonce given to submit_open
-- Returns the token elements "<rid>|<k>|<epoch>" to push onto the request's priority list (none
-- for a delayed request), or an error "SGSTATE ..." (not loading: its loading ttl ran out, or
-- another producer's request) or "SGINCOMPLETE ..." (parts missing). The same call re-sent after
-- a reconnect returns the elements of the tokens still queued.
local function submit_commit(keys, args)
  local m = redis.call('HMGET', keys[1], 'state', 'nonce', 'ntok')
  if m[2] ~= args[3] then
    return redis.error_reply('SGSTATE request is not loading (its loading time ran out?)')
  end
  if m[1] ~= 'loading' then
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
  local now = sg_now()
  local ntok = math.min(tonumber(redis.call('HGET', keys[1], 'limit')), total)
  redis.call('PERSIST', keys[1])
  redis.call('PERSIST', keys[2])
  redis.call('HSET', keys[1], 'state', 'queued', 'total', total, 'left', total, 'ntok', ntok, 'queued', now)
  local delay = tonumber(redis.call('HGET', keys[1], 'delay') or '0')
  local fields, out = {}, {}
  if delay > 0 then
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
