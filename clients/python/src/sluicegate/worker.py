"""Workers: slots that take tokens and run parts, a liveness thread that beats and checks holds,
and a chores thread that runs recovery (docs/protocol.md §6.2, §6.4-§6.6; the same call sequences
and fencing as src/worker/slot.rs, liveness.rs and recovery.rs).

Each slot is a thread. A synchronous handler runs in a thread of its slot's own; an ``async def``
handler runs on one asyncio loop the worker keeps in a thread. Beats run on a thread and a
connection of their own, so that busy handlers never delay them: a live worker is not declared
dead for being busy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import inspect
import json
import logging
import os
import random
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _recovery as recovery
from . import codec
from ._conn import Conn, fcall_items, integer, text
from ._conn import retry_transient as _retry_transient
from ._keys import group_of_queue, home_shard, key_id, lane_of, raw_id
from ._protocol import MAX_TOKEN_SHARDS, Ended, Finished, LaneSettings, Placement, Protocol, Settings, Unfinished, ms
from .errors import NoResult, PermanentError, UnknownRequest
from .producer import PartError

log = logging.getLogger("sluicegate.worker")

#: How often the thread that follows the shards' ``up`` channels looks whether the worker stops
#: (seconds): a stop waits for it.
LISTEN_TICK = 0.1
#: How long a batch of fast handlers should take (src/worker/slot.rs BATCH_TARGET).
BATCH_TARGET_US = 2000.0
#: How long a hold's first batch, sized from the slot's last hold, may run (its handlers' own
#: time) before it hands back what it has not run (src/worker/slot.rs GUESS_BUDGET).
GUESS_BUDGET_S = 0.008
#: Dead workers one beat claims at most.
REAP_BATCH = 16


class Context:
    """What a handler is told about the part it runs. ``cancelled`` turns true when the part's
    request was cancelled or finished, its deadline passed, its attempt timed out, or this worker
    lost its hold (its result would be dropped): a long handler should check it and stop."""

    def __init__(self, request_id: str, index: int, attempt: int, priority: int, cancel: "_Cancel",
                 protocol: Optional[Protocol] = None) -> None:
        self.request_id = request_id
        self.index = index
        self.attempt = attempt
        self.priority = priority
        self._cancel = cancel
        self._protocol = protocol

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def wait_cancelled(self, timeout: Optional[float] = None) -> bool:
        """Sleeps up to ``timeout`` seconds, returning early (True) once cancelled."""
        return self._cancel.event.wait(timeout)

    @property
    def idempotency_key(self) -> str:
        return f"{self.request_id}/{self.index}"

    def upstream(self, request_id: str, start: int = 0, end: Optional[int] = None) -> List[Any]:
        """The results of parts ``start`` to ``end`` (excluded; None: to the last; both clamped to
        the request's parts) of request ``request_id``, in part order: typically an upstream this
        request was submitted after (``Producer.submit(after=...)``), whose results are then final,
        read on demand (nothing is copied into this request's parts). A part that was
        dead-lettered reads as its :class:`PartError` (an instance in the list, in its place).
        Results live for their request's retention; a part without one (not ended, its results
        taken or discarded, or expired) raises :class:`NoResult`, an unknown request
        :class:`UnknownRequest` (the Rust ``Context::upstream``). Two reads per call, whatever the
        range; a blocking call, which an ``async`` handler may run with ``asyncio.to_thread``."""
        if self._protocol is None:
            raise RuntimeError("this context has no connection to read results with")
        return upstream_results(self._protocol, request_id, start, end)

    def __repr__(self) -> str:
        return f"Context(request_id={self.request_id!r}, index={self.index}, attempt={self.attempt})"


def upstream_results(p: Protocol, rid: str, start: int = 0, end: Optional[int] = None) -> List[Any]:
    """The outcomes of parts ``start..end`` of request ``rid`` (clamped to its parts), decoded; a
    dead-lettered part as its :class:`PartError` (Rust ``worker::upstream::results``): a request of
    its own stream keeps them in its ``:res`` and ``:err`` hashes, a lane request in its record
    (``o<i>``, ``e<i>``)."""
    kid = key_id(rid)
    keys = p.keys.request(kid)
    client = p.conn.client
    total, discard = client.hmget(keys.meta, ["total", "discard"])
    if total is not None:
        lo, hi = _clamp(start, end, integer(total))
        oks_key, errs_key = keys.results, keys.errors
        ok_fields = [str(i) for i in range(lo, hi)]
        err_fields = ok_fields
        discarded = text(discard) == "1"
    else:
        record = p.keys.record(p.lane_home(kid), kid)
        pol, discard = client.hmget(record, ["pol", "discard"])
        if pol is None:
            raise UnknownRequest(f'no request with id "{rid}" (never submitted, or its results expired)')
        lo, hi = _clamp(start, end, LaneSettings.parse(text(pol)).values[2])
        oks_key = errs_key = record
        ok_fields = [f"o{i}" for i in range(lo, hi)]
        err_fields = [f"e{i}" for i in range(lo, hi)]
        # A discarding record counts its discarded parts in ``discard``.
        discarded = discard is not None
    if lo >= hi:
        return []
    pipe = client.pipeline(transaction=False)
    pipe.hmget(oks_key, ok_fields)
    pipe.hmget(errs_key, err_fields)
    oks, errs = pipe.execute()
    out: List[Any] = []
    for index, ok, err in zip(range(lo, hi), oks, errs):
        if ok is not None:
            out.append(codec.decode(ok))
        elif err is not None:
            out.append(PartError.from_record(err))
        else:
            why = (
                "its results are discarded" if discarded else
                "the part has not ended, or its result was taken (results_from) or expired with its retention"
            )
            raise NoResult(rid, index, why)
    return out


def _clamp(start: int, end: Optional[int], total: int) -> Tuple[int, int]:
    """``start..end`` within ``0..total``."""
    start = max(0, start)
    return min(start, total), min(total if end is None else max(0, end), total)


class _Cancel:
    """A cancellation flag, with callbacks (an async handler's task cancel)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: List[Callable[[], None]] = []

    def is_set(self) -> bool:
        return self.event.is_set()

    def on_cancel(self, cb: Callable[[], None]) -> None:
        with self._lock:
            if not self.event.is_set():
                self._callbacks.append(cb)
                return
        cb()

    def cancel(self) -> bool:
        """Cancels; whether it was not cancelled before."""
        with self._lock:
            if self.event.is_set():
                return False
            self.event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb()
            except Exception:  # noqa: BLE001
                pass
        return True


@dataclass
class _Policy:
    max_attempts: int = 1
    timeout_ms: int = 0
    base_ms: int = 1000
    cap_ms: int = 60000
    shards: int = 1
    #: When the request's deadline falls, on this process's ``time.monotonic()`` clock (acquire's
    #: report): no part starts after it, and the handlers still running then are cancelled.
    deadline: Optional[float] = None

    def past_deadline(self) -> bool:
        """Whether the request's deadline (if any) has passed."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def is_last(self, attempt: int, permanent: bool) -> bool:
        return permanent or attempt >= self.max_attempts

    def backoff_ms(self, attempt: int) -> int:
        d = min(self.base_ms * (1 << min(max(attempt - 1, 0), 20)), self.cap_ms)
        half = d / 2
        return int(half + half * random.random())


def _read_policy(v: Any, sent: float) -> Tuple[_Policy, Optional[int]]:
    """A policy as ``acquire`` reports it: ``[max attempts, timeout ms, backoff base ms, backoff
    max ms[, token shards[, queue wait ms (-1: none)[, ms until the deadline]]]]``, and the queue
    wait. ``sent``: when the call was sent (``time.monotonic()``), before Redis read its clock, so
    that the deadline kept here is never later than Redis's (Rust ``read_policy``)."""
    p = [integer(x) for x in (v or [])]
    if len(p) < 4:
        raise ValueError("a policy has fewer than four fields")
    shards = max(1, min(1024, p[4])) if len(p) > 4 else 1
    deadline = sent + max(0, p[6]) / 1000 if len(p) > 6 else None
    waited = p[5] if len(p) > 5 and p[5] >= 0 else None
    return _Policy(max(1, p[0]), max(0, p[1]), max(0, p[2]), max(0, p[3]), shards, deadline), waited


def _lane_policy(pol: str) -> _Policy:
    fields = pol[1:] if pol.startswith("f") else pol
    values = [int(x) for x in fields.split(",")]
    defaults = [1, 0, 1000, 60000]
    while len(values) < 7:
        values.append(defaults[len(values) - 3])
    return _Policy(max(1, values[3]), values[4], values[5], values[6], 1)


@dataclass
class _Entry:
    id: bytes
    index: int
    payload: bytes
    attempt: int
    lane: Optional[Tuple[str, bytes, _Policy]] = None  # request key id, lifecycle, policy

    def policy(self, batch: Optional[_Policy]) -> _Policy:
        if self.lane is not None:
            return self.lane[2]
        return batch or _Policy()


@dataclass
class _Next:
    tag: str  # run, requeue, park, finished, drop, stale, fenced
    entries: List[_Entry] = field(default_factory=list)
    policy: Optional[_Policy] = None
    element: Any = None
    priority: Optional[int] = None
    wake_ms: int = 0
    finished: Optional[Finished] = None
    park_shards: Optional[int] = None
    #: Key ids of the lane requests with downstreams that a ``lane_ack`` finished (its trailing
    #: ``{'rel', key id, state, lifecycle, ...}``), with the lifecycle each ended: their releases are
    #: owed (in the outbox), and the slot's to run.
    releases: List[Tuple[str, Ended]] = field(default_factory=list)


#: Which call's reply :func:`_parse_next` reads, which says where a ``run`` reply's policy comes
#: from (Rust ``Reading``): ``acquire`` (the item after the tag), ``lane`` (``lane_acquire`` or
#: ``take``'s: the first entry's own), ``ack`` (``ack``: none; the slot keeps the one its acquire
#: reported), ``lane_ack`` (none, as ``ack``; its entries carry their requests' own).
ACQUIRE, LANE_ACQUIRE, ACK, LANE_ACK = "acquire", "lane", "ack", "lane_ack"


def _parse_next(reply: Any, reading: str, sent: float = 0.0) -> _Next:
    """Reads an acquire or ack reply; ``sent`` is when the call was sent (``time.monotonic()``),
    which an acquire's deadline counts from. The call, not the shape of the items, says whether a
    policy comes first: a policy of seven fields is as long as a lane entry."""
    items = fcall_items(reply)
    releases: List[Tuple[str, Ended]] = []
    if _trailing(items, "rel"):
        # Key id, state, lifecycle of each.
        rel = items.pop()[1:]
        releases = [(text(rel[i]), Ended(integer(rel[i + 2]), text(rel[i + 1]))) for i in range(0, len(rel) - 2, 3)]
    if _trailing(items, "done"):
        items.pop()
    nxt = _parse_items(items, reading, sent)
    nxt.releases = releases
    return nxt


def _entry_index(entry_id: Any) -> int:
    """A request entry's index from its id ``0-<seq>``: ``seq - 1``."""
    seq = text(entry_id)
    if not seq.startswith("0-") or not seq[2:].isdigit() or int(seq[2:]) < 1:
        raise ValueError(f"entry id {seq!r} is not 0-<n>, n >= 1")
    return int(seq[2:]) - 1


def _trailing(items: List[Any], tag: str) -> bool:
    """Whether the last item of a reply is an array ``{tag, ...}`` (``lane_ack``'s ``done`` and
    ``rel``)."""
    return bool(items) and isinstance(items[-1], (list, tuple)) and bool(items[-1]) and text(items[-1][0]) == tag


def _parse_items(items: List[Any], reading: str, sent: float) -> _Next:
    tag = text(items[0]) if items else ""
    rest = items[1:]
    if tag == "run":
        policy = None
        if reading == ACQUIRE:
            policy, _ = _read_policy(rest[0] if rest else None, sent)
            rest = rest[1:]
        entries = []
        if rest and not isinstance(rest[0], (list, tuple)) and reading in (LANE_ACQUIRE, LANE_ACK):
            # Flat lane entries: id, index, payload, attempt, request key id, lifecycle, settings,
            # queue wait (-1: none).
            if len(rest) % 8:
                raise ValueError("short lane entry in a 'run' reply")
            for i in range(0, len(rest), 8):
                e = rest[i:i + 8]
                lane_info = (text(e[4]), e[5] if isinstance(e[5], bytes) else str(e[5]).encode(), _lane_policy(text(e[6])))
                entries.append(_Entry(e[0], integer(e[1]), e[2] or b"", integer(e[3], 1), lane_info))
            rest = []
        elif rest and not isinstance(rest[0], (list, tuple)):
            # Flat entries: id, payload, attempt; the index is the id's sequence number - 1.
            if len(rest) % 3:
                raise ValueError("short entry in a 'run' reply")
            for i in range(0, len(rest), 3):
                entries.append(_Entry(rest[i], _entry_index(rest[i]), rest[i + 1] or b"", integer(rest[i + 2], 1), None))
            rest = []
        for e in rest:
            lane_info = None
            if len(e) >= 7:
                lane_info = (text(e[4]), e[5] if isinstance(e[5], bytes) else str(e[5]).encode(), _lane_policy(text(e[6])))
            entries.append(_Entry(e[0], integer(e[1]), e[2] or b"", integer(e[3], 1), lane_info))
        if not entries:
            raise ValueError("a 'run' reply without entries")
        if reading == LANE_ACQUIRE:
            policy = entries[0].lane[2] if entries[0].lane else None
        return _Next("run", entries, policy)
    if tag == "requeue":
        prio = integer(rest[1]) if len(rest) > 1 and rest[1] is not None else None
        return _Next("requeue", element=rest[0] if rest else None, priority=prio)
    if tag == "park":
        # acquire's also names the request's token shards (its slot has no policy yet).
        shards = max(1, min(1024, integer(rest[1]))) if len(rest) > 1 and rest[1] is not None else None
        return _Next("park", wake_ms=max(0, integer(rest[0] if rest else 0)), park_shards=shards)
    if tag == "finished":
        # (acquire's, at a deadline, ends with ['shards', S]: Finished.parse reads it.)
        return _Next("finished", finished=Finished.parse(rest))
    if tag in ("drop", "stale", "fenced"):
        return _Next(tag)
    raise ValueError(f"unexpected reply {tag!r}")


@dataclass
class _Token:
    kid: str
    k: str
    epoch: str
    rid: str
    priority: int
    shard: int
    #: The list it was taken from: a shard's priority list, or a tenant group's queue (the take
    #: then holds a token of the group too, which the call that ends the take record returns).
    list: str
    take: int
    acquired: Optional[_Next] = None
    #: Taken for one part only: a request in a rate-limited tenant group (``take``'s third item
    #: ``'one'``; Rust ``Token::one_part``). Each part's start is charged to the group's bucket by
    #: a take of its own, so the slot runs one and gives the token back.
    one_part: bool = False

    @property
    def group(self) -> Optional[str]:
        """The request's tenant group, if it has one (its token came from the group's queue)."""
        return group_of_queue(self.list)


@dataclass
class _Lease:
    meta: str
    k: str
    epoch: str
    holder: str
    record: Optional[Tuple[str, bytes]]
    since: float
    cancel: _Cancel


class _Failure(Exception):
    pass


def _tick(deadline: Optional[float]) -> float:
    """How long a supervised handler is waited for before its limits are checked again: 20 ms, or
    less when the request's deadline falls sooner."""
    if deadline is None:
        return 0.02
    return min(0.02, max(0.0, deadline - time.monotonic()))


class Worker:
    """Runs ``handler(ctx, payload) -> result`` on parts of every request of the namespace,
    ``slots`` at once. ``handler`` may be a plain function (run in threads) or ``async def``
    (run on an asyncio loop). Raise :class:`PermanentError` for a failure that must not be
    retried; any other exception is retried while the request's ``max_attempts`` allows.

    Timings are in seconds, with the Rust client's defaults. ``reserve=(n, p)`` keeps the last
    ``n`` slots for requests of priority ``p`` (1 to 99) or higher (the Rust
    ``WorkerBuilder::reserve``): they take nothing lower, and start such a request as soon as it
    is announced, while the other slots are busy.
    """

    def __init__(
        self,
        url: str,
        handler: Callable[..., Any],
        slots: int = 8,
        namespace: str = "sluicegate",
        *,
        lease: float = 2.0,
        heartbeat: float = 0.5,
        recovery_interval: float = 0.2,
        census_interval: float = 60.0,
        idle_poll: float = 1.0,
        shutdown_grace: float = 30.0,
        quantum_parts: int = 32,
        quantum_time: float = 0.25,
        max_batch: int = 32,
        retention: float = 24 * 3600.0,
        loading_ttl: float = 3600.0,
        token_shards: int = 1,
        shard_poll: float = 0.1,
        reserve: Optional[Tuple[int, int]] = None,
    ) -> None:
        if slots < 1:
            raise ValueError("a worker needs at least one slot")
        if reserve is not None:
            n, floor = reserve
            if not 1 <= n < slots:
                raise ValueError(
                    f"reserve=({n}, ..) keeps {n} of the worker's {slots} slots: from 1, and at least one must "
                    "take every priority"
                )
            if not 1 <= floor <= 99:
                raise ValueError(f"reserve=(.., {floor}): a priority is from 1 to 99 here")
        if heartbeat > lease / 2:
            raise ValueError("the heartbeat must be at most half the lease")
        if not 1 <= max_batch <= 256:
            raise ValueError("max_batch must be from 1 to 256")
        self.settings = Settings(
            namespace=namespace, lease=lease, heartbeat=heartbeat, recovery_interval=recovery_interval,
            census_interval=census_interval, retention=retention, loading_ttl=loading_ttl,
            token_shards=token_shards,
        )
        if not 1 <= token_shards <= MAX_TOKEN_SHARDS:
            raise ValueError("token_shards must be from 1 to 1024")
        self.shard_poll = shard_poll
        self.higher = _Higher(token_shards, None if reserve is None else reserve[1])
        #: How many slots are kept for high priorities, and from which priority (the last ones).
        self.reserve = reserve
        self.url = url
        self.handler = handler
        self.is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            getattr(handler, "__call__", None)
        )
        self.slots = slots
        self.idle_poll = idle_poll
        self.shutdown_grace = shutdown_grace
        self.quantum_parts = quantum_parts
        self.quantum_time = quantum_time
        self.max_batch = max_batch
        self.protocol = Protocol(Conn(url, socket_timeout=max(10.0, idle_poll + 5)), self.settings)
        self.id = f"w-{uuid.uuid4().hex}"
        self._id_lock = threading.Lock()
        self.stopping = threading.Event()
        #: Set once the worker is registered and its slots run.
        self.ready = threading.Event()
        self._stopped_at: Optional[float] = None
        self._halt = threading.Event()  # stops the liveness and chores threads
        self._leases: Dict[int, _Lease] = {}
        self._leases_lock = threading.Lock()
        self._wakes: List[Tuple[float, str, int]] = []
        self._wakes_lock = threading.Lock()
        #: Set when a wake falls due sooner than the chores thread planned to look (or at the
        #: halt): it looks again at once instead of sleeping on to its next recovery pass.
        self._wakes_sooner = threading.Event()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._threads: List[threading.Thread] = []
        self.fenced = 0
        self.started_ms = int(time.time() * 1000)

    # ----- life cycle -----

    def stop(self) -> None:
        """Stops taking work: running handlers finish (within the shutdown grace), tokens go back."""
        if not self.stopping.is_set():
            self._stopped_at = time.monotonic()
            self.stopping.set()

    def run(self, install_signals: bool = True) -> None:
        """Runs until :meth:`stop` (or SIGTERM/SIGINT when ``install_signals`` and on the main
        thread); then hands back what the slots hold and leaves the registry."""
        if install_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        self._beat(first=True)
        if self.is_async:
            self._loop = asyncio.new_event_loop()
            t = threading.Thread(target=self._loop.run_forever, name="sluicegate-asyncio", daemon=True)
            t.start()
        liveness = [
            threading.Thread(target=self._beats, name="sluicegate-liveness", daemon=True),
            threading.Thread(target=self._chores, name="sluicegate-recovery", daemon=True),
            threading.Thread(target=self._listen_up, name="sluicegate-up", daemon=True),
        ]
        for t in liveness:
            t.start()
        slots = [threading.Thread(target=_Slot(self, n).run, name=f"sluicegate-slot-{n}", daemon=True) for n in range(self.slots)]
        for t in slots:
            t.start()
        self._threads = slots
        self.ready.set()
        try:
            for t in slots:
                while t.is_alive():
                    t.join(0.2)
        finally:
            self._halt.set()
            self._wakes_sooner.set()
            for t in liveness:
                t.join(5)
            try:
                k = self.protocol.keys
                self.protocol.conn.fcall("reaped", [k.workers(), k.worker_info(), k.reaping()], [self.worker_id])
            except Exception as e:  # noqa: BLE001 - the registration expires by itself
                log.warning("could not leave the registry: %s", e)
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
            self.protocol.conn.close()

    def start(self) -> threading.Thread:
        """Runs the worker in a background thread (no signal handlers); :meth:`stop` ends it."""
        t = threading.Thread(target=self.run, kwargs={"install_signals": False}, name="sluicegate-worker", daemon=True)
        t.start()
        return t

    @property
    def worker_id(self) -> str:
        with self._id_lock:
            return self.id

    def _renew_id(self) -> str:
        with self._id_lock:
            self.id = f"w-{uuid.uuid4().hex}"
            return self.id

    # ----- liveness (§6.4) -----

    def _description(self) -> str:
        return json.dumps(
            {"id": self.worker_id, "slots": self.slots, "pid": os.getpid(), "host": socket.gethostname(),
             "started_ms": self.started_ms, "shards": self.settings.token_shards},
            separators=(",", ":"),
        )

    def _beat(self, first: bool, p: Optional[Protocol] = None) -> Tuple[bool, List[Tuple[str, Optional[str]]]]:
        p = p or self.protocol
        k = p.keys
        s = self.settings
        reply = fcall_items(
            p.conn.fcall(
                "beat", [k.workers(), k.worker_info(), k.reaping()],
                [self.worker_id, ms(s.lease), self._description(), "1" if first else "0", REAP_BATCH, ms(5 * s.lease)],
            )
        )
        alive = integer(reply[0], 1) == 1 if reply else True
        dead = [(text(reply[i]), text(reply[i + 1]) or None) for i in range(1, len(reply) - 1, 2)]
        return alive, dead

    def _beats(self) -> None:
        p = Protocol(Conn(self.url, load=False), self.settings)
        first = False
        try:
            while not self._halt.wait(self.settings.heartbeat):
                try:
                    alive, dead = self._beat(first, p)
                    first = False
                    if not alive:
                        self._cancel_all_leases()
                        new = self._renew_id()
                        first = True
                        log.warning("this worker had been declared dead; going on as %s", new)
                    for wid, desc in dead:
                        threading.Thread(target=self._reap, args=(wid, desc), daemon=True).start()
                except Exception as e:  # noqa: BLE001
                    log.warning("heartbeat failed: %s", e)
                self._check_holds(p)
        finally:
            p.conn.close()

    def _reap(self, wid: str, desc: Optional[str]) -> None:
        p = Protocol(Conn(self.url, load=False), self.settings)
        try:
            recovery.reap(p, wid, desc)
        except Exception as e:  # noqa: BLE001
            log.warning("reaping %s failed (another beat will claim it again): %s", wid, e)
        finally:
            p.conn.close()

    def _hold(self, slot: int, lease: _Lease) -> None:
        with self._leases_lock:
            self._leases[slot] = lease

    def _unhold(self, slot: int) -> None:
        with self._leases_lock:
            self._leases.pop(slot, None)

    def _cancel_all_leases(self) -> None:
        with self._leases_lock:
            leases = list(self._leases.values())
        for lease in leases:
            lease.cancel.cancel()

    def _check_holds(self, p: Protocol) -> None:
        """Cancels the handlers whose hold no longer stands (``holds``; a lane request's record)."""
        now = time.monotonic()
        with self._leases_lock:
            snapshot = [lease for lease in self._leases.values() if now - lease.since >= self.settings.heartbeat]
        by_meta: Dict[str, List[_Lease]] = {}
        for lease in snapshot:
            try:
                if lease.record is not None:
                    state, lc = p.conn.client.hmget(lease.record[0], ["state", "lc"])
                    live = text(state) in ("queued", "running") and lc == lease.record[1]
                    if not live and lease.cancel.cancel():
                        log.warning("lane request no longer live; cancelling its handler")
            except Exception as e:  # noqa: BLE001 - checked again at the next beat
                log.debug("hold check failed: %s", e)
            by_meta.setdefault(lease.meta, []).append(lease)
        for meta, held in by_meta.items():
            args: List[Any] = []
            for lease in held:
                args += [lease.k, lease.epoch, lease.holder]
            try:
                lost = {text(v) for v in fcall_items(p.conn.fcall("holds", [meta], args, ro=True))}
            except Exception as e:  # noqa: BLE001
                log.debug("hold check failed: %s", e)
                continue
            for lease in held:
                if lease.k in lost and lease.cancel.cancel():
                    log.warning("token %s of %s no longer held; cancelling its handler", lease.k, meta)

    def _listen_up(self) -> None:
        """Follows each shard's ``up`` channel: a priority became waiting there, and the first
        slot holding a lower one to end a batch gives its token back (§6.2 step 5). Ends with the
        stop: a stopping slot gives its token back after its batch anyway."""
        channels = [self.protocol.keys.up_channel(s) for s in range(self.settings.token_shards)]
        done = lambda: self._halt.is_set() or self.stopping.is_set()  # noqa: E731
        while not done():
            try:
                pubsub = self.protocol.conn.pubsub()
                try:
                    pubsub.subscribe(*channels)
                    while not done():
                        msg = pubsub.get_message(timeout=LISTEN_TICK)
                        if msg and msg.get("type") == "message":
                            channel, prio = text(msg.get("channel")), text(msg.get("data"))
                            if channel in channels and prio.isdigit():
                                self.higher.announce(channels.index(channel), int(prio))
                finally:
                    pubsub.close()
            except Exception as e:  # noqa: BLE001 - busy slots give way at the end of their quantum meanwhile
                log.debug("cannot listen for higher priorities: %s", e)
                self.stopping.wait(1.0)

    # ----- recovery chores (§6.6) -----

    def _wake_at(self, at: float, kid: str, shards: int) -> None:
        with self._wakes_lock:
            heapq.heappush(self._wakes, (at, kid, shards))
            sooner = self._wakes[0][0] == at
        if sooner:
            # A parked token's wake (a retry, a rate limit's next unit) may fall due well before
            # the next recovery pass: the chores thread plans again.
            self._wakes_sooner.set()

    def _chores(self) -> None:
        p = Protocol(Conn(self.url, load=False), self.settings)
        s = self.settings
        next_pass = time.monotonic()
        next_scan = time.monotonic()
        try:
            while not self._halt.is_set():
                now = time.monotonic()
                if now >= next_pass:
                    try:
                        recovery.recovery_pass(p)
                    except Exception as e:  # noqa: BLE001
                        log.warning("recovery pass failed; retrying next interval: %s", e)
                    next_pass = time.monotonic() + s.recovery_interval
                if now >= next_scan:
                    try:
                        recovery.scan_held(p)
                    except Exception as e:  # noqa: BLE001
                        log.warning("take records check failed: %s", e)
                    next_scan = time.monotonic() + s.census_interval
                while True:
                    with self._wakes_lock:
                        if not self._wakes or self._wakes[0][0] > time.monotonic():
                            break
                        _, kid, shards = heapq.heappop(self._wakes)
                    try:
                        recovery.census(p, home_shard(kid, shards), kid, None)
                    except Exception as e:  # noqa: BLE001
                        log.debug("wake-up failed; recovery will look at the request: %s", e)
                with self._wakes_lock:
                    soonest = min([next_pass, next_scan] + ([self._wakes[0][0]] if self._wakes else []))
                    # Cleared under the lock: a wake queued from here on sets it again.
                    self._wakes_sooner.clear()
                if not self._halt.is_set():
                    self._wakes_sooner.wait(max(0.0, soonest - time.monotonic()))
        finally:
            p.conn.close()


class _Higher:
    """Per shard, the highest priority announced waiting (plus one; 0: none), for busy slots of
    a lower priority to give way to; and for the worker's reserved slots, the announcements at or
    above their floor (src/worker/higher.rs)."""

    def __init__(self, shards: int, reserved: Optional[int] = None) -> None:
        self.cells = [0] * shards
        self.lock = threading.Lock()
        self.reserved = reserved
        #: Reserved slots waiting for work: an announcement they cover wakes them, and no busy
        #: slot gives way for it.
        self.idle_reserved = 0
        #: Announcements at or above the reserved floor: how many so far, and the last one's shard.
        self.heard = 0
        self.heard_shard = 0
        self.hear = threading.Condition(self.lock)

    def announce(self, shard: int, priority: int) -> None:
        with self.lock:
            if self.reserved is not None and priority >= self.reserved:
                self.heard += 1
                self.heard_shard = shard
                self.hear.notify_all()
                if self.idle_reserved > 0:
                    return
            if shard < len(self.cells):
                self.cells[shard] = max(self.cells[shard], priority + 1)

    def wait_heard(self, seen: int, timeout: float) -> Optional[int]:
        """For an idle reserved slot: waits until an announcement it covers comes after the
        ``seen``-th, at most ``timeout`` seconds; the shard it came on, or None."""
        with self.lock:
            self.idle_reserved += 1
            try:
                if self.hear.wait_for(lambda: self.heard != seen, timeout):
                    return self.heard_shard
                return None
            finally:
                self.idle_reserved -= 1

    def claim_above(self, shard: int, priority: int) -> bool:
        """Whether a higher priority waits on the shard; the one slot that claims it gives way."""
        with self.lock:
            if shard < len(self.cells) and self.cells[shard] > priority + 1:
                self.cells[shard] = 0
                return True
            return False

    def answered(self, shard: int, priority: int) -> None:
        """A take at or above the announced priority answers it."""
        with self.lock:
            if shard < len(self.cells) and 0 != self.cells[shard] <= priority + 1:
                self.cells[shard] = 0


class _Slot:
    """One slot: take a token, run parts of its request for one quantum, give the token back."""

    def __init__(self, worker: Worker, n: int) -> None:
        self.w = worker
        self.p = worker.protocol
        self.n = n
        self.next_take = 0
        self.last_take: List[Optional[int]] = [None] * worker.settings.token_shards
        self.pending: Optional[int] = None
        # The holder name the slot's takes and records were made under: a worker declared dead
        # goes on under a new id, and the slot's next take ends what the old name left.
        self.took_as: Optional[str] = None
        self.executor = None if worker.is_async else concurrent.futures.ThreadPoolExecutor(1, f"sluicegate-handler-{n}")
        # The handler time of the hold under way (µs), and the slot's last of each kind, which
        # size the first batch of its next hold of that kind (src/worker/slot.rs Turn::new).
        self.mean_us: Optional[float] = None
        self.lane_mean_us: Optional[float] = None
        self.own_mean_us: Optional[float] = None
        # The last handler run's own time (µs), set by the thread or task that ran it.
        self.ran_us: Optional[float] = None
        # A reserved slot's floor (`reserve`): it takes no lower priority, and waits for work on
        # the announcements at or above it rather than on the bell, which every push rings.
        reserve = worker.reserve
        self.floor: Optional[int] = reserve[1] if reserve is not None and n >= worker.slots - reserve[0] else None
        # The shard a reserved slot heard of work on: it takes there next.
        self.go: Optional[int] = None

    # ----- the loop (§6.2) -----

    def run(self) -> None:
        backoff = 0.05
        shards = self.w.settings.token_shards
        shard = self.n % shards
        while not self.w.stopping.is_set():
            try:
                self.take_and_serve(shard)
                backoff = 0.05
                if self.go is not None:
                    shard, self.go = self.go % shards, None
                else:
                    shard = (shard + 1) % shards
            except Exception as e:  # noqa: BLE001 - the same shard again
                log.warning("slot %d error; retrying after %.2fs: %s", self.n, backoff, e)
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
        self.release_all()
        if self.executor is not None:
            self.executor.shutdown(wait=False)

    def holder(self) -> str:
        return f"{self.w.worker_id}/{self.n}"

    def release_all(self) -> None:
        """At a clean stop, or at the first take under a new worker id: ends the slot's records of
        tokens it no longer holds and undoes a take whose reply it never saw, under the holder
        name they were made under."""
        holder = self.took_as or self.holder()
        if self.pending is not None:
            shard, self.pending = self.pending, None
            try:
                k = self.p.keys
                took = integer(self.p.conn.fcall("untake", [k.held(shard), k.bell(shard)], [holder, self.next_take]))
                if took == 1:
                    # A lane's token the take acquired is kept for recovery under a lost name:
                    # reclaimed now, not at the backstop's next pass (Rust `reclaim_untaken`).
                    recovery.reclaim_untaken(self.p, shard, holder, self.next_take)
                self.next_take += 1
            except Exception as e:  # noqa: BLE001
                log.debug("could not undo a take; recovery will reclaim it: %s", e)
        for shard, last in enumerate(self.last_take):
            if last is not None:
                self.last_take[shard] = None
                try:
                    self.p.release(shard, holder, str(last))
                except Exception as e:  # noqa: BLE001
                    log.debug("could not end a take record; recovery will: %s", e)

    def take_and_serve(self, shard: int) -> None:
        holder = self.holder()
        # The worker went on under a new id (it had been declared dead): what the old holder name
        # left ends as at a clean stop, as the slot's next take under that name would have ended
        # it; else it waits for recovery's backstop, which no worker runs once the fleet stops.
        if self.took_as is not None and self.took_as != holder:
            self.release_all()
        self.took_as = holder
        for s, last in enumerate(self.last_take):
            if s != shard and last is not None:
                self.p.release(s, holder, str(last))
                self.last_take[s] = None
        seen = self.w.higher.heard
        took = self.take(holder, shard, False)
        if took == "nothing" or isinstance(took, float):
            wait = self.w.idle_poll if self.w.settings.token_shards == 1 else self.w.shard_poll
            if isinstance(took, float):
                # A group's rate limit refills sooner: the take after it queues the group's token.
                wait = min(took, wait)
            if self.floor is not None:
                # A reserved slot waits for an announcement it covers (or a poll), not on the
                # bell: woken by a flood it does not take, it would spin. It then takes on that
                # shard.
                self.go = self.w.higher.wait_heard(seen, wait)
                return
            bell = self.p.keys.bell(shard)
            # (At least 1 ms: a BRPOP timeout of 0 would block for ever.)
            rang = self.p.conn.client.brpop([bell], timeout=max(wait, 0.001))
            took = self.take(holder, shard, rang is not None)
            if took == "nothing" or isinstance(took, float):
                return
        if took == "paused":
            self.w.stopping.wait(self.w.idle_poll)
            return
        assert isinstance(took, _Token)
        self.w.higher.answered(shard, took.priority)
        self.serve(holder, took)

    def want(self, ran: int, parts: Optional[int] = None) -> int:
        """The next batch's size: what runs in about ``BATCH_TARGET_US``, within what is left of
        the ``parts`` a hold may run (the quantum's by default)."""
        fits = 1.0 if self.mean_us is None else BATCH_TARGET_US / max(self.mean_us, 1.0)
        left = max((self.w.quantum_parts if parts is None else parts) - ran, 1)
        return min(max(int(fits), 1), self.w.max_batch, left)

    def take(self, holder: str, shard: int, woken: bool) -> Any:
        """``take`` on ``shard``: a :class:`_Token`, ``"nothing"``, ``"paused"``, or, when nothing
        was taken and a tenant group's token waits for its rate limit to refill, in how many
        seconds that is (a float: the slot asks again then, not after an idle poll)."""
        k = self.p.keys
        take_id = self.next_take
        prev = self.last_take[shard]
        self.pending = shard
        # A lane's token comes with its first batch, sized from the slot's last lane hold.
        self.mean_us = self.lane_mean_us
        reply = fcall_items(
            self.p.conn.fcall(
                "take", [k.held(shard), k.bell(shard), k.active(shard), k.armed(shard), k.paused(shard)],
                [holder, take_id, "" if prev is None else str(prev), "1" if woken else "0", self.w.worker_id,
                 f"{self.want(0)}|flat", k.lane_prefix(shard), k.record_prefix(shard), k.list_prefix(shard)]
                # (A reserved slot's floor: the lowest priority it pops.)
                + ([] if self.floor is None else [str(self.floor)]),
            )
        )
        self.pending = None
        self.last_take[shard] = take_id
        self.next_take += 1
        if len(reply) == 1 and text(reply[0]) == "paused":
            return "paused"
        if len(reply) < 2:
            return "nothing"
        if len(reply) == 2 and text(reply[0]) == "wait":
            # {'wait', ms}: nothing taken; a group token's rate-limit wait ends in ms.
            return max(integer(reply[1], 1), 1) / 1000
        list_key, element = text(reply[0]), text(reply[1])
        # A third item: 'one' for a request in a rate-limited tenant group (one part under this
        # take), else what acquiring a lane's token in the same call answered.
        acquired, one_part = None, False
        if len(reply) > 2:
            if isinstance(reply[2], (bytes, str)) and text(reply[2]) == "one":
                one_part = True
            else:
                acquired = _parse_next(reply[2], LANE_ACQUIRE)
        prio = k.priority_of_list(list_key)
        parts = element.split("|")
        try:
            if prio is None or len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
                raise ValueError(element)
            rid = raw_id(parts[0])
        except (ValueError, UnicodeDecodeError):
            log.warning("dropping a malformed token element %r from %s", element, list_key)
            return "nothing"
        return _Token(parts[0], parts[1], parts[2], rid, prio, shard, list_key, take_id, acquired, one_part)

    # ----- holding a token -----

    def _holding_args(self, t: _Token) -> List[Any]:
        return [t.kid, t.k, t.epoch, self.holder_of(t), self.consumer]

    def holder_of(self, t: _Token) -> str:
        return self._holder

    def serve(self, holder: str, token: _Token) -> None:
        self._holder = holder
        self.consumer = self.w.worker_id
        # The first batch is sized from the slot's last hold of the same kind (`acquire` caps it
        # at the hold's share of the parts left); a guess, it hands back what it has not run once
        # it has taken GUESS_BUDGET_S, so a slower request still gives way between its parts.
        lane = lane_of(token.kid) is not None
        self.mean_us = self.lane_mean_us if lane else self.own_mean_us
        # Parts this hold may run: the quantum's, or one for a token taken for one part.
        quantum = 1 if token.one_part else self.w.quantum_parts
        want = self.want(0, quantum)
        budget: Optional[float] = GUESS_BUDGET_S if want > 1 else None
        first = token.acquired
        if first is None:
            try:
                first = self.acquire(token, want)
            except Exception as e:  # noqa: BLE001 - whether it ran is unknown
                self.reclaim_own(token, e)
                return
        try:
            self.serve_batches(token, first, quantum, budget)
        finally:
            # Whatever ended the hold, its handler times size the slot's next hold of this kind.
            if lane:
                self.lane_mean_us = self.mean_us
            else:
                self.own_mean_us = self.mean_us

    def serve_batches(self, token: _Token, first: _Next, quantum: int, budget: Optional[float]) -> None:
        """Runs the batches ``first`` and each ack hand out while the slot keeps the token, then does
        what the last answer says."""
        started = time.monotonic()
        ran = 0
        policy: Optional[_Policy] = None
        nxt = first
        while nxt.tag == "run":
            policy = nxt.policy or policy
            outcomes = self.run_batch(token, nxt.entries, policy, budget)
            budget = None
            # Only the parts that ran count toward the quantum: a guessed first batch cut by its
            # budget hands the rest back, and the hold goes on with them.
            ran += sum(1 for o in outcomes if o[0] != "skip")
            keep = (
                ran < quantum
                and time.monotonic() - started < self.w.quantum_time
                and not self.w.stopping.is_set()
                and not self.w.higher.claim_above(token.shard, token.priority)
            )
            try:
                nxt = self.ack(token, nxt.entries, policy, outcomes, self.want(ran, quantum) if keep else None)
            except Exception as e:  # noqa: BLE001 - whether the ack ran is unknown
                self.w._unhold(self.n)
                self.reclaim_own(token, e)
                return
            finally:
                self.w._unhold(self.n)
        self.settle(token, nxt, policy)

    def acquire(self, t: _Token, want: int) -> _Next:
        keys = self.p.keys.request(t.kid).all()
        # Flat entries in a run reply (protocol §5, the hand-out).
        args = self._holding_args(t) + [f"{want}|flat"]
        lane = lane_of(t.kid)
        if lane is not None:
            shard = lane[0]
            args.append(self.p.keys.record_prefix(shard))
            keys += [self.p.keys.active(shard), self.p.keys.armed(shard)]
            return _parse_next(self.p.conn.fcall("lane_acquire", keys, args), LANE_ACQUIRE)
        # Retention and channel: for a request the call finishes at its deadline. Then the group of
        # the list the element came from, so that a copy of another request under the same id is
        # refused (§5 acquire, ARGV 9).
        args += [ms(self.w.settings.retention), self.p.keys.done_channel(), t.group or ""]
        sent = time.monotonic()
        return _parse_next(self.p.conn.fcall("acquire", keys, args), ACQUIRE, sent)

    def run_batch(
        self, t: _Token, entries: List[_Entry], policy: Optional[_Policy], budget: Optional[float] = None
    ) -> List[Tuple[Any, ...]]:
        w = self.w
        # The budget is of the handlers' own time, as the batch sizes are: on a pool whose
        # hand-over to a handler's thread and back costs more than a no-op handler, wall time
        # would cut every guessed batch of fast parts.
        spent_us = 0.0
        meta = self.p.keys.request(t.kid).meta
        batch_cancel = _Cancel()
        w._hold(self.n, _Lease(meta, t.k, t.epoch, self._holder, None, time.monotonic(), batch_cancel))
        outcomes: List[Tuple[Any, ...]] = []
        for e in entries:
            # Once stopping (or once the grace ran out), or once a guessed first batch has run for
            # its budget (its first part always runs), the rest of the batch is handed back; past
            # the request's deadline, no part starts (the ack then ends the request).
            if (
                w.stopping.is_set()
                or (outcomes and outcomes[-1][0] == "skip")
                or (outcomes and budget is not None and spent_us >= budget * 1e6)
                or e.policy(policy).past_deadline()
            ):
                outcomes.append(("skip",))
                continue
            cancel = batch_cancel
            rid = t.rid
            if e.lane is not None:
                cancel = _Cancel()
                record = self.p.keys.record(t.shard, e.lane[0])
                w._hold(self.n, _Lease(meta, t.k, t.epoch, self._holder, (record, e.lane[1]), time.monotonic(), cancel))
                try:
                    rid = raw_id(e.lane[0])
                except (ValueError, UnicodeDecodeError) as err:
                    outcomes.append(("fail", f"lane entry names no request: {err}", True))
                    continue
            self.ran_us = None
            outcomes.append(self.run_handler(rid, t.priority, e, e.policy(policy), cancel))
            # Sized by the handler's own time, measured in its thread: the hand-over to it and back
            # (and the GIL's other threads) would make a no-op look slow and batches shrink to one.
            us = self.ran_us
            if us is not None:
                self.mean_us = us if self.mean_us is None else 0.8 * self.mean_us + 0.2 * us
                spent_us += us
        return outcomes

    def run_handler(self, rid: str, priority: int, e: _Entry, policy: _Policy, cancel: _Cancel) -> Tuple[Any, ...]:
        try:
            payload = codec.decode(e.payload)
        except Exception as err:  # noqa: BLE001
            return ("fail", f"payload does not decode: {err}", True)
        ctx = Context(rid, e.index, e.attempt, priority, cancel, self.p)
        w = self.w
        ended = threading.Event()
        if w.is_async:
            assert w._loop is not None
            loop = w._loop

            async def runner() -> Any:
                task = asyncio.current_task()
                if task is not None:
                    cancel.on_cancel(lambda: loop.call_soon_threadsafe(task.cancel))
                began = time.monotonic()
                try:
                    return await w.handler(ctx, payload)
                finally:
                    self.ran_us = (time.monotonic() - began) * 1e6
                    ended.set()

            fut: concurrent.futures.Future = asyncio.run_coroutine_threadsafe(runner(), loop)
        else:
            assert self.executor is not None

            def call() -> Any:
                began = time.monotonic()
                try:
                    return w.handler(ctx, payload)
                finally:
                    self.ran_us = (time.monotonic() - began) * 1e6
                    ended.set()

            fut = self.executor.submit(call)
        began = time.monotonic()
        abandoned: Optional[Tuple[Any, ...]] = None
        while not ended.wait(_tick(policy.deadline)):
            if policy.past_deadline():
                # Its ack, past the deadline, ends the request: nothing of this run is recorded,
                # and no attempt is spent.
                log.info("the request's deadline passed; stopping part %d", e.index)
                abandoned = ("skip",)
                break
            if policy.timeout_ms > 0 and time.monotonic() - began >= policy.timeout_ms / 1000:
                abandoned = ("fail", f"attempt timed out after {policy.timeout_ms / 1000:g}s", False)
                break
            if w._stopped_at is not None and time.monotonic() - w._stopped_at >= w.shutdown_grace:
                log.warning("shutdown grace ran out; handing part %d back", e.index)
                abandoned = ("skip",)
                break
        if abandoned is not None:
            # Cancelled and waited for: a handler that ignores it keeps the slot (and the token),
            # so that no other part of the request starts in its place and the limit holds.
            cancel.cancel()
            ended.wait()
            return abandoned
        try:
            result = fut.result(timeout=5)
        except PermanentError as err:
            outcome: Tuple[Any, ...] = ("fail", str(err) or type(err).__name__, True)
        except (asyncio.CancelledError, concurrent.futures.CancelledError):
            outcome = ("fail", "handler task was cancelled", False)
        except Exception as err:  # noqa: BLE001 - a handler's failure is retryable
            outcome = ("fail", str(err) or type(err).__name__, False)
        else:
            try:
                return ("ok", codec.encode(result))
            except Exception as err:  # noqa: BLE001
                return ("fail", f"cannot encode: {err}", True)
        if cancel.is_set():
            # The failure is the cancellation's: no attempt is spent.
            return ("skip",)
        return outcome

    def ack(self, t: _Token, entries: List[_Entry], policy: Optional[_Policy], outcomes: List[Tuple[Any, ...]],
            want: Optional[int]) -> _Next:
        k = self.p.keys
        keys = k.request(t.kid).all()
        lane = lane_of(t.kid)
        if lane is not None:
            keys += [k.events(lane[0]), k.active(lane[0]), k.armed(lane[0])]
        # The next batch comes with flat entries (protocol §5, the hand-out).
        args: List[Any] = self._holding_args(t) + [
            "1" if want is not None else "0", ms(self.w.settings.retention), k.done_channel(), f"{want or 0}|flat",
        ]
        if lane is not None:
            args.append(k.record_prefix(lane[0]))
        for e, o in zip(entries, outcomes):
            pol = e.policy(policy)
            if o[0] == "ok":
                kind, body, delay = "ok", o[1], 0
            elif o[0] == "skip":
                kind, body, delay = "skip", b"", 0
            else:
                record = json.dumps({"error": o[1], "attempts": e.attempt, "permanent": o[2]},
                                    separators=(",", ":"), ensure_ascii=False).encode()
                if pol.is_last(e.attempt, o[2]):
                    log.warning("part %d dead-lettered at attempt %d: %s", e.index, e.attempt, o[1])
                    kind, body, delay = "dead", record, 0
                else:
                    kind, body, delay = "retry", record, pol.backoff_ms(e.attempt)
            args += [e.id, kind, body, delay, e.attempt]
            if lane is not None and e.lane is not None:
                args += [e.lane[0], e.lane[1], e.index]
        func = "lane_ack" if lane is not None else "ack"
        nxt = _parse_next(self.p.conn.fcall(func, keys, args), LANE_ACK if lane is not None else ACK)
        if lane is not None:
            # Lane requests with downstreams that this call finished: their releases are owed (in
            # the outbox, for recovery if this fails), and run here, before the next batch.
            for ukid, ended in nxt.releases:
                self.p.release_owed(lane[0], ukid, ended=ended)
        return nxt

    def settle(self, t: _Token, last: _Next, policy: Optional[_Policy]) -> None:
        shards = policy.shards if policy else 1
        if policy is None and last.finished is not None and last.finished.shards is not None:
            # An acquire that ended the request at its deadline says its shards; no policy came.
            shards = last.finished.shards
        if policy is None and last.park_shards is not None:
            # So does an acquire that parked the token.
            shards = last.park_shards
        if last.tag == "requeue":
            self.give_back(t, last.priority, [last.element])
        elif last.tag == "finished" and last.finished is not None:
            self.p.finish(t.kid, Placement(t.priority, shards, t.group), last.finished)
        elif last.tag == "park" and last.wake_ms > 0:
            self.wake_later(t.kid, shards, last.wake_ms)
        elif last.tag == "fenced":
            self.w.fenced += 1
            log.warning("fenced: this slot no longer holds the token as it was; its results were dropped")
            self.reclaim(t)

    def give_back(self, t: _Token, priority: Optional[int], elements: List[Any]) -> None:
        # The request's priority now, if an operator changed it; a grouped request keeps its own
        # (reprioritize refuses it), and its element goes back to its group's queue.
        same = priority is None or priority == t.priority or t.group is not None
        list_key = t.list if same else self.p.keys.token_list(t.shard, priority)
        _retry_transient("give back", lambda: self.p.give_back(t.shard, list_key, self._holder, str(t.take), elements))

    def wake_later(self, kid: str, shards: int, wake_ms: int) -> None:
        self.w._wake_at(time.monotonic() + wake_ms / 1000, kid, shards)
        _retry_transient("arm", lambda: self.p.arm(kid, shards, wake_ms / 1000))

    def reclaim_own(self, t: _Token, error: Exception) -> None:
        log.warning("a call failed halfway (%s); reclaiming the token", error)
        try:
            self.reclaim(t)
        except Exception as e:  # noqa: BLE001
            self.last_take[t.shard] = None
            log.error("could not reclaim the token; leaving its take record to recovery: %s", e)
            raise
        raise error

    def reclaim(self, t: _Token) -> None:
        """Recovery's step on this slot's own token, armed first (§6.2 step 8)."""
        placement = _retry_transient("placement", lambda: self.p.placement(t.kid))
        shards = placement.shards if placement else 1
        tag, rest = _retry_transient(
            "reclaim",
            lambda: self.p.armed(t.kid, shards, lambda d: self.p.reclaim(t.kid, int(t.k), t.epoch, self._holder, t.list, d)),
        )
        if tag == "push":
            prio = integer(rest[1]) if len(rest) > 1 and rest[1] is not None else None
            self.give_back(t, prio, rest[:1])
        elif tag == "finished":
            self.p.finish_reported(t.kid, Unfinished.parse(rest))
        elif tag == "wake":
            self.wake_later(t.kid, shards, max(1, integer(rest[0] if rest else 1, 1)))
