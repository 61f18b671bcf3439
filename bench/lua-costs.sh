#!/usr/bin/env bash
# What a function call costs inside Redis, apart from what it does: the fixed cost of an FCALL,
# of its arguments (strings Redis has seen before against new ones), of a command called from Lua
# (and of a Lua number among that command's arguments, which Redis 7.0 formats as text), and of the
# library's `take` on a shard with one priority list. Each figure is Redis's own (`INFO
# commandstats`, µs per call), from 20,000 calls sent one after another by redis-cli, so neither
# the network nor the client counts. Starts a redis-server of its own on a free port and stops it
# at the end. docs/benchmarks.md, "What a call costs inside Redis", has a run.
#
#   bash bench/lua-costs.sh            # about a minute
set -euo pipefail
cd "$(dirname "$0")/.."

n=20000
source bench/lib.sh

cli -x FUNCTION LOAD REPLACE < "${LIBRARY:-lua/dist/sluicegate_v2.lua}" >/dev/null
cli -x FUNCTION LOAD REPLACE >/dev/null <<'EOF'
#!lua name=costs
redis.register_function('noop', function(keys, args) return 1 end)
redis.register_function('exists10', function(keys, args)
  for _ = 1, 10 do redis.call('EXISTS', 'x') end
  return 1
end)
redis.register_function('exists10_number', function(keys, args)
  for _ = 1, 10 do redis.call('EXISTS', 1732000000000) end
  return 1
end)
redis.register_function('time10', function(keys, args)
  for _ = 1, 10 do redis.call('TIME') end
  return 1
end)
EOF

# The command files: one command a line.
python3 - "$dir" "$n" <<'EOF'
import sys
dir, n = sys.argv[1], int(sys.argv[2])
shard = 'ns:{ns.q0}:'
def write(name, lines):
    with open(f'{dir}/{name}', 'w') as f:
        f.writelines(line + '\n' for line in lines)
write('noop', ['FCALL noop 0'] * n)
write('noop_same50', ['FCALL noop 0 ' + ' '.join(f'arg{j}' for j in range(50))] * n)
write('noop_new50', ['FCALL noop 0 ' + ' '.join(f'1732-{i * 50 + j}' for j in range(50)) for i in range(n)])
write('exists10', ['FCALL exists10 0'] * n)
write('exists10_number', ['FCALL exists10_number 0'] * n)
write('time10', ['FCALL time10 0'] * n)
# Elements for `take` to pop (a request's token elements, priority 50), then the takes: each slot
# new (no record of an earlier take), so each pops one element and records it.
write('push', [f'RPUSH {shard}p:50 ' + ' '.join(f'r{j}|0|1' for j in range(i, i + 500)) for i in range(0, n, 500)])
keys = f'{shard}held {shard}bell {shard}active {shard}armed {shard}paused'
write('take', [f"FCALL sg2_take 5 {keys} w/{i} t{i} '' 1 c{i} 8 {shard}lane: {shard}s: {shard}p: 0" for i in range(n)])
EOF

usec() { # the µs per call of one command in INFO commandstats
  cli INFO commandstats | tr -d '\r' | sed -n "s/^cmdstat_$1:.*usec_per_call=\([0-9.]*\).*/\1/p"
}
run() { # label, file, command whose µs per call to print
  cli CONFIG RESETSTAT >/dev/null
  cli < "$dir/$2" >/dev/null
  printf '%-52s %8s µs\n' "$1" "$(usec "$3")"
}

run 'FCALL of a no-op, no arguments' noop fcall
run 'FCALL of a no-op, 50 arguments seen before' noop_same50 fcall
run 'FCALL of a no-op, 50 new arguments' noop_new50 fcall
run 'FCALL calling EXISTS 10 times' exists10 fcall
run 'FCALL calling EXISTS 10 times, a Lua number its key' exists10_number fcall
run 'FCALL calling TIME 10 times' time10 fcall
cli < "$dir/push" >/dev/null
run 'sg2_take, popping one element' take fcall
printf '%-52s %8s µs\n' '  of which its LMPOP' "$(usec lmpop)"
