-- unindex: the last step of a finish (after finish_index and seal): the request leaves recovery's
-- index, unless requeue_dead has reopened it since (the index entry then belongs to the new
-- lifecycle).
-- KEYS[1] active-request index   KEYS[2] the request's finish marks (finish_index)
-- ARGV[1] request key id   ARGV[2] the lifecycle (`gen`) that finished
-- Returns 1 when the request left the index (its marks are deleted with it), 0 otherwise.
local function unindex(keys, args)
  local reopened = redis.call('HGET', keys[2], 'o')
  if reopened and tonumber(reopened) > tonumber(args[2]) then return 0 end
  redis.call('DEL', keys[2])
  return redis.call('ZREM', keys[1], args[1])
end
