-- stream_finalize: no more parts will come; the request completes when every part is done
-- (at once, if they all are).
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] retention (ms)   ARGV[3] completion channel
-- ARGV[4] the nonce given at stream_open, or '' for an operator finalizing another's request
-- Returns {'open'} (parts still to run), {'finished', state, lifecycle, sweep...} as ack, or errors
-- "SGSTATE ..." when the request is not open.
-- The producer's finalize sent again (its reply was lost; `open` is 0 and the nonce its own)
-- answers as the first did, but names no elements to sweep (the first call took the tokens'
-- fields that name them; an element left on its list is dropped by the take that finds it): {'open'} while
-- parts are left, {'finished', state, lifecycle} once the request is terminal, whoever finished
-- it; the steps after a finish are harmless run twice. An operator's ('' nonce) is refused.
local function stream_finalize(keys, args)
  local m = redis.call('HMGET', keys[1], 'open', 'nonce', 'left', 'failed', 'state')
  local terminal = m[5] == 'completed' or m[5] == 'failed' or m[5] == 'cancelled'
  if m[1] == '0' and args[4] ~= '' and m[2] == args[4] then
    if terminal then return {'finished', m[5], sg_lifecycle(keys)} end
    return {'open'}
  end
  if m[1] ~= '1' or terminal or (args[4] ~= '' and m[2] ~= args[4]) then
    return redis.error_reply('SGSTATE the request is not open (finalized already, cancelled or unknown)')
  end
  redis.call('HSET', keys[1], 'open', 0)
  if tonumber(m[3]) > 0 then return {'open'} end
  local state = 'completed'
  if tonumber(m[4]) > 0 then state = 'failed' end
  return sg_finish(keys, args[1], state, args[2], args[3], sg_now())
end
