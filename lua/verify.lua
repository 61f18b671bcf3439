-- verify: recovery's token-side step after a census: push woken or restored elements, and report
-- which of the elements that should be waiting in the list are not there (taken by a worker that
-- died before recording it, in an older protocol; or never pushed, because whoever was to push
-- them died first). Also sets, on the home shard, when recovery next looks at the request.
-- The presence test costs O(1) whatever the list's length: elements are pushed at the head just
-- after their epoch is issued (an epoch is a time) and taken from the tail, so the list holds no
-- element older than its tail's epoch. An element whose epoch is more than the grace below the
-- tail's, or any element when the list is empty, is not in the list. (The grace absorbs clock
-- differences between masters, whose times the epochs are; a wrong "missing" only makes restore
-- issue a newer element, and the older copy is refused when taken.)
-- KEYS[1] the priority list   KEYS[2] the shard's bell   KEYS[3] (home shard only) the active index
-- KEYS[4] (home shard only) the looks armed before a step (arm)
-- ARGV[1] request key id   ARGV[2] next look (ms from now; read on the home shard)   ARGV[3] grace
-- (ms)   ARGV[4] n: how many elements to push   ARGV[5 .. 4+n] elements to push
-- ARGV[5+n ..] elements to check; on the home shard, the last argument is the score recovery's
-- claim wrote ('' if none): the next look is set as for arm (sg_rearm)
-- Returns the checked elements that are missing from the list. When some are, the next look is
-- set a grace from now instead, so that it comes soon if the restore they call for never happens
-- (its caller died).
local function verify(keys, args)
  local n = tonumber(args[4])
  sg_push(keys[1], keys[2], {unpack(args, 5, 4 + n)})
  local grace = tonumber(args[3])
  local last = #args
  local claim = nil
  if keys[3] then
    claim = args[last]
    last = last - 1
  end
  local tail = redis.call('LINDEX', keys[1], -1)
  local tail_epoch = sg_element_epoch(tail)
  local missing = {}
  for i = 5 + n, last do
    local epoch = sg_element_epoch(args[i])
    if not tail or (tail ~= args[i] and tail_epoch and epoch and tail_epoch > epoch + grace) then
      missing[#missing + 1] = args[i]
    end
  end
  if keys[3] then
    local look = tonumber(args[2])
    if #missing > 0 then look = math.min(look, grace) end
    sg_rearm(keys[3], args[1], sg_now() + look, claim, keys[4])
  end
  return missing
end
