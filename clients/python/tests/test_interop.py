"""Interop with the Rust CLI (target/debug/sluicegate, built by `cargo build -p sluicegate-cli`):
a Python producer served by `sluicegate worker --exec`, and `sluicegate submit` served by a
Python worker. Skipped when the binary is missing."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator, List

import pytest

from sluicegate import Producer, Worker

from conftest import CLI, FAST

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
    import sys

    proc = subprocess.Popen(
        [str(CLI), "--redis", server.url, "--namespace", ns, "--lease", "1500ms", "--heartbeat", "300ms",
         "worker", "--exec", f"{sys.executable} {script}", "--slots", "3"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    yield proc
    proc.terminate()
    proc.wait(15)


def test_a_python_producer_is_served_by_the_rust_cli_worker(server: Any, ns: str, cli_worker: Any) -> None:
    p = Producer(server.url, ns)
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
        out = subprocess.run(
            [str(CLI), "--redis", server.url, "--namespace", ns, "--json", "submit", "--concurrency", "2", "--wait", str(src)],
            capture_output=True, text=True, timeout=60,
        )
        assert out.returncode == 0, out.stderr
        got = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
        sent = [{"n": 1}, "hello world", 42, "quoted", "", {"nested": {"a": [1, 2.5, None, True]}}]
        assert [g["index"] for g in got] == list(range(6))
        results = [g["ok"] for g in got]
        assert [r["got"] for r in results] == sent, got
        assert [r["index"] for r in results] == list(range(len(sent)))
    finally:
        w.stop()
        t.join(15)
