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
  local entries, complete = {}, true
  for set in string.gmatch(args[1], '[^,]+') do
    local got = redis.call('ZREVRANGEBYSCORE', ix .. set, from, '-inf', 'WITHSCORES', 'LIMIT', 0, want)
    if #got / 2 >= want then complete = false end
    for i = 1, #got, 2 do entries[#entries + 1] = {got[i], tonumber(got[i + 1]), set} end
  end
  table.sort(entries, function(a, b)
    if a[2] ~= b[2] then return a[2] > b[2] end
    return a[1] > b[1]
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
      local row = sg_ix_row(ix, kid)
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
  if i < #entries or not complete then
    out[1], out[2] = sg_int(last or tonumber(from)), ties
    if not last then out[2] = passed end
  end
  out[3] = looked
  return out
end
