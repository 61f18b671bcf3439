# Sourced by the bench scripts: starts a redis-server of the script's own on a free port (no
# persistence), stops it and removes its directory when the script exits, and defines `cli`
# (redis-cli on that port) and `port`.
dir=$(mktemp -d)
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --save '' --appendonly no --daemonize yes --pidfile "$dir/pid" >/dev/null
trap 'kill "$(cat "$dir/pid")" 2>/dev/null; rm -rf "$dir"' EXIT
cli() { redis-cli -p "$port" "$@"; }
for _ in $(seq 50); do cli ping >/dev/null 2>&1 && break; sleep 0.1; done
