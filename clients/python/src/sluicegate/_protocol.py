"""The steps producers, workers and recovery share (docs/protocol.md §5-§6): pushing token
elements, arming looks, the steps after a finish, reclaiming a token. One typed function per
library call; nothing outside this module and ``_conn`` packs FCALL arguments."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import redis

from . import errors
from ._conn import Conn, fcall_items, integer, text
from ._keys import Keys, group_of_queue, group_shard, home_shard, key_id, raw_id, token_shard

log = logging.getLogger("sluicegate.protocol")

#: The most token shards a configuration may name (a pause is written on each of them).
MAX_TOKEN_SHARDS = 1024
#: The priority of a request whose meta is gone by the time a step needs it (Rust
#: ``Priority::default()``).
DEFAULT_PRIORITY = 50
#: How deep a cascade of finishes (a downstream failed by its upstream, then its own downstreams,
#: ...) a finisher follows itself; deeper hops are left to recovery's next claim of the outbox
#: (src/shards/dag.rs ``INLINE_DEPTH``).
INLINE_DEPTH = 16
#: Downstreams one ``SSCAN`` of an upstream's set asks for.
DOWNSTREAMS_PAGE = 100

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
    #: How often a windowed request's ``add`` asks whether its parts fit (Rust
    #: ``Config::window_poll``).
    window_poll: float = 0.05
    lane_tokens: int = 64
    token_shards: int = 1
    #: Tests only: a finish whose request has downstreams leaves their release to recovery (the
    #: outbox), as if its finisher died right after it (Rust ``Config::test_no_inline_release``).
    inline_releases: bool = True

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


@dataclass(frozen=True)
class Placement:
    """Where a request's tokens and index entry live (Rust ``shards::Placement``): its priority,
    its token shards, and its tenant group, if any. A grouped request's tokens all live on the
    group's shard and their elements wait in the group's queue of the priority, instead of the
    shard's priority list; its home shard (index, events) is the key id's, as for any request."""

    priority: int
    shards: int
    group: Optional[str] = None

    def token_shard(self, kid: str, k: int) -> int:
        """The shard token ``k`` of request ``kid`` lives on."""
        if self.group is not None:
            return group_shard(self.group, self.shards)
        return token_shard(kid, self.shards, k)

    def list_at(self, keys: Keys, shard: int, priority: int) -> str:
        """The list the request's token elements wait in on ``shard`` at ``priority``: the shard's
        list of that priority, or its group's queue."""
        if self.group is not None:
            return keys.group_queue(shard, self.group, priority)
        return keys.token_list(shard, priority)

    def list(self, keys: Keys, shard: int) -> str:
        """:meth:`list_at` the request's priority."""
        return self.list_at(keys, shard, self.priority)


def group_item(item: Any) -> Optional[str]:
    """The tenant group a reply names ('' or absent: none; Rust ``group_of``)."""
    if item is None:
        return None
    g = text(item)
    return g or None


@dataclass
class Unfinished:
    """``['finished', state, prio, shards, lifecycle, sealed, group]`` of census and reclaim."""

    state: str
    priority: int
    shards: int
    lifecycle: bytes
    sealed: bool
    group: Optional[str] = None

    @property
    def place(self) -> Placement:
        return Placement(self.priority, self.shards, self.group)

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
            group_item(get(5)),
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
class Ended:
    """An upstream's lifecycle that ended (Rust ``dag::Ended``): its lifecycle (created ms * 1000 +
    gen) and its terminal state (completed, failed, cancelled; or ``gone``, lifecycle 0, for one
    of which nothing was left)."""

    lifecycle: int
    state: str


#: What a release tells the downstreams of an upstream of which nothing is left.
GONE = Ended(0, "gone")


@dataclass
class Link:
    """Where an upstream stands, as ``dag_link`` (or a read of its home shard) finds it (Rust
    ``dag::Link``): ``tag`` ``live`` (not ended; ``lifecycle``: a lane request's, None for a
    request of its own stream, whose meta says), ``done`` (its latest lifecycle ended, ``ended``)
    or ``unknown``."""

    tag: str
    lifecycle: Optional[int] = None
    ended: Optional[Ended] = None


def _opt_int(v: Any) -> Optional[int]:
    """A reply item or field as an int, None when absent or not one ('' included)."""
    if v is None:
        return None
    if isinstance(v, int):
        return v
    t = text(v)
    return int(t) if t.lstrip("-").isdigit() else None


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


def running_marks(conn: Any, keys: Any, records: Sequence[Tuple[int, str, Dict[str, str]]]) -> List[Optional[str]]:
    """The running marks of lane requests of one part handed out without their records (their
    records say ``queued`` until their batch's ack; protocol.md §5, "Lanes"; Rust
    ``lane::running_marks``): for each (shard, key id, :func:`record_meta`) whose state is
    ``queued``, the ms its part was handed out at, if a token of its lane names it and its lifecycle
    in its marks (``m<k>`` = ``<ms>|<kid>|<lc>,...`` in the lane's meta). One read of each lane's meta."""
    out: List[Optional[str]] = [None] * len(records)
    lanes: Dict[str, Dict[str, str]] = {}
    for i, (shard, kid, meta) in enumerate(records):
        if meta.get("state") != "queued":
            continue
        lane = f"{keys.lane_prefix(shard)}{meta.get('prio', '')}"
        if lane not in lanes:
            lanes[lane] = marks_of({text(k): text(v) for k, v in conn.client.hgetall(lane).items()})
        out[i] = lanes[lane].get(f"{kid}|{meta.get('lc', '')}")
    return out


def marks_of(lane_meta: Dict[str, str]) -> Dict[str, str]:
    """The running marks a lane's meta holds (its fields ``m<k>``), by ``<kid>|<lc>``: the hand-out ms."""
    out: Dict[str, str] = {}
    for field, value in lane_meta.items():
        if len(field) > 1 and field[0] == "m" and field[1:].isascii() and field[1:].isdigit() and "|" in value:
            since, kids = value.split("|", 1)
            for kid in kids.split(","):
                if kid:
                    out[kid] = since
    return out


def mark_running(meta: Dict[str, str], since: Optional[str]) -> None:
    """A lane record read by :func:`record_meta` with its running mark (:func:`running_marks`):
    ``running`` since the mark's ms."""
    if since is not None:
        meta["state"] = "running"
        meta["started"] = since


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
    # A discarding record counts its discarded results in ``discard``, as a meta hash does in
    # ``discarded`` beside its flag.
    if "discard" in meta:
        meta["discarded"] = meta["discard"]
        meta["discard"] = "1"
    lc = meta.get("lc", "")
    if lc.isascii() and lc.isdigit():
        meta["created"] = str(int(lc) // 1000)
    # How many requeues reopened it is its own field (the lifecycle's last three digits are not).
    meta.setdefault("gen", "0")
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


def by_shard(kid: str, place: Placement, elements: Sequence[Any]) -> Dict[int, List[Any]]:
    """Elements grouped by the shard their token lives on."""
    out: Dict[int, List[Any]] = {}
    for e in elements:
        out.setdefault(place.token_shard(kid, element_token(e)), []).append(e)
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

    def push(self, kid: str, place: Placement, elements: Sequence[Any], next_s: float, first: Optional[int] = None) -> None:
        """Queues elements: the home shard's through ``push`` with the index keys (made even with
        no element: it sets the next look), the other shards' through ``push`` without. Each
        shard's elements go to ``place``'s list there (a grouped request's, to its group's queue)."""
        home = home_shard(kid, place.shards)
        by = by_shard(kid, place, elements)
        k = self.keys
        mode = f"first:{first}" if first is not None else "more"
        self.conn.fcall(
            "push",
            [place.list(k, home), k.bell(home), k.active(home), k.registrations(home)],
            [kid, ms(next_s), mode, *by.pop(home, [])],
        )
        for shard, some in by.items():
            if some:
                self.push_plain(kid, shard, place.list(k, shard), some)

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

    def placement(self, kid: str) -> Optional[Placement]:
        """The request's priority, token shards and group, from its meta hash; None when unknown."""
        prio, shards, grp = self.conn.client.hmget(self.keys.request(kid).meta, ["prio", "shards", "grp"])
        if prio is None:
            return None
        return Placement(integer(prio), max(1, integer(shards, 1)), group_item(grp))

    # ----- the steps after a finish (§6.3) -----

    def finish(self, kid: str, place: Placement, finished: Finished, depth: int = 0) -> Optional[int]:
        """The steps after request ``kid`` turned terminal, each repeatable (Rust
        ``shards::finish``): stale elements swept and the lifecycle's one event (``finish_index``);
        when that answered that the request has downstreams (2: its release is owed, in the
        outbox), their release (:meth:`release_owed`) of the lifecycle and state it knows ended
        (first: their wait is the latency users see); then ``seal`` and ``unindex`` (the request
        stays indexed meanwhile). ``depth``: how many finishes of a cascade this one follows.
        Returns the lifecycle a requeue marked (``reopen``) when the request stays indexed for
        it."""
        k = self.keys
        home = home_shard(kid, place.shards)
        by = by_shard(kid, place, finished.sweep)
        home_sweep = by.pop(home, [])
        for shard, some in by.items():
            if some:
                self.conn.fcall("sweep", [place.list(k, shard), k.bell(shard)], some)
        indexed = integer(
            self.conn.fcall(
                "finish_index",
                [k.active(home), k.events(home), place.list(k, home), k.finish_marks(home, kid), k.bell(home)],
                [kid, finished.state, ms(self.settings.retention), finished.lifecycle, *home_sweep],
            )
        )
        if indexed == 2:
            ended = Ended(integer(finished.lifecycle), finished.state)
            self.release_owed(home, kid, depth, ended)
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
            reopened = self.finish(kid, u.place, Finished(u.state, u.lifecycle, []))
        if reopened is not None:
            self.resume_requeue(kid, u.place, reopened)

    def resume_requeue(self, kid: str, place: Placement, lifecycle: int) -> None:
        requeued = self.requeue_dead(kid, place.shards, str(lifecycle), resume=True)
        if requeued.n >= 0 and requeued.elements:
            self.push(kid, place, requeued.elements, self.settings.grace)

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

    def requeue(self, kid: str, place: Placement) -> int:
        """Hands the dead letters of request ``kid`` (of its own stream) out again; a failed one
        reopens (also a downstream its upstream had failed, once its gate is open again). A failed
        request is reopened only after its own lifecycle is announced and sealed, and after
        ``reopen`` indexed it again and marked the new lifecycle: ``requeue_dead`` says which step
        is missing, in that order (Rust ``shards::requeue``). Returns how many dead letters were
        requeued."""
        reopen_as = ""
        for _ in range(4):
            requeued = self.requeue_dead(kid, place.shards, reopen_as)
            if requeued.n == -1:
                # A failure whose steps after the finish are not done: announce it first, so that
                # its lifecycle keeps its one event.
                self.finish(kid, place, Finished("failed", str(requeued.lifecycle).encode(), []))
            elif requeued.n == -2:
                self.reopen(kid, place.shards, requeued.lifecycle)
                reopen_as = str(requeued.lifecycle)
            else:
                if requeued.elements:
                    self.push(kid, place, requeued.elements, self.settings.grace)
                return max(0, requeued.n)
        raise errors.ProtocolError(f'request "{raw_id(kid)}" kept changing while it was being requeued; try again')

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

    def purge(self, keys: Sequence[str], args: Sequence[Any] = ()) -> bool:
        """``purge`` on the request's slot: deletes ``keys`` (the first holds its ``state``) if it
        finished. With ``args`` ``[key id]`` (a lane request), the last key is its home shard's
        release outbox, and a release still owed refuses it. False when there was nothing;
        :class:`errors.Refused` (the library's words) when it has not finished."""
        try:
            return integer(self.conn.fcall("purge", keys, list(args))) == 1
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

    # ----- dependencies between requests (prelude.lua, "Dependencies between requests") -----

    def dag_link(self, home: int, ukid: str, entry: str, lifecycle: Optional[int] = None) -> Link:
        """``dag_link``: downstream ``entry`` (``<dkid>|<its token shards>``) joins upstream
        ``ukid``'s downstreams, on the upstream's home shard ``home``. ``lifecycle``: the
        upstream's as its meta hash said just before (a request of its own stream), so that marks
        an earlier request of the id left are not taken for its end."""
        k = self.keys
        items = fcall_items(
            self.conn.fcall(
                "dag_link",
                [k.downstreams(home, ukid), k.finish_marks(home, ukid), k.record(home, ukid), k.active(home),
                 k.releases(home)],
                [ukid, entry, ms(self.settings.retention), "" if lifecycle is None else str(lifecycle)],
            )
        )
        tag = text(items[0]) if items else ""
        lifecycle = _opt_int(items[1]) if len(items) > 1 else None
        if tag == "live":
            return Link("live", lifecycle)
        if tag == "done" and lifecycle is not None:
            return Link("done", lifecycle, Ended(lifecycle, text(items[2]) if len(items) > 2 else ""))
        return Link("unknown")

    def link_all(self, dkid: str, shards: int, upstreams: Sequence[str]) -> List[Tuple[str, int, Optional[str]]]:
        """Links downstream ``dkid`` (submitted with ``shards`` token shards) to each of
        ``upstreams`` (raw ids), on their home shards, between its ``submit_open`` and its
        ``submit_commit`` (Rust ``dag::link_all``). Returns what each link found, for the commit:
        (key id, lifecycle, the state it ended in or None). An upstream that is unknown, or still
        being submitted, is :class:`errors.UnknownUpstream`."""
        entry = f"{dkid}|{shards}"
        links = []
        client = self.conn.client
        for start in range(0, len(upstreams), DOWNSTREAMS_PAGE):
            some = upstreams[start : start + DOWNSTREAMS_PAGE]
            pipe = client.pipeline(transaction=False)
            for upstream in some:
                pipe.hmget(self.keys.request(key_id(upstream)).meta, ["state", "created", "gen", "shards"])
            for upstream, meta in zip(some, pipe.execute()):
                links.append(self._link_one(entry, upstream, meta))
        return links

    def _link_one(self, entry: str, upstream: str, meta: Sequence[Any]) -> Tuple[str, int, Optional[str]]:
        ukid = key_id(upstream)
        state, created, gen, shards = meta
        unknown = errors.UnknownUpstream(upstream, "is unknown (never submitted, or its retention ran out)")
        # A request of its own stream is homed by the shard count in its meta; a lane request's
        # record is on the home of the count it was submitted with, which may not be this one's.
        lifecycle: Optional[int] = None
        if state is not None and text(state) == "loading":
            raise errors.UnknownUpstream(upstream, "is still being submitted: submit after it once its submit returned")
        if state is not None:
            home = home_shard(ukid, max(1, integer(shards, 1)))
            lifecycle = integer(created) * 1000 + integer(gen)
        else:
            home = self.lane_home(ukid)
        link = self.dag_link(home, ukid, entry, lifecycle)
        if link.tag == "live":
            lc = link.lifecycle if link.lifecycle is not None else lifecycle
            if lc is None:
                raise unknown
            return ukid, lc, None
        if link.tag == "done" and link.ended is not None:
            return ukid, link.ended.lifecycle, link.ended.state
        raise unknown

    def dag_settle(self, dkid: str, ukid: str, ended: Ended, deadline: int) -> List[Any]:
        """``dag_settle``: tells downstream ``dkid`` that lifecycle ``ended`` of upstream ``ukid``
        has ended; the reply's items. ``deadline``: the caller's arm's (:meth:`armed`)."""
        return fcall_items(
            self.conn.fcall(
                "dag_settle", self.keys.request(dkid).all(),
                [dkid, ukid, ended.lifecycle, ended.state, ms(self.settings.retention), self.keys.done_channel(),
                 deadline],
            )
        )

    def rel_done(self, home: int, ukid: str, lifecycle: Optional[int]) -> bool:
        """``rel_done``: the release of upstream ``ukid``'s lifecycle ``lifecycle`` reached every
        downstream (None: the release found it running again); whether it left the outbox of its
        home shard ``home`` (False: a later finish owes another)."""
        k = self.keys
        reply = self.conn.fcall(
            "rel_done",
            [k.releases(home), k.finish_marks(home, ukid), k.record(home, ukid), k.downstreams(home, ukid)],
            [ukid, "" if lifecycle is None else lifecycle, ms(self.settings.retention)],
        )
        return integer(reply) == 1

    def ended(self, home: int, ukid: str) -> Link:
        """Where upstream ``ukid``, homed on ``home``, stands, read from its home shard: its lane
        record, or its finish marks and index entry (what ``dag_link`` reads, writing nothing)."""
        k = self.keys
        client = self.conn.client
        state, lc = client.hmget(k.record(home, ukid), ["state", "lc"])
        lifecycle = _opt_int(lc)
        if state is not None and lifecycle is not None:
            if text(state) in ("queued", "running"):
                return Link("live", lifecycle)
            return Link("done", lifecycle, Ended(lifecycle, text(state)))
        e, s, o = client.hmget(k.finish_marks(home, ukid), ["e", "s", "o"])
        written, reopened = _opt_int(e), _opt_int(o)
        if written is not None and (reopened is None or reopened <= written):
            return Link("done", written, Ended(written, text(s) if s is not None else "completed"))
        if client.zscore(k.active(home), ukid) is not None:
            return Link("live")
        return Link("unknown")

    def downstreams_page(self, home: int, ukid: str, cursor: int) -> Tuple[int, List[str]]:
        """A page of upstream ``ukid``'s downstreams (``SSCAN`` of its set on its home shard
        ``home``, from ``cursor``): the next cursor (0 after the last page) and the entries
        ``<dkid>|<shards>``."""
        nxt, entries = self.conn.client.sscan(self.keys.downstreams(home, ukid), cursor=cursor, count=DOWNSTREAMS_PAGE)
        return integer(nxt), [text(e) for e in entries]

    def release_owed(self, home: int, ukid: str, depth: int = 0, ended: Optional[Ended] = None) -> None:
        """The release of upstream ``ukid`` (homed on ``home``) that its finish just put in the
        outbox, run by its finisher at once; ``ended``: the lifecycle that finished, as the
        finisher knows it (else it is read). An error (or a cascade deeper than
        :data:`INLINE_DEPTH`) leaves it to recovery, which claims the outbox's entry when it falls
        due (Rust ``dag::release_owed``)."""
        if not self.settings.inline_releases or depth >= INLINE_DEPTH:
            return
        try:
            self.dag_release(home, ukid, depth, ended)
        except Exception as e:  # noqa: BLE001 - the outbox keeps it for recovery
            log.warning("releasing the downstreams of %s failed; recovery will: %s", ukid, e)

    def dag_release(self, home: int, ukid: str, depth: int = 0, known: Optional[Ended] = None) -> None:
        """Runs the release of upstream ``ukid``, homed on ``home``, that its finish owes (in the
        outbox): tells every downstream in its set that a lifecycle of it ended (``known``, when
        the caller knows which: its finisher; else the one its home shard says ended last), and
        does what each answer asks (push an opened gate's tokens, finish a downstream failed by
        it, reopen one it failed before); then takes it out of the outbox. Repeatable (Rust
        ``dag::release``). ``depth``: how many finishes this one follows in a cascade."""
        ended = known
        if ended is None:
            link = self.ended(home, ukid)
            if link.tag == "live":
                # Running again (requeued after its finish): its next finish owes the next release.
                self.rel_done(home, ukid, None)
                return
            # Its marks gone with its retention: whoever still waits learns it is gone.
            ended = link.ended if link.tag == "done" and link.ended is not None else GONE
        cursor = 0
        while True:
            cursor, entries = self.downstreams_page(home, ukid, cursor)
            for entry in entries:
                dkid, bar, shards = entry.rpartition("|")
                if not bar:
                    continue
                n = int(shards) if shards.isdigit() else 1
                self.settle(dkid, max(1, min(MAX_TOKEN_SHARDS, n)), ukid, ended, depth)
            if cursor == 0:
                break
        self.rel_done(home, ukid, ended.lifecycle)

    def settle(self, dkid: str, shards: int, ukid: str, ended: Ended, depth: int = 0) -> None:
        """``dag_settle`` of downstream ``dkid`` (homed by ``shards``) for upstream ``ukid``, armed,
        and what its answer asks (Rust ``dag::settle``)."""
        items = self.armed(dkid, shards, lambda deadline: self.dag_settle(dkid, ukid, ended, deadline))
        tag = text(items[0]) if items else ""
        if tag == "open":
            # {'open', priority, shards, group ('' for none), element...}
            priority = _priority_item(items[1]) if len(items) > 1 and items[1] is not None else DEFAULT_PRIORITY
            place_shards = max(1, min(MAX_TOKEN_SHARDS, integer(items[2], 1))) if len(items) > 2 else 1
            group = group_item(items[3]) if len(items) > 3 else None
            place = Placement(priority, place_shards, group)
            self.push(dkid, place, items[4:], self.settings.census_interval)
        elif tag == "finished":
            place = self.placement(dkid) or Placement(DEFAULT_PRIORITY, shards)
            self.finish(dkid, place, Finished.parse(items[1:]), depth + 1)
        elif tag == "reopen":
            place = self.placement(dkid)
            if place is not None:
                log.info("reopening request %s, which its upstream %s had failed", dkid, ukid)
                self.requeue(dkid, place)

    def check_waiting(self, dkid: str, shards: int, upstreams: Sequence[str]) -> None:
        """Recovery's look at waiting downstream ``dkid`` (homed by ``shards``): each upstream
        listed (not ended, by its fields) is read where it lives; one that has ended, or is gone,
        is settled here, in case its release never reached this downstream (Rust
        ``dag::check_waiting``)."""
        for ukid in upstreams:
            ended = self.upstream_now(ukid)
            if ended is None:
                continue
            log.info("settling waiting request %s's upstream %s (%s)", dkid, ukid, ended.state)
            self.settle(dkid, shards, ukid, ended, 0)

    def upstream_now(self, ukid: str) -> Optional[Ended]:
        """Where upstream ``ukid`` stands, read from its own keys: None while it is live, its
        ended lifecycle once terminal, or ``gone`` (lifecycle 0) when nothing of it is left."""
        state, created, gen = self.conn.client.hmget(self.keys.request(ukid).meta, ["state", "created", "gen"])
        if state is not None:
            st = text(state)
            if st in ("completed", "failed", "cancelled"):
                return Ended(integer(created) * 1000 + integer(gen), st)
            return None
        link = self.ended(self.lane_home(ukid), ukid)
        if link.tag == "live":
            return None
        if link.tag == "done" and link.ended is not None:
            return link.ended
        return GONE

    # ----- tokens -----

    def give_back(self, shard: int, list_key: str, holder: str, take: str, elements: Sequence[Any]) -> None:
        self.conn.fcall("give_back", [self.keys.held(shard), self.keys.bell(shard), list_key], [holder, take, *elements])

    def release(self, shard: int, holder: str, take: str) -> None:
        self.conn.fcall("release", [self.keys.held(shard)], [holder, take])

    # ----- tenant groups (prelude.lua, "Tenant groups") -----

    def group_set(self, shard: int, name: str, limit: Optional[int], rate: str = "") -> Tuple[int, int]:
        """``group_set`` on group ``name``'s shard ``shard``: sets its limit (None: keeps it) and
        its rate limit (``rate``: ``"<n>/<interval ms>"``; ``"none"`` removes it; ``""`` keeps
        it). Returns (tokens added, tokens retired now)."""
        k = self.keys
        args: List[Any] = [name, "" if limit is None else limit, rate]
        items = fcall_items(self.conn.fcall("group_set", [k.group_limits(shard), k.group(shard, name)], args))
        return (integer(items[0]) if items else 0, integer(items[1]) if len(items) > 1 else 0)

    def group_audit(self, shard: int, cursor: str, count: int) -> Tuple[str, int, List[Tuple[str, str]]]:
        """``group_audit`` on ``shard``, scan mode: looks at up to ``count`` groups from SSCAN
        cursor ``cursor`` (with the grace), repairing what it can tell alone (a token waiting for
        its group's rate limit that is missing from ``gwake``, a queued group token whose element
        was lost). Returns (next cursor, '0' after the last; tokens repaired; the held group tokens
        that no take record names, as ``("<group>|<k>|<epoch>", holder)``) (Rust
        ``groups::audit``)."""
        k = self.keys
        args = [cursor, count, ms(self.settings.grace)]
        items = fcall_items(self.conn.fcall("group_audit", [k.held(shard), k.groups(shard)], args))
        nxt = text(items[0]) if items and items[0] is not None else "0"
        repaired = integer(items[1]) if len(items) > 1 else 0
        unnamed = []
        for item in items[2:]:
            token, bar, holder = text(item).rpartition("|")
            if bar:
                unnamed.append((token, holder))
        return nxt, repaired, unnamed

    def group_audit_end(self, shard: int, tokens: Sequence[str]) -> int:
        """``group_audit`` on ``shard``, end mode: gives back each of ``tokens``
        (``<group>|<k>|<epoch>``) still held under that epoch by no take record. Returns how many
        went back (Rust ``groups::end``)."""
        k = self.keys
        return integer(self.conn.fcall("group_audit", [k.held(shard), k.groups(shard)], ["end", *tokens]))

    def reclaim(self, kid: str, k: int, epoch: str, holder: str, list_key: str,
                deadline: Optional[int]) -> Tuple[str, List[Any]]:
        """``reclaim`` of a token taken from ``list_key``: (tag, rest of the reply). The list's
        tenant group (none for a shard's list) tells the function whether the request under that
        id now is the one the token was taken for (an id is free again after a purge)."""
        args: List[Any] = [kid, k, epoch, holder, deadline or 0, group_of_queue(list_key) or ""]
        items = fcall_items(self.conn.fcall("reclaim", self.keys.request(kid).all(), args))
        tag = text(items[0]) if items else "none"
        return tag, items[1:]
