-- reaped: a worker leaves the registry: it stopped cleanly, or recovery reclaimed every token its
-- slots had taken after it died.
-- KEYS[1] the registry   KEYS[2] worker descriptions   KEYS[3] workers being reaped
-- ARGV[1] worker id
-- Returns 1.
local function reaped(keys, args)
  redis.call('ZREM', keys[1], args[1])
  redis.call('ZREM', keys[3], args[1])
  redis.call('HDEL', keys[2], args[1], args[1] .. '|lapsed')
  return 1
end
