-- reprioritize: an operator changes the priority of a request that is not finished (`prio` in its
-- meta hash). Every step that puts one of its token elements on a list reads `prio` when it issues
-- the element (ack's re-queue, reclaim, census), so held and parked tokens reach the new
-- priority's list at their next hand-back. The elements of the tokens queued now wait in the old
-- priority's lists, on the token side (another hash tag): this returns them for `relist`, which
-- moves them there.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] the new priority, 0 to 99
-- Returns {'moved', old priority, shards, element...}: the priority is now ARGV[2]; the elements
--         "<kid>|<k>|<epoch>" of the tokens queued now (k ascending), to move from the old
--         priority's list of their shard (token k is on shard (home + k) % shards) to the new
--         one's (`relist`). When the priority was ARGV[2] already (a call re-sent after its reply
--         was lost, or a repeat), the old priority is the one before the last change (meta
--         `pprio`), so that a repeat completes a move its first caller left undone; with none,
--         no element is listed;
--         {'unknown'}: no such request (a small request in a lane has no meta hash: its record
--         is on its home shard, see lanes);
--         {'refused', state}: it is finished (completed, failed, cancelled) or still loading.
-- A request in a tenant group is refused with "SGINVALID ...": its elements wait in its group's
-- queues, and its group's tokens on the shard's lists (prelude.lua, "Tenant groups").
-- Errors "SGINVALID priority must be an integer from 0 to 99".
local function reprioritize(keys, args)
  local prio = tonumber(args[2])
  if not prio or prio < 0 or prio > 99 or prio % 1 ~= 0 then
    return redis.error_reply('SGINVALID priority must be an integer from 0 to 99')
  end
  local m = redis.call('HMGET', keys[1], 'state', 'prio', 'pprio', 'ntok', 'shards', 'lane', 'grp')
  local state = m[1]
  if not state or m[6] then return {'unknown'} end
  if m[7] then
    return redis.error_reply('SGINVALID a request in a tenant group keeps the priority it was submitted with')
  end
  if state ~= 'scheduled' and state ~= 'queued' and state ~= 'running' then return {'refused', state} end
  local old = tonumber(m[2])
  if old == prio then
    old = tonumber(m[3] or prio)
  else
    redis.call('HSET', keys[1], 'prio', prio, 'pprio', old)
  end
  local out = {'moved', old, m[5] or '1'}
  if old == prio then return out end
  sg_each_token(keys, 0, tonumber(m[4] or '0'), function(k, tok)
    if string.sub(tok, 1, 2) == 'q|' then out[#out + 1] = sg_element(args[1], k, sg_split(tok)[2]) end
  end)
  return out
end
