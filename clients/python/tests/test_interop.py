"""Interop with the Rust CLI (target/debug/sluicegate, built by `cargo build -p sluicegate-cli`):
a Python producer served by `sluicegate worker --exec`, `sluicegate submit` served by a Python
worker, and the Python Admin agreeing with the CLI's operator commands. Skipped when the binary is
missing."""

from __future__ import annotations

import dataclasses
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator, List

import pytest

from sluicegate import Admin, Paused, PermanentError, Producer, Worker

from conftest import CLI, FAST, Running, cli, cli_json, cli_worker_process

pytestmark = pytest.mark.skipif(not CLI.exists(), reason=f"{CLI} is missing: cargo build -p sluicegate-cli")


@pytest.fixture
def cli_worker(server: Any, ns: str, tmp_path: Path) -> Iterator[subprocess.Popen]:
    script = tmp_path / "triple.py"
    script.write_text(
        "import json, os, sys\n"
        "p = json.loads(sys.stdin.read())\n"
        "if p['i'] == 3 and os.environ['SLUICEGATE_ATTEMPT'] == '1':\n"
        "    sys.exit(1)\n"
        "if p['i'] == 4:\n"
        "    print('no four', file=sys.stderr); sys.exit(100)\n"
        "print(json.dumps({'i': p['i'], 'triple': 3 * p['i'], 'tags': p['tags'], 'idx': int(os.environ['SLUICEGATE_INDEX'])}))\n"
    )
    proc = cli_worker_process(server.url, ns, script, slots=3)
    yield proc
    proc.terminate()
    proc.wait(15)


def test_a_python_producer_is_served_by_the_rust_cli_worker(server: Any, ns: str, cli_worker: Any) -> None:
    p = Producer(server.url, ns)
    # The Python Admin lists the Rust worker as it registered: its slots (the three asked for and
    # its urgent slot), version and command.
    deadline = time.time() + 10
    while not Admin(server.url, ns).workers():
        assert time.time() < deadline, "the CLI worker never registered"
        time.sleep(0.05)
    (info,) = Admin(server.url, ns).workers()
    assert info.slots == 4 and info.version and info.label and "triple.py" in info.label, info
    payloads = [{"i": i, "tags": ["a", "ü"]} for i in range(6)]
    for own in (False, True):
        done = p.submit(payloads, concurrency=2, max_attempts=2, backoff=0.01, backoff_max=0.05, own_stream=own).wait(timeout=30)
        assert done.state == "failed"
        expected: List[Any] = [{"i": i, "triple": 3 * i, "tags": ["a", "ü"], "idx": i} for i in range(6)]
        expected[4] = None
        assert done.results == expected
        assert set(done.errors) == {4}
        assert done.errors[4].permanent and "no four" in done.errors[4].message


def test_a_cli_submit_is_served_by_a_python_worker(server: Any, ns: str, tmp_path: Path) -> None:
    def handler(ctx: Any, part: Any) -> Any:
        return {"got": part, "index": ctx.index}

    w = Worker(server.url, handler, slots=3, namespace=ns, **FAST)
    t = w.start()
    try:
        lines = ['{"n": 1}', "hello world", "42", '"quoted"', "", '{"nested": {"a": [1, 2.5, null, true]}}']
        src = tmp_path / "in.txt"
        src.write_text("\n".join(lines) + "\n")
        got = cli_json(server.url, ns, "submit", "--concurrency", "2", "--wait", str(src))
        sent = [{"n": 1}, "hello world", 42, "quoted", "", {"nested": {"a": [1, 2.5, None, True]}}]
        assert [g["index"] for g in got] == list(range(6))
        results = [g["ok"] for g in got]
        assert [r["got"] for r in results] == sent, got
        assert [r["index"] for r in results] == list(range(len(sent)))
    finally:
        w.stop()
        t.join(15)


def test_a_cli_submit_that_discards_its_results_is_waited_for_in_python(server: Any, ns: str, running: Running,
                                                                        tmp_path: Path) -> None:
    running.start(server.url, lambda ctx, part: part, ns, slots=2)
    src = tmp_path / "in.txt"
    src.write_text("1\n2\n3\n")
    out = cli(server.url, ns, "submit", "--id", "quiet", "--discard-results", str(src))
    assert out.returncode == 0, out.stderr
    done = Producer(server.url, ns).wait("quiet", timeout=30)
    assert (done.state, done.discarded, done.total, done.failed, done.results) == ("completed", True, 3, 0, [])


def test_the_python_admin_and_the_cli_agree(server: Any, ns: str, running: Running) -> None:
    fixed = threading.Event()

    def handler(ctx: Any, part: Any) -> Any:
        if part["i"] == 1 and not fixed.is_set():
            raise PermanentError("bad 1")
        return part["i"]

    def cli(*args: str) -> List[Any]:
        return cli_json(server.url, ns, *args)

    running.start(server.url, handler, ns, slots=2)
    p = Producer(server.url, ns)
    admin = Admin(server.url, ns)
    for n in range(3):
        bad = n != 2
        p.submit([{"i": i} for i in range(3)] if bad else [{"i": 0}], id=f"x{n}", tags=["cli"],
                 own_stream=n == 1).wait(timeout=20)
        time.sleep(0.005)
    deadline = time.time() + 10
    while len(admin.list(state="failed").requests) < 2 and time.time() < deadline:
        time.sleep(0.02)  # the listing index shows a finish once its finisher's next step ran
    page = admin.list()
    assert cli("list") == [dataclasses.asdict(r) for r in page.requests] + [{"cursor": None}]
    first = admin.list(limit=1, state="failed")
    assert cli("list", "--limit", "1", "--state", "failed")[-1] == {"cursor": first.cursor}
    rest = cli("list", "--limit", "5", "--state", "failed", "--cursor", str(first.cursor))
    assert [r["id"] for r in rest[:-1]] == [r.id for r in admin.list(limit=5, state="failed", cursor=first.cursor).requests]
    for rid in ("x0", "x1"):
        dead = [{"index": d.index, "attempts": d.error.attempts, "permanent": d.error.permanent,
                 "error": d.error.message, "payload": d.payload} for d in admin.dead(rid)]
        assert dead == [{"index": 1, "attempts": 1, "permanent": True, "error": "bad 1", "payload": {"i": 1}}]
        assert cli("dead", rid) == dead

    admin.pause(7)
    assert cli("pause", "--priority", "5") == [{"all": False, "priorities": [7, 5]}]
    assert admin.paused() == Paused(False, [7, 5])
    assert cli("resume") == [{"all": False, "priorities": []}]

    fixed.set()
    assert cli("requeue", "x0") == [{"id": "x0", "requeued": 1}]
    assert admin.requeue("x1") == 1
    for rid in ("x0", "x1"):
        assert p.wait(rid, timeout=20).results == [0, 1, 2]
    while len(admin.list(state="completed").requests) < 3 and time.time() < deadline + 10:
        time.sleep(0.02)
    assert [r["id"] for r in cli("list", "--state", "completed")[:-1]] == ["x2", "x1", "x0"]


def test_a_schedule_added_by_the_cli_is_listed_paused_resumed_and_removed_by_the_python_admin(
    server: Any, ns: str, tmp_path: Path
) -> None:
    from sluicegate import Schedule, UnknownSchedule

    def cli(*args: str, stdin: str = "") -> List[Any]:
        return cli_json(server.url, ns, *args, stdin=stdin)

    cli("schedule", "add", "nightly", "--cron", "30 2 * * *", "--tz", "Europe/Rome", "--missed", "catch-up",
        "--catch-up", "3", "--", "--priority", "70", "--tag", "team:ops", "-", stdin='{"report": 1}\n{"report": 2}\n')
    admin = Admin(server.url, ns)
    [listed] = admin.schedules()
    [rust] = cli("schedule", "list")
    assert listed == Schedule(
        name="nightly", cron="30 2 * * *", time_zone="Europe/Rome", missed="catch-up 3", added_ms=rust["added_ms"],
        paused_ms=None, next_ms=None, last_ms=None, owed_ms=[], parts=2, priority=70,
        tags=["schedule:nightly", "team:ops"],
    )
    # (The Rust Admin computes the first tick from the pattern; no worker fired it yet.)
    assert rust["next_ms"] > rust["added_ms"]
    assert admin.schedule_pause("nightly") is True
    assert admin.schedule_pause("nightly") is False
    [rust] = cli("schedule", "list")
    assert rust["paused_ms"] == admin.schedule("nightly").paused_ms is not None
    assert admin.schedule_resume("nightly") is True
    assert cli("schedule", "list")[0]["paused_ms"] is None
    admin.schedule_remove("nightly")
    assert admin.schedules() == [] and cli("schedule", "list") == []
    with pytest.raises(UnknownSchedule, match='no schedule named "nightly"'):
        admin.schedule_remove("nightly")
