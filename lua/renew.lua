-- renew: heartbeat for the tokens one worker holds on one request.
-- KEYS[1] meta hash (renew touches no other key of the request)
-- ARGV[1] lease (ms)   ARGV[2..] triples: token k, epoch, holder
-- Returns the token numbers whose lease is lost (moved on, expired and restored, or request
-- finished): the worker cancels the handlers running under them.
local function renew(keys, args)
  local now = sg_now()
  local lost = {}
  for i = 2, #args, 3 do
    local k, epoch, holder = args[i], args[i + 1], args[i + 2]
    local tok = redis.call('HGET', keys[1], 't' .. k)
    local f = tok and sg_split(tok)
    if f and f[1] == 'h' and f[2] == epoch and f[3] == holder then
      redis.call('HSET', keys[1], 't' .. k,
        'h|' .. epoch .. '|' .. holder .. '|' .. (now + tonumber(args[1])) .. '|' .. f[5])
    else
      lost[#lost + 1] = k
    end
  end
  return lost
end
