-- stats_add: adds a producer's or a worker's counts to the stats by stage, one hash per minute
-- (docs/protocol.md §3, "Stats by stage"). Components count in memory and call this once per
-- flush interval with what they counted since, never per part or per take.
-- KEYS[1..n] per-minute stats hashes ("<ns>:{<ns>.q0}:st:<minute>"), all on shard 0's tag
-- ARGV[1] how long a minute's hash is kept after this addition (ms, at least 1)
-- ARGV[2..] per key, in the order of KEYS: the number m of its fields, then m pairs field, delta
--   (a whole number; fields "<priority>|<counter>" and "<priority>|<histogram>|<bucket>")
-- Returns how many fields were added to, or an error "SGINVALID ..." for malformed arguments
-- (nothing is written then).
-- Each hash gets its expiry in the same step as its counts, so none is ever left without one.
-- A call re-sent after a lost reply adds its counts twice: the stats are exact only while calls
-- get through.
local function stats_add(keys, args)
  local ttl = tonumber(args[1])
  if not ttl or ttl < 1 or ttl % 1 ~= 0 then
    return redis.error_reply('SGINVALID argument 1 must be a whole number of ms of at least 1')
  end
  -- Checked whole before anything is written.
  local i = 2
  for _ = 1, #keys do
    local m = tonumber(args[i])
    if not m or m < 0 or m % 1 ~= 0 or i + 2 * m > #args then
      return redis.error_reply('SGINVALID argument ' .. i .. ' must count the field/delta pairs that follow it')
    end
    for j = i + 2, i + 2 * m, 2 do
      local d = tonumber(args[j])
      if not d or d % 1 ~= 0 then
        return redis.error_reply('SGINVALID argument ' .. j .. ' must be a whole number')
      end
    end
    i = i + 1 + 2 * m
  end
  if i ~= #args + 1 then
    return redis.error_reply('SGINVALID more arguments than the keys announce')
  end
  i = 2
  local n = 0
  for _, key in ipairs(keys) do
    local m = tonumber(args[i])
    for j = i + 1, i + 2 * m - 1, 2 do
      redis.call('HINCRBY', key, args[j], args[j + 1])
    end
    if m > 0 then redis.call('PEXPIRE', key, ttl) end
    n = n + m
    i = i + 1 + 2 * m
  end
  return n
end
