#!/usr/bin/env bash
# The project's test command (README, "Set up"; CI runs it through .ci/run): installs what the
# tests need where it is missing, then runs every crate's tests: with cargo-nextest when it is
# installed (.config/nextest.toml: four tests at a time, each in its own process) and the doctests
# with `cargo test --doc`, else with `cargo test`. Arguments, when given, go to `cargo test`
# instead (`./test.sh --test integration core::`).
#
# The tests need a redis-server (each test starts its own on a free port), for the dashboard's
# browser test Debian's chromium and chromium-driver, and for the Python client's suite
# (tests/python_client.rs) python3 with its venv module. Where they are missing and apt-get can
# install them (root on Debian), they are installed; elsewhere this says what to install and runs
# the tests anyway: the ones that need what is missing fail and say why. The Python client is
# installed (editable, with pytest) into a virtual environment at target/py-venv, made when
# missing and refreshed when clients/python/pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")"

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
[ -n "${CHROME_BIN:-}" ] || command -v chromium >/dev/null 2>&1 || need+=(chromium)
[ -n "${CHROMEDRIVER:-}" ] || command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
venv=target/py-venv
if [ ! -x "$venv/bin/python" ]; then
  command -v python3 >/dev/null 2>&1 || need+=(python3)
  python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
fi

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

# The Python client's virtual environment (tests/python_client.rs runs its suite from it).
pyproject=clients/python/pyproject.toml
stamp="$venv/.sluicegate-pyproject"
if [ ! -x "$venv/bin/python" ] && command -v python3 >/dev/null 2>&1; then
  echo "test.sh: making the Python client's virtual environment at $venv"
  python3 -m venv "$venv" || { rm -rf "$venv"; echo "test.sh: python3 -m venv failed; the Python client's tests will fail" >&2; }
fi
if [ -x "$venv/bin/python" ]; then
  if ! cmp -s "$pyproject" "$stamp" || ! "$venv/bin/python" -c 'import sluicegate, pytest' >/dev/null 2>&1; then
    echo "test.sh: installing clients/python[test] into $venv"
    "$venv/bin/pip" install -q -e 'clients/python[test]' && cp "$pyproject" "$stamp"
  fi
fi

if [ "$#" -eq 0 ] && cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace
  exec cargo test --workspace --doc
fi
exec cargo test "$@"
