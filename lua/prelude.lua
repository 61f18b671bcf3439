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
