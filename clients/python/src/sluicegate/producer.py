"""Submitting requests and waiting for them (docs/protocol.md §6.1, §6.7, §6.9, §6.11)."""

from __future__ import annotations

import inspect
import json
import math
import numbers
import time
import uuid
import weakref
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import redis

from . import codec, errors
from ._conn import Conn, fcall_items, integer, retry_transient, text
from ._doorbell import Doorbell
from ._keys import check_group, generate_id, home_shard, key_id, lane_key_id, raw_id, reason_shown
from ._protocol import (
    DEFAULT_PRIORITY,
    MAX_TOKEN_SHARDS,
    Finished,
    Placement,
    Protocol,
    Settings,
    mark_running,
    ms,
    record_meta,
    running_marks,
)

#: A lane request has at most this many parts and payload bytes (src/protocol/lane.rs).
LANE_MAX_PARTS = 64
LANE_MAX_BYTES = 64 << 10
#: Parts and bytes per load call (src/producer.rs).
LOAD_CHUNK = 2000
LOAD_CHUNK_BYTES = 4 << 20
#: Requests per lane_submit_many call (Rust ``BULK_REQUESTS``).
BULK_REQUESTS = 256
#: Parts per stream_append call.
APPEND_CHUNK = 1000
MAX_DELAY_S = 10 * 365 * 24 * 3600
TERMINAL = ("completed", "failed", "cancelled")
#: A request's deadline: seconds from now, or a point in time (a naive ``datetime`` is UTC).
Deadline = Union[float, int, datetime]
#: :attr:`Completion.reason` of a request that ended at its deadline.
DEADLINE_REASON = "deadline"
#: The most upstreams a request can be submitted after (Rust ``MAX_UPSTREAMS``).
MAX_UPSTREAMS = 1000
#: An upstream as ``submit(after=...)`` takes it: a request id, or a handle (its ``id``).
UpstreamRef = Union[str, "RequestHandle", "OpenRequest"]
#: A request's rate limit: at most ``n`` parts start per ``per`` seconds (``(100, 1.0)``: 100 a
#: second).
Rate = Tuple[int, float]
#: A rate limit's bounds (Rust ``RequestBuilder::rate``): 1 to this many parts ...
MAX_RATE_PARTS = 1_000_000
#: ... per 1 ms to a day.
MAX_RATE_PER_S = 24 * 3600


@dataclass
class PartError:
    """Why a part has no result: its error record (docs/protocol.md §4)."""

    message: str
    attempts: int = 0
    permanent: bool = False

    @staticmethod
    def from_record(record: bytes) -> "PartError":
        try:
            v = json.loads(record)
            return PartError(str(v["error"]), int(v.get("attempts", 0)), bool(v.get("permanent", False)))
        except (ValueError, KeyError, TypeError):
            return PartError(text(record))

    def __str__(self) -> str:
        return self.message


@dataclass
class Completion:
    """A finished request: its terminal state, its results in part order (None where a part has
    no result) and the errors of the parts without one, by index. ``reason`` says why a
    ``failed`` request ended when not by its dead letters: ``"deadline"`` (its deadline passed;
    the parts that never ran have an error saying so), or ``"upstream:<id>"`` (an upstream it was
    submitted after failed, naming it by its key id; none of its parts ran); None otherwise."""

    id: str
    state: str
    results: List[Any] = field(default_factory=list)
    errors: Dict[int, PartError] = field(default_factory=dict)
    reason: Optional[str] = None
    #: The request's numbers of parts and of dead-lettered parts, when its results are discarded
    #: (``discard_results``): then ``results`` and ``errors`` are empty, and these counts are all
    #: that is kept to return (Rust ``Completion::total`` and ``failed``, its ``results`` empty).
    counts: Optional[Tuple[int, int]] = None
    #: The part index of ``results[0]`` (Rust ``Completion::first``): the parts before it were read
    #: while the request ran (:meth:`RequestHandle.results_from`), so their outcomes are gone; 0
    #: otherwise. ``errors`` are keyed by part index, so ``results[i - first]`` and ``errors[i]``
    #: are part ``i``'s.
    first: int = 0
    #: The request's dead-lettered parts, as its meta hash counts them, when some parts were read
    #: before the completion (then ``errors`` holds only the unread ones').
    dead_total: Optional[int] = field(default=None, repr=False)

    @property
    def total(self) -> int:
        """The request's number of parts."""
        return self.counts[0] if self.counts is not None else self.first + len(self.results)

    @property
    def failed(self) -> int:
        """Its dead-lettered parts (those read with ``results_from`` included)."""
        if self.counts is not None:
            return self.counts[1]
        return self.dead_total if self.dead_total is not None else len(self.errors)

    @property
    def discarded(self) -> bool:
        """Its results were discarded (``discard_results``): only its counts came back."""
        return self.counts is not None


@dataclass
class ResultsPage:
    """A page of a streamed request's outcomes read while it runs
    (:meth:`RequestHandle.results_from`; Rust ``ResultsPage``): from part ``first`` on, in part
    order, ``results`` (None where a part has no result) and ``errors`` by part index, as in a
    :class:`Completion` (``results[i - first]`` and ``errors[i]`` are part ``i``'s). It ends before
    the first part not settled yet, so it may be empty."""

    first: int
    results: List[Any]
    errors: Dict[int, PartError]
    #: The request's state when the page was read.
    state: str
    #: Its number of parts once no more can be added (finalized, or terminal), else None.
    total: Optional[int]

    @property
    def next_index(self) -> int:
        """Where the next page starts: pass it as ``first``."""
        return self.first + len(self.results)

    @property
    def is_last(self) -> bool:
        """Whether this page reached the last part: nothing more to read."""
        return self.total is not None and self.next_index >= self.total


def _completion(rid: str, state: str, total: int, oks: Dict[int, bytes], errs: Dict[int, bytes],
                reason: Optional[str] = None) -> Completion:
    """The completion from a request's results and error records (Rust ``completion_from``): a
    part with neither never ran, and of a request ended at its deadline, says so."""
    done = Completion(rid, state, reason=reason)
    for i in range(total):
        if i in oks:
            done.results.append(codec.decode(oks[i]))
        else:
            done.results.append(None)
            if i in errs:
                done.errors[i] = PartError.from_record(errs[i])
            elif reason == DEADLINE_REASON:
                done.errors[i] = PartError("not run: the request's deadline passed first", 0, True)
            elif reason is not None and reason.startswith("upstream:"):
                upstream = reason[len("upstream:"):]
                done.errors[i] = PartError(f"not run: its upstream {upstream} did not complete", 0, True)
            else:
                done.errors[i] = PartError(f"no result recorded (request {state})")
    return done


def _by_index(h: Dict[bytes, bytes], prefix: str = "") -> Dict[int, bytes]:
    out: Dict[int, bytes] = {}
    for k, v in h.items():
        name = text(k)
        if prefix:
            if not name.startswith(prefix):
                continue
            name = name[len(prefix):]
        if name.isdigit():
            out[int(name)] = v
    return out


def _lane_total(pol: str) -> int:
    fields = pol.lstrip("f").split(",")
    return int(fields[2]) if len(fields) > 2 and fields[2].isdigit() else 0


class RequestHandle:
    """A submitted request: wait for it, cancel it, read its status."""

    def __init__(self, producer: "Producer", rid: str, lane: bool = False) -> None:
        self.producer = producer
        self.id = rid
        # Submitted as a lane request: its state and results are in its record alone (§6.7).
        self._lane = lane

    def __repr__(self) -> str:
        return f"RequestHandle({self.id!r})"

    def wait(self, timeout: Optional[float] = None) -> Completion:
        return self.producer._wait(self.id, timeout, self._lane)

    def cancel(self) -> str:
        return self.producer.cancel(self.id)

    def results_from(self, first: int, count: int = 1000) -> ResultsPage:
        """:meth:`Producer.results_from` of this request."""
        return self.producer.results_from(self.id, first, count)

    def status(self) -> Dict[str, str]:
        return self.producer.status(self.id)


class OpenRequest:
    """A streamed request open for parts: :meth:`add` them, then :meth:`finalize`."""

    def __init__(
        self, producer: "Producer", rid: str, kid: str, nonce: str, place: Placement, window: Optional[int] = None
    ) -> None:
        self.producer = producer
        self.handle = RequestHandle(producer, rid)
        self.id = rid
        self._kid = kid
        self._nonce = nonce
        self._place = place
        self.added = 0
        #: The window (None: none), and the parts unsettled as the last append or poll said.
        self.window = window
        self.outstanding = 0

    def add(self, parts: Iterable[Any]) -> None:
        """Adds parts (one call per 1,000, or per window when it is smaller); workers may start on
        them at once. With a window, each call first waits until its parts fit."""
        p = self.producer.protocol
        keys = p.keys.request(self._kid).all()
        chunk: List[bytes] = []
        items = iter(parts)
        per_call = APPEND_CHUNK if self.window is None else min(APPEND_CHUNK, self.window)
        while True:
            chunk = [codec.encode(v) for _, v in zip(range(per_call), items)]
            if not chunk:
                return
            if self.window is not None:
                self._wait_for_room(len(chunk))
            first = self.added

            def append(deadline: int, chunk: List[bytes] = chunk, first: int = first) -> Any:
                try:
                    return p.conn.fcall("stream_append", keys, [self._kid, self._nonce, first, deadline, *chunk])
                except Exception as e:  # noqa: BLE001 - mapped below
                    if text(str(e)).startswith("SGSTATE"):
                        raise errors.NotOpen(f'request "{self.id}" is not open for parts') from e
                    raise

            reply = fcall_items(p.armed(self._kid, self._place.shards, append))
            if reply:
                place = self._place
                self._place = Placement(integer(reply[0], place.priority), place.shards, place.group)
            self.added += len(chunk)
            elements = reply[1:]
            if self.window is not None:
                # A windowed append's reply says how many parts are unsettled, before the elements
                # it woke; a re-sent one that added nothing says nothing: the chunk went in.
                if elements:
                    self.outstanding = max(integer(elements[0], 0), 0)
                    elements = elements[1:]
                else:
                    self.outstanding += len(chunk)
            if elements:
                p.push(self._kid, self._place, elements, p.settings.census_interval)

    def _wait_for_room(self, n: int) -> None:
        """Waits until ``n`` more parts fit in the window: until at most ``window - n`` parts are
        unsettled (the count the last append said, then ``outstanding`` every ``window_poll``)."""
        assert self.window is not None
        p = self.producer.protocol
        room = max(self.window - n, 0)
        while self.outstanding > room:
            time.sleep(p.settings.window_poll)
            meta = p.keys.request(self._kid).meta
            left = integer(retry_transient("outstanding", lambda: p.conn.fcall("outstanding", [meta], [], ro=True)), -1)
            if left < 0:
                raise errors.NotOpen(f'request "{self.id}" is not open for parts')
            self.outstanding = left

    def finalize(self) -> RequestHandle:
        """No more parts: the request completes once every part is done. Called again, or its
        call sent again after a lost reply, it answers as the first did. :class:`NotOpen` when
        the request ended before it was finalized (cancelled, failed fast, past its deadline, or
        expired unfinalized)."""
        self.producer._finalize(self._kid, self._nonce)
        return self.handle


class Producer:
    """Submits requests to a sluicegate namespace.

    >>> producer = Producer("redis://127.0.0.1:6379")          # doctest: +SKIP
    >>> producer.submit([{"n": 1}, {"n": 2}], concurrency=2).wait().results  # doctest: +SKIP
    """

    def __init__(
        self,
        url: str,
        namespace: str = "sluicegate",
        *,
        lease: float = 2.0,
        retention: float = 24 * 3600.0,
        loading_ttl: float = 3600.0,
        census_interval: float = 60.0,
        wait_poll: float = 2.0,
        lane_tokens: int = 64,
        token_shards: int = 1,
        window_poll: float = 0.05,
    ) -> None:
        if not 1 <= token_shards <= MAX_TOKEN_SHARDS:
            raise errors.InvalidRequest("token_shards must be from 1 to 1024")
        settings = Settings(
            namespace=namespace,
            lease=lease,
            retention=retention,
            loading_ttl=loading_ttl,
            census_interval=census_interval,
            wait_poll=wait_poll,
            window_poll=window_poll,
            lane_tokens=lane_tokens,
            token_shards=token_shards,
        )
        self.protocol = Protocol(Conn(url), settings)
        self._doorbell = Doorbell(self.protocol.conn, self.protocol.keys.done_channel())
        # A producer dropped without close() ends its subscription (its thread holds the
        # doorbell, not the producer).
        weakref.finalize(self, self._doorbell.close, False)

    def close(self) -> None:
        self._doorbell.close()
        self.protocol.conn.close()

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- submit -----

    def submit(
        self,
        parts: Sequence[Any],
        priority: int = 50,
        concurrency: int = 1,
        id: Optional[str] = None,  # noqa: A002 - the protocol's name
        max_attempts: int = 1,
        delay: Optional[float] = None,
        tags: Sequence[str] = (),
        own_stream: bool = False,
        *,
        backoff: float = 1.0,
        backoff_max: float = 60.0,
        timeout: Optional[float] = None,
        fail_fast: bool = False,
        unlisted: bool = False,
        deadline: Optional[Deadline] = None,
        rate: Optional[Rate] = None,
        after: Iterable[UpstreamRef] = (),
        on_upstream_failure: str = "fail",
        group: Optional[str] = None,
        discard_results: bool = False,
    ) -> RequestHandle:
        """Submits a request whose parts are ``parts`` (JSON-compatible values, or bytes); returns
        once it is durable in Redis. Delays, backoffs and the timeout are in seconds. ``unlisted``
        leaves it out of the listing index (listing and the request counts of stats); everything
        by id works as usual.

        ``deadline`` (seconds from now, or a ``datetime``; a naive one is UTC): past it none of the
        request's parts starts, the handlers still running are cancelled (their parts get no
        result), and the request ends ``failed`` with :attr:`Completion.reason` ``"deadline"``;
        the parts already done keep their results. It is taken against this process's clock once,
        here, and kept in Redis as Redis's now plus what was left. A deadline that has passed, or
        more than ten years ahead, is :class:`InvalidRequest`. A request with a deadline takes a
        stream of its own, never a lane (Rust ``RequestBuilder::deadline``).

        ``rate`` ``(n, per)``: at most ``n`` of the request's parts start per ``per`` seconds,
        across all workers, with bursts of up to ``n`` (over any window W, at most
        ``n * W / per + n``). A start is any hand-out: a first attempt, a retry, a part run again
        after its worker died. The limit is kept in Redis and held by the library's hand-out, so
        workers of either language honour it; it is on top of ``concurrency``. ``n`` is an int
        from 1 to 1,000,000 and ``per`` from 0.001 (1 ms) to 86,400 (a day), kept in whole ms;
        else :class:`InvalidRequest`. A rate-limited request takes a stream of its own, never a
        lane, so it cannot be ``unlisted`` (Rust ``RequestBuilder::rate``).

        ``after`` (request ids, or handles): runs the request only after these requests, its
        upstreams. It is stored at once, in state ``waiting``, and gets its tokens when every one
        of them has completed; handlers can read their results with :meth:`Context.upstream`. With
        ``on_upstream_failure`` ``"fail"`` (the default) an upstream that fails, is cancelled or is
        gone fails this request too, without running it, with :attr:`Completion.reason`
        ``"upstream:<id>"`` (and so do its own downstreams); if that upstream is requeued and then
        completes, this request reopens and runs. With ``"run"`` it runs once every upstream has
        ended, however. Each upstream must exist when this request is submitted (its submit has
        returned), so no cycle can form: an unknown one, or one still being submitted, raises
        :class:`UnknownUpstream` naming it, and nothing of this request is kept. An id given twice
        counts once; at most 1,000 upstreams. Such a request takes a stream of its own, never a
        lane (so it cannot be ``unlisted``), and cannot be delayed or submitted after itself
        (Rust ``RequestBuilder::after`` and ``on_upstream_failure``).

        ``group`` puts the request in a tenant group: at most the group's limit of sub-requests of
        all its requests run at once, across all workers, on top of the request's own
        ``concurrency``; and within a priority the groups with work take turns, so that a tenant
        with a thousand requests queued cannot crowd out one with a single request. The limit is
        set with :meth:`Admin.set_group` (default :data:`DEFAULT_GROUP_LIMIT`, 10). A name is 1 to
        64 ASCII letters, digits, ``.``, ``_`` or ``-``, else :class:`InvalidRequest`. A grouped
        request takes a stream of its own, never a lane (so it cannot be ``unlisted``), and keeps
        the priority it was submitted with (:meth:`Admin.reprioritize` refuses it) (Rust
        ``RequestBuilder::group``).

        ``discard_results``: successful parts' results are never stored (errors are). The request
        still finishes, announces its completion and keeps its status and errors for the
        retention, but Redis neither stores its results nor hands them back: ``wait()`` returns a
        :class:`Completion` with only its counts (:attr:`Completion.total`,
        :attr:`Completion.failed`; :attr:`Completion.discarded` is true). For work whose effect is
        elsewhere, as BullMQ's ``removeOnComplete`` (Rust ``RequestBuilder::discard_results``)."""
        return self._write(_Spec.of(self.protocol.settings, parts, priority, concurrency, id, max_attempts, delay,
                                    tags, own_stream, backoff, backoff_max, timeout, fail_fast, unlisted,
                                    deadline, rate, after, on_upstream_failure, group, discard_results))

    def submit_many(self, requests: Iterable[Dict[str, Any]]) -> List[Union[RequestHandle, errors.SluicegateError]]:
        """Submits several requests at once, as BullMQ's ``addBulk``: each is a dict of
        :meth:`submit`'s arguments (``parts`` and any others by name). Returns one answer per
        request, in order: its handle, or the error that refused it (:class:`DuplicateRequestId`,
        :class:`InvalidRequest`, ...), which is returned rather than raised, so that one refused
        request leaves the others. An error of the connection is raised (which of the requests
        were created is then unknown; a duplicate refusal on submitting them again tells).

        Requests a lane takes (:meth:`submit`'s small ones) go in one ``lane_submit_many`` call per
        up to 256 requests of one priority and home shard (docs/protocol.md §5); an id in use in
        Redis, or earlier in the batch, is refused alone. Any other request goes through
        :meth:`submit`, after them (Rust ``Producer::submit_many``)."""
        p = self.protocol
        s = p.settings
        answers: List[Any] = []
        # Per priority and home shard, the calls' requests, and the payload bytes of the last call.
        calls: Dict[Tuple[int, int], List[List[Tuple[int, _Spec]]]] = {}
        last_bytes: Dict[Tuple[int, int], int] = {}
        others: List[Tuple[int, _Spec]] = []
        for n, request in enumerate(requests):
            answers.append(None)
            try:
                spec = _Spec.named(s, request)
            except errors.SluicegateError as e:
                answers[n] = e
                continue
            if not spec.takes_lane:
                others.append((n, spec))
                continue
            place = (home_shard(spec.kid, s.token_shards), spec.priority)
            batches = calls.setdefault(place, [[]])
            last = batches[-1]
            if len(last) >= BULK_REQUESTS or (last and last_bytes[place] + spec.size > LOAD_CHUNK_BYTES):
                last = []
                batches.append(last)
            last_bytes[place] = (last_bytes[place] if len(last) > 0 else 0) + spec.size
            last.append((n, spec))
        k = p.keys
        for (shard, priority), batches in calls.items():
            lane = lane_key_id(shard, priority)
            for batch in batches:
                keys = k.request(lane).all() + [
                    k.token_list(shard, priority), k.bell(shard), k.active(shard), k.registrations(shard)]
                args: List[Any] = [lane, priority, s.lane_tokens, ms(s.census_interval)]
                for _, spec in batch:
                    keys += [k.record(shard, spec.kid), k.finish_marks(shard, spec.kid)]
                    args += [*spec.lane_args(), len(spec.payloads), *spec.payloads]
                try:
                    reply = fcall_items(p.conn.fcall("lane_submit_many", keys, args))
                except errors.SluicegateError as e:
                    # The call refused as a whole (nothing written): each of its requests says so.
                    for n, _ in batch:
                        answers[n] = e
                    continue
                if len(reply) != len(batch):
                    raise errors.ProtocolError(f"lane_submit_many answered {len(reply)} of {len(batch)} requests")
                for (n, spec), one in zip(batch, reply):
                    refusal = text(one)
                    if refusal.startswith("SGDUPLICATE"):
                        answers[n] = errors.DuplicateRequestId(refusal)
                    elif refusal.startswith("SG"):
                        answers[n] = errors.InvalidRequest(refusal.split(" ", 1)[-1])
                    else:
                        answers[n] = RequestHandle(self, spec.rid, lane=True)
        for n, spec in others:
            try:
                answers[n] = self._write(spec)
            except errors.SluicegateError as e:
                answers[n] = e
        return answers

    def _write(self, spec: "_Spec") -> RequestHandle:
        """Creates the request ``spec`` describes, and queues its tokens."""
        p = self.protocol
        s = p.settings
        priority, concurrency, rid, kid, nonce = spec.priority, spec.concurrency, spec.rid, spec.kid, spec.nonce
        payloads, upstreams, group, due, limit = spec.payloads, spec.upstreams, spec.group, spec.due, spec.limit
        policy, ff, delay, delay_ms, onup = spec.policy, spec.ff, spec.delay, spec.delay_ms, spec.onup
        if spec.takes_lane:
            shard = home_shard(kid, s.token_shards)
            lane = lane_key_id(shard, priority)
            k = p.keys
            keys = k.request(lane).all() + [
                k.record(shard, kid),
                k.token_list(shard, priority),
                k.bell(shard),
                k.active(shard),
                k.registrations(shard),
                k.finish_marks(shard, kid),
                # A reserved slot (a Rust worker's) that waits for one is handed the token.
                k.held(shard),
                k.armed(shard),
                k.offers(shard),
            ]
            args = [lane, kid, rid, spec.nonce_arg(), priority, concurrency, *policy, ff, s.lane_tokens,
                    ms(s.census_interval), spec.row, "", *payloads]
            p.conn.fcall("lane_submit", keys, args)
            return RequestHandle(self, rid, lane=True)
        shards = s.token_shards
        place = Placement(priority, shards, group)
        at, score = p.register(kid, shards, spec.row)
        step_deadline = at + ms(s.loading_ttl) // 2
        keys = p.keys.request(kid).all()
        head = [rid, priority, concurrency, ms(s.loading_ttl), *policy, nonce, delay_ms, ff, shards, step_deadline]
        # After the head: the trace context ('': none), the deadline (ms from now; 0: none), the
        # rate limit ('<n>/<interval ms>'; '': none); for a downstream or a grouped request, its
        # policy for a failed upstream and its upstreams' key ids (may be ''); then its group.
        if not upstreams and group is None and len(payloads) <= LOAD_CHUNK and spec.size <= LOAD_CHUNK_BYTES:
            elements = fcall_items(
                p.conn.fcall("submit_small", keys, [*head, kid, "", _within_ms(due), limit, *payloads])
            )
        else:
            dag = [onup, ",".join(key_id(u) for u in upstreams)] if upstreams or group is not None else []
            if group is not None:
                dag.append(group)
            p.conn.fcall("submit_open", keys, [*head, "", _within_ms(due), limit, *dag])
            links: List[Tuple[str, int, Optional[str]]] = []
            try:
                # Linked after the open (a release from then on reaches it) and before the commit
                # (each upstream exists before it is committed, so no cycle can form); before the
                # load, so that an upstream that cannot be waited for is refused before any part
                # is sent.
                links = p.link_all(kid, shards, upstreams)
                loaded = 0
                while loaded < len(payloads):
                    chunk: List[bytes] = []
                    nbytes = 0
                    while loaded + len(chunk) < len(payloads) and len(chunk) < LOAD_CHUNK and (not chunk or nbytes < LOAD_CHUNK_BYTES):
                        b = payloads[loaded + len(chunk)]
                        chunk.append(b)
                        nbytes += len(b)
                    p.conn.fcall("load_parts", keys, [nonce, loaded, *chunk])
                    loaded += len(chunk)
            except Exception:
                # Nothing of a half-written request is visible to workers; its entries in upstreams'
                # sets of downstreams name no request, and are passed over.
                try:
                    p.conn.fcall("submit_abort", keys, [nonce])
                except Exception:  # noqa: BLE001 - the loading ttl frees it anyway
                    pass
                raise
            # From here on the request may be committed: never delete it on error.
            commit: List[Any] = [kid, len(payloads), nonce]
            if links:
                commit += [ms(s.retention), p.keys.done_channel()]
                for ukid, lifecycle, end in links:
                    status = "w" if end is None else "c" if end == "completed" else "f"
                    commit += [ukid, lifecycle, status, end or ""]
            elements = fcall_items(p.conn.fcall("submit_commit", keys, commit))
            if elements and text(elements[0]) == "finished":
                # An upstream had failed already: it ended at once, failed, and is announced now.
                p.finish(kid, place, Finished.parse(elements[1:]))
                return RequestHandle(self, rid)
        # A delayed request is first looked at (and promoted) when its time comes; one with a
        # deadline no later than that.
        nxt = (delay if delay_ms > 0 else s.census_interval) or s.census_interval
        if due is not None:
            nxt = min(nxt, max(0.001, due - time.monotonic()))
        p.push(kid, place, elements, nxt, first=score)
        return RequestHandle(self, rid)

    def open(
        self,
        priority: int = 50,
        concurrency: int = 1,
        id: Optional[str] = None,  # noqa: A002
        max_attempts: int = 1,
        tags: Sequence[str] = (),
        *,
        backoff: float = 1.0,
        backoff_max: float = 60.0,
        timeout: Optional[float] = None,
        fail_fast: bool = False,
        expire_after: Optional[float] = None,
        unlisted: bool = False,
        deadline: Optional[Deadline] = None,
        rate: Optional[Rate] = None,
        after: Iterable[UpstreamRef] = (),
        group: Optional[str] = None,
        discard_results: bool = False,
        window: Optional[int] = None,
    ) -> OpenRequest:
        """Opens a streamed request (§6.9): runnable at once, complete once finalized and done.
        ``window``: at most this many of its parts unsettled in Redis at once (§6.14, the Rust
        ``RequestBuilder::window``): :meth:`OpenRequest.add` waits, polling every
        ``window_poll``, until its next call's parts fit, so a request of any size runs in
        memory bounded by the window (with ``discard_results``, or its results read at the end,
        which Redis keeps until then).
        ``deadline`` as :meth:`submit`'s: past it, the request ends ``failed`` (reason
        ``"deadline"``) whether finalized or not; :meth:`OpenRequest.add` and
        :meth:`OpenRequest.finalize` are then :class:`NotOpen`, and ``handle.wait()`` returns the
        completion. ``rate``, ``group`` and ``discard_results`` as :meth:`submit`'s. A streamed request cannot be
        submitted ``after`` others (:class:`InvalidRequest`): :meth:`submit` it whole."""
        p = self.protocol
        s = p.settings
        _check(priority, concurrency, max_attempts, backoff, backoff_max, timeout, expire_after)
        if _upstream_ids(after):
            raise errors.InvalidRequest("a streamed request cannot be submitted after others: submit() it whole")
        if group is not None:
            check_group(group)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise errors.InvalidRequest(
                f"a window must allow at least 1 part in Redis (window=0 would never let a part in), not {window!r}"
            )
        due = _deadline_at(deadline)
        limit = _rate_arg(rate)
        rid = id if id is not None else generate_id()
        _check_id(rid)
        kid = key_id(rid)
        nonce = uuid.uuid4().hex
        shards = s.token_shards
        place = Placement(priority, shards, group)
        if unlisted:
            raise errors.InvalidRequest(UNLISTED_LANE_ONLY)
        at, score = p.register(kid, shards, _row("r", priority, concurrency, tags, unlisted))
        step_deadline = at + ms(s.loading_ttl) // 2
        # ... the window (0: none), results kept or discarded, no trace context, the deadline (ms
        # from now), the rate limit, the group ('': none).
        args = [kid, rid, priority, concurrency, ms(s.loading_ttl), max_attempts, ms(timeout or 0), ms(backoff),
                ms(backoff_max), nonce, ms(expire_after or 0), "1" if fail_fast else "0", shards, step_deadline,
                window or 0,
                "1" if discard_results else "0", "", _within_ms(due), limit, group or ""]
        p.conn.fcall("stream_open", p.keys.request(kid).all(), args)
        # Its first look: when it expires unfinalized or reaches its deadline, or the census
        # interval.
        nxt = min(expire_after, s.census_interval) if expire_after else s.census_interval
        if due is not None:
            nxt = min(nxt, max(0.001, due - time.monotonic()))
        p.push(kid, place, [], nxt, first=score)
        return OpenRequest(self, rid, kid, nonce, place, window)

    def _finalize(self, kid: str, nonce: str) -> None:
        finalize_request(self.protocol, kid, nonce)

    # ----- reading -----

    def results_from(self, rid: str, first: int, count: int = 1000) -> ResultsPage:
        """Up to ``count`` outcomes of streamed request ``rid`` from part ``first``, in part order,
        while it runs (§6.14, the Rust ``RequestHandle::results_from``): the page ends before the
        first part not settled yet, so it may be empty (poll again later). Read from 0 on, each
        call from the previous page's ``next_index``, until ``is_last``: asking from ``first`` says
        that you hold every outcome below it, which is then deleted from Redis, so a reader that
        keeps up bounds the results a windowed request keeps. After an error, call again with the
        same ``first``: the page is still there. Results taken this way are not returned again by
        :meth:`wait`, whose results then start at the first part not taken.

        Raises :class:`InvalidRequest` for a request not opened with :meth:`open`, one whose
        results are discarded, or a ``first`` past the parts read so far;
        :class:`UnknownRequest` for an unknown one."""
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise errors.InvalidRequest(f"first is a part index of at least 0, not {first!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise errors.InvalidRequest(f"count is a number of parts of at least 1, not {count!r}")
        p = self.protocol
        kid = key_id(rid)
        try:
            reply = fcall_items(p.conn.fcall("results_from", p.keys.request(kid).all(), [first, count]))
        except errors.InvalidRequest as e:
            raise errors.InvalidRequest(f'request "{rid}": {e}') from e
        except redis.exceptions.ResponseError as e:
            code, _, why = str(e).partition(" ")
            if code == "SGSTATE" and "unknown" in why:
                if p.conn.client.exists(p.keys.record(p.lane_home(kid), kid)):
                    raise errors.InvalidRequest(
                        f'request "{rid}": results_from is for streamed requests (opened with open()); wait() '
                        "returns the results of a submitted one"
                    ) from e
                raise errors.UnknownRequest(f'unknown request "{rid}" (never submitted, or its retention ran out)') from e
            if code in ("SGSTATE", "SGGAP"):
                raise errors.InvalidRequest(f'request "{rid}": {why}') from e
            raise
        state, total, at = text(reply[0]), integer(reply[1], -1), max(integer(reply[2], 0), 0)
        page = ResultsPage(at, [], {}, state, total if total >= 0 else None)
        for j in range(3, len(reply) - 1, 2):
            i, tag, body = at + (j - 3) // 2, text(reply[j]), reply[j + 1]
            if tag == "ok":
                page.results.append(codec.decode(body))
                continue
            page.results.append(None)
            page.errors[i] = PartError.from_record(body) if tag == "err" else PartError(
                f"no result recorded (request {state})"
            )
        return page

    def try_completion(self, rid: str) -> Optional[Completion]:
        """The request's completion if it is terminal, else None."""
        return self._try_completion(rid, False)

    def _try_completion(self, rid: str, lane: bool) -> Optional[Completion]:
        """``try_completion``; ``lane``: known to be a lane request, whose record is read without
        first looking for a meta hash (§6.7)."""
        p = self.protocol
        kid = key_id(rid)
        keys = p.keys.request(kid)
        client = p.conn.client
        state = total = taken = why = discard = failed = None
        if not lane:
            state, total, taken, why, discard, failed = client.hmget(
                keys.meta, ["state", "total", "taken", "why", "discard", "failed"])
        if state is None:
            record = client.hgetall(p.keys.record(home_shard(kid, p.settings.token_shards), kid))
            if not record:
                # Submitted with another shard count than this producer's.
                record = client.hgetall(p.keys.record(p.lane_home(kid), kid))
            if not record or b"state" not in record:
                raise errors.UnknownRequest(f'unknown request "{rid}" (never submitted, or its retention ran out)')
            st = text(record[b"state"])
            if st not in TERMINAL:
                return None
            total = _lane_total(text(record.get(b"pol", b"")))
            if b"discard" in record:
                # It discards its results: its record counts them in ``discard`` (_protocol.record_meta).
                return Completion(rid, st, counts=(total, integer(record.get(b"failed"))))
            return _completion(rid, st, total, _by_index(record, "o"), _by_index(record, "e"))
        st = text(state)
        if st not in TERMINAL:
            return None
        if discard is not None and text(discard) == "1":
            return Completion(rid, st, reason=reason_shown(None if why is None else text(why)),
                              counts=(integer(total), integer(failed)))
        oks = _by_index(client.hgetall(keys.results))
        errs = _by_index(client.hgetall(keys.errors))
        done = _completion(rid, st, integer(total), oks, errs, reason_shown(None if why is None else text(why)))
        first = min(integer(taken), len(done.results))
        if first:
            done.first, done.dead_total = first, integer(failed)
            done.results = done.results[first:]
            done.errors = {i: e for i, e in done.errors.items() if i >= first}
        return done

    def wait(self, rid: str, timeout: Optional[float] = None) -> Completion:
        """Waits for the request to finish (§6.7: subscribed first, then read the durable record,
        again whenever a completion names it or ``wait_poll`` passes). The producer's waits share
        one subscription (``_doorbell.Doorbell``)."""
        return self._wait(rid, timeout, False)

    def _wait(self, rid: str, timeout: Optional[float], lane: bool) -> Completion:
        p = self.protocol
        kid = key_id(rid)
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float:
            if deadline is None:
                return p.settings.wait_poll
            return min(p.settings.wait_poll, max(0.0, deadline - time.monotonic()))

        ring = self._doorbell.listen(kid)
        try:
            # Subscribed before the first read; if the subscription is slow to stand, the read
            # goes ahead and the poll covers a message missed meanwhile.
            self._doorbell.subscribed(left())
            reads = 0
            while True:
                ring.clear()
                done = self._try_completion(rid, lane)
                if done is not None:
                    return done
                # A lane request's first read comes about when a worker takes it; a second one
                # finds a short handler's part acked without waiting for the doorbell (the Rust
                # producer does the same).
                reads += 1
                if lane and reads == 1:
                    continue
                if deadline is not None and time.monotonic() >= deadline:
                    raise errors.WaitTimeout(f'timed out waiting for request "{rid}"')
                ring.wait(left())
        finally:
            self._doorbell.forget(kid, ring)

    def status(self, rid: str) -> Dict[str, str]:
        """The request's meta hash (or lane record) fields as text; raises UnknownRequest."""
        p = self.protocol
        kid = key_id(rid)
        meta = p.conn.client.hgetall(p.keys.request(kid).meta)
        if meta:
            return {text(k): text(v) for k, v in meta.items()}
        home = p.lane_home(kid)
        record = {text(k): v for k, v in p.conn.client.hgetall(p.keys.record(home, kid)).items()}
        if not record:
            raise errors.UnknownRequest(f'unknown request "{rid}"')
        out = {k: text(v) for k, v in record.items()}
        # Handed out without its record: running since its lane's mark says.
        mark_running(out, running_marks(p.conn, p.keys, [(home, kid, record_meta(record))])[0])
        return out

    def cancel(self, rid: str) -> str:
        """Cancels a request (§6.11). Returns ``"cancelled"``, or the state it had finished in."""
        return cancel_request(self.protocol, rid)


def cancel_request(p: Protocol, rid: str) -> str:
    """Cancels request ``rid`` (§6.11): ``"cancelled"``, or the state it had finished in
    (:meth:`Producer.cancel`, :meth:`Admin.cancel`)."""
    kid = key_id(rid)
    placement = p.placement(kid)
    reply = fcall_items(
        p.conn.fcall("cancel", p.keys.request(kid).all(), [kid, ms(p.settings.retention), p.keys.done_channel()])
    )
    tag = text(reply[0]) if reply else "unknown"
    if tag == "finished":
        p.finish(kid, placement or Placement(DEFAULT_PRIORITY, 1), Finished.parse(reply[1:]))
        return "cancelled"
    if tag == "already":
        return text(reply[1]) if len(reply) > 1 else ""
    shard = p.lane_home(kid)
    lane = fcall_items(
        p.conn.fcall("lane_cancel", [p.keys.record(shard, kid), p.keys.events(shard)],
                     [kid, ms(p.settings.retention), p.keys.done_channel()])
    )
    tag = text(lane[0]) if lane else "unknown"
    if tag == "finished":
        if len(lane) > 3 and text(lane[3]) == "rel":
            # It has downstreams: its release is owed (in the outbox), and run here.
            p.release_owed(shard, kid)
        return "cancelled"
    if tag == "already":
        return text(lane[1]) if len(lane) > 1 else ""
    raise errors.UnknownRequest(f'unknown request "{rid}"')


def finalize_request(p: Protocol, kid: str, nonce: str) -> None:
    """``stream_finalize`` of request ``kid`` (``nonce`` empty: an operator's finalize), and its
    finish if that ended it (:meth:`OpenRequest.finalize`, :meth:`Admin.finalize`)."""
    try:
        reply = fcall_items(
            p.conn.fcall("stream_finalize", p.keys.request(kid).all(),
                         [kid, ms(p.settings.retention), p.keys.done_channel(), nonce])
        )
    except Exception as e:  # noqa: BLE001
        if str(e).startswith("SGSTATE"):
            raise errors.NotOpen(f'request "{raw_id(kid)}" is not open') from e
        raise
    if reply and text(reply[0]) == "finished":
        p.finish(kid, p.placement(kid) or Placement(DEFAULT_PRIORITY, 1), Finished.parse(reply[1:]))


#: The refusal of ``unlisted`` for a request that does not take a lane (the Rust message).
UNLISTED_LANE_ONLY = (
    "only a request that takes its priority's lane can be unlisted: at most 64 parts and 64 KB given whole, "
    "not delayed, not own_stream, not opened for streaming, with no deadline or rate limit"
)


#: :meth:`Producer.submit`'s arguments and their defaults, which :meth:`Producer.submit_many` takes by name.
_SUBMIT_ARGS: Dict[str, Any] = {
    name: param.default for name, param in inspect.signature(Producer.submit).parameters.items() if name != "self"
}


@dataclass
class _Spec:
    """A request as :meth:`Producer.submit` was asked for it: checked, its parts encoded."""

    priority: int
    concurrency: int
    given_id: bool
    rid: str
    kid: str
    nonce: str
    payloads: List[bytes]
    size: int
    upstreams: List[str]
    onup: str
    group: Optional[str]
    due: Optional[float]
    limit: str
    policy: List[int]
    #: Its flags as the creating calls take them (``_flags``).
    ff: str
    delay: Optional[float]
    delay_ms: int
    takes_lane: bool
    #: Its row in the listing index ("": unlisted).
    row: str

    @staticmethod
    def of(s: Settings, parts: Sequence[Any], priority: int, concurrency: int, id: Optional[str],  # noqa: A002
           max_attempts: int, delay: Optional[float], tags: Sequence[str], own_stream: bool, backoff: float,
           backoff_max: float, timeout: Optional[float], fail_fast: bool, unlisted: bool,
           deadline: Optional[Deadline], rate: Optional[Rate], after: Iterable[UpstreamRef],
           on_upstream_failure: str, group: Optional[str], discard_results: bool = False) -> "_Spec":
        _check(priority, concurrency, max_attempts, backoff, backoff_max, timeout, delay)
        upstreams = _upstream_ids(after)
        onup = _upstream_policy(on_upstream_failure)
        rid = id if id is not None else generate_id()
        _check_id(rid)
        _check_upstreams(rid, upstreams, delay)
        if group is not None:
            check_group(group)
        due = _deadline_at(deadline)
        limit = _rate_arg(rate)
        payloads = [codec.encode(v) for v in parts]
        if not payloads:
            raise errors.InvalidRequest("a request needs at least one part")
        delay_ms = ms(delay or 0)
        size = sum(len(b) for b in payloads)
        takes_lane = (
            s.lane_tokens > 0 and not own_stream and delay_ms == 0 and due is None and not limit and not upstreams
            and group is None and len(payloads) <= LANE_MAX_PARTS and size <= LANE_MAX_BYTES
        )
        if unlisted and not takes_lane:
            raise errors.InvalidRequest(UNLISTED_LANE_ONLY)
        return _Spec(priority=priority, concurrency=concurrency, given_id=id is not None, rid=rid, kid=key_id(rid),
                     nonce=uuid.uuid4().hex, payloads=payloads, size=size, upstreams=upstreams, onup=onup, group=group, due=due, limit=limit,
                     policy=[max_attempts, ms(timeout or 0), ms(backoff), ms(backoff_max)],
                     ff=_flags(fail_fast, discard_results), delay=delay, delay_ms=delay_ms, takes_lane=takes_lane,
                     row=_row("l" if takes_lane else "r", priority, concurrency, tags, unlisted))

    @staticmethod
    def named(s: Settings, request: Dict[str, Any]) -> "_Spec":
        """A request of :meth:`Producer.submit_many`: :meth:`Producer.submit`'s arguments by name."""
        if not isinstance(request, dict):
            raise errors.InvalidRequest(f"a request of submit_many is a dict of submit's arguments, not {type(request).__name__}")
        known = _SUBMIT_ARGS
        unknown = sorted(set(request) - set(known))
        if unknown:
            raise errors.InvalidRequest(f"submit has no argument {', '.join(map(repr, unknown))}")
        if "parts" not in request:
            raise errors.InvalidRequest("a request of submit_many needs its parts")
        given = {**known, **request}
        return _Spec.of(s, **given)

    def nonce_arg(self) -> str:
        """The submission nonce as the lane calls take it: '' for a generated id (it is unique, so
        a re-sent submit needs no nonce to be known)."""
        return self.nonce if self.given_id else ""

    def lane_args(self) -> List[Any]:
        """Its group of ``lane_submit_many``'s arguments, up to its number of parts."""
        return [self.kid, self.rid, self.nonce_arg(), self.concurrency, *self.policy, self.ff, self.row, ""]


def _flags(fail_fast: bool, discard_results: bool) -> str:
    """A request's flags as ``submit_open``, ``submit_small`` and the lane submits take them
    (prelude.lua ``sg_flags``, Rust ``NewRequest::flags``): ``1`` for fail fast (``0`` for not),
    then ``d`` when its results are discarded."""
    return ("1" if fail_fast else "0") + ("d" if discard_results else "")


def _row(kind: str, priority: int, concurrency: int, tags: Sequence[str], unlisted: bool) -> str:
    """A request's row in the listing index (protocol §5, "Listing"); "" leaves it out."""
    if unlisted:
        if tags:
            raise errors.InvalidRequest("an unlisted request cannot carry tags: tags name sets of the listing index")
        return ""
    return f"{kind}|{priority}|{concurrency}|{','.join(tags)}"


def _check_id(rid: str) -> None:
    if not rid or len(rid.encode("utf-8")) > 512:
        raise errors.InvalidRequest("a request id is a non-empty string of at most 512 bytes")


def _upstream_ids(after: Iterable[UpstreamRef]) -> List[str]:
    """The ids of ``after`` (ids, or handles and open requests: their ``id``), each once, in the
    order given (Rust ``RequestBuilder::after``)."""
    if isinstance(after, (str, bytes)):
        raise errors.InvalidRequest("after takes a list of request ids, not one id: after=[id]")
    out: List[str] = []
    for u in after:
        rid = u if isinstance(u, str) else getattr(u, "id", None)
        if not isinstance(rid, str):
            raise errors.InvalidRequest(f"after takes request ids (or handles), not {type(u).__name__}")
        _check_id(rid)
        if rid not in out:
            out.append(rid)
    return out


def _upstream_policy(policy: str) -> str:
    """``on_upstream_failure`` as ``submit_open`` takes it: ``fail`` or ``run``."""
    if policy not in ("fail", "run"):
        raise errors.InvalidRequest(f"on_upstream_failure is \"fail\" or \"run\", not {policy!r}")
    return policy


def _check_upstreams(rid: str, upstreams: Sequence[str], delay: Optional[float]) -> None:
    """Refuses upstreams a request cannot wait for as built: itself, too many, with a delay (Rust
    ``RequestBuilder::check_upstreams``)."""
    if not upstreams:
        return
    if rid in upstreams:
        raise errors.InvalidRequest(f'request "{rid}" cannot be submitted after itself')
    if len(upstreams) > MAX_UPSTREAMS:
        raise errors.InvalidRequest(
            f"a request can be submitted after at most {MAX_UPSTREAMS} others, not {len(upstreams)}"
        )
    if delay:
        raise errors.InvalidRequest("a request submitted after others cannot be delayed as well")


def _check(priority: int, concurrency: int, max_attempts: int, backoff: float, backoff_max: float,
           timeout: Optional[float], delay: Optional[float]) -> None:
    if not 0 <= priority <= 99:
        raise errors.InvalidRequest("priority must be an integer from 0 to 99")
    if not 1 <= concurrency <= 10_000:
        raise errors.InvalidRequest("concurrency must be an integer from 1 to 10000")
    if not 1 <= max_attempts <= 1000:
        raise errors.InvalidRequest("max attempts must be from 1 to 1000")
    if backoff < 0 or backoff > backoff_max:
        raise errors.InvalidRequest("the backoff base must be at least 0 and at most its cap")
    if timeout is not None and timeout <= 0:
        raise errors.InvalidRequest("a timeout must be longer than 0")
    if delay is not None and not 0 <= delay <= MAX_DELAY_S:
        raise errors.InvalidRequest("a delay must be from 0 to ten years")


def _deadline_at(deadline: Optional[Deadline]) -> Optional[float]:
    """When ``deadline`` falls on this process's ``time.monotonic()`` clock (None: no deadline),
    taken once against the wall clock for a ``datetime``. A deadline that has passed, or more than
    ten years ahead, is :class:`InvalidRequest` (Rust ``RequestBuilder::finish_within``)."""
    if deadline is None:
        return None
    if isinstance(deadline, datetime):
        at = deadline if deadline.tzinfo is not None else deadline.replace(tzinfo=timezone.utc)
        left = (at - datetime.now(timezone.utc)).total_seconds()
    elif isinstance(deadline, (int, float)) and not isinstance(deadline, bool):
        left = float(deadline)
        if math.isnan(left):
            raise errors.InvalidRequest("a deadline must be a number of seconds from now, or a datetime, not NaN")
    else:
        raise errors.InvalidRequest(
            f"a deadline must be a number of seconds from now, or a datetime, not {type(deadline).__name__}"
        )
    if left <= 0:
        raise errors.InvalidRequest(f"the deadline has passed ({-left:.3f}s ago): give a time in the future")
    if left > MAX_DELAY_S:
        raise errors.InvalidRequest(f"the deadline is too far ({left:.0f}s from now): at most ten years ahead")
    return time.monotonic() + left


def _within_ms(due: Optional[float]) -> int:
    """The ms a deadline leaves from now, at least 1, as the creating calls take it (0: none).
    Rounded down, so that Redis's deadline is never later than the one given."""
    if due is None:
        return 0
    return max(1, int((due - time.monotonic()) * 1000))


def _rate_arg(rate: Optional[Rate]) -> str:
    """A rate limit ``(n, per seconds)`` as the creating calls take it, ``"<n>/<interval ms>"``
    ('': none). ``n`` must be an int from 1 to 1,000,000 and ``per`` from 1 ms to a day, else
    :class:`InvalidRequest` in the Rust ``RequestBuilder::rate``'s words. The interval is kept in
    whole ms, rounded down as the Rust client does (after rounding ``per`` to the microsecond, so
    that ``0.3`` is 300 ms whatever its binary fraction)."""
    if rate is None:
        return ""
    bounds = f"a rate is 1 to {MAX_RATE_PARTS} parts per 1 ms to a day"
    if not isinstance(rate, (tuple, list)) or len(rate) != 2:
        raise errors.InvalidRequest(f"{bounds}, not {rate!r}: give (parts, seconds)")
    n, per = rate
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise errors.InvalidRequest(f"{bounds}, not {n!r} per {per!r} s: the parts are a whole number")
    if isinstance(per, bool) or not isinstance(per, numbers.Real):
        raise errors.InvalidRequest(f"{bounds}, not {n!r} per {per!r}: the interval is in seconds")
    n, per = int(n), float(per)
    if not (1 <= n <= MAX_RATE_PARTS and 0.001 <= per <= MAX_RATE_PER_S):
        raise errors.InvalidRequest(f"{bounds}, not {n} per {per!r} s")
    return f"{n}/{max(1, round(per * 1_000_000) // 1000)}"
