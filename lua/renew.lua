-- renew: heartbeat for the tokens one worker holds on one request.
-- KEYS[1] meta hash
-- ARGV[1] holder   ARGV[2] lease (ms)   ARGV[3..] pairs: token k, epoch
-- Returns the token numbers whose lease this holder has lost (moved on, expired and restored,
-- or request finished): the worker cancels the handlers running under them.
local function renew(keys, args)
  local now = sg_now()
  local lost = {}
  for i = 3, #args, 2 do
    local k, epoch = args[i], args[i + 1]
    local tok = redis.call('HGET', keys[1], 't' .. k)
    local f = tok and sg_split(tok)
    if f and f[1] == 'h' and f[2] == epoch and f[3] == args[1] then
      redis.call('HSET', keys[1], 't' .. k,
        'h|' .. epoch .. '|' .. args[1] .. '|' .. (now + tonumber(args[2])) .. '|' .. f[5])
    else
      lost[#lost + 1] = k
    end
  end
  return lost
end
