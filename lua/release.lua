-- release: end a slot's record of holding a token it no longer holds (parked, finished, dropped,
-- fenced), when the slot moves to another shard or stops. (On its own shard the slot's next take
-- ends the record anyway.)
-- KEYS[1] the shard's held records
-- ARGV[1] holder   ARGV[2] the take id the record must carry
-- A group token the record names goes back (prelude, sg_held_end).
-- Returns 1 if a record was removed.
local function release(keys, args)
  local held = redis.call('HGET', keys[1], args[1])
  if not held then return 0 end
  local f = sg_split(held)
  if f[4] ~= args[2] then return 0 end
  redis.call('HDEL', keys[1], args[1])
  sg_held_end(sg_shard_key(keys[1], ''), f)
  return 1
end
