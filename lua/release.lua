-- release: end a slot's record of holding a token it no longer holds (parked, finished, dropped,
-- fenced), when the slot moves to another shard or stops. (On its own shard the slot's next take
-- ends the record anyway.)
-- KEYS[1] the shard's held records
-- ARGV[1] holder   ARGV[2] the take id the record must carry
-- Returns 1 if a record was removed.
local function release(keys, args)
  local held = redis.call('HGET', keys[1], args[1])
  if not held or sg_split(held)[4] ~= args[2] then return 0 end
  return redis.call('HDEL', keys[1], args[1])
end
