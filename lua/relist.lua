-- relist: reprioritize's token-side step: move a request's waiting elements from the list of its
-- old priority to the list of its new one, on one shard, each element in one atomic step, so that
-- it is always in exactly one list (the shard's bell keeps its one wake-up per element).
-- An element goes where its epoch puts it: before the first element, from the head, whose epoch
-- is not above its own (at the tail if there is none). Lists then stay ordered by epoch, newest at
-- the head, as pushes keep them, which verify's presence test relies on; and a token keeps its
-- seniority at its new priority (one that has waited longer than the others there is taken first).
-- The work is bounded like a sweep's: an element is looked for within SG_RELIST_SCAN elements of
-- either end of the old list, and its place within as many from the head of the new one. An
-- element not found (taken meanwhile, not pushed yet, or deep in a long list) or with no place
-- found stays where it is: it is still valid there, is taken at the old priority, and goes to the
-- new priority's list when handed back.
-- KEYS[1] the old priority's list   KEYS[2] the new priority's list (of the same shard)
-- ARGV[1..] elements "<kid>|<k>|<epoch>"
-- Returns the number of elements moved.
local SG_RELIST_SCAN = 1000

-- Inserts `element` (epoch `epoch`) into `list` at its place by epoch; false if the place is not
-- within SG_RELIST_SCAN elements of the head.
local function sg_relist_place(list, element, epoch)
  local from = 0
  while from < SG_RELIST_SCAN do
    local chunk = redis.call('LRANGE', list, from, from + 99)
    for _, other in ipairs(chunk) do
      local e = sg_element_epoch(other)
      if e and e <= epoch then
        redis.call('LINSERT', list, 'BEFORE', other, element)
        return true
      end
    end
    if #chunk < 100 then
      redis.call('RPUSH', list, element)
      return true
    end
    from = from + 100
  end
  return false
end

local function relist(keys, args)
  local old, new = keys[1], keys[2]
  if old == new then return 0 end
  local was_empty = redis.call('LLEN', new) == 0
  local moved = 0
  for i = 1, #args do
    local element, epoch = args[i], sg_element_epoch(args[i])
    -- Looked for from the tail first: a waiting element is taken from there.
    local from_tail = redis.call('LPOS', old, element, 'RANK', -1, 'MAXLEN', SG_RELIST_SCAN)
    local found = from_tail or redis.call('LPOS', old, element, 'MAXLEN', SG_RELIST_SCAN)
    if epoch and found and sg_relist_place(new, element, epoch) then
      if from_tail then redis.call('LREM', old, -1, element) else redis.call('LREM', old, 1, element) end
      moved = moved + 1
    end
  end
  if was_empty and moved > 0 then
    -- A push onto an empty list: announced as sg_push does, so that busy slots holding a lower
    -- priority give way.
    sg_announce_up(new)
  end
  return moved
end
