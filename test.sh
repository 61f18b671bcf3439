#!/usr/bin/env bash
# The project's test command (README, "Set up"; CI runs it through .ci/run): installs what the
# tests need where it is missing, then runs every crate's tests. Arguments go to `cargo test`.
#
# The tests need a redis-server (each test starts its own on a free port) and, for the
# dashboard's browser test, Debian's chromium and chromium-driver. Where they are missing and
# apt-get can install them (root on Debian), they are installed; elsewhere this says what to
# install and runs the tests anyway: the ones that need what is missing fail and say why.
set -euo pipefail
cd "$(dirname "$0")"

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
[ -n "${CHROME_BIN:-}" ] || command -v chromium >/dev/null 2>&1 || need+=(chromium)
[ -n "${CHROMEDRIVER:-}" ] || command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)

if [ "${#need[@]}" -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "test.sh: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "test.sh: missing ${need[*]}; install them (Debian: apt-get install -y ${need[*]})," \
      "or the tests that need them will fail" >&2
  fi
fi

exec cargo test "$@"
