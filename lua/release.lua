-- release: a slot gives up a token it holds without an outcome (shutdown deadline passed, or the
-- handler was abandoned): the entry becomes an orphan, handed out again first, and the token is
-- re-queued under a new epoch.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] token k   ARGV[3] epoch   ARGV[4] holder
-- Returns {'requeue', element} to push onto the priority list, or {'fenced'} if the slot no
-- longer held the token.
local function release(keys, args)
  local tok = redis.call('HGET', keys[1], 't' .. args[2])
  if not tok then return {'fenced'} end
  local f = sg_split(tok)
  if f[1] ~= 'h' or f[2] ~= args[3] or f[3] ~= args[4] then return {'fenced'} end
  if f[5] ~= '' then sg_orphan(keys, f[5]) end
  return {'requeue', sg_requeue(keys, args[1], args[2], args[3], sg_now())}
end
