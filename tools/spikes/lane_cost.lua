#!lua name=spike
-- A spike, not sluicegate's library: the two hot calls of a lane (docs/design/lanes.md) in their
-- simplest form, with no fencing, policy or held records. tools/spikes/lane_cost.sh measures it.
local function now() local t = redis.call('TIME') return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) end
-- KEYS[1] lane stream  KEYS[2] request hash  KEYS[3] lane meta  KEYS[4] bell ; ARGV[1] id ARGV[2] payload
local function lane_submit(keys, args)
  if redis.call('EXISTS', keys[2]) == 1 then return redis.error_reply('SGDUPLICATE') end
  redis.call('HSET', keys[2], 'st', 'q', 'n', 1, 'd', 0, 'pol', '1|1000|60000|0|0', 'at', now())
  redis.call('XADD', keys[1], '*', 'r', args[1], 'i', 0, 'p', args[2])
  local parked = redis.call('HGET', keys[3], 'parked')
  if parked and tonumber(parked) > 0 then redis.call('HINCRBY', keys[3], 'parked', -1) redis.call('LPUSH', keys[4], 'x') end
  return 1
end
-- KEYS[1] lane  KEYS[2] events  KEYS[3] lane meta ; ARGV[1] consumer ARGV[2] count ARGV[3] prefix
local function lane_work(keys, args)
  local tok = redis.call('HMGET', keys[3], 't0', 'extra')
  local r = redis.call('XREADGROUP', 'GROUP', 'g', args[1], 'COUNT', args[2], 'STREAMS', keys[1], '>')
  if not r then return 0 end
  local ids = {}
  local t = now()
  for _, e in ipairs(r[1][2]) do
    ids[#ids + 1] = e[1]
    local f = e[2]
    local rid, i = f[2], f[4]
    local key = args[3] .. rid
    redis.call('HSET', key, 'o' .. i, '\192')
    local d = redis.call('HINCRBY', key, 'd', 1)
    local n = redis.call('HGET', key, 'n')
    if d == tonumber(n) then
      redis.call('HSET', key, 'st', 'c', 'fin', t)
      redis.call('PEXPIRE', key, 60000)
      redis.call('XADD', keys[2], 'MAXLEN', '~', 10000, '*', 'r', rid, 's', 'c')
      redis.call('PUBLISH', 'done', rid)
    end
  end
  redis.call('XACK', keys[1], 'g', unpack(ids))
  redis.call('XDEL', keys[1], unpack(ids))
  redis.call('HSET', keys[3], 't0', 'h|1|w/1|' .. t)
  return #ids
end
redis.register_function('lane_submit', lane_submit)
redis.register_function('lane_work', lane_work)
