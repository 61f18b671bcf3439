-- prelude.lua: helpers shared by every sluicegate function.
--
-- The library is assembled as: the `#!lua name=...` header, this prelude, every transition file in
-- lua/ (each defines one local function), then one redis.register_function per transition
-- (see docs/protocol.md, "Functions library"). Nothing here touches a key it was not given.
--
-- Token state, one hash field `t<k>` per token k in the request's meta hash:
--   q|<epoch>|<since ms>                      queued: a list element "<rid>|<k>|<epoch>" should exist
--   h|<epoch>|<holder>|<expiry ms>|<ids>     held by a worker slot, leased until expiry, with the
--                                             batch of entries "id,id,..." it was handed
--   p|<epoch>                                  parked: the request had no work to hand out
-- Only the element whose epoch matches the field is valid; every re-queue bumps the epoch, so a copy
-- of an older element (replayed pop, late push, duplicate restore) is refused when presented.

local function sg_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function sg_split(s)
  local out = {}
  for part in string.gmatch(s .. '|', '([^|]*)|') do out[#out + 1] = part end
  return out
end

-- Entry ids are "0-<index + 1>": the sub-request index is the sequence number minus one.
local function sg_index(entry_id)
  return tonumber(string.match(entry_id, '^0%-(%d+)$')) - 1
end

local function sg_element(rid, k, epoch)
  return rid .. '|' .. k .. '|' .. epoch
end

-- Every request-side function (all but renew) takes the same six keys, all with the request's
-- hash tag:
--   keys[1] meta hash   keys[2] parts stream   keys[3] results hash   keys[4] errors hash
--   keys[5] orphans list (entries whose holder lost its lease)   keys[6] retry sorted set (due ms)
-- The meta field `extra` counts the entries in orphans and retry, so that the hot path (ack)
-- looks at them only when there are any.

-- Delivers one specific pending entry to this consumer: {id, payload, attempt} or nil when the
-- entry no longer exists. The delivery count that XCLAIM raises is the attempt number.
local function sg_claim(keys, consumer, id)
  local claimed = redis.call('XCLAIM', keys[2], 'g', consumer, 0, id)
  local entry = claimed[1]
  if not entry or not entry[2] then return nil end
  local pending = redis.call('XPENDING', keys[2], 'g', id, id, 1)
  local attempt = 1
  if pending[1] then attempt = tonumber(pending[1][4]) end
  return {entry[1], entry[2][2], attempt}
end

-- Splits a held token's entry list "id,id,..." (empty string: none).
local function sg_ids(list)
  local out = {}
  for id in string.gmatch(list, '[^,]+') do out[#out + 1] = id end
  return out
end

-- Up to `want` pieces of work for a token holder: orphaned entries first (their holder died),
-- then retries that are due, then new entries. `extra` is the meta field of that name (or nil).
-- Returns a list of {id, payload, attempt}.
local function sg_take_work(keys, consumer, now, extra, want)
  want = math.max(want or 1, 1)
  local got = {}
  if extra and tonumber(extra) > 0 then
    while #got < want do
      local id = redis.call('LPOP', keys[5])
      if not id then break end
      redis.call('HINCRBY', keys[1], 'extra', -1)
      got[#got + 1] = sg_claim(keys, consumer, id)
    end
    while #got < want do
      local due = redis.call('ZRANGEBYSCORE', keys[6], '-inf', now, 'LIMIT', 0, 1)
      if not due[1] then break end
      redis.call('ZREM', keys[6], due[1])
      redis.call('HINCRBY', keys[1], 'extra', -1)
      got[#got + 1] = sg_claim(keys, consumer, due[1])
    end
  end
  if #got < want then
    local reply = redis.call('XREADGROUP', 'GROUP', 'g', consumer, 'COUNT', want - #got, 'STREAMS', keys[2], '>')
    if reply and reply[1] then
      for _, entry in ipairs(reply[1][2]) do got[#got + 1] = {entry[1], entry[2][2], 1} end
    end
  end
  return got
end

-- Hands the token's holder its next batch of up to `want` sub-requests (run one after another
-- under the one token), or parks the token when there is none.
-- Returns {'run', {entry id, index, payload, attempt}, ...} or {'park'}.
local function sg_next(keys, rid, k, epoch, holder, consumer, lease_ms, now, extra, want)
  local work = sg_take_work(keys, consumer, now, extra, want)
  if #work > 0 then
    local ids = {}
    local reply = {'run'}
    for i, w in ipairs(work) do
      ids[i] = w[1]
      reply[i + 1] = {w[1], sg_index(w[1]), w[2], w[3]}
    end
    redis.call('HSET', keys[1], 't' .. k,
      'h|' .. epoch .. '|' .. holder .. '|' .. (now + lease_ms) .. '|' .. table.concat(ids, ','))
    return reply
  end
  redis.call('HSET', keys[1], 't' .. k, 'p|' .. epoch)
  return {'park'}
end

-- An entry whose holder is gone goes back to the front of the work (sg_take_work).
local function sg_orphan(keys, entry)
  redis.call('RPUSH', keys[5], entry)
  redis.call('HINCRBY', keys[1], 'extra', 1)
end

-- Puts token k back in circulation under a new epoch; returns the element to push.
local function sg_requeue(keys, rid, k, epoch, now)
  local next_epoch = tonumber(epoch) + 1
  redis.call('HSET', keys[1], 't' .. k, 'q|' .. next_epoch .. '|' .. now)
  return sg_element(rid, k, next_epoch)
end

-- Turns a request terminal: one terminal record (the meta hash's state), one event, cleanup.
-- Returns the reply for the caller, whose 3rd and later items are the still-queued token elements
-- for the token side to sweep from the priority list. A failed request keeps its stream and
-- retry set (its dead letters) until the retention ends, so that they can be requeued.
-- A finished request's keys are held for its retention plus this long until `seal` (run once
-- its event is recorded on the token side) starts the retention proper; the hold only matters
-- when nothing reaches Redis to seal it, and bounds what such a request leaves behind.
local SG_FINISH_HOLD_MS = 3600000

-- The request keys a finished request keeps (by index into keys): a failed one keeps its stream,
-- orphans and retry set (its dead letters stay requeueable); the others are deleted at the finish.
local function sg_kept(state)
  if state == 'failed' then return {1, 2, 3, 4, 5, 6} end
  return {1, 3, 4}
end

local function sg_finish(keys, rid, state, retention_ms, channel, now)
  local ntok = tonumber(redis.call('HGET', keys[1], 'ntok') or '0')
  local sweep = {}
  for k = 0, ntok - 1 do
    local tok = redis.call('HGET', keys[1], 't' .. k)
    if tok then
      local f = sg_split(tok)
      if f[1] == 'q' then sweep[#sweep + 1] = sg_element(rid, k, f[2]) end
      -- A failed request may be requeued: entries other slots still held (fail fast) become
      -- orphans, handed out again if it is.
      if f[1] == 'h' and state == 'failed' then
        for _, id in ipairs(sg_ids(f[5])) do sg_orphan(keys, id) end
      end
      redis.call('HDEL', keys[1], 't' .. k)
    end
  end
  if state ~= 'failed' then
    -- Dead letters (pending entries parked in the retry set at +inf), orphans and the parts that
    -- never ran stay requeueable while a failed request is kept; otherwise they go now.
    redis.call('DEL', keys[2], keys[5], keys[6])
  end
  redis.call('HSET', keys[1], 'state', state, 'finished', now)
  local hold = tonumber(retention_ms) + SG_FINISH_HOLD_MS
  for _, i in ipairs(sg_kept(state)) do redis.call('PEXPIRE', keys[i], hold) end
  redis.call('PUBLISH', channel, rid .. '|' .. state)
  -- The lifecycle (`gen`, bumped when a failed request is reopened) names this finish in the
  -- token-side steps that follow (finish_index, seal, unindex).
  local out = {'finished', state, redis.call('HGET', keys[1], 'gen') or '0'}
  for _, e in ipairs(sweep) do out[#out + 1] = e end
  return out
end
