-- sweep: remove a finished request's stale elements from a list of a shard other than its home
-- (finish_index sweeps the home shard's), within the 1,000 elements nearest the head.
-- KEYS[1] the priority list   KEYS[2] the shard's bell
-- ARGV[1..] elements
-- Returns 1.
local function sweep(keys, args)
  sg_sweep(keys[1], keys[2], args, 1)
  return 1
end
