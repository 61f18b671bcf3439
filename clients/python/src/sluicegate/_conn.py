"""Connecting to Redis, loading the Functions library, and calling it (docs/protocol.md §1).

Nothing else in the package sends FCALL: every call goes through :meth:`Conn.fcall`, which maps
the library's error codes to this package's errors and reloads the library once when it is
missing (a Redis restarted without persistence, a failover to a replica that never had it).
"""

from __future__ import annotations

import threading
from importlib import resources
from typing import Any, List, Optional, Sequence, Tuple, Union
from urllib.parse import urlparse

import redis
from redis.cluster import RedisCluster

from . import errors

LIBRARY_NAME = "sluicegate_v2"
MIN_REDIS: Tuple[int, int] = (7, 0)
#: Transport failures: the call may or may not have run.
TRANSIENT = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)

Client = Union["redis.Redis[bytes]", RedisCluster]


def library_source() -> str:
    """The library text, byte for byte lua/dist/sluicegate_v2.lua of the Rust build."""
    return resources.files(__package__).joinpath("sluicegate_v2.lua").read_bytes().decode("utf-8")


def text(v: Any) -> str:
    """A reply item as text."""
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if v is None:
        return ""
    return str(v)


def integer(v: Any, default: int = 0) -> int:
    if v is None:
        return default
    if isinstance(v, int):
        return v
    try:
        return int(text(v))
    except ValueError:
        return default


def version_at_least(version: str, needed: Tuple[int, int]) -> bool:
    parts = [int(p) if p.isdigit() else 0 for p in version.split(".")[:2]]
    while len(parts) < 2:
        parts.append(0)
    return (parts[0], parts[1]) >= needed


def check_version(info: dict) -> None:
    """Refuses a server older than 7.0 (an unparseable version too), as the Rust client does."""
    version = str(info.get("redis_version", "unknown"))
    if not version_at_least(version, MIN_REDIS):
        raise errors.UnsupportedRedis(version, "7.0")


def _refusal(e: redis.exceptions.ResponseError) -> Exception:
    msg = str(e)
    code = msg.split(" ", 1)[0]
    if code == "SGDUPLICATE":
        return errors.DuplicateRequestId(msg)
    if code == "SGINVALID":
        return errors.InvalidRequest(msg.split(" ", 1)[-1])
    if code == "SGLATE":
        return errors.Late(msg)
    return e


class Conn:
    """One client (a pool, thread-safe) of a single Redis or a Cluster, with the library loaded."""

    def __init__(self, url: str, *, socket_timeout: float = 10.0, load: bool = True) -> None:
        self.url = url
        self.cluster = url.startswith("redis-cluster://")
        self.socket_timeout = socket_timeout
        self.client: Client = self._new_client()
        self._load_lock = threading.Lock()
        self.check_version()
        if load:
            self.load_library()

    def _new_client(self) -> Client:
        if self.cluster:
            u = urlparse(self.url)
            return RedisCluster(
                host=u.hostname or "127.0.0.1",
                port=u.port or 6379,
                username=u.username,
                password=u.password,
                socket_timeout=self.socket_timeout,
                socket_connect_timeout=5,
                protocol=2,
            )
        return redis.Redis.from_url(
            self.url,
            socket_timeout=self.socket_timeout,
            socket_connect_timeout=5,
            health_check_interval=30,
            protocol=2,
        )

    def check_version(self) -> None:
        try:
            if self.cluster:
                infos = self.client.info("server", target_nodes=RedisCluster.PRIMARIES)
                for info in infos.values() if isinstance(infos, dict) and "redis_version" not in infos else [infos]:
                    check_version(info)
            else:
                check_version(self.client.info("server"))
        except TRANSIENT as e:
            raise errors.SluicegateError(f"cannot connect to {self.url}: {e}") from e

    def load_library(self) -> None:
        """FUNCTION LOAD REPLACE on the server, or on every primary of a Cluster."""
        source = library_source()
        with self._load_lock:
            try:
                if isinstance(self.client, RedisCluster):
                    for node in self.client.get_primaries():
                        self.client.execute_command("FUNCTION LOAD", "REPLACE", source, target_nodes=node)
                else:
                    self.client.execute_command("FUNCTION LOAD", "REPLACE", source)
            except redis.exceptions.NoPermissionError:
                pass  # an ACL user without FUNCTION LOAD uses the library already loaded
            except redis.exceptions.ResponseError as e:
                if "NOPERM" not in str(e):
                    raise

    def fcall(self, name: str, keys: Sequence[str], args: Sequence[Any], *, ro: bool = False) -> Any:
        """``FCALL sg2_<name>``; reloads the library and retries once when it is missing."""
        cmd = "FCALL_RO" if ro else "FCALL"
        for attempt in (0, 1):
            try:
                return self.client.execute_command(cmd, f"sg2_{name}", len(keys), *keys, *args)
            except redis.exceptions.ResponseError as e:
                msg = str(e)
                if attempt == 0 and ("Function not found" in msg or "NOSCRIPT" in msg):
                    self.load_library()
                    continue
                raise _refusal(e) from e
        raise errors.ProtocolError("unreachable")

    def pubsub(self) -> Any:
        return self.client.pubsub()

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass


def fcall_items(reply: Any) -> List[Any]:
    return list(reply) if isinstance(reply, (list, tuple)) else []


def maybe_text(v: Optional[bytes]) -> Optional[str]:
    return None if v is None else text(v)
