-- lane_submit_many: several whole small requests of one priority and home shard in one call
-- (`Producer::submit_many`), each as lane_submit creates it: the lane is opened once, each
-- request is checked and written in turn, and the parked lane tokens their first parts need are
-- woken once, at the end. A request whose id is in use is refused alone: the others are created.
-- KEYS[1..6] the lane's keys (as a request's, prelude.lua)   KEYS[7] the lane's priority list
-- KEYS[8] the shard's bell   KEYS[9] the shard's active index   KEYS[10] the shard's registration
-- times   KEYS[11..] per request, two: its record, and its id's finish marks on the shard
-- ARGV[1] the lane's key id   ARGV[2] priority   ARGV[3] the lane's tokens L (used when it is
-- created)   ARGV[4] the lane's first look by recovery (ms from now)   ARGV[5..] per request, in
-- the order of its keys, a group of 12 + n: request key id, request id as the producer gave it,
-- submission nonce ('' when the producer generated the id), concurrency limit, max attempts,
-- per-attempt timeout (ms, 0 = none), retry backoff base (ms), backoff cap (ms), flags (sg_flags),
-- its row in the listing index ('' : not listed), trace context ('' = none), n (its number of
-- parts, 1 to 64), then its n payloads (as lane_submit's ARGV[2..4], [6..11], [14..16..])
-- Returns one item per request, in order: its lifecycle, or the text of its refusal
-- ("SGDUPLICATE ..."). The same call re-sent after a reconnect answers as the first did and
-- writes nothing (each request as lane_submit's). Errors "SGINVALID ..." when an argument is out of
-- range; then nothing is written.
local function lane_submit_many(keys, args)
  local prio, lanes = tonumber(args[2]), tonumber(args[3])
  local invalid = sg_lane_check_tokens(lanes)
  if invalid then return invalid end
  -- Every request is checked before any is written.
  local requests, i = {}, 5
  while i <= #args do
    local n = tonumber(args[i + 11])
    local j = #requests + 1
    invalid = sg_lane_check(prio, tonumber(args[i + 3]), args, i + 4, n, args[i + 10])
    if invalid then return invalid end
    local failfast, discard
    failfast, discard, invalid = sg_flags(args[i + 8])
    if invalid then return invalid end
    if i + 11 + n > #args or not keys[10 + 2 * j] then
      return redis.error_reply('SGINVALID request ' .. j .. ' has fewer payloads or keys than it says')
    end
    requests[j] = {kid = args[i], id = args[i + 1], nonce = args[i + 2], record = keys[9 + 2 * j],
      marks = keys[10 + 2 * j], prio = prio, limit = tonumber(args[i + 3]), maxatt = args[i + 4],
      timeout = args[i + 5], bbase = args[i + 6], bmax = args[i + 7], failfast = failfast, discard = discard,
      row = args[i + 9], trace = args[i + 10], first = i + 12, n = n}
    i = i + 12 + n
  end
  if #requests == 0 or #keys ~= 10 + 2 * #requests then
    return redis.error_reply('SGINVALID lane_submit_many takes 10 keys and two per request, and one request at least')
  end
  -- One clock reading, so one lifecycle, for the call's requests; once one is listed live (one with
  -- tags: those without are listed when handed out, sg_ix_add_kept), the index's shared keys are
  -- known to be kept (sg_ix_add's `live`). The queued ones are counted once, at the end.
  local reply, now, lc, parked, ix, fed, live, queued = {}, nil, nil, nil, sg_ix(keys[9]), 0, false, 0
  for j, r in ipairs(requests) do
    local taken = sg_lane_taken(r, keys[10], keys[9])
    if taken then
      reply[j] = taken
    else
      if not now then
        now, lc = sg_lane_clock()
        parked = sg_lane_open(keys, args[1], prio, lanes, now, tonumber(args[4]), keys[9])
      end
      local f, q = sg_lane_write(keys, r, args, r.first, r.n, now, lc, ix, live)
      fed, queued = fed + f, queued + q
      live = live or (r.row ~= '' and string.byte(r.row, -1) ~= 124)
      reply[j] = lc
    end
  end
  sg_ix_queued(ix, queued)
  if now then sg_push(keys[7], keys[8], sg_unpark(keys, args[1], fed, now, parked)) end
  return reply
end
