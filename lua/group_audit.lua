-- group_audit: recovery's check of the group tokens of one shard (prelude.lua, "Tenant groups"):
-- a token held by a take record that no longer exists goes back (sg_group_end), so that a record
-- lost without its end (the shard's records expired: SG_HELD_TTL_MS) cannot keep a group's
-- tokens forever; a token waiting for its group's rate limit that is missing from the shard's
-- `gwake` goes back in it, due now. A record and the token it holds change in the same call everywhere else, so
-- this finds nothing unless Redis lost a write. Groups whose meta expired leave the set.
-- KEYS[1] the shard's take records (`held`)   KEYS[2] the shard's groups (set `groups`)
-- ARGV[1] SSCAN cursor over the groups   ARGV[2] how many to look at
-- Returns {next cursor ('0' after the last), tokens returned}.
local function group_audit(keys, args)
  local shard = sg_shard_key(keys[1], '')
  local scan = redis.call('SSCAN', keys[2], args[1], 'COUNT', args[2])
  local records, returned, now = nil, 0, sg_now()
  for _, name in ipairs(scan[2]) do
    local gkey = sg_group_key(shard, name)
    local ntok = redis.call('HGET', gkey, 'ntok')
    if not ntok then
      redis.call('SREM', keys[2], name)
    else
      sg_each_token({gkey}, 0, tonumber(ntok), function(k, tok)
        local t = sg_split(tok)
        if t[1] == 'r' then
          -- Waiting for its rate limit, but not in the wait set: queued again now.
          if not redis.call('ZSCORE', shard .. 'gwake', name .. '|' .. k .. '|' .. t[2]) then
            redis.call('ZADD', shard .. 'gwake', now, name .. '|' .. k .. '|' .. t[2])
            returned = returned + 1
          end
          return
        end
        if t[1] ~= 'h' then return end
        if not records then
          records = {}
          local all = redis.call('HGETALL', keys[1])
          for i = 2, #all, 2 do
            local f = sg_split(all[i])
            if f[6] and f[6] ~= '' then records[f[6] .. '|' .. f[7] .. '|' .. f[8]] = true end
          end
        end
        if not records[name .. '|' .. k .. '|' .. t[2]] then
          sg_group_end(gkey, k, t[2], now)
          returned = returned + 1
        end
      end)
    end
  end
  return {scan[1], returned}
end
