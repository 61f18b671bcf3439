"""Connecting to Redis, loading the Functions library, and calling it (docs/protocol.md §1).

Nothing else in the package sends FCALL: every call goes through :meth:`Conn.fcall`, which maps
the library's error codes to this package's errors and reloads the library once when it is
missing (a Redis restarted without persistence, a failover to a replica that never had it).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from importlib import resources
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union
from urllib.parse import urlparse

import redis
from redis.cluster import RedisCluster

from . import errors

LIBRARY_NAME = "sluicegate_v2"
MIN_REDIS: Tuple[int, int] = (7, 0)
#: Transport failures: the call may or may not have run.
TRANSIENT = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)

log = logging.getLogger("sluicegate")


def retry_transient(what: str, fn: Callable[[], Any], limit: float = 60.0) -> Any:
    """Repeats ``fn`` while Redis is unreachable (up to ``limit`` seconds)."""
    backoff = 0.05
    end = time.monotonic() + limit
    while True:
        try:
            return fn()
        except TRANSIENT as e:
            if time.monotonic() > end:
                raise
            log.debug("%s: %s; retrying", what, e)
            time.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

Client = Union["redis.Redis[bytes]", RedisCluster]


def library_source() -> str:
    """The library text, byte for byte lua/dist/sluicegate_v2.lua of the Rust build."""
    return resources.files(__package__).joinpath("sluicegate_v2.lua").read_bytes().decode("utf-8")


#: The library's revision, as the Rust build writes it at its end (Rust ``library_revision``).
_REVISION = re.compile(r"function_name='sg2_revision', callback=function\(\) return (\d+) end")


def library_revision(source: str) -> int:
    """The revision of library text ``source``: it grows with every change to the library."""
    m = _REVISION.search(source)
    return int(m.group(1)) if m else 0


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


def _is_full(e: redis.exceptions.ResponseError) -> bool:
    """An ``OOM`` refusal (redis-py takes the code off the message and raises its own class)."""
    return isinstance(e, redis.exceptions.OutOfMemoryError) or str(e).startswith("OOM")


def _refusal(e: redis.exceptions.ResponseError) -> Exception:
    msg = str(e)
    if _is_full(e):
        return errors.RedisFull(msg if msg.startswith("OOM") else f"OOM {msg}")
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

    def loaded_revision(self) -> Optional[int]:
        """The revision of the library loaded (the oldest of the primaries' on a Cluster), or None
        when one has none: no library, or one from before revisions (``sg2_revision``)."""
        nodes: List[Any] = list(self.client.get_primaries()) if isinstance(self.client, RedisCluster) else [None]
        oldest: Optional[int] = None
        for node in nodes:
            try:
                if node is None:
                    reply = self.client.execute_command("FCALL_RO", "sg2_revision", 0)
                else:
                    reply = self.client.execute_command("FCALL_RO", "sg2_revision", 0, target_nodes=node)
                revision = int(reply)
            except (redis.exceptions.ResponseError, ValueError, TypeError):
                return None
            oldest = revision if oldest is None else min(oldest, revision)
        return oldest

    def load_library(self, check: bool = True) -> None:
        """FUNCTION LOAD REPLACE on the server, or on every primary of a Cluster, unless the library
        loaded (on every primary) is of this copy's revision or a newer one: an older client that
        connects after a newer one keeps the newer library, and a connect does not make Redis
        compile it again (docs/operations.md, "Upgrades"; the Rust ``Store::load_library``).
        Without ``check`` (a call found the library missing) it loads without asking."""
        source = library_source()
        with self._load_lock:
            loaded = self.loaded_revision() if check else None
            if loaded is not None and loaded >= library_revision(source):
                return
            try:
                if isinstance(self.client, RedisCluster):
                    for node in self.client.get_primaries():
                        self.client.execute_command("FUNCTION LOAD", "REPLACE", source, target_nodes=node)
                else:
                    self.client.execute_command("FUNCTION LOAD", "REPLACE", source)
            except redis.exceptions.NoPermissionError:
                pass  # an ACL user without FUNCTION LOAD uses the library already loaded
            except redis.exceptions.ResponseError as e:
                # At maxmemory every write is refused, a library load too: reads, and the
                # read-only functions, still work with the library already there (the first write
                # says why).
                if "NOPERM" not in str(e) and not _is_full(e):
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
                    self.load_library(check=False)
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
