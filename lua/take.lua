-- take: a worker slot takes the token element of the highest priority waiting on a shard, and
-- records that it holds it (`held`), in one step: a token is never only in a reply on the wire or
-- in a process's memory, so a slot that dies right after taking it loses nothing (its worker's
-- death is noticed by `beat`, and recovery reclaims what the record names).
-- A lane's token (key id "~<shard>.<priority>") is acquired in the same call: the lane's keys are
-- in this shard's slot, so the slot gets its first batch without an `acquire` round trip.
-- KEYS[1] the shard's held records (hash: holder -> "<element>|<take id>|<list>")   KEYS[2] the shard's bell
-- KEYS[3] the shard's active index   KEYS[4] the shard's looks armed before a step
-- KEYS[5] the shard's pauses (hash: 'all' or a priority -> 1; `Admin::pause`)
-- ARGV[1] holder "<worker>/<slot>"   ARGV[2] this take's id (unique per slot)   ARGV[3] the id of
-- the slot's previous take on this shard ('' if none): its record, if still there, is done with
-- ARGV[4] '1' when the slot was woken by a bell it popped itself (else this call pops one, so that
-- bells and elements stay about even)
-- ARGV[5] the worker's consumer name   ARGV[6] the first batch's size ("<n>|flat": a lane's, flat, lane_acquire)
-- ARGV[7] the shard's lane key prefix ("<ns>:{<ns>.q<s>}:lane:")   ARGV[8] its records' key prefix
-- ARGV[9] the shard's priority list prefix ("<ns>:{<ns>.q<s>}:p:"): the lists, 99 down to 0, are
-- named here rather than passed, since a hundred key arguments cost more than the pop
-- A group's token (element "^<G>|<k>|<epoch>", prelude "Tenant groups") brings the group's
-- highest-priority request element, popped from its queue in the same call: the record then names
-- both ("<element>|<take id>|<queue>|<G>|<k>|<epoch>"), and the reply the queue and the request's
-- element. Stale group elements, and group tokens that find no work (they park), are passed over:
-- up to SG_TAKE_POPS elements per call. Group tokens whose rate-limit wait is over are queued again
-- first (sg_group_wake); when nothing was taken and one still waits: {'wait', ms}, in how many ms
-- its wait ends (the slot asks again then, rather than after an idle poll).
-- The record this slot's previous take left (ARGV[3]) ends here, and with it the group token it
-- held, if any, goes back (prelude, sg_held_end).
-- ARGV[10] (optional; '' or absent: 0) the floor: the lowest priority this take pops. A slot kept
-- for higher priorities (`WorkerBuilder::reserve`) takes with its floor, and finds nothing while
-- only lower priorities wait.
-- ARGV[10] may also be "<floor>|<next take id>|<ms>": a slot's offer of a hand-off, for as long as
-- ms (a library older than hand-offs refuses it as a floor, rather than misread it). A reserved slot
-- offers with its floor; a worker's standby slot, one idle slot per worker, with floor 0 (any
-- priority; prelude.lua, "Hand-offs"):
-- when this take finds nothing, the slot waits for one (prelude.lua, "Hand-offs"): it is
-- registered in the shard's `wait` hash, holder -> "<floor>|<next take id>|<consumer>|<batch>|<until
-- ms>", and its hand list is emptied. Every take ends the slot's offer first: a slot offers only
-- while it waits.
-- KEYS[6] and ARGV[11..] (optional) a token to give back first, as `give_back` does it: a slot at
-- its quantum's end gives its token back and takes again in one call. KEYS[6] the list to push to,
-- ARGV[11] the take id the slot's record must carry to be ended, ARGV[12..] the elements. A re-sent
-- call whose first copy took something (its record carries ARGV[2]) gives nothing back again; one
-- whose first copy took nothing pushes the elements again, which is harmless (give_back.lua).
-- Returns {list, element}, {list, element, 'one'} for a request in a rate-limited group (the slot
-- runs one part under it and gives it back: each part's start is charged to the group's bucket),
-- {list, element, acquired} for a lane token (`acquired` is what
-- `lane_acquire` returns), {} when every list is empty, or {'paused'} when an operator paused the
-- namespace or every priority (nothing taken; the slot waits an idle poll and asks again). The same call re-sent (the same take
-- id: its first reply was lost) returns the element it took the first time, without a batch: the
-- slot then acquires it, and `lane_acquire` hands out the same entries again. So does a take whose
-- id is the one a hand-off recorded (the id the slot's last take offered): the slot that did not
-- see the hand list's message gets the token handed to it this way. And so does an offering take
-- re-sent (its first reply lost) that finds the token handed under the id it offered: the record
-- is rewritten under this take's id, which the slot will hold it by.
local SG_TAKE_POPS = 16

local function take(keys, args)
  local holder, id = args[1], args[2]
  local floor, offer, lasts = 0, nil, nil
  if (args[10] or '') ~= '' then
    local text = args[10]
    local f, o, ms = string.match(text, '^([^|]*)|(%d+)|(%d+)$')
    if f then text, offer, lasts = f, o, tonumber(ms) end
    floor = tonumber(text)
    if not floor or floor ~= math.floor(floor) or floor < 0 or floor > 99 then
      return redis.error_reply('SGINVALID take\'s floor must be a priority from 0 to 99, not ' .. args[10])
    end
    -- An offer of 0 ms would set the `wait` hash's TTL to 0, ending every slot's offer.
    if lasts == 0 then
      return redis.error_reply('SGINVALID take\'s offer must last at least 1 ms, not ' .. args[10])
    end
  end
  local shard = sg_shard_key(keys[1], '')
  redis.call('HDEL', shard .. 'wait', holder)
  local held = redis.call('HGET', keys[1], holder)
  if keys[6] and (args[11] or '') ~= '' and not (held and sg_split(held)[4] == id) then
    give_back({keys[1], keys[2], keys[6]}, {holder, args[11], unpack(args, 12)})
    held = redis.call('HGET', keys[1], holder)
  end
  local previous = nil
  if held then
    local f = sg_split(held)
    if offer and f[4] == offer then
      -- This offering take was re-sent, and a hand-off came under the id it offered: the token is
      -- this take's.
      f[4] = id
      held = table.concat(f, '|')
      redis.call('HSET', keys[1], holder, held)
    end
    if f[4] == id then
      -- A bell this slot popped was not for this token: a hand-off rang none, and a re-sent take's
      -- first copy balanced its own. It rings again for the element it was for (one too many, if
      -- this take was re-sent, wakes a slot that finds nothing).
      if args[4] == '1' then
        redis.call('LPUSH', keys[2], '1')
        redis.call('PEXPIRE', keys[2], SG_BELL_TTL_MS)
      end
      local one = nil
      if f[6] and redis.call('HEXISTS', sg_group_key(shard, f[6]), 'rate') == 1 then one = 'one' end
      return {f[5], sg_element(f[1], f[2], f[3]), one}
    end
    if f[4] ~= args[3] then
      -- A record this slot did not know it still had: keep it for recovery (reclaim), under a
      -- name no live slot uses.
      redis.call('HSET', keys[1], holder .. '/lost/' .. f[4], held)
    else
      previous = f
    end
  end
  -- The previous record ends whatever this take finds (the field is overwritten or deleted below).
  if previous then sg_held_end(shard, previous) end
  local lmpop = sg_lmpop_lists(args[9], floor)
  -- (A caller of before pauses passes four keys: it takes as if nothing were paused.)
  local pauses = keys[5] and redis.call('HGETALL', keys[5]) or {}
  local paused = nil
  if #pauses > 0 then
    paused = {}
    for i = 1, #pauses, 2 do paused[pauses[i]] = true end
    lmpop = not paused['all'] and sg_lmpop_unpaused(args[9], paused, floor)
    if not lmpop then
      if held then redis.call('HDEL', keys[1], holder) end
      -- A bell the slot popped stays for the elements waiting: the slot waits an idle poll.
      if args[4] == '1' then redis.call('LPUSH', keys[2], '1') end
      return {'paused'}
    end
  end
  local list, element, record, one = nil, nil, nil, nil
  local now = sg_now()
  sg_group_wake(shard, now)
  for _ = 1, SG_TAKE_POPS do
    local popped = redis.call(unpack(lmpop))
    if not popped then break end
    local f = sg_split(popped[2][1])
    if string.sub(f[1], 1, 1) ~= '^' then
      list, element = popped[1], popped[2][1]
      record = element .. '|' .. id .. '|' .. list
      break
    end
    local got = sg_group_take(shard, f, holder, now, paused)
    if got then
      list, element, one = got[1], got[2], got[3]
      record = element .. '|' .. id .. '|' .. list .. '|' .. string.sub(f[1], 2) .. '|' .. f[2] .. '|' .. f[3]
      break
    end
    -- The element passed over takes its bell along.
    redis.call('RPOP', keys[2])
  end
  if not element then
    if held then redis.call('HDEL', keys[1], holder) end
    -- A group token waiting for its rate limit: the slot asks again when the wait ends.
    local wait = sg_group_next_wake(shard, now)
    if wait then return {'wait', wait} end
    -- (The offer keeps the batch size as a number: a hand-off's batch travels packed, not as a
    -- reply, so it has nothing to gain from flat entries.)
    if offer then sg_hand_offer(shard, holder, floor, offer, args[5], sg_int(sg_want(args[6]) or 1), now, lasts) end
    return {}
  end
  redis.call('HSET', keys[1], holder, record)
  redis.call('PEXPIRE', keys[1], SG_HELD_TTL_MS)
  if args[4] ~= '1' then redis.call('RPOP', keys[2]) end
  local f = sg_split(element)
  local priority = string.match(f[1], '^~%d+%.(%d+)$')
  if not priority then return {list, element, one} end
  local base = args[7] .. priority
  local lane = {base, base .. ':s', base .. ':res', base .. ':err', base .. ':orph', base .. ':retry', keys[3], keys[4]}
  local acquired = lane_acquire(lane, {f[1], f[2], f[3], holder, args[5], args[6], args[8]})
  return {list, element, acquired}
end
