"""Requests submitted after others (a DAG of requests; tests/suites/dag.rs for the Rust client):
their gates, their results flowing through ``Context.upstream``, failures cascading with one
event each, a requeued upstream reopening them, releases left to recovery, the refusals, a Redis
Cluster, and interop with the Rust CLI's worker and submits."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence

import pytest

from sluicegate import (
    Admin,
    Completion,
    InvalidRequest,
    Listener,
    PartError,
    PermanentError,
    Producer,
    RequestHandle,
    UnknownUpstream,
    Upstream,
    Worker,
)
from sluicegate._keys import key_id

from conftest import CLI, FAST, Running, cli, cli_json, cli_worker_process


class Steps:
    """A handler whose part ``{"n", "upstreams", "fail"}`` adds to ``n`` every result of each of
    its upstreams (read with ``ctx.upstream``), and fails permanently while ``failing`` is set and
    the part has ``fail``. Records when each request's parts started and ended."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.first_start: Dict[str, float] = {}
        self.last_end: Dict[str, float] = {}
        self.failing = threading.Event()
        #: Parts wait for it before they start (set: they do not wait).
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, ctx: Any, step: Dict[str, Any]) -> int:
        self.gate.wait(30)
        with self.lock:
            self.first_start.setdefault(ctx.request_id, time.monotonic())
        total = step["n"]
        for up in step["upstreams"]:
            for r in ctx.upstream(up):
                if isinstance(r, PartError):
                    raise PermanentError(f"upstream part failed: {r}")
                total += r
        time.sleep(0.005)
        with self.lock:
            self.last_end[ctx.request_id] = time.monotonic()
        if step["fail"] and self.failing.is_set():
            raise PermanentError("a step chosen to fail")
        return total

    def started(self, h: RequestHandle) -> bool:
        with self.lock:
            return h.id in self.first_start

    def after(self, down: RequestHandle, up: RequestHandle) -> bool:
        with self.lock:
            return self.first_start[down.id] >= self.last_end[up.id]


def parts(ns: Sequence[int], upstreams: Sequence[RequestHandle] = (), fail: bool = False) -> List[Dict[str, Any]]:
    return [{"n": n, "upstreams": [u.id for u in upstreams], "fail": fail} for n in ns]


def outputs(h: RequestHandle, timeout: float = 20) -> List[Any]:
    done = h.wait(timeout=timeout)
    assert done.state == "completed", (h.id, done.state, done.reason, done.errors)
    return done.results


def outputs_once_reopened(h: RequestHandle, timeout: float = 20) -> List[Any]:
    """The results of ``h`` once it completed, for a request that is failed until a release
    reopens it (its wait returns its failure until then)."""
    end = time.monotonic() + timeout
    while True:
        done = h.wait(timeout=timeout)
        if done.state == "completed":
            return done.results
        assert time.monotonic() < end, f"{h.id} never reopened: {done.reason}"
        time.sleep(0.05)


def until(what: str, check: Any, timeout: float = 10) -> Any:
    end = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_diamond_runs_each_request_after_its_upstreams_and_their_results_flow(
    server: Any, ns: str, running: Running
) -> None:
    steps = Steps()
    p = Producer(server.url, ns)
    admin = Admin(server.url, ns)
    for own_stream in (False, True):
        a = p.submit(parts(range(3)), concurrency=2, own_stream=own_stream)
        b = p.submit(parts([10, 11], [a]), concurrency=2, after=[a])
        if own_stream:
            # A finished before C is submitted: C's link finds it ended, and its commit opens it.
            outputs(a)
        c = p.submit(parts([20], [a]), after=[a.id])
        d = p.submit(parts([100, 101, 102], [b, c]), concurrency=3, after=[b, c])
        if not own_stream:
            # No worker yet: B, C and D wait, visibly.
            st = admin.status(b.id)
            assert st.state == "waiting" and st.upstreams == [Upstream(a.id, None)]
            assert sorted(admin.status(a.id).downstreams) == sorted([b.id, c.id])
            assert admin.status(d.id).upstreams == [Upstream(b.id, None), Upstream(c.id, None)]
            assert {r.id for r in admin.list(state="waiting").requests} == {b.id, c.id, d.id}
            assert p.try_completion(d.id) is None
            running.start(server.url, steps, ns, slots=8)
        a_sum = sum(outputs(a))
        assert a_sum == 3
        b_out = outputs(b)
        assert b_out == [10 + a_sum, 11 + a_sum]
        c_out = outputs(c)
        assert c_out == [20 + a_sum]
        bc = sum(b_out) + sum(c_out)
        assert outputs(d) == [100 + bc, 101 + bc, 102 + bc]
        for down, ups in ((b, [a]), (c, [a]), (d, [b, c])):
            for up in ups:
                assert steps.after(down, up), f"{down.id} started before its upstream {up.id} ended"
        assert admin.status(d.id).upstreams == [Upstream(b.id, "completed"), Upstream(c.id, "completed")]
        assert admin.list(state="waiting").requests == []


def test_a_failed_upstream_fails_its_downstreams_once_and_a_requeued_one_releases_them(
    server: Any, ns: str, running: Running
) -> None:
    listener = Listener(server.url, ns, block=0.2)
    steps = Steps()
    steps.failing.set()
    p = Producer(server.url, ns)
    admin = Admin(server.url, ns)
    a = p.submit(parts([0, 1], fail=True), own_stream=True)
    b = p.submit(parts([10], [a]), after=[a])
    c = p.submit(parts([20], [b]), after=[b])
    d = p.submit(parts([30]), after=[a], on_upstream_failure="run")
    running.start(server.url, steps, ns, slots=4)
    for h, upstream in ((a, None), (b, a), (c, b)):
        done = h.wait(timeout=20)
        assert done.state == "failed", h.id
        assert done.reason == (None if upstream is None else f"upstream:{upstream.id}"), h.id
    assert outputs(d) == [30]
    assert not steps.started(b) and not steps.started(c), "a downstream of a failed upstream ran"
    assert admin.status(c.id).upstreams == [Upstream(b.id, "failed")]
    assert c.wait().errors[0].message == f"not run: its upstream {b.id} did not complete"
    # One event per request: a, b, c failed and d completed.
    events: Dict[str, List[str]] = {}
    quiet = 0
    while quiet < 3:
        got = listener.poll()
        quiet = 0 if got else quiet + 1
        for e in got:
            events.setdefault(e.request_id, []).append(e.state)
    assert events == {a.id: ["failed"], b.id: ["failed"], c.id: ["failed"], d.id: ["completed"]}
    # A downstream failed by its upstream has no dead letter of its own: a requeue of it reopens
    # nothing while its upstream is still failed.
    assert admin.requeue(b.id) == 0
    assert b.wait().state == "failed"
    # Requeued, A completes this time: B and C reopen, run and complete, in order.
    steps.failing.clear()
    assert admin.requeue(a.id) == 2
    a_sum = sum(outputs(a))
    assert a_sum == 1
    assert outputs_once_reopened(b) == [10 + a_sum]
    assert outputs_once_reopened(c) == [20 + 10 + a_sum]
    assert steps.after(b, a) and steps.after(c, b)
    assert admin.status(c.id).upstreams == [Upstream(b.id, "completed")]
    listener.close()


def test_a_waiting_request_can_be_cancelled_and_a_cancelled_lane_upstream_fails_its_downstream(
    server: Any, ns: str, running: Running
) -> None:
    steps = Steps()
    p = Producer(server.url, ns)
    # No worker yet: the upstreams stay queued.
    a = p.submit(parts([0]))
    b = p.submit(parts([1], [a]), after=[a])
    assert p.cancel(b.id) == "cancelled"
    assert b.wait(timeout=5).state == "cancelled"
    # Cancelling a lane upstream releases its downstreams (lane_cancel's 'rel').
    u = p.submit(parts([5]))
    v = p.submit(parts([6], [u]), after=[u])
    w = p.submit(parts([7]), after=[u], on_upstream_failure="run")
    assert p.cancel(u.id) == "cancelled"
    done = v.wait(timeout=5)
    assert (done.state, done.reason) == ("failed", f"upstream:{u.id}")
    running.start(server.url, steps, ns, slots=2)
    outputs(a)
    assert outputs(w) == [7]
    assert not steps.started(b) and not steps.started(v), "a cancelled or failed downstream ran"
    assert Admin(server.url, ns).status(w.id).upstreams == [Upstream(u.id, "cancelled")]


def test_a_request_after_an_unknown_or_loading_one_itself_or_with_a_delay_is_refused_and_leaves_nothing(
    server: Any, ns: str, running: Running
) -> None:
    p = Producer(server.url, ns)
    client = p.protocol.conn.client
    a = p.submit(parts([0]))
    with pytest.raises(UnknownUpstream) as e:
        p.submit(parts([0]), id="d1", after=[a, "never-submitted"])
    assert e.value.id == "never-submitted"
    assert str(e.value) == (
        'upstream request "never-submitted" is unknown (never submitted, or its retention ran out); '
        "nothing of the request submitted after it is kept"
    )
    assert not client.exists(*p.protocol.keys.request(key_id("d1")).all())
    # An upstream whose submit has not returned (still loading) cannot be waited for either.
    client.hset(p.protocol.keys.request("loading-one").meta, "state", "loading")
    with pytest.raises(UnknownUpstream, match='"loading-one" is still being submitted'):
        p.submit(parts([0]), after=["loading-one"])
    with pytest.raises(InvalidRequest, match='"d2" cannot be submitted after itself'):
        p.submit(parts([0]), id="d2", after=["d2"])
    with pytest.raises(InvalidRequest, match="cannot be delayed"):
        p.submit(parts([0]), after=[a], delay=1)
    with pytest.raises(InvalidRequest, match="at most 1000 others, not 1001"):
        p.submit(parts([0]), after=[f"u{i}" for i in range(1001)])
    with pytest.raises(InvalidRequest, match="cannot be submitted after others"):
        p.open(after=[a])
    with pytest.raises(InvalidRequest, match="on_upstream_failure"):
        p.submit(parts([0]), after=[a], on_upstream_failure="skip")
    with pytest.raises(InvalidRequest, match="lane"):
        p.submit(parts([0]), after=[a], unlisted=True)
    with pytest.raises(InvalidRequest, match="list of request ids"):
        p.submit(parts([0]), after=a.id)  # type: ignore[arg-type]
    # The refused id is free again, and runs as any request; an id given twice counts once.
    running.start(server.url, Steps(), ns, slots=2)
    d1 = p.submit(parts([5], [a]), id="d1", after=[a, a.id])
    assert outputs(d1) == [5]
    assert Admin(server.url, ns).status("d1").upstreams == [Upstream(a.id, "completed")]


def test_a_downstream_of_a_failed_request_fails_at_its_commit(server: Any, ns: str, running: Running) -> None:
    steps = Steps()
    steps.failing.set()
    running.start(server.url, steps, ns, slots=2)
    p = Producer(server.url, ns)
    listener = Listener(server.url, ns, block=0.2)
    f = p.submit(parts([0], fail=True), own_stream=True)
    assert f.wait(timeout=20).state == "failed"
    until("f's finish steps", lambda: Admin(server.url, ns).list(state="failed").requests)
    d = p.submit(parts([1]), after=[f])
    done = d.wait(timeout=5)
    assert (done.state, done.reason) == ("failed", f"upstream:{f.id}")
    r = p.submit(parts([2]), after=[f], on_upstream_failure="run")
    assert outputs(r) == [2]
    # Its one event, written by the steps after its finish that the submit ran.
    states = until("d's event", lambda: [e.state for e in listener.poll(block=False) if e.request_id == d.id])
    assert states == ["failed"]
    listener.close()


def test_a_release_whose_finisher_died_is_run_by_recovery(server: Any, ns: str) -> None:
    # Finishers leave every release to recovery, as if each died right after its finish; the
    # outbox entries fall due 10 s after a finish, and a waiting request's next look an hour after
    # the last, which this test brings forward (as time would).
    steps = Steps()
    steps.gate.clear()
    w = Worker(server.url, steps, slots=4, namespace=ns, **FAST)
    w.settings.inline_releases = False
    t = w.start()
    assert w.ready.wait(10)
    try:
        # (A short census interval: the downstreams' first look comes soon after their submit.)
        p = Producer(server.url, ns, census_interval=0.3)
        k = p.protocol.keys
        client = p.protocol.conn.client
        # One of each kind of upstream: a lane request, and one of its own stream.
        a = p.submit(parts([0]))
        b = p.submit(parts([1]), own_stream=True)
        c = p.submit(parts([10], [a, b]), after=[a, b])
        d = p.submit(parts([20], [c]), after=[c])
        # Recovery has looked at C and D once (they wait for an hour before the next look), before
        # their upstreams end: only a release can open them now.
        hour_ahead = lambda kid: (client.zscore(k.active(0), kid) or 0) > time.time() * 1000 + 600_000  # noqa: E731
        until("C's and D's first look", lambda: hour_ahead(c.id) and hour_ahead(d.id))
        steps.gate.set()
        outputs(a), outputs(b)
        owed = until("A's and B's releases in the outbox", lambda: dict(client.zrange(k.releases(0), 0, -1, withscores=True)).keys() >= {a.id.encode(), b.id.encode()})
        assert owed
        time.sleep(0.5)
        admin = Admin(server.url, ns)
        assert admin.status(c.id).state == "waiting"
        # A's release falls due and recovery runs it; B's is lost (its outbox entry gone).
        client.zadd(k.releases(0), {a.id: 0}, xx=True)
        client.zrem(k.releases(0), b.id)
        until("A's release", lambda: admin.status(c.id).upstreams == [Upstream(a.id, "completed"), Upstream(b.id, None)])
        time.sleep(0.3)
        assert admin.status(c.id).state == "waiting"
        # C's next look (an hour away, brought forward) finds B ended, and settles it itself.
        client.zadd(k.active(0), {c.id: 0}, xx=True)
        assert outputs(c) == [11]
        until("C's release in the outbox", lambda: client.zscore(k.releases(0), c.id) is not None)
        time.sleep(0.3)
        assert Admin(server.url, ns).status(d.id).state == "waiting"
        client.zadd(k.releases(0), {c.id: 0}, xx=True)
        assert outputs(d) == [31]
        # Every release ran: the outbox is empty again.
        until("an empty outbox", lambda: client.zcard(k.releases(0)) == 0)
    finally:
        w.stop()
        t.join(15)


def test_a_dag_across_the_masters_of_a_cluster(cluster: Any, ns: str, running: Running) -> None:
    steps = Steps()
    p = Producer(cluster.url, ns, token_shards=3)
    admin = Admin(cluster.url, ns, token_shards=3)
    a = p.submit(parts([0, 1, 2]), concurrency=3)
    b = p.submit(parts([1]), own_stream=True)
    c = p.submit(parts([10], [a, b]), after=[a, b])
    d = p.submit(parts([20], [c]), after=[c])
    e = p.submit(parts([30], fail=True), id="e-fails")
    f = p.submit(parts([40], [e]), after=[e])
    assert admin.status(c.id).state == "waiting"
    steps.failing.set()
    running.start(cluster.url, steps, ns, slots=4, token_shards=3)
    assert outputs(c) == [14]
    assert outputs(d) == [34]
    done = f.wait(timeout=20)
    assert (done.state, done.reason) == ("failed", "upstream:e-fails")
    assert admin.status(a.id).downstreams == [c.id]
    assert admin.status(d.id).upstreams == [Upstream(c.id, "completed")]


# ----- interop with the Rust CLI (target/debug/sluicegate) -----

needs_cli = pytest.mark.skipif(not CLI.exists(), reason=f"{CLI} is missing: cargo build -p sluicegate-cli")


@pytest.fixture
def cli_worker(server: Any, ns: str, tmp_path: Path) -> Iterator[subprocess.Popen]:
    """A Rust worker running a script that echoes its part with when it ran; a part with
    ``fail`` fails permanently."""
    script = tmp_path / "stamp.py"
    script.write_text(
        "import json, sys, time\n"
        "p = json.loads(sys.stdin.read())\n"
        "if p.get('fail'):\n"
        "    print('chosen to fail', file=sys.stderr); sys.exit(100)\n"
        "print(json.dumps({'n': p['n'], 'at': time.time()}))\n"
    )
    proc = cli_worker_process(server.url, ns, script, slots=4)
    yield proc
    proc.terminate()
    proc.wait(15)


@needs_cli
def test_a_python_dag_is_run_by_a_rust_worker(server: Any, ns: str, cli_worker: Any) -> None:
    p = Producer(server.url, ns)
    admin = Admin(server.url, ns)
    a = p.submit([{"n": i} for i in range(3)], concurrency=3)
    b = p.submit([{"n": 10}], own_stream=True)
    c = p.submit([{"n": 20}, {"n": 21}], after=[a, b], concurrency=2)
    d = p.submit([{"n": 30}], after=[c])
    e = p.submit([{"n": 40, "fail": True}])
    f = p.submit([{"n": 50}], after=[e])
    g = p.submit([{"n": 60}], after=[e], on_upstream_failure="run")
    ran: Dict[str, Completion] = {h.id: h.wait(timeout=30) for h in (a, b, c, d, g)}
    assert [r["n"] for r in ran[d.id].results] == [30]
    assert all(done.state == "completed" for done in ran.values())
    last = lambda h: max(r["at"] for r in ran[h.id].results)  # noqa: E731
    first = lambda h: min(r["at"] for r in ran[h.id].results)  # noqa: E731
    assert first(c) >= max(last(a), last(b)) and first(d) >= last(c)
    done = f.wait(timeout=20)
    assert (done.state, done.reason) == ("failed", f"upstream:{e.id}")
    assert e.wait().state == "failed"
    # The Rust admin and the Python one read the same upstreams and downstreams.
    shown = cli_json(server.url, ns, "status", c.id)[0]
    st = admin.status(c.id)
    assert shown["upstreams"] == [{"id": u.id, "ended": u.ended} for u in st.upstreams]
    assert shown["upstreams"] == [{"id": a.id, "ended": "completed"}, {"id": b.id, "ended": "completed"}]
    assert shown["downstreams"] == st.downstreams == [d.id]


@needs_cli
def test_a_python_request_after_a_cli_submit_reads_its_results(server: Any, ns: str, running: Running,
                                                              tmp_path: Path) -> None:
    def handler(ctx: Any, part: Any) -> Any:
        if isinstance(part, dict) and "after" in part:
            return part["n"] + sum(ctx.upstream(part["after"], 1))
        return int(part) * 2

    src = tmp_path / "in.txt"
    src.write_text("1\n2\n3\n")
    cli_json(server.url, ns, "submit", "--id", "from-cli", str(src))
    p = Producer(server.url, ns)
    d = p.submit([{"n": 100, "after": "from-cli"}], after=["from-cli"])
    assert Admin(server.url, ns).status(d.id).state in ("waiting", "queued", "running", "completed")
    running.start(server.url, handler, ns, slots=2)
    assert outputs(d) == [100 + 4 + 6]
    assert p.wait("from-cli", timeout=20).results == [2, 4, 6]


@needs_cli
def test_a_cli_submit_after_python_requests_is_run_by_a_python_worker(server: Any, ns: str, running: Running,
                                                                     tmp_path: Path) -> None:
    steps = Steps()
    steps.failing.set()
    p = Producer(server.url, ns)
    a = p.submit(parts([1, 2]), concurrency=2)
    f = p.submit(parts([0], fail=True))

    def cli_submit(rid: str, *args: str, part: Dict[str, Any]) -> None:
        src = tmp_path / f"{rid}.txt"
        src.write_text(json.dumps(part) + "\n")
        out = cli(server.url, ns, "submit", "--id", rid, *args, str(src))
        assert out.returncode == 0, out.stderr

    # The Rust producer links the downstreams; the Python worker releases them.
    cli_submit("cli-after-a", "--after", a.id, part=parts([10], [a])[0])
    cli_submit("cli-after-f", "--after", f.id, part=parts([20])[0])
    cli_submit("cli-after-f-run", "--after", f.id, "--on-upstream-failure", "run", part=parts([30])[0])
    assert Admin(server.url, ns).status("cli-after-a").upstreams == [Upstream(a.id, None)]
    running.start(server.url, steps, ns, slots=2)
    assert p.wait("cli-after-a", timeout=20).results == [13]
    done = p.wait("cli-after-f", timeout=20)
    assert (done.state, done.reason) == ("failed", f"upstream:{f.id}")
    assert p.wait("cli-after-f-run", timeout=20).results == [30]
    assert not steps.started(RequestHandle(p, "cli-after-f"))
