-- purge: deletes a finished request's keys now, rather than at the end of its retention
-- (`Admin::purge`; then `unlist` on its home shard). Run on the request's slot.
-- KEYS[1] the hash holding its `state` (a request's meta, or a lane request's record)
-- KEYS[2..] its other keys (none for a lane request)
-- Returns 1 when the keys were deleted, 0 when there was nothing (unknown, or expired). Errors
-- "SGSTATE ..." when the request has not finished: nothing is deleted.
local function purge(keys, args)
  local state = redis.call('HGET', keys[1], 'state')
  if not state then return 0 end
  if state ~= 'completed' and state ~= 'failed' and state ~= 'cancelled' then
    return redis.error_reply('SGSTATE the request has not finished (state ' .. state .. '): cancel it first')
  end
  redis.call('DEL', unpack(keys))
  return 1
end
