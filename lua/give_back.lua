-- give_back: push a token's new element back (a slot at the end of its quantum, after ack answered
-- 'requeue'; recovery after reclaim), and end the take's record, in one step: while the record is
-- there, the push has not happened, so whoever finds it after its slot died (recovery) knows that
-- the token still needs pushing.
-- The elements are pushed whether or not the record is still there: an element is only ever issued
-- to be pushed, and pushing one that is no longer current is harmless (acquire refuses it), while
-- not pushing the current one would lose the token (recovery may have ended the record, or the slot
-- itself, after a newer epoch was issued).
-- KEYS[1] the shard's held records   KEYS[2] the shard's bell   KEYS[3] the priority list
-- ARGV[1] holder   ARGV[2] the take id its record must carry to be ended   ARGV[3..] elements
-- A group token the record names goes back (prelude, sg_held_end): parked if its group has no
-- other work, and then woken by the push of the elements to its group's queue.
-- Returns the number of elements pushed.
local function give_back(keys, args)
  local held = redis.call('HGET', keys[1], args[1])
  if held then
    local f = sg_split(held)
    if f[4] == args[2] then
      redis.call('HDEL', keys[1], args[1])
      sg_held_end(sg_shard_key(keys[1], ''), f)
    end
  end
  return sg_push(keys[3], keys[2], args, 3)
end
