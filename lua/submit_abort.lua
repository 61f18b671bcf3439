-- submit_abort: a producer gives up a submit that failed while loading: its keys go at once,
-- rather than when the loading ttl ends. Only the producer that opened it (same nonce) can.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] the submission nonce
-- Returns 1 when the keys were deleted, 0 when they were not this producer's loading request.
local function submit_abort(keys, args)
  local m = redis.call('HMGET', keys[1], 'state', 'nonce')
  if m[1] ~= 'loading' or m[2] ~= args[1] then return 0 end
  redis.call('DEL', keys[1], keys[2])
  return 1
end
