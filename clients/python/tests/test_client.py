"""The Python client's promises, each against its own redis-server."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List
from unittest import mock

import pytest
import redis

import sluicegate
from sluicegate import Admin, Listener, PermanentError, Producer, RedisFull, UnsupportedRedis
from sluicegate._conn import Conn

from conftest import FAST, HERE, REPO, Running

LIB = REPO / "lua" / "dist" / "sluicegate_v2.lua"


class Concurrency:
    """Counts the handler runs in progress, per request, and the most ever seen."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now: Dict[str, int] = defaultdict(int)
        self.most: Dict[str, int] = defaultdict(int)

    def enter(self, rid: str) -> None:
        with self.lock:
            self.now[rid] += 1
            self.most[rid] = max(self.most[rid], self.now[rid])

    def leave(self, rid: str) -> None:
        with self.lock:
            self.now[rid] -= 1


def double(ctx: Any, part: Any) -> Any:
    return {"i": part["i"], "double": 2 * part["i"]}


def parts(n: int) -> List[Dict[str, Any]]:
    return [{"i": i} for i in range(n)]


def test_the_shipped_library_is_byte_identical_to_the_rust_build() -> None:
    shipped = (Path(sluicegate.__file__).parent / "sluicegate_v2.lua").read_bytes()
    assert shipped == LIB.read_bytes(), (
        "clients/python/src/sluicegate/sluicegate_v2.lua differs from lua/dist/sluicegate_v2.lua: "
        "copy it over (cp lua/dist/sluicegate_v2.lua clients/python/src/sluicegate/)"
    )


def test_a_connect_loads_the_library_only_over_an_older_revision_or_none(server: Any) -> None:
    from sluicegate._conn import library_revision, library_source

    source = library_source()
    ours = library_revision(source)
    assert ours > 0
    first = Conn(server.url)
    client = first.client

    def revision() -> int:
        return int(client.execute_command("FCALL_RO", "sg2_revision", 0))

    def loads() -> int:
        return int(client.info("commandstats").get("cmdstat_function|load", {}).get("calls", 0))

    assert revision() == ours
    before = loads()
    Conn(server.url).close()
    assert loads() == before, "a connect finding its own revision loads nothing"
    for other, kept in ((ours + 1, ours + 1), (ours - 1, ours)):
        mine = f"callback=function() return {ours} end"
        assert source.count(mine) == 1
        client.execute_command("FUNCTION LOAD", "REPLACE", source.replace(mine, f"callback=function() return {other} end"))
        Conn(server.url).close()
        assert revision() == kept, other
    first.close()


def test_at_maxmemory_reads_keep_working_and_a_refused_write_says_redis_is_full(server: Any, ns: str) -> None:
    """The Rust ``at_maxmemory_reads_keep_working_and_a_refused_write_says_redis_is_full``: a load
    of the library refused for want of memory is passed over (the one loaded serves), reads work,
    and a write is refused whole with the Rust message."""
    p = Producer(server.url, ns)
    queued = p.submit([{"n": 1}, {"n": 2}])
    client = redis.Redis.from_url(server.url)
    client.config_set("maxmemory", "1mb")
    filler = "x" * 100_000
    for i in range(40):
        try:
            client.set(f"filler{i}", filler)
        except redis.exceptions.OutOfMemoryError:
            break
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("one-more", "x")
    # A load without asking for the revision (as after "Function not found") meets the refusal.
    Conn(server.url).load_library(check=False)
    admin = Admin(server.url, ns)
    status = admin.status(queued.id)
    assert (status.total, status.done, status.state) == (2, 0, "queued")
    assert [r.id for r in admin.list().requests] == [queued.id]
    full = r"^Redis is full \(at its maxmemory\) and refused a write: nothing was written; .*\(Redis said: OOM "
    with pytest.raises(RedisFull, match=full):
        Producer(server.url, ns).submit([{"n": 3}])
    with pytest.raises(RedisFull, match=full):
        p.cancel(queued.id)
    assert admin.status(queued.id).state == "queued"


def test_a_redis_older_than_7_is_refused_with_the_rust_message(server: Any) -> None:
    with mock.patch("redis.Redis.info", return_value={"redis_version": "6.2.14"}):
        with pytest.raises(UnsupportedRedis) as e:
            Conn(server.url)
    assert str(e.value) == (
        "redis server 6.2.14 is too old: sluicegate needs Redis 7.0 or newer (it runs as a Redis Functions library)"
    )


def test_results_come_back_in_order_for_lane_large_and_own_stream_requests(server: Any, ns: str, running: Running) -> None:
    running.start(server.url, double, ns, slots=4)
    p = Producer(server.url, ns)
    small = p.submit(parts(10), concurrency=3)
    large = p.submit(parts(2500), concurrency=4)  # more than one load chunk: submit_open, load_parts, commit
    own = p.submit(parts(7), concurrency=2, own_stream=True)
    for handle, n in ((small, 10), (large, 2500), (own, 7)):
        done = handle.wait(timeout=30)
        assert done.state == "completed"
        assert done.results == [{"i": i, "double": 2 * i} for i in range(n)]
        assert done.errors == {}
    assert p.status(own.id)["state"] == "completed"
    assert p.status(small.id)["state"] == "completed"
    assert p.protocol.conn.client.exists(p.protocol.keys.request(sluicegate._keys.key_id(large.id)).stream) == 0


def wait_for_subscribers(client: Any, channel: str, n: int, what: str) -> None:
    """Waits up to 10 s for ``channel`` to have ``n`` subscribers (PUBSUB NUMSUB)."""
    deadline = time.monotonic() + 10
    while client.pubsub_numsub(channel)[0][1] != n:
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_concurrent_waits_share_one_subscription_and_each_is_rung_by_its_own_request(
    server: Any, ns: str, running: Running
) -> None:
    # A poll of 600 s: only a completion message can end these waits within 30 s (the waits' own
    # timeout, 120 s, ends in a last read of the record, which would find them done).
    p = Producer(server.url, ns, wait_poll=600)
    try:
        handles = [p.submit(parts(1 + n % 3), concurrency=2, own_stream=n % 4 == 0) for n in range(20)]
        done: Dict[Any, Any] = {}

        def wait(key: Any, handle: Any) -> None:
            done[key] = handle.wait(timeout=120)

        waits = [(i, h) for i, h in enumerate(handles)] + [("again", handles[0])]
        threads = [threading.Thread(target=wait, args=w, daemon=True) for w in waits]
        for t in threads:
            t.start()
        channel = p.protocol.keys.done_channel()
        client = p.protocol.conn.client
        wait_for_subscribers(client, channel, 1, "the producer's waits did not subscribe")
        time.sleep(0.3)  # every wait has read its record and sleeps on its ring
        assert client.pubsub_numsub(channel)[0][1] == 1, "21 waits, one subscription"
        running.start(server.url, double, ns, slots=4)
        deadline = time.monotonic() + 30
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "a wait was not rung by its request's completion"
        for key, handle in waits:
            n = 1 + handles.index(handle) % 3
            assert done[key].results == [{"i": i, "double": 2 * i} for i in range(n)], key
    finally:
        p.close()
    wait_for_subscribers(client, channel, 0, "close ends the subscription")


def test_a_wait_survives_the_loss_of_the_shared_subscription(server: Any, ns: str, running: Running) -> None:
    p = Producer(server.url, ns, wait_poll=600)
    try:
        handle = p.submit(parts(3), concurrency=2)
        done: List[Any] = []
        waiter = threading.Thread(target=lambda: done.append(handle.wait(timeout=120)), daemon=True)
        waiter.start()
        channel = p.protocol.keys.done_channel()
        client = p.protocol.conn.client
        wait_for_subscribers(client, channel, 1, "the wait did not subscribe")
        assert client.client_kill_filter(_type="pubsub") == 1
        wait_for_subscribers(client, channel, 1, "the doorbell did not subscribe again")
        running.start(server.url, double, ns, slots=2)
        waiter.join(30)
        assert not waiter.is_alive(), "the wait was not rung after the subscription came back"
        assert done[0].results == [{"i": i, "double": 2 * i} for i in range(3)]
    finally:
        p.close()


def test_a_wait_with_no_time_left_still_reads_the_record_once(server: Any, ns: str, running: Running) -> None:
    running.start(server.url, double, ns, slots=2)
    with Producer(server.url, ns) as p:
        handle = p.submit(parts(2))
        assert handle.wait(timeout=30).results == [{"i": i, "double": 2 * i} for i in range(2)]
        assert handle.wait(timeout=0).state == "completed", "done already: no time needed"
        pending = p.submit(parts(1), delay=3600)
        with pytest.raises(sluicegate.errors.WaitTimeout):
            pending.wait(timeout=0)


def test_a_lane_requests_wait_reads_its_record_alone(server: Any, ns: str) -> None:
    """The handle of a request submitted in a lane knows where it lives: its wait reads the record
    and never looks for a meta hash (§6.7); a wait by id alone still finds it after the meta hash."""
    import redis

    admin = redis.Redis(port=server.port)

    def hmgets() -> int:
        return int(admin.info("commandstats").get("cmdstat_hmget", {}).get("calls", 0))

    with Producer(server.url, ns) as p:
        handles = [p.submit(parts(1))] + p.submit_many([{"parts": parts(2)}])
        for h in handles:
            p.cancel(h.id)  # no worker: each ends by its cancellation
        before = hmgets()
        for h in handles:
            assert h.wait(timeout=10).state == "cancelled"
        assert hmgets() == before, "a lane request's wait looked for a meta hash"
        assert p.wait(handles[0].id, timeout=10).state == "cancelled"
        assert hmgets() == before + 1
    admin.close()


def test_submit_many_answers_each_request_in_order_and_refuses_only_the_bad_ones(server: Any, ns: str, running: Running) -> None:
    p = Producer(server.url, ns)
    p.submit(parts(1), id="taken")
    requests: List[Dict[str, Any]] = [{"parts": parts(1 + n % 3), "priority": (10, 50, 90)[n % 3], "id": f"bulk-{n}"}
                                      for n in range(900)]  # two lane_submit_many calls per priority
    requests += [
        {"parts": parts(2), "id": "taken"},             # its id in use in Redis
        {"parts": parts(2), "id": "bulk-7"},            # ... earlier in the batch
        {"parts": []},                                  # no parts
        {"parts": parts(1), "priority": 101},           # out of range
        {"parts": parts(1), "colour": "red"},           # not an argument of submit
        {"priority": 50},                               # no parts at all
        {"parts": parts(70), "concurrency": 4},         # too big for a lane: submit takes it
        {"parts": parts(3), "own_stream": True, "concurrency": 2},
        {"parts": parts(2), "unlisted": True, "tags": ["t"]},
    ]
    answers = p.submit_many(requests)
    assert len(answers) == len(requests)
    for n, a in enumerate(answers[:900]):
        assert isinstance(a, sluicegate.producer.RequestHandle) and a.id == f"bulk-{n}", (n, a)
    dup_redis, dup_batch, empty, prio, unknown, no_parts, big, own, tagged = answers[900:]
    assert isinstance(dup_redis, sluicegate.DuplicateRequestId), dup_redis
    assert isinstance(dup_batch, sluicegate.DuplicateRequestId), dup_batch
    assert isinstance(empty, sluicegate.InvalidRequest) and "at least one part" in str(empty)
    assert isinstance(prio, sluicegate.InvalidRequest) and "priority" in str(prio)
    assert isinstance(unknown, sluicegate.InvalidRequest) and "'colour'" in str(unknown)
    assert isinstance(no_parts, sluicegate.InvalidRequest) and "needs its parts" in str(no_parts)
    assert isinstance(tagged, sluicegate.InvalidRequest) and "tags" in str(tagged)
    running.start(server.url, double, ns, slots=4)
    for n, h in enumerate(answers[:900]):
        assert h.wait(timeout=60).results == [{"i": i, "double": 2 * i} for i in range(1 + n % 3)], n
    assert big.wait(timeout=30).results == [{"i": i, "double": 2 * i} for i in range(70)]
    assert own.wait(timeout=30).results == [{"i": i, "double": 2 * i} for i in range(3)]
    # The refused duplicate left the first request of its id as it was.
    assert p.wait("bulk-7", timeout=30).results == [{"i": i, "double": 2 * i} for i in range(2)]


@pytest.mark.parametrize("own_stream", [False, True])
def test_the_concurrency_limit_is_reached_and_never_exceeded(server: Any, ns: str, running: Running, own_stream: bool) -> None:
    seen = Concurrency()

    def handler(ctx: Any, part: Any) -> Any:
        seen.enter(ctx.request_id)
        time.sleep(0.03)
        seen.leave(ctx.request_id)
        return part["i"]

    running.start(server.url, handler, ns, slots=4)
    running.start(server.url, handler, ns, slots=4)
    p = Producer(server.url, ns)
    handles = [p.submit(parts(24), concurrency=limit, own_stream=own_stream) for limit in (1, 3)]
    for h, limit in zip(handles, (1, 3)):
        assert h.wait(timeout=30).results == list(range(24))
        assert seen.most[h.id] == limit, f"limit {limit}: at most {seen.most[h.id]} ran at once"


def test_a_retryable_failure_is_retried_then_succeeds(server: Any, ns: str, running: Running) -> None:
    attempts: Dict[int, List[int]] = defaultdict(list)

    def flaky(ctx: Any, part: Any) -> Any:
        attempts[part["i"]].append(ctx.attempt)
        if part["i"] == 1 and ctx.attempt < 3:
            raise RuntimeError(f"flaky attempt {ctx.attempt}")
        return ctx.attempt

    running.start(server.url, flaky, ns)
    p = Producer(server.url, ns)
    for own in (False, True):
        attempts.clear()
        done = p.submit(parts(3), max_attempts=3, backoff=0.01, backoff_max=0.05, own_stream=own).wait(timeout=20)
        assert done.state == "completed"
        assert done.results == [1, 3, 1]
        assert attempts[1] == [1, 2, 3]


def test_a_permanent_error_fails_the_request_with_its_errors(server: Any, ns: str, running: Running) -> None:
    def handler(ctx: Any, part: Any) -> Any:
        if part["i"] == 2:
            raise PermanentError("no such thing")
        if part["i"] == 3:
            raise ValueError("always broken")
        return part["i"]

    running.start(server.url, handler, ns)
    p = Producer(server.url, ns)
    for own in (False, True):
        done = p.submit(parts(5), max_attempts=2, backoff=0.01, backoff_max=0.02, own_stream=own).wait(timeout=20)
        assert done.state == "failed"
        assert done.results == [0, 1, None, None, 4]
        assert set(done.errors) == {2, 3}
        assert (done.errors[2].message, done.errors[2].attempts, done.errors[2].permanent) == ("no such thing", 1, True)
        assert (done.errors[3].message, done.errors[3].attempts, done.errors[3].permanent) == ("always broken", 2, False)


def test_cancel_ends_the_request_and_reaches_running_handlers(server: Any, ns: str, running: Running) -> None:
    told = threading.Event()

    def slow(ctx: Any, part: Any) -> Any:
        if ctx.wait_cancelled(10):
            told.set()
            raise RuntimeError("cancelled")
        return part["i"]

    running.start(server.url, slow, ns)
    p = Producer(server.url, ns)
    for own in (True, False):
        told.clear()
        h = p.submit(parts(4), concurrency=1, own_stream=own)
        time.sleep(0.5)
        assert h.cancel() == "cancelled"
        done = h.wait(timeout=10)
        assert done.state == "cancelled"
        assert told.wait(5), "the running handler was not told"
        assert h.cancel() == "cancelled"  # already cancelled: reports the state it finished in


def test_a_streamed_request_runs_as_parts_are_added_and_completes_at_finalize(server: Any, ns: str, running: Running) -> None:
    running.start(server.url, double, ns)
    p = Producer(server.url, ns)
    req = p.open(concurrency=2)
    req.add(parts(3))
    time.sleep(0.3)
    assert p.status(req.id)["state"] == "running"
    req.add([{"i": i} for i in range(3, 1500)])
    h = req.finalize()
    # Again (as a call re-sent after its reply was lost would be): answered as the first was.
    assert req.finalize() is h
    done = h.wait(timeout=30)
    assert done.state == "completed"
    assert done.results == [{"i": i, "double": 2 * i} for i in range(1500)]
    # Finalized again once finished: still as the first.
    assert req.finalize().wait(timeout=5).state == "completed"


def test_a_windowed_request_keeps_at_most_its_window_unsettled_and_completes(
    server: Any, ns: str, running: Running
) -> None:
    """A streamed request opened with ``window=W`` (§6.14, the Rust ``RequestBuilder::window``):
    each ``add`` call waits until its parts fit, so the parts added and not settled never exceed
    W, whatever is added at once; discarding or keeping its results, it completes."""
    from sluicegate import InvalidRequest

    p = Producer(server.url, ns, window_poll=0.01)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(InvalidRequest, match=r"^a window must allow at least 1 part in Redis"):
            p.open(window=bad)
    client = redis.Redis.from_url(server.url)

    def slow(ctx: Any, part: Any) -> Any:
        time.sleep(0.002)
        return 2 * part["i"]

    running.start(server.url, slow, ns, slots=4)
    for discard in (True, False):
        req = p.open(concurrency=4, window=25, discard_results=discard)
        meta = p.protocol.keys.request(req._kid).meta
        most, stop = [0], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                left = client.hget(meta, "left")
                most[0] = max(most[0], int(left or 0))
                time.sleep(0.001)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            req.add([{"i": i} for i in range(400)])
        finally:
            stop.set()
            sampler.join()
        assert 0 < most[0] <= 25, f"{most[0]} parts were unsettled at once, with a window of 25"
        assert req.outstanding <= 25
        done = req.finalize().wait(timeout=30)
        assert (done.state, done.total, done.failed, done.discarded) == ("completed", 400, 0, discard)
        assert done.results == ([] if discard else [2 * i for i in range(400)])
        # The acks trimmed the stream as they went: far fewer entries than parts were ever added.
        assert client.xlen(p.protocol.keys.request(req._kid).stream) < 100


def test_results_from_reads_a_streamed_requests_outcomes_in_order_while_it_runs_and_frees_them(
    server: Any, ns: str, running: Running
) -> None:
    """``results_from`` (§6.14, the Rust ``RequestHandle::results_from``): pages from 0 on, each
    from the last one's ``next_index``, give every outcome once, in part order, dead letters
    among them; what was read is deleted from Redis, ``wait`` then returns only what was not
    read; and what it cannot serve it refuses by name."""
    from sluicegate import InvalidRequest, ResultsPage, UnknownRequest

    def handler(ctx: Any, part: Any) -> Any:
        if part["i"] == 7:
            raise PermanentError("seven")
        return 2 * part["i"]

    running.start(server.url, handler, ns, slots=4)
    p = Producer(server.url, ns)
    req = p.open(concurrency=4, window=40)
    client = redis.Redis.from_url(server.url)
    results_key = p.protocol.keys.request(req._kid).results
    req.add([{"i": i} for i in range(300)])
    read: List[Any] = []
    errors_seen: Dict[int, Any] = {}
    page = req.handle.results_from(0, 50)
    deadline = time.time() + 30
    while True:
        assert isinstance(page, ResultsPage)
        assert page.first == len(read)
        read.extend(page.results)
        errors_seen.update(page.errors)
        if page.is_last:
            break
        if page.next_index == 300 and page.total is None:
            req.finalize()
        if not page.results:
            assert time.time() < deadline, f"no outcome after part {page.next_index}"
            time.sleep(0.02)
        page = req.handle.results_from(page.next_index, 50)
    assert read == [None if i == 7 else 2 * i for i in range(300)]
    assert list(errors_seen) == [7] and errors_seen[7].message == "seven" and errors_seen[7].permanent
    assert page.total == 300 and page.state == "failed"
    # Read pages are deleted: what is left is the last page, kept until a call asks past it.
    assert client.hlen(results_key) <= 50
    done = req.handle.wait(timeout=10)
    assert done.state == "failed" and len(done.results) <= 50
    # Only the parts not read come back, from `first`; the counts are the request's.
    assert (done.first + len(done.results), done.total, done.failed, done.errors) == (300, 300, 1, {})
    assert done.results == [2 * i for i in range(done.first, 300)]
    # Refusals, each naming the request.
    with pytest.raises(InvalidRequest, match=r"^request \"[^\"]+\": results from index 300 were not taken before index 10000"):
        req.handle.results_from(10_000, 5)
    with pytest.raises(InvalidRequest, match=r"results below index \d+ were taken and deleted already"):
        req.handle.results_from(0, 5)
    small = p.submit([{"i": 1}])
    small.wait(timeout=10)
    with pytest.raises(InvalidRequest, match=r"results_from is for streamed requests \(opened with open\(\)\)"):
        small.results_from(0)
    quiet = p.open(discard_results=True)
    with pytest.raises(InvalidRequest, match=r"discarded"):
        quiet.handle.results_from(0)
    with pytest.raises(UnknownRequest):
        p.results_from("never-submitted", 0)
    with pytest.raises(InvalidRequest, match=r"first is a part index"):
        p.results_from(req.id, -1)


def test_an_async_handler_runs_on_asyncio(server: Any, ns: str, running: Running) -> None:
    seen = Concurrency()

    async def handler(ctx: Any, part: Any) -> Any:
        seen.enter(ctx.request_id)
        await asyncio.sleep(0.02)
        seen.leave(ctx.request_id)
        return [ctx.index, part["i"] * 3]

    running.start(server.url, handler, ns, slots=4)
    done = Producer(server.url, ns).submit(parts(12), concurrency=4).wait(timeout=20)
    assert done.results == [[i, 3 * i] for i in range(12)]
    assert seen.most[done.id] == 4


def test_chunks_run_each_part_once_with_its_own_index_and_flatten_to_the_parts_results(
    server: Any, ns: str, running: Running
) -> None:
    seen: List[int] = []
    lock = threading.Lock()

    def handler(ctx: Any, part: Any) -> Any:
        with lock:
            seen.append(ctx.index)
        assert ctx.idempotency_key == f"{ctx.request_id}/{ctx.index}"
        return part["i"] * 2

    running.start(server.url, sluicegate.chunked(handler), ns, slots=4)
    p = Producer(server.url, ns)
    for own in (False, True):
        seen.clear()
        done = p.submit(sluicegate.chunks(parts(10), 3), concurrency=2, own_stream=own).wait(timeout=20)
        assert done.state == "completed"
        assert done.results == [[0, 2, 4], [6, 8, 10], [12, 14, 16], [18]], f"own stream: {own}"
        assert sorted(seen) == list(range(10)), f"each part once, by its own index (own stream: {own})"


def test_a_failing_part_fails_its_chunk_names_itself_and_stops_the_parts_after_it(
    server: Any, ns: str, running: Running
) -> None:
    ran: List[int] = []

    async def handler(ctx: Any, part: Any) -> Any:
        ran.append(ctx.index)
        if part["i"] == 5:
            raise PermanentError("no such thing")
        return part["i"]

    running.start(server.url, sluicegate.chunked(handler), ns)
    done = Producer(server.url, ns).submit(sluicegate.chunks(parts(10), 4)).wait(timeout=20)
    assert done.state == "failed"
    assert done.results == [[0, 1, 2, 3], None, [8, 9]]
    assert (done.errors[1].message, done.errors[1].permanent) == ("part 5: no such thing", True)
    assert 5 in ran and 6 not in ran and 7 not in ran, ran


def test_a_retried_chunk_runs_all_its_parts_again_and_a_retryable_failure_stays_retryable(
    server: Any, ns: str, running: Running
) -> None:
    ran: List[Any] = []

    def handler(ctx: Any, part: Any) -> Any:
        ran.append((ctx.index, ctx.attempt))
        if part["i"] == 2 and ctx.attempt == 1:
            raise ValueError("not yet")
        if part["i"] == 4:
            raise ValueError("never")
        return part["i"]

    running.start(server.url, sluicegate.chunked(handler), ns, slots=1)
    done = Producer(server.url, ns).submit(sluicegate.chunks(parts(6), 3), max_attempts=2, backoff=0.01,
                                           backoff_max=0.02).wait(timeout=20)
    assert done.state == "failed"
    assert done.results[0] == [0, 1, 2]
    assert (done.errors[1].message, done.errors[1].attempts, done.errors[1].permanent) == ("part 4: never", 2, False)
    assert [r for r in ran if r[0] < 3] == [(0, 1), (1, 1), (2, 1), (0, 2), (1, 2), (2, 2)], "the whole chunk, twice"
    assert 5 not in [index for index, _ in ran]


def test_a_part_that_outlives_the_attempts_timeout_stops_its_chunk_before_the_next_part(
    server: Any, ns: str, running: Running
) -> None:
    ran: List[int] = []

    def handler(ctx: Any, part: Any) -> Any:
        ran.append(ctx.index)
        if part["i"] == 0:
            time.sleep(0.8)  # ignores its cancellation
        return part["i"]

    running.start(server.url, sluicegate.chunked(handler), ns, slots=1)
    done = Producer(server.url, ns).submit(sluicegate.chunks(parts(3), 3), timeout=0.2).wait(timeout=20)
    assert done.state == "failed"
    assert "timed out" in done.errors[0].message
    assert ran == [0], "part 1 started after the timeout"


def test_a_chunk_is_the_array_of_its_first_index_and_its_parts_as_in_rust() -> None:
    assert sluicegate.chunks(["a", "b", "c"], 2) == [[0, ["a", "b"]], [2, ["c"]]]
    assert sluicegate.chunks([], 2) == []
    assert sluicegate.chunks(["d", "e", "f"], 2, first=3) == [[3, ["d", "e"]], [5, ["f"]]]
    with pytest.raises(sluicegate.InvalidRequest, match="first part is a number from 0, not -1"):
        sluicegate.chunks([1], 2, first=-1)
    # The bytes of the Rust unit test `a_chunk_is_the_array_of_its_first_index_and_its_parts`:
    # chunks() of parts 0..8 in chunks of 7, its second chunk.
    second = sluicegate.chunks(["x"] * 7 + ["a", "b"], 7)[1]
    assert sluicegate.codec.encode(second) == bytes.fromhex("920792a161a162")
    for size in (0, sluicegate.MAX_CHUNK + 1, True, 2.5):
        with pytest.raises(sluicegate.InvalidRequest, match=f"from 1 to 10000 parts, not {size!r}"):
            sluicegate.chunks([1], size)  # type: ignore[arg-type]


def test_a_payload_that_is_not_a_chunk_fails_at_once_and_says_what_a_chunk_is(
    server: Any, ns: str, running: Running
) -> None:
    running.start(server.url, sluicegate.chunked(lambda ctx, part: part), ns)
    done = Producer(server.url, ns).submit([{"i": 1}], max_attempts=3).wait(timeout=20)
    assert done.state == "failed"
    assert done.errors[0].permanent and done.errors[0].attempts == 1
    assert done.errors[0].message.startswith("a chunk is [first, [part, ...]], not {'i': 1}")


def test_a_listener_resumes_after_its_cursor(server: Any, ns: str, running: Running) -> None:
    running.start(server.url, double, ns)
    p = Producer(server.url, ns)
    first = Listener(server.url, ns, after="0-0")
    a = p.submit(parts(2), own_stream=True)
    a.wait(timeout=10)
    events = []
    while not events:
        events = first.poll()
    assert [(e.request_id, e.state) for e in events] == [(a.id, "completed")]
    cursor = events[-1].cursor
    b = p.submit(parts(2))  # a lane request
    c = p.submit(parts(2), own_stream=True)
    b.wait(timeout=10)
    c.wait(timeout=10)
    resumed = Listener(server.url, ns, after=cursor)
    got: List[Any] = []
    deadline = time.time() + 10
    while len(got) < 2 and time.time() < deadline:
        got += resumed.poll()
    assert sorted((e.request_id, e.state) for e in got) == sorted([(b.id, "completed"), (c.id, "completed")])
    assert not resumed.poll(block=False)


def test_lane_requests_finished_together_share_an_entry_and_a_cursor_inside_it_resumes_at_the_next(
        server: Any, ns: str, running: Running) -> None:
    p = Producer(server.url, ns)
    # Queued before the worker starts, so that one lane_ack finishes several of them.
    handles = p.submit_many([{"parts": parts(1)} for _ in range(200)])
    running.start(server.url, double, ns, slots=2)
    for h in handles:
        h.wait(timeout=30)
    listener = Listener(server.url, ns, after="0-0")
    events: List[Any] = []
    deadline = time.time() + 10
    while len(events) < 200 and time.time() < deadline:
        events += listener.poll()
    assert sorted(e.request_id for e in events) == sorted(h.id for h in handles)
    inside = [n for n, e in enumerate(events) if "/" in e.cursor]
    assert len(inside) >= 10, f"few events shared an entry: {len(inside)}"
    for n in inside[:: max(1, len(inside) // 6)] + [n for n in range(199) if n not in inside][:2]:
        resumed = Listener(server.url, ns, after=events[n].cursor)
        got: List[Any] = []
        while len(got) < 199 - n:
            more = resumed.poll()
            assert more, f"after cursor {events[n].cursor}: {len(got)} of {199 - n} events"
            got += more
        assert [(e.request_id, e.cursor) for e in got] == [(e.request_id, e.cursor) for e in events[n + 1:]]
        assert not resumed.poll(block=False)


def test_a_killed_worker_loses_nothing(server: Any, ns: str, tmp_path: Path, running: Running) -> None:
    """SIGKILL a worker (the conformance driver) mid-run; another finishes every part."""
    scenario = tmp_path / "kill.json"
    n = 30
    scenario.write_text(json.dumps({"name": "kill", "parts": n, "concurrency": 4, "sleep_ms": 300, "own_stream": True}))
    log = tmp_path / "log.jsonl"
    doomed = subprocess.Popen(
        [sys.executable, str(HERE / "conformance_driver.py"), "worker", "--url", server.url, "--namespace", ns,
         "--scenario", str(scenario), "--log", str(log), "--slots", "4"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert doomed.stdout is not None and doomed.stdout.readline().strip() == "READY"
        p = Producer(server.url, ns)
        h = p.submit([{"i": i, "s": f"part-{i}"} for i in range(n)], concurrency=4, own_stream=True, max_attempts=3)
        deadline = time.time() + 10
        while time.time() < deadline and (not log.exists() or log.read_text().count('"start"') < 6):
            time.sleep(0.05)
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.wait()
        killed_at = time.time()

        rescued: List[int] = []

        def rescue(ctx: Any, part: Any) -> Any:
            rescued.append(part["i"])
            return {"i": part["i"], "double": 2 * part["i"], "s": part["s"]}

        running.start(server.url, rescue, ns)
        done = h.wait(timeout=30)
        assert done.state == "completed"
        assert done.results == [{"i": i, "double": 2 * i, "s": f"part-{i}"} for i in range(n)]
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        started = {line["i"] for line in lines if line["ev"] == "start"}
        ended = {line["i"] for line in lines if line["ev"] == "end"}
        interrupted = started - ended
        assert interrupted, "the kill interrupted no handler"
        assert interrupted <= set(rescued), "a part interrupted by the kill did not run again"
        assert time.time() - killed_at < 15
    finally:
        if doomed.poll() is None:
            doomed.kill()


def test_a_worker_going_on_under_a_new_id_ends_the_take_records_of_its_old_one(
    server: Any, ns: str, running: Running
) -> None:
    """A worker declared dead while it lives (its registration claimed) goes on under a new id; its
    slots end what their old holder names left at their next take, as at a clean stop, rather than
    leaving it to recovery's backstop (here an hour away): no take record of the old id is left,
    and the ``held`` key goes with the last take. (A Python slot gives a token back under its
    take's holder name at once, which ends the record, so here only a take whose reply was lost or
    a hold that ended parked or finished could leave one; the Rust twin in
    tests/suites/recovery.rs, whose slots give back in their next take, fails without it.)"""
    client = redis.Redis.from_url(server.url)

    def handler(ctx: Any, part: Any) -> Any:
        time.sleep(part.get("sleep", 0))
        return 2 * part["n"]

    w = running.start(server.url, handler, ns, slots=2, census_interval=3600)
    keys = w.protocol.keys
    old = w.worker_id

    def records(prefix: str) -> List[str]:
        return [f.decode() for f in client.hkeys(keys.held(0)) if f.decode().startswith(prefix)]

    p = Producer(server.url, ns)
    first = p.submit([{"n": i, "sleep": 0.15} for i in range(8)], concurrency=2, own_stream=True)
    deadline = time.time() + 10
    while not records(f"{old}/"):
        assert time.time() < deadline, "the worker's slots never recorded a take"
        time.sleep(0.01)
    # What a reaper's beat does to a worker not heard from for a lease: its registration leaves the
    # registry. Nobody else reaps it here; its next beat finds it gone and takes a new id.
    assert client.zrem(keys.workers(), old) == 1
    while w.worker_id == old:
        assert time.time() < deadline, "the worker never went on under a new id"
        time.sleep(0.01)
    assert first.wait(timeout=20).results == [2 * i for i in range(8)]
    # Both slots take again under the new id.
    assert p.submit([{"n": i} for i in range(4)], concurrency=2).wait(timeout=20).state == "completed"
    assert records(f"{old}/") == [], f"take records of the old id {old} are left"
    running.stop()
    running.workers.clear()
    assert client.exists(keys.held(0)) == 0, records("")


def test_a_lane_token_a_stopping_slot_took_unseen_is_reclaimed_at_its_stop(
    server: Any, ns: str, running: Running
) -> None:
    """A slot stopping with a take whose reply it never saw undoes it (``untake``); a lane's token
    that take acquired, with its first batch, is kept for recovery under a lost name, and the slot
    reclaims it at once rather than leaving it to recovery's backstop (every census interval, and
    never once the fleet is stopped). Fails without the reclaim: the lost record stays."""
    client = redis.Redis.from_url(server.url)
    p = Producer(server.url, ns)
    h = p.submit([21])
    w = sluicegate.Worker(server.url, lambda ctx, part: 2 * part, slots=1, namespace=ns)
    slot = sluicegate.worker._Slot(w, 0)
    try:
        token = slot.take(slot.holder(), 0, False)
        assert isinstance(token, sluicegate.worker._Token) and token.acquired is not None, token
        # Its reply lost: the slot knows only that a take was under way on shard 0.
        slot.pending, slot.next_take, slot.last_take[0] = 0, token.take, None
        slot.release_all()
        held = {f.decode(): v.decode() for f, v in client.hgetall(w.protocol.keys.held(0)).items()}
        assert not [f for f in held if "/lost/" in f], held
    finally:
        w.protocol.conn.close()
    running.start(server.url, lambda ctx, part: 2 * part, ns, slots=1)
    assert h.wait(timeout=20).results == [42]


def test_a_redis_cluster_runs_requests_too(cluster: Any, ns: str, running: Running) -> None:
    def handler(ctx: Any, part: Any) -> Any:
        if part.get("slow"):
            ctx.wait_cancelled(10)
            raise RuntimeError("cancelled")
        if part["i"] == 7 and ctx.attempt == 1:
            raise RuntimeError("flaky")
        return double(ctx, part)

    running.start(cluster.url, handler, ns, slots=4, token_shards=2)
    p = Producer(cluster.url, ns, token_shards=2)
    listener = Listener(cluster.url, ns, after="0-0", token_shards=2)
    lane = p.submit(parts(5), concurrency=2)
    own = p.submit(parts(30), concurrency=3, own_stream=True, max_attempts=2, backoff=0.01, backoff_max=0.02)
    req = p.open(concurrency=2, max_attempts=2, backoff=0.01, backoff_max=0.02)
    req.add(parts(12))
    streamed = req.finalize()
    slow = p.submit([{"i": 0, "slow": True}], own_stream=True)
    assert lane.wait(timeout=20).results == [{"i": i, "double": 2 * i} for i in range(5)]
    assert own.wait(timeout=20).results == [{"i": i, "double": 2 * i} for i in range(30)]
    assert streamed.wait(timeout=20).results == [{"i": i, "double": 2 * i} for i in range(12)]
    time.sleep(0.3)
    assert slow.cancel() == "cancelled"
    assert slow.wait(timeout=10).state == "cancelled"
    got: List[Any] = []
    deadline = time.time() + 10
    while len(got) < 4 and time.time() < deadline:
        got += listener.poll()
    assert sorted((e.request_id, e.state) for e in got) == sorted(
        [(lane.id, "completed"), (own.id, "completed"), (streamed.id, "completed"), (slow.id, "cancelled")]
    )


def test_on_a_cluster_waits_are_rung_by_their_completions_through_the_shared_subscription(
    cluster: Any, ns: str, running: Running
) -> None:
    # A poll of 600 s, as on one server above: only a completion message, heard through the
    # doorbell's one subscription (redis-py's ClusterPubSub on a cluster), ends these waits within
    # 30 s. The subscription stands before any request runs, so none is missed.
    p = Producer(cluster.url, ns, wait_poll=600, token_shards=2)
    try:
        handles = [p.submit(parts(1 + n % 3), concurrency=2, own_stream=n % 4 == 0) for n in range(12)]
        done: Dict[int, Any] = {}

        def wait(i: int) -> None:
            done[i] = handles[i].wait(timeout=120)

        threads = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(len(handles))]
        for t in threads:
            t.start()
        assert p._doorbell.subscribed(10), "the doorbell did not subscribe on the cluster"
        time.sleep(0.3)  # every wait has read its record and sleeps on its ring
        running.start(cluster.url, double, ns, slots=4, token_shards=2)
        deadline = time.monotonic() + 30
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "a wait was not rung by its request's completion"
        for i in range(len(handles)):
            assert done[i].results == [{"i": j, "double": 2 * j} for j in range(1 + i % 3)], i
    finally:
        p.close()


def test_token_shards_spread_tokens_and_events_and_everything_completes(server: Any, ns: str, running: Running) -> None:
    seen = Concurrency()

    def handler(ctx: Any, part: Any) -> Any:
        seen.enter(ctx.request_id)
        time.sleep(0.01)
        seen.leave(ctx.request_id)
        return part["i"]

    running.start(server.url, handler, ns, slots=6, token_shards=3)
    p = Producer(server.url, ns, token_shards=3)
    listener = Listener(server.url, ns, after="0-0", token_shards=3)
    handles = [p.submit(parts(40), concurrency=5, id=f"sharded-{n}", own_stream=True) for n in range(4)]
    handles.append(p.submit(parts(3), id="sharded-lane"))
    req = p.open(concurrency=3, id="sharded-stream")
    req.add(parts(30))
    handles.append(req.finalize())
    for h in handles:
        done = h.wait(timeout=30)
        assert done.state == "completed" and done.results == list(range(len(done.results)))
        assert seen.most[h.id] <= 5
    got: List[Any] = []
    deadline = time.time() + 10
    while len(got) < len(handles) and time.time() < deadline:
        got += listener.poll()
    assert sorted(e.request_id for e in got) == sorted(h.id for h in handles)
    assert len(got[-1].cursor.split(",")) == 3


def test_after_fast_requests_a_slow_one_still_runs_at_its_limit(server: Any, ns: str, running: Running) -> None:
    """A slot sizes a hold's first batch from its last hold: fast handlers must not make one slot
    take all of a slow request's parts (``acquire`` hands it its share of the parts left)."""
    seen = Concurrency()

    def handler(ctx: Any, part: Any) -> Any:
        seen.enter(ctx.request_id)
        time.sleep(part.get("sleep", 0))
        seen.leave(ctx.request_id)
        return part["i"]

    running.start(server.url, handler, ns, slots=4)
    p = Producer(server.url, ns)
    assert p.submit(parts(400), concurrency=4, own_stream=True).wait(timeout=30).state == "completed"
    slow = p.submit([{"i": i, "sleep": 0.3} for i in range(8)], concurrency=4, own_stream=True)
    assert slow.wait(timeout=30).results == list(range(8))
    assert seen.most[slow.id] == 4, f"the slow request ran {seen.most[slow.id]} parts at once, limit 4"


def test_a_first_batch_sized_by_fast_handlers_hands_back_a_slow_requests_rest(
    server: Any, ns: str, running: Running
) -> None:
    """Once a guessed first batch has run for its budget it hands back what it has not run, so a
    higher priority gets the slot between a slow request's parts, not after the whole batch."""
    started: List[str] = []

    def handler(ctx: Any, part: Any) -> Any:
        started.append(ctx.request_id)
        time.sleep(part.get("sleep", 0))
        return part["i"]

    running.start(server.url, handler, ns, slots=1, quantum_parts=100_000, quantum_time=600.0)
    p = Producer(server.url, ns)
    assert p.submit(parts(100), own_stream=True).wait(timeout=30).state == "completed"
    slow = p.submit([{"i": i, "sleep": 0.1} for i in range(20)], priority=1, own_stream=True)
    deadline = time.monotonic() + 10
    while slow.id not in started and time.monotonic() < deadline:
        time.sleep(0.005)
    urgent = p.submit(parts(1), priority=99)
    assert urgent.wait(timeout=30).state == "completed"
    before = started[: started.index(urgent.id)].count(slow.id)
    assert before <= 3, f"{before} slow parts started before the urgent one: the first batch ran whole"
    assert slow.wait(timeout=30).results == list(range(20))


def test_a_free_slot_takes_the_highest_priority_waiting(server: Any, ns: str, running: Running) -> None:
    order: List[str] = []

    def handler(ctx: Any, part: Any) -> Any:
        order.append(ctx.request_id)
        return part["i"]

    p = Producer(server.url, ns)
    low = p.submit(parts(5), priority=10, own_stream=True)
    mid = p.submit(parts(5), priority=50)
    high = p.submit(parts(5), priority=90, own_stream=True)
    running.start(server.url, handler, ns, slots=1)
    for h in (low, mid, high):
        assert h.wait(timeout=20).state == "completed"
    assert order == [high.id] * 5 + [mid.id] * 5 + [low.id] * 5


def test_a_reserved_slot_starts_an_urgent_request_while_every_other_slot_is_busy(
    server: Any, ns: str, running: Running
) -> None:
    """Two slots, one kept for priorities 90 and up: the long priority-89 request's second token
    waits (the reserved slot leaves it), and a priority-99 request starts while the other slot is
    still inside a long handler."""
    release = threading.Event()
    started: List[str] = []

    def handler(ctx: Any, part: Any) -> Any:
        started.append(ctx.request_id)
        if ctx.priority == 89:
            release.wait(30)
        return part["i"]

    with pytest.raises(ValueError, match="at least one must take every priority"):
        sluicegate.Worker(server.url, handler, slots=2, namespace=ns, reserve=(2, 90))
    with pytest.raises(ValueError, match="a priority is from 1 to 99"):
        sluicegate.Worker(server.url, handler, slots=2, namespace=ns, reserve=(1, 0))
    running.start(server.url, handler, ns, slots=2, reserve=(1, 90))
    p = Producer(server.url, ns)
    long = p.submit(parts(2), priority=89, concurrency=2)
    deadline = time.time() + 10
    while len(started) < 1 and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # a reserved slot that took the 89 would have started its second part by now
    assert started == [long.id], started
    urgent = p.submit(parts(1), priority=99)
    assert urgent.wait(timeout=10).state == "completed"
    assert not release.is_set() and started == [long.id, urgent.id], started
    release.set()
    assert long.wait(timeout=30).state == "completed"


def test_an_unlisted_request_runs_but_stays_out_of_the_listing_index(server: Any, ns: str, running: Running) -> None:
    running.start(server.url, double, ns, slots=2)
    p = Producer(server.url, ns)
    with pytest.raises(sluicegate.InvalidRequest, match="unlisted request cannot carry tags"):
        p.submit(parts(1), tags=["t"], unlisted=True)
    for refused in (lambda: p.submit(parts(3), own_stream=True, unlisted=True),
                    lambda: p.submit(parts(65), unlisted=True),
                    lambda: p.open(unlisted=True)):
        with pytest.raises(sluicegate.InvalidRequest, match="only a request that takes its priority's lane"):
            refused()
    listed = p.submit(parts(1))
    lane = p.submit(parts(2), unlisted=True)
    own = p.submit(parts(3), concurrency=2, unlisted=True)
    for handle, n in ((listed, 1), (lane, 2), (own, 3)):
        assert handle.wait(timeout=30).results == [{"i": i, "double": 2 * i} for i in range(n)]
    # Finished, each listed request is in `completed` (a lane request without tags keeps its
    # row in its record, not in ix:row).
    rows = p.protocol.conn.client.zrange(f"{ns}:{{{ns}.q0}}:ix:completed", 0, -1)
    listed_ids = {r.decode() if isinstance(r, bytes) else r for r in rows}
    key = sluicegate._keys.key_id
    assert listed_ids == {key(listed.id)}, listed_ids


def test_a_request_that_discards_its_results_stores_none_and_wait_returns_its_counts(
    server: Any, ns: str, running: Running
) -> None:
    def handler(ctx: Any, part: Any) -> Any:
        if part["i"] == 3:
            raise PermanentError("no three")
        return part["i"]

    running.start(server.url, handler, ns, slots=3)
    p = Producer(server.url, ns)
    client = p.protocol.conn.client
    lane = p.submit(parts(3), discard_results=True)
    own = p.submit(parts(3), concurrency=2, own_stream=True, discard_results=True)
    bulk = p.submit_many([{"parts": parts(2), "discard_results": True}, {"parts": parts(2)}])
    opened = p.open(discard_results=True)
    opened.add(parts(3))
    streamed = opened.finalize()
    for handle, n in ((lane, 3), (own, 3), (bulk[0], 2), (streamed, 3)):
        done = handle.wait(timeout=30)
        assert (done.state, done.discarded, done.results, done.errors) == ("completed", True, [], {}), handle
        assert (done.total, done.failed) == (n, 0), handle
    # Nothing was stored: no results hash, no result field in the lane record.
    key = sluicegate._keys.key_id
    assert client.exists(p.protocol.keys.request(key(own.id)).results) == 0
    record = client.hgetall(p.protocol.keys.record(0, key(lane.id)))
    assert record and not [f for f in record if f.startswith(b"o")], record
    # Kept beside them: the other request of the bulk submit.
    kept = bulk[1].wait(timeout=30)
    assert (kept.results, kept.discarded, kept.total) == ([0, 1], False, 2)
    # A dead letter still fails it, and is counted.
    for own_stream in (False, True):
        done = p.submit(parts(5), own_stream=own_stream, discard_results=True).wait(timeout=30)
        assert (done.state, done.total, done.failed, done.results) == ("failed", 5, 1, []), own_stream


def connected(server: Any) -> int:
    client = redis.Redis.from_url(server.url)
    try:
        # This client itself is one of them.
        return int(client.info("clients")["connected_clients"]) - 1
    finally:
        client.close()


def settle_to(server: Any, want: int) -> int:
    """The server's count of client connections once it stops falling (closes are asynchronous on
    the server's side), at most 5 s."""
    deadline = time.monotonic() + 5
    n = connected(server)
    while n > want and time.monotonic() < deadline:
        time.sleep(0.05)
        n = connected(server)
    return n


def test_closed_or_dropped_components_leave_no_connection_open(server: Any, ns: str) -> None:
    """Each component, used (a wait that subscribes, a listener's read, an admin call, a worker
    that ran a request) then closed or stopped, twenty times over: the server's count of client
    connections comes back to where it was. A producer dropped without close() ends its
    subscription and its connection too."""
    base = connected(server)
    for n in range(20):
        with Producer(server.url, ns) as p:
            w = sluicegate.Worker(server.url, double, slots=2, namespace=ns, **FAST)
            t = w.start()
            assert w.ready.wait(10), "worker did not start"
            assert p.submit(parts(2)).wait(timeout=30).results == [{"i": i, "double": 2 * i} for i in range(2)]
            w.stop()
            t.join(15)
            assert not t.is_alive(), "the worker's thread ended"
        listener = Listener(server.url, ns, after="0-0")
        assert len(listener.poll()) >= 1
        listener.close()
        with sluicegate.Admin(server.url, ns) as admin:
            admin.paused()
        # A producer dropped without close(), after a wait that subscribed and was answered.
        dropped = Producer(server.url, ns)
        w = sluicegate.Worker(server.url, double, slots=1, namespace=ns, **FAST)
        t = w.start()
        assert w.ready.wait(10), "worker did not start"
        assert dropped.submit(parts(1), own_stream=True).wait(timeout=30).state == "completed"
        w.stop()
        t.join(15)
        del dropped
        gc.collect()
        assert settle_to(server, base) == base, f"round {n}: {connected(server) - base} connections left open"
