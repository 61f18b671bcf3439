-- lane_acquire: acquire for a lane token (prelude.lua, "Lanes"): the slot presents the lane token
-- element it took and gets a batch of lane entries, which may belong to different requests.
-- KEYS[1..6] the lane's keys (as a request's, prelude.lua)   KEYS[7] the shard's active index
-- KEYS[8] the shard's looks armed before a step
-- ARGV[1] the lane's key id   ARGV[2] token k   ARGV[3] epoch   ARGV[4] holder   ARGV[5] consumer
-- ARGV[6] batch: how many entries at most ("<n>|flat": flat entries)   ARGV[7] the records' key prefix ("<ns>:{<ns>.q<s>}:s:")
-- Returns {'run', entry, ...}: entry = {entry id, index, payload, attempt, request key id,
--          lifecycle, the record's pol, and, for a request's first entry, its queue wait ms}, or
--          with "<n>|flat" these eight items in the reply itself, the eighth -1 when absent;
--         {'park', wake}, {'drop'}, {'stale'} as acquire.
-- Entries of requests no longer live (cancelled, failed fast, reopened) are acked away unrun.
-- A call re-sent after its reply was lost (the token held by this holder under this epoch) hands
-- out again what the first handed out and is still live, or else hands out afresh.
local function lane_acquire(keys, args)
  local m = redis.call('HMGET', keys[1], 't' .. args[2], 'extra')
  local tok = m[1]
  if not tok then return {'drop'} end
  local f = sg_split(tok)
  local now = sg_now()
  local want, flat = sg_want(args[6])
  if f[1] == 'h' and f[2] == args[3] and f[3] == args[4] and f[5] ~= '' then
    -- The same call re-sent after its reply was lost: the entries it handed out, again. Those of
    -- requests no longer live (cancelled meanwhile) are acked away as a hand-out does, and the
    -- token then holds exactly the rest, which the slot's ack presents (sg_holds). When none is
    -- left, the hand-out starts afresh: answering `stale` would leave the token held by a live
    -- slot that forgets it.
    local reply, seen, ids, dropped = {'run'}, {}, {}, {}
    for _, id in ipairs(sg_ids(f[5])) do
      local entry = redis.call('XRANGE', keys[2], id, id)[1]
      local pending = redis.call('XPENDING', keys[2], 'g', id, id, 1)[1]
      if entry and pending then
        if sg_lane_entry(reply, flat, args[7], id, entry[2], tonumber(pending[4]), now, seen, sg_int(now)) then
          ids[#ids + 1] = id
        else
          dropped[#dropped + 1] = id
        end
      end
    end
    sg_lane_drop(keys, dropped)
    sg_lane_list_started(args[7], seen)
    if #ids > 0 then
      if #ids < #sg_ids(f[5]) then
        redis.call('HSET', keys[1], 't' .. args[2], 'h|' .. f[2] .. '|' .. f[3] .. '|' .. f[4] .. '|' .. table.concat(ids, ','))
      end
      return reply
    end
  elseif f[1] ~= 'q' or f[2] ~= args[3] then
    return {'stale'}
  end
  return sg_lane_next(keys, args[2], args[3], args[4], args[5], now, m[2], want, args[7], keys[7], keys[8], flat)
end
