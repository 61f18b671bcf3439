-- untake: undo a take whose reply its slot never saw (the call failed, or a hand-off's message was
-- not read), at the slot's clean stop:
-- the element goes back to the tail of its list, where it was taken from, and the record ends.
-- KEYS[1] the shard's held records   KEYS[2] the shard's bell
-- ARGV[1] holder   ARGV[2] the take id
-- A lane's token was acquired in the same call (take.lua), which may have handed out a batch:
-- its record is kept for recovery under a name no live slot uses, and reclaim settles it (the
-- batch becomes orphans, the token is pushed again) as for a dead slot's.
-- Returns 1 if the take had happened (and is undone, or left to recovery), 0 if there is no record of it.
local function untake(keys, args)
  -- A hand-off the slot offered ends too (prelude.lua, "Hand-offs"); one made already is undone
  -- below as the take it stands for.
  redis.call('HDEL', sg_shard_key(keys[1], 'wait'), args[1])
  local held = redis.call('HGET', keys[1], args[1])
  if not held then return 0 end
  local f = sg_split(held)
  if f[4] ~= args[2] then return 0 end
  redis.call('HDEL', keys[1], args[1])
  if string.sub(f[1], 1, 1) == '~' then
    -- The HDEL may have emptied the hash, and the HSET then makes a new one: it takes the
    -- records' expiry as every take's write does.
    redis.call('HSET', keys[1], args[1] .. '/lost/' .. args[2], held)
    redis.call('PEXPIRE', keys[1], SG_HELD_TTL_MS)
    return 1
  end
  local len = redis.call('RPUSH', f[5], sg_element(f[1], f[2], f[3]))
  local gkey, p = sg_group_of_queue(f[5])
  if gkey then
    -- Back in its group's queue; the group token goes back with it (to this work).
    redis.call('ZADD', gkey .. ':w', p, p)
    sg_held_end(sg_shard_key(keys[1], ''), f)
    return 1
  end
  -- Onto an empty list: announced as sg_push announces, so that busy slots holding a lower
  -- priority give way at their batch's end rather than their quantum's.
  if len == 1 then sg_announce_up(f[5]) end
  redis.call('LPUSH', keys[2], '1')
  redis.call('PEXPIRE', keys[2], SG_BELL_TTL_MS)
  return 1
end
