-- verify_tokens: recovery's token-side step: push restored elements, and report which of the
-- elements that should be waiting in the list are not there (popped into a reply nobody read, or
-- never pushed). Also re-arms the request's next census.
-- KEYS[1] the request's priority list   KEYS[2] the active-request index
-- ARGV[1] request key id   ARGV[2] delay (ms) until the next census   ARGV[3] n: how many
-- elements to push   ARGV[4 .. 3+n] elements to push   ARGV[4+n ..] elements to check
-- Returns the checked elements that are missing from the list.
local function verify_tokens(keys, args)
  local n = tonumber(args[3])
  for i = 4, 3 + n do redis.call('LPUSH', keys[1], args[i]) end
  redis.call('ZADD', keys[2], 'XX', sg_now() + tonumber(args[2]), args[1])
  local missing = {}
  for i = 4 + n, #args do
    if not redis.call('LPOS', keys[1], args[i]) then missing[#missing + 1] = args[i] end
  end
  return missing
end
