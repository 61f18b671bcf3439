-- relabel: after reprioritize, the request's row in the listing index (prelude.lua, "The listing
-- index") takes its new priority, so that `list --priority` finds it there. Run on its home shard.
-- KEYS[1] the shard's index rows
-- ARGV[1] request key id   ARGV[2] its priority now
-- Returns 1 when the row was rewritten, 0 when the request is not listed.
local function relabel(keys, args)
  local row = redis.call('HGET', keys[1], args[1])
  if not row then return 0 end
  local kind, rest = string.match(row, '^([^|]*)|[^|]*|(.*)$')
  redis.call('HSET', keys[1], args[1], kind .. '|' .. args[2] .. '|' .. rest)
  return 1
end
