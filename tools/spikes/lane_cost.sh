#!/usr/bin/env bash
# Redis cost of the lane spike (docs/design/lanes.md): 200,000 single-part requests submitted, then
# worked 16 at a time. Starts its own redis-server; prints µs, commands and bytes per request.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
port="${PORT:-6702}"
dir="$(mktemp -d)"
redis-server --port "$port" --save '' --appendonly no --daemonize yes --dir "$dir" --logfile "$dir/log"
trap 'redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
R="redis-cli -p $port"
until $R ping >/dev/null 2>&1; do sleep 0.1; done
$R function load replace "$(cat "$here/lane_cost.lua")" >/dev/null
$R xgroup create '{q0}:lane:50' g '$' mkstream >/dev/null
N=200000
python3 - "$dir" "$N" <<'PY'
import sys
dir, n = sys.argv[1], int(sys.argv[2])
def cmd(*a):
    out = [b'*%d\r\n' % len(a)]
    for x in a:
        x = x.encode()
        out.append(b'$%d\r\n%s\r\n' % (len(x), x))
    return b''.join(out)
with open(f'{dir}/submit.resp', 'wb') as f:
    for i in range(n):
        rid = '01a20f9e7ba6779f859fe27f%08x' % i
        f.write(cmd('FCALL', 'lane_submit', '4', '{q0}:lane:50', '{q0}:s:' + rid, '{q0}:lm:50', '{q0}:bell', rid, '0123456789abcdef'))
with open(f'{dir}/work.resp', 'wb') as f:
    for i in range(n // 16 + 1):
        f.write(cmd('FCALL', 'lane_work', '3', '{q0}:lane:50', '{q0}:events', '{q0}:lm:50', 'c1', '16', '{q0}:s:'))
PY
cpu() { $R info cpu | awk -F: '/used_cpu_(sys|user):/{s+=$2} END{printf "%.6f", s}'; }
mem() { $R info memory | awk -F: '/^used_memory:/{print $2+0}'; }
calls() { $R info commandstats | awk -F'[=,]' '{s+=$2} END{print s}'; }
c0=$(cpu); m0=$(mem); k0=$(calls)
$R --pipe < "$dir/submit.resp" | tail -1
c1=$(cpu); m1=$(mem); k1=$(calls)
$R --pipe < "$dir/work.resp" | tail -1
c2=$(cpu); m2=$(mem); k2=$(calls)
awk -v n="$N" -v c0="$c0" -v c1="$c1" -v c2="$c2" -v k0="$k0" -v k1="$k1" -v k2="$k2" -v m0="$m0" -v m1="$m1" -v m2="$m2" 'BEGIN {
  printf "lane_submit: %.1f us, %.1f commands, %d bytes queued per request\n", (c1-c0)*1e6/n, (k1-k0)/n, (m1-m0)/n
  printf "lane_work:   %.1f us, %.1f commands, %d bytes kept per finished request\n", (c2-c1)*1e6/n, (k2-k1)/n, (m2-m0)/n
}'
