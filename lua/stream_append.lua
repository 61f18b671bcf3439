-- stream_append: add parts to an open streamed request; parked tokens wake up for them. The
-- producer arms recovery (arm) before this call and pushes the elements (push) after it.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] the nonce given at stream_open   ARGV[3] index of the first
-- part   ARGV[4] the deadline of the producer's arm (sg_step_late)   ARGV[5..] payloads
-- Returns {priority, [outstanding,] element...}: the request's priority now (the list to push the
-- elements onto: an operator may have changed it since the request was opened, reprioritize);
-- for a windowed request (meta `window` > 0) its outstanding parts (`left`, after this call);
-- then the token elements to push. The same call re-sent after a reconnect adds nothing
-- twice (parts below the request's total are skipped). Errors "SGSTATE ..." when the request is
-- not open (finalized, cancelled, unknown) or not this producer's, "SGGAP ..." when parts before
-- ARGV[3] are missing, "SGLATE ..." past the deadline.
local function stream_append(keys, args)
  local late = sg_step_late(args[4])
  if late then return late end
  local m = redis.call('HMGET', keys[1], 'open', 'nonce', 'total', 'state', 'window', 'prio')
  if m[1] ~= '1' or m[2] ~= args[2] or m[4] == 'cancelled' or m[4] == 'failed' or m[4] == 'completed' then
    return redis.error_reply('SGSTATE the request is not open for parts (finalized, cancelled or unknown)')
  end
  local total = tonumber(m[3])
  local first = tonumber(args[3])
  if first > total then
    return redis.error_reply('SGGAP parts from index ' .. total .. ' are missing before index ' .. first)
  end
  -- Part i is entry 0-<i+1>. Parts are appended in order and `total` is the number of the last
  -- one (trims and deletes leave the stream's last id as it was), so `0-*` (the next sequence
  -- number) names each part's entry without formatting its number.
  local added = 0
  for i = math.max(total - first, 0) + 5, #args do
    redis.call('XADD', keys[2], '0-*', 'p', args[i])
    added = added + 1
  end
  redis.call('HINCRBY', keys[1], 'total', added)
  local left = redis.call('HINCRBY', keys[1], 'left', added)
  local elements = sg_unpark(keys, args[1], added, sg_now())
  if tonumber(m[5] or '0') > 0 then
    -- A windowed producer paces itself by the parts still to settle (docs/protocol.md §6.14).
    table.insert(elements, 1, left)
  end
  table.insert(elements, 1, tonumber(m[6]))
  return elements
end
