-- holds: which of the tokens one worker's slots hold on one request they no longer hold (the
-- request finished or was cancelled, or their worker was declared dead and recovery moved the
-- tokens on): the worker cancels the handlers running under them. Reads only.
-- KEYS[1] meta hash (holds touches no other key of the request)
-- ARGV[1..] triples: token k, epoch, holder
-- Returns the token numbers no longer held by that holder at that epoch.
local function holds(keys, args)
  local lost = {}
  for i = 1, #args, 3 do
    local k, epoch, holder = args[i], args[i + 1], args[i + 2]
    local tok = redis.call('HGET', keys[1], 't' .. k)
    local f = tok and sg_split(tok)
    if not (f and f[1] == 'h' and f[2] == epoch and f[3] == holder) then lost[#lost + 1] = k end
  end
  return lost
end
