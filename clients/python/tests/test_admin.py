"""The Python Admin: status, listing, tracking, purge, dead letters, requeue, reprioritize, pause and
resume, as the Rust Admin does them."""

from __future__ import annotations

import threading
import time
from typing import Any, List, Optional

import pytest
import redis

import sluicegate
from sluicegate import (
    Admin,
    IndexedError,
    NoDeadLetters,
    PartError,
    Paused,
    PermanentError,
    Producer,
    Refused,
    Reprioritized,
    UnknownRequest,
    WaitTimeout,
)

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


def listed(admin: Admin, expected: List[str], any_order: bool = False, **query: Any) -> None:
    """Asserts that ``list(**query)`` comes to show ``expected``: a request's terminal state is in
    its meta at once, and in the listing index once its finisher's next step (finish_index) ran.
    ``any_order`` compares the ids sorted: requests submitted in the same millisecond list in the
    order of their key ids, not of their ids nor of their submits."""
    deadline = time.time() + 10
    if any_order:
        expected = sorted(expected)
    while True:
        got = [r.id for r in admin.list(**query).requests]
        if any_order:
            got.sort()
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
    assert str(e.value) == 'unknown state "done": one of queued, running, scheduled, waiting, open, completed, failed, cancelled'
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
    # Neither runs while paused: a second's wait for the first, by when the other waited as long.
    for h, wait in ((low, 1.0), (low_own, 0.05)):
        with pytest.raises(WaitTimeout):
            h.wait(timeout=wait)
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


def keys_of(admin: Admin, rid: str) -> List[str]:
    """Every key of the namespace naming request ``rid`` (its own keys, a lane record, finish
    marks), and every listing index entry of it."""
    client = admin.protocol.conn.client
    ns = admin.protocol.keys.ns
    kid = sluicegate._keys.key_id(rid)
    found = [
        k.decode()
        for k in client.scan_iter(match=f"{ns}:*", count=1000)
        if "{" + kid + "}" in k.decode() or k.decode().endswith(":" + kid)
    ]
    for shard in range(admin.protocol.settings.token_shards):
        k = admin.protocol.keys
        if client.hexists(k.index_rows(shard), kid):
            found.append(f"{k.index_rows(shard)}[{kid}]")
        for name in ("live", "completed", "failed", "cancelled", "tracked", "exp", "t:keep"):
            if client.zscore(k.index_set(shard, name), kid) is not None:
                found.append(f"{k.index_set(shard, name)}[{kid}]")
    return found


@pytest.mark.parametrize("own_stream", [False, True])
def test_purge_deletes_a_finished_request_and_refuses_a_live_one(server: Any, ns: str, running: Running, own_stream: bool) -> None:
    running.start(server.url, Flaky(), ns, slots=2)
    p = Producer(server.url, ns)
    admin = Admin(server.url, ns)
    h = p.submit(mixed(3, bad=(1,)), id="done", tags=["keep"], own_stream=own_stream)
    assert h.wait(timeout=20).state == "failed"
    other = p.submit(mixed(2), id="other", own_stream=own_stream)
    assert other.wait(timeout=20).state == "completed"
    listed(admin, ["done"], state="failed")
    admin.track("done", True)
    assert keys_of(admin, "done"), "a finished request has keys until its retention ends"

    assert admin.purge("done") is True
    assert keys_of(admin, "done") == []
    assert [r.id for r in admin.list().requests] == ["other"]
    assert admin.list(tracked=True).requests == [] and admin.list(tag="keep").requests == []
    with pytest.raises(UnknownRequest):
        admin.status("done")
    assert admin.purge("done") is False
    assert admin.purge("never-submitted") is False
    assert admin.status("other").state == "completed"

    admin.pause()
    live = p.submit(mixed(2), id="live", own_stream=own_stream)
    with pytest.raises(Refused) as e:
        admin.purge(live.id)
    assert str(e.value) == 'request "live" has not finished (or its finish is still being recorded): cancel it first'
    assert admin.status("live").state == "queued"
    assert [r.id for r in admin.list(state="queued").requests] == ["live"]
    live.cancel()
    listed(admin, ["live"], state="cancelled")
    assert admin.purge("live") is True and keys_of(admin, "live") == []


def test_track_marks_a_request_for_list_tracked(server: Any, ns: str, running: Running) -> None:
    running.start(server.url, Flaky(), ns, slots=2)
    p = Producer(server.url, ns)
    admin = Admin(server.url, ns)
    for n, own in enumerate((False, True, False)):
        p.submit(mixed(2), id=f"t{n}", own_stream=own).wait(timeout=20)
        time.sleep(0.005)
    admin.pause()
    p.submit(mixed(2), id="queued", own_stream=True)
    assert admin.list(tracked=True).requests == []
    admin.track("t1", True)
    admin.track("t0", True)
    admin.track("queued", True)
    admin.track("t0", True)  # a repeat changes nothing
    assert [r.id for r in admin.list(tracked=True).requests] == ["queued", "t1", "t0"]
    assert all(r.tracked for r in admin.list(tracked=True).requests)
    assert admin.status("t1").tracked and not admin.status("t2").tracked
    admin.track("t1", False)
    admin.track("queued", False)
    assert [r.id for r in admin.list(tracked=True).requests] == ["t0"]
    assert not admin.status("t1").tracked
    with pytest.raises(UnknownRequest) as e:
        admin.track("nope", True)
    assert str(e.value) == 'no request with id "nope" (never submitted, or its results expired)'
    with pytest.raises(sluicegate.InvalidRequest, match=r"^a request id cannot be empty$"):
        admin.track("", True)


def test_reprioritize_moves_a_queued_request_ahead_of_another(server: Any, ns: str, running: Running) -> None:
    p = Producer(server.url, ns)
    admin = Admin(server.url, ns)
    # No worker yet: both wait, "low" in the list of priority 10, "high" in that of 50.
    low = p.submit(mixed(3), id="low", priority=10, concurrency=2, own_stream=True)
    high = p.submit(mixed(3), id="high", priority=50, own_stream=True)
    assert admin.reprioritize("low", 90) == Reprioritized(10, 90, 2, 0)
    assert admin.status("low").priority == 90
    assert [r.id for r in admin.list(priority=90).requests] == ["low"]
    assert admin.list(priority=10).requests == []
    client, keys = admin.protocol.conn.client, admin.protocol.keys
    assert client.llen(keys.token_list(0, 10)) == 0 and client.llen(keys.token_list(0, 90)) == 2
    # A repeat moves nothing more (as with the Rust admin, it counts the tokens it found in the
    # new list already as `left`: the old priority is the one before the last change).
    assert admin.reprioritize("low", 90) == Reprioritized(10, 90, 0, 2)
    assert client.llen(keys.token_list(0, 10)) == 0 and client.llen(keys.token_list(0, 90)) == 2

    order: List[str] = []

    def note(ctx: Any, part: Any) -> Any:
        order.append(ctx.request_id)
        return part["i"]

    running.start(server.url, note, ns, slots=1)
    assert low.wait(timeout=20).state == "completed"
    assert high.wait(timeout=20).state == "completed"
    assert order == ["low"] * 3 + ["high"] * 3


def test_reprioritize_refuses_finished_lane_and_unknown_requests(server: Any, ns: str, running: Running) -> None:
    running.start(server.url, Flaky(), ns, slots=2)
    p = Producer(server.url, ns)
    admin = Admin(server.url, ns)
    p.submit(mixed(2), id="done", own_stream=True).wait(timeout=20)
    p.submit(mixed(2), id="lane-done").wait(timeout=20)
    admin.pause()
    p.submit(mixed(2), id="lane", priority=30)
    for rid, state in (("done", "completed"), ("lane-done", "completed")):
        with pytest.raises(Refused) as e:
            admin.reprioritize(rid, 70)
        assert str(e.value) == f'request "{rid}" has already finished ({state}): its priority can no longer change'
    with pytest.raises(Refused) as lane:
        admin.reprioritize("lane", 70)
    assert str(lane.value) == (
        'request "lane" is a small request that shares the lane of priority 30 with others: its sub-requests '
        "already wait in that lane, so its priority cannot be changed and it runs at priority 30; submit small "
        "requests with their own stream (RequestBuilder::own_stream) to be able to change their priority, or "
        "cancel this one and submit it again"
    )
    assert admin.status("lane").priority == 30
    with pytest.raises(UnknownRequest, match=r'^no request with id "nope"'):
        admin.reprioritize("nope", 70)
    with pytest.raises(sluicegate.InvalidRequest, match="priority 100 is out of range"):
        admin.reprioritize("lane", 100)


@pytest.mark.parametrize("own_stream", [False, True])
def test_status_counts_a_running_and_a_finished_request(server: Any, ns: str, running: Running, own_stream: bool) -> None:
    release = threading.Event()

    def handler(ctx: Any, part: Any) -> Any:
        if ctx.request_id == "run":
            if part["i"] == 0:
                raise RuntimeError("later")  # waits a long backoff for its retry
            assert release.wait(20)
            return part["i"]
        if part["i"] == 1 and ctx.attempt == 1:
            raise RuntimeError("once")
        if part["i"] == 2:
            raise PermanentError("bad 2")
        return part["i"]

    running.start(server.url, handler, ns, slots=1)
    p = Producer(server.url, ns)
    admin = Admin(server.url, ns)
    h = p.submit(mixed(3), id="run", concurrency=1, priority=40, max_attempts=3, backoff=60, backoff_max=60,
                 tags=["st"], own_stream=own_stream)
    deadline = time.time() + 10
    while admin.status("run").retrying < 1 and time.time() < deadline:
        time.sleep(0.05)
    st = admin.status("run")
    assert (st.id, st.state, st.priority, st.concurrency, st.total, st.done, st.failed) == ("run", "running", 40, 1, 3, 0, 0)
    # A lane request's parts in its lane are not told apart from running ones: 0.
    assert (st.running, st.retrying) == ((1 if own_stream else 0), 1)
    assert st.errors == [IndexedError(0, PartError("later", 1, False))]
    assert st.max_attempts_seen == 1 and st.succeeded_after_retry == 0
    assert st.created_ms > 0 and st.started_ms is not None and st.started_ms >= st.created_ms and st.finished_ms is None
    assert not st.open and st.window is None and not st.discard_results and st.results_taken == 0
    assert (st.tags, st.tracked, st.paused) == (["st"], False, False)
    admin.pause(40)
    assert admin.status("run").paused
    admin.resume()
    h.cancel()
    release.set()

    f = p.submit(mixed(3), id="fin", max_attempts=3, backoff=0.01, backoff_max=0.02, own_stream=own_stream)
    assert f.wait(timeout=20).state == "failed"
    st = admin.status("fin")
    assert (st.state, st.total, st.done, st.failed, st.running, st.retrying) == ("failed", 3, 3, 1, 0, 0)
    assert (st.succeeded_after_retry, st.max_attempts_seen) == (1, 2)
    assert st.errors == [IndexedError(2, PartError("bad 2", 1, True))]
    assert st.finished_ms is not None and st.finished_ms >= st.created_ms
    assert st.tags == [] and not st.paused
    admin.pause()
    assert not admin.status("fin").paused  # finished: nothing to pause
    assert admin.status("run").state == "cancelled"
    with pytest.raises(UnknownRequest, match=r'^no request with id "nope"'):
        admin.status("nope")


def test_status_track_reprioritize_and_purge_on_a_three_master_cluster(cluster: Any, ns: str, running: Running) -> None:
    p = Producer(cluster.url, ns, token_shards=3)
    admin = Admin(cluster.url, ns, token_shards=3)
    # Three tokens, one on each token shard (each on its own master's slots, or not).
    q = p.submit(mixed(6), id="q", priority=20, concurrency=3, own_stream=True)
    small = p.submit(mixed(2), id="small", priority=20)
    assert admin.reprioritize("q", 80) == Reprioritized(20, 80, 3, 0)
    assert [r.id for r in admin.list(priority=80).requests] == ["q"]
    admin.track("q", True)
    admin.track("small", True)
    assert [r.id for r in admin.list(tracked=True).requests] == ["small", "q"]
    st = admin.status("q")
    assert (st.state, st.priority, st.total, st.done, st.tracked) == ("queued", 80, 6, 0, True)
    assert admin.status("small").priority == 20
    with pytest.raises(Refused):
        admin.reprioritize("small", 80)
    with pytest.raises(Refused, match="has not finished"):
        admin.purge("q")

    w = running.start(cluster.url, Flaky(), ns, slots=4, token_shards=3)
    assert [(i.id, i.slots, i.shards) for i in admin.workers()] == [(w.worker_id, 4, 3)]
    assert q.wait(timeout=20).results == [i * 10 for i in range(6)]
    assert small.wait(timeout=20).state == "completed"
    st = admin.status("q")
    assert (st.state, st.done, st.failed, st.running, st.retrying) == ("completed", 6, 0, 0, 0)
    listed(admin, ["small", "q"], state="completed")
    assert admin.purge("q") is True and admin.purge("small") is True
    assert keys_of(admin, "q") == [] and keys_of(admin, "small") == []
    assert admin.list().requests == [] and admin.list(tracked=True).requests == []


def test_an_admin_with_another_shard_count_lists_and_finds_every_lane_request(server: Any, ns: str) -> None:
    p = Producer(server.url, ns, token_shards=3)
    handles = [p.submit([{"i": n}]) for n in range(40)]
    admin = Admin(server.url, ns, token_shards=2)
    client = p.protocol.conn.client
    # Queued lane requests are counted in `lq` until their first hand-out (docs/protocol.md §5).
    indexed = sum(
        client.zcard(f"{ns}:{{{ns}.q{shard}}}:ix:live") + int(client.get(f"{ns}:{{{ns}.q{shard}}}:ix:lq") or 0)
        for shard in range(2)
    )
    assert 0 < indexed < 40
    assert len(admin.list(limit=100).requests) == indexed
    for h in handles:
        assert admin.status(h.id).state == "queued", h.id
    assert admin.dead(handles[0].id) == []
    with pytest.raises(sluicegate.UnknownRequest):
        admin.status("never-submitted")
    # A producer of one shard finds them too, and cancels one.
    other = Producer(server.url, ns)
    for h in handles:
        assert other.status(h.id)["state"] == "queued", h.id
    assert other.cancel(handles[1].id) == "cancelled"
    assert other.try_completion(handles[1].id) is not None


def test_schedules_are_paused_resumed_and_removed_by_name(server: Any, ns: str) -> None:
    from sluicegate import InvalidSchedule, UnknownSchedule

    admin = Admin(server.url, ns)
    k = admin.protocol.keys
    # A schedule as the Rust Admin stores it (sched_add; docs/protocol.md §3, "Schedules").
    spec = '{"cron":"*/5 * * * *","missed":"skip","request":{"parts":["oWE="],"priority":60}}'
    reply = admin.protocol.conn.fcall(
        "sched_add", [k.schedules(), k.schedules_due(), k.schedule_state("every-5m"), k.schedules_gen()],
        ["every-5m", spec, "0"],
    )
    assert reply[0] == b"added"
    [s] = admin.schedules()
    assert (s.name, s.cron, s.time_zone, s.missed, s.parts, s.priority, s.tags) == (
        "every-5m", "*/5 * * * *", None, "skip", 1, 60, ["schedule:every-5m"]
    )
    assert s.paused_ms is None and s.added_ms > 0
    assert admin.schedule_pause("every-5m") and not admin.schedule_pause("every-5m")
    assert admin.schedule("every-5m").paused_ms is not None
    assert admin.schedule_resume("every-5m") and not admin.schedule_resume("every-5m")
    admin.schedule_remove("every-5m")
    assert admin.schedules() == []
    for call in (admin.schedule_pause, admin.schedule_resume, admin.schedule_remove, admin.schedule):
        with pytest.raises(UnknownSchedule):
            call("every-5m")
    with pytest.raises(InvalidSchedule, match="invalid schedule name"):
        admin.schedule_pause("a@b")


def test_an_operator_cancels_a_request_and_finalizes_a_streamed_one_whose_producer_is_gone(
    server: Any, ns: str, running: Running
) -> None:
    """``Admin.cancel`` and ``Admin.finalize`` (the Rust ``Admin``'s): a queued request of its own
    stream and a lane one end ``cancelled`` (again: the state they ended in); a streamed request
    left open by its producer completes once an operator finalizes it, and a second finalize, or
    one of an unknown request, is ``NotOpen``."""
    from sluicegate import NotOpen

    admin = Admin(server.url, ns)
    p = Producer(server.url, ns)
    admin.pause()
    own = p.submit([{"i": 1}, {"i": 2}], own_stream=True)
    lane = p.submit([{"i": 3}])
    for h in (own, lane):
        assert admin.cancel(h.id) == "cancelled"
        assert h.wait(timeout=10).state == "cancelled"
        assert admin.cancel(h.id) == "cancelled"
    with pytest.raises(UnknownRequest):
        admin.cancel("never-submitted")
    admin.resume()
    running.start(server.url, lambda ctx, part: part["i"] * 10, ns, slots=2)
    orphan = p.open(concurrency=2)
    orphan.add([{"i": i} for i in range(5)])
    # Its producer is gone (it never finalizes): an operator does.
    admin.finalize(orphan.id)
    assert orphan.handle.wait(timeout=10).results == [0, 10, 20, 30, 40]
    with pytest.raises(NotOpen):
        admin.finalize(orphan.id)
    with pytest.raises(NotOpen):
        admin.finalize("never-submitted")


def test_workers_lists_the_live_workers_and_what_their_slots_hold(server: Any, ns: str, running: Running) -> None:
    """``Admin.workers`` (the Rust ``Admin::workers``): each live worker as it registered, with
    its slots that hold a token now: a request of its own stream by id, a lane by priority."""
    from sluicegate import SlotWork

    admin = Admin(server.url, ns)
    assert admin.workers() == []
    release = threading.Event()

    def held(ctx: Any, part: Any) -> Any:
        release.wait(10)
        return part

    w = running.start(server.url, held, ns, slots=2)
    p = Producer(server.url, ns)
    own = p.submit([1], own_stream=True)
    lane = p.submit([2], priority=70)
    deadline = time.time() + 10
    while True:
        workers = admin.workers()
        if len(workers) == 1 and len(workers[0].busy) == 2:
            break
        assert time.time() < deadline, workers
        time.sleep(0.02)
    (info,) = workers
    assert (info.id, info.slots, info.shards) == (w.worker_id, 2, 1)
    assert info.registration_expires_ms is not None and info.started_ms > 0
    works = sorted(info.busy, key=lambda s: s.lane or 0)
    assert [(s.request, s.lane, s.shard) for s in works] == [(own.id, None, 0), (None, 70, 0)]
    assert all(isinstance(s, SlotWork) and s.slot.startswith(f"{w.worker_id}/") for s in works)
    release.set()
    assert own.wait(timeout=10).results == [1] and lane.wait(timeout=10).results == [2]
    running.stop()
    running.workers.clear()
    assert admin.workers() == []


@pytest.mark.parametrize("on_cluster", [False, True])
def test_purge_namespace_is_refused_while_workers_run_and_then_leaves_no_key_of_it(
    server: Any, cluster: Any, ns: str, running: Running, on_cluster: bool
) -> None:
    """``Admin.purge_namespace`` (the Rust ``Admin::purge_namespace``, ``sluicegate purge
    --all``): refused, naming the workers, while any is registered, unless forced; then every
    key of the namespace goes (on every primary of a cluster), and another namespace's stay."""
    url = cluster.url if on_cluster else server.url
    admin, p = Admin(url, ns), Producer(url, ns)
    other = Producer(url, ns + "-other")
    kept = other.submit([1])
    w = running.start(url, lambda ctx, part: part, ns, slots=2)
    done = [p.submit([i, i + 1], own_stream=i % 2 == 0) for i in range(6)]
    assert all(h.wait(timeout=10).state == "completed" for h in done)
    p.submit([99])  # and one left queued
    with pytest.raises(Refused, match=rf'^1 worker\(s\) are registered in namespace "{ns}" \({w.worker_id}\): stop'):
        admin.purge_namespace()
    running.stop()
    running.workers.clear()
    assert admin.purge_namespace() > 10
    client = p.protocol.conn.client
    nodes = client.get_primaries() if on_cluster else [None]
    for node in nodes:
        # Each primary on its own, a cluster's three (its keys were spread over them).
        direct = redis.Redis(host=node.host, port=node.port) if node is not None else client
        assert list(direct.scan_iter(match=f"{ns}:*")) == [], node
    assert Admin(url, ns + "-other").status(kept.id).state == "queued", "another namespace's keys stay"
    assert admin.purge_namespace() == 0


def test_purge_finished_deletes_every_finished_request_of_a_state_and_keeps_the_rest(
    server: Any, ns: str, running: Running
) -> None:
    """``Admin.purge_finished`` (the Rust ``Admin::purge_finished``, ``sluicegate purge --state``):
    every request finished in the state goes, keys and listing, however it was submitted; the
    other states' and younger ones stay; a state that is not a finished one is refused."""
    admin, p = Admin(server.url, ns), Producer(server.url, ns)
    running.start(server.url, Flaky(), ns, slots=4)
    ok = [p.submit(mixed(2), own_stream=i == 0) for i in range(3)]
    bad = [p.submit(mixed(2, bad=[1])) for _ in range(2)]
    assert [h.wait(timeout=10).state for h in ok + bad] == ["completed"] * 3 + ["failed"] * 2
    listed(admin, [h.id for h in ok], any_order=True, state="completed")
    listed(admin, [h.id for h in bad], any_order=True, state="failed")
    assert admin.purge_finished("failed", older_than=3600) == 0, "none is an hour old"
    assert admin.purge_finished("completed") == 3
    assert admin.list(state="completed").requests == []
    assert all(keys_of(admin, h.id) == [] for h in ok)
    assert sorted(r.id for r in admin.list(state="failed").requests) == sorted(h.id for h in bad)
    assert admin.purge_finished("completed") == 0
    with pytest.raises(sluicegate.InvalidRequest, match=r"^only finished requests are purged \(completed, failed or cancelled\), not running$"):
        admin.purge_finished("running")
