#!/usr/bin/env python3
"""Python workers on the many_small shape (issue 16), beside the Rust worker and BullMQ's Python
port, on the same Redis in the same run.

    REDIS_URL=redis://127.0.0.1:PORT target/bench-py-venv/bin/python bench/python/bench.py [--runs N] [scenario...]

Scenarios (default: all three, in this order):
  python_many_small              1,000 requests x 100 parts (limit 4) submitted by the Python
                                 producer, then drained by a pool of Python worker processes
  python_rust_worker_many_small  examples/bench's own many_small on the same server: the Rust
                                 producer and one Rust worker of 16 slots
  bullmq_python_plain_queue      100,000 BullMQ jobs added with the Python `bullmq` package, then
                                 drained by a pool of Python BullMQ workers of the same size

Stdout: a `meta` line, then one JSON line per result (medians over the runs), in the shape of
examples/bench.rs and bench/bullmq/bench.mjs. Stderr: progress and a short table.
README.md beside this file explains the figures; docs/benchmarks.md quotes them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
PAYLOAD = "0123456789abcdef"  # the 16-byte payload of every sluicegate scenario
BULLMQ_PAYLOAD = {"p": PAYLOAD}  # bench.mjs's
REQUESTS, PARTS, LIMIT = 1_000, 100, 4  # many_small
ADD_BATCH = 1_000  # addBulk batch, as bench.mjs
SCENARIOS = ["python_many_small", "python_rust_worker_many_small", "bullmq_python_plain_queue"]
# As examples/bench.rs's scenario settings: long leases (no recovery work from slow beats on a
# loaded machine), results kept a minute.
LEASE_S, RETENTION_S = 30.0, 60.0


def log(*a: Any) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f}s]", *a, file=sys.stderr, flush=True)


STARTED = time.monotonic()


# ---------------------------------------------------------------------------- Redis counters
class Counters:
    """INFO cpu and commandstats of the server, read before and after a measured phase."""

    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=30)

    def snapshot(self) -> Dict[str, float]:
        cpu = self.client.info("cpu")
        calls = scripts = 0
        for name, v in self.client.info("commandstats").items():
            n = int(v.get("calls", 0)) if isinstance(v, dict) else 0
            calls += n
            if name in ("cmdstat_fcall", "cmdstat_fcall_ro", "cmdstat_evalsha", "cmdstat_eval"):
                scripts += n
        return {"cpu": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), "calls": calls, "scripts": scripts}

    def sweep(self, pattern: str) -> int:
        """Unlinks every key matching ``pattern`` (outside any measured phase)."""
        n = 0
        batch: List[str] = []
        for key in self.client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                n += self.client.unlink(*batch)
                batch = []
        if batch:
            n += self.client.unlink(*batch)
        return n


def row(system: str, scenario: str, items: int, seconds: float, s0: Dict[str, float], s1: Dict[str, float],
        note: str) -> Dict[str, Any]:
    scripts = (s1["scripts"] - s0["scripts"]) / items
    return {
        "system": system,
        "scenario": scenario,
        "items": items,
        "throughput_per_s": round(items / seconds, 1),
        "p50_ms": None,
        "p99_ms": None,
        "redis_cpu_us_per_item": round((s1["cpu"] - s0["cpu"]) * 1e6 / items, 2),
        "redis_cmds_per_item": round((s1["calls"] - s0["calls"]) / items, 2),
        "bytes_per_item": None,
        "note": f"{note}; {scripts:.2f} script calls/item",
    }


# ---------------------------------------------------------------------------- worker processes
# Each pool process builds its worker (connection, library or scripts loaded), says it is ready,
# and starts taking work only when the parent sets `go`, so the timed drain starts with every
# process ready (as bench.mjs starts its timer after `waitUntilReady`) and does not include
# interpreter start-up. `stop` ends it; SIGINT is left to the parent, which then sets `stop`.

def _quiet_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def sluicegate_process(url: str, ns: str, slots: int, handler_kind: str, ready: Any, go: Any, stop: Any) -> None:
    _quiet_sigint()
    from sluicegate import Worker

    def noop(ctx: Any, part: Any) -> None:
        return None

    async def anoop(ctx: Any, part: Any) -> None:
        return None

    handler: Callable[..., Any] = anoop if handler_kind == "async" else noop
    worker = Worker(url, handler, slots=slots, namespace=ns, lease=LEASE_S, retention=RETENTION_S)
    ready.release()
    go.wait()
    thread = worker.start()
    stop.wait()
    worker.stop()  # hands its tokens back and leaves the registry
    thread.join(60)


def bullmq_process(url: str, prefix: str, queue: str, concurrency: int, ready: Any, go: Any, stop: Any,
                   counts: Any, lasts: Any, failures: Any, index: int) -> None:
    _quiet_sigint()
    from bullmq import Worker

    async def main() -> None:
        async def noop(job: Any, token: Any) -> None:
            return None

        worker = Worker(queue, noop, {"connection": url, "prefix": prefix, "concurrency": concurrency,
                                      "autorun": False})

        def completed(job: Any, result: Any) -> None:
            # Each process writes only its own cells; the parent sums the counts once they reach
            # the jobs queued, so the time is written first.
            lasts[index] = time.monotonic()
            counts[index] += 1

        def failed(job: Any, err: Any) -> None:
            failures[index] += 1

        worker.on("completed", completed)
        worker.on("failed", failed)
        worker.on("error", lambda err, *rest: failed(None, err))
        await worker.client.ping()
        ready.release()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, go.wait)
        running = asyncio.ensure_future(worker.run())
        await loop.run_in_executor(None, stop.wait)
        await worker.close()
        await asyncio.gather(running, return_exceptions=True)

    asyncio.run(main())


class Pool:
    """``n`` worker processes of one kind, started, made ready, let go, stopped."""

    def __init__(self, n: int, target: Callable[..., None], args: Callable[["Pool", int], tuple]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.ready = ctx.Semaphore(0)
        self.go = ctx.Event()
        self.stop = ctx.Event()
        self.procs = [ctx.Process(target=target, args=args(self, i), daemon=True) for i in range(n)]

    def start(self, timeout: float) -> None:
        for p in self.procs:
            p.start()
        deadline = time.monotonic() + timeout
        for _ in self.procs:
            while not self.ready.acquire(timeout=0.5):
                self.check()
                if time.monotonic() > deadline:
                    raise RuntimeError("the worker processes were not ready in time")

    def check(self) -> None:
        for p in self.procs:
            if p.exitcode is not None:
                raise RuntimeError(f"worker process {p.pid} exited with {p.exitcode}")

    def close(self) -> None:
        self.stop.set()
        self.go.set()  # a process still waiting for go reaches stop
        for p in self.procs:
            if p.pid is None:
                continue  # never started
            p.join(90)
            if p.is_alive():
                log(f"worker process {p.pid} did not stop in 90 s; killing it")
                p.kill()
                p.join()


# ---------------------------------------------------------------------------- scenarios
class Bench:
    def __init__(self, url: str, scale: float, processes: int, slots: int, handler: str, rust_bench: Path,
                 timeout: float) -> None:
        self.url = url
        self.scale = scale
        self.processes = processes
        self.slots = slots
        self.handler = handler
        self.rust_bench = rust_bench
        self.timeout = timeout
        self.counters = Counters(url)
        self.next_ns = 0

    def scaled(self, n: int) -> int:
        return max(1, round(n * self.scale))

    def pool_text(self) -> str:
        return f"{self.processes} processes x {self.slots}"

    def python_many_small(self) -> List[Dict[str, Any]]:
        from sluicegate import Listener, Producer

        requests = self.scaled(REQUESTS)
        items = requests * PARTS
        # A namespace as long as examples/bench.rs's ("b<pid>.<n>"), since it is in every key.
        ns = f"p{os.getpid()}.{self.next_ns}"
        self.next_ns += 1
        producer = Producer(self.url, ns, lease=LEASE_S, retention=RETENTION_S)
        pool: Optional[Pool] = None
        try:
            parts = [PAYLOAD] * PARTS
            s0 = self.counters.snapshot()
            t0 = time.monotonic()
            ids = {producer.submit(parts, concurrency=LIMIT).id for _ in range(requests)}
            t1 = time.monotonic()
            s1 = self.counters.snapshot()
            submit = row("sluicegate-python", "python_many_small_submit", items, t1 - t0, s0, s1,
                         f"{requests} x {PARTS} parts, one Python producer, submitted one request after another")

            # The events stream is the durable record of completions; reading it costs one XREAD
            # per batch of events, so the drain's figures are the workers'.
            events = Listener(self.url, ns, block=0.5)
            pool = Pool(self.processes, sluicegate_process,
                        lambda pool, i: (self.url, ns, self.slots, self.handler, pool.ready, pool.go, pool.stop))
            pool.start(timeout=60)
            s2 = self.counters.snapshot()
            t2 = time.monotonic()
            pool.go.set()
            done = 0
            states: Dict[str, int] = {}
            while done < requests:
                for ev in events.poll():
                    if ev.request_id in ids:
                        done += 1
                        states[ev.state] = states.get(ev.state, 0) + 1
                pool.check()
                if time.monotonic() - t2 > self.timeout:
                    raise RuntimeError(f"timed out after {self.timeout:.0f} s with {done} of {requests} requests done")
            t3 = time.monotonic()
            s3 = self.counters.snapshot()
            events.close()
            if states.get("completed", 0) != requests:
                raise RuntimeError(f"requests ended {states}, not all completed")
            drain = row("sluicegate-python", "python_many_small", items, t3 - t2, s2, s3,
                        f"{requests} x {PARTS}, limit {LIMIT} per request, {self.pool_text()} slots "
                        f"({self.handler} no-op handler), lease {LEASE_S:g} s, recovery on: "
                        "pool go -> last completion event")
            return [submit, drain]
        finally:
            if pool is not None:
                pool.close()
            producer.close()
            self.counters.sweep(f"{ns}:*")

    def python_rust_worker_many_small(self) -> List[Dict[str, Any]]:
        if not self.rust_bench.exists():
            raise RuntimeError(
                f"{self.rust_bench} is missing: run `cargo build --release --example bench` at the repository root "
                "(or pass --rust-bench PATH)"
            )
        env = {**os.environ, "REDIS_URL": self.url, "BENCH_SCALE": repr(self.scale)}
        proc = subprocess.Popen([str(self.rust_bench), "many_small"], env=env, stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=self.timeout + 60)
        # examples/bench.rs names its namespaces b<pid>.<n> and leaves their results to expire.
        self.counters.sweep(f"b{proc.pid}.*")
        if proc.returncode != 0:
            raise RuntimeError(f"{self.rust_bench} many_small failed ({proc.returncode})")
        rows = []
        for line in out.splitlines():
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get("scenario") in ("many_small", "many_small_submit"):
                r["scenario"] = r["scenario"].replace("many_small", "python_rust_worker_many_small")
                note = r["note"].removesuffix(" (median of 1)")
                r["note"] = f"examples/bench many_small (Rust producer, one Rust worker process): {note}"
                for field, digits in (("throughput_per_s", 1), ("redis_cpu_us_per_item", 2), ("redis_cmds_per_item", 2)):
                    if r.get(field) is not None:
                        r[field] = round(r[field], digits)
                rows.append(r)
        if len(rows) != 2:
            raise RuntimeError(f"{self.rust_bench} printed no many_small rows")
        return rows

    def bullmq_python_plain_queue(self) -> List[Dict[str, Any]]:
        return asyncio.run(self._bullmq())

    async def _bullmq(self) -> List[Dict[str, Any]]:
        from bullmq import Queue

        n = self.scaled(REQUESTS * PARTS)
        prefix = f"sgbench-py-{int(time.time()):x}-{os.getpid()}"
        name = "plain"
        queue = Queue(name, {"connection": self.url, "prefix": prefix})
        pool: Optional[Pool] = None
        ctx = multiprocessing.get_context("spawn")
        counts = ctx.RawArray("q", self.processes)
        lasts = ctx.RawArray("d", self.processes)
        failures = ctx.RawArray("q", self.processes)
        try:
            await queue.client.ping()
            s0 = self.counters.snapshot()
            t0 = time.monotonic()
            for i in range(0, n, ADD_BATCH):
                jobs = [{"name": "j", "data": BULLMQ_PAYLOAD, "opts": {"removeOnComplete": True}}
                        for _ in range(min(ADD_BATCH, n - i))]
                await queue.addBulk(jobs)
            t1 = time.monotonic()
            s1 = self.counters.snapshot()
            add = row("bullmq-python", "bullmq_python_plain_add", n, t1 - t0, s0, s1,
                      f"Queue.addBulk batches of {ADD_BATCH} (removeOnComplete), one Python producer")

            pool = Pool(self.processes, bullmq_process,
                        lambda pool, i: (self.url, prefix, name, self.slots, pool.ready, pool.go, pool.stop,
                                   counts, lasts, failures, i))
            await asyncio.get_running_loop().run_in_executor(None, pool.start, 60)
            s2 = self.counters.snapshot()
            t2 = time.monotonic()
            pool.go.set()
            while sum(counts) < n:
                await asyncio.sleep(0.005)
                pool.check()
                if sum(failures):
                    raise RuntimeError(f"{sum(failures)} jobs failed or workers reported errors")
                if time.monotonic() - t2 > self.timeout:
                    raise RuntimeError(f"timed out after {self.timeout:.0f} s with {sum(counts)} of {n} jobs done")
            t3 = max(lasts)
            s3 = self.counters.snapshot()
            drain = row("bullmq-python", "bullmq_python_plain_queue", n, t3 - t2, s2, s3,
                        f"{self.pool_text()} concurrency, async no-op processor, removeOnComplete: "
                        "pool go -> last completion")
            return [add, drain]
        finally:
            if pool is not None:
                await asyncio.get_running_loop().run_in_executor(None, pool.close)
            try:
                await queue.obliterate(force=True)
            except Exception as e:  # noqa: BLE001 - the sweep below removes what is left
                log(f"obliterate failed: {e}")
            await queue.close()
            left = self.counters.sweep(f"{prefix}:*")
            if left:
                log(f"{left} keys were left under {prefix} after obliterate and have been removed")


# ---------------------------------------------------------------------------- output
def medians(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per (system, scenario): the median of each figure (the upper one of an even count,
    as examples/bench.rs)."""
    keys: List[tuple] = []
    for r in rows:
        k = (r["system"], r["scenario"])
        if k not in keys:
            keys.append(k)
    out = []
    for system, scenario in keys:
        runs = [r for r in rows if r["system"] == system and r["scenario"] == scenario]
        m = dict(runs[0])
        for field in ("throughput_per_s", "p50_ms", "p99_ms", "redis_cpu_us_per_item", "redis_cmds_per_item",
                      "bytes_per_item"):
            v = sorted(r[field] for r in runs if r.get(field) is not None)
            m[field] = v[len(v) // 2] if v else None
        m["note"] = f"{runs[0]['note']} (median of {len(runs)})"
        out.append(m)
    return out


def table(rows: List[Dict[str, Any]]) -> None:
    f = lambda v, p: "-" if v is None else f"{v:,.{p}f}"  # noqa: E731
    print(f"{'system':<18} {'scenario':<36} {'items':>8} {'items/s':>10} {'µs Redis':>9} {'cmds':>6}", file=sys.stderr)
    for r in rows:
        print(f"{r['system']:<18} {r['scenario']:<36} {r['items']:>8} {f(r['throughput_per_s'], 0):>10} "
              f"{f(r['redis_cpu_us_per_item'], 2):>9} {f(r['redis_cmds_per_item'], 2):>6}", file=sys.stderr)
    find = {r["scenario"]: r for r in rows}
    py = find.get("python_many_small")
    for other in ("python_rust_worker_many_small", "bullmq_python_plain_queue"):
        o = find.get(other)
        if py and o and py["throughput_per_s"] and o["throughput_per_s"] and py["redis_cpu_us_per_item"]:
            # As examples/bench.rs's ratios: above 1 is better for the Python pool.
            print(f"python_many_small against {other}: throughput {py['throughput_per_s'] / o['throughput_per_s']:.2f}x, "
                  f"Redis CPU per item {o['redis_cpu_us_per_item'] / py['redis_cpu_us_per_item']:.2f}x "
                  "(above 1: better for the Python pool)", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", metavar="scenario", help=", ".join(SCENARIOS))
    parser.add_argument("--runs", type=int, default=3, help="runs of every scenario; medians are printed (default 3)")
    # The default pool, 2 processes x 4 slots: a Python worker runs its slots as threads under one
    # GIL, so on 2 cores one process per core is the most that helps (Redis needs CPU too), and
    # beyond about 4 slots a process spends its time handing parts between threads, and its
    # slots' batches shrink (README.md, "The pool").
    parser.add_argument("--processes", type=int, default=2, help="worker processes in each Python pool (default 2)")
    parser.add_argument("--slots", type=int, default=4,
                        help="slots per sluicegate process, concurrency per BullMQ process (default 4)")
    parser.add_argument("--handler", choices=["sync", "async"], default="sync",
                        help="the sluicegate Python no-op handler: a plain function (threads) or async def")
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
    parser.add_argument("--rust-bench", type=Path, default=target / "release" / "examples" / "bench",
                        help="examples/bench built with `cargo build --release --example bench`")
    args = parser.parse_args()

    url = os.environ.get("REDIS_URL")
    if not url:
        # No default on purpose: this writes 100,000s of keys and burns CPU; never hit a server by accident.
        print("bench.py: REDIS_URL is required (e.g. REDIS_URL=redis://127.0.0.1:6633)", file=sys.stderr)
        return 2
    try:
        scale = float(os.environ.get("BENCH_SCALE", "1"))
        assert scale > 0
    except (ValueError, AssertionError):
        print(f"bench.py: bad BENCH_SCALE {os.environ.get('BENCH_SCALE')}", file=sys.stderr)
        return 2
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown or args.runs < 1 or args.processes < 1 or args.slots < 1:
        print(f"bench.py: bad arguments {unknown or ''}; scenarios: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    chosen = args.scenarios or SCENARIOS
    if "python_rust_worker_many_small" in chosen and not args.rust_bench.exists():
        print(f"bench.py: {args.rust_bench} is missing: run `cargo build --release --example bench` at the "
              "repository root (or pass --rust-bench PATH)", file=sys.stderr)
        return 2
    timeout = float(os.environ.get("BENCH_TIMEOUT_S", "600"))
    bench = Bench(url, scale, args.processes, args.slots, args.handler, args.rust_bench, timeout)

    import bullmq
    import redis
    import sluicegate

    server = bench.counters.client.info("server")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    meta = {
        "system": "python", "scenario": "meta", "items": 0, "throughput_per_s": None, "p50_ms": None,
        "p99_ms": None, "redis_cpu_us_per_item": None, "redis_cmds_per_item": None, "bytes_per_item": None,
        "note": (f"python {platform.python_version()}, sluicegate {sluicegate.__version__}, bullmq {bullmq.__version__}, "
                 f"redis-py {redis.__version__}, redis {server['redis_version']}, cpus {os.cpu_count()}, "
                 f"loadavg {load}, scale {scale}, runs {args.runs}, pool {args.processes} processes x {args.slots}, "
                 f"{args.handler} handler"),
    }
    print(json.dumps(meta, ensure_ascii=False), flush=True)

    rows: List[Dict[str, Any]] = []
    failed = 0
    for run in range(1, args.runs + 1):
        load = os.getloadavg()[0]
        log(f"run {run}/{args.runs} against {url} (scale {scale}; load average {load:.2f})")
        if load > 1.5:
            log(f"note: the machine is busy with something else (load average {load:.2f}); figures will be lower")
        for name in chosen:
            t = time.monotonic()
            log(f"{name}: start")
            try:
                got = getattr(bench, name)()
            except Exception as e:  # noqa: BLE001 - the other scenarios still run
                failed += 1
                log(f"{name}: FAILED: {e}")
                if not isinstance(e, RuntimeError):
                    traceback.print_exc()
                continue
            for r in got:
                log(f"  {r['scenario']}: {r['throughput_per_s']:,.0f}/s, {r['redis_cpu_us_per_item']} µs Redis, "
                    f"{r['redis_cmds_per_item']} cmds per item")
            rows.extend(got)
            log(f"{name}: done in {time.monotonic() - t:.1f} s")
    result = medians(rows)
    table(result)
    for r in result:
        print(json.dumps(r, ensure_ascii=False), flush=True)
    if failed:
        log(f"{failed} scenario runs failed")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(130)
