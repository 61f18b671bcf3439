#!/usr/bin/env bash
# What a short-lived client costs Redis: N processes one after another, each connecting and
# submitting one single-part request, then exiting, as a script that runs `sluicegate submit` per
# line does, or a fleet restarting. Side by side on one redis-server of its own (a free port):
# the `sluicegate` command (each connect reads the library's revision, and loads the library only
# when the one loaded is older or missing: docs/operations.md, "Upgrades"), and BullMQ 6.7.0
# (`new Queue`, one `add`, `close`; its scripts are sent with EVALSHA, and compiled once per
# Redis). Each figure is Redis's own: `used_cpu_sys` + `used_cpu_user` per process, and how many
# `FUNCTION LOAD`s and `EVAL`s ran (INFO cpu, INFO commandstats), so neither process start-up nor
# the network counts. docs/benchmarks.md, "Library revisions", has a run.
#
#   bash bench/connect-cost.sh [N] [SLUICEGATE_BINARY...]   # N = 50, the binary target/release/sluicegate
#   (cd bench/bullmq && npm ci) first, for BullMQ's row.
set -euo pipefail
cd "$(dirname "$0")/.."

n=${1:-50}
shift || true
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=(target/release/sluicegate)
source bench/lib.sh
url=redis://127.0.0.1:$port

cpu() { cli info cpu | awk -F: '/^used_cpu_(sys|user):/ { s += $2 } END { printf "%.6f", s }'; }
calls() { cli info commandstats | awk -F'[:=,]' -v c="cmdstat_$1" '$1 == c { print $3 }'; }
# One row: LABEL, then the command each of the N processes runs.
row() {
  local label=$1
  shift
  "$@" >/dev/null 2>&1 # the first process of each kind loads what it needs: not counted
  local c0 l0 e0 c1 l1 e1
  c0=$(cpu) l0=$(calls "function|load") e0=$(calls eval)
  for _ in $(seq "$n"); do "$@" >/dev/null 2>&1; done
  c1=$(cpu) l1=$(calls "function|load") e1=$(calls eval)
  awk -v l="$label" -v n="$n" -v c="$(awk -v a="$c0" -v b="$c1" 'BEGIN { print b - a }')" \
    -v fl="$(( ${l1:-0} - ${l0:-0} ))" -v ev="$(( ${e1:-0} - ${e0:-0} ))" \
    'BEGIN { printf "%-44s %8.3f ms of Redis CPU per process, %d FUNCTION LOAD, %d EVAL in %d processes\n", l, c * 1000 / n, fl, ev, n }'
}

echo "line" >"$dir/one.txt"
for bin in "${bins[@]}"; do
  row "$(basename "$bin") submit ($bin)" "$bin" --redis "$url" --namespace connect submit "$dir/one.txt"
done
if [ -d bench/bullmq/node_modules/bullmq ]; then
  row "BullMQ (new Queue, add, close)" env REDIS_URL="$url" node bench/bullmq/connect.mjs
else
  echo "BullMQ: not installed (cd bench/bullmq && npm ci)"
fi
