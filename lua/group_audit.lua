-- group_audit: recovery's check of the group tokens of one shard (prelude.lua, "Tenant groups").
-- A record and the group token it holds change in the same call everywhere else, so this finds
-- nothing unless the shard's records expired (a week after its last take: SG_HELD_TTL_MS) or
-- Redis lost a write. Two modes:
-- Scan: ARGV[1] an SSCAN cursor over the shard's groups, ARGV[2] how many to look at, ARGV[3] the
--   grace (ms). For each group (its meta gone: it leaves the set): a token waiting for its rate
--   limit that is missing from `gwake` goes back in it, due now; a queued token older than the
--   grace whose element is not in its list (the test of `verify`: the list is empty, or its tail
--   is more than a grace newer) is queued again under a new epoch; a held token that no take
--   record names is reported, for recovery to check that its holder's worker is gone (a live slot
--   may hold a token whose record expired) and then give it back (mode end).
--   Returns {next cursor ('0' after the last), tokens repaired, "<G>|<k>|<epoch>|<holder>"...}.
-- End: ARGV[1] 'end', ARGV[2..] "<G>|<k>|<epoch>": each token still held under that epoch that
--   no take record names goes back (sg_group_end). Returns the number given back.
-- KEYS[1] the shard's take records (`held`)   KEYS[2] the shard's groups (set `groups`)
local function sg_audit_named(held)
  local named = {}
  local all = redis.call('HGETALL', held)
  for i = 2, #all, 2 do
    local f = sg_split(all[i])
    if f[6] and f[6] ~= '' then named[f[6] .. '|' .. f[7] .. '|' .. f[8]] = true end
  end
  return named
end

local function group_audit(keys, args)
  local shard = sg_shard_key(keys[1], '')
  local now = sg_now()
  if args[1] == 'end' then
    local named, returned = sg_audit_named(keys[1]), 0
    for i = 2, #args do
      local f = sg_split(args[i])
      local gkey = sg_group_key(shard, f[1])
      local tok = redis.call('HGET', gkey, 't' .. f[2])
      if not named[args[i]] and tok and string.sub(tok, 1, 2 + #f[3]) == 'h|' .. f[3] then
        sg_group_end(gkey, tonumber(f[2]), f[3], now)
        returned = returned + 1
      end
    end
    return returned
  end
  local grace = tonumber(args[3] or '0')
  local scan = redis.call('SSCAN', keys[2], args[1], 'COUNT', args[2])
  local named, repaired, out = nil, 0, {}
  for _, name in ipairs(scan[2]) do
    local gkey = sg_group_key(shard, name)
    local ntok = redis.call('HGET', gkey, 'ntok')
    if not ntok then
      redis.call('SREM', keys[2], name)
    else
      sg_each_token({gkey}, 0, tonumber(ntok), function(k, tok)
        local t = sg_split(tok)
        local member = name .. '|' .. k .. '|' .. t[2]
        if t[1] == 'r' and not redis.call('ZSCORE', shard .. 'gwake', member) then
          sg_group_wait(shard, now, member)
          repaired = repaired + 1
        elseif t[1] == 'q' and now - tonumber(t[3]) > grace then
          local list = shard .. 'p:' .. t[4]
          local element = '^' .. member
          local tail = redis.call('LINDEX', list, -1)
          local tail_epoch = sg_element_epoch(tail)
          if not tail or (tail ~= element and tail_epoch and tail_epoch > tonumber(t[2]) + grace) then
            sg_group_queue(gkey, k, t[2], tonumber(t[4]), now)
            repaired = repaired + 1
          end
        elseif t[1] == 'h' then
          named = named or sg_audit_named(keys[1])
          if not named[member] then out[#out + 1] = member .. '|' .. t[3] end
        end
      end)
    end
  end
  local reply = {scan[1], repaired}
  for _, c in ipairs(out) do reply[#reply + 1] = c end
  return reply
end
