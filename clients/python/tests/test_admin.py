"""The Python Admin: listing, dead letters, requeue, pause and resume, as the Rust Admin does them."""

from __future__ import annotations

import threading
import time
from typing import Any, List, Optional

import pytest

import sluicegate
from sluicegate import Admin, NoDeadLetters, Paused, PermanentError, Producer, UnknownRequest, WaitTimeout

from conftest import Running


class Flaky:
    """A handler whose parts marked ``bad`` fail (permanently, or ``transient``ly) until fixed."""

    def __init__(self) -> None:
        self.fixed = threading.Event()
        self.runs: List[Any] = []

    def __call__(self, ctx: Any, part: Any) -> Any:
        self.runs.append((ctx.request_id, ctx.index, ctx.attempt))
        if part.get("bad") and not self.fixed.is_set():
            if part.get("transient"):
                raise RuntimeError(f"transient {part['i']}")
            raise PermanentError(f"bad {part['i']}")
        return part["i"] * 10


def mixed(n: int, bad: Any = ()) -> List[Any]:
    return [{"i": i, "bad": i in bad} for i in range(n)]


def listed(admin: Admin, expected: List[str], **query: Any) -> None:
    """Asserts that ``list(**query)`` comes to show ``expected``: a request's terminal state is in
    its meta at once, and in the listing index once its finisher's next step (finish_index) ran."""
    deadline = time.time() + 10
    while True:
        got = [r.id for r in admin.list(**query).requests]
        if got == expected or time.time() > deadline:
            break
        time.sleep(0.02)
    assert got == expected


def all_pages(admin: Admin, **query: Any) -> List[List[str]]:
    """The ids of every page of a listing, page by page."""
    pages: List[List[str]] = []
    cursor: Optional[str] = None
    while True:
        page = admin.list(cursor=cursor, **query)
        pages.append([r.id for r in page.requests])
        cursor = page.cursor
        if cursor is None:
            return pages
        assert len(pages) < 50, "the cursor never ended"


def test_list_filters_by_state_tag_priority_and_age_and_pages_newest_first(server: Any, ns: str, running: Running) -> None:
    running.start(server.url, Flaky(), ns, slots=2)
    p = Producer(server.url, ns)
    admin = Admin(server.url, ns)
    done: List[str] = []
    for n in range(6):
        # Even ones complete, odd ones fail; lane and own-stream requests alternate in pairs.
        h = p.submit(mixed(3, bad=(1,) if n % 2 else ()), id=f"r{n}", tags=["odd" if n % 2 else "even", "all"],
                     own_stream=n // 2 % 2 == 1, concurrency=2)
        assert h.wait(timeout=20).state == ("failed" if n % 2 else "completed")
        done.append(h.id)
        time.sleep(0.005)  # a submit millisecond of its own
    admin.pause()  # what is submitted now stays queued
    for n in range(2):
        time.sleep(0.005)
        p.submit(mixed(2), id=f"q{n}", priority=70 if n else 50, own_stream=n == 1)
    newest_first = ["q1", "q0", "r5", "r4", "r3", "r2", "r1", "r0"]
    listed(admin, ["r5", "r3", "r1"], state="failed")
    listed(admin, ["r4", "r2", "r0"], state="completed")

    page = admin.list()
    assert [r.id for r in page.requests] == newest_first
    assert page.cursor is None and page.looked_at == 8
    rows = {r.id: r for r in page.requests}
    assert (rows["r1"].state, rows["r1"].total, rows["r1"].done, rows["r1"].failed) == ("failed", 3, 3, 1)
    assert (rows["r2"].state, rows["r2"].total, rows["r2"].done, rows["r2"].failed) == ("completed", 3, 3, 0)
    assert rows["r3"].tags == ["odd", "all"] and rows["r3"].concurrency == 2 and rows["r3"].priority == 50
    assert (rows["q1"].state, rows["q1"].priority, rows["q1"].done, rows["q1"].total) == ("queued", 70, 0, 2)
    assert rows["q0"].state == "queued" and not rows["q0"].open and not rows["q0"].tracked
    assert all(isinstance(r.submitted_ms, int) and r.submitted_ms > 0 for r in page.requests)
    assert [r.submitted_ms for r in page.requests] == sorted((r.submitted_ms for r in page.requests), reverse=True)

    assert [r.id for r in admin.list(state="queued").requests] == ["q1", "q0"]
    assert admin.list(state="running").requests == [] and admin.list(state="cancelled").requests == []
    assert [r.id for r in admin.list(tag="even").requests] == ["r4", "r2", "r0"]
    assert [r.id for r in admin.list(tag="all", state="failed").requests] == ["r5", "r3", "r1"]
    assert [r.id for r in admin.list(priority=70).requests] == ["q1"]
    assert admin.list(older_than=3600).requests == []
    assert [r.id for r in admin.list(older_than=0).requests] == newest_first

    pages = all_pages(admin, limit=3)
    assert pages == [newest_first[0:3], newest_first[3:6], newest_first[6:8]]
    assert all_pages(admin, limit=2, tag="odd") == [["r5", "r3"], ["r1"]]
    # A page that ends on a request with a walk left resumes right after it.
    first = admin.list(limit=1, state="failed")
    assert [r.id for r in first.requests] == ["r5"] and first.cursor is not None and first.cursor.startswith("l1:")
    assert [r.id for r in admin.list(limit=5, state="failed", cursor=first.cursor).requests] == ["r3", "r1"]


def test_list_refuses_what_the_rust_admin_refuses(server: Any, ns: str) -> None:
    admin = Admin(server.url, ns)
    assert admin.list().requests == [] and admin.list().cursor is None
    with pytest.raises(sluicegate.InvalidRequest, match=r"^a page holds 1 to 1000 requests$"):
        admin.list(limit=0)
    with pytest.raises(sluicegate.InvalidRequest, match=r"^a page holds 1 to 1000 requests$"):
        admin.list(limit=1001)
    with pytest.raises(sluicegate.InvalidRequest) as e:
        admin.list(state="done")
    assert str(e.value) == 'unknown state "done": one of queued, running, scheduled, open, completed, failed, cancelled'
    with pytest.raises(sluicegate.InvalidRequest, match=r'^invalid tag "a b": a tag is 1 to 64 characters'):
        admin.list(tag="a b")
    with pytest.raises(sluicegate.InvalidCursor) as c:
        admin.list(cursor="nonsense")
    assert str(c.value) == (
        "\"nonsense\" is not a list cursor of this namespace's 1 shard(s): pass a cursor a page gave"
    )
    with pytest.raises(sluicegate.InvalidCursor):
        Admin(server.url, ns, token_shards=2).list(cursor="l1:17.0")
    with pytest.raises(sluicegate.InvalidRequest, match="priority 100 is out of range"):
        admin.list(priority=100)


@pytest.mark.parametrize("own_stream", [False, True])
def test_dead_shows_each_dead_letter_with_its_error_and_payload(server: Any, ns: str, running: Running, own_stream: bool) -> None:
    running.start(server.url, Flaky(), ns, slots=2)
    p = Producer(server.url, ns)
    admin = Admin(server.url, ns)
    payloads = mixed(5, bad=(1, 3))
    payloads[3]["transient"] = True
    h = p.submit(payloads, max_attempts=2, backoff=0.01, backoff_max=0.02, own_stream=own_stream)
    assert h.wait(timeout=20).state == "failed"
    dead = admin.dead(h.id)
    assert [d.index for d in dead] == [1, 3]
    assert (dead[0].error.message, dead[0].error.attempts, dead[0].error.permanent) == ("bad 1", 1, True)
    assert (dead[1].error.message, dead[1].error.attempts, dead[1].error.permanent) == ("transient 3", 2, False)
    assert dead[0].payload == {"i": 1, "bad": True}
    assert dead[1].payload == {"i": 3, "bad": True, "transient": True}
    assert dead[1].raw == sluicegate.codec.encode(payloads[3])
    ok = p.submit(mixed(2), own_stream=own_stream)
    ok.wait(timeout=20)
    assert admin.dead(ok.id) == []
    with pytest.raises(sluicegate.InvalidRequest, match=r"^a request id cannot be empty$"):
        admin.dead("")
    with pytest.raises(UnknownRequest) as e:
        admin.dead("no-such-request")
    assert str(e.value) == 'no request with id "no-such-request" (never submitted, or its results expired)'


@pytest.mark.parametrize("own_stream", [False, True])
def test_a_requeued_failed_request_completes_once_its_handler_is_fixed(server: Any, ns: str, running: Running, own_stream: bool) -> None:
    handler = Flaky()
    # A long lease (a grace of 16 s): recovery, which would heal a requeue whose tokens were not
    # pushed, comes by too late to hide one here.
    running.start(server.url, handler, ns, slots=3, lease=8.0)
    p = Producer(server.url, ns, lease=8.0)
    admin = Admin(server.url, ns, lease=8.0)
    h = p.submit(mixed(6, bad=(2, 4)), concurrency=2, own_stream=own_stream, id=f"req-{own_stream}")
    first = h.wait(timeout=20)
    assert first.state == "failed" and set(first.errors) == {2, 4}
    listed(admin, [h.id], state="failed")

    handler.fixed.set()
    assert admin.requeue(h.id) == 2
    done = h.wait(timeout=6)
    assert done.state == "completed", done.errors
    assert done.results == [i * 10 for i in range(6)]
    assert admin.dead(h.id) == []
    listed(admin, [h.id], state="completed")
    assert admin.list(state="failed").requests == []
    # Each dead part ran again from attempt 1; the others did not run again.
    reruns = [(i, a) for rid, i, a in handler.runs if rid == h.id]
    assert sorted(reruns) == sorted([(i, 1) for i in range(6)] + [(2, 1), (4, 1)])

    with pytest.raises(NoDeadLetters) as e:
        admin.requeue(h.id)
    assert str(e.value) == (
        f'request "{h.id}" has no dead letters that can be requeued (only a failed, running or queued request has)'
    )
    with pytest.raises(UnknownRequest, match=r'^no request with id "gone"'):
        admin.requeue("gone")


def test_requeue_of_a_running_request_gives_its_dead_letters_back(server: Any, ns: str, running: Running) -> None:
    """A request still running when its dead letters are requeued: they run again in it."""
    handler = Flaky()
    release = threading.Event()

    def gated(ctx: Any, part: Any) -> Any:
        if part["i"] == 3:
            assert release.wait(20)
        return handler(ctx, part)

    running.start(server.url, gated, ns, slots=2)
    p = Producer(server.url, ns)
    admin = Admin(server.url, ns)
    h = p.submit(mixed(4, bad=(0,)), own_stream=True)
    deadline = time.time() + 10
    while not admin.dead(h.id) and time.time() < deadline:
        time.sleep(0.05)
    assert [d.index for d in admin.dead(h.id)] == [0]
    assert p.status(h.id)["state"] == "running"
    handler.fixed.set()
    assert admin.requeue(h.id) == 1
    release.set()
    done = h.wait(timeout=20)
    assert done.state == "completed" and done.results == [0, 10, 20, 30]


def test_pausing_one_priority_holds_its_requests_while_another_runs(server: Any, ns: str, running: Running) -> None:
    admin = Admin(server.url, ns)
    admin.pause(10)
    assert admin.paused() == Paused(False, [10])
    running.start(server.url, Flaky(), ns, slots=2)
    p = Producer(server.url, ns)
    low = p.submit(mixed(3), priority=10, id="low")
    time.sleep(0.005)  # a submit millisecond of its own: newest first is then low-own, low
    low_own = p.submit(mixed(3), priority=10, own_stream=True, id="low-own")
    high = p.submit(mixed(3), priority=90, own_stream=True)
    mid = p.submit(mixed(2), priority=50)
    assert high.wait(timeout=20).state == "completed"
    assert mid.wait(timeout=20).state == "completed"
    for h in (low, low_own):
        with pytest.raises(WaitTimeout):
            h.wait(timeout=1.0)
        assert p.status(h.id)["state"] == "queued"
    assert [r.id for r in admin.list(state="queued").requests] == [low_own.id, low.id]
    admin.resume(10)
    assert admin.paused() == Paused()
    assert low.wait(timeout=20).results == [0, 10, 20]
    assert low_own.wait(timeout=20).results == [0, 10, 20]


def test_pause_and_resume_write_every_shard_a_worker_may_use(server: Any, ns: str) -> None:
    admin = Admin(server.url, ns)
    client = admin.protocol.conn.client
    keys = admin.protocol.keys
    admin.pause()
    admin.pause(10)
    admin.pause(90)
    admin.pause(10)
    assert admin.paused() == Paused(True, [90, 10])
    assert client.hgetall(keys.paused(1023)) == {b"all": b"1", b"10": b"1", b"90": b"1"}
    admin.resume(10)
    assert admin.paused() == Paused(True, [90])
    assert client.hgetall(keys.paused(517)) == {b"all": b"1", b"90": b"1"}
    admin.resume()
    assert admin.paused() == Paused()
    assert not any(client.exists(keys.paused(s)) for s in (0, 1, 1023))
    with pytest.raises(sluicegate.InvalidRequest, match="priority 100 is out of range"):
        admin.pause(100)


def test_admin_on_a_three_master_cluster_across_token_shards(cluster: Any, ns: str, running: Running) -> None:
    handler = Flaky()
    running.start(cluster.url, handler, ns, slots=4, token_shards=3)
    p = Producer(cluster.url, ns, token_shards=3)
    admin = Admin(cluster.url, ns, token_shards=3)
    ids = []
    for n in range(7):
        bad = (1,) if n in (2, 5) else ()
        h = p.submit(mixed(3, bad=bad), id=f"c{n}", tags=["t5"] if n == 5 else ["rest"], own_stream=n % 2 == 0)
        assert h.wait(timeout=20).state == ("failed" if bad else "completed")
        ids.append(h.id)
        time.sleep(0.005)
    homes = {sluicegate._keys.home_shard(sluicegate._keys.key_id(i), 3) for i in ids}
    assert len(homes) > 1, "the requests should be homed on more than one shard"
    newest_first = ids[::-1]
    listed(admin, ["c5", "c2"], state="failed")
    page = admin.list()
    assert [r.id for r in page.requests] == newest_first and page.cursor is None
    pages = all_pages(admin, limit=2)
    assert pages == [newest_first[i : i + 2] for i in range(0, 7, 2)]
    cursor = admin.list(limit=2).cursor
    assert cursor is not None and len(cursor[3:].split(",")) == 3
    assert [r.id for r in admin.list(tag="t5").requests] == ["c5"]
    # (A walk that filled its page exactly cannot tell that its sets ended: as with the Rust
    # Admin, its cursor may lead to one empty page.)
    assert [pg for pg in all_pages(admin, limit=1, state="failed") if pg] == [["c5"], ["c2"]]

    assert [(d.index, d.payload["i"]) for d in admin.dead("c2")] == [(1, 1)]  # own stream
    assert [(d.index, d.error.message) for d in admin.dead("c5")] == [(1, "bad 1")]  # lane
    handler.fixed.set()
    assert admin.requeue("c2") == 1
    assert admin.requeue("c5") == 1
    assert p.wait("c2", timeout=20).results == [0, 10, 20]
    assert p.wait("c5", timeout=20).results == [0, 10, 20]
    listed(admin, [], state="failed")

    admin.pause(50)
    held = p.submit(mixed(2), id="held", own_stream=True)
    with pytest.raises(WaitTimeout):
        held.wait(timeout=1.0)
    admin.resume()
    assert held.wait(timeout=20).results == [0, 10]
