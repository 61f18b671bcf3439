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
from typing import Iterator, List

import pytest
import redis

REPO = Path(__file__).resolve().parents[3]
CLI = REPO / "target" / "debug" / "sluicegate"
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, extra: List[str] = ()) -> None:
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not on PATH (Debian: apt-get install -y redis-server)")
        self.dir = tempfile.mkdtemp(prefix="sg-py-redis-")
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}"
        client = redis.Redis(port=self.port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
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
            self.nodes.append(RedisServer(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"]))
        for n in self.nodes:
            # each node keeps its cluster config in its own dir (set with --dir)
            pass
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(["redis-cli", "--cluster", "create", *addrs, "--cluster-yes"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        c = redis.Redis(port=self.nodes[0].port)
        for _ in range(200):
            if c.cluster("info").get("cluster_state") == "ok":
                break
            time.sleep(0.05)
        c.close()
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


def python() -> str:
    return sys.executable
