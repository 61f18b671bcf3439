"""Per-request rate limits (``Producer.submit(rate=(n, per))``, Rust ``RequestBuilder::rate``;
docs/protocol.md §6.17): at most n parts of a request start per interval across all workers, with
bursts of up to n. The library's hand-out holds the limit (GCRA on meta ``tat``); a Python
worker's part is to wake the token the hand-out parked when the next part may start (the
``park`` reply's wake, as for a retry)."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, List

import pytest
import redis

from sluicegate import Admin, InvalidRequest, Producer, RateLimit
from sluicegate._keys import key_id
from sluicegate.producer import LOAD_CHUNK, UNLISTED_LANE_ONLY

from conftest import CLI, Running, cli_json

REFUSED = "a rate is 1 to 1000000 parts per 1 ms to a day, not "


class Starts:
    """When each handler run started (``time.monotonic()``, one clock for every worker of the
    test: they run in this process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.at: List[float] = []

    def handler(self, seconds: float = 0.001) -> Callable[[Any, Any], Any]:
        def handle(ctx: Any, part: Any) -> Any:
            with self.lock:
                self.at.append(time.monotonic())
            time.sleep(seconds)
            return part

        return handle

    def all(self) -> List[float]:
        with self.lock:
            return sorted(self.at)


def most_in_a_window(starts: List[float], window: float) -> int:
    """The most starts in any window [t, t + window) that begins at a start."""
    most, j = 0, 0
    for i, t in enumerate(starts):
        while j < len(starts) and starts[j] < t + window:
            j += 1
        most = max(most, j - i)
    return most


def test_a_rate_limit_holds_across_two_python_workers(server: Any, ns: str, running: Running) -> None:
    """400 parts, concurrency 8, 20 per second, 1 ms handlers, two workers of 4 slots: without
    the limit they would all start within a second. With it, the first 5 s see the burst of 20
    and then 20 a second: at most 5 * 20 + 20 = 120 starts (GCRA: hand-outs in [0, W) are at
    most 20 + 20 * W / 1 s rounded down, and none comes before the first start), and no window
    of 1 s holds more than 2 * 20."""
    starts = Starts()
    for _ in range(2):
        running.start(server.url, starts.handler(), ns, slots=4)
    p = Producer(server.url, ns)
    h = p.submit(list(range(400)), concurrency=8, rate=(20, 1.0))
    deadline = time.monotonic() + 20
    while not starts.all() and time.monotonic() < deadline:
        time.sleep(0.01)
    seen = starts.all()
    assert seen, "no part started"
    first = seen[0]
    # A margin after the 5 s, for the starts handed out before it to be logged.
    time.sleep(max(0.0, first + 5.3 - time.monotonic()))
    seen = starts.all()
    h.cancel()
    in_five = [t for t in seen if t < first + 5.0]
    per_second = [sum(1 for t in in_five if first + s <= t < first + s + 1) for s in range(5)]
    print(f"starts in the first 5 s: {len(in_five)}, by second {per_second}, "
          f"most in a 1 s window: {most_in_a_window(seen, 1.0)}")
    # At most the 120 allowed, give or take what the starts' lag behind their hand-outs moves
    # across the window's ends (a 121st would need the first start 50 ms behind its hand-out:
    # the margin to 125 is for a loaded machine). At least 95: the workers keep up with the
    # limit (a token parked for want of room is woken by its worker's timer, up to a recovery
    # interval late, and the bucket refills meanwhile, so lateness costs little); 116 to 119 in
    # 36 runs on an idle machine. Without the limit: 400 in the first second.
    assert 95 <= len(in_five) <= 125, (len(in_five), per_second)
    assert most_in_a_window(seen, 1.0) <= 40, per_second
    st = Admin(server.url, ns).status(h.id)
    assert st.rate == RateLimit(20, 1000)
    assert st.concurrency == 8


def test_a_limit_without_bursts_is_kept_up_with(server: Any, ns: str, running: Running) -> None:
    """20 a second with bursts of 1 (1 per 50 ms): every start waits for its unit, so each one
    that is late is lost. The worker wakes a parked token when its wake falls due, not at its
    next recovery pass (1 s apart here): at least 36 of the 61 allowed in 3 s start, more than
    twice the 15 or so of a wake at the passes (45 was missed by one on a loaded CI machine)."""
    starts = Starts()
    running.start(server.url, starts.handler(), ns, slots=2, recovery_interval=1.0)
    p = Producer(server.url, ns)
    h = p.submit(list(range(200)), concurrency=2, rate=(1, 0.05))
    deadline = time.monotonic() + 20
    while not starts.all() and time.monotonic() < deadline:
        time.sleep(0.01)
    first = starts.all()[0]
    time.sleep(max(0.0, first + 3.2 - time.monotonic()))
    seen = starts.all()
    h.cancel()
    in_three = sum(1 for t in seen if t < first + 3.0)
    print(f"starts in the first 3 s: {in_three}")
    # (At most 61 are handed out in 3 s; 62 leaves a ms of lag on either end.) Waking at the
    # recovery passes instead: about 15.
    assert 36 <= in_three <= 62, in_three


def test_a_streamed_request_keeps_its_rate(server: Any, ns: str, running: Running) -> None:
    """2 per 500 ms: the burst of 2, then one every 250 ms, so 6 parts take about a second."""
    starts = Starts()
    running.start(server.url, starts.handler(), ns, slots=4)
    p = Producer(server.url, ns)
    req = p.open(concurrency=4, rate=(2, 0.5))
    assert p.status(req.id)["rate"] == "2/500"
    req.add(list(range(6)))
    done = req.finalize().wait(timeout=30)
    assert (done.state, done.results) == ("completed", list(range(6)))
    seen = starts.all()
    assert len(seen) == 6
    # The 6th is handed out 4 intervals of 250 ms after the burst; the margin is for the starts'
    # lag behind their hand-outs (the first one's the longest: its slot's thread starts then).
    assert seen[-1] - seen[0] >= 0.95, [round(t - seen[0], 3) for t in seen]
    assert most_in_a_window(seen, 0.5) <= 4
    assert Admin(server.url, ns).status(req.id).rate == RateLimit(2, 500)


def test_retries_count_against_the_rate(server: Any, ns: str, running: Running) -> None:
    """A retry is a start: 1 per 300 ms, a part that fails twice and succeeds the third time,
    no backoff. Its three attempts are handed out 300 ms apart."""
    starts = Starts()
    attempts: List[int] = []

    def flaky(ctx: Any, part: Any) -> Any:
        starts.handler(0)(ctx, part)
        attempts.append(ctx.attempt)
        if ctx.attempt < 3:
            raise RuntimeError("not yet")
        return part

    running.start(server.url, flaky, ns, slots=2)
    p = Producer(server.url, ns)
    done = p.submit(["x"], max_attempts=3, backoff=0, backoff_max=0, rate=(1, 0.3)).wait(timeout=30)
    assert (done.state, done.results, attempts) == ("completed", ["x"], [1, 2, 3])
    seen = starts.all()
    assert seen[-1] - seen[0] >= 0.55, [round(t - seen[0], 3) for t in seen]


def test_the_rate_is_sent_as_n_per_whole_ms_by_every_creating_call(server: Any, ns: str) -> None:
    p = Producer(server.url, ns)
    admin = Admin(server.url, ns)
    cases = [
        ((100, 1), "100/1000"),
        ((3, 0.3), "3/300"),          # 0.3 * 1000 is 300.00000000000006
        ((7, 4.35), "7/4350"),        # 4.35 * 1000 is 4349.999999999999
        ((1, 0.001), "1/1"),
        ((1, 0.0015), "1/1"),         # whole ms, rounded down as the Rust client's
        ((1_000_000, 86_400), "1000000/86400000"),
    ]
    for rate, sent in cases:
        # Small (submit_small; it takes no lane), large (submit_open), streamed (stream_open).
        small = p.submit([1], rate=rate)
        large = p.submit([1] * (LOAD_CHUNK + 1), rate=rate)
        opened = p.open(rate=rate)
        for rid in (small.id, large.id, opened.id):
            assert p.status(rid)["rate"] == sent, (rate, rid)
            n, per = sent.split("/")
            assert admin.status(rid).rate == RateLimit(int(n), int(per))
    # Without one: none stored, and a small request takes its lane as before.
    lane = p.submit([1])
    plain = p.submit([1], own_stream=True)
    assert "rate" not in p.status(plain.id) and "rate" not in p.status(lane.id)
    assert admin.status(plain.id).rate is None and admin.status(lane.id).rate is None
    client = redis.Redis(port=server.port)
    assert client.exists(p.protocol.keys.request(key_id(lane.id)).meta) == 0
    assert client.exists(p.protocol.keys.request(key_id(small.id)).meta) == 1


def test_a_bad_rate_is_refused_before_anything_is_written(server: Any, ns: str) -> None:
    p = Producer(server.url, ns)
    out_of_range = [(0, 1), (-1, 1), (1_000_001, 1), (1, 0), (1, -1), (1, 0.0009), (1, 86_400.001),
                    (1, float("nan")), (1, float("inf"))]
    malformed = [(1.5, 1), (True, 1), ("20", 1), (20, "1s"), (20, None), (20, True), 20, "20/s", (20,),
                 (20, 1, 2), "20", {20: 1}, RateLimit(20, 1000)]
    for rate in out_of_range + malformed:
        with pytest.raises(InvalidRequest) as e:
            p.submit([1], rate=rate)  # type: ignore[arg-type]
        assert str(e.value).startswith(REFUSED), (rate, str(e.value))
        with pytest.raises(InvalidRequest) as e:
            p.open(rate=rate)  # type: ignore[arg-type]
        assert str(e.value).startswith(REFUSED), (rate, str(e.value))
    assert str(pytest.raises(InvalidRequest, p.submit, [1], rate=(0, 1)).value) == REFUSED + "0 per 1.0 s"
    # A rate-limited request never takes a lane: it cannot be unlisted.
    for kw in ({}, {"own_stream": True}):
        with pytest.raises(InvalidRequest, match="^" + re.escape(UNLISTED_LANE_ONLY)):
            p.submit([1], unlisted=True, rate=(5, 1), **kw)
    with pytest.raises(InvalidRequest, match="^" + re.escape(UNLISTED_LANE_ONLY)):
        p.open(unlisted=True, rate=(5, 1))
    assert redis.Redis(port=server.port).keys(f"*{ns}*") == []


@pytest.mark.skipif(not CLI.exists(), reason=f"{CLI} is missing: cargo build -p sluicegate-cli")
def test_a_cli_submit_with_a_rate_is_served_by_a_python_worker(server: Any, ns: str, running: Running,
                                                               tmp_path: Path) -> None:
    starts = Starts()
    running.start(server.url, starts.handler(), ns, slots=4)
    src = tmp_path / "in.txt"
    src.write_text("".join(f"{i}\n" for i in range(12)))

    def cli(*args: str) -> Any:
        return cli_json(server.url, ns, *args, quiet=True)

    rid = "rated-by-the-cli"
    cli("submit", "--id", rid, "--concurrency", "4", "--rate", "4/500ms", str(src))
    assert Admin(server.url, ns).status(rid).rate == RateLimit(4, 500)
    done = Producer(server.url, ns).wait(rid, timeout=30)
    assert (done.state, len(done.results)) == ("completed", 12)
    seen = starts.all()
    # The burst of 4, then one every 125 ms: the 12th is handed out 8 * 125 ms after the first.
    assert seen[-1] - seen[0] >= 0.95, [round(t - seen[0], 3) for t in seen]
    assert most_in_a_window(seen, 0.5) <= 8
    # The CLI's status (Rust RequestStatus::rate) says the same.
    assert cli("status", rid)[0]["rate"] == {"n": 4, "per_ms": 500}
