-- outstanding: how many parts of an open streamed request are not settled yet (added, neither
-- done nor dead-lettered): what a windowed producer waits on before it adds more. Read-only
-- (registered no-writes: callable with FCALL_RO, on a replica, at Redis's memory limit).
-- KEYS[1] the request's meta hash (only this key)
-- ARGV none
-- Returns the meta field `left` (integer) while the request is open for parts, or -1 when it is
-- not (finalized, cancelled, finished, expired or unknown): the producer's add then stops.
local function outstanding(keys, args)
  local m = redis.call('HMGET', keys[1], 'open', 'state', 'left')
  if m[1] ~= '1' or m[2] == 'completed' or m[2] == 'failed' or m[2] == 'cancelled' or not m[2] then
    return -1
  end
  return tonumber(m[3] or '0')
end
