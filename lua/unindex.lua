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
