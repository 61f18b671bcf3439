-- purge: deletes a finished request's keys now, rather than at the end of its retention
-- (`Admin::purge`; then `unlist` on its home shard). Run on the request's slot.
-- KEYS[1] the hash holding its `state` (a request's meta, or a lane request's record)
-- KEYS[2..] its other keys (none for a lane request); with ARGV[1], the last one is instead its
-- home shard's release outbox (a lane request's: its record is on that shard)
-- ARGV[1] (optional) its key id: refused while the outbox holds it (its downstreams have not all
-- heard of its finish yet; prelude.lua, "Dependencies between requests"); a lane request listed
-- in a group of its terminal set leaves the group (the rest of its index entries go by `unlist`)
-- Returns 1 when the keys were deleted, 0 when there was nothing (unknown, or expired). Errors
-- "SGSTATE ..." when the request has not finished, or its release is owed: nothing is deleted.
local function purge(keys, args)
  local state = redis.call('HGET', keys[1], 'state')
  if not state then return 0 end
  if state ~= 'completed' and state ~= 'failed' and state ~= 'cancelled' then
    return redis.error_reply('SGSTATE the request has not finished (state ' .. state .. '): cancel it first')
  end
  local delete = keys
  if args[1] then
    if redis.call('ZSCORE', keys[#keys], args[1]) then
      return redis.error_reply('SGSTATE the request has finished, but its downstreams have not all heard yet')
    end
    delete = {}
    for i = 1, #keys - 1 do delete[i] = keys[i] end
    -- A lane request listed in a group of its terminal set (prelude.lua, "The listing index")
    -- leaves the group now: `unlist`, after this, finds it no more by its record.
    local ix = sg_ix(keys[#keys])
    local st, at = sg_ix_kept_terminal(ix, args[1])
    if st then sg_ix_ungroup(ix, st, at, args[1]) end
  end
  redis.call('DEL', unpack(delete))
  return 1
end
