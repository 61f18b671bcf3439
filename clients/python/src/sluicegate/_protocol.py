"""The steps producers, workers and recovery share (docs/protocol.md §5-§6): pushing token
elements, arming looks, the steps after a finish, reclaiming a token. One typed function per
library call; nothing outside this module and ``_conn`` packs FCALL arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import redis

from . import errors
from ._conn import Conn, fcall_items, integer, text
from ._keys import Keys, home_shard, raw_id, token_shard

#: The most token shards a configuration may name (a pause is written on each of them).
MAX_TOKEN_SHARDS = 1024

T = TypeVar("T")

#: How many times an armed step refused as late (SGLATE) is armed and sent again.
LATE_STEPS = 5


@dataclass
class Settings:
    """Timings in seconds; the defaults are the Rust client's (src/config.rs)."""

    namespace: str = "sluicegate"
    lease: float = 2.0
    heartbeat: float = 0.5
    retention: float = 24 * 3600.0
    loading_ttl: float = 3600.0
    recovery_interval: float = 0.2
    census_interval: float = 60.0
    wait_poll: float = 2.0
    lane_tokens: int = 64
    token_shards: int = 1

    @property
    def grace(self) -> float:
        return 2 * self.lease


def ms(seconds: float) -> int:
    return int(round(seconds * 1000))


@dataclass
class Finished:
    """``['finished', state, lifecycle, sweep...]``: the lifecycle is passed back as received.
    ``acquire``'s finish at a request's deadline ends with ``['shards', S]``: the request's token
    shards (``shards``), since its slot has no policy of the request yet (Rust ``Finished``)."""

    state: str
    lifecycle: bytes
    sweep: List[Any] = field(default_factory=list)
    shards: Optional[int] = None

    @staticmethod
    def parse(items: Sequence[Any]) -> "Finished":
        lifecycle = items[1] if len(items) > 1 else b"0"
        if isinstance(lifecycle, int):
            lifecycle = str(lifecycle).encode()
        sweep = list(items[2:])
        shards = None
        # Sweep elements are strings: a trailing array is the request's shard count.
        last = sweep[-1] if sweep else None
        if isinstance(last, (list, tuple)) and last and text(last[0]) == "shards":
            sweep.pop()
            shards = max(1, min(MAX_TOKEN_SHARDS, integer(last[1], 1) if len(last) > 1 else 1))
        return Finished(text(items[0]) if items else "", lifecycle, sweep, shards)


@dataclass
class Unfinished:
    """``['finished', state, prio, shards, lifecycle, sealed]`` of census and reclaim."""

    state: str
    priority: int
    shards: int
    lifecycle: bytes
    sealed: bool

    @staticmethod
    def parse(items: Sequence[Any]) -> "Unfinished":
        get = lambda i: items[i] if len(items) > i else None  # noqa: E731
        lifecycle = get(3)
        if isinstance(lifecycle, int):
            lifecycle = str(lifecycle).encode()
        return Unfinished(
            text(get(0)),
            integer(get(1)),
            max(1, min(1024, integer(get(2), 1))),
            lifecycle if lifecycle is not None else b"0",
            integer(get(4)) == 1,
        )


@dataclass
class Requeued:
    """What ``requeue_dead`` answers: ``n`` = -1 (``FinishFirst``: run §6.3 for ``lifecycle``,
    then call again), -2 (``ReopenFirst``: ``reopen`` as ``lifecycle``, then call again with it),
    else how many dead letters were requeued, with the token elements to push."""

    n: int
    lifecycle: int
    elements: List[Any] = field(default_factory=list)


@dataclass
class Reprioritize:
    """What ``reprioritize`` answers: ``tag`` ``moved`` (the request has the new priority; ``old``
    is the one before, ``shards`` its token shards, ``elements`` those of its tokens queued now, to
    move from ``old``'s lists with ``relist``), ``refused`` (``state``: finished, or still loading)
    or ``unknown`` (no request with keys of its own has the id; a lane request may)."""

    tag: str
    old: int = 0
    shards: int = 1
    elements: List[Any] = field(default_factory=list)
    state: str = ""


@dataclass
class LaneSettings:
    """A lane request's settings as its record stores them (``pol``, prelude.lua "Lanes"):
    ``[f]<priority>,<limit>,<parts>,<max attempts>,<timeout ms>,<backoff base ms>,<backoff cap ms>``,
    trailing fields at their defaults (1, 0, 1000, 60000) left out (Rust ``lane::Settings``)."""

    NAMES = ("prio", "limit", "total", "maxatt", "timeout", "bbase", "bmax")
    DEFAULTS = (1, 0, 1000, 60_000)

    values: Tuple[int, ...]
    fail_fast: bool

    @staticmethod
    def parse(pol: str) -> "LaneSettings":
        bad = errors.ProtocolError(f"a lane request's settings are malformed: {quoted(pol)}")
        fail_fast, rest = (True, pol[1:]) if pol.startswith("f") else (False, pol)
        given = rest.split(",")
        if not all(v.isascii() and v.isdigit() for v in given) or not 3 <= len(given) <= 7:
            raise bad
        values = [int(v) for v in given] + list(LaneSettings.DEFAULTS[len(given) - 3 :])
        return LaneSettings(tuple(values), fail_fast)


def record_meta(record: Dict[str, bytes]) -> Dict[str, str]:
    """The scalar fields of a lane request's record under the names a meta hash gives them
    (``prio``, ``limit``, ``total``, ``created``, ``gen``, ...; Rust ``lane::record_meta``): its
    settings unpacked from ``pol``, its creation time and generation from ``lc``, its per-part
    fields (``o<i>``, ``e<i>``, ``x<i>``, ``w<i>``) left out."""

    def per_part(k: str) -> bool:
        return len(k) > 1 and k[0] in "oexw" and k[1:].isascii() and k[1:].isdigit()

    meta = {k: text(v) for k, v in record.items() if not per_part(k)}
    pol = meta.pop("pol", None)
    if pol is not None:
        try:
            settings: Optional[LaneSettings] = LaneSettings.parse(pol)
        except errors.ProtocolError:
            settings = None
        if settings is not None:
            meta.update(zip(LaneSettings.NAMES, (str(v) for v in settings.values)))
            meta["failfast"] = "1" if settings.fail_fast else "0"
    lc = meta.get("lc", "")
    if lc.isascii() and lc.isdigit():
        meta["created"] = str(int(lc) // 1000)
        meta["gen"] = str(int(lc) % 1000)
    meta.setdefault("failed", "0")
    return meta


def quoted(s: str) -> str:
    """``s`` in double quotes, as Rust's ``{:?}`` of a string shows it in messages."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def refused_state(e: BaseException) -> bool:
    """Whether ``e`` is the library's ``SGSTATE`` refusal."""
    return isinstance(e, redis.exceptions.ResponseError) and str(e).split(" ", 1)[0] == "SGSTATE"


def refusal_why(e: BaseException) -> str:
    """The library's words after the code of a refusal ``SG<CODE> <why>``."""
    return str(e).partition(" ")[2]


def _priority_item(item: Any) -> int:
    """A priority a function answered (Rust ``priority_item``)."""
    p = integer(item)
    if not 0 <= p <= 255:
        raise errors.ProtocolError(f"priority {p} out of range")
    if p > 99:
        raise errors.ProtocolError(f"priority {p} is out of range: use 0 (lowest) to 99 (highest)")
    return p


def element_token(element: Any) -> int:
    parts = text(element).split("|")
    if len(parts) == 3 and parts[1].isdigit():
        return int(parts[1])
    return 0


def by_shard(kid: str, shards: int, elements: Sequence[Any]) -> Dict[int, List[Any]]:
    out: Dict[int, List[Any]] = {}
    for e in elements:
        out.setdefault(token_shard(kid, shards, element_token(e)), []).append(e)
    return out


class Protocol:
    """A connection, the namespace's keys and the settings: what every call needs."""

    def __init__(self, conn: Conn, settings: Settings) -> None:
        self.conn = conn
        self.settings = settings
        self.keys = Keys(settings.namespace)

    def lane_home(self, kid: str) -> int:
        """The shard holding lane request ``kid``'s record, looked up by id (Rust
        ``shards::lane_home_found``): this client's home for it when its record is there;
        otherwise the home another shard count (1 to 1,024) gives it, where its record is, since
        the request may have been submitted with another count; this client's home when no record
        is found (unknown, or expired)."""
        own = home_shard(kid, self.settings.token_shards)
        client = self.conn.client
        if client.exists(self.keys.record(own, kid)):
            return own
        candidates = sorted({home_shard(kid, s) for s in range(1, MAX_TOKEN_SHARDS + 1)} - {own})
        pipe = client.pipeline(transaction=False)
        for shard in candidates:
            pipe.exists(self.keys.record(shard, kid))
        for shard, n in zip(candidates, pipe.execute()):
            if n:
                return shard
        return own

    # ----- index and token lists -----

    def register(self, kid: str, shards: int, row: str) -> Tuple[int, int]:
        """``register``: returns (Redis time of the registration, the score it wrote)."""
        home = home_shard(kid, shards)
        k = self.keys
        grace = ms(self.settings.grace)
        reply = fcall_items(
            self.conn.fcall("register", [k.active(home), k.registrations(home), k.record(home, kid)], [kid, grace, row])
        )
        at = integer(reply[1]) if len(reply) > 1 else 0
        return at, at + grace

    def push(self, kid: str, priority: int, shards: int, elements: Sequence[Any], next_s: float, first: Optional[int] = None) -> None:
        """Queues elements: the home shard's through ``push`` with the index keys (made even with
        no element: it sets the next look), the other shards' through ``push`` without."""
        home = home_shard(kid, shards)
        groups = by_shard(kid, shards, elements)
        k = self.keys
        mode = f"first:{first}" if first is not None else "more"
        self.conn.fcall(
            "push",
            [k.token_list(home, priority), k.bell(home), k.active(home), k.registrations(home)],
            [kid, ms(next_s), mode, *groups.pop(home, [])],
        )
        for shard, group in groups.items():
            if group:
                self.push_plain(kid, shard, k.token_list(shard, priority), group)

    def push_plain(self, kid: str, shard: int, list_key: str, elements: Sequence[Any]) -> None:
        self.conn.fcall("push", [list_key, self.keys.bell(shard)], [kid, 0, "more", *elements])

    def arm(self, kid: str, shards: int, within_s: float, *, claim: Optional[int] = None, census: bool = False, step: bool = False) -> int:
        """``arm``: returns when the look is due (Redis ms), 0 when the request is not indexed."""
        home = home_shard(kid, shards)
        args: List[Any] = [kid, ms(within_s)]
        if step:
            args += ["", "step"]
        elif census:
            args.append("" if claim is None else claim)
        return integer(self.conn.fcall("arm", [self.keys.active(home), self.keys.armed(home)], args))

    def armed(self, kid: str, shards: int, step: Callable[[int], T]) -> T:
        """Runs ``step(deadline)`` after arming a look a grace later; re-arms on SGLATE."""
        grace = ms(self.settings.grace)
        for _ in range(LATE_STEPS):
            due = self.arm(kid, shards, self.settings.grace, step=True)
            deadline = due - grace // 2 if due > 0 else 0
            try:
                return step(deadline)
            except errors.Late:
                continue
        raise errors.ProtocolError(
            f'a step on request "{kid}" ran past its deadline {LATE_STEPS} times in a row: Redis is overloaded, '
            "or the clock of the request's master is ahead of its home shard's by more than half a grace"
        )

    def placement(self, kid: str) -> Optional[Tuple[int, int]]:
        """(priority, shards) from the meta hash, None when unknown."""
        prio, shards = self.conn.client.hmget(self.keys.request(kid).meta, ["prio", "shards"])
        if prio is None:
            return None
        return integer(prio), max(1, integer(shards, 1))

    # ----- the steps after a finish (§6.3) -----

    def finish(self, kid: str, priority: int, shards: int, finished: Finished) -> Optional[int]:
        k = self.keys
        home = home_shard(kid, shards)
        groups = by_shard(kid, shards, finished.sweep)
        home_sweep = groups.pop(home, [])
        for shard, group in groups.items():
            if group:
                self.conn.fcall("sweep", [k.token_list(shard, priority), k.bell(shard)], group)
        self.conn.fcall(
            "finish_index",
            [k.active(home), k.events(home), k.token_list(home, priority), k.finish_marks(home, kid), k.bell(home)],
            [kid, finished.state, ms(self.settings.retention), finished.lifecycle, *home_sweep],
        )
        return self.seal_and_unindex(kid, home, finished.lifecycle)

    def seal_and_unindex(self, kid: str, home: int, lifecycle: bytes) -> Optional[int]:
        k = self.keys
        retention = ms(self.settings.retention)
        if integer(self.conn.fcall("seal", k.request(kid).all(), [lifecycle, retention])) != 1:
            return None
        unindexed = integer(
            self.conn.fcall(
                "unindex",
                [k.active(home), k.finish_marks(home, kid), k.registrations(home), k.armed(home)],
                [kid, lifecycle, retention],
            )
        )
        return unindexed if unindexed > 1 else None

    def finish_reported(self, kid: str, u: Unfinished) -> None:
        """Completes the steps after a finish of a request found terminal but still indexed."""
        if u.sealed:
            reopened = self.seal_and_unindex(kid, home_shard(kid, u.shards), u.lifecycle)
        else:
            reopened = self.finish(kid, u.priority, u.shards, Finished(u.state, u.lifecycle, []))
        if reopened is not None:
            self.resume_requeue(kid, u.priority, u.shards, reopened)

    def resume_requeue(self, kid: str, priority: int, shards: int, lifecycle: int) -> None:
        requeued = self.requeue_dead(kid, shards, str(lifecycle), resume=True)
        if requeued.n >= 0 and requeued.elements:
            self.push(kid, priority, shards, requeued.elements, self.settings.grace)

    # ----- operators (§5 "Operators", §6.12) -----

    def requeue_dead(self, kid: str, shards: int, reopen_as: str, *, resume: bool = False) -> Requeued:
        """One ``requeue_dead`` call, armed: ``reopen_as`` is the lifecycle a failed request reopens
        as ('' until ``reopen`` marked one), ``resume`` recovery's completion of a requeue whose
        caller died after that mark. ``SGSTATE`` (not failed, running or queued) is
        :class:`errors.NoDeadLetters`, or :class:`errors.Refused` for a request that ended at its
        deadline (Rust ``operators::requeue_dead``)."""
        keys = self.keys.request(kid).all()

        def step(deadline: int) -> Any:
            args: List[Any] = [kid, reopen_as, deadline]
            if resume:
                args.append("resume")
            try:
                return self.conn.fcall("requeue_dead", keys, args)
            except redis.exceptions.ResponseError as e:
                if refused_state(e) and "deadline" in refusal_why(e):
                    raise errors.Refused(
                        f'request "{raw_id(kid)}" ended at its deadline, which has passed for good: '
                        "submit it again instead"
                    ) from e
                if refused_state(e):
                    raise errors.NoDeadLetters(raw_id(kid)) from e
                raise

        items = fcall_items(self.armed(kid, shards, step))
        n = integer(items[0]) if items else 0
        lifecycle = integer(items[1]) if len(items) > 1 else 0
        return Requeued(n, lifecycle, items[2:] if n >= 0 else [])

    def reopen(self, kid: str, shards: int, lifecycle: int) -> bool:
        """``reopen`` on the home shard, before requeue reopens a failed request as ``lifecycle``:
        indexes it again (first looked at a grace from now) and marks that lifecycle."""
        home = home_shard(kid, shards)
        k = self.keys
        reply = self.conn.fcall(
            "reopen", [k.active(home), k.registrations(home), k.finish_marks(home, kid)],
            [kid, ms(self.settings.grace), lifecycle],
        )
        return integer(reply) == 1

    def reprioritize(self, kid: str, priority: int) -> Reprioritize:
        """``reprioritize``: gives request ``kid`` priority ``priority`` (in its meta hash)."""
        items = fcall_items(self.conn.fcall("reprioritize", self.keys.request(kid).all(), [kid, priority]))
        tag = text(items[0]) if items else ""
        if tag == "moved":
            old = items[1] if len(items) > 1 else None
            shards = max(1, min(1024, integer(items[2], 1))) if len(items) > 2 else 1
            return Reprioritize(tag, priority if old is None else _priority_item(old), shards, items[3:])
        if tag == "refused":
            return Reprioritize(tag, state=text(items[1]) if len(items) > 1 else "")
        if tag == "unknown":
            return Reprioritize(tag)
        raise errors.ProtocolError(f"unexpected reprioritize reply {quoted(tag)}")

    def relist(self, shard: int, old: int, new: int, elements: Sequence[Any]) -> int:
        """``relist`` on ``shard``: moves ``elements`` from the list of priority ``old`` to the list
        of ``new``, each to its place by epoch; those not found near either end of the old list, or
        with no place near the head of the new one, stay. Returns how many moved."""
        k = self.keys
        moved = integer(self.conn.fcall("relist", [k.token_list(shard, old), k.token_list(shard, new)], elements))
        return max(0, moved)

    # ----- the listing index (§5 "Listing") -----

    def track(self, shard: int, kid: str, on: bool) -> bool:
        """``track`` on ``shard``: marks (or unmarks) ``kid`` as tracked. False when it is not
        listed."""
        return integer(self.conn.fcall("track", [self.keys.index_rows(shard)], [kid, "1" if on else "0"])) == 1

    def relabel(self, shard: int, kid: str, priority: int) -> bool:
        """``relabel`` on ``shard``: the listed row of ``kid`` takes ``priority``. False when it is
        not listed."""
        return integer(self.conn.fcall("relabel", [self.keys.index_rows(shard)], [kid, priority])) == 1

    def purge(self, keys: Sequence[str]) -> bool:
        """``purge`` on the request's slot: deletes ``keys`` (the first holds its ``state``) if it
        finished. False when there was nothing; :class:`errors.Refused` (the library's words) when
        it has not finished."""
        try:
            return integer(self.conn.fcall("purge", keys, [])) == 1
        except redis.exceptions.ResponseError as e:
            if refused_state(e):
                raise errors.Refused(refusal_why(e)) from e
            raise

    def unlist(self, shard: int, kid: str) -> bool:
        """``unlist`` on ``shard``: the request leaves the index and its finish marks go. False
        when it was not listed; :class:`errors.Refused` while it is still in recovery's index."""
        k = self.keys
        try:
            reply = self.conn.fcall(
                "unlist", [k.index_rows(shard), k.active(shard), k.finish_marks(shard, kid), k.record(shard, kid)], [kid]
            )
        except redis.exceptions.ResponseError as e:
            if refused_state(e):
                raise errors.Refused(refusal_why(e)) from e
            raise
        return integer(reply) == 1

    # ----- tokens -----

    def give_back(self, shard: int, list_key: str, holder: str, take: str, elements: Sequence[Any]) -> None:
        self.conn.fcall("give_back", [self.keys.held(shard), self.keys.bell(shard), list_key], [holder, take, *elements])

    def release(self, shard: int, holder: str, take: str) -> None:
        self.conn.fcall("release", [self.keys.held(shard)], [holder, take])

    def reclaim(self, kid: str, k: int, epoch: str, holder: str, deadline: Optional[int]) -> Tuple[str, List[Any]]:
        """``reclaim``: (tag, rest of the reply)."""
        args: List[Any] = [kid, k, epoch, holder]
        if deadline is not None:
            args.append(deadline)
        items = fcall_items(self.conn.fcall("reclaim", self.keys.request(kid).all(), args))
        tag = text(items[0]) if items else "none"
        return tag, items[1:]
