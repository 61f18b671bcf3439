"""The key schema (docs/protocol.md §2-§3): the only place a key string is built."""

from __future__ import annotations

import os
import re
import time
from typing import Any, List, Optional, Tuple

from . import errors

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.")
_NAMESPACE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_DIGITS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_GROUP = re.compile(r"^[A-Za-z0-9._\-]{1,64}\Z")


def key_id(raw: str) -> str:
    """Percent-encodes every byte of the UTF-8 id except ``A-Z a-z 0-9 - _ .`` (uppercase hex)."""
    return "".join(chr(b) if b in _SAFE else "%%%02X" % b for b in raw.encode("utf-8"))


def reason_shown(why: Optional[str]) -> Optional[str]:
    """A terminal record's reason as users read it (Rust ``reason_shown``): ``upstream:<key id>``,
    as stored, names the upstream by its id."""
    if why is not None and why.startswith("upstream:"):
        try:
            return "upstream:" + raw_id(why[len("upstream:"):])
        except ValueError:
            return why
    return why


def raw_id(kid: str) -> str:
    """The raw id of a key id (percent-decoded); raises ValueError when it is not valid UTF-8."""
    out = bytearray()
    i = 0
    data = kid.encode("utf-8")
    while i < len(data):
        if data[i] == 0x25 and i + 2 < len(data) + 0 and _is_hex(data[i + 1 : i + 3]):
            out.append(int(data[i + 1 : i + 3], 16))
            i += 3
        else:
            out.append(data[i])
            i += 1
    return out.decode("utf-8")


def _is_hex(b: bytes) -> bool:
    return len(b) == 2 and all(c in b"0123456789abcdefABCDEF" for c in b)


def generate_id() -> str:
    """A time-ordered id: a UUIDv7's 128 bits as 22 base-62 digits, as the Rust client makes them."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    n = (ms & ((1 << 48) - 1)) << 80
    n |= 0x7 << 76  # version 7
    n |= ((rand >> 68) & 0xFFF) << 64  # rand_a, 12 bits
    n |= 0b10 << 62  # variant
    n |= rand & ((1 << 62) - 1)  # rand_b
    digits = []
    for _ in range(22):
        digits.append(_DIGITS[n % 62])
        n //= 62
    return "".join(reversed(digits))


def check_namespace(ns: str) -> str:
    if not _NAMESPACE.match(ns):
        raise ValueError(f"namespace {ns!r} must be 1 to 64 characters from A-Z a-z 0-9 _ . -")
    return ns


def lane_of(kid: str) -> Optional[Tuple[int, int]]:
    """The (shard, priority) of a lane's key id ``~<s>.<P>``, else None."""
    if not kid.startswith("~"):
        return None
    shard, dot, prio = kid[1:].partition(".")
    if not dot or not shard.isdigit() or not prio.isdigit() or int(prio) > 99:
        return None
    return int(shard), int(prio)


def lane_key_id(shard: int, priority: int) -> str:
    return f"~{shard}.{priority}"


def _fnv1a(text: str) -> int:
    """FNV-1a, 32 bit, of the UTF-8 bytes of ``text``."""
    h = 0x811C9DC5
    for b in text.encode("utf-8"):
        h ^= b
        h = (h * 0x01000193) & 0xFFFFFFFF
    return h


def home_shard(kid: str, shards: int) -> int:
    """FNV-1a-32 of the key id, modulo the request's token shards (§3.1)."""
    lane = lane_of(kid)
    if lane is not None:
        return lane[0]
    return _fnv1a(kid) % max(shards, 1)


def check_group(name: Any) -> str:
    """Checks a tenant group's name: 1 to 64 ASCII letters, digits, ``.``, ``_`` or ``-`` (Rust
    ``check_group``); raises :class:`InvalidRequest` in its words."""
    if not isinstance(name, str) or not _GROUP.match(name):
        raise errors.InvalidRequest(
            f"a group name is 1 to 64 ASCII letters, digits, '.', '_' or '-', not {_quoted(name)}"
        )
    return name


def _quoted(v: Any) -> str:
    if not isinstance(v, str):
        return repr(v)
    return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'


def group_shard(name: str, shards: int) -> int:
    """The shard of tenant group ``name`` among ``shards`` token shards: FNV-1a (32 bit) of the
    name, modulo ``shards`` (Rust ``group_shard``). Every token of a request in the group lives
    there."""
    return _fnv1a(name) % max(shards, 1)


def group_of_queue(list_key: str) -> Optional[str]:
    """The group name of a group queue key (``...:grp:<name>:p:<priority>``); None for any other
    key (Rust ``group_of_queue``)."""
    _, sep, rest = list_key.rpartition(":grp:")
    if not sep:
        return None
    name, sep, _ = rest.partition(":p:")
    return name if sep else None


def token_shard(kid: str, shards: int, k: int) -> int:
    lane = lane_of(kid)
    if lane is not None:
        return lane[0]
    shards = max(shards, 1)
    return (home_shard(kid, shards) + k) % shards


class RequestKeys:
    """The six keys of one request (or of a lane), in the order every function takes them."""

    __slots__ = ("meta", "stream", "results", "errors", "orphans", "retry")

    def __init__(self, base: str) -> None:
        self.meta = base
        self.stream = base + ":s"
        self.results = base + ":res"
        self.errors = base + ":err"
        self.orphans = base + ":orph"
        self.retry = base + ":retry"

    def all(self) -> List[str]:
        return [self.meta, self.stream, self.results, self.errors, self.orphans, self.retry]


class Keys:
    """Key names of one namespace."""

    def __init__(self, ns: str) -> None:
        self.ns = check_namespace(ns)

    def _shard(self, shard: int) -> str:
        return f"{self.ns}:{{{self.ns}.q{shard}}}:"

    def request(self, kid: str) -> RequestKeys:
        lane = lane_of(kid)
        if lane is not None:
            return RequestKeys(f"{self.lane_prefix(lane[0])}{lane[1]}")
        return RequestKeys(f"{self.ns}:r:{{{kid}}}")

    def list_prefix(self, shard: int) -> str:
        return self._shard(shard) + "p:"

    def token_list(self, shard: int, priority: int) -> str:
        return f"{self.list_prefix(shard)}{priority}"

    def priority_of_list(self, name: str) -> Optional[int]:
        prefix = f"{self.ns}:{{{self.ns}.q"
        if not name.startswith(prefix):
            return None
        _, sep, prio = name.rpartition(":p:")
        if not sep or not prio.isdigit() or int(prio) > 99:
            return None
        return int(prio)

    def group(self, shard: int, name: str) -> str:
        """The meta hash of tenant group ``name`` on ``shard``, its group's shard (prelude.lua,
        "Tenant groups"): its limit and its tokens."""
        return self._shard(shard) + "grp:" + name

    def group_queue(self, shard: int, name: str, priority: int) -> str:
        """The queue of group ``name``'s request token elements of ``priority``."""
        return f"{self.group(shard, name)}:p:{priority}"

    def group_work(self, shard: int, name: str) -> str:
        """Sorted set of the priorities whose queue of group ``name`` may hold elements."""
        return self.group(shard, name) + ":w"

    def group_limits(self, shard: int) -> str:
        """Hash of the group limits operators set for the groups of ``shard``: name -> limit."""
        return self._shard(shard) + "gconf"

    def groups(self, shard: int) -> str:
        """Set of the groups of ``shard`` that have a meta hash (recovery's audit scans it)."""
        return self._shard(shard) + "groups"

    def active(self, shard: int) -> str:
        return self._shard(shard) + "active"

    def armed(self, shard: int) -> str:
        return self._shard(shard) + "armed"

    def paused(self, shard: int) -> str:
        return self._shard(shard) + "paused"

    def index_rows(self, shard: int) -> str:
        """The listing index's rows of ``shard`` (key id -> ``<kind>|<priority>|<limit>|<tags>``);
        its sorted sets are named from the same prefix (:meth:`index_set`)."""
        return self._shard(shard) + "ix:row"

    def index_set(self, shard: int, name: str) -> str:
        """One set of the listing index of ``shard`` (``live``, ``completed``, ``t:<tag>``, ...)."""
        return self._shard(shard) + "ix:" + name

    def bell(self, shard: int) -> str:
        return self._shard(shard) + "bell"

    def held(self, shard: int) -> str:
        return self._shard(shard) + "held"

    def offers(self, shard: int) -> str:
        """Reserved slots' offers of hand-offs on ``shard`` (docs/protocol.md §5, "Hand-offs")."""
        return self._shard(shard) + "wait"

    def registrations(self, shard: int) -> str:
        return self._shard(shard) + "reg"

    def events(self, shard: int) -> str:
        return self._shard(shard) + "events"

    def finish_marks(self, shard: int, kid: str) -> str:
        return self._shard(shard) + "f:" + kid

    def downstreams(self, shard: int, kid: str) -> str:
        """The set of the downstreams of request ``kid`` (``<dkid>|<D's token shards>``), on its
        home ``shard`` (prelude.lua, "Dependencies between requests")."""
        return self._shard(shard) + "dn:" + kid

    def releases(self, shard: int) -> str:
        """The release outbox of the requests homed on ``shard``: key id of a finished request with
        downstreams -> when recovery should run its release (ms)."""
        return self._shard(shard) + "rel"

    def record_prefix(self, shard: int) -> str:
        return self._shard(shard) + "s:"

    def record(self, shard: int, kid: str) -> str:
        return self.record_prefix(shard) + kid

    def lane_prefix(self, shard: int) -> str:
        return self._shard(shard) + "lane:"

    def workers(self) -> str:
        return self._shard(0) + "workers"

    def worker_info(self) -> str:
        return self._shard(0) + "winfo"

    def reaping(self) -> str:
        return self._shard(0) + "reaping"

    def schedules(self) -> str:
        """The schedules (hash: name -> spec JSON), on shard 0."""
        return self._shard(0) + "sch"

    def schedules_due(self) -> str:
        """The schedules' due set (name -> ms when a worker should look at it), on shard 0."""
        return self._shard(0) + "sch:due"

    def schedules_gen(self) -> str:
        """The schedules' counter, from which every change takes its ``gen``, on shard 0."""
        return self._shard(0) + "sch:gen"

    def schedule_state(self, name: str) -> str:
        """One schedule's state (hash), on shard 0."""
        return self._shard(0) + "sch:s:" + name

    def up_channel(self, shard: int) -> str:
        return self._shard(shard) + "up"

    def done_channel(self) -> str:
        return f"{self.ns}:done"
