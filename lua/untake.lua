-- untake: undo a take whose reply its slot never saw (the call failed), at the slot's clean stop:
-- the element goes back to the tail of its list, where it was taken from, and the record ends.
-- KEYS[1] the shard's held records   KEYS[2] the shard's bell
-- ARGV[1] holder   ARGV[2] the take id
-- Returns 1 if the take had happened (and is undone), 0 if there is no record of it.
local function untake(keys, args)
  local held = redis.call('HGET', keys[1], args[1])
  if not held then return 0 end
  local f = sg_split(held)
  if f[4] ~= args[2] then return 0 end
  redis.call('HDEL', keys[1], args[1])
  redis.call('RPUSH', f[5], sg_element(f[1], f[2], f[3]))
  redis.call('LPUSH', keys[2], '1')
  redis.call('PEXPIRE', keys[2], SG_BELL_TTL_MS)
  return 1
end
