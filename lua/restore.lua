-- restore: re-queue tokens whose element verify found missing, under a new epoch, but only if each
-- is still queued with the epoch that was checked: if a worker acquired it in the meantime (the
-- element was in flight), nothing happens, and a late push of the old element is refused by
-- acquire. Restoring therefore never makes a token too many.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2..] missing elements "<rid>|<k>|<epoch>"
-- Returns the new elements, to push onto the request's priority list.
local function restore(keys, args)
  local now = sg_now()
  local out = {}
  for i = 2, #args do
    local f = sg_split(args[i])
    local k, epoch = f[2], f[3]
    local tok = redis.call('HGET', keys[1], 't' .. k)
    if tok then
      local t = sg_split(tok)
      if t[1] == 'q' and t[2] == epoch then out[#out + 1] = sg_requeue(keys, args[1], k, epoch, now) end
    end
  end
  return out
end
