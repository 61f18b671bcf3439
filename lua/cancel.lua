-- cancel: end a request now. Its tokens are withdrawn (queued elements swept, held tokens fenced:
-- their holders' acks record nothing and their heartbeats report the hold lost, which cancels
-- the handlers' contexts), its queued parts never run, and it gets one terminal record, state
-- `cancelled`, and one event, like any finish.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] retention (ms)   ARGV[3] completion channel
-- Returns {'finished', 'cancelled', lifecycle, sweep elements...} as ack does, or {'already', state}
-- when the request was terminal before (or loading: it is discarded), or {'unknown'}.
local function cancel(keys, args)
  local state = redis.call('HGET', keys[1], 'state')
  if not state then return {'unknown'} end
  if state == 'completed' or state == 'failed' or state == 'cancelled' then return {'already', state} end
  if state == 'loading' then
    redis.call('DEL', keys[1], keys[2])
    return {'already', 'loading'}
  end
  redis.call('DEL', keys[6])
  return sg_finish(keys, args[1], 'cancelled', args[2], args[3], sg_now())
end
