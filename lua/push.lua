-- push: put token elements on a priority list of their shard, each with a wake-up on the shard's
-- bell; on the request's home shard, also make sure the request is in recovery's index.
-- KEYS[1] the priority list   KEYS[2] the shard's bell   KEYS[3] (home shard only) the active-request
-- index   KEYS[4] (home shard only) the registration times
-- ARGV[1] request key id   ARGV[2] next look (ms from now)   ARGV[3] 'first:<score>' (the push
-- that follows a submit, with the score its registration wrote: while that score is still there,
-- the next look is set to ARGV[2], however far; if recovery has looked since, only moved earlier)
-- or 'more' (the next look only ever moves earlier)   ARGV[4..] elements
-- KEYS[5], KEYS[6] (home shard only, optional) the shard's held records and hand-off offers
-- (prelude.lua, "Hand-offs"): given, an element of a request of its own keys pushed onto a priority
-- list goes to a slot that offered to take its priority (a reserved slot, or an idle worker's
-- standby), as that slot's take would have taken it, rather than onto the list: the slot acquires
-- it without a take.
-- The first push also lists the request in place of a purged request of its id that its
-- registration found listed (sg_ix_takeover).
-- Returns the number of elements pushed or handed. An element of a request that finished in the meantime is
-- refused by acquire when taken ('drop'), and the index entry by recovery, so a late or repeated
-- push is harmless; a push never silently does nothing.
local function push(keys, args)
  if keys[3] then
    local due = sg_now() + tonumber(args[2])
    local first = string.match(args[3], '^first:(%d+)$')
    if redis.call('ZADD', keys[3], 'NX', due, args[1]) == 0 then
      sg_rearm(keys[3], args[1], due, first)
    end
    -- The request exists: it may take the listing entry of a purged one of its id.
    if first then sg_ix_takeover(sg_ix(keys[3]), args[1], sg_now()) end
    -- A lane (key id "~...") is never registered: it is created in the step that indexes it.
    if string.sub(args[1], 1, 1) ~= '~' then redis.call('HSETNX', keys[4], args[1], sg_now()) end
  end
  local handed = 0
  -- (Not a group's queue: its requests' elements are taken with a group token, prelude.lua. Not a
  -- lane's token either, which recovery pushes: a lane's hand-off comes acquired, from lane_submit.)
  local prio = keys[6] and string.sub(args[1], 1, 1) ~= '~' and not string.find(keys[1], ':grp:', 1, true)
    and string.match(keys[1], ':p:(%d+)$')
  if prio then
    handed = sg_hand(keys[6], keys[5], tonumber(prio), keys[1], args, 4, sg_now(), function(_, _, element)
      return {keys[1], element}
    end)
  end
  return handed + sg_push(keys[1], keys[2], args, 4 + handed)
end
