-- submit_small: a whole request in one call, for one that fits in one chunk of parts:
-- submit_open, load_parts and submit_commit in one atomic step. The producer registers the
-- request with recovery (register) before, and pushes the elements (push) after, as for any
-- submit.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1..13] as submit_open's   ARGV[14] request key id   ARGV[15] trace context ('' = none;
-- submit_open's ARGV[14])   ARGV[16] deadline in ms from now ('' or 0 = none; submit_open's
-- ARGV[15])   ARGV[17] rate limit ('' = none; submit_open's ARGV[16])   ARGV[18..] payloads
-- Returns the token elements to push, or submit_open's / submit_commit's errors. The same call
-- re-sent after a reconnect returns the elements of the tokens still queued.
local function submit_small(keys, args)
  local open_args = {}
  for i = 1, 13 do open_args[i] = args[i] end
  open_args[14] = args[15]
  open_args[15] = args[16]
  open_args[16] = args[17]
  local opened = submit_open(keys, open_args)
  if type(opened) == 'table' and opened.err then return opened end
  if redis.call('HGET', keys[1], 'state') ~= 'loading' then
    -- The same call re-sent after it ran: answer as it did (the elements of the queued tokens).
    return submit_commit(keys, {args[14], '0', args[9]})
  end
  local load_args = {args[9], '0'}
  for i = 18, #args do load_args[#load_args + 1] = args[i] end
  local loaded = load_parts(keys, load_args)
  if type(loaded) == 'table' and loaded.err then return loaded end
  return submit_commit(keys, {args[14], tostring(#args - 17), args[9]})
end
