-- list: a page of the listing index of one shard (prelude.lua, "The listing index"), newest first.
-- Reads only (registered no-writes: FCALL_RO, replicas, a Redis at its maxmemory).
-- KEYS[1] the shard's index rows (hash; the other index keys are named from its prefix)
-- ARGV[1] the sets to walk, comma-separated index names (`live`, `completed`, `failed`,
-- `cancelled`, `t:<tag>`, `tracked`): their entries are merged, newest first
-- ARGV[2] the state sets an entry must be in, comma-separated ('' any)
-- ARGV[3] the cursor's score ('+inf' to start)   ARGV[4] how many entries of exactly that score
-- the walk has passed already (the cursor's second half)
-- ARGV[5] only requests submitted at least this long ago (ms; '' any)   ARGV[6] most rows returned
-- ARGV[7] most entries looked at (rows and entries the filters passed over)
-- ARGV[8] priority the row must have ('' any)   ARGV[9] tag the row must have ('' any)
-- ARGV[10] '1': only tracked requests
-- Returns {next score, next passed, looked at, rows...}: next score is '' when the walk reached the
-- end; each row is seven items: key id, submit ms, index row, state set, tracked (0/1), and the
-- cursor (score, passed) that resumes right after it.
-- How many lane entries `list` passes over in one lane (hidden ones, below, and entries of
-- requests listed in `live` that run: with parts fed later, or requeued) before it ends its page where that lane's walk
-- stopped (list_lane's `low`). The randomized checker's build of the library sets it to 2.
local LIST_LANE_SKIP = 10000

-- How many pending entries of one lane `list` reads (those of its running requests, below)
-- before it refuses to page.
local LIST_LANE_PENDING = 10000

-- The live requests of one lane that are listed from it (prelude.lua, sg_ix_add_kept), as `list`
-- walks a set, each as {key id, submitted ms, 'live'} once per request, those submitted after
-- `from` (ms, or '+inf') left out: every one with an entry handed out and not settled yet (the
-- group's pending entries, in any order), and of the entries of the lane `stream` (its consumer
-- group `g`) not handed out yet, newest first, at least `want` more requests when the lane has
-- that many, and then every one submitted in the same millisecond as the last (so that ties are
-- told apart by key id as in a sorted set).
-- Such a request is queued, or running with every part of it fed at its submit; either way each
-- part of it not settled yet is in the lane, pending or not handed out yet, and those not handed
-- out are in submission order, as are the parts of one cancelled before it started. Those entries
-- ("ordered") follow their requests' submit times, which a binary search by entry id uses. The
-- walk shows only the live requests that keep their rows in their records and are not in `live`
-- (`live` shows those); the other ordered ones (unlisted, tracked, cancelled) are hidden, and
-- entries of requests with parts fed later are passed over. Returns the entries (nil when more
-- than LIST_LANE_PENDING entries are pending), whether that was all, and, when it passed over
-- more than LIST_LANE_SKIP entries first, the submit ms of the last ordered entry it reached
-- (math.huge when none): the page then ends above it.
local function list_lane(base, stream, from, want, live)
  local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)[1]
  if not last then return {}, true end
  local delivered, grouped = '0-0', false
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    for i = 1, #g, 2 do
      if g[i] == 'last-delivered-id' then delivered, grouped = g[i + 1], true end
    end
  end
  local n = function(id) return tonumber(string.match(id, '^0%-(%d+)$') or '0') end
  local lo, hi = n(delivered) + 1, n(last[1])
  -- The submit ms of the request of entry `e` if the entry is ordered, else nil; and whether the
  -- walk shows it. By request and lifecycle: entries of an earlier request of the id (cancelled,
  -- then purged) may still wait in the lane.
  local known = {}
  local function ordered(e)
    local kid, lc = e[2][4], e[2][8]
    local key = kid .. '|' .. lc
    local k = known[key]
    if k == nil then
      local m = redis.call('HMGET', base .. 's:' .. kid, 'state', 'lc', 'started', 'ix', 'nf')
      k = false
      if m[2] == lc then
        local at = math.floor(tonumber(lc) / 1000)
        if m[1] == 'queued' or (m[1] == 'cancelled' and not m[3]) then
          local shown = m[1] == 'queued' and m[4] and not redis.call('ZSCORE', live, kid)
          k = {at, shown and true or false}
        elseif m[1] == 'running' and m[4] and not m[5] and not redis.call('ZSCORE', live, kid) then
          -- Listed from its lane: its parts were all fed at its submit, and none was requeued
          -- (that lists it in `live`).
          k = {at, true}
        end
      end
      known[key] = k
    end
    if not k then return nil end
    return k[1], k[2]
  end
  local f = tonumber(from) or math.huge
  -- The running requests with entries handed out: in delivery order, not submission order, so
  -- all of them (not only the newest `want`); the walk below counts only requests these left out.
  local out, shown = {}, {}
  local pending = grouped and redis.call('XPENDING', stream, 'g', '-', '+', LIST_LANE_PENDING + 1) or {}
  if #pending > LIST_LANE_PENDING then return nil end
  for _, p in ipairs(pending) do
    local e = redis.call('XRANGE', stream, p[1], p[1])[1]
    if e then
      local kid = e[2][4]
      local at, show = ordered(e)
      if at and show and at <= f and not shown[kid] then
        shown[kid] = true
        out[#out + 1] = {kid, at, 'live'}
      end
    end
  end
  local found = #out
  if lo > hi then return out, true end
  -- The first entry id after which every ordered entry was submitted after `from`: the smallest
  -- id whose first ordered entry at or after it was. A probe that finds none near errs later,
  -- which only makes the walk below pass over more.
  local top = '+'
  if from ~= '+inf' then
    local a, b = lo, hi + 1
    while a < b do
      local mid = math.floor((a + b) / 2)
      local at
      for _, e in ipairs(redis.call('XRANGE', stream, '0-' .. mid, '+', 'COUNT', 16)) do
        at = ordered(e)
        if at then break end
      end
      if at and at > f then b = mid else a = mid + 1 end
    end
    if a <= hi then top = '(0-' .. a end
  end
  local skipped, tie, low = 0, nil, nil
  while true do
    local got = redis.call('XREVRANGE', stream, top, '(' .. delivered, 'COUNT', 100)
    if #got == 0 then return out, true end
    for _, e in ipairs(got) do
      local kid = e[2][4]
      local at, show = ordered(e)
      if at and at <= f then
        if tie and at < tie then return out, false end
        low = at
        if show and not shown[kid] then
          shown[kid] = true
          out[#out + 1] = {kid, at, 'live'}
          if #out - found >= want then tie = at end
        elseif not show then
          skipped = skipped + 1
        end
      else
        skipped = skipped + 1
      end
      if skipped > LIST_LANE_SKIP then return out, false, low or math.huge end
    end
    top = '(' .. got[#got][1]
  end
end

local function list(keys, args)
  local ix = string.sub(keys[1], 1, -4)
  local cursor, passed = args[3], tonumber(args[4])
  local newest = '+inf'
  if args[5] ~= '' then newest = sg_int(sg_now() - tonumber(args[5])) end
  local from = cursor
  if newest ~= '+inf' and (cursor == '+inf' or tonumber(newest) < tonumber(cursor)) then
    from, passed = newest, 0
  end
  local limit, budget = tonumber(args[6]), tonumber(args[7])
  local want = passed + budget
  -- `floor`: a lane walk that stopped early (list_lane) saw every entry above it, not every one
  -- at it or below: this page shows only entries above it, and the next one starts there.
  local entries, complete, floor = {}, true, nil
  for set in string.gmatch(args[1], '[^,]+') do
    local got = redis.call('ZREVRANGEBYSCORE', ix .. set, from, '-inf', 'WITHSCORES', 'LIMIT', 0, want)
    local terminal = set == 'completed' or set == 'failed' or set == 'cancelled'
    if #got / 2 >= want then
      complete = false
      if terminal then
        -- A group member (prelude.lua, "The listing index") holds several requests of its score,
        -- which sort among the others of that score by key id: every member at the lowest score
        -- read is read, so that the page's order within a score is the same on every page.
        local low = got[#got]
        while #got > 0 and got[#got] == low do
          got[#got] = nil
          got[#got] = nil
        end
        for _, m in ipairs(redis.call('ZRANGEBYSCORE', ix .. set, low, low)) do
          got[#got + 1] = m
          got[#got + 1] = low
        end
      end
    end
    for i = 1, #got, 2 do
      if terminal and string.byte(got[i], 1) == 124 then
        for _, kid in ipairs(sg_ix_group_kids(got[i])) do
          entries[#entries + 1] = {kid, tonumber(got[i + 1]), set, true}
        end
      else
        entries[#entries + 1] = {got[i], tonumber(got[i + 1]), set}
      end
    end
    if set == 'live' then
      -- Queued lane requests are listed as live, but found in their lanes (sg_ix_add_kept).
      local base = string.sub(ix, 1, -4)
      for p = 0, 99 do
        if args[8] == '' or args[8] == tostring(p) then
          local stream = base .. 'lane:' .. p .. ':s'
          if redis.call('EXISTS', stream) == 1 then
            local queued, all, low = list_lane(base, stream, from, want, ix .. 'live')
            if not queued then
              return redis.error_reply('SGSTATE a lane holds more than ' .. LIST_LANE_PENDING .. ' entries handed '
                .. 'out and not settled: list cannot page through its running requests now (try again once '
                .. 'they have settled)')
            end
            if not all then complete = false end
            if low then floor = math.max(floor or low, low) end
            for _, e in ipairs(queued) do entries[#entries + 1] = e end
          end
        end
      end
    end
  end
  if floor then
    if floor >= (tonumber(from) or math.huge) then
      return redis.error_reply('SGSTATE a lane holds more than ' .. LIST_LANE_SKIP .. ' entries of started '
        .. 'requests among its queued ones: list cannot page past them now (list finished requests, or '
        .. 'try again once the lane has drained further)')
    end
    local above = {}
    for _, e in ipairs(entries) do if e[2] > floor then above[#above + 1] = e end end
    entries = above
  end
  -- By score, then key id, then set: the same order on every page.
  table.sort(entries, function(a, b)
    if a[2] ~= b[2] then return a[2] > b[2] end
    if a[1] ~= b[1] then return a[1] > b[1] end
    return a[3] > b[3]
  end)
  local states = {}
  for s in string.gmatch(args[2], '[^,]+') do states[#states + 1] = s end
  local out = {'', 0, 0}
  local rows, looked, last, ties = 0, 0, nil, 0
  local first = from == cursor and tonumber(from)
  local i = 0
  while i < #entries and looked < budget and rows < limit do
    i = i + 1
    local e = entries[i]
    if e[2] == last then ties = ties + 1 else last, ties = e[2], 1 end
    if not (first and e[2] == first and ties <= passed) then
      looked = looked + 1
      local kid = e[1]
      local row
      if e[4] then
        -- In a group: listed while its record agrees (its state is the set's, its submit ms the
        -- score): a request of it purged, reopened or submitted again under its id since is not.
        local r = redis.call('HMGET', sg_ix_record(ix, kid), 'state', 'ix', 'lc')
        if r[1] == e[3] and r[2] and tonumber(sg_ix_kept_at(r[2], r[3])) == e[2] then row = sg_ix_row(ix, kid) end
      else
        row = sg_ix_row(ix, kid)
      end
      local state = string.match(e[3], '^t:') == nil and e[3] ~= 'tracked' and e[3] or nil
      if not state then
        for _, s in ipairs(SG_IX_STATES) do
          if redis.call('ZSCORE', ix .. s, kid) then state = s break end
        end
      end
      local ok = row ~= nil and state ~= nil
      if ok and #states > 0 then
        ok = false
        for _, s in ipairs(states) do if s == state then ok = true end end
      end
      local f = ok and sg_split(row)
      if ok and args[8] ~= '' and f[2] ~= args[8] then ok = false end
      if ok and args[9] ~= '' then
        ok = false
        for _, tag in ipairs(sg_ix_tags(row)) do if tag == args[9] then ok = true end end
      end
      local tracked = ok and redis.call('ZSCORE', ix .. 'tracked', kid) and 1 or 0
      if ok and args[10] == '1' and tracked == 0 then ok = false end
      if ok then
        rows = rows + 1
        for _, v in ipairs({kid, sg_int(e[2]), row, state, tracked, sg_int(e[2]), ties}) do out[#out + 1] = v end
      end
    end
  end
  if floor and i >= #entries and looked == 0 then
    -- Nothing above the floor was left to look at: the next page starts at it, none of it
    -- passed. (Otherwise it resumes after the last entry looked at, as always: a set that gave
    -- `want` entries may hold more above the floor.)
    out[1], out[2] = sg_int(floor), 0
  elseif i < #entries or not complete then
    out[1], out[2] = sg_int(last or tonumber(from)), ties
    if not last then out[2] = passed end
  end
  out[3] = looked
  return out
end
