"""Request deadlines (``Producer.submit(deadline=...)``, Rust ``RequestBuilder::deadline``): past
its deadline no part of a request starts, the handlers still running are stopped, and the request
ends ``failed`` with reason ``"deadline"``, whichever of acquire, ack or recovery's census meets
it first. The test's redis-server runs on this machine's clock, so Redis times (meta ``dl`` and
``finished``) and ``time.time()`` compare."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, List, Tuple

import pytest
import redis

from sluicegate import Admin, InvalidRequest, NotOpen, Producer, Refused
from sluicegate._keys import Keys, home_shard, key_id
from sluicegate.producer import LOAD_CHUNK
from sluicegate.worker import ACK, ACQUIRE, Worker, _Entry, _Policy, _Slot, _Token, _parse_next

from conftest import CLI, Running, cli_json


def epoch_ms() -> int:
    return int(time.time() * 1000)


class Runs:
    """Logs when each handler run started and ended (ms since the Unix epoch), and which runs
    were cancelled."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: List[Tuple[int, int]] = []
        self.cut: List[Tuple[int, int]] = []

    def add(self, start: int, cancelled: bool = False) -> None:
        with self.lock:
            self.runs.append((start, epoch_ms()))
            if cancelled:
                self.cut.append(self.runs[-1])

    def all(self) -> List[Tuple[int, int]]:
        with self.lock:
            return list(self.runs)

    def cancelled(self) -> List[Tuple[int, int]]:
        with self.lock:
            return list(self.cut)


def punctual(runs: Runs, kind: str) -> Callable[..., Any]:
    """A handler of 300 ms (75, 150 and 225 ms for parts 0, 1 and 2: the tokens that run them then
    run their next parts out of step with each other) that stops once cancelled: a thread's by
    ``ctx.wait_cancelled``, an async one by its task's cancellation."""

    def seconds(part: Any) -> float:
        return {0: 0.075, 1: 0.15, 2: 0.225}.get(part, 0.3) if isinstance(part, int) else 0.3

    if kind == "async":

        async def handler(ctx: Any, part: Any) -> Any:
            start, cancelled = epoch_ms(), False
            try:
                await asyncio.sleep(seconds(part))
                return part
            except asyncio.CancelledError:
                cancelled = True
                raise
            finally:
                runs.add(start, cancelled)

        return handler

    def handler(ctx: Any, part: Any) -> Any:  # type: ignore[no-redef]
        start, cancelled = epoch_ms(), False
        try:
            if ctx.wait_cancelled(seconds(part)):
                cancelled = True
                raise RuntimeError("cancelled")
            return part
        finally:
            runs.add(start, cancelled)

    return handler


def times(p: Producer, rid: str) -> Tuple[int, int]:
    """The request's deadline and when it finished (Redis ms), from its meta hash."""
    meta = p.status(rid)
    return int(meta["dl"]), int(meta["finished"])


@pytest.mark.parametrize("kind", ["thread", "async"])
def test_a_deadline_ends_a_request_on_time(server: Any, ns: str, running: Running, kind: str) -> None:
    runs = Runs()
    running.start(server.url, punctual(runs, kind), ns, slots=4)
    p = Producer(server.url, ns)
    admin = Admin(server.url, ns)
    # Mid-run: 4 tokens run rounds of 300 ms, 75 ms out of step with each other (their first
    # parts take 75, 150, 225 and 300 ms). Each round starts a little after the last one ended
    # (a give back, a take and an acquire); were the tokens in step, a busy machine could put the
    # deadline in that gap, with no run going then.
    h = p.submit(list(range(40)), concurrency=4, deadline=1.65)
    done = h.wait(timeout=30)
    assert (done.state, done.reason) == ("failed", "deadline")
    dl, finished = times(p, h.id)
    assert dl <= finished <= dl + 250, f"finished {finished - dl} ms after its deadline"

    # Every run began before the deadline, and every run still going then was stopped within
    # 100 ms of it. (The worker stops them at the deadline as it knows it: acquire's report,
    # counted from when the call was sent, so never later than Redis's, and earlier by the
    # call's time on the way there, a few ms, more on a busy machine.)
    got = runs.all()
    assert 4 <= len(got) < 40, f"{len(got)} runs"
    for start, end in got:
        assert start <= dl + 10, f"a run started {start - dl} ms after the deadline"
        assert end <= dl + 100, f"a run ended {end - dl} ms after the deadline"
    cut = runs.cancelled()
    assert cut, ("no run was going at the deadline", sorted((a - dl, b - dl) for a, b in got))
    assert all(dl - 250 <= end for _, end in cut), [(a - dl, b - dl) for a, b in cut]

    # The parts done keep their results; the others, stopped or never started, say why.
    ok = [i for i, r in enumerate(done.results) if r is not None]
    assert 4 <= len(ok) < 40 and all(done.results[i] == i for i in ok)
    assert set(done.errors) == set(range(40)) - set(ok)
    for e in done.errors.values():
        assert (e.message, e.attempts, e.permanent) == ("not run: the request's deadline passed first", 0, True)

    st = admin.status(h.id)
    assert (st.state, st.reason, st.deadline_ms, st.finished_ms) == ("failed", "deadline", dl, finished)
    assert st.done == len(ok) and st.failed == 0, st
    # Ended for good: a requeue would end it again at once.
    with pytest.raises(Refused, match="ended at its deadline"):
        admin.requeue(h.id)


def test_a_deadline_ends_a_request_whose_tokens_all_wait_for_a_retry(server: Any, ns: str, running: Running) -> None:
    def broken(ctx: Any, part: Any) -> Any:
        raise RuntimeError(f"part {part} failed on purpose")

    running.start(server.url, broken, ns, slots=2)
    p = Producer(server.url, ns)
    # Its parts wait 30 s for a retry: its tokens park, and only recovery's look at the deadline
    # ends it.
    retrying = p.submit([0, 1], concurrency=2, max_attempts=5, backoff=30, backoff_max=30, deadline=1.0)
    # Delayed past its deadline: it never runs.
    late = p.submit([7], delay=3, deadline=1.0)
    for h in (retrying, late):
        done = h.wait(timeout=20)
        assert (done.state, done.reason) == ("failed", "deadline"), h.id
        dl, finished = times(p, h.id)
        assert dl <= finished <= dl + 1000, f"{h.id}: finished {finished - dl} ms after its deadline"
    done = retrying.wait(timeout=5)
    # Their pending retries' records are their errors.
    assert {i: (e.message, e.attempts) for i, e in done.errors.items()} == {
        0: ("part 0 failed on purpose", 1),
        1: ("part 1 failed on purpose", 1),
    }
    assert late.wait(timeout=5).errors[0].message == "not run: the request's deadline passed first"
    assert "started" not in p.status(late.id)


def test_a_request_done_before_its_deadline_completes(server: Any, ns: str, running: Running) -> None:
    running.start(server.url, lambda ctx, part: part * 2, ns)
    p = Producer(server.url, ns)
    admin = Admin(server.url, ns)
    h = p.submit([1, 2, 3], deadline=60)
    done = h.wait(timeout=20)
    assert (done.state, done.reason, done.results, done.errors) == ("completed", None, [2, 4, 6], {})
    # A small request with a deadline takes no lane: it has a meta hash, with the deadline in it.
    st = admin.status(h.id)
    assert st.reason is None and st.done == 3
    assert st.deadline_ms is not None and abs(st.deadline_ms - (st.created_ms + 60_000)) < 1000
    # Without a deadline: none.
    plain = p.submit([1], own_stream=True)
    plain.wait(timeout=20)
    assert (admin.status(plain.id).deadline_ms, admin.status(plain.id).reason) == (None, None)


def test_a_deadline_may_be_a_datetime_and_a_naive_one_is_utc(server: Any, ns: str, monkeypatch: Any) -> None:
    # Far from UTC, so that a naive time read as local time would be hours off.
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    try:
        p = Producer(server.url, ns)
        now = epoch_ms()
        aware = datetime.now(timezone(timedelta(hours=-7))) + timedelta(seconds=60)
        naive = datetime.now(timezone.utc).replace(tzinfo=None) + timedelta(seconds=90)
        # (The second one is opened, loaded in chunks and committed: submit_open takes it.)
        for at, want, n in ((aware, now + 60_000, 1), (naive, now + 90_000, LOAD_CHUNK + 1)):
            dl = int(p.status(p.submit([1] * n, deadline=at).id)["dl"])
            assert abs(dl - want) < 1000, (at, dl - want)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_a_deadline_past_or_too_far_is_refused_before_anything_is_written(server: Any, ns: str) -> None:
    p = Producer(server.url, ns)
    past = datetime.now(timezone.utc) - timedelta(seconds=1)
    for deadline in (-1, 0, past, past.replace(tzinfo=None)):
        with pytest.raises(InvalidRequest, match="deadline has passed"):
            p.submit([1], deadline=deadline)
        with pytest.raises(InvalidRequest, match="deadline has passed"):
            p.open(deadline=deadline)
    far = 11 * 365 * 24 * 3600
    for deadline in (far, datetime.now(timezone.utc) + timedelta(seconds=far)):
        with pytest.raises(InvalidRequest, match="deadline is too far"):
            p.submit([1], deadline=deadline)
        with pytest.raises(InvalidRequest, match="deadline is too far"):
            p.open(deadline=deadline)
    for deadline in ("10s", True, float("nan")):
        with pytest.raises(InvalidRequest, match="a deadline must be"):
            p.submit([1], deadline=deadline)  # type: ignore[arg-type]
    assert redis.Redis(port=server.port).keys(f"*{ns}*") == []
    # Just under ten years is fine.
    assert p.status(p.submit([1], deadline=far - 366 * 24 * 3600).id)["state"] == "queued"


def test_a_streamed_request_ends_at_its_deadline_open_or_not(server: Any, ns: str, running: Running) -> None:
    running.start(server.url, lambda ctx, part: part + 1, ns)
    p = Producer(server.url, ns)
    req = p.open(concurrency=2, deadline=1.0)
    req.add([1, 2])
    done = req.handle.wait(timeout=20)
    assert (done.state, done.reason, done.results) == ("failed", "deadline", [2, 3])
    dl, finished = times(p, req.id)
    assert dl <= finished <= dl + 1000, f"finished {finished - dl} ms after its deadline"
    with pytest.raises(NotOpen):
        req.add([3])
    with pytest.raises(NotOpen):
        req.finalize()


def test_an_acquire_past_the_deadline_ends_the_request_on_its_own_shards(server: Any, ns: str, running: Running) -> None:
    """The deadline passes while the request's priority is paused and no look at it is due:
    the first acquire ends it, and the steps after the finish go to the shards its reply names
    (the slot has no policy of the request to read them from)."""
    shards = 4
    rid = next(f"a{n}" for n in range(100) if home_shard(key_id(f"a{n}"), shards) != 0)
    admin = Admin(server.url, ns, token_shards=shards)
    admin.pause(20)
    ran: List[int] = []
    # Recovery passes 60 s apart: the first, at the start, comes before the look at the deadline.
    running.start(server.url, lambda ctx, part: ran.append(part), ns, slots=2, token_shards=shards,
                  recovery_interval=60, census_interval=60)
    p = Producer(server.url, ns, token_shards=shards, census_interval=60)
    h = p.submit([1, 2], id=rid, priority=20, deadline=0.5)
    time.sleep(0.8)
    assert p.status(rid)["state"] == "queued"
    admin.resume(20)
    done = h.wait(timeout=10)
    assert (done.state, done.reason, ran) == ("failed", "deadline", [])
    keys = Keys(ns)
    client = redis.Redis(port=server.port)
    end = time.monotonic() + 5
    while time.monotonic() < end and [r.id for r in admin.list(state="failed").requests] != [rid]:
        time.sleep(0.02)
    assert [r.id for r in admin.list(state="failed").requests] == [rid]
    assert client.zscore(keys.active(home_shard(key_id(rid), shards)), key_id(rid)) is None


def test_a_seven_field_policy_is_not_read_as_a_lane_entry() -> None:
    sent = time.monotonic()
    nxt = _parse_next([b"run", [3, 0, 1000, 60000, 4, -1, 5000], [b"0-1", 0, b"\x01", 1]], ACQUIRE, sent)
    assert nxt.policy is not None and (nxt.policy.max_attempts, nxt.policy.shards) == (3, 4)
    assert nxt.policy.deadline == pytest.approx(sent + 5)
    assert [(e.index, e.lane) for e in nxt.entries] == [(0, None)]
    # An ack's entries come without a policy; the slot keeps its acquire's.
    nxt = _parse_next([b"run", [b"0-2", 1, b"\x01", 1]], ACK)
    assert nxt.policy is None and [e.index for e in nxt.entries] == [1]
    # acquire's finish at a deadline names the request's shards after the elements to sweep.
    nxt = _parse_next([b"finished", b"failed", 17, b"k|0|3", [b"shards", b"4"]], ACQUIRE, sent)
    assert nxt.finished is not None
    assert (nxt.finished.sweep, nxt.finished.shards) == ([b"k|0|3"], 4)


def test_a_batch_handed_out_past_the_deadline_starts_none_of_its_entries(server: Any, ns: str) -> None:
    """An ack that reached Redis just before its deadline may hand out a batch that this worker,
    whose deadline is a round trip earlier, gets after its own: none of it starts."""
    called: List[int] = []
    w = Worker(server.url, lambda ctx, part: called.append(part), slots=1, namespace=ns)
    slot = _Slot(w, 0)
    try:
        slot._holder = f"{w.worker_id}/0"
        token = _Token("r", "0", "1", "r", 50, 0, "list", 0)
        entries = [_Entry(f"0-{i + 1}".encode(), i, b"\x01", 1) for i in range(3)]
        policy = _Policy(deadline=time.monotonic() - 0.001)
        assert slot.run_batch(token, entries, policy) == [("skip",)] * 3
        assert called == []
        # Before it, they run.
        policy.deadline = time.monotonic() + 60
        assert [o[0] for o in slot.run_batch(token, entries, policy)] == ["ok"] * 3
        assert called == [1, 1, 1]
    finally:
        if slot.executor is not None:
            slot.executor.shutdown()
        w.protocol.conn.close()


@pytest.mark.skipif(not CLI.exists(), reason=f"{CLI} is missing: cargo build -p sluicegate-cli")
def test_a_cli_submit_with_a_deadline_is_served_by_a_python_worker(server: Any, ns: str, running: Running,
                                                                   tmp_path: Path) -> None:
    runs = Runs()
    running.start(server.url, punctual(runs, "thread"), ns, slots=2)
    src = tmp_path / "in.txt"
    src.write_text("".join(f"{i}\n" for i in range(20)))

    def cli(*args: str) -> Any:
        return cli_json(server.url, ns, *args, quiet=True)

    rid = "from-the-cli"
    cli("submit", "--id", rid, "--concurrency", "2", "--deadline", "+1s", str(src))
    p = Producer(server.url, ns)
    done = p.wait(rid, timeout=20)
    assert (done.state, done.reason) == ("failed", "deadline")
    dl, finished = times(p, rid)
    assert dl <= finished <= dl + 250, f"finished {finished - dl} ms after its deadline"
    assert all(start <= dl + 10 and end <= dl + 100 for start, end in runs.all()), (dl, runs.all())
    st = Admin(server.url, ns).status(rid)
    shown = cli("status", rid)[0]
    assert {k: shown[k] for k in ("state", "done", "deadline_ms", "finished_ms", "reason")} == {
        "state": st.state, "done": st.done, "deadline_ms": st.deadline_ms, "finished_ms": st.finished_ms,
        "reason": "deadline",
    }
