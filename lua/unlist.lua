-- unlist: the token-side half of purging one finished request (`Admin::purge`): it leaves the
-- listing index, and its finish marks go. Run on its home shard, after `purge` deleted its keys.
-- KEYS[1] the shard's index rows (prelude.lua, "The listing index")   KEYS[2] the shard's active
-- index   KEYS[3] the request's finish marks   KEYS[4] the id's lane record on this shard
-- (optional: a lane request of the id created since `purge` found none is not unlisted)
-- ARGV[1] request key id
-- Returns 1 when it was listed, 0 when not. Errors "SGSTATE ..." while the request is in recovery's
-- index (not finished, or its finish steps not all done; or a new request of the id registered
-- since its keys went, which its first push lists), listed as live (a new lane request of the
-- id, which recovery's index does not name) or, given KEYS[4], while a lane request of the id
-- exists (one created after `purge` looked, and finished since), or while its release to its
-- downstreams is owed (the shard's outbox `rel` holds it): nothing is changed. Its set of
-- downstreams goes with the marks.
local function unlist(keys, args)
  local ix = string.sub(keys[1], 1, -4)
  if redis.call('ZSCORE', keys[2], args[1]) or redis.call('ZSCORE', ix .. 'live', args[1])
    or (keys[4] and redis.call('EXISTS', keys[4]) == 1)
    or redis.call('ZSCORE', sg_shard_key(keys[2], 'rel'), args[1]) then
    return redis.error_reply('SGSTATE the request has not finished (or is still finishing)')
  end
  redis.call('DEL', keys[3], sg_shard_key(keys[2], 'dn:' .. args[1]))
  return sg_ix_remove(ix, args[1], sg_now())
end
