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
