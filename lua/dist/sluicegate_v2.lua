#!lua name=sluicegate_v2

-- prelude.lua: helpers shared by every sluicegate function.
--
-- The library is assembled as: the `#!lua name=...` header, this prelude, every transition file in
-- lua/ (each defines one local function), then one redis.register_function per transition
-- (see docs/protocol.md, "Functions library"). Nothing here touches a key it was not given.
--
-- Token state, one hash field `t<k>` per token k in the request's meta hash:
--   q|<epoch>|<since ms>             queued: an element "<rid>|<k>|<epoch>" should be in its list
--   h|<epoch>|<holder>|<since>|<ids> held by a worker slot (holder "<worker>/<slot>") since <since>,
--                                    with the batch of entries "id,id,..." it was handed
--   p|<epoch>                        parked: the request had no work to hand out
-- Only the element whose epoch matches the field is valid; every re-queue gives the token a new,
-- larger epoch, so a copy of an older element (a replayed take, a late push, a duplicate restore)
-- is refused when presented. An epoch is the Redis time (ms) at which it was issued, or one more
-- than the token's previous epoch if that is larger: epochs only grow, also across a request's
-- lifecycles and across requests that reuse an id. Because elements are pushed at the head of a
-- list and taken from its tail, and each is pushed just after its epoch is issued, the epoch of the
-- tail element also says how far the list has moved on (see `verify`).
-- A holder keeps its token while its worker is alive: the worker registry (`beat`) decides, not a
-- per-token expiry. A dead worker's tokens are found through the `held` record its slot wrote when
-- it took the token (`take`), and reclaimed (`reclaim`).

-- The functions' clock, in ms, from a reply of TIME. The test builds of the library replace its
-- one line (src/protocol/library.rs): every reading of the clock goes through it.
local function sg_ms(t)
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function sg_now()
  return sg_ms(redis.call('TIME'))
end

-- A whole number as text, without the exponent notation Lua uses for large ones (lifecycles are
-- 16 digits: created ms * 1000 + gen, exact in a double). Below 1e14 Lua's own conversion
-- (`%.14g`, made by a concatenation: no function call) already writes every digit, and costs
-- less than string.format's.
local function sg_int(x)
  if type(x) == 'number' and x < 1e14 and x > -1e14 and x % 1 == 0 then return x .. '' end
  return string.format('%.0f', x)
end

-- The functions' clock as sg_now's, and the first lifecycle of a lane request submitted now:
-- the ms * 1000, plus the µs within the ms halved (0 to 499). A request submitted under the id of
-- one purged in the same ms (cancelled, purged and submitted again at once) so gets a lifecycle
-- of its own: every call between the two submits (the old one's cancel or finish, its purge, its
-- requeues, each adding 1) takes more than 2 µs. Its old parts still in the lane are then not
-- taken for its own (sg_lane_live). At least 500 requeues fit before a lifecycle's ms part, the
-- request's identity and its listing's submit ms (sg_ix_kept_at), would move.
local function sg_lane_clock()
  local t = redis.call('TIME')
  local now = sg_ms(t)
  return now, sg_int(now * 1000 + math.floor((tonumber(t[2]) % 1000) / 2))
end

-- Small whole numbers as text, remembered: Lua turns a number into text with sprintf, which
-- costs about what a Redis command does here, and the hot paths write counters, indices and
-- priorities, all small, on every call. Filled as they are first met (the library's load may not
-- call tostring), at most 1024 of them.
local SG_SMALL = {}

-- A whole number as text, as sg_int, remembered in SG_SMALL when it is from 0 to 1023.
local function sg_str(x)
  local s = SG_SMALL[x]
  if s then return s end
  s = sg_int(x)
  if type(x) == 'number' and x >= 0 and x < 1024 and x % 1 == 0 then SG_SMALL[x] = s end
  return s
end

local function sg_split(s)
  local out = {}
  for part in string.gmatch(s .. '|', '([^|]*)|') do out[#out + 1] = part end
  return out
end

-- Whether token value `tok` says it is held under `epoch` by `holder` with exactly the entries
-- `list` (their ids joined by commas): the fence of every ack. A held token's value is
-- "h|<epoch>|<holder>|<since>|<list>", four bars exactly (its only writers: sg_next,
-- sg_lane_next), so it matches when it starts with the first three fields and ends with the
-- last, with `since` between: what sg_split and a comparison of its fields would say, without
-- splitting a value that grows with the batch.
local function sg_holds(tok, epoch, holder, list)
  local head, tail = 'h|' .. epoch .. '|' .. holder .. '|', '|' .. list
  return #tok > #head + #tail and string.sub(tok, 1, #head) == head and string.sub(tok, -#tail) == tail
end

-- The hand-out ms of a held token's batch (its value "h|<epoch>|<holder>|<since>|<ids>").
local function sg_held_since(tok)
  return string.match(tok, '^h|[^|]*|[^|]*|(%d+)|')
end

-- The indices of entry ids "0-1" to "0-1024", remembered as they are first met (sg_index).
local SG_INDEX = {}

-- Entry ids are "0-<index + 1>": the sub-request index is the sequence number minus one. Every
-- id given here was made by the library's own XADDs (read back from Redis, or fenced against a
-- token's list of them), so its digits start at the third character (a cut is cheaper than a
-- pattern, on the path of every part). Turning text into a number costs about what a Redis
-- command does here, so small indices are remembered (the ids are interned strings: a lookup
-- is cheap).
local function sg_index(entry_id)
  local i = SG_INDEX[entry_id]
  if i then return i end
  i = tonumber(string.sub(entry_id, 3)) - 1
  if i < 1024 then SG_INDEX[entry_id] = i end
  return i
end

local function sg_element(rid, k, epoch)
  return rid .. '|' .. k .. '|' .. epoch
end

-- The next epoch of a token whose epoch was `epoch` (nil: a new token).
local function sg_next_epoch(epoch, now)
  if epoch and tonumber(epoch) >= now then return tonumber(epoch) + 1 end
  return now
end

-- Calls `fn(k, value)` for every token field t<from> .. t<to-1> that exists, reading them in chunks
-- (one HMGET per 500 tokens), so that a request with a large limit costs few calls.
local function sg_each_token(keys, from, to, fn)
  local k = from
  while k < to do
    local last = math.min(k + 500, to) - 1
    local fields = {}
    for i = k, last do fields[#fields + 1] = 't' .. i end
    local values = redis.call('HMGET', keys[1], unpack(fields))
    for i = k, last do
      local v = values[i - k + 1]
      if v then fn(i, v) end
    end
    k = last + 1
  end
end

-- Runs `command key args...` over a long argument list in chunks of 1,000 (Lua's unpack has a
-- limit on arguments); the chunks must stay whole pairs for HSET (1,000 is even).
local function sg_chunked(command, key, list)
  local i = 1
  while i <= #list do
    local last = math.min(i + 999, #list)
    redis.call(command, key, unpack(list, i, last))
    i = last + 1
  end
end

-- HSETs field/value pairs in chunks.
local function sg_hset_many(key, pairs_list) sg_chunked('HSET', key, pairs_list) end

-- HDELs fields in chunks.
local function sg_hdel_many(key, fields) sg_chunked('HDEL', key, fields) end

-- Checks a new request's priority and limit (numbers or nil) and that args[from..to] are whole
-- numbers of at least 0: the error reply naming the first that is not, or nil.
local function sg_check_new(prio, limit, args, from, to)
  if not prio or prio < 0 or prio > 99 or prio % 1 ~= 0 then
    return redis.error_reply('SGINVALID priority must be an integer from 0 to 99')
  end
  if not limit or limit < 1 or limit > 10000 or limit % 1 ~= 0 then
    return redis.error_reply('SGINVALID concurrency must be an integer from 1 to 10000')
  end
  for i = from, to do
    local v = tonumber(args[i])
    if not v or v < 0 or v % 1 ~= 0 then
      return redis.error_reply('SGINVALID argument ' .. i .. ' must be a whole number of at least 0')
    end
  end
  return nil
end

-- A whole request's flags, as submit_open's and lane_submit's ARGV[11] carry them: '1' for fail
-- fast ('0' or '' for not), then 'd' when its successful parts' results are not stored
-- (`discard_results`): '', '0', '1', '0d' or '1d'. Returns failfast, discard (booleans), or nil, nil
-- and the error reply.
local function sg_flags(text)
  local f, d = string.match(text or '', '^([01]?)(d?)$')
  if not f then
    return nil, nil, redis.error_reply('SGINVALID flags are 0 or 1 (fail fast), then d to discard results, not '
      .. tostring(text))
  end
  return f == '1', d == 'd'
end

-- Checks the trace context a producer passes with a new request (docs/protocol.md §4, "Trace
-- context"): nil or '' for none, else a JSON object of at most 4096 bytes, stored as it is and read
-- by no function. Its first and last bytes, '{' and '}', also tell it from a payload (a MessagePack
-- value that starts with 0x7b is that one byte), so that a client that still sends payloads in its
-- place is refused instead of losing a part. The error reply, or nil.
local function sg_check_trace(trace)
  if trace == nil or trace == '' then return nil end
  if #trace > 4096 or string.byte(trace, 1) ~= 123 or string.byte(trace, -1) ~= 125 then
    return redis.error_reply('SGINVALID a trace context is empty or a JSON object of at most 4096 bytes')
  end
  return nil
end

-- Every request-side function (all but holds) takes the same six keys, all with the request's
-- hash tag:
--   keys[1] meta hash   keys[2] parts stream   keys[3] results hash   keys[4] errors hash
--   keys[5] orphans list (entries whose holder died)   keys[6] retry sorted set (due ms)
-- The meta field `extra` counts the entries in orphans and retry, so that the hot path (ack)
-- looks at them only when there are any.

-- The lifecycle of a request: created ms * 1000 + gen (gen counts reopenings by requeue_dead).
-- It names a finish in the token-side steps that follow it (finish_index, seal, unindex) and is
-- unique across requests that reuse an id, so a later request's finish is never taken for an
-- earlier one's.
local function sg_lifecycle(keys)
  local m = redis.call('HMGET', keys[1], 'created', 'gen')
  return sg_int(tonumber(m[1] or '0') * 1000 + tonumber(m[2] or '0'))
end

-- Delivers one specific pending entry to this consumer: {id, fields, attempt} or nil when the
-- entry no longer exists (fields: the entry's field/value list; a request stream's entry has one
-- field, `p`, its payload). The delivery count that XCLAIM raises is the attempt number.
local function sg_claim(keys, consumer, id)
  local claimed = redis.call('XCLAIM', keys[2], 'g', consumer, 0, id)
  local entry = claimed[1]
  if not entry or not entry[2] then return nil end
  local pending = redis.call('XPENDING', keys[2], 'g', id, id, 1)
  local attempt = 1
  if pending[1] then attempt = tonumber(pending[1][4]) end
  return {entry[1], entry[2], attempt}
end

-- Splits a held token's entry list "id,id,..." (empty string: none).
local function sg_ids(list)
  local out = {}
  for id in string.gmatch(list, '[^,]+') do out[#out + 1] = id end
  return out
end

-- Up to `want` pieces of work for a token holder: orphaned entries first (their holder died),
-- then retries that are due, then new entries. `extra` is the meta field of that name (or nil).
-- Returns a list of {id, fields, attempt}, and where in it the new entries start (their ids
-- only grow).
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
  local fresh = #got + 1
  if #got < want then
    local reply = redis.call('XREADGROUP', 'GROUP', 'g', consumer, 'COUNT', want - #got, 'STREAMS', keys[2], '>')
    if reply and reply[1] then
      -- XREADGROUP's own {id, fields} tables, given their attempt: no new table per entry.
      for _, entry in ipairs(reply[1][2]) do
        entry[3] = 1
        got[#got + 1] = entry
      end
    end
  end
  return got, fresh
end

-- When the earliest retry that is not due yet falls due (ms), or nil: when a parked token should be
-- woken for it.
local function sg_next_retry(keys, now)
  local next = redis.call('ZRANGEBYSCORE', keys[6], '(' .. now, '(inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if next[2] then return tonumber(next[2]) end
  return nil
end

-- A request's rate limit (meta `rate` = "<R>/<interval ms>", `tat`; RequestBuilder::rate): GCRA,
-- a token bucket kept as one number. Parts are emitted every T = interval / R ms with bursts of
-- up to R: `tat` (the theoretical arrival time, ms) moves on by T per part started, and at `now`
-- k more may start while max(tat, now) + k*T <= now + tau + T, tau = (R - 1) * T. The bucket
-- refills by time alone: nothing writes it but a hand-out. Returns k (>= 0), T, max(tat, now)
-- and tau.
local function sg_rate_room(rate, tat, now)
  local r, per = string.match(rate, '^(%d+)/(%d+)$')
  local t = tonumber(per) / tonumber(r)
  local tau = (tonumber(r) - 1) * t
  local base = math.max(tonumber(tat or '0') or 0, now)
  return math.max(math.floor((now + tau + t - base) / t + 1e-9), 0), t, base, tau
end

-- A batch size as `acquire` and `ack` take it: "<n>", or "<n>|flat" for a `run` reply whose
-- entries are flat (sg_next). Returns n (nil if the text is neither) and whether flat.
local function sg_want(text)
  local n = tonumber(text)
  if n then return n, false end
  n = string.match(text or '', '^(%d+)|flat$')
  return tonumber(n), n ~= nil
end

-- Hands the token's holder its next batch of up to `want` sub-requests (run one after another
-- under the one token), or parks the token when there is none. `rate` and `tat`: the meta
-- fields of a rate-limited request (nil: none); the batch is then at most what the limit lets
-- start now, and with no room the token parks until there is.
-- Returns {'run', {entry id, index, payload, attempt}, ...} or {'park', wake}: wake is in how
-- many ms a retry falls due (0 if none is waiting), when the token should be woken for it.
-- With `flat`, a `run` reply holds each entry's id, payload and attempt in itself, three items
-- per entry, rather than an array of four: Redis turns each table of a reply into an array at a
-- cost (it looks up the fields that would make the table an error or status reply), about a
-- tenth of a part's. The index is the id's sequence number minus one (sg_index).
local function sg_next(keys, k, epoch, holder, consumer, now, extra, want, rate, tat, flat)
  local t, base
  if rate then
    local room, tau
    room, t, base, tau = sg_rate_room(rate, tat, now)
    if room < 1 then
      redis.call('HSET', keys[1], 't' .. k, 'p|' .. epoch)
      redis.call('HINCRBY', keys[1], 'npark', 1)
      return {'park', math.max(math.ceil(base - tau - now), 1)}
    end
    want = math.min(math.max(want or 1, 1), room)
  end
  local work, fresh = sg_take_work(keys, consumer, now, extra, want)
  if #work > 0 then
    if rate then redis.call('HSET', keys[1], 'tat', string.format('%.3f', base + #work * t)) end
    local ids = {}
    local reply = {'run'}
    if flat then
      for i, w in ipairs(work) do
        ids[i] = w[1]
        reply[3 * i - 1], reply[3 * i], reply[3 * i + 1] = w[1], w[2][2], w[3]
      end
      redis.call('HSET', keys[1], 't' .. k, 'h|' .. epoch .. '|' .. holder .. '|' .. now .. '|' .. table.concat(ids, ','))
      return reply
    end
    -- The new entries' ids only grow, so when the last one's index is the first one's plus
    -- their count - 1, the ones between have the indices in between: two conversions of text to
    -- a number for them instead of one each.
    local offset = nil
    if fresh < #work then
      local head = sg_index(work[fresh][1])
      if sg_index(work[#work][1]) == head + #work - fresh then offset = head - fresh end
    end
    for i, w in ipairs(work) do
      ids[i] = w[1]
      reply[i + 1] = {w[1], offset and i >= fresh and offset + i or sg_index(w[1]), w[2][2], w[3]}
    end
    redis.call('HSET', keys[1], 't' .. k, 'h|' .. epoch .. '|' .. holder .. '|' .. now .. '|' .. table.concat(ids, ','))
    return reply
  end
  redis.call('HSET', keys[1], 't' .. k, 'p|' .. epoch)
  redis.call('HINCRBY', keys[1], 'npark', 1)
  local due = sg_next_retry(keys, now)
  return {'park', due and math.max(due - now, 1) or 0}
end

-- An entry whose holder is gone goes back to the front of the work (sg_take_work).
local function sg_orphan(keys, entry)
  redis.call('RPUSH', keys[5], entry)
  redis.call('HINCRBY', keys[1], 'extra', 1)
end

-- Puts token k (epoch `epoch`) back in circulation under a new epoch; returns the element to push.
local function sg_requeue(keys, rid, k, epoch, now)
  local next_epoch = sg_next_epoch(epoch, now)
  redis.call('HSET', keys[1], 't' .. k, 'q|' .. next_epoch .. '|' .. now)
  return sg_element(rid, k, next_epoch)
end

-- Wakes up to `n` parked tokens (the meta field `npark` counts them, so this costs nothing when
-- none is parked; `parked`, if given, is its value, read by the caller). Returns the elements to
-- push.
local function sg_unpark(keys, rid, n, now, parked)
  local out = {}
  parked = parked or tonumber(redis.call('HGET', keys[1], 'npark') or '0')
  if n <= 0 or parked <= 0 then return out end
  local ntok = tonumber(redis.call('HGET', keys[1], 'ntok') or '0')
  -- Read in chunks that start at about what is wanted and grow: waking one token of an idle lane
  -- reads a few fields, not all 64 (an HMGET of 64 fields costs ten times one of 8).
  local from, chunk = 0, math.max(8, math.min(n, 500))
  while from < ntok and #out < n do
    local to = math.min(from + chunk, ntok)
    sg_each_token(keys, from, to, function(k, tok)
      if #out < n and string.sub(tok, 1, 2) == 'p|' then
        out[#out + 1] = sg_requeue(keys, rid, k, sg_split(tok)[2], now)
      end
    end)
    from, chunk = to, math.min(chunk * 4, 500)
  end
  if #out > 0 then redis.call('HINCRBY', keys[1], 'npark', -#out) end
  return out
end

-- Turns a request terminal: one terminal record (the meta hash's state), one event, cleanup.
-- Returns the reply for the caller, whose 4th and later items are the still-queued token elements
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

-- `except` (optional): a token number whose batch the caller has just recorded (the ack that
-- finishes the request); its entries are where that ack put them, not orphans.
local function sg_finish(keys, rid, state, retention_ms, channel, now, except)
  local ntok = tonumber(redis.call('HGET', keys[1], 'ntok') or '0')
  local sweep, fields = {}, {}
  local maxep = tonumber(redis.call('HGET', keys[1], 'maxep') or '0')
  sg_each_token(keys, 0, ntok, function(k, tok)
    local f = sg_split(tok)
    maxep = math.max(maxep, tonumber(f[2]))
    if f[1] == 'q' then sweep[#sweep + 1] = sg_element(rid, k, f[2]) end
    -- A failed request may be requeued: entries other slots still held (fail fast) become
    -- orphans, handed out again if it is.
    if f[1] == 'h' and state == 'failed' and k ~= except then
      for _, id in ipairs(sg_ids(f[5])) do sg_orphan(keys, id) end
    end
    fields[#fields + 1] = 't' .. k
  end)
  sg_hdel_many(keys[1], fields)
  if state ~= 'failed' then
    -- Dead letters (pending entries parked in the retry set at +inf), orphans and the parts that
    -- never ran stay requeueable while a failed request is kept; otherwise they go now.
    redis.call('DEL', keys[2], keys[5], keys[6])
  end
  redis.call('HSET', keys[1], 'state', state, 'finished', now, 'maxep', maxep, 'npark', 0)
  local hold = tonumber(retention_ms) + SG_FINISH_HOLD_MS
  for _, i in ipairs(sg_kept(state)) do redis.call('PEXPIRE', keys[i], hold) end
  redis.call('PUBLISH', channel, rid .. '|' .. state)
  local out = {'finished', state, sg_lifecycle(keys)}
  for _, e in ipairs(sweep) do out[#out + 1] = e end
  return out
end

-- A request's deadline (meta `dl`, Redis ms; RequestBuilder::deadline): whether Redis time `now`
-- has reached it. Past it no part starts; the first hand-out (acquire, ack) or census that meets it
-- finishes the request `failed` with `why` = `deadline` (sg_finish_deadline).
local function sg_past_deadline(dl, now)
  return dl ~= nil and dl ~= false and dl ~= '' and now >= tonumber(dl)
end

-- Ends a request at its deadline: `failed`, with `why` = `deadline`; the parts that never ran stay
-- in the stream and have no result. sg_finish's reply.
local function sg_finish_deadline(keys, rid, retention_ms, channel, now, except)
  redis.call('HSET', keys[1], 'why', 'deadline')
  return sg_finish(keys, rid, 'failed', retention_ms, channel, now, except)
end

-- Past its deadline a request hands out nothing, but it finishes only once no slot holds a batch
-- of it: those slots' timers cancel their handlers at the deadline and their acks come within
-- ms, so the parts done just before it keep their results instead of being fenced. A hand-out
-- (acquire, ack) past the deadline calls this with its own token k: while another token is held,
-- k parks (`p|<epoch>`) and the reply is {'park', 0}; otherwise nil, and the caller finishes the
-- request. census finishes it anyway a grace after the deadline (a holder that never acks).
local function sg_deadline_wait(keys, k, epoch)
  local ntok = tonumber(redis.call('HGET', keys[1], 'ntok') or '0')
  local held = false
  sg_each_token(keys, 0, ntok, function(i, tok)
    if i ~= tonumber(k) and string.sub(tok, 1, 2) == 'h|' then held = true end
  end)
  if not held then return nil end
  redis.call('HSET', keys[1], 't' .. k, 'p|' .. epoch)
  redis.call('HINCRBY', keys[1], 'npark', 1)
  return {'park', 0}
end

-- Dependencies between requests (docs/protocol.md §5, "Dependencies"). A downstream D is
-- submitted `after` upstreams: its meta lists them in `ups` (key ids, comma-separated, in the
-- order given) and keeps one field per upstream U, `u:<ukid>`:
--   w|<lc>            U has not ended; lc: U's lifecycle when D linked (its created ms * 1000 + gen)
--   c|<lc>            U's lifecycle lc completed
--   f|<lc>|<state>    U's lifecycle lc ended otherwise: failed, cancelled, or gone
-- `upw` counts the w fields and `upf` the f ones, both changed only with a field, in the same call,
-- so they never drift; `onup` is D's policy for a failed upstream: 'fail' (D ends failed, `why`
-- = `upstream:<ukid>`) or 'run' (any end of U counts). U's lifecycle tells a later request of the
-- same id (another created) from U: it is never taken for U. A D whose gate is closed waits in
-- state `waiting`, its tokens parked; its upstreams' releases (dag_settle) open it.
-- U's side, on U's home shard: the set `dn:<ukid>` names its downstreams ("<dkid>|<D's token
-- shards>"), a lane record's field `dn` says it has some, and the sorted set `rel` (the release
-- outbox) holds U's key id from its finish until every downstream heard of it (rel_done).

-- How long after a finish recovery first runs the release the finisher owes (ms): the finisher
-- runs it at once, and recovery (claim_due) only if it has not answered by then.
local SG_REL_DELAY_MS = 10000
-- How often recovery looks at a waiting request (ms): its releases come from its upstreams' side,
-- and this look only checks that no upstream vanished without one.
local SG_WAITING_LOOK_MS = 3600000

-- A key of the shard `shard_key` belongs to ("<ns>:{<ns>.q<s>}:<name>"), named `name`.
local function sg_shard_key(shard_key, name)
  return string.match(shard_key, '^(.*:)[^:]*$') .. name
end

-- A field `u:<ukid>` as {status, lc, state}, or nil.
local function sg_dag_field(v)
  if not v then return nil end
  local f = sg_split(v)
  return {f[1], tonumber(f[2]), f[3]}
end

-- Writes D's field for U as `status|lc[|state]` and keeps `upw`/`upf` in step with the change.
local function sg_dag_set(keys, ukid, old, status, lc, state)
  local v = status .. '|' .. sg_int(lc)
  if status == 'f' then v = v .. '|' .. state end
  redis.call('HSET', keys[1], 'u:' .. ukid, v)
  local dw, df = 0, 0
  if old and old[1] == 'w' then dw = dw - 1 end
  if old and old[1] == 'f' then df = df - 1 end
  if status == 'w' then dw = dw + 1 end
  if status == 'f' then df = df + 1 end
  if dw ~= 0 then redis.call('HINCRBY', keys[1], 'upw', dw) end
  if df ~= 0 then redis.call('HINCRBY', keys[1], 'upf', df) end
end

-- Whether news of U's lifecycle `lc` (status c or f) is newer than D's field `old` for U: same U
-- (the created ms of both lifecycles agree) and a later lifecycle, or the end of the one D waits on.
local function sg_dag_newer(old, lc)
  if not old then return true end
  if math.floor(old[2] / 1000) ~= math.floor(lc / 1000) then return false end
  return lc > old[2] or (lc == old[2] and old[1] == 'w')
end

-- What D's gate says, from its counters: 'fail' (an upstream failed and D's policy is 'fail'),
-- 'wait' (an upstream has not ended), or 'open'.
local function sg_dag_gate(m_upw, m_upf, onup)
  if tonumber(m_upf or '0') > 0 and onup ~= 'run' then return 'fail' end
  if tonumber(m_upw or '0') > 0 then return 'wait' end
  return 'open'
end

-- The first upstream in `ups` whose field says it failed: the one D's `why` names.
local function sg_dag_failed_one(keys, ups)
  for ukid in string.gmatch(ups, '[^,]+') do
    local f = sg_dag_field(redis.call('HGET', keys[1], 'u:' .. ukid))
    if f and f[1] == 'f' then return ukid end
  end
  return ''
end

-- Ends D `failed` because of upstream `ukid` (its parked tokens need no sweep): sg_finish's reply.
local function sg_dag_fail(keys, rid, ukid, retention_ms, channel, now)
  redis.call('HSET', keys[1], 'why', 'upstream:' .. ukid)
  return sg_finish(keys, rid, 'failed', retention_ms, channel, now)
end

-- Opens a waiting D: `queued` (since now) with every parked token woken; returns the elements.
local function sg_dag_open(keys, rid, now)
  redis.call('HSET', keys[1], 'state', 'queued', 'queued', now)
  return sg_unpark(keys, rid, tonumber(redis.call('HGET', keys[1], 'ntok') or '0'), now)
end

-- Whether failed D can run again: it failed because of an upstream, and its gate is open now (the
-- upstream was requeued and completed). requeue_dead then reopens it although it has no dead letter.
local function sg_dag_reopenable(why, m_upw, m_upf, onup)
  return why ~= nil and why ~= false and string.sub(why, 1, 9) == 'upstream:'
    and sg_dag_gate(m_upw, m_upf, onup) == 'open'
end

-- A new request's rate limit, "<R>/<interval ms>" (R from 1 to 1,000,000, the interval from 1 ms
-- to a day; '' or absent: none): the value to store, or nil and the error reply.
local function sg_check_rate(rate)
  if rate == nil or rate == '' then return '', nil end
  local r, per = string.match(rate, '^(%d+)/(%d+)$')
  r, per = tonumber(r), tonumber(per)
  if not r or r < 1 or r > 1000000 or per < 1 or per > 86400000 then
    return nil, redis.error_reply('SGINVALID a rate is <R>/<interval ms>: R from 1 to 1000000, the interval from 1 ms to a day')
  end
  return r .. '/' .. per, nil
end

-- The ms a new request's deadline leaves (a whole number of at least 1 and at most ten years; ''
-- or 0: none), or nil and the error reply.
local SG_MAX_DEADLINE_MS = 10 * 365 * 24 * 3600 * 1000
local function sg_check_deadline(ms)
  if ms == nil or ms == '' or ms == '0' then return 0, nil end
  local v = tonumber(ms)
  if not v or v < 1 or v % 1 ~= 0 or v > SG_MAX_DEADLINE_MS then
    return nil, redis.error_reply('SGINVALID deadline must be a whole number of ms from 1 to ten years ahead')
  end
  return v, nil
end

-- Whether Redis time `now` is past a submit's deadline (ARGV given as ms; '' or absent: none).
local function sg_late(deadline, now)
  return deadline and deadline ~= '' and tonumber(deadline) > 0 and now > tonumber(deadline)
end

-- The refusal of a step that runs past the deadline its caller's arm gave it (Redis time, ms; 0 or
-- absent: none): recovery's look, armed for the step, may have come and gone before it, and the
-- caller arms again and retries (shards::armed). Nil when the step is in time.
local function sg_step_late(deadline)
  if sg_late(deadline, sg_now()) then
    return redis.error_reply('SGLATE the step came after its deadline ' .. deadline .. '; arm again and retry')
  end
  return nil
end

-- The LMPOP command over one shard's priority lists, highest first down to `floor` (0: all), from
-- their common prefix: built once per prefix and floor and kept (a library's local state lasts
-- until it is loaded again), at most SG_LMPOP_KEPT of them (namespaces times shards times the
-- floors of reserved slots) at a time.
local SG_LMPOP_KEPT = 256
local sg_lmpop_kept, sg_lmpop_count = {}, 0
local function sg_lmpop_lists(prefix, floor)
  local kept = floor == 0 and prefix or prefix .. '|' .. floor
  local command = sg_lmpop_kept[kept]
  if command then return command end
  command = {'LMPOP', tostring(100 - floor)}
  for p = 99, floor, -1 do command[#command + 1] = prefix .. p end
  command[#command + 1] = 'RIGHT'
  if sg_lmpop_count >= SG_LMPOP_KEPT then sg_lmpop_kept, sg_lmpop_count = {}, 0 end
  sg_lmpop_kept[kept] = command
  sg_lmpop_count = sg_lmpop_count + 1
  return command
end

-- The same LMPOP without the priorities an operator paused (`paused`: priority text -> true);
-- nil when every priority from `floor` up is paused. Built for each call: pauses are rare and
-- short-lived.
local function sg_lmpop_unpaused(prefix, paused, floor)
  local command = {'LMPOP', 0}
  for p = 99, floor, -1 do
    if not paused[tostring(p)] then command[#command + 1] = prefix .. p end
  end
  if #command == 2 then return nil end
  command[2] = tostring(#command - 2)
  command[#command + 1] = 'RIGHT'
  return command
end

-- How long a shard's take records outlive the last take: a record is the fast way to a dead slot's
-- token; one that expired (a hold of over a week whose worker then died, or a namespace whose
-- workers all died) leaves it to recovery's census, which finds tokens held by gone workers, and
-- to its audit of group tokens (group_audit). A week: a tenant group's token is given back when
-- its record ends, so a record must outlive any hold of a live slot. (The TTLs are text: Redis 7.0
-- formats a Lua number argument as a double, which costs more than a small command does;
-- bench/lua-costs.sh.)
local SG_HELD_TTL_MS = '604800000'

-- How long a shard's bell outlives its last push: bells are only wake-ups (an idle slot also
-- takes after each idle poll), so one that is lost only delays a take, and one too many only wakes
-- a slot for nothing; the expiry keeps strays from lasting.
local SG_BELL_TTL_MS = '600000'

-- Pushes onto a group's queue instead (defined in "Tenant groups" below: it pushes the group's
-- tokens, not the request's, onto the shard's lists).
local sg_group_push

-- Hand-offs. A reserved slot (`WorkerBuilder::reserve`) whose take found nothing at or above its
-- floor offers to be handed the next token of such a priority; so does a worker's standby slot
-- (one idle unreserved slot per worker at a time), with floor 0: any priority. Its take registers
-- it in the shard's `wait` hash (holder -> "<floor>|<take id>|<consumer>|<batch>|<until ms>") and
-- it blocks on its hand list `<shard>hand:<holder>` (a standby on the shard's bell too).
-- `lane_submit` of a request of priority p >= floor then does, for the lane token it wakes, what
-- that slot's next take (with the registered take id) would: the held record, and `lane_acquire`
-- for the slot's consumer, and pushes the reply the take would have given (MessagePack) onto the
-- hand list instead of the element onto the priority list: the slot's blocked pop returns in the
-- step that submitted, one round trip fewer than a take after a bell or an announcement. `push`
-- (given `held` and `wait`) does the same for a request of its own keys, without a batch: that
-- request lives in another slot, and the handed slot acquires the token itself (sg_hand). The
-- token is held (a record; for a lane's, entries pending under the slot's consumer) before the
-- message leaves, so a lost message loses nothing: the slot's next take, with that id, gets the
-- element as a re-sent take does (take.lua), and `lane_acquire` the same entries; a slot that died
-- is reclaimed from its record as any, and one that stops undoes it (`untake`). An offer ends with the slot's next take (or `untake` at its stop), with the
-- hand-off, or at its `until`, past which it is passed over (a worker that died without ending it).
-- The `wait` hash lasts as long as its longest offer, and a hand list as long as its slot's offer:
-- what a worker that died while it offered leaves goes soon after (a token handed to it is in its
-- held record, which recovery reclaims; its message is only a shortcut).
local function sg_hand_offer(shard, holder, floor, take, consumer, want, now, lasts)
  local wait = shard .. 'wait'
  redis.call('HSET', wait, holder, floor .. '|' .. take .. '|' .. consumer .. '|' .. want .. '|' .. (now + lasts))
  if redis.call('PTTL', wait) < lasts then redis.call('PEXPIRE', wait, lasts) end
  redis.call('DEL', shard .. 'hand:' .. holder)
end

-- The offers on `shard` of slots whose floor is at most `priority`, best first ({holder,
-- fields}, fields as sg_split gives them), ending those past their `until` on the way.
local function sg_hand_offers(shard, priority, now)
  local all = redis.call('HGETALL', shard .. 'wait')
  local out = {}
  for i = 1, #all, 2 do
    local f = sg_split(all[i + 1])
    if tonumber(f[5]) < now then
      redis.call('HDEL', shard .. 'wait', all[i])
    elseif tonumber(f[1]) <= priority then
      out[#out + 1] = {all[i], f}
    end
  end
  -- The highest floor first: a slot kept for lower floors stays for what only it covers.
  table.sort(out, function(a, b) return tonumber(a[2][1]) > tonumber(b[2][1]) end)
  return out
end

-- Hands token elements of priority `prio`, `elements[from..]` from the first on, to the slots that
-- offered to take that priority (`offers`: the shard's `wait` hash), one each: what each slot's
-- next take (under the id it offered) would do with the element taken from `list`. The held record
-- (`held`) first, then `message(holder, fields, element)`, the reply that take would have given, packed
-- onto the slot's hand list. Stops at the first element it cannot hand: no offer left, or a group
-- token (its take pops the group's queue). Nothing is handed while an operator pauses the priority.
-- Returns how many elements it handed; the caller pushes the rest.
local function sg_hand(offers, held, prio, list, elements, from, now, message)
  if from > #elements or redis.call('EXISTS', offers) == 0 then return 0 end
  local shard = sg_shard_key(offers, '')
  -- (Paused, by an operator: the token waits on its list, where no slot takes it until resumed.)
  local paused = redis.call('HMGET', shard .. 'paused', 'all', sg_str(prio))
  if paused[1] or paused[2] then return 0 end
  local all = sg_hand_offers(shard, prio, now)
  local next, i = 1, from
  while i <= #elements and string.byte(elements[i], 1) ~= 94 do
    local offer = all[next]
    -- (A slot that offers holds nothing on the shard: its take ended its record. One that does is
    -- passed over, its offer ended.)
    while offer and redis.call('HEXISTS', held, offer[1]) == 1 do
      redis.call('HDEL', offers, offer[1])
      next = next + 1
      offer = all[next]
    end
    if not offer then break end
    next = next + 1
    local holder, f, element = offer[1], offer[2], elements[i]
    redis.call('HDEL', offers, holder)
    redis.call('HSET', held, holder, element .. '|' .. f[2] .. '|' .. list)
    redis.call('PEXPIRE', held, SG_HELD_TTL_MS)
    local hand = shard .. 'hand:' .. holder
    redis.call('RPUSH', hand, cmsgpack.pack(message(holder, f, element)))
    redis.call('PEXPIRE', hand, math.max(tonumber(f[5]) - now, 1))
    i = i + 1
  end
  return i - from
end

-- Announces a token list's priority on its shard's channel `<ns>:{<ns>.q<s>}:up` (below).
local function sg_announce_up(list)
  local base, priority = string.match(list, '^(.*):p:(%d+)$')
  if base then redis.call('PUBLISH', base .. ':up', priority) end
end

-- Pushes elements onto a token list, each with a wake-up on the shard's bell. The bell lets idle
-- slots block on one key and then take the highest priority with `take`. A push onto an empty list
-- is announced on the shard's channel `<ns>:{<ns>.q<s>}:up` with the list's priority: busy slots
-- holding a lower priority give their token back at the end of their batch (one per worker), so a
-- newly waiting higher priority does not wait for their quantum to run out.
local function sg_push(list, bell, elements, from)
  if string.find(list, ':grp:', 1, true) then return sg_group_push(list, elements, from or 1) end
  local i, n = from or 1, 0
  while i <= #elements do
    local last = math.min(i + 999, #elements)
    local len = redis.call('LPUSH', list, unpack(elements, i, last))
    if n == 0 and len == last - i + 1 then sg_announce_up(list) end
    local bells = {}
    for b = i, last do bells[#bells + 1] = '1' end
    redis.call('LPUSH', bell, unpack(bells))
    n = n + last - i + 1
    i = last + 1
  end
  if n > 0 then redis.call('PEXPIRE', bell, SG_BELL_TTL_MS) end
  return n
end

-- The epoch in an element "<rid>|<k>|<epoch>" (nil if malformed).
local function sg_element_epoch(element)
  local epoch = string.match(element or '', '^[^|]*|[^|]*|(%d+)$')
  return epoch and tonumber(epoch)
end

-- Removes stale elements (of a finished request's queued tokens) from a list, with the bell of
-- each: at most 64 of them, each only if it is within the 1,000 elements nearest the head, so that
-- the cost is bounded however long the list and however many tokens the request had. The others
-- stay until a slot takes them, when acquire answers 'drop' (the request is finished).
local SG_SWEEP_MAX = 64

local function sg_sweep(list, bell, elements, from)
  from = from or 1
  for i = from, math.min(#elements, from + SG_SWEEP_MAX - 1) do
    if redis.call('LPOS', list, elements[i], 'MAXLEN', 1000) then
      redis.call('LREM', list, 1, elements[i])
      -- (A group's queue has no bells: its tokens' elements brought them.)
      if not string.find(list, ':grp:', 1, true) then redis.call('RPOP', bell) end
    end
  end
end

-- Tenant groups (docs/protocol.md §5, "Groups"). A request submitted in group G (meta `grp`) has
-- all its tokens on G's shard, and its token elements wait in G's queues, one list per priority,
-- `<shard>grp:<G>:p:<P>` (and the sorted set `<shard>grp:<G>:w` names the priorities that may
-- have some), never on the shard's lists. What waits on the shard's lists instead is G's own
-- tokens: G has `limit` of them, in its meta hash `<shard>grp:<G>`, fields `t<k>` as a request's:
--   q|<epoch>|<since>|<P>      queued: the element "^<G>|<k>|<epoch>" is on the shard's list of P
--   h|<epoch>|<holder>|<since> held by the slot whose take record names it
--   p|<epoch>                  parked: G had no work
--   r|<epoch>                  waiting for G's rate limit to refill: in the shard's sorted set
--                              `gwake` as "<G>|<k>|<epoch>", scored when (ms); the first take on
--                              the shard after that queues it again (sg_group_wake); `nwait`
--                              counts them
-- A slot that takes a group token pops G's highest-priority request element in the same call, and
-- its take record names both; the group token goes back in the step that ends the record (give
-- back, release, untake, the slot's next take, recovery's reclaim of a dead slot's record), so at
-- most `limit` of G's request tokens are held at once, and the count cannot drift: nothing counts,
-- every token is a field with one holder. Within a priority the shard's list is first in, first
-- out, so groups take turns, each through its own tokens, however many requests each has queued.
-- Other fields: `limit`, `ntok` (token fields are t0 .. t<ntok-1>; retired ones are gone),
-- `nlive` (how many exist), `npark`, `floor` (no queued token sits below this priority), and
-- with a rate limit `rate` ("<R>/<interval ms>") and `tat`, a GCRA bucket as a request's
-- (sg_rate_room): a take of a rate-limited group's token starts one part only (its reply says
-- 'one'), charged to the bucket, so that at most R of the group's parts start per interval across
-- all workers. The shard's hash `gconf` holds what operators set (group_set): `<G>` its limit,
-- `<G>:rate` its rate; its set `groups` names the groups with a meta hash. A group whose tokens
-- are all parked expires after a day idle.

-- A group's limit when no operator set one (Admin::set_group).
local SG_GROUP_DEFAULT_LIMIT = 10
local SG_GROUP_IDLE_MS = 86400000
-- `floor` when no token of the group is queued.
local SG_GROUP_NO_FLOOR = 100

-- Checks a group name: '' or nil for none, else 1 to 64 of [A-Za-z0-9._-]. The error reply, or nil.
local function sg_check_group(name)
  if name == nil or name == '' then return nil end
  if #name > 64 or not string.match(name, '^[%w._%-]+$') then
    return redis.error_reply('SGINVALID a group name is 1 to 64 letters, digits, dots, underscores or hyphens')
  end
  return nil
end

-- A group's meta key, from its shard's key prefix ("<ns>:{<ns>.q<s>}:") and name.
local function sg_group_key(shard, name) return shard .. 'grp:' .. name end

-- A group queue's group meta key and priority (nil if `list` is not a group queue).
local function sg_group_of_queue(list)
  return string.match(list, '^(.*:grp:[^:]+):p:(%d+)$')
end

-- The shard's key prefix and the group's name, from its meta key.
local function sg_group_parts(gkey)
  return string.match(gkey, '^(.*:)grp:([^:]+)$')
end

-- The shard's pauses (`Admin::pause`) as priority text -> true ('all' for the namespace), or nil.
local function sg_group_paused(shard)
  local pauses = redis.call('HGETALL', shard .. 'paused')
  if #pauses == 0 then return nil end
  local paused = {}
  for i = 1, #pauses, 2 do paused[pauses[i]] = true end
  return paused
end

-- Whether priority p (a number) is paused in `paused` (sg_group_paused's).
local function sg_group_is_paused(paused, p)
  return paused ~= nil and (paused['all'] or paused[tostring(p)]) and true or false
end

-- The priority a group's token should wait at: its highest priority with work waiting that is not
-- paused, else its highest with work (the token then waits on that paused list until it is
-- resumed); nil when it has no work. Priorities whose queue has emptied leave `w`.
local function sg_group_top(gkey, paused)
  local first_paused = nil
  for _, p in ipairs(redis.call('ZREVRANGE', gkey .. ':w', 0, -1)) do
    if redis.call('LLEN', gkey .. ':p:' .. p) > 0 then
      if not sg_group_is_paused(paused, p) then return tonumber(p) end
      first_paused = first_paused or tonumber(p)
    else
      redis.call('ZREM', gkey .. ':w', p)
    end
  end
  return first_paused
end

-- Names group `name` in the shard's set `groups` (recovery's audit reads it), which outlives its
-- last such call by twice a group's idle expiry: every wake of a parked token and every return of
-- a token to work names the group again.
local function sg_group_listed(shard, name)
  redis.call('SADD', shard .. 'groups', name)
  redis.call('PEXPIRE', shard .. 'groups', 2 * SG_GROUP_IDLE_MS)
end

-- Puts a group token in the shard's `gwake` (member "<G>|<k>|<epoch>") until `due` (ms). The set
-- outlives its last entry by twice a group's idle expiry, as `groups` does: with no take on the
-- shard to wake them (no worker running), its entries would otherwise stay for good.
local function sg_group_wait(shard, due, member)
  redis.call('ZADD', shard .. 'gwake', due, member)
  redis.call('PEXPIRE', shard .. 'gwake', 2 * SG_GROUP_IDLE_MS)
end

-- Makes a group's meta the first time work is queued in it: `limit` tokens, all parked.
local function sg_group_open(gkey, now)
  if redis.call('HEXISTS', gkey, 'limit') == 1 then return end
  local shard, name = sg_group_parts(gkey)
  local conf = redis.call('HMGET', shard .. 'gconf', name, name .. ':rate')
  local limit = tonumber(conf[1] or SG_GROUP_DEFAULT_LIMIT)
  local fields = {'limit', limit, 'ntok', limit, 'nlive', limit, 'npark', limit, 'floor', SG_GROUP_NO_FLOOR}
  if conf[2] then
    fields[#fields + 1] = 'rate'
    fields[#fields + 1] = conf[2]
  end
  for k = 0, limit - 1 do
    fields[#fields + 1] = 't' .. k
    fields[#fields + 1] = 'p|' .. now
  end
  sg_hset_many(gkey, fields)
  sg_group_listed(shard, name)
end

-- Queues group token k (whose epoch was `epoch`) on the shard's list of priority p, under a new
-- epoch; `floor` follows.
local function sg_group_queue(gkey, k, epoch, p, now)
  local next_epoch = sg_next_epoch(epoch, now)
  redis.call('HSET', gkey, 't' .. k, 'q|' .. next_epoch .. '|' .. now .. '|' .. p)
  local floor = tonumber(redis.call('HGET', gkey, 'floor') or SG_GROUP_NO_FLOOR)
  if p < floor then redis.call('HSET', gkey, 'floor', p) end
  local shard, name = sg_group_parts(gkey)
  sg_push(shard .. 'p:' .. p, shard .. 'bell', {'^' .. name .. '|' .. k .. '|' .. next_epoch})
end

-- A group whose tokens are all parked, or waiting for its rate limit's refill with no work queued
-- (`nwait` counts those waiting), holds nothing and has nothing queued: it expires if it stays so
-- for SG_GROUP_IDLE_MS (a take on the shard after the refill parks the waiting ones; with no
-- worker running, none comes).
local function sg_group_idle_check(gkey)
  local m = redis.call('HMGET', gkey, 'npark', 'nlive', 'nwait')
  local npark, nlive, nwait = tonumber(m[1] or '0'), tonumber(m[2] or '0'), tonumber(m[3] or '0')
  if npark >= nlive or (npark + nwait >= nlive and redis.call('EXISTS', gkey .. ':w') == 0) then
    redis.call('PEXPIRE', gkey, SG_GROUP_IDLE_MS)
  end
end

-- Parks group token k: the group has no work for it.
local function sg_group_park(gkey, k, epoch, now)
  redis.call('HSET', gkey, 't' .. k, 'p|' .. sg_next_epoch(epoch, now))
  redis.call('HINCRBY', gkey, 'npark', 1)
  sg_group_idle_check(gkey)
end

-- Retires group token k: the group has more tokens than its limit (it was lowered). `maxep` keeps
-- the largest epoch a retired token had: one made again later (group_set) starts above it, so
-- that a stale element of the old one is never taken for it.
local function sg_group_retire(gkey, k)
  local m = redis.call('HMGET', gkey, 't' .. k, 'maxep')
  if not m[1] then return end
  local f = sg_split(m[1])
  local epoch = tonumber(f[2])
  if epoch > tonumber(m[2] or '0') then redis.call('HSET', gkey, 'maxep', sg_int(epoch)) end
  redis.call('HDEL', gkey, 't' .. k)
  redis.call('HINCRBY', gkey, 'nlive', -1)
  if f[1] == 'p' then redis.call('HINCRBY', gkey, 'npark', -1) end
  sg_group_idle_check(gkey)
end

-- Whether the group has more tokens than its limit: the one at hand then retires.
local function sg_group_excess(gkey)
  local m = redis.call('HMGET', gkey, 'nlive', 'limit')
  return tonumber(m[1] or '0') > tonumber(m[2] or '0')
end

-- Pushes request elements onto group queue `list` (sg_push's stand-in for group queues). Then,
-- in the same step: as many of the group's parked tokens wake, queued at the queue's priority p
-- (parked ones retire instead while the group has more tokens than its limit); and, while tokens
-- pushed outnumber tokens woken, queued tokens that wait below p, or on a paused list when p is
-- not paused, are queued again at p (their old elements become stale: take drops them), so that
-- the new work competes at its own priority without lifting the rest of the group's. `floor`
-- (no queued token below it) is recomputed when the tokens are read. Returns the number pushed.
sg_group_push = function(list, elements, from)
  local gkey, p = sg_group_of_queue(list)
  p = tonumber(p)
  local i, n = from, 0
  while i <= #elements do
    local last = math.min(i + 999, #elements)
    redis.call('LPUSH', list, unpack(elements, i, last))
    n = n + last - i + 1
    i = last + 1
  end
  if n == 0 then return 0 end
  redis.call('ZADD', gkey .. ':w', p, p)
  local now = sg_now()
  sg_group_open(gkey, now)
  -- Work is queued: the group is not idle, even if none of its tokens is parked (they may all wait
  -- for the rate limit's refill, which an idle check gave an expiry).
  redis.call('PERSIST', gkey)
  local shard, name = sg_group_parts(gkey)
  local paused = sg_group_paused(shard)
  local m = redis.call('HMGET', gkey, 'ntok', 'npark', 'floor', 'limit', 'nlive')
  local ntok, npark, floor = tonumber(m[1]), tonumber(m[2]), tonumber(m[3] or SG_GROUP_NO_FLOOR)
  local excess = math.max(tonumber(m[5]) - tonumber(m[4]), 0)
  local p_paused = sg_group_is_paused(paused, p)
  local raise = p > floor or (paused ~= nil and not p_paused)
  if math.min(npark, n) == 0 and excess == 0 and not raise then return n end
  local woken, moved, low = 0, 0, SG_GROUP_NO_FLOOR
  local parked_tokens, queued_tokens = {}, {}
  sg_each_token({gkey}, 0, ntok, function(k, tok)
    local f = sg_split(tok)
    if f[1] == 'p' then parked_tokens[#parked_tokens + 1] = {k, f[2]} end
    if f[1] == 'q' then queued_tokens[#queued_tokens + 1] = {k, f[2], tonumber(f[4])} end
  end)
  for _, t in ipairs(parked_tokens) do
    if excess > 0 then
      sg_group_retire(gkey, t[1])
      excess = excess - 1
    elseif woken < n then
      woken = woken + 1
      redis.call('HINCRBY', gkey, 'npark', -1)
      sg_group_queue(gkey, t[1], t[2], p, now)
    end
  end
  for _, t in ipairs(queued_tokens) do
    local below = t[3] < p or (not p_paused and sg_group_is_paused(paused, t[3]))
    if below and woken + moved < n then
      moved = moved + 1
      sg_group_queue(gkey, t[1], t[2], p, now)
      t[3] = p
    end
    low = math.min(low, t[3])
  end
  if woken > 0 then low = math.min(low, p) end
  redis.call('HSET', gkey, 'floor', low)
  if woken > 0 then sg_group_listed(shard, name) end
  return n
end

-- Group token k (epoch `epoch`), out of use, goes back to its group's work: retired while the
-- group has more tokens than its limit, else queued at the group's top priority (sg_group_top,
-- with the shard's pauses `paused`), else parked. Returns true when it was queued.
local function sg_group_return(gkey, k, epoch, now, paused)
  if sg_group_excess(gkey) then
    sg_group_retire(gkey, k)
    return false
  end
  local top = sg_group_top(gkey, paused)
  if not top then
    sg_group_park(gkey, k, epoch, now)
    return false
  end
  sg_group_queue(gkey, k, epoch, top, now)
  return true
end

-- Group token k of epoch `epoch` goes back (the take record that held it ended: sg_group_return),
-- and a group whose token goes back to work stays in its shard's set. Does nothing unless the
-- token is still held under that epoch (a record ended twice, a group that expired).
local function sg_group_end(gkey, k, epoch, now)
  local tok = redis.call('HGET', gkey, 't' .. k)
  if not tok then return end
  local f = sg_split(tok)
  if f[1] ~= 'h' or f[2] ~= epoch then return end
  local shard, name = sg_group_parts(gkey)
  if sg_group_return(gkey, k, epoch, now, sg_group_paused(shard)) then sg_group_listed(shard, name) end
end

-- Ends the group part of a take record (split: fields 6 to 8 are the group, its token and the
-- token's epoch; a record without them held no group token). `shard`: the shard's key prefix.
local function sg_held_end(shard, f)
  if f[6] and f[6] ~= '' then sg_group_end(sg_group_key(shard, f[6]), tonumber(f[7]), f[8], sg_now()) end
end

-- A slot took group element f (split: "^<G>", k, epoch) from the shard's list: if the token is
-- current, it is now held by `holder`, with the group's highest-priority request element not
-- paused (`paused`: priority text -> true, or nil), popped from its queue. Returns {queue,
-- request element}, and 'one' third when the group has a rate limit (the take starts one part,
-- charged to its bucket), or nil when there is nothing to take: the element was stale, the
-- token retired (the group has more than its limit), the group's rate limit has no room (the
-- token waits for the refill: `gwake`), or the group had no work (the token parks) or only work
-- of paused priorities (the token waits on the shard's list of the highest of them, where no
-- slot takes it until it is resumed).
local function sg_group_take(shard, f, holder, now, paused)
  local gkey = sg_group_key(shard, string.sub(f[1], 2))
  local k = tonumber(f[2])
  local tok = redis.call('HGET', gkey, 't' .. k)
  if not tok then return nil end
  local cur = sg_split(tok)
  if cur[1] ~= 'q' or cur[2] ~= f[3] then return nil end
  if sg_group_excess(gkey) then
    sg_group_retire(gkey, k)
    return nil
  end
  local r = redis.call('HMGET', gkey, 'rate', 'tat')
  local t, base
  if r[1] then
    local room, tau
    room, t, base, tau = sg_rate_room(r[1], r[2], now)
    if room < 1 then
      -- No room: the token waits for the bucket to refill (a take on the shard then queues it).
      local due = math.max(math.ceil(base - tau - now), 1) + now
      redis.call('HSET', gkey, 't' .. k, 'r|' .. f[3])
      redis.call('HINCRBY', gkey, 'nwait', 1)
      sg_group_wait(shard, due, string.sub(f[1], 2) .. '|' .. k .. '|' .. f[3])
      sg_group_idle_check(gkey)
      return nil
    end
  end
  local waiting = nil
  for _, p in ipairs(redis.call('ZREVRANGE', gkey .. ':w', 0, -1)) do
    local queue = gkey .. ':p:' .. p
    if sg_group_is_paused(paused, p) then
      if not waiting and redis.call('LLEN', queue) > 0 then waiting = tonumber(p) end
    else
      local element = redis.call('RPOP', queue)
      if element then
        if redis.call('LLEN', queue) == 0 then redis.call('ZREM', gkey .. ':w', p) end
        redis.call('HSET', gkey, 't' .. k, 'h|' .. f[3] .. '|' .. holder .. '|' .. now)
        if r[1] then
          redis.call('HSET', gkey, 'tat', string.format('%.3f', base + t))
          return {queue, element, 'one'}
        end
        return {queue, element}
      end
      redis.call('ZREM', gkey .. ':w', p)
    end
  end
  if waiting then
    sg_group_queue(gkey, k, f[3], waiting, now)
  else
    sg_group_park(gkey, k, f[3], now)
  end
  return nil
end

-- Queues again the group tokens of the shard whose rate-limit wait is over (`gwake` due by
-- `now`), at most 32 per call (sg_group_return).
local function sg_group_wake(shard, now)
  local wake = shard .. 'gwake'
  -- (Most takes find no wait set: one EXISTS costs a third of the read.)
  if redis.call('EXISTS', wake) == 0 then return end
  local due = redis.call('ZRANGEBYSCORE', wake, '-inf', now, 'LIMIT', '0', '32')
  if #due == 0 then return end
  local paused = sg_group_paused(shard)
  for _, member in ipairs(due) do
    redis.call('ZREM', wake, member)
    local f = sg_split(member)
    local gkey, k = sg_group_key(shard, f[1]), tonumber(f[2])
    if redis.call('HGET', gkey, 't' .. k) == 'r|' .. f[3] then
      redis.call('HINCRBY', gkey, 'nwait', -1)
      sg_group_return(gkey, k, f[3], now, paused)
    end
  end
end

-- In how many ms the shard's next rate-limit wait ends (nil: none waits).
local function sg_group_next_wake(shard, now)
  local next = redis.call('ZRANGE', shard .. 'gwake', 0, 0, 'WITHSCORES')
  if next[2] then return math.max(tonumber(next[2]) - now, 1) end
  return nil
end

-- Recovery's re-arm of a request's next look to `due` (ms): set as computed when the score is still
-- the one recovery's claim wrote (`claim`, from claim_due), so that a look planned far off is not
-- brought forward for nothing; otherwise someone asked for a look since (a push, an arm), and the
-- look only moves earlier, so that theirs is not put off. Either way, a look armed before a step
-- (`armed`, the key beside `active`) that was not yet due when the claim was made bounds the new
-- look: the census may have run before that step.
local function sg_rearm(active, rid, due, claim, armed)
  local score = redis.call('ZSCORE', active, rid)
  if not score then return 0 end
  local step = armed and redis.call('ZSCORE', armed, rid)
  if step then due = math.min(due, tonumber(step)) end
  if claim and claim ~= '' and tonumber(score) == tonumber(claim) then
    redis.call('ZADD', active, 'XX', due, rid)
  else
    redis.call('ZADD', active, 'XX', 'LT', due, rid)
  end
  return 1
end

-- The listing index (docs/protocol.md §5, "Listing"), on each home shard beside `active`, its
-- keys named from the shard's prefix "<ns>:{<ns>.q<s>}:" followed by `ix:` and:
--   live, completed, failed, cancelled  sorted sets of the requests in that state (live: not yet
--                                        terminal; but see `lq`), score = when submitted (ms). A
--                                        member is a key id, or, in a terminal set, a group: the
--                                        untracked lane requests whose records keep their rows,
--                                        submitted in that millisecond and moved there by one call
--                                        (sg_ix_finish_kept), "|<kid>|<kid>|..." (a key id never
--                                        holds '|'). A group's request is listed while its record
--                                        agrees (the state, the submit ms; list.lua)
--   gn                                   hash: per terminal state, how many more requests its set
--                                        holds than members (each group of n counts n - 1)
--   row                                  hash: key id -> "<kind>|<priority>|<limit>|<tags>" (kind
--                                        `r` a request of its own keys, `l` a lane request; tags
--                                        comma-separated), except a lane request without tags,
--                                        whose record keeps its row (an empty field `ix`: its
--                                        `pol` and `lc` say its row and submit ms, sg_ix_row,
--                                        sg_ix_kept_at; sg_ix_add_kept): its finish then reads it
--                                        with the record, and the row goes with the record
--   t:<tag>, tracked                     sorted sets, score = when submitted (ms)
--   exp                                  sorted set of the finished ones, score = when their keys
--                                        expire (ms): each finish drops a few expired ones. A
--                                        member is a key id, or, for the untracked lane requests
--                                        whose records keep their rows and that one call moved to
--                                        one terminal set, one member for all of them (a batch,
--                                        sg_ix_batch): "|<state>|<submit ms>,<key id>|..." (a key
--                                        id never holds '|')
--   tl, tx                               hashes: per tag (and ' tracked' for the tracked set) how
--                                        many of its requests are live, and the latest expiry
--                                        among its finished ones (ms)
--   lq                                   the number of live lane requests whose records keep
--                                        their rows and that are not in `live`: queued ones, and
--                                        running ones whose parts were all fed at their submit
--                                        (sg_ix_add_kept): `list` finds them in their lanes. It
--                                        is deleted when it reaches 0
--   next                                 hash: key id -> the row of a registration that found its
--                                        id listed by a finished request (sg_ix_add): once the new
--                                        request exists (that one's keys were purged), its first
--                                        push lists it in that one's place (sg_ix_takeover), or
--                                        its finish (finish_index) when it ended before any push
-- Every change is O(log n) (per tag). A finished request leaves with its retention (each finish and
-- each claim of recovery drop a few expired ones), and every key expires on its own once it holds
-- only finished requests: the terminal sets at their latest member's expiry, a tag's set when its
-- last live request finishes, and `row`, `tl`, `tx`, `exp`, `next` when the shard has no live one
-- left (while one is, `exp` stays, so that trimming finds every finished request).
local SG_IX_SHARED = {'row', 'tl', 'tx', 'exp', 'next', 'gn'}
local SG_IX_STATES = {'live', 'completed', 'failed', 'cancelled'}
-- Expired entries a call that finishes requests drops, and recovery's periodic claim (claim_due):
-- more than such a call finishes (a lane's batch is at most 32 by default), so the index never
-- grows behind, and the claims empty it once the work stops. Trimming costs a few commands per
-- call however many it drops (sg_ix_trim).
local SG_IX_TRIM_FINISH = 64
local SG_IX_TRIM_CLAIM = 100
local SG_IX_TRACKED = ' tracked'
-- How long after its score a batch in `exp` (sg_ix_batch) waits to be trimmed: its records expire
-- at that score, a millisecond or so either way of the call's clock.
local SG_IX_BATCH_LATE_MS = 2

-- The index prefix of the shard a key belongs to ("<ns>:{<ns>.q<s>}:<name>" -> "...:ix:").
local function sg_ix(shard_key)
  return string.match(shard_key, '^(.*:)[^:]*$') .. 'ix:'
end

-- What sg_ix_tags and sg_ix_marks_of return when there is nothing: one shared table, which their
-- callers only read, so that the common request (no tags, not tracked) makes none.
local SG_IX_NONE = {}

-- The tags in an index row.
local function sg_ix_tags(row)
  -- No tags (the row ends with its third '|'): the common case, without the patterns.
  if row == nil or row == false or string.byte(row, -1) == 124 then return SG_IX_NONE end
  local tags = {}
  local t = string.match(row, '^[^|]*|[^|]*|[^|]*|(.*)$')
  if t then for tag in string.gmatch(t, '[^,]+') do tags[#tags + 1] = tag end end
  return tags
end

-- The sets a request is a member of beside its state's: {field in tl/tx, key}, its tags (from its
-- `row`) and, if it is `tracked`, the tracked set.
local function sg_ix_marks_of(ix, row, tracked)
  local tags = sg_ix_tags(row)
  if #tags == 0 and not tracked then return SG_IX_NONE end
  local marks = {}
  for _, tag in ipairs(tags) do marks[#marks + 1] = {tag, ix .. 't:' .. tag} end
  if tracked then marks[#marks + 1] = {SG_IX_TRACKED, ix .. 'tracked'} end
  return marks
end

-- sg_ix_marks_of for request `kid`, whose row is `row`.
local function sg_ix_marks(ix, kid, row)
  return sg_ix_marks_of(ix, row, redis.call('ZSCORE', ix .. 'tracked', kid))
end

-- Sets `key` to expire at `at` (ms) unless it already expires later.
local function sg_ix_expire_at(key, at, now)
  local ttl = redis.call('PTTL', key)
  if ttl == -2 then return end
  if ttl == -1 or now + ttl < at then redis.call('PEXPIREAT', key, at) end
end

-- A set of `mark` (a tag's, or the tracked set) gained a live request: it stays while it has one.
local function sg_ix_mark_live(ix, mark)
  redis.call('HINCRBY', ix .. 'tl', mark[1], 1)
  redis.call('PERSIST', mark[2])
end

-- A live request of `mark`'s set finished (its keys expiring at `expires`, or nil when it left the
-- index): once none is live, the set expires with its latest finished member.
local function sg_ix_mark_done(ix, mark, expires, now)
  if expires then
    local latest = tonumber(redis.call('HGET', ix .. 'tx', mark[1]) or '0')
    if expires > latest then redis.call('HSET', ix .. 'tx', mark[1], expires) end
  end
  if redis.call('HINCRBY', ix .. 'tl', mark[1], -1) > 0 then return end
  redis.call('HDEL', ix .. 'tl', mark[1])
  local latest = redis.call('HGET', ix .. 'tx', mark[1])
  if latest then sg_ix_expire_at(mark[2], tonumber(latest), now) end
end

-- With no live request left on the shard (none in `live`, none listed from its lane: `lq`), the
-- keys that hold both kinds expire with the latest finished one (each new request makes them
-- persist again: sg_ix_first_live, sg_ix_queued).
local function sg_ix_settle(ix, now)
  if redis.call('EXISTS', ix .. 'live', ix .. 'lq') > 0 then return end
  local last = redis.call('ZRANGE', ix .. 'exp', -1, -1, 'WITHSCORES')
  for _, name in ipairs(SG_IX_SHARED) do
    if last[2] then sg_ix_expire_at(ix .. name, tonumber(last[2]), now) else redis.call('DEL', ix .. name) end
  end
end

-- Before a request turns live: if none was, the keys `sg_ix_settle` gave an expiry keep theirs no
-- more (while one is live they have none).
local function sg_ix_first_live(ix)
  if redis.call('EXISTS', ix .. 'live') == 1 then return end
  for _, name in ipairs(SG_IX_SHARED) do redis.call('PERSIST', ix .. name) end
end

-- The key ids of a group member of a terminal set ("|<kid>|<kid>|...").
local function sg_ix_group_kids(member)
  local kids = {}
  for kid in string.gmatch(member, '[^|]+') do kids[#kids + 1] = kid end
  return kids
end

-- The member of a terminal set for `kids`, submitted in one millisecond: the key id itself for
-- one, else a group.
local function sg_ix_group(kids)
  if #kids == 1 then return kids[1] end
  return '|' .. table.concat(kids, '|')
end

-- `kids` by their submit ms `ats` (text): {ms = {kid, ...}}, and the ms in the order first met.
local function sg_ix_by_at(ats, kids)
  local at_kids, order = {}, {}
  for j, kid in ipairs(kids) do
    local same = at_kids[ats[j]]
    if not same then
      same = {}
      at_kids[ats[j]] = same
      order[#order + 1] = ats[j]
    end
    same[#same + 1] = kid
  end
  return at_kids, order
end

-- Takes `kid` out of the group that holds it among the members of terminal set `state` at score
-- `at` (its submit ms); the rest of the group stays, as a group or, when one is left, as that
-- one's own member. Returns whether a group held it.
local function sg_ix_ungroup(ix, state, at, kid)
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', ix .. state, at, at)) do
    if string.byte(m, 1) == 124 then
      local kids, rest = sg_ix_group_kids(m), {}
      for _, k in ipairs(kids) do if k ~= kid then rest[#rest + 1] = k end end
      if #rest < #kids then
        -- The rest first: removing the group first could empty the set, which the ZADD would
        -- then make anew without the set's expiry.
        if #rest > 0 then redis.call('ZADD', ix .. state, at, sg_ix_group(rest)) end
        redis.call('ZREM', ix .. state, m)
        redis.call('HINCRBY', ix .. 'gn', state, -1)
        return true
      end
    end
  end
  return false
end

-- Where the record of lane request `kid` lists it in a group of a terminal set, by what the
-- record says: its state and submit ms, or nil when the record keeps no row or is not terminal
-- (a group member is found from its record; sg_ix_finish_kept).
local function sg_ix_kept_terminal(ix, kid)
  local r = redis.call('HMGET', string.sub(ix, 1, -4) .. 's:' .. kid, 'state', 'ix', 'lc')
  if not r[2] or (r[1] ~= 'completed' and r[1] ~= 'failed' and r[1] ~= 'cancelled') then return nil end
  if r[2] ~= '' then return r[1], string.match(r[2], '^[^|]*') end
  return r[1], string.sub(r[3], 1, -4)
end

-- The score of `kid` in a terminal set (its submit ms), or nil when it is in none: its own member,
-- or a group that holds it.
local function sg_ix_terminal(ix, kid)
  for i = 2, #SG_IX_STATES do
    local score = redis.call('ZSCORE', ix .. SG_IX_STATES[i], kid)
    if score then return score end
  end
  local state, at = sg_ix_kept_terminal(ix, kid)
  if state then
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', ix .. state, at, at)) do
      if string.byte(m, 1) == 124 and string.find('|' .. m .. '|', '|' .. kid .. '|', 1, true) then return at end
    end
  end
  return nil
end

-- When the keys of finished request `kid` expire (ms), as `exp` says: its own entry's score, or,
-- for a lane request whose record keeps its row and whose entry is in a batch (sg_ix_batch), its
-- record's expiry (0 when the record is gone: expired, or purged; math.huge when it keeps none).
-- nil when it is listed as finished in neither way.
local function sg_ix_expiry(ix, kid, now)
  local exp = redis.call('ZSCORE', ix .. 'exp', kid)
  if exp then return tonumber(exp) end
  if redis.call('HEXISTS', ix .. 'row', kid) == 1 or not sg_ix_terminal(ix, kid) then return nil end
  local ttl = redis.call('PTTL', string.sub(ix, 1, -4) .. 's:' .. kid)
  if ttl == -2 then return 0 end
  if ttl == -1 then return math.huge end
  return now + ttl
end

-- Removes a request from every index set; returns 1 if it was indexed.
local function sg_ix_remove(ix, kid, now)
  redis.call('HDEL', ix .. 'next', kid)
  local row = redis.call('HGET', ix .. 'row', kid)
  -- A row kept in its record (sg_ix_add_kept) is not in `row`: such a request is listed while it
  -- is live or its entry has not expired (its own in `exp`, or its terminal set's entry, which a
  -- batch in `exp` expires).
  if not row and not redis.call('ZSCORE', ix .. 'live', kid) and not redis.call('ZSCORE', ix .. 'exp', kid)
    and not sg_ix_terminal(ix, kid) then
    return 0
  end
  local marks = sg_ix_marks(ix, kid, row)
  local live = redis.call('ZREM', ix .. 'live', kid) == 1
  for i = 2, #SG_IX_STATES do redis.call('ZREM', ix .. SG_IX_STATES[i], kid) end
  local state, at = sg_ix_kept_terminal(ix, kid)
  if state then sg_ix_ungroup(ix, state, at, kid) end
  for _, mark in ipairs(marks) do
    redis.call('ZREM', mark[2], kid)
    if live then sg_ix_mark_done(ix, mark, nil, now) end
    if redis.call('EXISTS', mark[2]) == 0 then redis.call('HDEL', ix .. 'tx', mark[1]) end
  end
  redis.call('ZREM', ix .. 'exp', kid)
  redis.call('HDEL', ix .. 'row', kid)
  if live then sg_ix_settle(ix, now) end
  return 1
end

-- A batch member of `exp` (sg_ix_batch) read back: {member, state, ats, kids}.
local function sg_ix_unbatch(member)
  local state, rest = string.match(member, '^|([^|]*)|(.*)$')
  local batch = {member = member, state = state or 'completed', ats = {}, kids = {}}
  for at, kid in string.gmatch(rest or '', '([^,|]*),([^|]*)') do
    batch.ats[#batch.ats + 1] = at
    batch.kids[#batch.kids + 1] = kid
  end
  return batch
end

-- The entry in `exp` for untracked lane requests `kids` that keep their rows in their records
-- and that one call moved to terminal set `state`, submitted at `ats` (ms, text): one member for
-- all of them, "|<state>|<at>,<kid>|...", which costs a call one sorted-set insertion rather than
-- one a request. Their records expire at the batch's score, as their entries in `state` should.
local function sg_ix_batch(state, ats, kids)
  local items = {}
  for j, kid in ipairs(kids) do items[j] = ats[j] .. ',' .. kid end
  return '|' .. state .. '|' .. table.concat(items, '|')
end

-- Drops the requests of an expired batch (sg_ix_unbatch) from its terminal set. The call that
-- wrote the batch wrote one member there per submit millisecond (sg_ix_finish_kept): each such
-- group leaves whole, as written, or, when it was rewritten since (sg_ix_ungroup: a request of it
-- purged, reopened or tracked) or some of its requests' records exist, its requests whose records
-- are gone leave it one by one. A request's own member (a group of one, or
-- one tracked since) leaves only while it is the batch's: no record of the id exists on the
-- shard, and the member's score is the batch's submit ms (a request of its own stream under the
-- id, listed since, has its own). A record that exists is a later lane request of the id or this
-- one reopened: live (no expiry), it reaches the index by steps of its own; finished, its id gets
-- an entry of its own in `exp` at the record's expiry, which then drops whatever entries the id
-- has, as any expired entry does. Then the batch leaves `exp`.
local function sg_ix_trim_batch(ix, batch, now)
  local base, kids, ats, set = string.sub(ix, 1, -4) .. 's:', batch.kids, batch.ats, ix .. batch.state
  local records = {}
  for j, kid in ipairs(kids) do records[j] = base .. kid end
  local candidates, at_of = kids, ats
  if #records > 0 and redis.call('EXISTS', unpack(records)) > 0 then
    candidates, at_of = {}, {}
    local later = {}
    for j, kid in ipairs(kids) do
      local ttl = redis.call('PTTL', records[j])
      if ttl == -2 then
        candidates[#candidates + 1] = kid
        at_of[#candidates] = ats[j]
      elseif ttl >= 0 then
        later[#later + 1] = sg_int(now + ttl)
        later[#later + 1] = kid
      end
    end
    if #later > 0 then redis.call('ZADD', ix .. 'exp', unpack(later)) end
  end
  -- Only the requests whose records are gone leave their groups: one whose record exists was
  -- reopened (and ungrouped then) or is a later request of the id, and may be in a group written
  -- since, even one of the same text, at the same submit ms.
  local gone_kid = {}
  for _, kid in ipairs(candidates) do gone_kid[kid] = true end
  local at_kids, order = sg_ix_by_at(ats, kids)
  for _, at in ipairs(order) do
    local group = at_kids[at]
    if #group > 1 then
      local gone = {}
      for _, kid in ipairs(group) do if gone_kid[kid] then gone[#gone + 1] = kid end end
      if #gone == #group and redis.call('ZREM', set, sg_ix_group(group)) == 1 then
        redis.call('HINCRBY', ix .. 'gn', batch.state, 1 - #group)
      else
        for _, kid in ipairs(gone) do sg_ix_ungroup(ix, batch.state, at, kid) end
      end
    end
  end
  if #candidates > 0 then
    local scores = redis.call('ZMSCORE', set, unpack(candidates))
    local drop, gone = {}, {}
    for j, kid in ipairs(candidates) do
      if scores[j] and tonumber(scores[j]) == tonumber(at_of[j]) then
        drop[#drop + 1] = kid
        gone[#gone + 1] = kid
      elseif #at_kids[at_of[j]] > 1 then
        -- Listed in a group, which left above.
        gone[#gone + 1] = kid
      end
    end
    if #gone > 0 then redis.call('HDEL', ix .. 'next', unpack(gone)) end
    if #drop > 0 then
      redis.call('ZREM', set, unpack(drop))
      -- Tracked once finished (track.lua): the tracked set lets them go too.
      if redis.call('EXISTS', ix .. 'tracked') == 1 then
        local tracked = redis.call('ZMSCORE', ix .. 'tracked', unpack(drop))
        local marked = {}
        for j, kid in ipairs(drop) do if tracked[j] then marked[#marked + 1] = kid end end
        if #marked > 0 then
          redis.call('ZREM', ix .. 'tracked', unpack(marked))
          if redis.call('EXISTS', ix .. 'tracked') == 0 then redis.call('HDEL', ix .. 'tx', SG_IX_TRACKED) end
        end
      end
    end
  end
  redis.call('ZREM', ix .. 'exp', batch.member)
end

-- Drops up to `n` finished requests whose keys have expired, all with one command per set (a
-- request in `exp` is finished, never live: sg_ix_remove's steps for a request that is not live).
local function sg_ix_trim(ix, now, n)
  local members = redis.call('ZRANGEBYSCORE', ix .. 'exp', '-inf', now, 'WITHSCORES', 'LIMIT', 0, n)
  if #members == 0 then return end
  local gone, batches, kids = {}, {}, 0
  for i = 1, #members, 2 do
    local m = members[i]
    if string.byte(m, 1) == 124 then
      -- A batch (sg_ix_batch): its requests count against `n` too, and one is always taken. Not
      -- before its records have expired: Redis expires a key only once its clock is past the
      -- key's time, which is the batch's score.
      if (kids > 0 and kids >= n) or tonumber(members[i + 1]) > now - SG_IX_BATCH_LATE_MS then break end
      local batch = sg_ix_unbatch(m)
      batches[#batches + 1] = batch
      kids = kids + #batch.kids
    else
      gone[#gone + 1] = m
      kids = kids + 1
    end
  end
  for _, batch in ipairs(batches) do sg_ix_trim_batch(ix, batch, now) end
  if #gone == 0 then return end
  redis.call('HDEL', ix .. 'next', unpack(gone))
  local rows = redis.call('HMGET', ix .. 'row', unpack(gone))
  local tracked = redis.call('ZMSCORE', ix .. 'tracked', unpack(gone))
  for i = 2, #SG_IX_STATES do redis.call('ZREM', ix .. SG_IX_STATES[i], unpack(gone)) end
  redis.call('ZREM', ix .. 'exp', unpack(gone))
  redis.call('HDEL', ix .. 'row', unpack(gone))
  for j, kid in ipairs(gone) do
    -- (A lane request whose record keeps its row has none in `row`, but may be tracked.)
    if rows[j] or tracked[j] then
      for _, mark in ipairs(sg_ix_marks_of(ix, rows[j], tracked[j])) do
        redis.call('ZREM', mark[2], kid)
        if redis.call('EXISTS', mark[2]) == 0 then redis.call('HDEL', ix .. 'tx', mark[1]) end
      end
    end
  end
end

-- Lists a new request as live, submitted at `now`, unless its id is listed already (then the
-- submit that registered it first is listed, and a second one of the id is refused when created).
-- A finished request whose keys have expired leaves first: its id may be used again. So does one
-- that is merely listed when the caller has created the new request (`created`: lane_submit), since
-- the id was free: an operator purged its keys and the index has not followed yet (`unlist` comes
-- after, or its caller died). A registration (not `created`) cannot tell whether the finished one's
-- keys are gone: it keeps its row in `next`, for the new request's first push, or its finish
-- when it ended before any (sg_ix_takeover).
-- `fresh`: the caller knows the id was never listed (lane_submit under an id the producer
-- generated, whose record it found absent), which saves the checks. `live`: the caller knows a
-- request is listed live on the shard already (lane_submit_many, after its first), which saves
-- sg_ix_first_live. `at`: `now` as text when the caller has it (the score is then not formatted
-- again, which costs about what a command does).
local function sg_ix_add(ix, kid, row, now, created, fresh, live, at)
  if row == nil or row == '' then return end
  at = at or now
  if fresh then
    redis.call('HSET', ix .. 'row', kid, row)
  else
    local live = redis.call('ZSCORE', ix .. 'live', kid)
    local exp = not live and sg_ix_expiry(ix, kid, now)
    if (exp and exp <= now) or (created and not live) then
      sg_ix_remove(ix, kid, now)
      exp, live = nil, nil
    end
    -- Listed already: live, or finished (its row in `row`, or kept in its lane record).
    if live or exp or redis.call('HSETNX', ix .. 'row', kid, row) == 0 then
      if not live then
        redis.call('HSET', ix .. 'next', kid, row)
        sg_ix_settle(ix, now)
      end
      return
    end
  end
  if not live then sg_ix_first_live(ix) end
  redis.call('ZADD', ix .. 'live', at, kid)
  for _, tag in ipairs(sg_ix_tags(row)) do
    redis.call('ZADD', ix .. 't:' .. tag, at, kid)
    sg_ix_mark_live(ix, {tag, ix .. 't:' .. tag})
  end
end

-- When a lane request whose record keeps its row was submitted (ms, text), from the record's
-- `ix` (`kept`) and `lc`: `ix` is empty, and `lc` starts with the submit ms, but in a record an
-- earlier version wrote `ix` is "<submitted ms>|<row>".
local function sg_ix_kept_at(kept, lc)
  if kept ~= '' then return string.match(kept, '^[^|]*') end
  return string.sub(lc, 1, -4)
end

-- Enters a created lane request `kid` whose record keeps its row (the caller writes the record's
-- `ix`) in the index: not in `live`, but as one of the shard's lane requests listed from their
-- lanes (`lq`), which `list` finds there (list.lua). So a small request costs no member of `live`
-- while its entries in the lane are in submission order: from its submit to its finish when every
-- part of it is fed at its submit. It is listed in `live` (sg_ix_live_kept) when its first part is
-- handed out if parts of it are fed later (the lane's tail then holds them out of order), when
-- dead parts of it are requeued while it runs (likewise), when it is tracked, and when it is
-- cancelled (before its finish moves it from `live`); its finish takes it off `lq` if it is not
-- in `live` (sg_ix_finish_kept).
-- An id that is not `fresh` first loses what an earlier request of it left listed; one listed as
-- live already (a registration of the id, refused as a duplicate, listed it) stays so, and is not
-- counted. Returns 1 when it counts among those listed from their lanes: the caller adds it to
-- `lq` (sg_ix_queued), once per call.
local function sg_ix_add_kept(ix, kid, now, fresh)
  if not fresh then
    if redis.call('ZSCORE', ix .. 'live', kid) then return 0 end
    sg_ix_remove(ix, kid, now)
  end
  return 1
end

-- Adds `n` to the shard's count of lane requests listed from their lanes (`lq`). They are live:
-- if none was, the keys `sg_ix_settle` gave an expiry keep theirs no more (sg_ix_first_live).
local function sg_ix_queued(ix, n)
  if n > 0 and redis.call('INCRBY', ix .. 'lq', n) == n and redis.call('EXISTS', ix .. 'live') == 0 then
    for _, name in ipairs(SG_IX_SHARED) do redis.call('PERSIST', ix .. name) end
  end
end

-- Lists live lane requests whose records keep their rows in `live`, unless they are already:
-- `listing` holds their submit ms and key ids, in pairs. Those it lists leave `lq`'s count.
-- One command per key for all of them.
local function sg_ix_live_kept_many(ix, listing)
  sg_ix_first_live(ix)
  local added = redis.call('ZADD', ix .. 'live', 'NX', unpack(listing))
  if added > 0 and redis.call('DECRBY', ix .. 'lq', added) <= 0 then redis.call('DEL', ix .. 'lq') end
end

-- sg_ix_live_kept_many for one request, `kid`, from its record's `ix` and `lc` (`kept`, `lc`): when
-- it is tracked, cancelled or requeued while listed from its lane (sg_ix_add_kept).
local function sg_ix_live_kept(ix, kid, kept, lc)
  sg_ix_live_kept_many(ix, {sg_ix_kept_at(kept, lc), kid})
end

-- The record of lane request `kid` on the shard of index prefix `ix` ("...:ix:" -> "...:s:<kid>").
local function sg_ix_record(ix, kid)
  return string.sub(ix, 1, -4) .. 's:' .. kid
end

-- The index row of `kid`: from `row`, or kept in its lane record (nil when neither has it): a
-- lane request without tags, whose row its settings (`pol`, "[f]<priority>,<limit>,...") say.
local function sg_ix_row(ix, kid)
  local row = redis.call('HGET', ix .. 'row', kid)
  if row then return row end
  local r = redis.call('HMGET', sg_ix_record(ix, kid), 'ix', 'pol')
  if not r[1] then return nil end
  if r[1] ~= '' then return string.match(r[1], '^[^|]*|(.*)$') end
  local prio, limit = string.match(r[2] or '', '^f?(%d+),(%d+)')
  return 'l|' .. (prio or '0') .. '|' .. (limit or '1') .. '|'
end

-- The first push of request `kid` (it exists): if its registration found the id listed by a
-- finished request (a row waits in `next`), that one's keys are gone, purged, and this request
-- takes its place in the index.
local function sg_ix_takeover(ix, kid, now)
  local row = redis.call('HGET', ix .. 'next', kid)
  if not row or redis.call('ZSCORE', ix .. 'live', kid) then return end
  sg_ix_add(ix, kid, row, now, true)
end

-- Ends a call's changes to the index after requests finished (`batch`: the latest expiry of each
-- terminal state they entered): the terminal sets' expiry, the trimming, the settling.
local function sg_ix_finished(ix, now, batch)
  for state, expires in pairs(batch) do sg_ix_expire_at(ix .. state, expires, now) end
  sg_ix_trim(ix, now, SG_IX_TRIM_FINISH)
  sg_ix_settle(ix, now)
end

-- Before members are added to terminal set `state`: one that expired (with its latest members'
-- keys, sg_ix_finished) took its groups with it, but not their count in `gn`, which a set made
-- anew would otherwise inherit (counts add `gn` to the set's members).
local function sg_ix_set_fresh(ix, state)
  if redis.call('EXISTS', ix .. state) == 0 then redis.call('HDEL', ix .. 'gn', state) end
end

-- Moves live requests `kids` to the terminal sets `states` names (by position), each scored by
-- its submission time `ats[j]` (text), and enters their expiry `expires` in `exp`: one command per
-- set. Notes in `batch` the latest expiry of each terminal set entered (sg_ix_finished).
local function sg_ix_move(ix, kids, states, ats, expires, batch)
  local by_state, exp, at = {}, {}, sg_int(expires)
  for j, kid in ipairs(kids) do
    local members = by_state[states[j]] or {}
    by_state[states[j]] = members
    members[#members + 1] = ats[j]
    members[#members + 1] = kid
    exp[#exp + 1] = at
    exp[#exp + 1] = kid
  end
  redis.call('ZREM', ix .. 'live', unpack(kids))
  for state, members in pairs(by_state) do
    sg_ix_set_fresh(ix, state)
    redis.call('ZADD', ix .. state, unpack(members))
    batch[state] = math.max(batch[state] or 0, expires)
  end
  redis.call('ZADD', ix .. 'exp', unpack(exp))
end

-- sg_ix_finish for several requests at once, with one command per set: `kids` turned terminal
-- in `states` (by position), their keys expiring at `expires`. Those not live are not listed.
local function sg_ix_finish_many(ix, kids, states, expires, now, batch)
  if #kids == 0 then return end
  local scores = redis.call('ZMSCORE', ix .. 'live', unpack(kids))
  local listed, listed_states, ats = {}, {}, {}
  for j, kid in ipairs(kids) do
    if scores[j] then
      listed[#listed + 1] = kid
      listed_states[#listed] = states[j]
      ats[#listed] = scores[j]
    end
  end
  if #listed == 0 then return end
  sg_ix_move(ix, listed, listed_states, ats, expires, batch)
  local rows = redis.call('HMGET', ix .. 'row', unpack(listed))
  local tracked = redis.call('ZMSCORE', ix .. 'tracked', unpack(listed))
  for j = 1, #listed do
    for _, mark in ipairs(sg_ix_marks_of(ix, rows[j], tracked[j])) do sg_ix_mark_done(ix, mark, expires, now) end
  end
end

-- sg_ix_finish_many for lane requests whose rows their records keep (sg_ix_add_kept), live by
-- construction (in `live`, or listed from their lanes): `ats` their submission times (text, from
-- the records), so neither the live set's scores nor `row` is read. Those not tracked enter `exp`
-- as one batch per terminal set (sg_ix_batch), their records expiring with it, and their terminal
-- set as one member per submit millisecond (sg_ix_group; `gn` counts what the groups hold beyond
-- their members).
local function sg_ix_finish_kept(ix, kids, states, ats, expires, now, batch)
  if #kids == 0 then return end
  local tracked = SG_IX_NONE
  if redis.call('EXISTS', ix .. 'tracked') == 1 then tracked = redis.call('ZMSCORE', ix .. 'tracked', unpack(kids)) end
  -- The tracked ones as any listed request (their own entries in `exp`, sg_ix_move); the others
  -- with one entry in `exp` per terminal set (sg_ix_batch).
  local marked, marked_states, marked_ats, by_state, batched = {}, {}, {}, {}, false
  for j, kid in ipairs(kids) do
    if tracked[j] then
      marked[#marked + 1], marked_states[#marked + 1], marked_ats[#marked + 1] = kid, states[j], ats[j]
    else
      local group = by_state[states[j]]
      if not group then
        group = {ats = {}, kids = {}}
        by_state[states[j]] = group
        batched = true
      end
      group.ats[#group.ats + 1] = ats[j]
      group.kids[#group.kids + 1] = kid
    end
  end
  if batched then
    local exp, at = {}, sg_int(expires)
    -- The tracked ones are in `live`; those of the others that are not were listed from their
    -- lanes, and leave `lq`'s count.
    local lanes = #kids - redis.call('ZREM', ix .. 'live', unpack(kids))
    if lanes > 0 and redis.call('DECRBY', ix .. 'lq', lanes) <= 0 then redis.call('DEL', ix .. 'lq') end
    for state, group in pairs(by_state) do
      -- One member per submit millisecond (sg_ix_group): a drain in submission order finishes a
      -- call's requests within a millisecond or two of submits.
      local at_kids, order = sg_ix_by_at(group.ats, group.kids)
      local members, extra = {}, 0
      for _, kat in ipairs(order) do
        members[#members + 1] = kat
        members[#members + 1] = sg_ix_group(at_kids[kat])
        extra = extra + #at_kids[kat] - 1
      end
      sg_ix_set_fresh(ix, state)
      redis.call('ZADD', ix .. state, unpack(members))
      if extra > 0 then redis.call('HINCRBY', ix .. 'gn', state, extra) end
      batch[state] = math.max(batch[state] or 0, expires)
      exp[#exp + 1] = at
      exp[#exp + 1] = sg_ix_batch(state, group.ats, group.kids)
    end
    redis.call('ZADD', ix .. 'exp', unpack(exp))
  end
  if #marked == 0 then return end
  sg_ix_move(ix, marked, marked_states, marked_ats, expires, batch)
  for _ = 1, #marked do sg_ix_mark_done(ix, {SG_IX_TRACKED, ix .. 'tracked'}, expires, now) end
end

-- Moves a live request to its terminal state's set, its keys expiring at `expires`. A call that
-- finishes several requests (lane_ack) passes `batch`, a table, and calls sg_ix_finished once at
-- its end; otherwise that is done here.
local function sg_ix_finish(ix, kid, state, expires, now, batch)
  local own = batch == nil
  batch = batch or {}
  sg_ix_finish_many(ix, {kid}, {state}, expires, now, batch)
  if own then sg_ix_finished(ix, now, batch) end
end

-- Moves a failed request back to live (requeue_dead or lane_requeue reopened it). `kept_at`: the
-- submit ms of a lane request whose record keeps its row, which may be in a group of `failed`.
local function sg_ix_reopen(ix, kid, kept_at)
  local score = redis.call('ZSCORE', ix .. 'failed', kid)
  if not score and kept_at and sg_ix_ungroup(ix, 'failed', kept_at, kid) then score = kept_at end
  if not score then return end
  redis.call('ZREM', ix .. 'failed', kid)
  redis.call('ZREM', ix .. 'exp', kid)
  sg_ix_first_live(ix)
  redis.call('ZADD', ix .. 'live', score, kid)
  for _, mark in ipairs(sg_ix_marks(ix, kid, redis.call('HGET', ix .. 'row', kid))) do sg_ix_mark_live(ix, mark) end
end

-- Lanes (docs/protocol.md, "Lanes"). A lane is a long-lived request of its own, one per priority
-- and token shard, whose keys carry the shard's hash tag and whose key id is "~<shard>.<priority>"
-- (a request's key id never starts with "~"). It never finishes; its L tokens (all on its shard)
-- are taken, acquired, parked, reclaimed and restored as any request's are. Its stream carries the
-- parts of many small requests: one entry per part with fields p (payload), r (the request's key
-- id), i (the part's index) and l (the request's lifecycle). Each such lane request has one
-- record, the hash "<ns>:{<ns>.q<shard>}:s:<key id>", in the lane's slot, kept lean because a
-- queued small request is little more than it:
--   state    queued, running, completed, failed or cancelled
--   lc       the lifecycle: created (ms) * 1000 + a part of its µs (sg_lane_clock), + 1 for each
--            requeue that reopened it failed       gen  those requeues (absent: none)
--   pol      its settings, "[f]<priority>,<limit>,<parts>,<max attempts>,<timeout ms>,<backoff
--            base ms>,<backoff cap ms>": "f" for fail fast, trailing fields at their defaults
--            (1, 0, 1000, 60000) left out (sg_lane_pol)
--   left     parts not settled yet        failed   parts dead (absent: none)
--   nf       the next part to feed (absent: every part was fed at submit)   rq  requeued parts
--   nonce    the submit's nonce, only when the producer named the id (a generated id is unique,
--            so a record under it can only be the same submit re-sent)
--   id       the id as the producer gave it, only when it differs from the key id
--   started, finished, retried, maxseen as a request's meta hash has them
--   discard  only when its results are discarded (`discard_results`): how many parts' results
--            were not stored (a request's meta `discarded`); lane_ack reads it with the rest
--   w<i> a part not yet fed (a fail-fast request keeps it until the part is settled), o<i> a
--   result (none when discarded), e<i> an error, x<i> a dead part's payload.
-- Lane functions name records from the prefix they are given (ARGV) and the key ids in the
-- entries; every record is in the lane's slot.
-- A lane request's limit N holds because at most N of its parts are in the lane at once: it is
-- fed N at submit, and one more each time one of its parts is settled (done or dead).

-- Whether a record's settings (its `pol` field) say fail fast (an "f" first; this is on the hot
-- path, where splitting the string would cost more than the rest of the step).
local function sg_lane_failfast(pol)
  return string.byte(pol, 1) == 102
end

-- The values a record's settings leave out when they end with them: max attempts, timeout ms,
-- backoff base ms, backoff cap ms (the Rust client's defaults).
local SG_LANE_DEFAULTS = {'1', '0', '1000', '60000'}

-- A record's settings as stored: "[f]<priority>,<limit>,<parts>,<max attempts>,<timeout ms>,
-- <backoff base ms>,<backoff cap ms>", "f" first for fail fast, trailing fields at their
-- defaults (SG_LANE_DEFAULTS) left out.
local function sg_lane_pol(prio, limit, total, maxatt, timeout, bbase, bmax, failfast)
  local v = {sg_str(prio), sg_str(limit), sg_str(total), maxatt, timeout, bbase, bmax}
  local n = 7
  while n > 3 and v[n] == SG_LANE_DEFAULTS[n - 3] do n = n - 1 end
  local pol = table.concat(v, ',', 1, n)
  if failfast then pol = 'f' .. pol end
  return pol
end

-- A record's settings (its `pol` field) as a table.
local function sg_lane_policy(pol)
  pol = pol or ''
  local failfast = sg_lane_failfast(pol)
  if failfast then pol = string.sub(pol, 2) end
  local v = {}
  for x in string.gmatch(pol, '[^,]+') do v[#v + 1] = x end
  for j = 4, 7 do v[j] = v[j] or SG_LANE_DEFAULTS[j - 3] end
  return {prio = v[1], limit = tonumber(v[2]), total = tonumber(v[3]), maxatt = v[4], timeout = v[5],
    bbase = v[6], bmax = v[7], failfast = failfast}
end

-- Appends part i of lane request `kid` (lifecycle `lc`) to the lane. Lane entry ids are
-- "0-<n>", n counting up, as a request's are: recovery's census counts undelivered entries from ids.
-- This is the only writer of lane entries, and readers take their fields by position: p (the
-- payload) at 2, r at 4, i at 6, l at 8, and s at 10 (a request of one part only).
-- `pol` (the record's settings) only for a request of one part: its entry carries them, so that
-- its first hand-out needs no read of its record (sg_lane_entry).
local function sg_lane_add(keys, kid, i, lc, payload, pol)
  if pol then
    redis.call('XADD', keys[2], '0-*', 'p', payload, 'r', kid, 'i', sg_str(i), 'l', lc, 's', pol)
  else
    redis.call('XADD', keys[2], '0-*', 'p', payload, 'r', kid, 'i', sg_str(i), 'l', lc)
  end
end

-- Which waiting part of a lane request the lane is fed next (requeued parts first, then parts in
-- order), from its record's `rq`, `nf` and `pol`: the part's index and the record fields that
-- say it was fed, or nil when none waits.
local function sg_lane_pick(rq, nf, pol)
  if rq and rq ~= '' then
    local first, rest = string.match(rq, '^(%d+),?(.*)$')
    return tonumber(first), {'rq', rest}
  end
  if nf and tonumber(nf) < sg_lane_policy(pol).total then
    return tonumber(nf), {'nf', tonumber(nf) + 1}
  end
  return nil
end

-- Adds waiting parts `indices` of a lane request (its record's `pol` given) to the lane, in that
-- order. A fail-fast request keeps a part's payload until the part is settled: if it fails while
-- the part is in the lane, a requeue feeds the part again from there.
local function sg_lane_feed_parts(keys, record, kid, lc, pol, indices)
  local fields = {}
  for j, i in ipairs(indices) do fields[j] = 'w' .. i end
  local w = redis.call('HMGET', record, unpack(fields))
  local fed = {}
  for j, i in ipairs(indices) do
    if w[j] then
      fed[#fed + 1] = fields[j]
      sg_lane_add(keys, kid, i, lc, w[j])
    end
  end
  if #fed > 0 and not sg_lane_failfast(pol) then redis.call('HDEL', record, unpack(fed)) end
end

-- Feeds the lane the next waiting part of a lane request, if any (sg_lane_pick).
local function sg_lane_feed(keys, record, kid, lc, pol)
  local m = redis.call('HMGET', record, 'rq', 'nf')
  local i, fed = sg_lane_pick(m[1], m[2], pol)
  if not i then return end
  redis.call('HSET', record, unpack(fed))
  sg_lane_feed_parts(keys, record, kid, lc, pol, {i})
end

-- Whether a lane request's record is live for an entry of lifecycle `lc`; `m` starts with its
-- HMGET 'state', 'lc'.
local function sg_lane_live(m, lc)
  return (m[1] == 'queued' or m[1] == 'running') and m[2] == lc
end

-- Announces that a lane request turned terminal (its record's state is written): the record is
-- kept for the retention. Returns its line of the completion message and of its event
-- ("<kid>|<state>"): the caller writes the lines of all the requests it finished as one entry of
-- the shard's events stream and publishes them as one message (sg_lane_events), and moves them in
-- the listing index (sg_ix_finish_many, sg_ix_finished), once per call. A request with downstreams
-- (its record's `dn`, read by the caller) is put in the shard's release outbox in the same step
-- (prelude.lua, "Dependencies between requests"); the caller's reply names it.
local function sg_lane_announce(record, kid, state, retention, now, events, dn)
  redis.call('PEXPIRE', record, retention)
  if dn then redis.call('ZADD', sg_shard_key(events, 'rel'), now + SG_REL_DELAY_MS, kid) end
  return kid .. '|' .. state
end

-- How many downstreams of a finished request a finishing call names in its reply, at most: a set
-- larger than that is read by the release itself, a page at a time.
local SG_DN_PAGE = 64

-- The reply item that names the downstreams of the requests a call released (`released`:
-- {'rel', key id, state, lifecycle, ...}): {'dn', key id, n, entry * n, ...} for each whose set
-- (`prefix` .. key id) holds at most SG_DN_PAGE entries. Their releases, run by the caller at once,
-- then need no read of their sets.
local function sg_lane_downstreams(prefix, released)
  local out = {'dn'}
  for j = 2, #released, 3 do
    local set = prefix .. released[j]
    if redis.call('SCARD', set) <= SG_DN_PAGE then
      local members = redis.call('SMEMBERS', set)
      out[#out + 1] = released[j]
      out[#out + 1] = #members
      for _, m in ipairs(members) do out[#out + 1] = m end
    end
  end
  return out
end

-- After a call's announcements (sg_lane_announce): their lines as one entry of the shard's events
-- stream (field 'done': the lines joined by newlines; docs/protocol.md §6.5), published as one
-- message on `channel`; the stream drops entries older than the retention (whole nodes, as XADD's
-- MINID ~ would, but once per call rather than per event) and is kept for the retention.
local function sg_lane_events(events, lines, retention, now, channel)
  local text = table.concat(lines, '\n')
  redis.call('XADD', events, '*', 'done', text)
  redis.call('XTRIM', events, 'MINID', '~', math.max(now - tonumber(retention), 0))
  redis.call('PEXPIRE', events, retention)
  redis.call('PUBLISH', channel, text)
end

-- One entry of a lane batch as handed out: {entry id, index, payload, attempt, request key id,
-- lifecycle, settings (the record's `pol`, as it is)[, queue wait ms]}, or nil when its request
-- is no longer live (then the entry is to be dropped). Marks the request running; the eighth
-- field only when this hand-out started it: how long it waited since its submit (the lifecycle's
-- created ms), for the stats by stage. `seen` holds the records read so far in this call (by key
-- id), so that a batch with several parts of one request reads its record once; `started` is
-- `now` as text, converted once per call. The entry goes at the end of `reply`: as an array, or
-- with `flat` as its eight items in the reply itself (the eighth -1 when the hand-out did not
-- start the request; sg_next, "flat"). Returns whether it went (false: to be dropped).
-- With `fast` (the entry was delivered fresh, `XREADGROUP >`) the entry of a request of one part
-- (field `s`: its settings) is handed out without its record, which a cold key's look-up makes
-- the costliest step of a small request's hand-out: the request is live unless a cancel ended it
-- while its entry waited, and such a cancel left "<kid>|<lc>" in `cancelled` (the lane's set of
-- them, given when it exists; lane_cancel), which the entry takes out as it is dropped. Its key
-- id goes to `seen[2]`: the call's running marks (sg_lane_next). An entry of such a request
-- dropped otherwise takes its member out too.
local function sg_lane_entry(reply, flat, prefix, id, fields, attempt, now, seen, started, fast, cancelled)
  -- The fields as sg_lane_add wrote them, the only writer of lane entries: p, r, i, l[, s].
  local payload, kid, index, lc, pol = fields[2], fields[4], fields[6], fields[8], fields[10]
  local n = #reply
  if fast and pol then
    if cancelled and redis.call('SREM', cancelled, kid .. '|' .. lc) == 1 then return false end
    local waited = math.max(now - math.floor(tonumber(lc) / 1000), 0)
    local marked = seen[2] or {}
    seen[2] = marked
    marked[#marked + 1] = kid .. '|' .. lc
    if flat then
      reply[n + 1], reply[n + 2], reply[n + 3], reply[n + 4] = id, tonumber(index), payload, attempt
      reply[n + 5], reply[n + 6], reply[n + 7], reply[n + 8] = kid, lc, pol, waited
    else
      reply[n + 1] = {id, tonumber(index), payload, attempt, kid, lc, pol, waited}
    end
    return true
  end
  local m = seen[kid]
  if not m then
    m = redis.call('HMGET', prefix .. kid, 'state', 'lc', 'pol', 'ix', 'nf')
    seen[kid] = m
  end
  if not sg_lane_live(m, lc) then
    if cancelled then redis.call('SREM', cancelled, kid .. '|' .. lc) end
    return false
  end
  local waited = nil
  if m[1] == 'queued' then
    redis.call('HSET', prefix .. kid, 'state', 'running', 'started', started)
    m[1] = 'running'
    -- One whose record keeps its row stays listed from its lane while it runs (list.lua), when
    -- every part of it was fed at its submit (no `nf`): its entries there are then in submission
    -- order. One with parts fed later is listed from now on as live, by the caller, with the
    -- others its call starts (sg_lane_list_started): `seen[1]` collects their submit ms and key ids.
    if m[4] and m[5] then
      local listing = seen[1] or {}
      seen[1] = listing
      listing[#listing + 1] = sg_ix_kept_at(m[4], m[2])
      listing[#listing + 1] = kid
    end
    -- Not its first hand-out if it was handed out before without its record (not fresh now).
    if fast or not pol then waited = math.max(now - math.floor(tonumber(lc) / 1000), 0) end
  end
  if flat then
    reply[n + 1], reply[n + 2], reply[n + 3], reply[n + 4] = id, tonumber(index), payload, attempt
    reply[n + 5], reply[n + 6], reply[n + 7], reply[n + 8] = kid, lc, m[3], waited or -1
  else
    reply[n + 1] = {id, tonumber(index), payload, attempt, kid, lc, m[3], waited}
  end
  return true
end

-- The hand-out ms of lane request `kid` of lifecycle `lc` if a token of lane `lane` (its meta key)
-- holds it in its running marks (sg_lane_marks), else nil. (Key ids hold no `,` or `|`.)
local function sg_lane_marked(lane, kid, lc)
  local ntok = tonumber(redis.call('HGET', lane, 'ntok') or '0')
  local needle = ',' .. kid .. '|' .. lc .. ','
  -- A thousand fields a read (a lane has up to 10,000 tokens).
  for from = 0, ntok - 1, 1000 do
    local fields = {}
    for k = from, math.min(from + 999, ntok - 1) do fields[#fields + 1] = 'm' .. k end
    for _, marks in ipairs(redis.call('HMGET', lane, unpack(fields))) do
      if marks then
        local since, kids = string.match(marks, '^(%d+)|(.*)$')
        if kids and string.find(',' .. kids .. ',', needle, 1, true) then return since end
      end
    end
  end
  return nil
end

-- A lane token's running marks (its meta's `m<k>`, beside `t<k>`):
-- "<hand-out ms>|<kid>|<lc>,<kid>|<lc>,..." names the requests of one part (and their lifecycles)
-- its batch handed out without their records, which say `queued` until the batch's ack; readers
-- take them for running since then (docs/protocol.md §5, "Lanes"). `kids` is the call's list of
-- them (sg_lane_entry's `seen[2]`), or nil. A token's marks go whenever it is written without
-- new ones (sg_lane_next), by its ack (lane_ack) and by reclaim.
local function sg_lane_marks(now, kids)
  if not kids then return nil end
  return sg_int(now) .. '|' .. table.concat(kids, ',')
end

-- Lists the lane requests whose first parts sg_lane_entry handed out in this call and that have
-- parts fed later (`seen[1]`: submit ms and key id, in pairs) in `live` (sg_ix_live_kept_many). `prefix` names the records
-- ("...:s:"), and so the shard's index ("...:ix:").
local function sg_lane_list_started(prefix, seen)
  if seen[1] then sg_ix_live_kept_many(string.sub(prefix, 1, -3) .. 'ix:', seen[1]) end
end

-- How long the lane's oldest pending entry may have been out before settled entries are deleted
-- one by one rather than trimmed away behind it (sg_lane_drop).
local SG_LANE_TRIM_MS = 1000

-- Acks lane entries (of requests no longer live, or settled) and frees them. Entries are delivered
-- in id order, so every entry older than the oldest one still pending is settled: while that one
-- is recent the lane is trimmed up to it, whole stream nodes at a time, which costs far less than
-- deleting entries one by one. An entry out for longer (a slow handler, a retry waiting out its
-- backoff) would hold everything after it, so then the settled entries are deleted. Either way
-- what is kept beyond the unsettled entries is bounded by about SG_LANE_TRIM_MS of throughput.
local function sg_lane_drop(keys, ids)
  if #ids == 0 then return end
  redis.call('XACK', keys[2], 'g', unpack(ids))
  local oldest = redis.call('XPENDING', keys[2], 'g', '-', '+', 1)[1]
  if oldest and tonumber(oldest[3]) > SG_LANE_TRIM_MS then
    redis.call('XDEL', keys[2], unpack(ids))
    return
  end
  local bound
  if oldest then
    bound = oldest[1]
  else
    local last = 0
    for _, id in ipairs(ids) do last = math.max(last, sg_index(id)) end
    bound = '0-' .. (last + 1)
  end
  redis.call('XTRIM', keys[2], 'MINID', '~', bound)
end

-- sg_next for a lane: hands out up to `want` entries of live requests, dropping those of requests
-- that are no longer live (cancelled, failed fast, reopened), or parks the token.
-- Returns {'run', entry, ...} (sg_lane_entry) or {'park', wake}.
-- How long a lane outlives the moment it falls idle (nothing in it, every token parked, so that
-- no element and no holder of it exists): it leaves recovery's index then and expires unless a
-- submit revives it (sg_lane_open), so that a namespace that goes quiet keeps nothing.
local SG_LANE_IDLE_MS = 5000

-- Makes sure the lane exists and is indexed: creates it (meta hash with L parked tokens, stream and
-- group, its entry in recovery's index, first look in `look` ms) or revives an idle one.
-- Returns how many of its tokens are parked (its meta field `npark`).
local function sg_lane_open(keys, lane, prio, lanes, now, look, active)
  local m = redis.call('HMGET', keys[1], 'npark', 'idle')
  if m[1] and not m[2] then return tonumber(m[1]) end
  if m[1] then
    -- Idle (sg_lane_next): kept again.
    redis.call('PERSIST', keys[1])
    redis.call('HDEL', keys[1], 'idle')
    if redis.call('PERSIST', keys[2]) == 1 or redis.call('EXISTS', keys[2]) == 1 then
      redis.call('ZADD', active, 'NX', now + look, lane)
      return tonumber(m[1])
    end
  end
  -- Created afresh: an idle stream left without its meta is empty and goes (and the set of
  -- cancelled requests' entries, sg_lane_entry).
  redis.call('DEL', keys[1], keys[2], keys[4], keys[5], keys[6])
  local fields = {'v', 2, 'id', lane, 'lane', 1, 'state', 'running', 'open', 1, 'prio', prio,
    'limit', lanes, 'ntok', lanes, 'extra', 0, 'npark', lanes, 'created', now, 'gen', 0,
    'maxatt', 1, 'timeout', 0, 'bbase', 0, 'bmax', 0, 'shards', 1, 'total', 0, 'left', 0}
  for k = 0, lanes - 1 do
    fields[#fields + 1] = 't' .. k
    fields[#fields + 1] = 'p|' .. now
  end
  sg_hset_many(keys[1], fields)
  redis.call('XGROUP', 'CREATE', keys[2], 'g', '0', 'MKSTREAM')
  redis.call('ZADD', active, 'NX', now + look, lane)
  return lanes
end

-- Submitting to a lane (lane_submit, lane_submit_many). The most parts a lane request has.
local SG_LANE_MAX_PARTS = 64

-- Checks a lane's token count L: nil, or the error reply.
local function sg_lane_check_tokens(lanes)
  if not lanes or lanes < 1 or lanes > 10000 or lanes % 1 ~= 0 then
    return redis.error_reply('SGINVALID lane tokens must be an integer from 1 to 10000')
  end
  return nil
end

-- Checks one lane request's settings: its priority and limit (numbers or nil), args[from ..
-- from + 3] (max attempts, timeout ms, backoff base ms, backoff cap ms), its number of parts `n`
-- and its trace context. nil, or the error reply naming the first that is wrong.
local function sg_lane_check(prio, limit, args, from, n, trace)
  local invalid = sg_check_new(prio, limit, args, from, from + 3)
  if invalid then return invalid end
  if tonumber(args[from]) < 1 then return redis.error_reply('SGINVALID max attempts must be at least 1') end
  if not n or n < 1 or n > SG_LANE_MAX_PARTS or n % 1 ~= 0 then
    return redis.error_reply('SGINVALID a lane request has 1 to ' .. SG_LANE_MAX_PARTS .. ' parts')
  end
  return sg_check_trace(trace)
end

local SG_LANE_DUPLICATE = 'SGDUPLICATE request id is already in use'

-- Whether lane request `r` (sg_lane_write's table) may be created: nil when it may, else its
-- lifecycle when its record is this same submit's, re-sent (a generated id, sent with no nonce,
-- is unique, so a record under it can only be that), or the refusal's text when the id is in use
-- (a lane request's record, or, for an id the producer named, a request of the stream path
-- registered or retained on this shard: `reg` its registration times, `active` the shard's
-- active index, r.marks the id's finish marks).
local function sg_lane_taken(r, reg, active)
  local seen = redis.call('HMGET', r.record, 'lc', 'nonce')
  if seen[1] then
    if (seen[2] or '') ~= r.nonce then return SG_LANE_DUPLICATE end
    return seen[1]
  end
  if r.nonce ~= '' and (redis.call('HGET', reg, r.kid) or redis.call('ZSCORE', active, r.kid)
    or redis.call('EXISTS', r.marks) == 1) then
    return SG_LANE_DUPLICATE
  end
  return nil
end

-- Creates lane request `r` at `now` in the lane whose keys are `keys` (1..6): its record, its row
-- in the listing index `ix`, and its first parts in the lane (as many as its limit; the others
-- wait in the record). `r` holds kid, id (as the producer gave it), nonce, record, prio, limit,
-- maxatt, timeout, bbase, bmax, failfast and discard (booleans), row, trace, and its payloads as args[first ..
-- first + n - 1]; `lc` is its lifecycle (sg_lane_clock); `live` as sg_ix_add's. Returns how
-- many parts were fed.
local function sg_lane_write(keys, r, args, first, n, now, lc, ix, live)
  local fed = math.min(r.limit, n)
  local fields = {'state', 'queued', 'lc', lc, 'left', sg_str(n),
    'pol', sg_lane_pol(r.prio, r.limit, n, r.maxatt, r.timeout, r.bbase, r.bmax, r.failfast)}
  if r.nonce ~= '' then
    fields[#fields + 1] = 'nonce'
    fields[#fields + 1] = r.nonce
  end
  if r.id ~= r.kid then
    fields[#fields + 1] = 'id'
    fields[#fields + 1] = r.id
  end
  if r.trace ~= '' then
    fields[#fields + 1] = 'trace'
    fields[#fields + 1] = r.trace
  end
  if r.discard then
    fields[#fields + 1] = 'discard'
    fields[#fields + 1] = '0'
  end
  if fed < n then
    fields[#fields + 1] = 'nf'
    fields[#fields + 1] = sg_str(fed)
  end
  -- A listed request without tags keeps its row here, not in the index's `row` (sg_ix_add_kept):
  -- an empty `ix` says it is listed, and its `pol` and `lc` say the rest (sg_ix_row,
  -- sg_ix_kept_at), which costs the record no bytes (it stays in its allocation's size class).
  -- `lc` is `now` * 1000 plus less than 1000 as text: all its digits but the last three are `now`'s.
  local at = string.sub(lc, 1, -4)
  local kept = r.row ~= '' and string.byte(r.row, -1) == 124
  if kept then
    fields[#fields + 1] = 'ix'
    fields[#fields + 1] = ''
  end
  -- A fail-fast request keeps every part's payload until the part is settled.
  local from = fed
  if r.failfast then from = 0 end
  for i = from, n - 1 do
    fields[#fields + 1] = 'w' .. i
    fields[#fields + 1] = args[first + i]
  end
  redis.call('HSET', r.record, unpack(fields))
  -- An id the producer generated (no nonce) whose record is absent was never listed.
  local queued = 0
  if kept then
    queued = sg_ix_add_kept(ix, r.kid, now, r.nonce == '')
  else
    sg_ix_add(ix, r.kid, r.row, now, true, r.nonce == '', live, at)
  end
  -- A request of one part: its entry carries its settings (`pol`, fields[8]).
  local pol = nil
  if n == 1 then pol = fields[8] end
  for i = 0, fed - 1 do sg_lane_add(keys, r.kid, i, lc, args[first + i], pol) end
  return fed, queued
end

local function sg_lane_next(keys, k, epoch, holder, consumer, now, extra, want, prefix, active, armed, flat)
  want = math.max(want or 1, 1)
  local reply, ids, seen, started = {'run'}, {}, {}, sg_int(now)
  -- Requests of one part cancelled while their entries waited (lane_cancel): the lane's set of
  -- them (its errors key, otherwise unused), read only while it exists.
  local cancelled = redis.call('EXISTS', keys[4]) == 1 and keys[4] or nil
  -- Whether the last take found nothing: else entries may wait undelivered behind the dropped ones.
  local found_none = false
  for _ = 1, 8 do
    local work, fresh = sg_take_work(keys, consumer, now, extra, want - #ids)
    if #work == 0 then
      found_none = true
      break
    end
    local dropped = {}
    for j, w in ipairs(work) do
      if sg_lane_entry(reply, flat, prefix, w[1], w[2], w[3], now, seen, started, j >= fresh, cancelled) then
        ids[#ids + 1] = w[1]
      else
        dropped[#dropped + 1] = w[1]
      end
    end
    sg_lane_drop(keys, dropped)
    if #ids >= want or #dropped == 0 then break end
    extra = redis.call('HGET', keys[1], 'extra')
  end
  sg_lane_list_started(prefix, seen)
  if #ids > 0 then
    local held = 'h|' .. epoch .. '|' .. holder .. '|' .. now .. '|' .. table.concat(ids, ',')
    local marks = sg_lane_marks(now, seen[2])
    if marks then
      redis.call('HSET', keys[1], 't' .. k, held, 'm' .. k, marks)
    else
      redis.call('HSET', keys[1], 't' .. k, held)
      redis.call('HDEL', keys[1], 'm' .. k)
    end
    return reply
  end
  redis.call('HSET', keys[1], 't' .. k, 'p|' .. epoch)
  redis.call('HDEL', keys[1], 'm' .. k)
  local parked = redis.call('HINCRBY', keys[1], 'npark', 1)
  -- Eight takes of nothing but entries no longer live: more may wait; the token comes back at once.
  if not found_none then return {'park', 1} end
  if parked >= tonumber(redis.call('HGET', keys[1], 'ntok'))
    and tonumber(redis.call('HGET', keys[1], 'extra') or '0') == 0
    and not redis.call('XPENDING', keys[2], 'g', '-', '+', 1)[1] then
    -- Idle (SG_LANE_IDLE_MS): nothing undelivered (this take found none), pending or waiting.
    -- What is left in the stream was settled and not trimmed yet (sg_lane_drop).
    redis.call('XTRIM', keys[2], 'MAXLEN', 0)
    -- Nothing waits: no cancelled request's entry is left to drop.
    redis.call('DEL', keys[4])
    redis.call('HSET', keys[1], 'idle', 1)
    local lane = redis.call('HGET', keys[1], 'id')
    redis.call('ZREM', active, lane)
    redis.call('ZREM', armed, lane)
    redis.call('PEXPIRE', keys[1], SG_LANE_IDLE_MS)
    redis.call('PEXPIRE', keys[2], SG_LANE_IDLE_MS)
  end
  local due = sg_next_retry(keys, now)
  return {'park', due and math.max(due - now, 1) or 0}
end

-- submit_open: create a request in state `loading`, invisible to workers (no token exists yet).
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request id as the producer gave it   ARGV[2] priority   ARGV[3] concurrency limit
-- ARGV[4] loading ttl (ms): a producer that dies mid-submit leaves keys that expire by themselves
-- ARGV[5] max attempts per sub-request   ARGV[6] per-attempt timeout (ms, 0 = none)
-- ARGV[7] retry backoff base (ms)   ARGV[8] retry backoff cap (ms)
-- ARGV[9] submission nonce: a random value of this submit, so that the same call re-sent after
-- a reconnect is recognised, and only its own producer can abort or commit it
-- ARGV[10] delay (ms, 0 = none): the request becomes eligible that long after its commit
-- ARGV[11] flags (sg_flags): '1' = fail fast: the first dead letter ends the request as failed;
-- then 'd' = its results are discarded: successful parts' results are never stored (meta `discard`)
-- ARGV[12] token shards S the request is submitted with: its token k lives on shard (home + k) % S,
-- home = FNV-1a(key id) % S (docs/protocol.md, "Token shards")
-- ARGV[13] deadline (Redis ms): the registration time plus half the loading ttl (register.lua)
-- ARGV[14] trace context (optional; '' or absent = none): the producer's send span as its
-- propagator writes it, a JSON object, stored as `trace` for workers to parent their spans on
-- ARGV[15] the request's deadline, in ms from now (optional; '' or 0 = none): stored as `dl`, the
-- Redis time (ms) past which no part starts and the request ends `failed`, `why` = `deadline`
-- ARGV[16] the request's rate limit, "<R>/<interval ms>" (optional; '' = none): at most R parts
-- start per interval, across all workers (stored as `rate`; prelude, sg_rate_room)
-- ARGV[17] the policy for a failed upstream (optional; '' = 'fail'): 'fail' or 'run'
-- ARGV[18] the upstreams (optional; '' = none): key ids, comma-separated, at most 1,000: the
-- request is a downstream, committed `waiting` until they end (prelude.lua, "Dependencies between
-- requests"); its producer links it to each (dag_link) before submit_commit. Not with a delay.
-- ARGV[19] the tenant group (optional; '' = none): stored as `grp`; the request's tokens then all
-- live on the group's shard and wait in its queues (prelude.lua, "Tenant groups")
-- Returns 1, or the errors "SGDUPLICATE ..." when the id is already in use (live or retained),
-- "SGINVALID ..." when an argument is out of range, "SGLATE ..." after the deadline.
local SG_MAX_DELAY_MS = 10 * 365 * 24 * 3600 * 1000

local function submit_open(keys, args)
  local prio, limit = tonumber(args[2]), tonumber(args[3])
  local invalid = sg_check_new(prio, limit, args, 4, 8)
  if invalid then return invalid end
  local delay = tonumber(args[10] or '0')
  if not delay or delay < 0 or delay % 1 ~= 0 or delay > SG_MAX_DELAY_MS then
    return redis.error_reply('SGINVALID delay must be a whole number of ms from 0 to ten years')
  end
  local shards = tonumber(args[12] or '1')
  if not shards or shards < 1 or shards > 1024 or shards % 1 ~= 0 then
    return redis.error_reply('SGINVALID token shards must be an integer from 1 to 1024')
  end
  if tonumber(args[5]) < 1 then return redis.error_reply('SGINVALID max attempts must be at least 1') end
  local failfast, discard
  failfast, discard, invalid = sg_flags(args[11])
  if invalid then return invalid end
  local trace = args[14] or ''
  invalid = sg_check_trace(trace)
  if invalid then return invalid end
  local within
  within, invalid = sg_check_deadline(args[15])
  if invalid then return invalid end
  local rate
  rate, invalid = sg_check_rate(args[16])
  if invalid then return invalid end
  local grp = args[19] or ''
  invalid = sg_check_group(grp)
  if invalid then return invalid end
  local ups, onup = args[18] or '', args[17] or ''
  if onup == '' then onup = 'fail' end
  if onup ~= 'fail' and onup ~= 'run' then
    return redis.error_reply('SGINVALID the policy for a failed upstream is fail or run')
  end
  if ups ~= '' then
    local n = 0
    for ukid in string.gmatch(ups .. ',', '([^,]*),') do
      if ukid == '' then return redis.error_reply('SGINVALID an upstream key id is empty') end
      n = n + 1
    end
    if n > 1000 then return redis.error_reply('SGINVALID a request has at most 1000 upstreams') end
    if delay > 0 then return redis.error_reply('SGINVALID a request submitted after others cannot be delayed') end
  end
  if redis.call('EXISTS', keys[1]) == 1 then
    if redis.call('HGET', keys[1], 'nonce') == args[9] then return 1 end
    return redis.error_reply('SGDUPLICATE request id is already in use')
  end
  if redis.call('EXISTS', keys[2]) == 1 then
    return redis.error_reply('SGDUPLICATE request id is already in use')
  end
  local now = sg_now()
  if sg_late(args[13], now) then
    return redis.error_reply('SGLATE the submit came too long after its registration; nothing was written')
  end
  redis.call('HSET', keys[1], 'v', 2, 'id', args[1], 'nonce', args[9], 'state', 'loading',
    'prio', args[2], 'limit', args[3], 'total', 0, 'left', 0, 'failed', 0, 'ntok', 0, 'extra', 0,
    'npark', 0, 'created', now, 'maxatt', args[5], 'timeout', args[6], 'bbase', args[7],
    'bmax', args[8], 'delay', delay, 'failfast', failfast and '1' or '0', 'shards', shards)
  -- Only a discarding request carries the field: ack reads it in its one HMGET.
  if discard then redis.call('HSET', keys[1], 'discard', 1) end
  -- Only a traced request carries the field.
  if trace ~= '' then redis.call('HSET', keys[1], 'trace', trace) end
  if within > 0 then redis.call('HSET', keys[1], 'dl', now + within) end
  if rate ~= '' then redis.call('HSET', keys[1], 'rate', rate) end
  if grp ~= '' then redis.call('HSET', keys[1], 'grp', grp) end
  if ups ~= '' then redis.call('HSET', keys[1], 'ups', ups, 'onup', onup, 'upw', 0, 'upf', 0) end
  -- The group starts at 0 so that every entry added afterwards is delivered once.
  redis.call('XGROUP', 'CREATE', keys[2], 'g', '0', 'MKSTREAM')
  redis.call('PEXPIRE', keys[1], args[4])
  redis.call('PEXPIRE', keys[2], args[4])
  return 1
end

-- load_parts: add a chunk of parts to a request that is loading (between submit_open and
-- submit_commit). One call per chunk of parts is far cheaper than one XADD per part.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] the submission nonce given to submit_open   ARGV[2] index of the first part
-- ARGV[3..] payloads
-- Returns how many parts the stream holds. Parts already there (a call re-sent after a
-- reconnect) are skipped. Errors "SGSTATE ..." when the request is not this producer's loading
-- request (its loading ttl ran out, and maybe another producer took the id).
local function load_parts(keys, args)
  local m = redis.call('HMGET', keys[1], 'state', 'nonce')
  if m[1] ~= 'loading' or m[2] ~= args[1] then
    return redis.error_reply('SGSTATE request is not loading (its loading time ran out?)')
  end
  local have = redis.call('XLEN', keys[2])
  local first = tonumber(args[2])
  if first > have then
    return redis.error_reply('SGGAP parts from index ' .. have .. ' are missing before index ' .. first)
  end
  -- Part i is entry 0-<i+1>. The stream was created empty (submit_open) and its parts go in in
  -- order, here or by a client's plain XADD of the same ids (docs/protocol.md), so its last entry
  -- is 0-<XLEN> and `0-*` (the next sequence number) names each part's entry without formatting
  -- its number.
  for i = math.max(have - first, 0) + 3, #args do
    redis.call('XADD', keys[2], '0-*', 'p', args[i])
  end
  return redis.call('XLEN', keys[2])
end

-- submit_commit: make a fully loaded request runnable, atomically.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id (encoded, as in the keys)   ARGV[2] number of parts the producer added
-- ARGV[3] the submission nonce given to submit_open
-- For a downstream (submit_open's ARGV[18]): ARGV[4] retention (ms)   ARGV[5] completion channel
-- ARGV[6..] one group of four per upstream, as its
-- link answered (dag_link, and the upstream's meta): upstream key id, lifecycle, 'w' (not ended),
-- 'c' (completed) or 'f' (ended otherwise), and the state it ended in ('' for 'w'). A release that
-- came before the commit (dag_settle while loading) is kept if it is news of the same upstream.
-- Returns the token elements "<rid>|<k>|<epoch>" to push onto the request's priority list (none
-- for a delayed request, or for a downstream left `waiting`, its tokens parked until its upstreams
-- end), {'finished', 'failed', lifecycle} for a downstream whose upstream failed (its policy
-- 'fail': it ends at once, `why` = `upstream:<ukid>`, and the steps after its finish follow), or
-- an error "SGSTATE ..." (not loading: its loading ttl ran out, or
-- another producer's request) or "SGINCOMPLETE ..." (parts missing). The same call re-sent after
-- a reconnect returns the elements of the tokens still queued.
local function submit_commit(keys, args)
  local m = redis.call('HMGET', keys[1], 'state', 'nonce', 'ntok')
  if m[2] ~= args[3] then
    return redis.error_reply('SGSTATE request is not loading (its loading time ran out?)')
  end
  if m[1] ~= 'loading' then
    if m[1] == 'failed' and redis.call('HGET', keys[1], 'ups') then
      return {'finished', 'failed', sg_lifecycle(keys)}
    end
    local out = {}
    sg_each_token(keys, 0, tonumber(m[3]), function(k, tok)
      local f = sg_split(tok)
      if f[1] == 'q' then out[#out + 1] = sg_element(args[1], k, f[2]) end
    end)
    return out
  end
  local total = tonumber(args[2])
  if not total or total < 1 then
    return redis.error_reply('SGINVALID a request needs at least one part')
  end
  if redis.call('XLEN', keys[2]) ~= total then
    return redis.error_reply('SGINCOMPLETE the stream does not hold every part')
  end
  local ups = redis.call('HGET', keys[1], 'ups')
  if ups then
    local linked = {}
    for i = 6, #args, 4 do linked[args[i]] = true end
    for ukid in string.gmatch(ups, '[^,]+') do
      if not linked[ukid] and redis.call('HEXISTS', keys[1], 'u:' .. ukid) == 0 then
        return redis.error_reply('SGINVALID upstream ' .. ukid .. ' was not linked before the commit')
      end
    end
  end
  local now = sg_now()
  local ntok = math.min(tonumber(redis.call('HGET', keys[1], 'limit')), total)
  redis.call('PERSIST', keys[1])
  redis.call('PERSIST', keys[2])
  redis.call('HSET', keys[1], 'state', 'queued', 'total', total, 'left', total, 'ntok', ntok, 'queued', now)
  local delay = tonumber(redis.call('HGET', keys[1], 'delay') or '0')
  local fields, out = {}, {}
  local gate = 'open'
  if ups then
    for i = 6, #args, 4 do
      local ukid, lc = args[i], tonumber(args[i + 1])
      local old = sg_dag_field(redis.call('HGET', keys[1], 'u:' .. ukid))
      if not string.find(',' .. ups .. ',', ',' .. ukid .. ',', 1, true) then
        -- Not one of its upstreams: ignored.
      elseif not old or math.floor(old[2] / 1000) ~= math.floor(lc / 1000) or old[2] < lc
        or (old[2] == lc and old[1] == 'w') then
        sg_dag_set(keys, ukid, old, args[i + 2], lc, args[i + 3])
      end
    end
    local c = redis.call('HMGET', keys[1], 'upw', 'upf', 'onup')
    gate = sg_dag_gate(c[1], c[2], c[3])
  end
  if gate ~= 'open' then
    -- A downstream whose upstreams have not all ended waits with parked tokens: dag_settle opens
    -- it. One whose upstream failed (policy 'fail') ends now.
    redis.call('HSET', keys[1], 'state', 'waiting', 'npark', ntok)
    for k = 0, ntok - 1 do
      fields[#fields + 1] = 't' .. k
      fields[#fields + 1] = 'p|' .. now
    end
    sg_hset_many(keys[1], fields)
    if gate == 'fail' then
      return sg_dag_fail(keys, args[1], sg_dag_failed_one(keys, ups), args[4], args[5], now)
    end
    return out
  elseif delay > 0 then
    -- Scheduled: tokens wait parked, and no worker can see the request until recovery promotes
    -- it (census) once its time has come.
    redis.call('HSET', keys[1], 'state', 'scheduled', 'eligible', now + delay, 'npark', ntok)
    for k = 0, ntok - 1 do
      fields[#fields + 1] = 't' .. k
      fields[#fields + 1] = 'p|' .. now
    end
  else
    for k = 0, ntok - 1 do
      fields[#fields + 1] = 't' .. k
      fields[#fields + 1] = 'q|' .. now .. '|' .. now
      out[#out + 1] = sg_element(args[1], k, now)
    end
  end
  sg_hset_many(keys[1], fields)
  return out
end

do
-- submit_small: a whole request in one call, for one that fits in one chunk of parts:
-- submit_open, load_parts and submit_commit in one atomic step. The producer registers the
-- request with recovery (register) before, and pushes the elements (push) after, as for any
-- submit.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1..13] as submit_open's   ARGV[14] request key id   ARGV[15] trace context ('' = none;
-- submit_open's ARGV[14])   ARGV[16] deadline in ms from now ('' or 0 = none; submit_open's
-- ARGV[15])   ARGV[17] rate limit ('' = none; submit_open's ARGV[16])   ARGV[18..] payloads
-- Returns the token elements to push, or submit_open's / submit_commit's errors. The same call
-- re-sent after a reconnect returns the elements of the tokens still queued.
local function submit_small(keys, args)
  local open_args = {}
  for i = 1, 13 do open_args[i] = args[i] end
  open_args[14] = args[15]
  open_args[15] = args[16]
  open_args[16] = args[17]
  local opened = submit_open(keys, open_args)
  if type(opened) == 'table' and opened.err then return opened end
  if redis.call('HGET', keys[1], 'state') ~= 'loading' then
    -- The same call re-sent after it ran: answer as it did (the elements of the queued tokens).
    return submit_commit(keys, {args[14], '0', args[9]})
  end
  local load_args = {args[9], '0'}
  for i = 18, #args do load_args[#load_args + 1] = args[i] end
  local loaded = load_parts(keys, load_args)
  if type(loaded) == 'table' and loaded.err then return loaded end
  return submit_commit(keys, {args[14], tostring(#args - 17), args[9]})
end
redis.register_function('sg2_submit_small', submit_small)
end
do
-- submit_abort: a producer gives up a submit that failed while loading: its keys go at once,
-- rather than when the loading ttl ends. Only the producer that opened it (same nonce) can.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] the submission nonce
-- Returns 1 when the keys were deleted, 0 when they were not this producer's loading request.
local function submit_abort(keys, args)
  local m = redis.call('HMGET', keys[1], 'state', 'nonce')
  if m[1] ~= 'loading' or m[2] ~= args[1] then return 0 end
  redis.call('DEL', keys[1], keys[2])
  return 1
end
redis.register_function('sg2_submit_abort', submit_abort)
end
do
-- stream_open: start a streamed request: runnable at once, its parts added over time with
-- stream_append, complete only after stream_finalize and every part done.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2..10] as submit_open's ARGV[1..9] (id, priority, limit, ttl,
-- max attempts, timeout, backoff base, backoff cap, nonce)   ARGV[11] expiry (ms, 0 = none): a
-- request still open this long after it was opened is cancelled by recovery   ARGV[12] '1' =
-- fail fast   ARGV[13] token shards (submit_open's ARGV[12])   ARGV[14] deadline (submit_open's
-- ARGV[13])   ARGV[15] window W (optional; 0 or absent = none): the producer keeps at most W
-- parts unsettled, and acks trim the stream as they go (stored as `window`)   ARGV[16] '1' =
-- discard results: `ok` results are never stored (stored as `discard`)   ARGV[17] trace context
-- (optional; '' or absent = none; submit_open's ARGV[14])   ARGV[18] deadline in ms from now
-- (optional; '' or 0 = none; submit_open's ARGV[15])   ARGV[19] rate limit (optional; '' = none;
-- submit_open's ARGV[16])   ARGV[20] group (optional; '' = none; submit_open's ARGV[19])
-- Returns the token elements to push (its tokens start parked, so none until parts arrive), or
-- submit_open's errors.
local function stream_open(keys, args)
  local expiry = tonumber(args[11])
  if not expiry or expiry < 0 or expiry % 1 ~= 0 or expiry > SG_MAX_DELAY_MS then
    return redis.error_reply('SGINVALID open expiry must be a whole number of ms from 0 to ten years')
  end
  local window = tonumber(args[15] or '0')
  if not window or window < 0 or window % 1 ~= 0 or window > 1e15 then
    return redis.error_reply('SGINVALID window must be a whole number of parts of at least 0')
  end
  local opened = submit_open(keys, {args[2], args[3], args[4], args[5], args[6], args[7], args[8],
    args[9], args[10], '0', args[12] or '0', args[13] or '1', args[14] or '', args[17] or '', args[18] or '', args[19] or '', '', '', args[20] or ''})
  if type(opened) == 'table' and opened.err then return opened end
  if redis.call('HGET', keys[1], 'state') ~= 'loading' then return {} end
  local now = sg_now()
  local ntok = tonumber(args[4])
  local deadline = 0
  if expiry > 0 then deadline = now + expiry end
  redis.call('PERSIST', keys[1])
  redis.call('PERSIST', keys[2])
  redis.call('HSET', keys[1], 'state', 'queued', 'open', 1, 'open_deadline', deadline, 'ntok', ntok,
    'queued', now, 'npark', ntok)
  -- Only a windowed or discarding request carries the fields: ack reads them in its one HMGET.
  if window > 0 then redis.call('HSET', keys[1], 'window', window) end
  if args[16] == '1' then redis.call('HSET', keys[1], 'discard', 1) end
  local fields = {}
  for k = 0, ntok - 1 do
    fields[#fields + 1] = 't' .. k
    fields[#fields + 1] = 'p|' .. now
  end
  sg_hset_many(keys[1], fields)
  return {}
end
redis.register_function('sg2_stream_open', stream_open)
end
do
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
redis.register_function('sg2_stream_append', stream_append)
end
do
-- stream_finalize: no more parts will come; the request completes when every part is done
-- (at once, if they all are).
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] retention (ms)   ARGV[3] completion channel
-- ARGV[4] the nonce given at stream_open, or '' for an operator finalizing another's request
-- Returns {'open'} (parts still to run), {'finished', state, lifecycle, sweep...} as ack, or errors
-- "SGSTATE ..." when the request is not open.
-- The producer's finalize sent again (its reply was lost; `open` is 0 and the nonce its own)
-- answers as the first did, but names no elements to sweep (the first call took the tokens'
-- fields that name them; an element left on its list is dropped by the take that finds it): {'open'} while
-- parts are left, {'finished', state, lifecycle} once the request is terminal, whoever finished
-- it; the steps after a finish are harmless run twice. An operator's ('' nonce) is refused.
local function stream_finalize(keys, args)
  local m = redis.call('HMGET', keys[1], 'open', 'nonce', 'left', 'failed', 'state')
  local terminal = m[5] == 'completed' or m[5] == 'failed' or m[5] == 'cancelled'
  if m[1] == '0' and args[4] ~= '' and m[2] == args[4] then
    if terminal then return {'finished', m[5], sg_lifecycle(keys)} end
    return {'open'}
  end
  if m[1] ~= '1' or terminal or (args[4] ~= '' and m[2] ~= args[4]) then
    return redis.error_reply('SGSTATE the request is not open (finalized already, cancelled or unknown)')
  end
  redis.call('HSET', keys[1], 'open', 0)
  if tonumber(m[3]) > 0 then return {'open'} end
  local state = 'completed'
  if tonumber(m[4]) > 0 then state = 'failed' end
  return sg_finish(keys, args[1], state, args[2], args[3], sg_now())
end
redis.register_function('sg2_stream_finalize', stream_finalize)
end
do
-- outstanding: how many parts of an open streamed request are not settled yet (added, neither
-- done nor dead-lettered): what a windowed producer waits on before it adds more. Read-only
-- (registered no-writes: callable with FCALL_RO, on a replica, at Redis's memory limit).
-- KEYS[1] the request's meta hash (only this key)
-- ARGV none
-- Returns the meta field `left` (integer) while the request is open for parts, or -1 when it is
-- not (finalized, cancelled, finished, expired or unknown): the producer's add then stops.
local function outstanding(keys, args)
  local m = redis.call('HMGET', keys[1], 'open', 'state', 'left')
  if m[1] ~= '1' or m[2] == 'completed' or m[2] == 'failed' or m[2] == 'cancelled' or not m[2] then
    return -1
  end
  return tonumber(m[3] or '0')
end
redis.register_function{function_name='sg2_outstanding', callback=outstanding, flags={'no-writes'}}
end
do
-- results_from: a page of a streamed request's outcomes, in part order, read while it runs; the
-- outcomes of the parts before the page are deleted, so that a reader that keeps up keeps the
-- results in Redis bounded (a windowed request's bounded memory, docs/protocol.md §6.14).
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] first: the index of the first part wanted. Asking from `first` says that the reader
-- holds every outcome below it: those records are deleted now. It must be at least the `first` of
-- the previous call (meta `tfirst`) and at most the meta `taken`   ARGV[2] at most this many parts
-- Returns {state, total, first, tag, body, tag, body, ...}: state as in the meta hash; total the
-- number of parts once no more can be added (finalized, or terminal), else -1; then per part from
-- `first`, in order: 'ok' and the result bytes, 'err' and the error record of a dead letter (or
-- of a terminal request's last failure), 'none' and '' for a part of a terminal request that
-- never ended (cancelled, or fail fast). The page stops before the first part not settled yet
-- (running, waiting for a retry, not yet delivered), so it may be empty. Meta `taken` becomes
-- the index after the page (never lower); the page stays readable until a call asks from past it,
-- so a call re-sent after a lost reply answers the same.
-- Errors "SGSTATE ..." when the request is unknown, or `first` is below records already deleted;
-- "SGINVALID ..." when it is not a streamed request or its results are discarded; "SGGAP ..."
-- when `first` is past `taken`.
local function results_from(keys, args)
  local m = redis.call('HMGET', keys[1], 'state', 'total', 'open', 'taken', 'tfirst', 'discard')
  local state = m[1]
  if not state then
    return redis.error_reply('SGSTATE the request is unknown (never submitted, or its retention ran out)')
  end
  if not m[3] then
    return redis.error_reply('SGINVALID results_from is for streamed requests (opened with open())')
  end
  if m[6] == '1' then
    return redis.error_reply('SGINVALID the results of this request are discarded (discard_results)')
  end
  local first, count = tonumber(args[1]), tonumber(args[2])
  if not first or first < 0 or first % 1 ~= 0 or not count or count < 1 then
    return redis.error_reply('SGINVALID first must be a whole number and count at least 1')
  end
  local taken, tfirst = tonumber(m[4] or '0'), tonumber(m[5] or '0')
  if first < tfirst then
    return redis.error_reply('SGSTATE results below index ' .. tfirst .. ' were taken and deleted already')
  end
  if first > taken then
    return redis.error_reply('SGGAP results from index ' .. taken .. ' were not taken before index ' .. first)
  end
  if first > tfirst then
    -- The reader holds every outcome below `first`: they go (a dead letter keeps its entry,
    -- pending, so that it can still be requeued; only its record goes).
    local fields = {}
    for i = tfirst, first - 1 do fields[#fields + 1] = i end
    local deleted = 0
    local i = 1
    while i <= #fields do
      local last = math.min(i + 999, #fields)
      deleted = deleted + redis.call('HDEL', keys[3], unpack(fields, i, last))
      redis.call('HDEL', keys[4], unpack(fields, i, last))
      i = last + 1
    end
    if deleted > 0 then redis.call('HINCRBY', keys[1], 'ntaken', deleted) end
    redis.call('HSET', keys[1], 'tfirst', first)
  end
  local terminal = state == 'completed' or state == 'failed' or state == 'cancelled'
  local total = tonumber(m[2] or '0')
  local known = -1
  if terminal or m[3] ~= '1' then known = total end
  local out = {state, known, first}
  local i = first
  while i < first + count and i < total do
    local r = redis.call('HGET', keys[3], i)
    if r then
      out[#out + 1] = 'ok'
      out[#out + 1] = r
    else
      local e = redis.call('HGET', keys[4], i)
      -- An error record is final for a dead letter (in the retry set at +inf) or once the request
      -- is terminal; otherwise the part still waits for a retry, or runs again.
      if e and (terminal or redis.call('ZSCORE', keys[6], '0-' .. (i + 1)) == 'inf') then
        out[#out + 1] = 'err'
        out[#out + 1] = e
      elseif terminal then
        out[#out + 1] = 'none'
        out[#out + 1] = ''
      else
        break
      end
    end
    i = i + 1
  end
  if i > taken then redis.call('HSET', keys[1], 'taken', i) end
  return out
end
redis.register_function('sg2_results_from', results_from)
end
do
-- register: enter a request in recovery's index before it is created, so that whatever happens to
-- its producer afterwards, recovery finds it. Run on the request's home shard.
-- KEYS[1] the active-request index (sorted set, score = when recovery should next look)
-- KEYS[2] the registration times (hash: key id -> ms)
-- KEYS[3] the id's lane request record on this shard (prelude.lua, "Lanes")
-- ARGV[1] request key id   ARGV[2] delay (ms) before recovery first looks at it   ARGV[3] its row in
-- the listing index (prelude.lua, "The listing index"; '' or absent: not listed)
-- Returns {added, now}, or the error "SGDUPLICATE ..." when a lane request has the id: added is 1 if this call entered it (0 if it was there), now the Redis time
-- (ms) of the registration. The producer must create the request before now + half the loading
-- ttl (the deadline it passes to submit_open, submit_small or stream_open): recovery drops a
-- registration whose request does not exist only once the loading ttl has passed since it was
-- registered (by any producer: each registration restarts that time), so a request can never be
-- created after its registration was dropped. Producers never take a registration back: it may
-- be another producer's (the same id submitted twice).
local function register(keys, args)
  if keys[3] and redis.call('EXISTS', keys[3]) == 1 then
    return redis.error_reply('SGDUPLICATE request id is already in use')
  end
  local now = sg_now()
  local added = redis.call('ZADD', keys[1], 'NX', now + tonumber(args[2]), args[1])
  -- The latest registration's time, not the first's: a producer's deadline counts from its own
  -- registration, and recovery must not drop the entry before that deadline has passed.
  redis.call('HSET', keys[2], args[1], now)
  sg_ix_add(sg_ix(keys[1]), args[1], args[3], now)
  return {added, now}
end
redis.register_function('sg2_register', register)
end
-- push: put token elements on a priority list of their shard, each with a wake-up on the shard's
-- bell; on the request's home shard, also make sure the request is in recovery's index.
-- KEYS[1] the priority list   KEYS[2] the shard's bell   KEYS[3] (home shard only) the active-request
-- index   KEYS[4] (home shard only) the registration times
-- ARGV[1] request key id   ARGV[2] next look (ms from now)   ARGV[3] 'first:<score>' (the push
-- that follows a submit, with the score its registration wrote: while that score is still there,
-- the next look is set to ARGV[2], however far; if recovery has looked since, only moved earlier)
-- or 'more' (the next look only ever moves earlier)   ARGV[4..] elements
-- KEYS[5], KEYS[6] (home shard only, optional) the shard's held records and hand-off offers
-- (prelude.lua, "Hand-offs"): given, an element of a request of its own keys pushed onto a priority
-- list goes to a slot that offered to take its priority (a reserved slot, or an idle worker's
-- standby), as that slot's take would have taken it, rather than onto the list: the slot acquires
-- it without a take.
-- The first push also lists the request in place of a purged request of its id that its
-- registration found listed (sg_ix_takeover).
-- Returns the number of elements pushed or handed. An element of a request that finished in the meantime is
-- refused by acquire when taken ('drop'), and the index entry by recovery, so a late or repeated
-- push is harmless; a push never silently does nothing.
local function push(keys, args)
  if keys[3] then
    local due = sg_now() + tonumber(args[2])
    local first = string.match(args[3], '^first:(%d+)$')
    if redis.call('ZADD', keys[3], 'NX', due, args[1]) == 0 then
      sg_rearm(keys[3], args[1], due, first)
    end
    -- The request exists: it may take the listing entry of a purged one of its id.
    if first then sg_ix_takeover(sg_ix(keys[3]), args[1], sg_now()) end
    -- A lane (key id "~...") is never registered: it is created in the step that indexes it.
    if string.sub(args[1], 1, 1) ~= '~' then redis.call('HSETNX', keys[4], args[1], sg_now()) end
  end
  local handed = 0
  -- (Not a group's queue: its requests' elements are taken with a group token, prelude.lua. Not a
  -- lane's token either, which recovery pushes: a lane's hand-off comes acquired, from lane_submit.)
  local prio = keys[6] and string.sub(args[1], 1, 1) ~= '~' and not string.find(keys[1], ':grp:', 1, true)
    and string.match(keys[1], ':p:(%d+)$')
  if prio then
    handed = sg_hand(keys[6], keys[5], tonumber(prio), keys[1], args, 4, sg_now(), function(_, _, element)
      return {keys[1], element}
    end)
  end
  return handed + sg_push(keys[1], keys[2], args, 4 + handed)
end

do
-- reopen: before requeue_dead reopens a failed request, enter it in recovery's index again and
-- mark the new lifecycle, so that a late `unindex` of the failed lifecycle leaves it there. Run on
-- the home shard, after the failed lifecycle's own steps (finish_index, seal, unindex) are done.
-- KEYS[1] active-request index   KEYS[2] registration times   KEYS[3] the request's finish marks
-- ARGV[1] request key id   ARGV[2] delay (ms) before recovery first looks at it
-- ARGV[3] the lifecycle about to start (the failed one's plus one)
-- Returns 1 if this call entered the request in the index, 0 if it was there.
local function reopen(keys, args)
  local now = sg_now()
  -- Kept (no expiry) while the reopened request runs; its own finish_index sets one.
  redis.call('HSET', keys[3], 'o', args[3])
  redis.call('PERSIST', keys[3])
  -- Its downstreams (if any) wait for this lifecycle's end: their set is kept while it runs.
  redis.call('PERSIST', sg_shard_key(keys[1], 'dn:' .. args[1]))
  redis.call('HSETNX', keys[2], args[1], now)
  sg_ix_reopen(sg_ix(keys[1]), args[1])
  return redis.call('ZADD', keys[1], 'NX', now + tonumber(args[2]), args[1])
end
redis.register_function('sg2_reopen', reopen)
end
do
-- arm: ask recovery to look at a request by a given time (only ever earlier than planned): before a
-- step whose follow-up (a push) its caller might not live to make, and when a parked token should
-- be woken for a retry.
-- KEYS[1] the active-request index (home shard)   KEYS[2] the looks armed before a step
-- ARGV[1] request key id   ARGV[2] in how long (ms; relative, so no client clock is involved)
-- ARGV[3] (recovery only, optional) the score its claim wrote: if it is still there, the look is
-- set to ARGV[2] even if that is later (sg_rearm)   ARGV[4] (optional) 'step': the look comes
-- before a step, which is to run before it is due; it is kept in KEYS[2] too, so that a census
-- that begins before it is due (and so maybe before the step) does not cancel it (claim_due,
-- sg_rearm)
-- Returns when the look is due (ms, Redis time) if the request is indexed, else 0.
local function arm(keys, args)
  local due = sg_now() + tonumber(args[2])
  if sg_rearm(keys[1], args[1], due, args[3], keys[2]) == 0 then return 0 end
  if args[4] == 'step' then redis.call('ZADD', keys[2], 'GT', due, args[1]) end
  return due
end
redis.register_function('sg2_arm', arm)
end
-- lane_acquire: acquire for a lane token (prelude.lua, "Lanes"): the slot presents the lane token
-- element it took and gets a batch of lane entries, which may belong to different requests.
-- KEYS[1..6] the lane's keys (as a request's, prelude.lua)   KEYS[7] the shard's active index
-- KEYS[8] the shard's looks armed before a step
-- ARGV[1] the lane's key id   ARGV[2] token k   ARGV[3] epoch   ARGV[4] holder   ARGV[5] consumer
-- ARGV[6] batch: how many entries at most ("<n>|flat": flat entries)   ARGV[7] the records' key prefix ("<ns>:{<ns>.q<s>}:s:")
-- Returns {'run', entry, ...}: entry = {entry id, index, payload, attempt, request key id,
--          lifecycle, the record's pol, and, for a request's first entry, its queue wait ms}, or
--          with "<n>|flat" these eight items in the reply itself, the eighth -1 when absent;
--         {'park', wake}, {'drop'}, {'stale'} as acquire.
-- Entries of requests no longer live (cancelled, failed fast, reopened) are acked away unrun.
-- A call re-sent after its reply was lost (the token held by this holder under this epoch) hands
-- out again what the first handed out and is still live, or else hands out afresh.
local function lane_acquire(keys, args)
  local m = redis.call('HMGET', keys[1], 't' .. args[2], 'extra')
  local tok = m[1]
  if not tok then return {'drop'} end
  local f = sg_split(tok)
  local now = sg_now()
  local want, flat = sg_want(args[6])
  if f[1] == 'h' and f[2] == args[3] and f[3] == args[4] and f[5] ~= '' then
    -- The same call re-sent after its reply was lost: the entries it handed out, again. Those of
    -- requests no longer live (cancelled meanwhile) are acked away as a hand-out does, and the
    -- token then holds exactly the rest, which the slot's ack presents (sg_holds). When none is
    -- left, the hand-out starts afresh: answering `stale` would leave the token held by a live
    -- slot that forgets it.
    local reply, seen, ids, dropped = {'run'}, {}, {}, {}
    for _, id in ipairs(sg_ids(f[5])) do
      local entry = redis.call('XRANGE', keys[2], id, id)[1]
      local pending = redis.call('XPENDING', keys[2], 'g', id, id, 1)[1]
      if entry and pending then
        if sg_lane_entry(reply, flat, args[7], id, entry[2], tonumber(pending[4]), now, seen, sg_int(now)) then
          ids[#ids + 1] = id
        else
          dropped[#dropped + 1] = id
        end
      end
    end
    sg_lane_drop(keys, dropped)
    sg_lane_list_started(args[7], seen)
    if #ids > 0 then
      if #ids < #sg_ids(f[5]) then
        redis.call('HSET', keys[1], 't' .. args[2], 'h|' .. f[2] .. '|' .. f[3] .. '|' .. f[4] .. '|' .. table.concat(ids, ','))
      end
      return reply
    end
  elseif f[1] ~= 'q' or f[2] ~= args[3] then
    return {'stale'}
  end
  return sg_lane_next(keys, args[2], args[3], args[4], args[5], now, m[2], want, args[7], keys[7], keys[8], flat)
end

-- give_back: push a token's new element back (a slot at the end of its quantum, after ack answered
-- 'requeue'; recovery after reclaim), and end the take's record, in one step: while the record is
-- there, the push has not happened, so whoever finds it after its slot died (recovery) knows that
-- the token still needs pushing.
-- The elements are pushed whether or not the record is still there: an element is only ever issued
-- to be pushed, and pushing one that is no longer current is harmless (acquire refuses it), while
-- not pushing the current one would lose the token (recovery may have ended the record, or the slot
-- itself, after a newer epoch was issued).
-- KEYS[1] the shard's held records   KEYS[2] the shard's bell   KEYS[3] the priority list
-- ARGV[1] holder   ARGV[2] the take id its record must carry to be ended   ARGV[3..] elements
-- A group token the record names goes back (prelude, sg_held_end): parked if its group has no
-- other work, and then woken by the push of the elements to its group's queue.
-- Returns the number of elements pushed.
local function give_back(keys, args)
  local held = redis.call('HGET', keys[1], args[1])
  if held then
    local f = sg_split(held)
    if f[4] == args[2] then
      redis.call('HDEL', keys[1], args[1])
      sg_held_end(sg_shard_key(keys[1], ''), f)
    end
  end
  return sg_push(keys[3], keys[2], args, 3)
end

do
-- take: a worker slot takes the token element of the highest priority waiting on a shard, and
-- records that it holds it (`held`), in one step: a token is never only in a reply on the wire or
-- in a process's memory, so a slot that dies right after taking it loses nothing (its worker's
-- death is noticed by `beat`, and recovery reclaims what the record names).
-- A lane's token (key id "~<shard>.<priority>") is acquired in the same call: the lane's keys are
-- in this shard's slot, so the slot gets its first batch without an `acquire` round trip.
-- KEYS[1] the shard's held records (hash: holder -> "<element>|<take id>|<list>")   KEYS[2] the shard's bell
-- KEYS[3] the shard's active index   KEYS[4] the shard's looks armed before a step
-- KEYS[5] the shard's pauses (hash: 'all' or a priority -> 1; `Admin::pause`)
-- ARGV[1] holder "<worker>/<slot>"   ARGV[2] this take's id (unique per slot)   ARGV[3] the id of
-- the slot's previous take on this shard ('' if none): its record, if still there, is done with
-- ARGV[4] '1' when the slot was woken by a bell it popped itself (else this call pops one, so that
-- bells and elements stay about even)
-- ARGV[5] the worker's consumer name   ARGV[6] the first batch's size ("<n>|flat": a lane's, flat, lane_acquire)
-- ARGV[7] the shard's lane key prefix ("<ns>:{<ns>.q<s>}:lane:")   ARGV[8] its records' key prefix
-- ARGV[9] the shard's priority list prefix ("<ns>:{<ns>.q<s>}:p:"): the lists, 99 down to 0, are
-- named here rather than passed, since a hundred key arguments cost more than the pop
-- A group's token (element "^<G>|<k>|<epoch>", prelude "Tenant groups") brings the group's
-- highest-priority request element, popped from its queue in the same call: the record then names
-- both ("<element>|<take id>|<queue>|<G>|<k>|<epoch>"), and the reply the queue and the request's
-- element. Stale group elements, and group tokens that find no work (they park), are passed over:
-- up to SG_TAKE_POPS elements per call. Group tokens whose rate-limit wait is over are queued again
-- first (sg_group_wake); when nothing was taken and one still waits: {'wait', ms}, in how many ms
-- its wait ends (the slot asks again then, rather than after an idle poll).
-- The record this slot's previous take left (ARGV[3]) ends here, and with it the group token it
-- held, if any, goes back (prelude, sg_held_end).
-- ARGV[10] (optional; '' or absent: 0) the floor: the lowest priority this take pops. A slot kept
-- for higher priorities (`WorkerBuilder::reserve`) takes with its floor, and finds nothing while
-- only lower priorities wait.
-- ARGV[10] may also be "<floor>|<next take id>|<ms>": a slot's offer of a hand-off, for as long as
-- ms (a library older than hand-offs refuses it as a floor, rather than misread it). A reserved slot
-- offers with its floor; a worker's standby slot, one idle slot per worker, with floor 0 (any
-- priority; prelude.lua, "Hand-offs"):
-- when this take finds nothing, the slot waits for one (prelude.lua, "Hand-offs"): it is
-- registered in the shard's `wait` hash, holder -> "<floor>|<next take id>|<consumer>|<batch>|<until
-- ms>", and its hand list is emptied. Every take ends the slot's offer first: a slot offers only
-- while it waits.
-- KEYS[6] and ARGV[11..] (optional) a token to give back first, as `give_back` does it: a slot at
-- its quantum's end gives its token back and takes again in one call. KEYS[6] the list to push to,
-- ARGV[11] the take id the slot's record must carry to be ended, ARGV[12..] the elements. A re-sent
-- call whose first copy took something (its record carries ARGV[2]) gives nothing back again; one
-- whose first copy took nothing pushes the elements again, which is harmless (give_back.lua).
-- Returns {list, element}, {list, element, 'one'} for a request in a rate-limited group (the slot
-- runs one part under it and gives it back: each part's start is charged to the group's bucket),
-- {list, element, acquired} for a lane token (`acquired` is what
-- `lane_acquire` returns), {} when every list is empty, or {'paused'} when an operator paused the
-- namespace or every priority (nothing taken; the slot waits an idle poll and asks again). The same call re-sent (the same take
-- id: its first reply was lost) returns the element it took the first time, without a batch: the
-- slot then acquires it, and `lane_acquire` hands out the same entries again. So does a take whose
-- id is the one a hand-off recorded (the id the slot's last take offered): the slot that did not
-- see the hand list's message gets the token handed to it this way. And so does an offering take
-- re-sent (its first reply lost) that finds the token handed under the id it offered: the record
-- is rewritten under this take's id, which the slot will hold it by.
local SG_TAKE_POPS = 16

local function take(keys, args)
  local holder, id = args[1], args[2]
  local floor, offer, lasts = 0, nil, nil
  if (args[10] or '') ~= '' then
    local text = args[10]
    local f, o, ms = string.match(text, '^([^|]*)|(%d+)|(%d+)$')
    if f then text, offer, lasts = f, o, tonumber(ms) end
    floor = tonumber(text)
    if not floor or floor ~= math.floor(floor) or floor < 0 or floor > 99 then
      return redis.error_reply('SGINVALID take\'s floor must be a priority from 0 to 99, not ' .. args[10])
    end
    -- An offer of 0 ms would set the `wait` hash's TTL to 0, ending every slot's offer.
    if lasts == 0 then
      return redis.error_reply('SGINVALID take\'s offer must last at least 1 ms, not ' .. args[10])
    end
  end
  local shard = sg_shard_key(keys[1], '')
  redis.call('HDEL', shard .. 'wait', holder)
  local held = redis.call('HGET', keys[1], holder)
  if keys[6] and (args[11] or '') ~= '' and not (held and sg_split(held)[4] == id) then
    give_back({keys[1], keys[2], keys[6]}, {holder, args[11], unpack(args, 12)})
    held = redis.call('HGET', keys[1], holder)
  end
  local previous = nil
  if held then
    local f = sg_split(held)
    if offer and f[4] == offer then
      -- This offering take was re-sent, and a hand-off came under the id it offered: the token is
      -- this take's.
      f[4] = id
      held = table.concat(f, '|')
      redis.call('HSET', keys[1], holder, held)
    end
    if f[4] == id then
      -- A bell this slot popped was not for this token: a hand-off rang none, and a re-sent take's
      -- first copy balanced its own. It rings again for the element it was for (one too many, if
      -- this take was re-sent, wakes a slot that finds nothing).
      if args[4] == '1' then
        redis.call('LPUSH', keys[2], '1')
        redis.call('PEXPIRE', keys[2], SG_BELL_TTL_MS)
      end
      local one = nil
      if f[6] and redis.call('HEXISTS', sg_group_key(shard, f[6]), 'rate') == 1 then one = 'one' end
      return {f[5], sg_element(f[1], f[2], f[3]), one}
    end
    if f[4] ~= args[3] then
      -- A record this slot did not know it still had: keep it for recovery (reclaim), under a
      -- name no live slot uses.
      redis.call('HSET', keys[1], holder .. '/lost/' .. f[4], held)
    else
      previous = f
    end
  end
  -- The previous record ends whatever this take finds (the field is overwritten or deleted below).
  if previous then sg_held_end(shard, previous) end
  local lmpop = sg_lmpop_lists(args[9], floor)
  -- (A caller of before pauses passes four keys: it takes as if nothing were paused.)
  local pauses = keys[5] and redis.call('HGETALL', keys[5]) or {}
  local paused = nil
  if #pauses > 0 then
    paused = {}
    for i = 1, #pauses, 2 do paused[pauses[i]] = true end
    lmpop = not paused['all'] and sg_lmpop_unpaused(args[9], paused, floor)
    if not lmpop then
      if held then redis.call('HDEL', keys[1], holder) end
      -- A bell the slot popped stays for the elements waiting: the slot waits an idle poll.
      if args[4] == '1' then redis.call('LPUSH', keys[2], '1') end
      return {'paused'}
    end
  end
  local list, element, record, one = nil, nil, nil, nil
  local now = sg_now()
  sg_group_wake(shard, now)
  for _ = 1, SG_TAKE_POPS do
    local popped = redis.call(unpack(lmpop))
    if not popped then break end
    local f = sg_split(popped[2][1])
    if string.sub(f[1], 1, 1) ~= '^' then
      list, element = popped[1], popped[2][1]
      record = element .. '|' .. id .. '|' .. list
      break
    end
    local got = sg_group_take(shard, f, holder, now, paused)
    if got then
      list, element, one = got[1], got[2], got[3]
      record = element .. '|' .. id .. '|' .. list .. '|' .. string.sub(f[1], 2) .. '|' .. f[2] .. '|' .. f[3]
      break
    end
    -- The element passed over takes its bell along.
    redis.call('RPOP', keys[2])
  end
  if not element then
    if held then redis.call('HDEL', keys[1], holder) end
    -- A group token waiting for its rate limit: the slot asks again when the wait ends.
    local wait = sg_group_next_wake(shard, now)
    if wait then return {'wait', wait} end
    -- (The offer keeps the batch size as a number: a hand-off's batch travels packed, not as a
    -- reply, so it has nothing to gain from flat entries.)
    if offer then sg_hand_offer(shard, holder, floor, offer, args[5], sg_int(sg_want(args[6]) or 1), now, lasts) end
    return {}
  end
  redis.call('HSET', keys[1], holder, record)
  redis.call('PEXPIRE', keys[1], SG_HELD_TTL_MS)
  if args[4] ~= '1' then redis.call('RPOP', keys[2]) end
  local f = sg_split(element)
  local priority = string.match(f[1], '^~%d+%.(%d+)$')
  if not priority then return {list, element, one} end
  local base = args[7] .. priority
  local lane = {base, base .. ':s', base .. ':res', base .. ':err', base .. ':orph', base .. ':retry', keys[3], keys[4]}
  local acquired = lane_acquire(lane, {f[1], f[2], f[3], holder, args[5], args[6], args[8]})
  return {list, element, acquired}
end
redis.register_function('sg2_take', take)
end
do
-- untake: undo a take whose reply its slot never saw (the call failed, or a hand-off's message was
-- not read), at the slot's clean stop:
-- the element goes back to the tail of its list, where it was taken from, and the record ends.
-- KEYS[1] the shard's held records   KEYS[2] the shard's bell
-- ARGV[1] holder   ARGV[2] the take id
-- A lane's token was acquired in the same call (take.lua), which may have handed out a batch:
-- its record is kept for recovery under a name no live slot uses, and reclaim settles it (the
-- batch becomes orphans, the token is pushed again) as for a dead slot's.
-- Returns 1 if the take had happened (and is undone, or left to recovery), 0 if there is no record of it.
local function untake(keys, args)
  -- A hand-off the slot offered ends too (prelude.lua, "Hand-offs"); one made already is undone
  -- below as the take it stands for.
  redis.call('HDEL', sg_shard_key(keys[1], 'wait'), args[1])
  local held = redis.call('HGET', keys[1], args[1])
  if not held then return 0 end
  local f = sg_split(held)
  if f[4] ~= args[2] then return 0 end
  redis.call('HDEL', keys[1], args[1])
  if string.sub(f[1], 1, 1) == '~' then
    -- The HDEL may have emptied the hash, and the HSET then makes a new one: it takes the
    -- records' expiry as every take's write does.
    redis.call('HSET', keys[1], args[1] .. '/lost/' .. args[2], held)
    redis.call('PEXPIRE', keys[1], SG_HELD_TTL_MS)
    return 1
  end
  local len = redis.call('RPUSH', f[5], sg_element(f[1], f[2], f[3]))
  local gkey, p = sg_group_of_queue(f[5])
  if gkey then
    -- Back in its group's queue; the group token goes back with it (to this work).
    redis.call('ZADD', gkey .. ':w', p, p)
    sg_held_end(sg_shard_key(keys[1], ''), f)
    return 1
  end
  -- Onto an empty list: announced as sg_push announces, so that busy slots holding a lower
  -- priority give way at their batch's end rather than their quantum's.
  if len == 1 then sg_announce_up(f[5]) end
  redis.call('LPUSH', keys[2], '1')
  redis.call('PEXPIRE', keys[2], SG_BELL_TTL_MS)
  return 1
end
redis.register_function('sg2_untake', untake)
end
do
-- acquire: a worker slot presents a token element it took, and gets sub-requests to run.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] token number k   ARGV[3] token epoch   ARGV[4] holder (worker/slot)
-- ARGV[5] stream consumer name   ARGV[6] batch: how many entries at most, "<n>" or "<n>|flat",
-- and never more than the hold's share of the parts left: `left` / `limit`, rounded up (at least 1);
-- one for a rate-limited request
-- ARGV[7] retention (ms) and ARGV[8] completion channel, as ack's ARGV[7..8]: for a request this
-- call finishes at its deadline
-- ARGV[9] (optional) the tenant group whose queue the element was taken from ('' for none: a
-- shard's list). An element of a request of another group (or of none) is a copy left on a list by
-- an earlier request under the same id (purged since) whose epoch the token now has by chance
-- (epochs are Redis time, and run ahead of it by one per re-issue within a millisecond): 'stale'.
-- Accepted, a grouped request's copy on a shard's list would run without its group's token.
-- Returns {'run', policy, entry, ...}: the slot holds the token, with a batch of entries to run one
--          after another; policy = {max attempts, timeout ms, backoff base ms, backoff max ms,
--          token shards of the request[, queue wait ms[, deadline ms]]}: the queue wait is how
--          long the request waited since it became runnable (queued at its commit, or its
--          delay's end) when this call started it (state queued -> running), for the stats by
--          stage, else -1; the deadline, only for a request that has one, is in how many ms it
--          falls: the slot cancels the handlers still running then;
--          entry = {entry id, index, payload, attempt}, or with ARGV[6] "<n>|flat" the three items
--          entry id, payload, attempt in the reply itself (index = the id's sequence number - 1);
--         {'park', wake, S}: no work left to hand out (or none the request's rate limit lets
--          start now), the token waits in the request until there is (wake: in how many ms a retry
--          falls due or the rate limit has room, 0 if neither; S: the request's token shards, for
--          the slot's arm of that wake);
--         {'finished', state, lifecycle, sweep elements..., {'shards', S}}: as ack's, when the
--          request's deadline has passed and no other slot holds a batch of it: this call ended it
--          `failed` (`why` = `deadline`) and handed out nothing; S is its token shards, for the
--          steps after the finish ({'park', 0} while another slot holds one: its ack finishes);
--         {'drop'}: the request is finished, cancelled or unknown: forget the element;
--         {'stale'}: the element is not the token's current one (old epoch, or not queued, or
--          taken from a list of another group than the request's: ARGV[9]).
local function acquire(keys, args)
  local m = redis.call('HMGET', keys[1], 't' .. args[2], 'extra', 'state', 'maxatt', 'timeout', 'bbase', 'bmax', 'shards',
    'queued', 'eligible', 'dl', 'rate', 'tat', 'left', 'limit', 'grp')
  local tok = m[1]
  if not tok then return {'drop'} end
  if args[9] and (m[16] or '') ~= args[9] then return {'stale'} end
  local policy = {m[4] or '1', m[5] or '0', m[6] or '0', m[7] or '0', m[8] or '1'}
  local f = sg_split(tok)
  if f[1] == 'h' and f[2] == args[3] and f[3] == args[4] and f[5] ~= '' then
    -- The same slot presenting the same element again: a call re-sent after a reconnect whose
    -- first reply was lost. Hand out the entries it already holds instead of stranding them.
    if m[11] then policy[6], policy[7] = -1, tonumber(m[11]) - sg_now() end
    local reply = {'run', policy}
    local _, flat = sg_want(args[6])
    for _, id in ipairs(sg_ids(f[5])) do
      local entry = redis.call('XRANGE', keys[2], id, id)[1]
      local pending = redis.call('XPENDING', keys[2], 'g', id, id, 1)[1]
      if entry and pending and flat then
        reply[#reply + 1], reply[#reply + 2], reply[#reply + 3] = id, entry[2][2], tonumber(pending[4])
      elseif entry and pending then
        reply[#reply + 1] = {id, sg_index(id), entry[2][2], tonumber(pending[4])}
      end
    end
    if #reply > 2 then return reply end
  end
  if f[1] ~= 'q' or f[2] ~= args[3] then return {'stale'} end
  local now = sg_now()
  if sg_past_deadline(m[11], now) then
    local wait = sg_deadline_wait(keys, args[2], args[3])
    if wait then return wait end
    local out = sg_finish_deadline(keys, args[1], args[7] or '0', args[8] or '', now)
    out[#out + 1] = {'shards', m[8] or '1'}
    return out
  end
  local want, flat = sg_want(args[6])
  -- A hold's first batch is at most its share of the parts left: a slot that sized it from
  -- another request's handler times must not run a slow request's parts one after another while
  -- the request's other tokens find none.
  -- A rate-limited request's is one entry: an entry handed back unrun would stay spent from its rate.
  want = math.min(want or 1, math.max(math.ceil(tonumber(m[14] or '0') / tonumber(m[15] or '1')), 1))
  if m[12] then want = 1 end
  local next = sg_next(keys, args[2], args[3], args[4], args[5], now, m[2], want, m[12], m[13], flat)
  if next[1] == 'park' then
    -- The slot has no policy of the request yet: the shards tell it where to arm the wake.
    next[3] = m[8] or '1'
    return next
  end
  if next[1] ~= 'run' then return next end
  if m[3] == 'queued' then
    redis.call('HSET', keys[1], 'state', 'running', 'started', now)
    local since = math.max(tonumber(m[9] or now), tonumber(m[10] or '0'))
    policy[6] = math.max(now - since, 0)
  end
  if m[11] then
    policy[6] = policy[6] or -1
    policy[7] = tonumber(m[11]) - now
  end
  table.insert(next, 2, policy)
  return next
end
redis.register_function('sg2_acquire', acquire)
end
do
-- ack: a slot reports the outcomes of the batch it was handed and, in the same step, either gets
-- the next batch (it keeps its token), or gives the token back, or learns that the request is
-- finished.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] token k   ARGV[3] epoch   ARGV[4] holder   ARGV[5] consumer
-- ARGV[6] 1 = continue with this request, 0 = give the token back (quantum used up, shutting down)
-- ARGV[7] retention (ms) of results once finished   ARGV[8] completion channel
-- ARGV[9] next batch: how many entries at most, "<n>" or "<n>|flat" (flat entries in a `run` reply, sg_next)
-- ARGV[10..] one group of five per entry of the batch, in the order it was handed out:
--   entry id, outcome, body, retry delay (ms), attempt
--   outcome 'ok': body = result bytes; 'retry' / 'dead': body = the error record (JSON: error,
--   attempts, permanent); 'skip': the entry did not run (shutdown, or a first batch past its
--   budget), it is handed out again first.
--   A dead letter stays pending, in the retry set at +inf, until requeue_dead or the retention.
-- Returns {'run', entry, ...} as acquire (without the policy; flat entries with "<n>|flat"); {'requeue', element, priority}:
--         push element back (give_back) onto the list of the request's priority now (an operator
--         may have changed it since the token was taken: reprioritize); {'park', wake} as
--         acquire; {'finished', state, lifecycle, sweep elements...}: the request just turned
--         terminal (completed, failed, or failed at its deadline: meta `dl`, `why` =
--         `deadline`); {'fenced'}: this slot no longer holds the token with exactly these
--         entries, so nothing was recorded (its worker was declared dead and the work moved on, or the
--         request was cancelled).
-- A windowed request (meta `window` W > 0), or one whose results are being taken (`taken` > 0,
-- results_from), acks its `ok` entries one by one, so that it knows which this call settled: only
-- those store their result, and not when the results are discarded or the part's outcome was
-- taken already (a requeued dead letter): they count in `discarded` instead. One that only
-- discards its results (`discard`) acks them together, as any request does, and counts in
-- `discarded` what that `XACK` settled. A windowed request also trims its stream every W/4
-- settled acks (meta `acks`), see window_trim.

-- The last entry id delivered to the group (`0-0` if none).
local function window_delivered(keys)
  local group = redis.call('XINFO', 'GROUPS', keys[2])[1]
  for i = 1, #group, 2 do
    if group[i] == 'last-delivered-id' then return group[i + 1] end
  end
  return '0-0'
end

-- Trims a windowed request's stream below its oldest pending entry (or, with none pending, past
-- the last one delivered): never an entry that is pending (running, waiting for a retry, an
-- orphan, a dead letter) or not yet delivered. When a pending entry holds the trim back (a dead
-- letter, a retry, a slow part) and more than W/2 acked entries stay above it, meta `xdel` = 1
-- tells the acks to XDEL the entries they settle one by one until a later trim finds the stream
-- short again.
local function window_trim(keys, window)
  local pending = redis.call('XPENDING', keys[2], 'g')
  local delivered = window_delivered(keys)
  local oldest = pending[2]
  if not oldest and delivered ~= '0-0' then oldest = '0-' .. (sg_index(delivered) + 2) end
  if oldest then redis.call('XTRIM', keys[2], 'MINID', oldest) end
  local undelivered = tonumber(redis.call('HGET', keys[1], 'total') or '0')
  if delivered ~= '0-0' then undelivered = undelivered - sg_index(delivered) - 1 end
  local stuck = redis.call('XLEN', keys[2]) - tonumber(pending[1]) - math.max(undelivered, 0)
  local xdel = 0
  if stuck > window / 2 then xdel = 1 end
  redis.call('HSET', keys[1], 'xdel', xdel)
end

local function ack(keys, args)
  local k, epoch, holder = args[2], args[3], args[4]
  local m = redis.call('HMGET', keys[1], 't' .. k, 'extra', 'window', 'discard', 'taken', 'xdel', 'prio', 'dl', 'rate', 'tat')
  local tok = m[1]
  if not tok then return {'fenced'} end
  local ids = {}
  for i = 10, #args, 5 do ids[#ids + 1] = args[i] end
  -- The token check is the fence: XACK alone would accept entries that were claimed by another.
  if not sg_holds(tok, epoch, holder, table.concat(ids, ',')) then
    return {'fenced'}
  end
  local now = sg_now()
  local extra = tonumber(m[2] or '0')
  local acked, results, errors, cleared = {}, {}, {}, {}
  local failed = 0
  local window, discard, taken = tonumber(m[3] or '0'), m[4] == '1', tonumber(m[5] or '0')
  local one_by_one = window > 0 or taken > 0
  local settled_ok, discarded, deleted = 0, 0, {}
  -- A part that succeeds clears the error record an earlier attempt left, if there is any: with
  -- no errors hash, there is none to clear.
  local errored = redis.call('EXISTS', keys[4]) == 1
  for i = 10, #args, 5 do
    local id, outcome, body, index = args[i], args[i + 1], args[i + 2], sg_index(args[i])
    -- The part's field in the results and errors hashes, as text: Redis would format a Lua
    -- number as a double (%.17g), the costliest step of an argument. Small indices are
    -- remembered (sg_str).
    local name = sg_str(index)
    -- The outcome of a part below `taken` was handed to the reader already (a requeued dead
    -- letter that ran again): nothing more is recorded for it.
    local past = index < taken
    if outcome == 'ok' then
      if not one_by_one then
        acked[#acked + 1] = id
        if not discard then
          results[#results + 1] = name
          results[#results + 1] = body
        end
      elseif redis.call('XACK', keys[2], 'g', id) == 1 then
        settled_ok = settled_ok + 1
        if discard or past then
          discarded = discarded + 1
        else
          results[#results + 1] = name
          results[#results + 1] = body
        end
        if m[6] == '1' then deleted[#deleted + 1] = id end
      end
      if errored and not past then cleared[#cleared + 1] = name end
      if args[i + 4] ~= '1' then
        -- Succeeded after retries: kept in the record, which the error record no longer is.
        redis.call('HINCRBY', keys[1], 'retried', 1)
        if tonumber(args[i + 4]) > tonumber(redis.call('HGET', keys[1], 'maxseen') or '1') then
          redis.call('HSET', keys[1], 'maxseen', args[i + 4])
        end
      end
    elseif outcome == 'dead' then
      -- A dead letter stays pending, parked in the retry set at +inf (never due), so that
      -- requeue_dead can hand it out again with its payload. It counts as done once: only if it is
      -- pending and was not a dead letter already.
      local pending = redis.call('XPENDING', keys[2], 'g', id, id, 1)[1]
      if pending and redis.call('ZADD', keys[6], 'inf', id) == 1 then failed = failed + 1 end
      if not past then
        errors[#errors + 1] = name
        errors[#errors + 1] = body
      end
    elseif outcome == 'retry' then
      -- Stays pending (its payload with it) until sg_take_work claims it again when due.
      redis.call('ZADD', keys[6], now + tonumber(args[i + 3]), id)
      if not past then
        errors[#errors + 1] = name
        errors[#errors + 1] = body
      end
      extra = extra + 1
    else
      -- Skipped: it did not run, so the delivery it had does not count as an attempt.
      redis.call('XCLAIM', keys[2], 'g', args[5], 0, id, 'RETRYCOUNT', math.max(tonumber(args[i + 4]) - 1, 0), 'JUSTID')
      redis.call('RPUSH', keys[5], id)
      extra = extra + 1
    end
  end
  if extra ~= tonumber(m[2] or '0') then redis.call('HSET', keys[1], 'extra', extra) end
  if #results > 0 then redis.call('HSET', keys[3], unpack(results)) end
  if #cleared > 0 then redis.call('HDEL', keys[4], unpack(cleared)) end
  if #errors > 0 then redis.call('HSET', keys[4], unpack(errors)) end
  if failed > 0 then redis.call('HINCRBY', keys[1], 'failed', failed) end
  -- `left` counts down by what this call really settled: entries acknowledged now (XACK counts
  -- only those still pending) and new dead letters.
  local settled = failed + settled_ok
  if #acked > 0 then
    -- Acked entries stay in the stream until census trims it (XTRIM MINID): cheaper than XDEL.
    local n = redis.call('XACK', keys[2], 'g', unpack(acked))
    settled = settled + n
    -- (Only `ok` entries are in `acked`: what a discarding request settled of them is discarded.)
    if discard then discarded = discarded + n end
  end
  if discarded > 0 then redis.call('HINCRBY', keys[1], 'discarded', discarded) end
  if #deleted > 0 then redis.call('XDEL', keys[2], unpack(deleted)) end
  if window > 0 and settled_ok > 0 then
    -- Every W/4 settled acks, the stream is trimmed: it holds about W entries whatever the
    -- request's size.
    local acks = redis.call('HINCRBY', keys[1], 'acks', settled_ok)
    local every = math.max(math.floor(window / 4), 1)
    if math.floor(acks / every) ~= math.floor((acks - settled_ok) / every) then window_trim(keys, window) end
  end
  if settled > 0 then
    if redis.call('HINCRBY', keys[1], 'left', -settled) <= 0
      and redis.call('HGET', keys[1], 'open') ~= '1' then
      local state = 'completed'
      if tonumber(redis.call('HGET', keys[1], 'failed')) > 0 then state = 'failed' end
      return sg_finish(keys, args[1], state, args[7], args[8], now, tonumber(k))
    end
  end
  if failed > 0 and redis.call('HGET', keys[1], 'failfast') == '1' then
    -- Fail fast: the first dead letter ends the request; the parts not yet run never will
    -- (unless its dead letters are requeued: then they run too).
    return sg_finish(keys, args[1], 'failed', args[7], args[8], now, tonumber(k))
  end
  if sg_past_deadline(m[8], now) then
    -- Past the request's deadline: what this batch settled is recorded; nothing more starts, and
    -- the last holder's ack finishes the request.
    return sg_deadline_wait(keys, k, epoch) or sg_finish_deadline(keys, args[1], args[7], args[8], now, tonumber(k))
  end
  if args[6] == '1' then
    local want, flat = sg_want(args[9])
    return sg_next(keys, k, epoch, holder, args[5], now, extra, want, m[9], m[10], flat)
  end
  return {'requeue', sg_requeue(keys, args[1], k, epoch, now), tonumber(m[7])}
end
redis.register_function('sg2_ack', ack)
end
do
-- release: end a slot's record of holding a token it no longer holds (parked, finished, dropped,
-- fenced), when the slot moves to another shard or stops. (On its own shard the slot's next take
-- ends the record anyway.)
-- KEYS[1] the shard's held records
-- ARGV[1] holder   ARGV[2] the take id the record must carry
-- A group token the record names goes back (prelude, sg_held_end).
-- Returns 1 if a record was removed.
local function release(keys, args)
  local held = redis.call('HGET', keys[1], args[1])
  if not held then return 0 end
  local f = sg_split(held)
  if f[4] ~= args[2] then return 0 end
  redis.call('HDEL', keys[1], args[1])
  sg_held_end(sg_shard_key(keys[1], ''), f)
  return 1
end
redis.register_function('sg2_release', release)
end
do
-- holds: which of the tokens one worker's slots hold on one request they no longer hold (the
-- request finished or was cancelled, or their worker was declared dead and recovery moved the
-- tokens on): the worker cancels the handlers running under them. Reads only.
-- KEYS[1] meta hash (holds touches no other key of the request)
-- ARGV[1..] triples: token k, epoch, holder
-- Returns the token numbers no longer held by that holder at that epoch.
local function holds(keys, args)
  local lost = {}
  for i = 1, #args, 3 do
    local k, epoch, holder = args[i], args[i + 1], args[i + 2]
    local tok = redis.call('HGET', keys[1], 't' .. k)
    local f = tok and sg_split(tok)
    if not (f and f[1] == 'h' and f[2] == epoch and f[3] == holder) then lost[#lost + 1] = k end
  end
  return lost
end
redis.register_function{function_name='sg2_holds', callback=holds, flags={'no-writes'}}
end
do
-- finish_index: record a finished request's one event on the token side. It is the first of three
-- steps after a request turns terminal (then `seal` on the request's keys, then `unindex`), each
-- repeatable: whoever runs them (the finishing slot, or recovery when that slot died) the event is
-- written once per lifecycle, and the request stays in the index until it is sealed.
-- KEYS[1] active-request index   KEYS[2] events stream   KEYS[3] the request's priority list
-- KEYS[4] the request's finish marks (hash: `e` last lifecycle whose event was written, `o` last
-- lifecycle reopened by requeue_dead), kept for the retention after unindex   KEYS[5] the home
-- shard's bell (its downstreams `dn:<kid>` and the release outbox `rel` are the shard's too,
-- named from KEYS[1]: prelude.lua, "Dependencies between requests")
-- ARGV[1] request key id   ARGV[2] terminal state   ARGV[3] retention (ms)   ARGV[4] lifecycle
-- that finished   ARGV[5..] stale token elements to remove from the priority list
-- Returns 1 when this call recorded the event, 2 when it did and the request has downstreams (its
-- release is owed: in the outbox, for recovery to run if the caller does not, see rel_done), 0
-- when it had been recorded already (or the request has left the index, which it does only after
-- its event). The marks also keep the state the lifecycle ended in (`s`), for the release.
local function finish_index(keys, args)
  sg_sweep(keys[3], keys[5], args, 5)
  if not redis.call('ZSCORE', keys[1], args[1]) then return 0 end
  local lifecycle = tonumber(args[4])
  local written = redis.call('HGET', keys[4], 'e')
  if written and tonumber(written) >= lifecycle then return 0 end
  local retention = tonumber(args[3])
  redis.call('HSET', keys[4], 'e', args[4], 's', args[2])
  -- Until unindex shortens it, the marks must outlive the request's keys, which are held as long.
  redis.call('PEXPIRE', keys[4], retention + SG_FINISH_HOLD_MS)
  local now = sg_now()
  redis.call('XADD', keys[2], 'MINID', '~', math.max(now - retention, 0), '*',
    'rid', args[1], 'state', args[2])
  redis.call('PEXPIRE', keys[2], retention)
  local ix = sg_ix(keys[1])
  -- A request that ended before any push (a downstream failed at its commit by a failed upstream)
  -- never took the listing entry of a purged request of its id that its registration found
  -- (sg_ix_takeover): it takes it here, then moves to its terminal set.
  sg_ix_takeover(ix, args[1], now)
  sg_ix_finish(ix, args[1], args[2], now + retention, now)
  if redis.call('EXISTS', sg_shard_key(keys[1], 'dn:' .. args[1])) == 1 then
    redis.call('ZADD', sg_shard_key(keys[1], 'rel'), now + SG_REL_DELAY_MS, args[1])
    return 2
  end
  return 1
end
redis.register_function('sg2_finish_index', finish_index)
end
do
-- sweep: remove a finished request's stale elements from a list of a shard other than its home
-- (finish_index sweeps the home shard's), within the 1,000 elements nearest the head.
-- KEYS[1] the priority list   KEYS[2] the shard's bell
-- ARGV[1..] elements
-- Returns 1.
local function sweep(keys, args)
  sg_sweep(keys[1], keys[2], args, 1)
  return 1
end
redis.register_function('sg2_sweep', sweep)
end
do
-- seal: start a finished request's retention, once its event is recorded (finish_index). Until
-- then its keys are held (prelude.lua, SG_FINISH_HOLD_MS), so that a finish whose token side is
-- delayed (the finishing worker died or stalled) is neither lost nor left unannounced.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] the lifecycle that finished   ARGV[2] retention (ms)
-- Returns 1 when the request is that finished lifecycle, now sealed (again: a repeat never extends
-- the retention); 0 when it is not (reopened by requeue_dead, or gone).
local function seal(keys, args)
  local state = redis.call('HGET', keys[1], 'state')
  if state ~= 'completed' and state ~= 'failed' and state ~= 'cancelled' then return 0 end
  if sg_lifecycle(keys) ~= args[1] then return 0 end
  redis.call('HSET', keys[1], 'sealed', args[1])
  -- LT: only ever shortens (a key without expiry counts as infinite).
  for _, i in ipairs(sg_kept(state)) do redis.call('PEXPIRE', keys[i], args[2], 'LT') end
  return 1
end
redis.register_function('sg2_seal', seal)
end
do
-- unindex: the last step of a finish (after finish_index and seal): the request leaves recovery's
-- index, unless requeue_dead has reopened it since (the index entry then belongs to the new
-- lifecycle).
-- KEYS[1] active-request index   KEYS[2] the request's finish marks (finish_index)
-- KEYS[3] registration times   KEYS[4] the looks armed before a step (arm)
-- ARGV[1] request key id   ARGV[2] the lifecycle that finished   ARGV[3] retention (ms)
-- ARGV[4] its terminal state (optional): a listing row still live for the id is moved to that
-- state's set. A later submit of the id, refused as a duplicate while this request is retained,
-- registered (and so listed the id as live) before its refusal; nothing else would move it.
-- Returns 1 when the request left the index, 0 when it was not there, or the newer lifecycle a
-- requeue marked (reopen) when the entry stays for it: recovery then completes that requeue if it
-- was left half-way (requeue_dead with 'resume'). The marks stay for the retention, as the
-- meta does (`LT`: not extended by an unindex run again): a late finish_index of this lifecycle
-- (its finisher stalled while others completed the steps, and the request was requeued and so
-- indexed again) then finds its event written.
local function unindex(keys, args)
  local reopened = redis.call('HGET', keys[2], 'o')
  if reopened and tonumber(reopened) > tonumber(args[2]) then return tonumber(reopened) end
  -- Never later than the retention from the first unindex: an unindex run again (recovery's look
  -- at a refused duplicate's registration) must not keep the marks past the request's keys, or a
  -- later request of the id would be taken for this one's end (dag_link).
  redis.call('PEXPIRE', keys[2], args[3], 'LT')
  redis.call('HDEL', keys[3], args[1])
  redis.call('ZREM', keys[4], args[1])
  if args[4] and args[4] ~= '' then
    local ix = sg_ix(keys[1])
    if redis.call('ZSCORE', ix .. 'live', args[1]) then
      local now = sg_now()
      sg_ix_finish(ix, args[1], args[4], now + tonumber(args[3]), now)
    end
  end
  return redis.call('ZREM', keys[1], args[1])
end
redis.register_function('sg2_unindex', unindex)
end
do
-- claim_due: take the requests whose census is due, so that concurrent workers spread the work
-- and do not census the same request at once (a double census would still be safe: every
-- restore is a compare-and-set on the token's epoch).
-- KEYS[1] the active-request index   KEYS[2] the looks armed before a step (arm)
-- KEYS[3] (optional) the shard's release outbox (prelude.lua, "Dependencies between requests")
-- KEYS[4] (optional, shard 0 only, with KEYS[3]) the schedules' due set (sched_add.lua)
-- ARGV[1] at most this many requests (and releases, and schedules)   ARGV[2] claim (ms): others
-- skip them for this long
-- Returns {key id, claim, key id, claim, ...}: the claimed requests, each with the score its claim
-- set (ms), which recovery's re-arm compares (prelude.lua, sg_rearm). An armed look that is due
-- is served by this census (its step ran before it fell due); one that is not due yet stays, and
-- the next look is set no later than it. Also drops finished requests whose retention has passed
-- from the shard's listing index (prelude.lua, "The listing index"), a hundred at most.
-- With KEYS[3], the reply goes on with '' (no key id is empty), the Redis time now (ms), the
-- number of releases claimed and their upstreams' key ids (each due again when the claim runs
-- out, unless rel_done took it out first); with KEYS[4] too, then the names of the due schedules
-- it claimed, from which and the time the caller computes their ticks (each due again when the
-- claim runs out, unless sched_fire or sched_paid set it first). With two keys the reply is the
-- requests' pairs alone.
local function claim_due(keys, args)
  local now = sg_now()
  local limit = tonumber(args[1])
  local due = redis.call('ZRANGEBYSCORE', keys[1], '-inf', now, 'LIMIT', 0, limit)
  local out = {}
  local claim = now + tonumber(args[2])
  for _, rid in ipairs(due) do
    redis.call('ZADD', keys[1], claim, rid)
    local armed = redis.call('ZSCORE', keys[2], rid)
    if armed and tonumber(armed) <= now then redis.call('ZREM', keys[2], rid) end
    out[#out + 1] = rid
    out[#out + 1] = claim
  end
  sg_ix_trim(sg_ix(keys[1]), now, SG_IX_TRIM_CLAIM)
  if keys[3] then
    out[#out + 1] = ''
    out[#out + 1] = now
    local rels = redis.call('ZRANGEBYSCORE', keys[3], '-inf', now, 'LIMIT', 0, limit)
    out[#out + 1] = #rels
    for _, ukid in ipairs(rels) do
      redis.call('ZADD', keys[3], claim, ukid)
      out[#out + 1] = ukid
    end
  end
  if keys[4] then
    local names = redis.call('ZRANGEBYSCORE', keys[4], '-inf', now, 'LIMIT', 0, limit)
    for _, name in ipairs(names) do
      redis.call('ZADD', keys[4], claim, name)
      out[#out + 1] = name
    end
  end
  return out
end
redis.register_function('sg2_claim_due', claim_due)
end
do
-- census: recovery's look at one request, in chunks of tokens: run by any worker for a request it
-- claimed (claim_due), when the request asked to be looked at (registration, arm, a retry or a
-- delay falling due) and at least once per census interval.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] grace (ms): how long a token may be queued before recovery
-- checks that its element is in the list   ARGV[3] retention (ms)   ARGV[4] completion channel
-- (for a streamed request that expired unfinalized: it is cancelled here)   ARGV[5] first token
-- of this chunk   ARGV[6] tokens per chunk   ARGV[7] the next look (ms) when nothing in this
-- chunk is due sooner: the census interval for the first chunk, the previous chunk's look for
-- the others
-- Returns {'gone'}: no such request (expired, or not created yet: drop_gone); {'loading'};
--         {'finished', state, priority, shards, lifecycle, sealed, group}: the request is terminal but
--         still indexed, so the steps after its finish (finish_index, seal, unindex) are to be
--         completed; sealed is 1 when only unindex is left;
--         {'waiting', shards, look, ukid...}: a downstream waiting for its upstreams (its tokens parked,
--         nothing of it can be lost): look again in `look` ms (at its deadline, or an hour), and
--         check that the upstreams listed (those not ended, by its fields) still exist: their
--         releases open it, and one that vanished without a release is settled as gone;
--         or {'ok', priority, shards, next, look, push, check, held}: next: the first token of the
--         next chunk (-1 after the last); look: in how many ms the request wants its next look,
--         counting this chunk and ARGV[7] (the last chunk's is the request's); push: elements of
--         woken tokens, to push now; check: elements queued longer than the grace, whose presence
--         in their list must be verified (verify; the look comes again after as long as the
--         oldest has waited, since verify may not be able to tell yet); held: {k, epoch, holder}
--         of every held token, for recovery to check that the holder's worker lives. Token k's
--         elements belong on shard (home + k) % shards; with a tenant group (the last item, ''
--         for none), on the group's shard, in the group's queue.
-- In the first chunk: a request past its deadline (meta `dl`) ends `failed`, `why` = `deadline`,
-- and one before it asks to be looked at then; a scheduled request whose time has come turns
-- queued; a streamed request past its expiry is cancelled; parked tokens are woken while work
-- waits for them; the stream is trimmed.
local function census(keys, args)
  local state = redis.call('HGET', keys[1], 'state')
  if not state then return {'gone'} end
  if state == 'loading' then return {'loading'} end
  local rid, grace = args[1], tonumber(args[2])
  local shards = redis.call('HGET', keys[1], 'shards') or '1'
  local prio = redis.call('HGET', keys[1], 'prio')
  local grp = redis.call('HGET', keys[1], 'grp') or ''
  if state == 'completed' or state == 'failed' or state == 'cancelled' then
    local lifecycle = sg_lifecycle(keys)
    local sealed = 0
    if redis.call('HGET', keys[1], 'sealed') == lifecycle then sealed = 1 end
    return {'finished', state, prio, shards, lifecycle, sealed, grp}
  end
  local now = sg_now()
  local from, count = tonumber(args[5]), tonumber(args[6])
  local look = tonumber(args[7])
  local push, check, held = {}, {}, {}
  local m = redis.call('HMGET', keys[1], 'eligible', 'open', 'open_deadline', 'ntok', 'npark', 'dl', 'rate', 'tat')
  if from == 0 then
    if m[6] then
      -- A request with a deadline: past it, it ends here if no hand-out ended it first (its
      -- tokens all parked, its parts all running long, or no worker at all); before it, the
      -- request is looked at no later than then.
      if sg_past_deadline(m[6], now) then
        -- Slots still holding batches ack within ms (their timers cancel their handlers), and
        -- the last of them finishes it; a grace after the deadline it ends here regardless. Held
        -- tokens are listed meanwhile, for the check that their holders live.
        if now < tonumber(m[6]) + grace then
          sg_each_token(keys, 0, tonumber(m[4] or '0'), function(k, tok)
            local f = sg_split(tok)
            if f[1] == 'h' then held[#held + 1] = {k, f[2], f[3]} end
          end)
        end
        if #held == 0 then
          local f = sg_finish_deadline(keys, rid, args[3], args[4], now)
          return {'finished', 'failed', prio, shards, f[3], 0, grp}
        end
        return {'ok', prio, shards, -1, math.max(tonumber(m[6]) + grace - now, 1), {}, {}, held, grp}
      end
      look = math.min(look, tonumber(m[6]) - now)
    end
    if state == 'waiting' then
      local ups = redis.call('HGET', keys[1], 'ups') or ''
      local wait_look = SG_WAITING_LOOK_MS
      if m[6] then wait_look = math.min(wait_look, tonumber(m[6]) - now) end
      local out = {'waiting', shards, math.max(wait_look, 1)}
      for ukid in string.gmatch(ups, '[^,]+') do
        local f = sg_dag_field(redis.call('HGET', keys[1], 'u:' .. ukid))
        if f and f[1] == 'w' then out[#out + 1] = ukid end
      end
      return out
    end
    if state == 'scheduled' then
      -- A delayed request waits with parked tokens; the first census after its time promotes it.
      local eligible = tonumber(m[1] or '0')
      if eligible > now then
        return {'ok', prio, shards, -1, eligible - now, {}, {}, {}, grp}
      end
      redis.call('HSET', keys[1], 'state', 'queued')
    end
    if m[2] == '1' and tonumber(m[3] or '0') > 0 then
      if tonumber(m[3]) < now then
        -- A streamed request whose producer never finalized it within its expiry: its input is
        -- incomplete, so it ends cancelled.
        redis.call('DEL', keys[6])
        local f = sg_finish(keys, rid, 'cancelled', args[3], args[4], now)
        return {'finished', 'cancelled', prio, shards, f[3], 0, grp}
      end
      look = math.min(look, tonumber(m[3]) - now)
    end
    -- Acked entries are not deleted one by one; drop every stream node older than the oldest
    -- entry still pending (or, with none pending, than the last one delivered).
    local group = redis.call('XINFO', 'GROUPS', keys[2])[1]
    local delivered = '0-0'
    for i = 1, #group, 2 do
      if group[i] == 'last-delivered-id' then delivered = group[i + 1] end
    end
    local oldest = redis.call('XPENDING', keys[2], 'g')[2]
    if not oldest and delivered ~= '0-0' then oldest = '0-' .. (sg_index(delivered) + 2) end
    if oldest then redis.call('XTRIM', keys[2], 'MINID', '~', oldest) end
    -- Parked tokens go back into circulation while there is work they could take: orphans, due
    -- retries, and entries never delivered (the stream's newest id past the group's last
    -- delivered one; XINFO's lag is unknown once entries were deleted, so compare ids).
    local work = redis.call('LLEN', keys[5]) + redis.call('ZCOUNT', keys[6], '-inf', now)
    local newest = redis.call('XREVRANGE', keys[2], '+', '-', 'COUNT', 1)[1]
    if newest and sg_index(newest[1]) > sg_index(delivered) then
      work = work + sg_index(newest[1]) - sg_index(delivered)
    end
    local woken = work
    if m[7] then
      -- Rate-limited: wake only as many tokens as parts may start now, and come back when more
      -- may (each woken token's hand-out takes what the limit then allows).
      local room, t, base, tau = sg_rate_room(m[7], m[8], now)
      woken = math.min(work, room)
      if work > woken then look = math.min(look, math.max(math.ceil(base + woken * t - tau - now), 1)) end
    end
    push = sg_unpark(keys, rid, woken, now)
    if tonumber(redis.call('HGET', keys[1], 'npark') or '0') > 0 then
      -- Still parked tokens: wake them when the next retry falls due.
      local due = sg_next_retry(keys, now)
      if due then look = math.min(look, due - now) end
    end
  end
  local ntok = tonumber(m[4] or '0')
  local to = math.min(from + count, ntok)
  sg_each_token(keys, from, to, function(k, tok)
    local f = sg_split(tok)
    if f[1] == 'q' then
      local since = tonumber(f[3] or '0')
      if since + grace <= now then
        check[#check + 1] = sg_element(rid, k, f[2])
        -- verify can only tell for sure that an element is missing once its list's tail has moved
        -- a grace past it; until then it may be there, or may never have been pushed (its pusher
        -- died). Look again after as long again as it has waited: a token never pushed is found
        -- within about twice the time its element would have waited in the list, at a cost of
        -- one look per doubling of that wait (at most one per census interval).
        look = math.min(look, math.max(grace, now - since))
      else
        look = math.min(look, since + grace - now)
      end
    elseif f[1] == 'h' then
      held[#held + 1] = {k, f[2], f[3]}
    end
  end)
  local next = to
  if to >= ntok then next = -1 end
  return {'ok', prio, shards, next, math.max(look, 1), push, check, held, grp}
end
redis.register_function('sg2_census', census)
end
do
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
redis.register_function('sg2_verify', verify)
end
do
-- restore: re-queue tokens whose element verify found missing, under a new epoch, but only if each
-- is still queued with the epoch that was checked: if a worker acquired it in the meantime (the
-- element was in flight), nothing happens, and a late push of the old element is refused by
-- acquire. Restoring therefore never makes a token too many.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2..] missing elements "<rid>|<k>|<epoch>"
-- Returns the new elements, to push onto the request's priority list.
local function restore(keys, args)
  local now = sg_now()
  local out = {}
  for i = 2, #args do
    local f = sg_split(args[i])
    local k, epoch = f[2], f[3]
    local tok = redis.call('HGET', keys[1], 't' .. k)
    if tok then
      local t = sg_split(tok)
      if t[1] == 'q' and t[2] == epoch then out[#out + 1] = sg_requeue(keys, args[1], k, epoch, now) end
    end
  end
  return out
end
redis.register_function('sg2_restore', restore)
end
do
-- reclaim: recovery's step for a token a dead worker's slot had taken (its `held` record named
-- element "<rid>|<k>|<epoch>"): put the token back in circulation if the slot's death left it out.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] k   ARGV[3] the epoch the slot took   ARGV[4] its holder
-- ARGV[5] (a slot's own reclaim) the deadline of its arm (sg_step_late: errors "SGLATE ..." past it;
--         0 or '': none)
-- ARGV[6] (optional) the tenant group whose queue the token was taken from ('' for none: a shard's
--         list or a lane's). A request whose group differs is another request under the same id
--         (a request's group never changes; an id is free again after a purge): the record does
--         not name its tokens, and it is left alone ({'none'}). Without this check, its queued token
--         would be re-issued onto a list of the record's kind: a grouped request's element on a
--         shard's list is taken without a group token, past its group's limit.
-- Returns {'push', element, priority}: push it (give_back, which also ends the record) onto the
--         list of the request's priority now (reprioritize may have changed it since the take) —
--         the token was taken and never acquired, or held by that slot (its batch becomes orphans,
--         run again first), or re-queued by the slot's last ack whose push (give_back) never ran
--         (a higher epoch, still queued: a newer element is issued, so that a push of the older
--         one that did happen is merely refused when taken);
--         {'finished', state, priority, shards, lifecycle, sealed, group}: the request is terminal (the
--         slot may have died between its finish and the steps after it: census's reply);
--         {'wake', in ms}: the token is parked (its slot parked it, then died before it asked for the
--         wake-up of a retry that falls due in that many ms): recovery is to look then (arm); a
--         parked token with work waiting now is woken at once ('push');
--         {'none'}: nothing to do (parked with no retry waiting, held by another, the request is
--         gone, or it is another request under the same id: ARGV[6]).
local function reclaim(keys, args)
  local late = sg_step_late(args[5])
  if late then return late end
  local rid, k, epoch, holder = args[1], args[2], args[3], args[4]
  local t = redis.call('HMGET', keys[1], 't' .. k, 'grp', 'prio')
  if args[6] and (t[2] or '') ~= args[6] then return {'none'} end
  local tok = t[1]
  if not tok then
    local m = redis.call('HMGET', keys[1], 'state', 'prio', 'shards', 'sealed', 'grp')
    if m[1] == 'completed' or m[1] == 'failed' or m[1] == 'cancelled' then
      local lifecycle = sg_lifecycle(keys)
      local sealed = 0
      if m[4] == lifecycle then sealed = 1 end
      return {'finished', m[1], m[2], m[3] or '1', lifecycle, sealed, m[5] or ''}
    end
    return {'none'}
  end
  local f = sg_split(tok)
  local now = sg_now()
  local prio = tonumber(t[3])
  if f[1] == 'h' and f[2] == epoch and f[3] == holder then
    for _, id in ipairs(sg_ids(f[5])) do sg_orphan(keys, id) end
    -- A lane token's running marks (sg_lane_marks) went with its batch.
    redis.call('HDEL', keys[1], 'm' .. k)
    return {'push', sg_requeue(keys, rid, k, f[2], now), prio}
  end
  if f[1] == 'q' and tonumber(f[2]) >= tonumber(epoch) then
    return {'push', sg_requeue(keys, rid, k, f[2], now), prio}
  end
  if f[1] == 'p' then
    -- Parked by the slot, which died before it asked for a wake-up: wake it now if work waits (an
    -- orphan, a retry due), else when the next retry falls due.
    if redis.call('LLEN', keys[5]) + redis.call('ZCOUNT', keys[6], '-inf', now) > 0 then
      redis.call('HINCRBY', keys[1], 'npark', -1)
      return {'push', sg_requeue(keys, rid, k, f[2], now), prio}
    end
    local due = sg_next_retry(keys, now)
    if due then return {'wake', math.max(due - now, 1)} end
  end
  return {'none'}
end
redis.register_function('sg2_reclaim', reclaim)
end
do
-- drop_gone: what recovery does with an index entry whose request does not exist (census said
-- 'gone'): its producer died before creating it, or it was never created (the id was in use), or
-- its keys expired (a loading ttl, or the retention of a finish nobody sealed). The entry is
-- dropped only once the loading ttl has passed since it was registered, so that no producer can
-- still create the request (its deadline, register.lua, is half that); until then the next look
-- is set to that time.
-- KEYS[1] active-request index   KEYS[2] registration times   KEYS[3] the request's finish marks
-- KEYS[4] the looks armed before a step (arm)
-- ARGV[1] request key id   ARGV[2] the loading ttl (ms)   ARGV[3] the score recovery's claim wrote
-- (sg_rearm: a push that came since keeps the look it set)   ARGV[4] the grace (ms)
-- Returns 1 when the entry was dropped, 0 when it was kept.
local function drop_gone(keys, args)
  local now = sg_now()
  local registered = tonumber(redis.call('HGET', keys[2], args[1]) or '0')
  local ttl, grace = tonumber(args[2]), tonumber(args[4])
  local drop_at = registered + ttl
  if drop_at > now then
    -- Until its deadline (half the ttl, plus a grace for clocks) the request may still be created,
    -- its creator dying before it pushes: look again soon. After it, only the drop is left.
    local next = drop_at
    if now < registered + ttl / 2 + grace then next = now + grace end
    sg_rearm(keys[1], args[1], next, args[3], keys[4])
    return 0
  end
  redis.call('ZREM', keys[1], args[1])
  redis.call('ZREM', keys[4], args[1])
  redis.call('HDEL', keys[2], args[1])
  -- A downstream linked to it was refused at its submit (it was not created): its set goes too.
  redis.call('DEL', keys[3], sg_shard_key(keys[1], 'dn:' .. args[1]))
  sg_ix_remove(sg_ix(keys[1]), args[1], now)
  return 1
end
redis.register_function('sg2_drop_gone', drop_gone)
end
do
-- cancel: end a request now. Its tokens are withdrawn (queued elements swept, held tokens fenced:
-- their holders' acks record nothing and their heartbeats report the hold lost, which cancels
-- the handlers' contexts), its queued parts never run, and it gets one terminal record, state
-- `cancelled`, and one event, like any finish.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] retention (ms)   ARGV[3] completion channel
-- Returns {'finished', 'cancelled', lifecycle, sweep elements...} as ack does, or {'already', state}
-- when the request was terminal before (or loading: it is discarded), or {'unknown'}.
local function cancel(keys, args)
  local state = redis.call('HGET', keys[1], 'state')
  if not state then return {'unknown'} end
  if state == 'completed' or state == 'failed' or state == 'cancelled' then return {'already', state} end
  if state == 'loading' then
    redis.call('DEL', keys[1], keys[2])
    return {'already', 'loading'}
  end
  redis.call('DEL', keys[6])
  return sg_finish(keys, args[1], 'cancelled', args[2], args[3], sg_now())
end
redis.register_function('sg2_cancel', cancel)
end
do
-- requeue_dead: hand a request's dead letters out again, each with a fresh set of attempts. A
-- running request simply gets the work back; a failed one is reopened (state `running`, keys
-- persisted again, its full set of tokens re-created under epochs above any earlier one) and will
-- end with a new terminal record and event.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] the lifecycle to reopen a failed request as ('' when the caller
-- has not marked one yet, see below)   ARGV[3] the deadline of the caller's arm (sg_step_late)
-- ARGV[4] 'resume' (recovery): complete a requeue whose caller died after `reopen` marked ARGV[2],
-- only if the request is still the failed lifecycle just before it; otherwise do nothing ({0, 0})
-- Returns {n, reopened, elements...}: how many were requeued; the new lifecycle when a failed
-- request was reopened, else 0; and token elements to push (re-created or woken tokens). A
-- downstream that failed because of an upstream (`why` = `upstream:<ukid>`) has no dead letter:
-- it is reopened (n = 0) once its gate is open again (prelude.lua, "Dependencies between
-- requests"), and is otherwise left as it is ({0, 0}). For a
-- failed request, nothing changes and the reply says what to do first:
--   {-1, lifecycle}: its finish is not sealed yet (its event may be unwritten): complete the steps
--   after that finish (finish_index, seal, unindex) and call again;
--   {-2, next lifecycle}: call `reopen` on the home shard with that lifecycle (it indexes the
--   request again and marks the lifecycle, so that no late unindex of the failed one removes it),
--   then call again with ARGV[2] set to it.
-- Errors "SGSTATE ..." when the request cannot be requeued (unknown, loading, completed,
-- cancelled, failed at its deadline, or its retention ran out), "SGLATE ..." past the deadline.
local function requeue_dead(keys, args)
  local late = sg_step_late(args[3])
  if late then return late end
  local m = redis.call('HMGET', keys[1], 'state', 'ntok', 'limit', 'sealed', 'total', 'maxep', 'why', 'upw',
    'upf', 'onup', 'open')
  local state = m[1]
  if state == 'failed' and m[7] == 'deadline' then
    -- It would end again at once: its deadline has passed for good.
    return redis.error_reply('SGSTATE the request ended at its deadline: submit it again instead')
  end
  if args[4] == 'resume' then
    if state ~= 'failed' then return {0, 0} end
    local lifecycle = sg_lifecycle(keys)
    if m[4] ~= lifecycle or args[2] ~= sg_int(tonumber(lifecycle) + 1) then return {0, 0} end
  end
  if state ~= 'failed' and state ~= 'running' and state ~= 'queued' then
    return redis.error_reply('SGSTATE only a failed, running or queued request has dead letters to requeue')
  end
  local dead = redis.call('ZRANGEBYSCORE', keys[6], 'inf', 'inf')
  local n = #dead
  -- A downstream failed because of an upstream has no dead letter, and reopens once its gate is
  -- open again (the upstream was requeued and completed). With nothing to requeue, nothing is
  -- asked of the caller either (a reopen asked for and not carried out would keep it indexed).
  if n == 0 and not (state == 'failed' and sg_dag_reopenable(m[7], m[8], m[9], m[10])) then return {0, 0} end
  local lifecycle = sg_lifecycle(keys)
  if state == 'failed' then
    if m[4] ~= lifecycle then return {-1, lifecycle} end
    local next = sg_int(tonumber(lifecycle) + 1)
    if args[2] ~= next then return {-2, next} end
  end
  local now = sg_now()
  for _, id in ipairs(dead) do
    -- RETRYCOUNT 0: the next delivery counts as attempt 1 again.
    redis.call('XCLAIM', keys[2], 'g', 'requeue', 0, id, 'RETRYCOUNT', 0, 'JUSTID')
    redis.call('ZADD', keys[6], now, id)
  end
  if n > 0 then
    redis.call('HINCRBY', keys[1], 'extra', n)
    redis.call('HINCRBY', keys[1], 'left', n)
    redis.call('HINCRBY', keys[1], 'failed', -n)
  end
  if state == 'failed' then
    redis.call('HINCRBY', keys[1], 'gen', 1)
    -- Elements of the earlier lifecycle may linger in a list: start the epochs above them.
    local epoch = sg_next_epoch(m[6], now)
    local ntok = math.min(tonumber(m[3]), tonumber(m[5]))
    for i = 1, 6 do redis.call('PERSIST', keys[i]) end
    redis.call('HSET', keys[1], 'state', 'running', 'ntok', ntok, 'npark', 0)
    -- A streamed request that failed before its finalize (fail fast) had its producer's adds and
    -- finalize refused from then on: reopened, it runs the parts it has and finishes with them,
    -- as if finalized, rather than waiting for a finalize that will not come.
    if m[11] == '1' then redis.call('HSET', keys[1], 'open', 0) end
    redis.call('HDEL', keys[1], 'finished', 'sealed', 'why')
    local out, fields = {n, args[2]}, {}
    for k = 0, ntok - 1 do
      fields[#fields + 1] = 't' .. k
      fields[#fields + 1] = 'q|' .. epoch .. '|' .. now
      out[#out + 1] = sg_element(args[1], k, epoch)
    end
    sg_hset_many(keys[1], fields)
    return out
  end
  -- Running: parked tokens come back for the work.
  local out = {n, 0}
  for _, e in ipairs(sg_unpark(keys, args[1], n, now)) do out[#out + 1] = e end
  return out
end
redis.register_function('sg2_requeue_dead', requeue_dead)
end
do
-- reprioritize: an operator changes the priority of a request that is not finished (`prio` in its
-- meta hash). Every step that puts one of its token elements on a list reads `prio` when it issues
-- the element (ack's re-queue, reclaim, census), so held and parked tokens reach the new
-- priority's list at their next hand-back. The elements of the tokens queued now wait in the old
-- priority's lists, on the token side (another hash tag): this returns them for `relist`, which
-- moves them there.
-- KEYS[1..6] the request's keys (prelude.lua)
-- ARGV[1] request key id   ARGV[2] the new priority, 0 to 99
-- Returns {'moved', old priority, shards, element...}: the priority is now ARGV[2]; the elements
--         "<kid>|<k>|<epoch>" of the tokens queued now (k ascending), to move from the old
--         priority's list of their shard (token k is on shard (home + k) % shards) to the new
--         one's (`relist`). When the priority was ARGV[2] already (a call re-sent after its reply
--         was lost, or a repeat), the old priority is the one before the last change (meta
--         `pprio`), so that a repeat completes a move its first caller left undone; with none,
--         no element is listed;
--         {'unknown'}: no such request (a small request in a lane has no meta hash: its record
--         is on its home shard, see lanes);
--         {'refused', state}: it is finished (completed, failed, cancelled) or still loading.
-- A request in a tenant group is refused with "SGINVALID ...": its elements wait in its group's
-- queues, and its group's tokens on the shard's lists (prelude.lua, "Tenant groups").
-- Errors "SGINVALID priority must be an integer from 0 to 99".
local function reprioritize(keys, args)
  local prio = tonumber(args[2])
  if not prio or prio < 0 or prio > 99 or prio % 1 ~= 0 then
    return redis.error_reply('SGINVALID priority must be an integer from 0 to 99')
  end
  local m = redis.call('HMGET', keys[1], 'state', 'prio', 'pprio', 'ntok', 'shards', 'lane', 'grp')
  local state = m[1]
  if not state or m[6] then return {'unknown'} end
  if m[7] then
    return redis.error_reply('SGINVALID a request in a tenant group keeps the priority it was submitted with')
  end
  if state ~= 'scheduled' and state ~= 'queued' and state ~= 'running' then return {'refused', state} end
  local old = tonumber(m[2])
  if old == prio then
    old = tonumber(m[3] or prio)
  else
    redis.call('HSET', keys[1], 'prio', prio, 'pprio', old)
  end
  local out = {'moved', old, m[5] or '1'}
  if old == prio then return out end
  sg_each_token(keys, 0, tonumber(m[4] or '0'), function(k, tok)
    if string.sub(tok, 1, 2) == 'q|' then out[#out + 1] = sg_element(args[1], k, sg_split(tok)[2]) end
  end)
  return out
end
redis.register_function('sg2_reprioritize', reprioritize)
end
do
-- relist: reprioritize's token-side step: move a request's waiting elements from the list of its
-- old priority to the list of its new one, on one shard, each element in one atomic step, so that
-- it is always in exactly one list (the shard's bell keeps its one wake-up per element).
-- An element goes where its epoch puts it: before the first element, from the head, whose epoch
-- is not above its own (at the tail if there is none). Lists then stay ordered by epoch, newest at
-- the head, as pushes keep them, which verify's presence test relies on; and a token keeps its
-- seniority at its new priority (one that has waited longer than the others there is taken first).
-- The work is bounded like a sweep's: an element is looked for within SG_RELIST_SCAN elements of
-- either end of the old list, and its place within as many from the head of the new one. An
-- element not found (taken meanwhile, not pushed yet, or deep in a long list) or with no place
-- found stays where it is: it is still valid there, is taken at the old priority, and goes to the
-- new priority's list when handed back.
-- KEYS[1] the old priority's list   KEYS[2] the new priority's list (of the same shard)
-- ARGV[1..] elements "<kid>|<k>|<epoch>"
-- Returns the number of elements moved.
local SG_RELIST_SCAN = 1000

-- Inserts `element` (epoch `epoch`) into `list` at its place by epoch; false if the place is not
-- within SG_RELIST_SCAN elements of the head.
local function sg_relist_place(list, element, epoch)
  local from = 0
  while from < SG_RELIST_SCAN do
    local chunk = redis.call('LRANGE', list, from, from + 99)
    for _, other in ipairs(chunk) do
      local e = sg_element_epoch(other)
      if e and e <= epoch then
        redis.call('LINSERT', list, 'BEFORE', other, element)
        return true
      end
    end
    if #chunk < 100 then
      redis.call('RPUSH', list, element)
      return true
    end
    from = from + 100
  end
  return false
end

local function relist(keys, args)
  local old, new = keys[1], keys[2]
  if old == new then return 0 end
  local was_empty = redis.call('LLEN', new) == 0
  local moved = 0
  for i = 1, #args do
    local element, epoch = args[i], sg_element_epoch(args[i])
    -- Looked for from the tail first: a waiting element is taken from there.
    local from_tail = redis.call('LPOS', old, element, 'RANK', -1, 'MAXLEN', SG_RELIST_SCAN)
    local found = from_tail or redis.call('LPOS', old, element, 'MAXLEN', SG_RELIST_SCAN)
    if epoch and found and sg_relist_place(new, element, epoch) then
      if from_tail then redis.call('LREM', old, -1, element) else redis.call('LREM', old, 1, element) end
      moved = moved + 1
    end
  end
  if was_empty and moved > 0 then
    -- A push onto an empty list: announced as sg_push does, so that busy slots holding a lower
    -- priority give way.
    sg_announce_up(new)
  end
  return moved
end
redis.register_function('sg2_relist', relist)
end
do
-- beat: a worker's heartbeat in the worker registry (shard 0), and its share of noticing dead
-- workers. A worker is alive while its registration has not expired (Redis time: no client clock
-- is involved); one not heard from for a lease is dead, and the beat of any other worker claims it
-- for reaping: recovery then reclaims every token its slots had taken (their `held` records).
-- KEYS[1] the registry (sorted set: worker id -> expiry ms)   KEYS[2] worker descriptions (hash:
-- worker id -> JSON; and "<worker id>|lapsed" -> when its registration was last found lapsed)
-- KEYS[3] workers being reaped (sorted set: worker id -> claim expiry ms)
-- ARGV[1] worker id   ARGV[2] lease (ms)   ARGV[3] its description (JSON, stored on the first
-- beat)   ARGV[4] '1' on the worker's first beat   ARGV[5] at most this many dead workers to claim
-- ARGV[6] claim (ms): a dead worker claimed by a reaper that dies is claimed again after this
-- Returns {alive, dead id, dead description, ...}: alive is 0 when this worker had been declared
-- dead (it must take a new id: its tokens are being, or were, reclaimed), else 1.
local function beat(keys, args)
  local now = sg_now()
  local id, lease = args[1], tonumber(args[2])
  local alive = 1
  -- A beat that finds its own registration expired (this worker, or the registry, could not be
  -- reached for a lease: a stalled process, a partition, the registry's master restarting) does
  -- not reap: the other workers were most likely cut off alike, and get a lease to beat again.
  local lapsed = false
  if args[4] == '1' then
    redis.call('ZADD', keys[1], now + lease, id)
    redis.call('HSET', keys[2], id, args[3])
  else
    local own = redis.call('ZSCORE', keys[1], id)
    if own then
      lapsed = tonumber(own) < now
      redis.call('ZADD', keys[1], 'XX', now + lease, id)
    else
      alive = 0
    end
  end
  -- The registry goes when no worker is left to beat (a namespace whose workers were all killed
  -- leaves nothing); dead workers' take records are then found by recovery's scan of them.
  for i = 1, 3 do redis.call('PEXPIRE', keys[i], lease * 6) end
  local out = {alive}
  -- For a lease after its lapse, a worker does not reap: the others get that long to come back
  -- (their own beats meet the same outage, and their reconnects take time).
  local quiet = id .. '|lapsed'
  if lapsed then
    redis.call('HSET', keys[2], quiet, now)
    return out
  end
  local since = redis.call('HGET', keys[2], quiet)
  if since then
    if tonumber(since) + lease > now then return out end
    redis.call('HDEL', keys[2], quiet)
  end
  local max, claim = tonumber(args[5]), tonumber(args[6])
  local dead = redis.call('ZRANGEBYSCORE', keys[1], '-inf', now, 'LIMIT', 0, max)
  local stuck = redis.call('ZRANGEBYSCORE', keys[3], '-inf', now, 'LIMIT', 0, max)
  for _, list in ipairs({dead, stuck}) do
    for _, w in ipairs(list) do
      redis.call('ZREM', keys[1], w)
      redis.call('ZADD', keys[3], now + claim, w)
      -- Outlives the claim by a lease, so a stuck claim is found again; no longer, so a claim
      -- whose reaper was killed along with every other worker does not outstay them for long.
      redis.call('PEXPIRE', keys[3], math.max(lease * 6, claim + lease))
      out[#out + 1] = w
      out[#out + 1] = redis.call('HGET', keys[2], w) or ''
    end
  end
  return out
end
redis.register_function('sg2_beat', beat)
end
do
-- reaped: a worker leaves the registry: it stopped cleanly, or recovery reclaimed every token its
-- slots had taken after it died.
-- KEYS[1] the registry   KEYS[2] worker descriptions   KEYS[3] workers being reaped
-- ARGV[1] worker id
-- Returns 1.
local function reaped(keys, args)
  redis.call('ZREM', keys[1], args[1])
  redis.call('ZREM', keys[3], args[1])
  redis.call('HDEL', keys[2], args[1], args[1] .. '|lapsed')
  return 1
end
redis.register_function('sg2_reaped', reaped)
end
do
-- lane_submit: a whole small request in one call, on its home shard's lane of its priority
-- (prelude.lua, "Lanes"): its record, its first parts in the lane (as many as its limit), its
-- other parts waiting in the record, and a wake-up of a parked lane token per part fed. Creates
-- the lane (its meta hash, group and L parked tokens, its entry in recovery's index) on first use,
-- and revives an idle one (sg_lane_open).
-- KEYS[1..6] the lane's keys (as a request's, prelude.lua)   KEYS[7] the request's record
-- KEYS[8] the lane's priority list   KEYS[9] the shard's bell   KEYS[10] the shard's active index
-- KEYS[11] the shard's registration times   KEYS[12] the request id's finish marks on the shard
-- ARGV[1] the lane's key id   ARGV[2] request key id   ARGV[3] request id as the producer gave it
-- ARGV[4] submission nonce, '' when the producer generated the id   ARGV[5] priority
-- ARGV[6] concurrency limit   ARGV[7] max attempts
-- ARGV[8] per-attempt timeout (ms, 0 = none)   ARGV[9] retry backoff base (ms)   ARGV[10] backoff
-- cap (ms)   ARGV[11] flags: '1' = fail fast, then 'd' = results discarded (sg_flags)   ARGV[12] the lane's tokens L (used when it is created)
-- ARGV[13] the lane's first look by recovery (ms from now)   ARGV[14] the request's row in the
-- listing index (prelude.lua, "The listing index"; '' : not listed)   ARGV[15] trace context ('' =
-- none; as submit_open's ARGV[14], stored as the record's `trace`)   ARGV[16..] payloads (1 to 64)
-- KEYS[13..15] (optional) the shard's held records, looks armed before a step, and hand-off
-- offers (prelude.lua, "Hand-offs"): given, a lane token this call wakes goes to a reserved slot
-- that waits for one of its priority, rather than onto the list.
-- Returns {lifecycle, woken}: woken is how many lane tokens were pushed or handed. The same call re-sent
-- after a reconnect (same nonce) answers as the first did and writes nothing. Errors
-- "SGDUPLICATE ..." when the id is in use (a lane request's record, or, for an id the producer
-- named, a request of the stream path registered or retained on this shard), "SGINVALID ..."
-- when an argument is out of range.
local function lane_submit(keys, args)
  local prio, limit, lanes = tonumber(args[5]), tonumber(args[6]), tonumber(args[12])
  local n = #args - 15
  local invalid = sg_lane_check(prio, limit, args, 7, n, args[15]) or sg_lane_check_tokens(lanes)
  if invalid then return invalid end
  local failfast, discard
  failfast, discard, invalid = sg_flags(args[11])
  if invalid then return invalid end
  local r = {kid = args[2], id = args[3], nonce = args[4], record = keys[7], marks = keys[12], prio = prio,
    limit = limit, maxatt = args[7], timeout = args[8], bbase = args[9], bmax = args[10],
    failfast = failfast, discard = discard, row = args[14], trace = args[15]}
  local taken = sg_lane_taken(r, keys[11], keys[10])
  if taken == SG_LANE_DUPLICATE then return redis.error_reply(taken) end
  if taken then return {taken, 0} end
  local now, lc = sg_lane_clock()
  local parked = sg_lane_open(keys, args[1], prio, lanes, now, tonumber(args[13]), keys[10])
  local ix = sg_ix(keys[10])
  local fed, queued = sg_lane_write(keys, r, args, 16, n, now, lc, ix)
  sg_ix_queued(ix, queued)
  local woken = sg_unpark(keys, args[1], fed, now, parked)
  -- A lane token it wakes goes to a slot that offered to take its priority, as that slot's take
  -- would have it: held, and its first batch acquired (prelude.lua, "Hand-offs").
  local handed = 0
  if keys[15] then
    local records = string.sub(keys[7], 1, #keys[7] - #args[2])
    handed = sg_hand(keys[15], keys[13], prio, keys[8], woken, 1, now, function(holder, f, element)
      local e = sg_split(element)
      return {keys[8], element, lane_acquire({keys[1], keys[2], keys[3], keys[4], keys[5], keys[6], keys[10], keys[14]},
        {e[1], e[2], e[3], holder, f[3], f[4], records})}
    end)
  end
  sg_push(keys[8], keys[9], woken, handed + 1)
  return {lc, #woken}
end
redis.register_function('sg2_lane_submit', lane_submit)
end
do
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
redis.register_function('sg2_lane_submit_many', lane_submit_many)
end
do
-- lane_ack: ack for a lane token (prelude.lua, "Lanes"): a slot reports the outcomes of the lane
-- batch it was handed and, in the same step, gets the next batch or gives the token back. Each
-- outcome is recorded in its request's record if that request is still live with the entry's
-- lifecycle (else it is dropped: the request was cancelled, failed fast or reopened); a settled
-- part feeds the lane its request's next waiting part; a request whose last part is settled
-- finishes here, and the requests the call finished share one entry of the events stream
-- (sg_lane_events).
-- KEYS[1..6] the lane's keys (as a request's, prelude.lua)   KEYS[7] the shard's events stream
-- KEYS[8] the shard's active index   KEYS[9] the shard's looks armed before a step
-- ARGV[1] the lane's key id   ARGV[2] token k   ARGV[3] epoch   ARGV[4] holder   ARGV[5] consumer
-- ARGV[6] 1 = continue, 0 = give the token back   ARGV[7] retention (ms)   ARGV[8] completion
-- channel   ARGV[9] next batch: how many entries at most ("<n>|flat": flat entries)   ARGV[10] the records' key prefix
-- KEYS[10] (optional) the prefix of the shard's downstream sets ("<ns>:{<ns>.q<s>}:dn:"): given,
--   the reply names the downstreams of each request it releases, when they are few (below)
-- ARGV[11..] one group of eight per entry, in the order handed out: entry id, outcome ('ok',
--   'retry', 'dead', 'skip' as for ack), body, retry delay (ms), attempt, request key id,
--   lifecycle, index
-- Returns {'run', entry, ...} as lane_acquire; {'requeue', element}; {'park', wake};
--         {'fenced'} as ack. Requests that finished are announced by this call itself; when some
--         did, the reply ends with one more item {'done', state, lifecycle, state, lifecycle,
--         ...}, one pair per request finished, for the stats by stage; and when some of them have
--         downstreams, with {'rel', key id, state, lifecycle, ...}: their releases, owed (in the
--         outbox) and for the caller to run. With KEYS[10], one more item after it, {'dn', key id,
--         n, downstream entry * n, ...}: the whole set of downstreams of each request released
--         whose set holds at most SG_DN_PAGE (the release then reads none of it).
local function lane_ack(keys, args)
  local k, epoch, holder = args[2], args[3], args[4]
  local m = redis.call('HMGET', keys[1], 't' .. k, 'extra', 'm' .. k)
  local tok = m[1]
  if not tok then return {'fenced'} end
  local ids = {}
  for i = 11, #args, 8 do ids[#ids + 1] = args[i] end
  if not sg_holds(tok, epoch, holder, table.concat(ids, ',')) then
    return {'fenced'}
  end
  -- The token holds exactly these entries under this epoch, so each is pending and is settled
  -- here once: they are acked and freed together at the end (sg_lane_drop).
  local now = sg_now()
  -- `now` as text, converted once for every record this call finishes.
  local finished_at = sg_int(now)
  local extra = tonumber(m[2] or '0')
  local prefix, retention = args[10], args[7]
  -- Each request's record is read once and written once however many of its parts the batch
  -- holds: `recs` keeps, by key id, the record as read and then updated here (`r`: state, lc,
  -- pol, left, failed, rq, nf, dn, ix, rqd, discard), which of its counters changed (`settled`:
  -- left, `dead`: failed, `fed`: rq or nf, `discarded`: discard), the parts' own fields to write (`out`, flat) and to delete (`del`),
  -- the parts to feed the lane (`feed`) and, once its last part is settled, its terminal state;
  -- `order` lists the key ids as first seen. Fields written and deleted never overlap, nor does a
  -- part's field repeat: each part is in the batch once.
  local recs, order, settled = {}, {}, {}
  -- The requests this call finished, for the caller's stats by stage: {'done', state, lc, ...}.
  local done = {'done'}
  for i = 11, #args, 8 do
    local id, outcome, body, attempt, kid, lc, index = args[i], args[i + 1], args[i + 2], args[i + 4],
      args[i + 5], args[i + 6], args[i + 7]
    local rec = recs[kid]
    if not rec then
      rec = {r = redis.call('HMGET', prefix .. kid, 'state', 'lc', 'pol', 'left', 'failed', 'rq', 'nf', 'dn', 'ix', 'rqd', 'discard'),
        out = {}}
      recs[kid] = rec
      order[#order + 1] = kid
    end
    local r, out = rec.r, rec.out
    if rec.state or not sg_lane_live(r, lc) then
      settled[#settled + 1] = id
    elseif r[1] == 'queued' then
      -- Handed out without its record (sg_lane_entry): it reads running from now on, since the
      -- batch's hand-out (the token's running marks go below).
      rec.marked = true
    end
    if rec.state or not sg_lane_live(r, lc) then
    elseif outcome == 'retry' then
      redis.call('ZADD', keys[6], now + tonumber(args[i + 3]), id)
      extra = extra + 1
      out[#out + 1] = 'e' .. index
      out[#out + 1] = body
    elseif outcome == 'skip' then
      redis.call('XCLAIM', keys[2], 'g', args[5], 0, id, 'RETRYCOUNT', math.max(tonumber(attempt) - 1, 0), 'JUSTID')
      redis.call('RPUSH', keys[5], id)
      extra = extra + 1
    else
      settled[#settled + 1] = id
      local failfast = sg_lane_failfast(r[3])
      r[4] = tonumber(r[4]) - 1
      rec.settled = true
      if outcome == 'ok' then
        if r[11] then
          -- Its results are discarded: counted, not stored.
          r[11] = tonumber(r[11]) + 1
          rec.discarded = true
        else
          out[#out + 1] = 'o' .. index
          out[#out + 1] = body
        end
        -- An error record is left by an earlier attempt, or by a run before a requeue (`rqd`).
        if attempt ~= '1' or r[10] then
          rec.del = rec.del or {}
          rec.del[#rec.del + 1] = 'e' .. index
        end
        if attempt ~= '1' then
          redis.call('HINCRBY', prefix .. kid, 'retried', 1)
          if tonumber(attempt) > tonumber(redis.call('HGET', prefix .. kid, 'maxseen') or '1') then
            redis.call('HSET', prefix .. kid, 'maxseen', attempt)
          end
        end
      else
        r[5] = tonumber(r[5] or '0') + 1
        rec.dead = true
        local entry = redis.call('XRANGE', keys[2], id, id)[1]
        out[#out + 1] = 'e' .. index
        out[#out + 1] = body
        out[#out + 1] = 'x' .. index
        -- The payload, as sg_lane_add placed it.
        out[#out + 1] = entry and entry[2][2] or ''
      end
      if failfast then
        rec.del = rec.del or {}
        rec.del[#rec.del + 1] = 'w' .. index
      end
      if r[4] <= 0 or (outcome == 'dead' and failfast) then
        rec.state = 'completed'
        if tonumber(r[5] or '0') > 0 then rec.state = 'failed' end
      else
        -- A settled part makes room for the request's next waiting part, if any.
        local feed, fed = sg_lane_pick(r[6], r[7], r[3])
        if feed then
          rec.feed = rec.feed or {}
          rec.feed[#rec.feed + 1] = feed
          if fed[1] == 'rq' then
            r[6], rec.fed_rq = fed[2], true
          else
            r[7], rec.fed_nf = fed[2], true
          end
        end
      end
    end
  end
  -- The records' writes, then the finished requests' announcements and the fed parts.
  -- Finished requests whose records keep their index rows (sg_ix_add_kept) apart: `kept`, with
  -- their states and submission times.
  local announced, finished, states, released = {}, {}, {}, {'rel'}
  local kept, kept_states, kept_ats = {}, {}, {}
  for _, kid in ipairs(order) do
    local rec, record = recs[kid], prefix .. kid
    local fields, r = rec.out, rec.r
    if rec.settled then
      fields[#fields + 1] = 'left'
      fields[#fields + 1] = sg_str(r[4])
    end
    if rec.dead then
      fields[#fields + 1] = 'failed'
      fields[#fields + 1] = sg_str(r[5])
    end
    if rec.discarded then
      fields[#fields + 1] = 'discard'
      fields[#fields + 1] = sg_str(r[11])
    end
    if rec.fed_rq then
      fields[#fields + 1] = 'rq'
      fields[#fields + 1] = r[6]
    end
    if rec.fed_nf then
      fields[#fields + 1] = 'nf'
      fields[#fields + 1] = sg_str(r[7])
    end
    if rec.marked then
      if not rec.state then
        fields[#fields + 1] = 'state'
        fields[#fields + 1] = 'running'
      end
      fields[#fields + 1] = 'started'
      fields[#fields + 1] = sg_held_since(tok)
    end
    if rec.state then
      fields[#fields + 1] = 'state'
      fields[#fields + 1] = rec.state
      fields[#fields + 1] = 'finished'
      fields[#fields + 1] = finished_at
    end
    if #fields > 0 then redis.call('HSET', record, unpack(fields)) end
    if rec.del then redis.call('HDEL', record, unpack(rec.del)) end
    if rec.feed then sg_lane_feed_parts(keys, record, kid, r[2], r[3], rec.feed) end
    if rec.state then
      -- A failed request keeps its waiting parts: its dead letters may be requeued, and its
      -- parts not yet run then run too.
      announced[#announced + 1] = sg_lane_announce(record, kid, rec.state, retention, now, keys[7], r[8])
      if r[8] then
        released[#released + 1] = kid
        released[#released + 1] = rec.state
        released[#released + 1] = r[2]
      end
      if r[9] then
        kept[#kept + 1] = kid
        kept_states[#kept_states + 1] = rec.state
        kept_ats[#kept_ats + 1] = sg_ix_kept_at(r[9], r[2])
      else
        finished[#finished + 1] = kid
        states[#states + 1] = rec.state
      end
      done[#done + 1] = rec.state
      done[#done + 1] = r[2]
    end
  end
  if #announced > 0 then
    local ix, listed, expires = sg_ix(keys[7]), {}, now + tonumber(retention)
    sg_ix_finish_many(ix, finished, states, expires, now, listed)
    sg_ix_finish_kept(ix, kept, kept_states, kept_ats, expires, now, listed)
    sg_ix_finished(ix, now, listed)
    sg_lane_events(keys[7], announced, retention, now, args[8])
  end
  -- The batch's running marks (sg_lane_marks): its records say running now.
  if m[3] then redis.call('HDEL', keys[1], 'm' .. k) end
  if extra ~= tonumber(m[2] or '0') then redis.call('HSET', keys[1], 'extra', extra) end
  sg_lane_drop(keys, settled)
  local reply
  if args[6] == '1' then
    local want, flat = sg_want(args[9])
    reply = sg_lane_next(keys, k, epoch, holder, args[5], now, extra, want, prefix, keys[8], keys[9], flat)
  else
    reply = {'requeue', sg_requeue(keys, args[1], k, epoch, now)}
  end
  if #done > 1 then reply[#reply + 1] = done end
  if #released > 1 then
    reply[#reply + 1] = released
    if keys[10] then reply[#reply + 1] = sg_lane_downstreams(keys[10], released) end
  end
  return reply
end
redis.register_function('sg2_lane_ack', lane_ack)
end
do
-- lane_cancel: cancel for a lane request (prelude.lua, "Lanes"): its one terminal record and
-- event now. Its parts still in the lane are acked away unrun when handed out, and the acks of
-- those running record nothing (their lifecycle is no longer live).
-- KEYS[1] the request's record   KEYS[2] the shard's events stream
-- ARGV[1] request key id   ARGV[2] retention (ms)   ARGV[3] completion channel
-- Returns {'finished', 'cancelled', lifecycle}, with a fourth item 'rel' when it has downstreams
-- (its release is owed, and for the caller to run), {'already', state} when it was terminal, or
-- {'unknown'}.
local function lane_cancel(keys, args)
  local m = redis.call('HMGET', keys[1], 'state', 'lc', 'pol', 'dn', 'ix')
  if not m[1] then return {'unknown'} end
  if m[1] ~= 'queued' and m[1] ~= 'running' then return {'already', m[1]} end
  local now = sg_now()
  local policy = sg_lane_policy(m[3])
  local waiting = {}
  for i = 0, policy.total - 1 do waiting[#waiting + 1] = 'w' .. i end
  sg_hdel_many(keys[1], waiting)
  local fields = {'state', 'cancelled', 'finished', now}
  if m[1] == 'queued' and policy.total == 1 then
    -- A request of one part whose record says queued: its entry was handed out without the record
    -- (sg_lane_entry), and a lane token's running marks name it (its part runs since then), or
    -- its entry waits in the lane, and "<kid>|<lc>" goes to the lane's set of cancelled requests'
    -- entries, so that the hand-out that meets it drops it.
    local lane = string.sub(keys[1], 1, #keys[1] - #args[1] - 3) .. ':lane:' .. policy.prio
    local since = sg_lane_marked(lane, args[1], m[2])
    if since then
      fields[#fields + 1] = 'started'
      fields[#fields + 1] = since
    elseif redis.call('EXISTS', lane) == 1 then
      redis.call('SADD', lane .. ':err', args[1] .. '|' .. m[2])
    end
  end
  redis.call('HSET', keys[1], unpack(fields))
  local line = sg_lane_announce(keys[1], args[1], 'cancelled', args[2], now, keys[2], m[4])
  local ix = sg_ix(keys[2])
  -- One whose record keeps its row may be listed from its lane, not in `live` (sg_ix_add_kept).
  if m[5] then sg_ix_live_kept(ix, args[1], m[5], m[2]) end
  sg_ix_finish(ix, args[1], 'cancelled', now + tonumber(args[2]), now)
  sg_lane_events(keys[2], {line}, args[2], now, args[3])
  if m[4] then return {'finished', 'cancelled', m[2], 'rel'} end
  return {'finished', 'cancelled', m[2]}
end
redis.register_function('sg2_lane_cancel', lane_cancel)
end
do
-- lane_requeue: requeue_dead for a lane request (prelude.lua, "Lanes"): a failed one reopens
-- under a new lifecycle (its old entries still in the lane are then dropped unrun), and its dead
-- parts are fed again, with its parts not yet run, within its limit; a live one gets its dead
-- parts back in line. Each runs with a fresh set of attempts.
-- KEYS[1..6] the lane's keys (as a request's, prelude.lua)   KEYS[7] the request's record
-- KEYS[8] the lane's priority list   KEYS[9] the shard's bell   KEYS[10] the shard's active index
-- ARGV[1] the lane's key id   ARGV[2] request key id   ARGV[3] the lane's tokens L (if it is
-- created again)   ARGV[4] the lane's first look (ms from now) if so
-- Returns {n, woken}: n dead letters requeued, woken lane tokens pushed. Errors "SGSTATE ..." when
-- the request is unknown, or finished other than failed.
local function lane_requeue(keys, args)
  local record = keys[7]
  local m = redis.call('HMGET', record, 'state', 'pol', 'nf', 'rq', 'ix', 'lc')
  if not m[1] or (m[1] ~= 'failed' and m[1] ~= 'queued' and m[1] ~= 'running') then
    return redis.error_reply('SGSTATE the request is unknown, or finished without dead letters')
  end
  local pol = sg_lane_policy(m[2])
  local fed = tonumber(m[3] or pol.total)
  local flat = redis.call('HGETALL', record)
  local dead, inflight = {}, {}
  for j = 1, #flat, 2 do
    local i = string.match(flat[j], '^x(%d+)$')
    if i then dead[#dead + 1] = tonumber(i) end
    i = string.match(flat[j], '^w(%d+)$')
    if i and tonumber(i) < fed then inflight[#inflight + 1] = tonumber(i) end
  end
  table.sort(dead)
  table.sort(inflight)
  if #dead == 0 then return {0, 0} end
  local now = sg_now()
  local moves, rq = {}, {}
  for _, i in ipairs(dead) do
    moves[#moves + 1] = 'w' .. i
    moves[#moves + 1] = redis.call('HGET', record, 'x' .. i)
    rq[#rq + 1] = i
  end
  local xs = {}
  for _, i in ipairs(dead) do xs[#xs + 1] = 'x' .. i end
  redis.call('HDEL', record, unpack(xs))
  -- `rqd`: parts of this request run again with a fresh set of attempts, so lane_ack clears the
  -- error record of a part that succeeds at its first attempt too.
  moves[#moves + 1] = 'rqd'
  moves[#moves + 1] = '1'
  redis.call('HSET', record, unpack(moves))
  if m[1] == 'failed' then
    -- Failed fast: its parts that were in the lane then are dropped unrun under the old lifecycle;
    -- their payloads were kept (sg_lane_feed), and they are fed again.
    for _, i in ipairs(inflight) do rq[#rq + 1] = i end
  else
    if m[4] and m[4] ~= '' then table.insert(rq, 1, m[4]) end
    -- Its requeued parts join the lane's tail, out of submission order: one listed from its lane
    -- (sg_ix_add_kept) is listed in `live` from now on.
    if m[5] then sg_ix_live_kept(sg_ix(keys[10]), args[2], m[5], m[6]) end
  end
  redis.call('HSET', record, 'rq', table.concat(rq, ','))
  redis.call('HINCRBY', record, 'failed', -#dead)
  local left = redis.call('HINCRBY', record, 'left', #dead)
  local feed = 0
  if m[1] == 'failed' then
    -- Reopened: nothing of the new lifecycle is in the lane yet.
    -- Its lifecycle's generation: `lc` does not tell it (sg_lane_clock).
    redis.call('HINCRBY', record, 'lc', 1)
    redis.call('HINCRBY', record, 'gen', 1)
    redis.call('HSET', record, 'state', 'running')
    redis.call('HDEL', record, 'finished')
    redis.call('PERSIST', record)
    -- Its downstreams (if any) wait for this lifecycle's end: their set is kept while it runs.
    redis.call('PERSIST', sg_shard_key(keys[10], 'dn:' .. args[2]))
    sg_ix_reopen(sg_ix(keys[10]), args[2], m[5] and sg_ix_kept_at(m[5], m[6]))
    feed = math.min(pol.limit, left)
  end
  local lc = redis.call('HGET', record, 'lc')
  sg_lane_open(keys, args[1], pol.prio, tonumber(args[3]), now, tonumber(args[4]), keys[10])
  for _ = 1, feed do sg_lane_feed(keys, record, args[2], lc, m[2]) end
  local woken = sg_unpark(keys, args[1], feed, now)
  sg_push(keys[8], keys[9], woken)
  return {#dead, #woken}
end
redis.register_function('sg2_lane_requeue', lane_requeue)
end
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

do
-- track: marks a listed request as tracked (qless's tracking: `list --tracked` shows it), or
-- unmarks it. Run on its home shard.
-- KEYS[1] the shard's index rows (prelude.lua, "The listing index")
-- ARGV[1] request key id   ARGV[2] '1' to track, '0' to stop
-- Returns 1 when the request is listed (tracked or not as asked), 0 when it is not (unknown, or
-- gone with its retention).
local function track(keys, args)
  local ix = string.sub(keys[1], 1, -4)
  local kid = args[1]
  if not sg_ix_row(ix, kid) then return 0 end
  local mark = {SG_IX_TRACKED, ix .. 'tracked'}
  local live = redis.call('ZSCORE', ix .. 'live', kid)
  if not live and args[2] == '1' then
    -- A live lane request listed from its lane (sg_ix_add_kept) is listed in `live` once
    -- tracked, so that the tracked set counts it live.
    local rec = redis.call('HMGET', sg_ix_record(ix, kid), 'state', 'ix', 'lc')
    if (rec[1] == 'queued' or rec[1] == 'running') and rec[2] then
      sg_ix_live_kept(ix, kid, rec[2], rec[3])
      live = redis.call('ZSCORE', ix .. 'live', kid)
    end
  end
  local was = redis.call('ZSCORE', mark[2], kid)
  local now = sg_now()
  if args[2] ~= '1' then
    if was then
      redis.call('ZREM', mark[2], kid)
      if live then sg_ix_mark_done(ix, mark, nil, now) end
    end
    return 1
  end
  if was then return 1 end
  local score = live
  for i = 2, #SG_IX_STATES do score = score or redis.call('ZSCORE', ix .. SG_IX_STATES[i], kid) end
  if not score then
    -- A finished lane request listed in a group of its terminal set gets a member of its own
    -- there, as a tracked one has (prelude.lua, "The listing index").
    local state, at = sg_ix_kept_terminal(ix, kid)
    if state and sg_ix_ungroup(ix, state, at, kid) then
      redis.call('ZADD', ix .. state, at, kid)
      score = at
    end
  end
  if not score then return 0 end
  redis.call('ZADD', mark[2], score, kid)
  if live then
    sg_ix_mark_live(ix, mark)
  else
    -- A finished request: the set expires with it, unless a live one keeps it.
    local expires = sg_ix_expiry(ix, kid, now) or 0
    if expires == math.huge then expires = 0 end
    local latest = tonumber(redis.call('HGET', ix .. 'tx', mark[1]) or '0')
    if expires > latest then redis.call('HSET', ix .. 'tx', mark[1], expires) end
    -- With no live request on the shard, `tx` expires with the latest finished one: one this
    -- call created (HSET) must too.
    sg_ix_settle(ix, now)
    if not redis.call('HGET', ix .. 'tl', mark[1]) then sg_ix_expire_at(mark[2], math.max(expires, latest), now) end
  end
  return 1
end
redis.register_function('sg2_track', track)
end
do
-- unlist: the token-side half of purging one finished request (`Admin::purge`): it leaves the
-- listing index, and its finish marks go. Run on its home shard, after `purge` deleted its keys.
-- KEYS[1] the shard's index rows (prelude.lua, "The listing index")   KEYS[2] the shard's active
-- index   KEYS[3] the request's finish marks   KEYS[4] the id's lane record on this shard
-- (optional: a lane request of the id created since `purge` found none is not unlisted)
-- ARGV[1] request key id
-- Returns 1 when it was listed, 0 when not. Errors "SGSTATE ..." while the request is in recovery's
-- index (not finished, or its finish steps not all done; or a new request of the id registered
-- since its keys went, which its first push lists), listed as live (a new lane request of the
-- id, which recovery's index does not name) or, given KEYS[4], while a lane request of the id
-- exists (one created after `purge` looked, and finished since), or while its release to its
-- downstreams is owed (the shard's outbox `rel` holds it): nothing is changed. Its set of
-- downstreams goes with the marks.
local function unlist(keys, args)
  local ix = string.sub(keys[1], 1, -4)
  if redis.call('ZSCORE', keys[2], args[1]) or redis.call('ZSCORE', ix .. 'live', args[1])
    or (keys[4] and redis.call('EXISTS', keys[4]) == 1)
    or redis.call('ZSCORE', sg_shard_key(keys[2], 'rel'), args[1]) then
    return redis.error_reply('SGSTATE the request has not finished (or is still finishing)')
  end
  redis.call('DEL', keys[3], sg_shard_key(keys[2], 'dn:' .. args[1]))
  return sg_ix_remove(ix, args[1], sg_now())
end
redis.register_function('sg2_unlist', unlist)
end
do
-- purge: deletes a finished request's keys now, rather than at the end of its retention
-- (`Admin::purge`; then `unlist` on its home shard). Run on the request's slot.
-- KEYS[1] the hash holding its `state` (a request's meta, or a lane request's record)
-- KEYS[2..] its other keys (none for a lane request); with ARGV[1], the last one is instead its
-- home shard's release outbox (a lane request's: its record is on that shard)
-- ARGV[1] (optional) its key id: refused while the outbox holds it (its downstreams have not all
-- heard of its finish yet; prelude.lua, "Dependencies between requests"); a lane request listed
-- in a group of its terminal set leaves the group (the rest of its index entries go by `unlist`)
-- Returns 1 when the keys were deleted, 0 when there was nothing (unknown, or expired). Errors
-- "SGSTATE ..." when the request has not finished, or its release is owed: nothing is deleted.
local function purge(keys, args)
  local state = redis.call('HGET', keys[1], 'state')
  if not state then return 0 end
  if state ~= 'completed' and state ~= 'failed' and state ~= 'cancelled' then
    return redis.error_reply('SGSTATE the request has not finished (state ' .. state .. '): cancel it first')
  end
  local delete = keys
  if args[1] then
    if redis.call('ZSCORE', keys[#keys], args[1]) then
      return redis.error_reply('SGSTATE the request has finished, but its downstreams have not all heard yet')
    end
    delete = {}
    for i = 1, #keys - 1 do delete[i] = keys[i] end
    -- A lane request listed in a group of its terminal set (prelude.lua, "The listing index")
    -- leaves the group now: `unlist`, after this, finds it no more by its record.
    local ix = sg_ix(keys[#keys])
    local st, at = sg_ix_kept_terminal(ix, args[1])
    if st then sg_ix_ungroup(ix, st, at, args[1]) end
  end
  redis.call('DEL', unpack(delete))
  return 1
end
redis.register_function('sg2_purge', purge)
end
do
-- relabel: after reprioritize, the request's row in the listing index (prelude.lua, "The listing
-- index") takes its new priority, so that `list --priority` finds it there. Run on its home shard.
-- KEYS[1] the shard's index rows
-- ARGV[1] request key id   ARGV[2] its priority now
-- Returns 1 when the row was rewritten, 0 when the request is not listed.
local function relabel(keys, args)
  local row = redis.call('HGET', keys[1], args[1])
  if not row then return 0 end
  local kind, rest = string.match(row, '^([^|]*)|[^|]*|(.*)$')
  redis.call('HSET', keys[1], args[1], kind .. '|' .. args[2] .. '|' .. rest)
  return 1
end
redis.register_function('sg2_relabel', relabel)
end
do
-- stats_add: adds a producer's or a worker's counts to the stats by stage, one hash per minute
-- (docs/protocol.md §3, "Stats by stage"). Components count in memory and call this once per
-- flush interval with what they counted since, never per part or per take.
-- KEYS[1..n] per-minute stats hashes ("<ns>:{<ns>.q0}:st:<minute>"), all on shard 0's tag
-- ARGV[1] how long a minute's hash is kept after this addition (ms, at least 1)
-- ARGV[2..] per key, in the order of KEYS: the number m of its fields, then m pairs field, delta
--   (a whole number; fields "<priority>|<counter>" and "<priority>|<histogram>|<bucket>")
-- Returns how many fields were added to, or an error "SGINVALID ..." for malformed arguments
-- (nothing is written then).
-- Each hash gets its expiry in the same step as its counts, so none is ever left without one.
-- A call re-sent after a lost reply adds its counts twice: the stats are exact only while calls
-- get through.
local function stats_add(keys, args)
  local ttl = tonumber(args[1])
  if not ttl or ttl < 1 or ttl % 1 ~= 0 then
    return redis.error_reply('SGINVALID argument 1 must be a whole number of ms of at least 1')
  end
  -- Checked whole before anything is written.
  local i = 2
  for _ = 1, #keys do
    local m = tonumber(args[i])
    if not m or m < 0 or m % 1 ~= 0 or i + 2 * m > #args then
      return redis.error_reply('SGINVALID argument ' .. i .. ' must count the field/delta pairs that follow it')
    end
    for j = i + 2, i + 2 * m, 2 do
      local d = tonumber(args[j])
      if not d or d % 1 ~= 0 then
        return redis.error_reply('SGINVALID argument ' .. j .. ' must be a whole number')
      end
    end
    i = i + 1 + 2 * m
  end
  if i ~= #args + 1 then
    return redis.error_reply('SGINVALID more arguments than the keys announce')
  end
  i = 2
  local n = 0
  for _, key in ipairs(keys) do
    local m = tonumber(args[i])
    for j = i + 1, i + 2 * m - 1, 2 do
      redis.call('HINCRBY', key, args[j], args[j + 1])
    end
    if m > 0 then redis.call('PEXPIRE', key, ttl) end
    n = n + m
    i = i + 1 + 2 * m
  end
  return n
end
redis.register_function('sg2_stats_add', stats_add)
end
do
-- sched_get: a schedule's spec and state (read-only). The
-- schedules live on shard 0 (docs/protocol.md §3, "Schedules"); the state fields are explained in
-- sched_add.lua.
-- KEYS[1] the schedules (hash: name -> spec JSON)   KEYS[2] the schedule's state (hash)
-- ARGV[1] the schedule's name
-- Returns {spec, gen, from, next, paused, gaps, owe, last}: each as stored (nil where absent; a
-- removed schedule has neither spec nor state).
local function sched_get(keys, args)
  local spec = redis.call('HGET', keys[1], args[1])
  local s = redis.call('HMGET', keys[2], 'gen', 'from', 'next', 'paused', 'gaps', 'owe', 'last')
  return {spec, s[1], s[2], s[3], s[4], s[5], s[6], s[7]}
end
redis.register_function{function_name='sg2_sched_get', callback=sched_get, flags={'no-writes'}}
end
do
-- sched_add: create a schedule, or replace one. A schedule is a spec (its cron, time zone, missed
-- policy and request template, as JSON) and a state hash, both on shard 0, and its entry in the
-- due set. Cron is never read here: the ticks are computed by the worker that fires it (Rust,
-- from a Redis time), so a new schedule's first tick is left to the first firing, which takes
-- the first tick after `from`.
-- The state: `gen` (a new value of the schedules' counter at every add, replace, pause and
-- resume, never one a schedule of this name had before it was removed: a firing computed from an
-- older state is refused), `from` (ticks at or before it are not owed: when the schedule was added
-- or replaced), `next` (the first tick not yet owed; absent until the first firing), `paused`
-- (when it was paused, while it is), `gaps` (the pauses since `next`: "<paused>:<resumed>,...";
-- a tick within one is not owed; a firing drops those it has passed), `resumed` (when it was last
-- resumed), `owe` (ticks owed and not yet submitted: "<ms>,<ms>,...", oldest first), `last` (the
-- latest tick paid).
-- KEYS[1] the schedules (hash: name -> spec)   KEYS[2] the due set (sorted set: name -> ms when
-- a worker should look at it)   KEYS[3] the schedule's state   KEYS[4] the schedules' counter
-- (hash: field `n`, the last gen given)
-- ARGV[1] name   ARGV[2] spec (JSON)   ARGV[3] '1': replace a schedule of this name whose spec
-- differs
-- Returns {'added', gen}, {'replaced', gen}, {'same', gen} (it is there with this very spec: a
-- re-sent add; nothing changed) or {'exists', gen} (with another spec, and ARGV[3] is not '1':
-- nothing changed). A replaced schedule is active (not paused) from now; ticks it owes are kept,
-- and paid with the new spec.
local function sched_add(keys, args)
  local name, spec = args[1], args[2]
  local old = redis.call('HGET', keys[1], name)
  if old == spec then
    return {'same', tonumber(redis.call('HGET', keys[3], 'gen') or '0')}
  end
  if old and args[3] ~= '1' then
    return {'exists', tonumber(redis.call('HGET', keys[3], 'gen') or '0')}
  end
  local now = sg_now()
  redis.call('HSET', keys[1], name, spec)
  local gen = redis.call('HINCRBY', keys[4], 'n', 1)
  redis.call('HSET', keys[3], 'gen', gen, 'from', now)
  redis.call('HDEL', keys[3], 'next', 'paused', 'gaps', 'resumed')
  -- Looked at now: the first firing sets `next`.
  redis.call('ZADD', keys[2], now, name)
  if old then return {'replaced', gen} end
  return {'added', gen}
end
redis.register_function('sg2_sched_add', sched_add)
end
do
-- sched_pause: pause or resume a schedule. Ticks after the pause and up to the resume are not
-- owed; ticks due before the pause still are (the next firing owes them, computing them from the
-- pause time it reads here), so a pause leaves the due set alone, unless nothing is left to do
-- before the pause (the next tick is after it, and nothing is owed): then the schedule leaves it.
-- A resume records the gap and asks for a look at the next tick (or now, when the firing is
-- behind).
-- KEYS[1] the due set   KEYS[2] the schedule's state   KEYS[3] the schedules' counter (sched_add)
-- ARGV[1] name   ARGV[2] '1' pause, '0' resume
-- Returns {'paused', gen}, {'resumed', gen}, {'already', gen} (it was paused, or not paused,
-- already: nothing changed) or {'unknown'} (no such schedule).
local function sched_pause(keys, args)
  local s = redis.call('HMGET', keys[2], 'gen', 'paused', 'gaps', 'next', 'owe')
  if not s[1] then return {'unknown'} end
  local pause = args[2] == '1'
  if (pause and s[2]) or (not pause and not s[2]) then return {'already', tonumber(s[1])} end
  local now = sg_now()
  local gen = redis.call('HINCRBY', keys[3], 'n', 1)
  redis.call('HSET', keys[2], 'gen', gen)
  if pause then
    redis.call('HSET', keys[2], 'paused', now)
    if s[4] and tonumber(s[4]) > now and not s[5] then redis.call('ZREM', keys[1], args[1]) end
    return {'paused', gen}
  end
  local gap = s[2] .. ':' .. now
  if s[3] and s[3] ~= '' then gap = s[3] .. ',' .. gap end
  redis.call('HSET', keys[2], 'gaps', gap, 'resumed', now)
  redis.call('HDEL', keys[2], 'paused')
  local look = now
  if s[4] and tonumber(s[4]) > now then look = tonumber(s[4]) end
  redis.call('ZADD', keys[1], 'LT', look, args[1])
  return {'resumed', gen}
end
redis.register_function('sg2_sched_pause', sched_pause)
end
do
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
redis.register_function('sg2_sched_fire', sched_fire)
end
do
-- sched_paid: an owed tick's request was submitted (the submit answered Ok, or SGDUPLICATE: it
-- exists already), so the tick leaves the debt. With nothing left owed, the schedule is next
-- looked at for its next tick (while it is paused, only if that tick fell before the pause).
-- KEYS[1] the due set   KEYS[2] the schedule's state
-- ARGV[1] name   ARGV[2] the tick (ms)
-- Returns 1 when the tick was owed, 0 when not (paid already, or the schedule was removed).
local function sched_paid(keys, args)
  local s = redis.call('HMGET', keys[2], 'gen', 'owe', 'next', 'paused', 'last')
  if not s[1] or not s[2] then return 0 end
  local tick = tonumber(args[2])
  local left, found = {}, false
  for t in string.gmatch(s[2], '[^,]+') do
    if tonumber(t) == tick then found = true else left[#left + 1] = t end
  end
  if not found then return 0 end
  if not s[5] or tonumber(s[5]) < tick then redis.call('HSET', keys[2], 'last', args[2]) end
  if #left > 0 then
    redis.call('HSET', keys[2], 'owe', table.concat(left, ','))
    return 1
  end
  redis.call('HDEL', keys[2], 'owe')
  local next = tonumber(s[3] or sg_now())
  if s[4] and next > tonumber(s[4]) then
    redis.call('ZREM', keys[1], args[1])
  else
    redis.call('ZADD', keys[1], next, args[1])
  end
  return 1
end
redis.register_function('sg2_sched_paid', sched_paid)
end
do
-- sched_del: remove a schedule: its spec, its state and its due entry. Ticks it owes and has not
-- submitted yet are dropped (a firing under way may still submit one); its requests stay.
-- KEYS[1] the schedules   KEYS[2] the due set   KEYS[3] the schedule's state
-- ARGV[1] name
-- Returns 1 when it existed, 0 when not.
local function sched_del(keys, args)
  local existed = redis.call('HDEL', keys[1], args[1])
  redis.call('ZREM', keys[2], args[1])
  redis.call('DEL', keys[3])
  return existed
end
redis.register_function('sg2_sched_del', sched_del)
end
do
-- dag_link: a downstream D being submitted links itself to upstream U, on U's home shard, between
-- D's submit_open and its submit_commit (prelude.lua, "Dependencies between requests"): D joins
-- U's downstreams, so that U's finish owes D a release, and the reply says where U stands now.
-- Atomic with U's finish on this shard (finish_index, a lane finish): a finish before it is in the
-- reply, a finish after it finds D in the set.
-- KEYS[1] U's downstreams (dn:<ukid>)   KEYS[2] U's finish marks   KEYS[3] U's lane record (its
-- home is this shard)   KEYS[4] the shard's active index   KEYS[5] the shard's release outbox
-- ARGV[1] U's key id   ARGV[2] D's entry "<dkid>|<D's token shards>"   ARGV[3] retention (ms)
-- ARGV[4] (optional) U's lifecycle as its meta hash says, read by the caller before this call ('':
--   none read): marks of another created ms are an earlier request's under the id, left a moment
--   past its keys (a purge whose unlist found the id registered again, or the steps between its
--   seal and its unindex), not this one's end; U is then live
-- Returns {'live', lc} when U has not ended (lc: a lane request's lifecycle; '' for a request of
-- its own stream, whose meta says), {'done', lc, state} when U's latest lifecycle lc has ended in
-- state, or {'unknown'} when there is no request U (never created, or gone with its retention);
-- then nothing is written. The set keeps no expiry while U may still end or a release of it is
-- owed; once U has ended it lives a retention past its last link or release, as U's marks do.
local function dag_link(keys, args)
  local r = redis.call('HMGET', keys[3], 'state', 'lc')
  local state, lc = r[1], r[2]
  local live
  if state then
    redis.call('HSET', keys[3], 'dn', 1)
    live = state == 'queued' or state == 'running'
  else
    local m = redis.call('HMGET', keys[2], 'e', 's', 'o')
    local indexed = redis.call('ZSCORE', keys[4], args[1])
    local stale = m[1] and (args[4] or '') ~= ''
      and math.floor(tonumber(m[1]) / 1000) ~= math.floor(tonumber(args[4]) / 1000)
    if m[1] and not stale and not (m[3] and tonumber(m[3]) > tonumber(m[1])) then
      lc, state, live = m[1], m[2] or 'completed', false
    elseif indexed or stale then
      lc, live = '', true
    else
      return {'unknown'}
    end
  end
  redis.call('SADD', keys[1], args[2])
  if live then
    redis.call('PERSIST', keys[1])
    return {'live', lc}
  end
  -- Ended: D learns it here. A release still owed (the outbox holds U) may or may not reach D too
  -- (dag_settle records a lifecycle once), and sets the set's expiry when it is done.
  if not redis.call('ZSCORE', keys[5], args[1]) then redis.call('PEXPIRE', keys[1], args[3]) end
  return {'done', lc, state}
end
redis.register_function('sg2_dag_link', dag_link)
end
do
-- dag_settle: tells downstream D that a lifecycle of its upstream U has ended (prelude.lua,
-- "Dependencies between requests"): U's release calls it for every downstream it names, and
-- recovery's look at a waiting D for an upstream that vanished. It records the news in D's field
-- for U (once per lifecycle: a repeat, or older news, changes nothing) and applies D's gate.
-- The elements of the tokens it wakes are pushed by its caller: a release's caller that dies
-- before the push leaves the release in the outbox, whose re-run gets them again (below); other
-- callers arm a look first (shards::armed) and pass its deadline.
-- KEYS[1..6] D's keys (prelude.lua)
-- ARGV[1] D's key id   ARGV[2] U's key id   ARGV[3] U's lifecycle that ended   ARGV[4] its state
-- (completed, failed, cancelled; or gone with lifecycle 0: nothing of U is left, news for
-- whichever lifecycle D waits on)   ARGV[5] retention (ms)   ARGV[6] completion channel
-- ARGV[7] the deadline of the caller's arm (sg_step_late)
-- Returns, whether or not this call changed the field (so that a caller that died after it is
-- replaced by a release that does the same):
--   {'open', priority, shards, group ('' for none), element...}: D's gate opened in this call: it is `queued`, and its
--     woken tokens' elements are to be pushed; or it opened before and no part of it was handed
--     out yet: the elements of its queued tokens, to be pushed (again: a copy is harmless);
--   {'finished', 'failed', lifecycle}: D failed because of an upstream in this call, or has since
--     and its finish steps may be undone (the caller completes them, repeatable);
--   {'reopen', lifecycle}: D failed because of an upstream and its gate is open now (a requeued
--     upstream completed): the caller requeues it (requeue_dead, which reopens it);
--   {'recorded'}: nothing for the caller to do (D waits for more, runs, or ended otherwise);
--   {'none'}: D is no downstream of this U (gone, its id used again, or never linked).
-- Errors "SGLATE ..." past the deadline.
local function dag_settle(keys, args)
  local late = sg_step_late(args[7])
  if late then return late end
  local ukid, lc = args[2], tonumber(args[3])
  local field = 'u:' .. ukid
  local m = redis.call('HMGET', keys[1], 'state', field, 'ups', 'onup', 'why')
  local state = m[1]
  if not state or not m[3] or not string.find(',' .. m[3] .. ',', ',' .. ukid .. ',', 1, true) then
    return {'none'}
  end
  local old = sg_dag_field(m[2])
  if args[4] == 'gone' and lc == 0 then
    -- U vanished (its keys and marks gone, its lifecycle unknown): news of whichever D waits on.
    if old and old[1] == 'w' then sg_dag_set(keys, ukid, old, 'f', old[2], 'gone') end
  else
    if old and math.floor(old[2] / 1000) ~= math.floor(lc / 1000) then return {'none'} end
    if sg_dag_newer(old, lc) then
      local status = 'f'
      if args[4] == 'completed' then status = 'c' end
      sg_dag_set(keys, ukid, old, status, lc, args[4])
    end
  end
  if state == 'loading' then
    -- Its commit applies the gate.
    return {'recorded'}
  end
  local c = redis.call('HMGET', keys[1], 'upw', 'upf', 'prio', 'shards', 'grp')
  local gate = sg_dag_gate(c[1], c[2], m[4])
  local now = sg_now()
  if state == 'waiting' then
    if gate == 'fail' then
      local f = sg_dag_fail(keys, args[1], sg_dag_failed_one(keys, m[3]), args[5], args[6], now)
      return {'finished', 'failed', f[3]}
    end
    if gate == 'open' then
      local out = {'open', c[3], c[4] or '1', c[5] or ''}
      for _, e in ipairs(sg_dag_open(keys, args[1], now)) do out[#out + 1] = e end
      return out
    end
    return {'recorded'}
  end
  if state == 'queued' then
    -- Opened before, and no part handed out yet: its queued tokens' elements, again. A release
    -- whose caller died between the call that opened it and the push is run again from the outbox,
    -- and pushes them then; an element pushed twice is taken once (acquire moves the token to held).
    local out = {'open', c[3], c[4] or '1', c[5] or ''}
    sg_each_token(keys, 0, tonumber(redis.call('HGET', keys[1], 'ntok') or '0'), function(k, tok)
      local f = sg_split(tok)
      if f[1] == 'q' then out[#out + 1] = sg_element(args[1], k, f[2]) end
    end)
    return out
  end
  if state == 'failed' and m[5] and string.sub(m[5], 1, 9) == 'upstream:' then
    if sg_dag_reopenable(m[5], c[1], c[2], m[4]) then return {'reopen', sg_lifecycle(keys)} end
    -- The upstream it names may have completed since (requeued) while another is still failed:
    -- the record names that one from now on.
    local still = sg_dag_failed_one(keys, m[3])
    if still ~= '' and m[5] ~= 'upstream:' .. still then redis.call('HSET', keys[1], 'why', 'upstream:' .. still) end
    if redis.call('HGET', keys[1], 'sealed') ~= sg_lifecycle(keys) then
      return {'finished', 'failed', sg_lifecycle(keys)}
    end
  end
  return {'recorded'}
end
redis.register_function('sg2_dag_settle', dag_settle)
end
do
-- rel_done: the release of upstream U's finished lifecycle has reached every downstream U names
-- (dag_settle, and what each reply asked for): U leaves the release outbox, unless a later
-- lifecycle of U has finished since (a requeue), whose release is then still owed. From now on U's
-- set of downstreams expires a retention after this, as U's marks do, unless U runs again (a link
-- or a reopen keeps it then).
-- KEYS[1] the shard's release outbox   KEYS[2] U's finish marks   KEYS[3] U's lane record (its home
-- is this shard)   KEYS[4] U's downstreams
-- ARGV[1] U's key id   ARGV[2] the lifecycle released ('': none, the caller found U running
-- again)   ARGV[3] retention (ms)
-- Returns 1 when U left the outbox, 0 when it stays (a later finish owes another release).
local function rel_done(keys, args)
  local r = redis.call('HMGET', keys[3], 'state', 'lc')
  local latest, live
  if r[1] then
    live = r[1] == 'queued' or r[1] == 'running'
    if not live then latest = r[2] end
  else
    local m = redis.call('HMGET', keys[2], 'e', 'o')
    latest = m[1]
    live = m[2] and (not m[1] or tonumber(m[2]) > tonumber(m[1]))
  end
  if args[2] == '' then
    -- The caller found U running again (requeued since that finish): its next finish owes the next
    -- release, if it still runs (a finish since then owes this one).
    if not live then return 0 end
    redis.call('ZREM', keys[1], args[1])
    return 1
  end
  if latest and tonumber(latest) > tonumber(args[2]) then return 0 end
  redis.call('ZREM', keys[1], args[1])
  if not live then redis.call('PEXPIRE', keys[4], args[3]) end
  return 1
end
redis.register_function('sg2_rel_done', rel_done)
end
do
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
redis.register_function('sg2_group_set', group_set)
end
do
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
redis.register_function('sg2_group_audit', group_audit)
end
redis.register_function('sg2_submit_open', submit_open)
redis.register_function('sg2_load_parts', load_parts)
redis.register_function('sg2_submit_commit', submit_commit)
redis.register_function('sg2_push', push)
redis.register_function('sg2_lane_acquire', lane_acquire)
redis.register_function('sg2_give_back', give_back)
redis.register_function{function_name='sg2_list', callback=list, flags={'no-writes'}}
-- The library's revision (docs/operations.md, "Upgrades"): a component loads its copy only
-- over an older one.
redis.register_function{function_name='sg2_revision', callback=function() return 17 end, flags={'no-writes'}}
