-- sched_fire: move a schedule's due ticks into its debt (`owe`), once. The caller (a worker's
-- recovery, on shard 0) read the state with sched_get, computed from that state and a Redis time
-- the ticks owed up to that time and the first tick after it; this is a compare-and-set on the
-- `gen` and `next` it read, so of racing callers one moves the ticks, and a re-sent call moves
-- nothing twice. Whatever the answer, the caller then submits every tick owed (its own, and those
-- left by a caller that died) and pays each with sched_paid.
-- KEYS[1] the due set   KEYS[2] the schedule's state
-- ARGV[1] name   ARGV[2] the gen read   ARGV[3] the next read ('' if absent)   ARGV[4] the new
-- next (ms)   ARGV[5] the gaps to keep (pruned of those before the new next; '' for none)
-- ARGV[6] claim (ms): while ticks are owed, others look again only after this long
-- ARGV[7...] the ticks to owe (ms), oldest first
-- Returns {'ok' or 'conflict', tick, tick, ...}: whether this call moved the ticks, and every tick
-- owed now, oldest first.
local function sched_fire(keys, args)
  local s = redis.call('HMGET', keys[2], 'gen', 'next', 'paused', 'owe')
  local owe = {}
  if s[4] and s[4] ~= '' then
    for t in string.gmatch(s[4], '[^,]+') do owe[#owe + 1] = tonumber(t) end
  end
  local tag = 'ok'
  if not s[1] or s[1] ~= args[2] or (s[2] or '') ~= args[3] then
    tag = 'conflict'
  else
    local seen = {}
    for _, t in ipairs(owe) do seen[t] = true end
    for i = 7, #args do
      local t = tonumber(args[i])
      if not seen[t] then
        seen[t] = true
        owe[#owe + 1] = t
      end
    end
    table.sort(owe)
    local text = {}
    for i, t in ipairs(owe) do text[i] = sg_int(t) end
    redis.call('HSET', keys[2], 'next', args[4])
    if #text > 0 then redis.call('HSET', keys[2], 'owe', table.concat(text, ',')) end
    if args[5] ~= '' then
      redis.call('HSET', keys[2], 'gaps', args[5])
    else
      redis.call('HDEL', keys[2], 'gaps')
    end
    -- Paused, a schedule is looked at again only while ticks before its pause are not owed yet
    -- (the caller computed up to a time before the pause).
    if #owe > 0 then
      redis.call('ZADD', keys[1], sg_now() + tonumber(args[6]), args[1])
    elseif s[3] and tonumber(args[4]) > tonumber(s[3]) then
      redis.call('ZREM', keys[1], args[1])
    else
      redis.call('ZADD', keys[1], args[4], args[1])
    end
  end
  local out = {tag}
  for _, t in ipairs(owe) do out[#out + 1] = t end
  return out
end
