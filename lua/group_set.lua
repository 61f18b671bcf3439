-- group_set: set a tenant group's limit and rate (Admin::set_group, Admin::set_group_rate;
-- prelude.lua, "Tenant groups"): at most `limit` sub-requests of the group's requests run at
-- once. Kept in the shard's `gconf` for when the group's meta is made. An existing group gets
-- tokens added at once, under the lowest free numbers (queued, as many as elements wait in its
-- queues, the rest parked), or loses tokens down to the new limit: parked ones now, queued and
-- held ones when next taken or given back, so that a lowered limit never stops a running part.
-- KEYS[1] the group's shard's settings (hash `gconf`: name -> limit, `<name>:rate` -> rate)
-- KEYS[2] the group's meta hash
-- ARGV[1] the group's name   ARGV[2] its limit, 1 to 10000 ('' = keep it)   ARGV[3] its rate
-- limit ('' or absent = keep it; 'none' = none; else "<R>/<interval ms>": at most R of its parts
-- start per interval, across all workers; stored as `<name>:rate` in `gconf` and `rate` in the meta)
-- Returns {tokens added, tokens retired now}.
local function group_set(keys, args)
  local name = args[1]
  if name == nil or name == '' then return redis.error_reply('SGINVALID a group needs a name') end
  local invalid = sg_check_group(name)
  if invalid then return invalid end
  local gkey = keys[2]
  local limit = tonumber(args[2])
  if args[2] == '' then
    limit = tonumber(redis.call('HGET', gkey, 'limit') or redis.call('HGET', keys[1], name) or SG_GROUP_DEFAULT_LIMIT)
  elseif not limit or limit < 1 or limit > 10000 or limit % 1 ~= 0 then
    return redis.error_reply('SGINVALID a group limit must be an integer from 1 to 10000')
  end
  local rate = args[3] or ''
  if rate ~= '' and rate ~= 'none' then
    rate, invalid = sg_check_rate(rate)
    if invalid then return invalid end
  end
  if args[2] ~= '' then redis.call('HSET', keys[1], name, limit) end
  local exists = redis.call('HEXISTS', gkey, 'limit') == 1
  if rate == 'none' then
    redis.call('HDEL', keys[1], name .. ':rate')
    if exists then redis.call('HDEL', gkey, 'rate', 'tat') end
  elseif rate ~= '' then
    redis.call('HSET', keys[1], name .. ':rate', rate)
    if exists then redis.call('HSET', gkey, 'rate', rate) end
  end
  if not exists then return {0, 0} end
  local now = sg_now()
  local shard = sg_group_parts(gkey)
  local m = redis.call('HMGET', gkey, 'ntok', 'maxep', 'nlive')
  local ntok, epoch, nlive = tonumber(m[1]), m[2], tonumber(m[3])
  redis.call('HSET', gkey, 'limit', limit)
  local added, retired = 0, 0
  if nlive > limit then
    sg_each_token({gkey}, 0, ntok, function(k, tok)
      if nlive > limit and string.sub(tok, 1, 2) == 'p|' then
        sg_group_retire(gkey, k)
        nlive = nlive - 1
        retired = retired + 1
      end
    end)
  end
  if nlive < limit then
    local waiting = 0
    for _, p in ipairs(redis.call('ZRANGE', gkey .. ':w', 0, -1)) do
      waiting = waiting + redis.call('LLEN', gkey .. ':p:' .. p)
    end
    local top = sg_group_top(gkey, sg_group_paused(shard))
    local k = 0
    while nlive < limit do
      if redis.call('HEXISTS', gkey, 't' .. k) == 0 then
        added, nlive = added + 1, nlive + 1
        redis.call('HINCRBY', gkey, 'nlive', 1)
        if top and waiting > 0 then
          waiting = waiting - 1
          sg_group_queue(gkey, k, epoch, top, now)
        else
          redis.call('HSET', gkey, 't' .. k, 'p|' .. sg_next_epoch(epoch, now))
          redis.call('HINCRBY', gkey, 'npark', 1)
        end
        ntok = math.max(ntok, k + 1)
      end
      k = k + 1
    end
    redis.call('HSET', gkey, 'ntok', ntok)
  end
  redis.call('PERSIST', gkey)
  sg_group_idle_check(gkey)
  return {added, retired}
end
