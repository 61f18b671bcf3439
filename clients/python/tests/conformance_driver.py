"""The Python conformance driver (the interface shared with the Rust driver).

    python conformance_driver.py producer --url URL --namespace NS --scenario FILE --out OUT [--timeout-s 60]
    python conformance_driver.py worker --url URL --namespace NS --scenario FILE --log LOG [--slots 4]

The producer submits the scenario's request, waits for it and writes its outcome as JSON; the worker
runs the scenario's handler until SIGTERM, logging each handler start and end as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any, Dict

from sluicegate import NotOpen, PermanentError, Producer, Worker

DEFAULTS: Dict[str, Any] = {
    "priority": 50,
    "concurrency": 1,
    "max_attempts": 3,
    "fail_permanently": [],
    "fail_times": {},
    "sleep_ms": 0,
    "streamed": False,
    "chunk": 5,
    "own_stream": False,
    "cancel_after_ms": None,
}
#: Short timings, so that recovery tests are quick.
TIMINGS = dict(lease=1.5, heartbeat=0.3, recovery_interval=0.3, census_interval=0.3, idle_poll=0.25)
BACKOFF, BACKOFF_MAX = 0.01, 0.1


def load(path: str) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        scenario = json.load(f)
    out = dict(DEFAULTS)
    out.update({k: v for k, v in scenario.items()})
    for k, v in DEFAULTS.items():
        if out.get(k) is None and v is not None:
            out[k] = v
    return out


def payload(i: int) -> Dict[str, Any]:
    return {"i": i, "s": f"part-{i}"}


def producer(args: argparse.Namespace) -> int:
    sc = load(args.scenario)
    p = Producer(args.url, args.namespace)
    parts = [payload(i) for i in range(int(sc["parts"]))]
    policy = dict(priority=sc["priority"], concurrency=sc["concurrency"], max_attempts=sc["max_attempts"])
    started = time.monotonic()
    cancel_after = sc.get("cancel_after_ms")
    if sc["streamed"]:
        req = p.open(**policy, backoff=BACKOFF, backoff_max=BACKOFF_MAX)
        rid = req.id
        timer = _cancel_timer(p, rid, cancel_after, started)
        chunk = max(1, int(sc["chunk"]))
        try:
            for i in range(0, len(parts), chunk):
                req.add(parts[i : i + chunk])
            req.finalize()
        except NotOpen:
            pass  # cancelled while it was being added to
    else:
        handle = p.submit(parts, **policy, own_stream=bool(sc["own_stream"]), backoff=BACKOFF, backoff_max=BACKOFF_MAX)
        rid = handle.id
        timer = _cancel_timer(p, rid, cancel_after, started)
    done = p.wait(rid, timeout=args.timeout_s)
    if timer is not None:
        timer.join()
    out = {
        "id": rid,
        "state": done.state,
        "results": done.results,
        "errors": {str(i): e.message for i, e in done.errors.items()},
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


def _cancel_timer(p: Producer, rid: str, after_ms: Any, started: float) -> Any:
    if after_ms is None:
        return None

    def cancel() -> None:
        time.sleep(max(0.0, started + after_ms / 1000 - time.monotonic()))
        p.cancel(rid)

    t = threading.Thread(target=cancel, daemon=True)
    t.start()
    return t


def worker(args: argparse.Namespace) -> int:
    sc = load(args.scenario)
    permanent = {int(i) for i in sc["fail_permanently"]}
    fail_times = {str(k): int(v) for k, v in dict(sc["fail_times"]).items()}
    sleep_s = float(sc["sleep_ms"]) / 1000
    log_fd = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()

    def log(ev: str, ctx: Any) -> None:
        line = json.dumps({"ev": ev, "rid": ctx.request_id, "i": ctx.index, "attempt": ctx.attempt,
                           "t_us": time.time_ns() // 1000, "pid": pid})
        os.write(log_fd, (line + "\n").encode())

    def handler(ctx: Any, part: Any) -> Any:
        log("start", ctx)
        try:
            i = int(part["i"])
            if sleep_s:
                time.sleep(sleep_s)
            if i in permanent:
                raise PermanentError(f"permanent {i}")
            if ctx.attempt <= fail_times.get(str(i), 0):
                raise RuntimeError(f"flaky {i} attempt {ctx.attempt}")
            return {"i": i, "double": 2 * i, "s": f"part-{i}"}
        finally:
            log("end", ctx)

    w = Worker(args.url, handler, slots=args.slots, namespace=args.namespace, **TIMINGS)
    threading.Thread(target=lambda: w.ready.wait() and print("READY", flush=True), daemon=True).start()
    w.run()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    sub = ap.add_subparsers(dest="role", required=True)
    for role in ("producer", "worker"):
        s = sub.add_parser(role)
        s.add_argument("--url", required=True)
        s.add_argument("--namespace", required=True)
        s.add_argument("--scenario", required=True)
        if role == "producer":
            s.add_argument("--out", required=True)
            s.add_argument("--timeout-s", type=float, default=60.0)
        else:
            s.add_argument("--log", required=True)
            s.add_argument("--slots", type=int, default=4)
    args = ap.parse_args()
    try:
        return producer(args) if args.role == "producer" else worker(args)
    except Exception as e:  # noqa: BLE001 - one clear line, non-zero exit
        print(f"conformance driver ({args.role}): {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
