"""Shared set-up: each test gets its own redis-server on a free port (never the shared one)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, List

import pytest
import redis

from sluicegate import Worker

REPO = Path(__file__).resolve().parents[3]
CLI = REPO / "target" / "debug" / "sluicegate"
HERE = Path(__file__).resolve().parent


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
        self.port = free_port(bus)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}"
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, retry=None)
        deadline = time.monotonic() + 10
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} exited ({self.proc.returncode})")
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"redis-server on port {self.port} did not come up")
                    time.sleep(0.02)
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


@pytest.fixture
def cluster() -> Iterator[RedisClusterServers]:
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not on PATH")
    c = RedisClusterServers()
    yield c
    c.stop()


FAST = dict(lease=1.5, heartbeat=0.3, recovery_interval=0.3, census_interval=0.3, idle_poll=0.25)


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
