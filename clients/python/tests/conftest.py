"""Shared set-up: each test gets its own redis-server on a free port (never the shared one); the
tests on a 3-master cluster share one per test process (each test in its own namespace).

The suite runs in parallel (pytest-xdist, ``-n auto`` in pyproject.toml's addopts; ``-n 0`` runs
it in one process): its tests mostly wait (for workers, timers, rate limits), each on redis-servers
of its own, so more test processes than cores pay off (:func:`pytest_xdist_auto_num_workers`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, List, Optional

import pytest
import redis

from sluicegate import Worker

REPO = Path(__file__).resolve().parents[3]
CLI = REPO / "target" / "debug" / "sluicegate"
HERE = Path(__file__).resolve().parent


def cli(url: str, ns: str, *args: str, stdin: Optional[str] = None, quiet: bool = False) -> subprocess.CompletedProcess:
    """The Rust CLI (``target/debug/sluicegate``) on namespace ``ns`` of the Redis at ``url``, its
    output captured; ``quiet`` turns its logs off (``RUST_LOG=off``)."""
    env = {**os.environ, "RUST_LOG": "off"} if quiet else None
    return subprocess.run([str(CLI), "--redis", url, "--namespace", ns, *args], input=stdin, capture_output=True,
                          text=True, timeout=60, env=env)


def cli_json(url: str, ns: str, *args: str, stdin: Optional[str] = None, quiet: bool = False) -> List[Any]:
    """:func:`cli` with ``--json``, which must succeed: the lines it printed, parsed."""
    out = cli(url, ns, "--json", *args, stdin=stdin, quiet=quiet)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def cli_worker_process(url: str, ns: str, script: Path, slots: int) -> subprocess.Popen:
    """The Rust CLI's ``worker --exec`` running ``script`` with this Python, on ``slots`` slots (a
    lease of 1.5 s); its stderr piped, for a test that reads it on failure."""
    return subprocess.Popen(
        [str(CLI), "--redis", url, "--namespace", ns, "--lease", "1500ms", "--heartbeat", "300ms",
         "worker", "--exec", f"{sys.executable} {script}", "--slots", str(slots)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def free_port(bus: bool = False) -> int:
    """A free port; with ``bus``, one whose cluster bus port (port + 10000) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not bus:
            return port
        if port + 10000 < 65536:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                pass


class RedisServer:
    def __init__(self, extra: List[str] = (), bus: bool = False) -> None:
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not on PATH (Debian: apt-get install -y redis-server)")
        self.dir = tempfile.mkdtemp(prefix="sg-py-redis-")
        # A free port may be taken by another test process's server before this one binds it:
        # then this one exits, or (while it has not yet) the ping answers from the other one,
        # which INFO's process_id tells. Another port then.
        for _ in range(5):
            self.port = free_port(bus)
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", self.dir, *extra],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            self.url = f"redis://127.0.0.1:{self.port}"
            if self._up():
                return
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
        raise RuntimeError("no redis-server came up on a free port in 5 tries")

    def _up(self) -> bool:
        """Waits for this server to answer: False when the port was another's."""
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, retry=None)
        deadline = time.monotonic() + 10
        try:
            while True:
                if self.proc.poll() is not None:
                    return False
                try:
                    return client.info("server")["process_id"] == self.proc.pid
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"redis-server on port {self.port} did not come up")
                    time.sleep(0.01)
        finally:
            client.close()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    s = RedisServer()
    yield s
    s.stop()


@pytest.fixture
def ns() -> str:
    return "t" + uuid.uuid4().hex[:8]


class RedisClusterServers:
    """A local 3-master cluster."""

    def __init__(self) -> None:
        self.nodes = []
        for _ in range(3):
            # (each node keeps its cluster config file in its own --dir)
            self.nodes.append(RedisServer(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"], bus=True))
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        try:
            subprocess.run(["redis-cli", "--cluster", "create", *addrs, "--cluster-yes"], check=True, timeout=30,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 15
            for n in self.nodes:
                c = redis.Redis(port=n.port)
                while c.cluster("info").get("cluster_state") != "ok":
                    if time.monotonic() > deadline:
                        raise RuntimeError("the cluster did not become ok")
                    time.sleep(0.05)
                c.close()
        except BaseException:
            self.stop()
            raise
        self.url = f"redis-cluster://127.0.0.1:{self.nodes[0].port}"

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


@pytest.fixture(scope="session")
def cluster() -> Iterator[RedisClusterServers]:
    """One cluster for the cluster tests of a test process (2 s to start): each works in a
    namespace of its own (``ns``), and stops its workers at its end."""
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not on PATH")
    c = RedisClusterServers()
    yield c
    c.stop()


def pytest_xdist_auto_num_workers(config: Any) -> int:
    """``-n auto``'s number of test processes: 4 whatever the cores (the tests mostly wait: the
    suite's CPU time is an eighth of its time in one process), or SLUICEGATE_PY_TEST_PROCESSES."""
    return int(os.environ.get("SLUICEGATE_PY_TEST_PROCESSES", "4"))


# (A short idle poll: an idle slot's BRPOP on the bell runs to its timeout, which a worker's stop,
# at each test's end, waits for.)
FAST = dict(lease=1.5, heartbeat=0.3, recovery_interval=0.3, census_interval=0.3, idle_poll=0.1)


class Running:
    """Workers started by a test, stopped (gracefully) at its end."""

    def __init__(self) -> None:
        self.workers: List[Any] = []

    def start(self, url: str, handler: Any, ns: str, slots: int = 4, **kw: Any) -> Worker:
        w = Worker(url, handler, slots=slots, namespace=ns, **{**FAST, **kw})
        t = w.start()
        assert w.ready.wait(10), "worker did not start"
        self.workers.append((w, t))
        return w

    def stop(self) -> None:
        for w, _ in self.workers:
            w.stop()
        for _, t in self.workers:
            t.join(15)


@pytest.fixture
def running() -> Iterator[Running]:
    r = Running()
    yield r
    r.stop()


def python() -> str:
    return sys.executable
