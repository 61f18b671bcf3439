"""Operating sluicegate: a request's status, listing requests, tracking, purging, their dead
letters, requeue, priority changes, pause and resume, tenant groups' limits, and schedules (the
Rust ``Admin`` of src/admin.rs, src/admin/listing.rs, src/admin/groups.rs and
src/admin/schedules.rs, call for call; docs/protocol.md §5 "Listing", "Operators" and "Schedules",
§6.12). Schedules are added here as the Rust ``Admin`` adds them (the same stored spec, checked
the same way: cron patterns by ``_cron``, a port of the croner crate's parser), and fired by Rust
workers only."""

from __future__ import annotations

import base64
import json
import numbers
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from redis.cluster import RedisCluster

from . import _cron, codec, errors
from ._conn import Conn, fcall_items, integer, text
from ._keys import check_group, group_shard, home_shard, key_id, lane_key_id, lane_of, raw_id, reason_shown
from ._protocol import (
    MAX_TOKEN_SHARDS,
    LaneSettings,
    Placement,
    Protocol,
    Settings,
    by_shard,
    mark_running,
    ms,
    quoted,
    record_meta,
    refused_state,
    running_marks,
)
from .producer import PartError, Rate, _rate_arg, cancel_request, finalize_request

#: Rows a page holds at most.
MAX_LIST_LIMIT = 1000
#: Index entries one :meth:`Admin.list` call looks at, at most, before it returns what it found
#: with a cursor (a filter that few requests pass would otherwise read the whole index).
MAX_LIST_LOOK = 10_000
#: A tag is 1 to this many bytes.
MAX_TAG_BYTES = 64
#: At most this many errors are listed in a :class:`RequestStatus`.
STATUS_ERRORS = 100
#: Elements per ``relist`` call.
RELIST_CHUNK = 100
#: At most this many downstreams are listed in a :class:`RequestStatus`.
STATUS_DOWNSTREAMS = 100

#: The states :meth:`Admin.list` filters on, and the index set each lives in.
LIST_STATES: Dict[str, str] = {
    "queued": "live",
    "running": "live",
    "scheduled": "live",
    "waiting": "live",
    "open": "live",
    "completed": "completed",
    "failed": "failed",
    "cancelled": "cancelled",
}
_REQUEST_STATES = ("loading", "scheduled", "waiting", "queued", "running", "completed", "failed", "cancelled")
_TERMINAL = ("completed", "failed", "cancelled")
_SCHEDULE_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:/=+-")
#: A schedule's name is 1 to this many bytes (its requests' tag, ``schedule:<name>``, is a tag).
MAX_SCHEDULE_NAME_BYTES = 55
#: The most ticks a schedule catches up on (Rust ``MAX_CATCH_UP``).
MAX_CATCH_UP = 100
#: The most bytes a schedule's spec takes in Redis, its parts included (Rust ``MAX_SPEC_BYTES``).
MAX_SPEC_BYTES = 1 << 20
#: The most tags a request carries (Rust ``MAX_TAGS``); a schedule's carry ``schedule:<name>`` too.
MAX_TAGS = 16
#: A lane request's bounds, which an unlisted schedule's request must fit (src/protocol/lane.rs).
_LANE_MAX_PARTS = 64
_LANE_MAX_BYTES = 64 << 10
#: The longest delay a submit accepts: ten years.
_MAX_DELAY_MS = 10 * 365 * 24 * 3600 * 1000
_TAG_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:/=@+-")
#: A tenant group's limit until an operator sets one (:meth:`Admin.set_group`).
DEFAULT_GROUP_LIMIT = 10
#: The largest group limit.
MAX_GROUP_LIMIT = 10_000
#: The most groups :meth:`Admin.groups` reads.
MAX_GROUPS_LISTED = 1000


@dataclass
class GroupStatus:
    """One tenant group as Redis has it now (the Rust ``GroupStatus``)."""

    #: Its name.
    name: str
    #: The token shard its tokens live on.
    shard: int
    #: At most this many of its sub-requests run at once.
    limit: int
    #: Whether an operator set the limit (else it is :data:`DEFAULT_GROUP_LIMIT`).
    configured: bool
    #: Its tokens held by worker slots: its requests' tokens running now.
    held: int
    #: Its tokens waiting on the shard's priority lists for a slot.
    queued: int
    #: Its tokens parked: it had no work for them.
    parked: int
    #: Its requests' token elements waiting in its queues, ``(priority, count)``, highest first.
    waiting: List[Tuple[int, int]] = field(default_factory=list)
    #: Its tokens waiting for its rate limit to refill (state ``r|...``, in the shard's ``gwake``).
    #: (The Rust struct has this and ``rate`` before ``waiting``; here they come last, with
    #: defaults, so that a ``GroupStatus`` built without them stays valid.)
    rate_waiting: int = 0
    #: Its rate limit (:meth:`Admin.set_group_rate`), if any.
    rate: Optional[RateLimit] = None


@dataclass
class ListedRequest:
    """One request in a :class:`ListPage` (Rust ``ListedRequest``)."""

    id: str
    #: Its state, read from the request itself.
    state: str
    #: Streamed and not finalized.
    open: bool
    priority: int
    #: Its concurrency limit.
    concurrency: int
    #: Parts in all (so far, for an open one).
    total: int
    #: Parts ended (done or dead).
    done: int
    #: Parts dead-lettered.
    failed: int
    #: When it was submitted (Redis time, ms since the epoch).
    submitted_ms: int
    tags: List[str] = field(default_factory=list)
    tracked: bool = False


@dataclass
class Schedule:
    """A schedule as :meth:`Admin.schedules` lists it (the Rust ``Schedule``)."""

    name: str
    #: Its cron pattern.
    cron: str
    #: Its time zone (``None``: UTC).
    time_zone: Optional[str]
    #: ``"skip"`` or ``"catch-up N"``.
    missed: str
    #: When it was added, or last replaced (ms, Redis time): ticks after it are owed.
    added_ms: int
    #: When it was paused, while it is.
    paused_ms: Optional[int]
    #: The next tick not owed yet (ms); ``None`` when paused, and (unlike the Rust ``Admin``,
    #: which computes it from the pattern) before its first firing.
    next_ms: Optional[int]
    #: The latest tick whose request was submitted.
    last_ms: Optional[int]
    #: Ticks owed whose requests are not submitted yet, oldest first.
    owed_ms: List[int]
    #: Parts of each tick's request.
    parts: int
    #: Each tick's request's priority.
    priority: int
    #: Each tick's request's tags (``schedule:<name>`` first; none when unlisted).
    tags: List[str] = field(default_factory=list)
    #: Each tick's request discards its results (``discard_results``).
    discard_results: bool = False


def _whole(v: Any) -> bool:
    """Whether ``v`` is a whole number (an int, not a bool)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _schedule_ms(what: str, seconds: Any) -> int:
    """``seconds`` (a number, at least 0) in whole ms, as a schedule stores a duration."""
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not seconds >= 0:
        raise errors.InvalidSchedule(f"{what} is a number of seconds of at least 0, not {seconds!r}")
    return ms(float(seconds))


def _schedule_spec(
    name: str,
    cron: str,
    parts: Iterable[Any],
    time_zone: Optional[str],
    catch_up: Optional[int],
    priority: int,
    concurrency: int,
    max_attempts: int,
    backoff: float,
    backoff_max: float,
    timeout: Optional[float],
    delay: Optional[float],
    tags: Sequence[str],
    fail_fast: bool,
    own_stream: bool,
    unlisted: bool,
    discard_results: bool = False,
) -> str:
    """A schedule's spec as the Rust ``ScheduleSpec`` stores it (JSON, src/schedule/spec.rs,
    ``Stored``: its fields in that order, compact, so that the very same spec added from Rust or
    the CLI is the same text), checked as the Rust ``ScheduleSpec`` setters, ``validate`` and
    ``Admin::schedule_add``'s check of each tick's request check it, in their words."""
    _check_schedule_name(name)
    if not isinstance(cron, str):
        raise errors.InvalidSchedule(f"a cron pattern is a string, not {cron!r}")
    try:
        _cron.check(cron)
    except ValueError as e:
        raise errors.InvalidSchedule(str(e)) from None
    if catch_up is not None and (not _whole(catch_up) or not 1 <= catch_up <= MAX_CATCH_UP):
        raise errors.InvalidSchedule(f"catch-up {catch_up} is out of range: use 1 to {MAX_CATCH_UP}")
    if time_zone is not None:
        if not isinstance(time_zone, str):
            raise errors.InvalidSchedule(f"a time zone is an IANA name, not {time_zone!r}")
        try:
            _cron.check_zone(time_zone)
        except ValueError as e:
            raise errors.InvalidSchedule(str(e)) from None
    if not _whole(priority) or not 0 <= priority <= 99:
        raise errors.InvalidRequest(f"priority {priority} is out of range: use 0 (lowest) to 99 (highest)")
    if not _whole(concurrency) or not 1 <= concurrency <= 10_000:
        raise errors.InvalidRequest(f"concurrency {concurrency} is out of range: use 1 to 10000")
    if not _whole(max_attempts) or not 1 <= max_attempts <= 1000:
        raise errors.InvalidSchedule(f"max_attempts {max_attempts} is out of range: use 1 to 1000")
    backoff_ms, backoff_max_ms = _schedule_ms("a backoff", backoff), _schedule_ms("a backoff cap", backoff_max)
    if backoff_ms > backoff_max_ms:
        raise errors.InvalidSchedule(f"backoff base {backoff_ms} ms exceeds its cap {backoff_max_ms} ms")
    timeout_ms = None if timeout is None else _schedule_ms("a timeout", timeout)
    if timeout_ms == 0:
        raise errors.InvalidSchedule("a timeout must be longer than zero")
    delay_ms = 0 if delay is None else _schedule_ms("a delay", delay)
    if delay_ms > _MAX_DELAY_MS:
        # (The Rust ``ScheduleSpec`` takes it, and every tick's submit refuses it.)
        raise errors.InvalidSchedule(f"a delay of {delay_ms} ms is too long: at most ten years")
    if isinstance(tags, str):
        raise errors.InvalidRequest("tags takes a list of tags, not one tag: tags=[tag]")
    kept: List[str] = []
    for tag in tags:
        _check_tag(tag)
        if tag not in kept:
            if len(kept) + 1 >= MAX_TAGS:
                raise errors.InvalidSchedule(
                    f"a schedule's request carries at most {MAX_TAGS - 1} tags besides its schedule:<name>"
                )
            kept.append(tag)
    if isinstance(parts, (str, bytes)):
        raise errors.InvalidSchedule("parts takes a list of parts, not one part: parts=[part]")
    encoded = [base64.b64encode(codec.encode(v)).decode("ascii") for v in parts]
    if not encoded:
        raise errors.InvalidSchedule(f"schedule {quoted(name)} has no parts: a request needs at least one")
    if unlisted:
        if kept:
            raise errors.InvalidSchedule("an unlisted schedule's requests cannot carry tags")
        size = sum(len(p) * 3 // 4 for p in encoded)
        if own_stream or delay_ms > 0 or len(encoded) > _LANE_MAX_PARTS or size > _LANE_MAX_BYTES:
            raise errors.InvalidSchedule(
                f"only a small request can be unlisted: at most {_LANE_MAX_PARTS} parts and "
                f"{_LANE_MAX_BYTES >> 10} KB, not delayed, not own_stream"
            )
    stored: Dict[str, Any] = {"cron": cron}
    if time_zone is not None:
        stored["tz"] = time_zone
    stored["missed"] = "skip" if catch_up is None else "catch-up"
    if catch_up is not None:
        stored["catch_up"] = int(catch_up)
    request: Dict[str, Any] = {
        "parts": encoded,
        "priority": int(priority),
        "limit": int(concurrency),
        "max_attempts": int(max_attempts),
        "backoff_ms": backoff_ms,
        "backoff_max_ms": backoff_max_ms,
    }
    if timeout_ms is not None:
        request["timeout_ms"] = timeout_ms
    request.update(
        delay_ms=delay_ms, tags=kept, fail_fast=bool(fail_fast), own_stream=bool(own_stream), unlisted=bool(unlisted)
    )
    if discard_results:
        # (Written only when set, as the Rust ``Template`` does.)
        request["discard_results"] = True
    stored["request"] = request
    text_ = json.dumps(stored, separators=(",", ":"), ensure_ascii=False)
    size = len(text_.encode("utf-8"))
    if size > MAX_SPEC_BYTES:
        raise errors.InvalidSchedule(
            f"schedule {quoted(name)} takes {size} bytes: at most {MAX_SPEC_BYTES} (its parts are stored with it)"
        )
    return text_


def _check_schedule_name(name: str) -> None:
    if not name or len(name.encode()) > MAX_SCHEDULE_NAME_BYTES or not set(name) <= _SCHEDULE_NAME_CHARS:
        raise errors.InvalidSchedule(
            f"invalid schedule name {quoted(name)}: a name is 1 to {MAX_SCHEDULE_NAME_BYTES} characters of "
            "A-Z a-z 0-9 _ . : / = + - (not @, which separates a schedule's name from the tick in its requests' ids)"
        )


def _schedule_from(name: str, spec_json: str, state: Dict[str, str]) -> Schedule:
    spec = json.loads(spec_json)
    request = spec.get("request") or {}
    missed = "skip"
    if spec.get("missed") == "catch-up" and isinstance(spec.get("catch_up"), int):
        # (Rust ``Stored::missed``: the count clamped to 1 to MAX_CATCH_UP.)
        missed = f"catch-up {min(max(int(spec['catch_up']), 1), MAX_CATCH_UP)}"
    tags: List[str] = [] if request.get("unlisted") else [f"schedule:{name}", *request.get("tags", [])]
    num = lambda f: int(state[f]) if state.get(f, "").lstrip("-").isdigit() else None  # noqa: E731
    paused = num("paused")
    return Schedule(
        name=name,
        cron=spec.get("cron", ""),
        time_zone=spec.get("tz"),
        missed=missed,
        added_ms=num("from") or 0,
        paused_ms=paused,
        next_ms=None if paused is not None else num("next"),
        last_ms=num("last"),
        owed_ms=[int(t) for t in state.get("owe", "").split(",") if t.lstrip("-").isdigit()],
        parts=len(request.get("parts", [])),
        priority=int(request.get("priority", 50)),
        tags=tags,
        discard_results=request.get("discard_results") is True,
    )


@dataclass
class ListPage:
    """A page of :meth:`Admin.list`: requests newest first, and the cursor of the next page
    (``None`` when there is no more)."""

    requests: List[ListedRequest]
    cursor: Optional[str]
    #: Index entries looked at to fill the page.
    looked_at: int


@dataclass
class DeadLetter:
    """A dead-lettered part (:meth:`Admin.dead`): its error, and the payload it was submitted with,
    decoded (MessagePack; else its text, or the bytes when they are not text), with ``raw`` as
    stored."""

    index: int
    error: PartError
    payload: Any
    raw: bytes


@dataclass
class SlotWork:
    """What a worker's slot holds a token of now, from its take record (the Rust ``SlotWork``)."""

    #: The slot: ``<worker id>/<slot>``.
    slot: str
    #: The request whose token it holds; None for a lane's token (``lane`` says which).
    request: Optional[str]
    #: For a lane's token, the lane's priority.
    lane: Optional[int]
    #: The token's number.
    token: int
    #: The token shard it was taken from.
    shard: int

    @staticmethod
    def from_record(shard: int, holder: str, record: str) -> Optional["SlotWork"]:
        """A take record (``<kid>|<k>|<epoch>|<take id>|<list>``); None for a record no slot
        knows about any more (``<holder>/lost/<take id>``) or a malformed one."""
        if "/lost/" in holder:
            return None
        fields = record.split("|")
        if len(fields) < 2 or not _digits(fields[1]):
            return None
        lane = lane_of(fields[0])
        try:
            request = None if lane is not None else raw_id(fields[0])
        except (ValueError, UnicodeDecodeError):
            return None
        return SlotWork(holder, request, None if lane is None else lane[1], int(fields[1]), shard)


@dataclass
class WorkerInfo:
    """A live worker (:meth:`Admin.workers`; the Rust ``WorkerInfo``), as it registered."""

    id: str
    #: Handlers it runs at once.
    slots: int
    pid: int
    host: str
    #: When it started (ms since the Unix epoch).
    started_ms: int
    #: The token shards it serves.
    shards: int = 1
    #: When its registration lapses unless it beats again (ms, Redis's clock).
    registration_expires_ms: Optional[int] = None
    #: The sluicegate version it runs (None: it did not say).
    version: Optional[str] = None
    #: What it runs, as its owner described it (``worker --exec`` puts its command line here).
    label: Optional[str] = None
    #: Its slots that hold a token now.
    busy: List[SlotWork] = field(default_factory=list)


@dataclass
class Paused:
    """What an operator paused in a namespace: the whole of it, and priorities one by one
    (highest first)."""

    all: bool = False
    priorities: List[int] = field(default_factory=list)

    def covers(self, priority: int) -> bool:
        """Whether slots take no tokens of ``priority``."""
        return self.all or priority in self.priorities


@dataclass
class IndexedError:
    """One part's error record (Rust ``IndexedError``)."""

    index: int
    #: Its last error.
    error: PartError


@dataclass(frozen=True)
class RateLimit:
    """A request's or a tenant group's rate limit (Rust ``RateLimit``): at most ``n`` parts start
    per ``per_ms`` ms (``Producer.submit(rate=(n, per_ms / 1000))``,
    ``Admin.set_group_rate(name, (n, per_ms / 1000))``)."""

    #: Parts per interval.
    n: int
    #: The interval, in ms.
    per_ms: int


@dataclass
class Upstream:
    """An upstream of a request (:attr:`RequestStatus.upstreams`; Rust ``Upstream``)."""

    #: The upstream request.
    id: str
    #: How it ended, as its downstream heard: None while the downstream waits for it;
    #: ``"completed"``, ``"failed"``, ``"cancelled"``, or ``"gone"`` (nothing of it was left).
    ended: Optional[str] = None


@dataclass
class RequestStatus:
    """A request's state and counters (:meth:`Admin.status`; Rust ``RequestStatus``)."""

    id: str
    #: Where it is in its lifecycle: ``loading``, ``scheduled``, ``waiting`` (for its upstreams),
    #: ``queued``, ``running``, ``completed``, ``failed`` or ``cancelled``.
    state: str
    #: 0 to 99.
    priority: int
    #: Its concurrency limit.
    concurrency: int
    #: Parts in all.
    total: int
    #: Parts that ended: succeeded or dead-lettered (of a request ended at its deadline, only
    #: those settled: the parts that never ran are not done).
    done: int
    #: Parts dead-lettered.
    failed: int
    #: Tokens held by worker slots right now (each runs one part at a time); 0 for a lane request,
    #: whose parts in the lane are not told apart from those running.
    running: int
    #: Parts waiting for a retry or re-delivery.
    retrying: int
    #: A streamed request still open for parts.
    open: bool
    #: A streamed request's window: at most this many of its parts unsettled at once.
    window: Optional[int]
    #: Its results are discarded.
    discard_results: bool
    #: Results handed to its reader by ``results_from`` (the index of the next one to take).
    results_taken: int
    #: Parts that succeeded after more than one attempt.
    succeeded_after_retry: int
    #: Most attempts any part has had so far (failed, retrying or succeeded).
    max_attempts_seen: int
    #: When it was submitted (ms since the Unix epoch, Redis's clock).
    created_ms: int
    #: When its first part started.
    started_ms: Optional[int]
    #: When it turned terminal.
    finished_ms: Optional[int]
    #: Its deadline (ms since the Unix epoch, Redis's clock; ``Producer.submit(deadline=...)``), if
    #: any.
    deadline_ms: Optional[int] = None
    #: Why a ``failed`` request ended, when not by its dead letters: ``"deadline"``.
    reason: Optional[str] = None
    #: Its rate limit (``Producer.submit(rate=...)``), if any.
    rate: Optional[RateLimit] = None
    #: Not terminal, and its priority or the whole namespace is paused (:meth:`Admin.pause`).
    paused: bool = False
    #: Its tags (empty when it has none, or when it is no longer listed).
    tags: List[str] = field(default_factory=list)
    #: Tracked (:meth:`Admin.track`).
    tracked: bool = False
    #: The last error of up to :data:`STATUS_ERRORS` parts (dead letters and pending retries), by
    #: index.
    errors: List[IndexedError] = field(default_factory=list)
    #: The requests it was submitted after (``Producer.submit(after=...)``), in the order given,
    #: each as far as this request has heard of it.
    upstreams: List[Upstream] = field(default_factory=list)
    #: Requests submitted after it: at most :data:`STATUS_DOWNSTREAMS` of them, in no order.
    downstreams: List[str] = field(default_factory=list)
    #: Its tenant group (``Producer.submit(group=...)``), if any.
    group: Optional[str] = None


@dataclass
class Reprioritized:
    """What :meth:`Admin.reprioritize` did (Rust ``Reprioritized``; its ``from`` is ``from_``)."""

    #: The priority the request had.
    from_: int
    #: The priority it has now.
    to: int
    #: Tokens that were waiting in the old priority's lists and wait in the new one's now.
    moved: int
    #: Tokens queued but not found waiting in the old lists (being taken or pushed at that moment,
    #: or deeper than 1,000 elements from either end of a long list): each is taken once more at
    #: the old priority and goes to the new one's list when handed back. Tokens held by slots, or
    #: parked, are counted in neither: they go there at their next hand-back.
    left: int


@dataclass
class _Position:
    """Where a walk of one shard's index stands: the score it reached and how many entries of
    exactly that score it has passed."""

    score: float
    passed: int


@dataclass
class _Row:
    """A request's row in the listing index: ``<kind>|<priority>|<limit>|<tags>``."""

    own: bool
    priority: int
    limit: int
    tags: List[str]

    @staticmethod
    def parse(row: str) -> "_Row":
        bad = errors.ProtocolError(f"malformed listing row {quoted(row)}")
        f = row.split("|", 3)
        if f[0] not in ("r", "l") or len(f) < 3:
            raise bad
        if not (_digits(f[1]) and int(f[1]) <= 255 and _digits(f[2]) and int(f[2]) < 1 << 32):
            raise bad
        tags = [t for t in f[3].split(",") if t] if len(f) > 3 else []
        return _Row(f[0] == "r", int(f[1]), int(f[2]), tags)


@dataclass
class _Listed:
    """One row ``list`` returned."""

    kid: str
    #: The shard whose index listed it: its home shard, where a lane request's record is.
    shard: int
    submitted_ms: int
    row: _Row
    tracked: bool
    #: Resumes right after this row.
    after: _Position


#: One shard's place in a walk: where to resume (a position), "start" or "done".
_Cursor = Any


def _digits(s: str) -> bool:
    return s.isascii() and s.isdigit()


def _opt_digits(s: Optional[str]) -> Optional[int]:
    """``s`` as a whole number that fits 32 bits (a Rust ``u32``), else None."""
    return int(s) if s is not None and _digits(s) and int(s) < 1 << 32 else None


def _check_id(rid: str) -> None:
    """Refuses what the Rust ``RequestId::new`` refuses, in its words."""
    if not rid:
        raise errors.InvalidRequest("a request id cannot be empty")
    n = len(rid.encode("utf-8"))
    if n > 512:
        raise errors.InvalidRequest(f"a request id is at most 512 bytes; this one has {n}")


def _unknown(rid: str) -> errors.UnknownRequest:
    return errors.UnknownRequest(f'no request with id "{rid}" (never submitted, or its results expired)')


def _priority(p: int) -> int:
    if not isinstance(p, int) or not 0 <= p <= 99:
        raise errors.InvalidRequest(f"priority {p} is out of range: use 0 (lowest) to 99 (highest)")
    return p


def _check_tag(tag: str) -> None:
    if not tag or len(tag.encode("utf-8")) > MAX_TAG_BYTES or not all(c in _TAG_CHARS for c in tag):
        raise errors.InvalidRequest(
            f"invalid tag {quoted(tag)}: a tag is 1 to {MAX_TAG_BYTES} characters of A-Z a-z 0-9 _ . : / = @ + -"
        )


def _encode_cursor(cursors: Sequence[_Cursor]) -> Optional[str]:
    if all(c == "done" for c in cursors):
        return None
    parts = []
    for c in cursors:
        if c == "start":
            parts.append("+")
        elif c == "done":
            parts.append("-")
        else:
            parts.append(f"{int(c.score)}.{c.passed}")
    return "l1:" + ",".join(parts)


def _decode_cursor(cursor: str, shards: int) -> List[_Cursor]:
    bad = errors.InvalidCursor(
        f"{quoted(cursor)} is not a list cursor of this namespace's {shards} shard(s): pass a cursor a page gave"
    )
    if not cursor.startswith("l1:"):
        raise bad
    parts = cursor[3:].split(",")
    if len(parts) != shards:
        raise bad
    out: List[_Cursor] = []
    for p in parts:
        if p == "+":
            out.append("start")
        elif p == "-":
            out.append("done")
        else:
            score, dot, passed = p.partition(".")
            negative = score.startswith("-")
            if not dot or not _digits(score[1:] if negative else score) or not _digits(passed):
                raise bad
            out.append(_Position(float(int(score)), int(passed)))
    return out


def _score_text(score: float) -> str:
    return "+inf" if score == float("inf") else str(int(score))


def _parse_score(s: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise errors.ProtocolError(f"list answered the score {quoted(s)}") from None


def _holds(state: str, listed: str, is_open: bool) -> bool:
    """Whether a request in ``listed`` state (open or not) is in the filter's ``state``."""
    if state == "open":
        return is_open and listed not in _TERMINAL
    return listed == state


def _state(name: str) -> str:
    """A request state read back from Redis; the Rust ``RequestState`` parse refuses any other."""
    if name not in _REQUEST_STATES:
        raise errors.ProtocolError(f"unknown request state {quoted(name)}")
    return name


def _not_reprioritized(rid: str, state: str) -> errors.Refused:
    """The refusal of a request in ``state`` (finished, or still loading) to change its priority."""
    if state == "loading":
        return errors.Refused(
            f'request "{rid}" is still being submitted: change its priority once its submit has returned'
        )
    return errors.Refused(f'request "{rid}" has already finished ({state}): its priority can no longer change')


def _status_from(
    rid: str, meta: Dict[str, str], errs: List[IndexedError], running: int, retrying: int
) -> RequestStatus:
    """A request's status from the scalar fields of its meta hash or lane record (both name them
    alike), its error records, and what was counted beside them."""
    num = lambda k: int(meta[k]) if _digits(meta.get(k, "")) else None  # noqa: E731
    state = _state(meta.get("state", ""))
    total = num("total") or 0
    left = num("left")
    left = total if left is None else left
    errs.sort(key=lambda e: e.index)
    # `maxseen` is written only past one attempt: a part settled at its first makes it 1.
    seen = [e.error.attempts for e in errs]
    maxseen = num("maxseen")
    if maxseen is not None:
        seen.append(maxseen & 0xFFFFFFFF)
    max_attempts_seen = max(max(seen, default=0), 1 if left < total else 0)
    window = num("window")
    reason = reason_shown(meta.get("why"))
    # A request ended at its deadline leaves parts that never ran: they are not done.
    ended_whole = state == "completed" or (state == "failed" and reason is None)
    return RequestStatus(
        id=rid,
        state=state,
        priority=(num("prio") or 0) & 0xFF,
        concurrency=(num("limit") or 0) & 0xFFFFFFFF,
        total=total,
        done=total if ended_whole else max(0, total - left),
        failed=num("failed") or 0,
        running=running,
        retrying=retrying,
        open=meta.get("open") == "1",
        window=window if window else None,
        discard_results=meta.get("discard") == "1",
        results_taken=num("taken") or 0,
        succeeded_after_retry=num("retried") or 0,
        max_attempts_seen=max_attempts_seen,
        created_ms=num("created") or 0,
        started_ms=num("started"),
        finished_ms=num("finished"),
        deadline_ms=num("dl"),
        reason=reason,
        rate=_rate_limit(meta.get("rate")),
        errors=errs[:STATUS_ERRORS],
        upstreams=_upstreams_of(meta),
        group=meta.get("grp") or None,
    )


def _upstreams_of(meta: Dict[str, str]) -> List[Upstream]:
    """A downstream's upstreams, from its meta (``ups`` and the fields ``u:<key id>``: ``w|<lc>``,
    ``c|<lc>``, ``f|<lc>|<state>``)."""
    out = []
    for ukid in meta.get("ups", "").split(","):
        if not ukid:
            continue
        try:
            uid = raw_id(ukid)
        except ValueError:
            continue
        f = meta.get(f"u:{ukid}", "").split("|")
        ended = "completed" if f[0] == "c" else f[2] if f[0] == "f" and len(f) > 2 else None
        out.append(Upstream(uid, ended))
    return out


def _rate_limit(rate: Optional[str]) -> Optional[RateLimit]:
    """Meta ``rate``, ``"<n>/<interval ms>"``, as the Rust ``status_from`` reads it: None when
    absent (or not two whole numbers)."""
    n, slash, per = (rate or "").partition("/")
    if not (slash and _digits(n) and _digits(per)):
        return None
    return RateLimit(int(n), int(per))


def _payload(raw: bytes) -> Any:
    """A payload decoded from MessagePack when it is that, else its text (or, for bytes that are
    not text, the bytes), as the ``dead`` command shows it."""
    try:
        return codec.decode(raw)
    except Exception:  # noqa: BLE001 - not MessagePack
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw


def _first_entry_field(reply: Any) -> Optional[bytes]:
    """The value of the first field of the first entry of an XRANGE reply."""
    if not reply:
        return None
    entry = reply[0]
    fields = entry[1] if isinstance(entry, (list, tuple)) and len(entry) > 1 else None
    if isinstance(fields, dict):
        return next(iter(fields.values()), None)
    if isinstance(fields, (list, tuple)) and len(fields) > 1:
        return fields[1]
    return None


def _entry_index(entry: str) -> int:
    """The index of stream entry ``0-<index + 1>``."""
    seq = entry[2:] if entry.startswith("0-") else ""
    if not _digits(seq) or int(seq) < 1:
        raise errors.ProtocolError(f"a dead letter's entry id {quoted(entry)} is not 0-<index + 1>")
    return int(seq) - 1


class Admin:
    """What an operator needs: status, listing, tracking, purging, dead letters, requeue,
    priority changes, pause and resume (the Rust ``Admin``). Give it the namespace's
    ``token_shards``: listing walks that many shards' indexes, and a small request's record is
    found on its home shard among them.

    >>> admin = Admin("redis://127.0.0.1:6379")                # doctest: +SKIP
    >>> page = admin.list(state="failed", limit=20)            # doctest: +SKIP
    >>> for r in page.requests:                                # doctest: +SKIP
    ...     print(r.id, [d.error.message for d in admin.dead(r.id)])
    """

    def __init__(
        self,
        url: str,
        namespace: str = "sluicegate",
        *,
        lease: float = 2.0,
        retention: float = 24 * 3600.0,
        census_interval: float = 60.0,
        lane_tokens: int = 64,
        token_shards: int = 1,
    ) -> None:
        if not 1 <= token_shards <= MAX_TOKEN_SHARDS:
            raise errors.InvalidRequest("token_shards must be from 1 to 1024")
        settings = Settings(
            namespace=namespace,
            lease=lease,
            retention=retention,
            census_interval=census_interval,
            lane_tokens=lane_tokens,
            token_shards=token_shards,
        )
        self.protocol = Protocol(Conn(url), settings)

    def close(self) -> None:
        self.protocol.conn.close()

    def __enter__(self) -> "Admin":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _lane_home(self, kid: str) -> int:
        """The shard holding a lane request's record (``Protocol.lane_home``)."""
        return self.protocol.lane_home(kid)

    def _home(self, kid: str) -> int:
        """The home shard of a request: its own meta says how many shards it was submitted with;
        a lane request (or an unknown one) is homed by this admin's."""
        place = self.protocol.placement(kid)
        return home_shard(kid, place.shards) if place is not None else self._lane_home(kid)

    # ----- status -----

    def status(self, rid: str) -> RequestStatus:
        """The request's state and counters, whether it is paused, and its tags and tracking while
        it is listed. An unknown request is :class:`UnknownRequest`."""
        _check_id(rid)
        kid = key_id(rid)
        status = self._unpaused_status(rid, kid)
        status.paused = status.state not in _TERMINAL and self.paused().covers(status.priority)
        listing = self._listing_of(kid)
        if listing is not None:
            status.tags, status.tracked = listing
        return status

    def _unpaused_status(self, rid: str, kid: str) -> RequestStatus:
        p = self.protocol
        keys = p.keys.request(kid)
        client = p.conn.client
        meta = {text(k): text(v) for k, v in client.hgetall(keys.meta).items()}
        if not meta:
            return self._lane_status(rid, kid)
        state = _state(meta.get("state", ""))
        running = sum(1 for k, v in meta.items() if k.startswith("t") and v.startswith("h|"))
        retrying = 0
        if state not in _TERMINAL:
            # Dead letters wait in the retry set too, at +inf: not counted.
            retrying = client.zcount(keys.retry, "-inf", sys.float_info.max) + client.llen(keys.orphans)
        errs = []
        for index, record in client.hgetall(keys.errors).items():
            if not _digits(text(index)):
                raise errors.ProtocolError(f"an error record's field {quoted(text(index))} is not a part index")
            errs.append(IndexedError(int(text(index)), PartError.from_record(record)))
        status = _status_from(rid, meta, errs, running, retrying)
        shards = max(1, int(meta["shards"])) if _digits(meta.get("shards", "")) else 1
        status.downstreams = self._downstreams_of(kid, home_shard(kid, shards))
        return status

    def _downstreams_of(self, kid: str, home: int) -> List[str]:
        """Up to :data:`STATUS_DOWNSTREAMS` downstreams of request ``kid``, homed on ``home`` (one
        page of its set, as the Rust ``Admin`` reads it)."""
        _, entries = self.protocol.downstreams_page(home, kid, 0)
        out = []
        for entry in entries:
            dkid, bar, _ = entry.rpartition("|")
            if not bar:
                continue
            try:
                out.append(raw_id(dkid))
            except ValueError:
                continue
        return out[:STATUS_DOWNSTREAMS]

    def _lane_status(self, rid: str, kid: str) -> RequestStatus:
        """``status`` of a lane request, from its record: ``running`` is not counted (its parts in
        the lane are not told apart from those running), ``retrying`` counts parts whose last
        attempt failed and that are not dead."""
        p = self.protocol
        home = self._lane_home(kid)
        record = {text(k): v for k, v in p.conn.client.hgetall(p.keys.record(home, kid)).items()}
        if not record:
            raise _unknown(rid)
        meta = record_meta(record)
        mark_running(meta, running_marks(p.conn, p.keys, [(home, kid, meta)])[0])
        state = _state(meta.get("state", ""))
        errs = [
            IndexedError(int(k[1:]), PartError.from_record(v))
            for k, v in record.items()
            if k.startswith("e") and _digits(k[1:])
        ]
        dead = sum(1 for k in record if k.startswith("x"))
        retrying = 0 if state in _TERMINAL else max(0, len(errs) - dead)
        status = _status_from(rid, meta, errs, 0, retrying)
        if "dn" in record:
            status.downstreams = self._downstreams_of(kid, home)
        return status

    def _listing_of(self, kid: str) -> Optional[Tuple[List[str], bool]]:
        """The tags and tracking of a listed request (None when it is not listed)."""
        p = self.protocol
        home = self._home(kid)
        row = p.conn.client.hget(p.keys.index_rows(home), kid)
        if row is None:
            # A lane request without tags: its record's `ix` says it is listed, and it has no tags
            # (a record an earlier version wrote keeps "<submitted ms>|<row>" there).
            kept = p.conn.client.hget(p.keys.record(home, kid), "ix")
            if kept is None:
                return None
            row = text(kept).split("|", 1)[1] if "|" in text(kept) else "l|0|1|"
        tags = _Row.parse(text(row)).tags
        tracked = p.conn.client.zscore(p.keys.index_set(home, "tracked"), kid)
        return tags, tracked is not None

    # ----- listing -----

    def list(
        self,
        state: Optional[str] = None,
        priority: Optional[int] = None,
        tag: Optional[str] = None,
        tracked: bool = False,
        older_than: Optional[float] = None,
        limit: int = 100,
        cursor: Optional[str] = None,
    ) -> ListPage:
        """Requests newest first, filtered by state (``queued``, ``running``, ``scheduled``,
        ``waiting``, ``open``, ``completed``, ``failed``, ``cancelled``), priority, tag, tracking and age
        (``older_than`` seconds), ``limit`` (1 to 1,000) a page, from the listing index of each
        home shard. Pass a page's ``cursor`` to get the next one. A filter few requests pass looks
        at up to 10,000 entries and returns what it found with a cursor to go on.

        Queued, running, scheduled, waiting and open requests share the index's ``live`` set and
        are told apart by the request's own state, so those filters look at the live requests in
        turn."""
        if not isinstance(limit, int) or not 0 < limit <= MAX_LIST_LIMIT:
            raise errors.InvalidRequest(f"a page holds 1 to {MAX_LIST_LIMIT} requests")
        if tag is not None:
            _check_tag(tag)
        if state is not None and state not in LIST_STATES:
            raise errors.InvalidRequest(
                f"unknown state {quoted(state)}: one of queued, running, scheduled, waiting, open, completed, failed, "
                "cancelled"
            )
        if priority is not None:
            _priority(priority)
        shards = self.protocol.settings.token_shards
        cursors: List[_Cursor] = _decode_cursor(cursor, shards) if cursor is not None else ["start"] * shards
        states = [LIST_STATES[state]] if state is not None else []
        if tag is not None:
            walk = [f"t:{tag}"]
        elif tracked:
            walk = ["tracked"]
        elif not states:
            walk = ["live", "completed", "failed", "cancelled"]
        else:
            walk = list(states)
        # A live state is told apart after reading the request: look further for each page.
        post_filter = state if state is not None and LIST_STATES[state] == "live" else None
        if post_filter is not None or priority is not None or tag is not None:
            budget = min(max(limit * 4, 1000), 5000)
        else:
            budget = limit
        page: List[ListedRequest] = []
        looked = 0
        while len(page) < limit and looked < MAX_LIST_LOOK:
            need = limit - len(page)
            found: List[Tuple[int, _Listed]] = []
            # Per shard walked: where its walk stopped (None: at the end of its sets).
            ends: List[Optional[Tuple[Optional[_Position]]]] = [None] * shards
            for shard in range(shards):
                at = cursors[shard]
                if at == "done":
                    continue
                rows, nxt, n = self._list_shard(
                    shard, walk, states, None if at == "start" else at, older_than, need, max(budget, need),
                    priority, tracked,
                )
                looked += n
                ends[shard] = (nxt,)
                found.extend((shard, r) for r in rows)
            if all(e is None for e in ends):
                break
            # Newest first over the shards; take what the page needs, and each shard resumes right
            # after the last row taken from it (or where its walk stopped, if all were).
            found.sort(key=lambda sr: (sr[1].submitted_ms, sr[1].kid), reverse=True)
            taken = found[:need]
            for shard in range(shards):
                end = ends[shard]
                if end is None:
                    continue
                returned = sum(1 for s, _ in found if s == shard)
                mine = [r for s, r in taken if s == shard]
                if len(mine) < returned:
                    if mine:
                        cursors[shard] = mine[-1].after
                else:
                    cursors[shard] = "done" if end[0] is None else end[0]
            rows = self._read_rows([r for _, r in taken])
            page.extend(r for r in rows if post_filter is None or _holds(post_filter, r.state, r.open))
            if all(c == "done" for c in cursors):
                break
        return ListPage(page, _encode_cursor(cursors), looked)

    def _list_shard(
        self, shard: int, walk: List[str], states: List[str], start: Optional[_Position], older_than: Optional[float],
        limit: int, budget: int, priority: Optional[int], tracked: bool,
    ) -> Tuple[List[_Listed], Optional[_Position], int]:
        """``list`` on ``shard`` (FCALL_RO): its rows, where its next page starts (None at the end),
        and how many entries it looked at."""
        p = self.protocol
        score, passed = (_score_text(start.score), start.passed) if start is not None else ("+inf", 0)
        args: List[Any] = [
            ",".join(walk),
            ",".join(states),
            score,
            passed,
            "" if older_than is None else ms(older_than),
            limit,
            budget,
            "" if priority is None else str(priority),
            "",  # a tag is walked (its own set), never filtered for
            "1" if tracked else "",
        ]
        items = fcall_items(p.conn.fcall("list", [p.keys.index_rows(shard)], args, ro=True))
        if len(items) < 3 or (len(items) - 3) % 7 != 0:
            raise errors.ProtocolError(f"list answered {len(items)} items")
        next_score = text(items[0])
        nxt = None if next_score == "" else _Position(_parse_score(next_score), max(0, integer(items[1])))
        looked = max(0, integer(items[2]))
        rows = []
        for i in range(3, len(items), 7):
            r = items[i : i + 7]
            rows.append(
                _Listed(
                    text(r[0]),
                    shard,
                    integer(r[1]),
                    _Row.parse(text(r[2])),
                    integer(r[4]) == 1,
                    _Position(_parse_score(text(r[5])), max(0, integer(r[6]))),
                )
            )
        return rows, nxt, looked

    def _read_rows(self, rows: List[_Listed]) -> List[ListedRequest]:
        """The counters of listed rows, read from each request's own keys in one pipeline. A row
        whose request is gone (expired, purged, or never created) is left out."""
        if not rows:
            return []
        p = self.protocol
        own_fields = ["state", "total", "left", "failed", "open", "why"]
        lane_fields = ["state", "left", "failed", "pol", "lc"]
        pipe = p.conn.client.pipeline(transaction=False)
        for r in rows:
            if r.row.own:
                pipe.hmget(p.keys.request(r.kid).meta, own_fields)
            else:
                # Where it was listed, not where this admin's shard count would put it: the two
                # differ while a change of token shards rolls out.
                pipe.hmget(p.keys.record(r.shard, r.kid), lane_fields)
        read = []
        for r, values in zip(rows, pipe.execute()):
            names = own_fields if r.row.own else lane_fields
            got = {n: v for n, v in zip(names, values) if v is not None}
            if "state" not in got:
                continue
            read.append((r, {k: text(v) for k, v in got.items()} if r.row.own else record_meta(got)))
        # A lane request handed out without its record reads running from its lane's mark.
        lanes = [(r.shard, r.kid, meta) for r, meta in read if not r.row.own]
        marks = iter(running_marks(p.conn, p.keys, lanes))
        out = []
        for r, meta in read:
            if not r.row.own:
                mark_running(meta, next(marks))
            st = meta["state"]
            if st not in _REQUEST_STATES or st == "loading":
                continue
            num = lambda k: int(meta[k]) if _digits(meta.get(k, "")) else None  # noqa: E731
            total = num("total") or 0
            left = num("left")
            left = total if left is None else left
            # As status counts it: a request ended at its deadline, or by an upstream, leaves parts
            # that never ran, which are not done.
            ended_whole = st == "completed" or (st == "failed" and "why" not in meta)
            done = total if ended_whole else max(0, total - left)
            try:
                rid = raw_id(r.kid) or r.kid
            except ValueError:
                rid = r.kid
            out.append(
                ListedRequest(
                    id=rid,
                    state=st,
                    open=meta.get("open") == "1",
                    priority=r.row.priority,
                    concurrency=r.row.limit,
                    total=total,
                    done=done,
                    failed=num("failed") or 0,
                    submitted_ms=r.submitted_ms,
                    tags=r.row.tags,
                    tracked=r.tracked,
                )
            )
        return out

    def track(self, rid: str, on: bool = True) -> None:
        """Marks a request as tracked (``list(tracked=True)`` shows it), or unmarks it (``on``
        false). An unknown request, or a finished one past its retention, is
        :class:`UnknownRequest` (the Rust ``track`` returns nothing either)."""
        _check_id(rid)
        kid = key_id(rid)
        if not self.protocol.track(self._home(kid), kid, on):
            raise _unknown(rid)

    # ----- purge -----

    def purge_finished(self, state: str, older_than: float = 0.0) -> int:
        """Purges every finished request in ``state`` (``completed``, ``failed`` or
        ``cancelled``) submitted at least ``older_than`` seconds ago, walking the listing index a
        page at a time (never a scan), as the Rust ``Admin::purge_finished`` and ``sluicegate purge
        --state``; returns how many were purged. Requests whose finish is still being recorded are
        left for a later run."""
        if state not in ("completed", "failed", "cancelled"):
            raise errors.InvalidRequest(
                f"only finished requests are purged (completed, failed or cancelled), not {state}"
            )
        purged = 0
        refused: set = set()
        while True:
            # From the newest each time: what was purged has left the index.
            page = self.list(state=state, older_than=older_than or None, limit=MAX_LIST_LIMIT)
            ids = [r.id for r in page.requests if r.id not in refused]
            if not ids:
                return purged
            for rid in ids:
                try:
                    purged += int(self.purge(rid))
                except errors.Refused:
                    refused.add(rid)

    def purge(self, rid: str) -> bool:
        """Deletes a finished request's keys now rather than at the end of its retention, and takes
        it out of the listing index. Returns False when there was nothing to delete (unknown, or
        already expired). A request that has not finished is :class:`Refused`: cancel it first."""
        _check_id(rid)
        p = self.protocol
        kid = key_id(rid)
        unfinished = errors.Refused(
            f'request "{rid}" has not finished (or its finish is still being recorded): cancel it first'
        )
        place = p.placement(kid)
        if place is not None:
            home = home_shard(kid, place.shards)
            # Out of the index, its finish is recorded: a release it owes is in the outbox already,
            # and nothing adds one now that it has finished (until a requeue, which `purge` refuses
            # to race: the request is not finished then).
            if (
                p.conn.client.zscore(p.keys.active(home), kid) is not None
                or p.conn.client.zscore(p.keys.releases(home), kid) is not None
            ):
                raise unfinished
            purge_keys, purge_args = p.keys.request(kid).all(), []
        else:
            # A lane request's record, unless its release to its downstreams is owed (in `purge`).
            home = self._lane_home(kid)
            purge_keys, purge_args = [p.keys.record(home, kid), p.keys.releases(home)], [kid]
        # A refusal by `purge` or `unlist` (its state not terminal) says the same, with the id.
        try:
            return self._unlist(home, kid, p.purge(purge_keys, purge_args))
        except errors.Refused as e:
            raise unfinished from e

    def _unlist(self, home: int, kid: str, purged: bool) -> bool:
        """The index's half of a purge, after ``purge`` answered ``purged``. Refused when the id is
        in use again: by a request that was live all along (nothing was purged), or by a new request
        submitted once the keys were gone, which lists itself in the purged one's place (then the
        purge is done)."""
        try:
            self.protocol.unlist(home, kid)
        except errors.Refused:
            if purged:
                return True
            raise
        return purged

    # ----- dead letters and requeue -----

    def dead(self, rid: str) -> List[DeadLetter]:
        """The request's dead letters, by index: each one's error and payload (what
        :meth:`requeue` would run again). Empty for a request without any; an unknown request is
        :class:`UnknownRequest`."""
        _check_id(rid)
        p = self.protocol
        kid = key_id(rid)
        keys = p.keys.request(kid)
        client = p.conn.client
        if not client.exists(keys.meta):
            return self._lane_dead(rid, kid)
        # Dead letters wait in the retry set with an infinite score; their payloads stay pending in
        # the stream (entry `0-<index + 1>`), their errors in the errors hash.
        ids = [text(e) for e in client.zrangebyscore(keys.retry, "+inf", "+inf")]
        dead = []
        for start in range(0, len(ids), 1000):
            chunk = ids[start : start + 1000]
            pipe = client.pipeline(transaction=False)
            for entry in chunk:
                pipe.xrange(keys.stream, entry, entry)
                pipe.hget(keys.errors, _entry_index(entry))
            replies = pipe.execute()
            for n, entry in enumerate(chunk):
                # Gone meanwhile (requeued and run, say): not a dead letter any more.
                raw = _first_entry_field(replies[2 * n])
                if raw is None:
                    continue
                record = replies[2 * n + 1] or b""
                dead.append(DeadLetter(_entry_index(entry), PartError.from_record(record), _payload(raw), raw))
        dead.sort(key=lambda d: d.index)
        return dead

    def _lane_dead(self, rid: str, kid: str) -> List[DeadLetter]:
        """``dead`` of a lane request: its record keeps a dead part's payload (``x<index>``) and
        error record (``e<index>``)."""
        p = self.protocol
        record = {text(k): v for k, v in p.conn.client.hgetall(p.keys.record(self._lane_home(kid), kid)).items()}
        if not record:
            raise _unknown(rid)
        dead = []
        for k, raw in record.items():
            if k.startswith("x") and _digits(k[1:]):
                index = int(k[1:])
                error = PartError.from_record(record.get(f"e{index}", b""))
                dead.append(DeadLetter(index, error, _payload(raw), raw))
        dead.sort(key=lambda d: d.index)
        return dead

    def cancel(self, rid: str) -> str:
        """Cancels a request (the Rust ``Admin::cancel``; §6.11): no part of it starts any more,
        running handlers are told to stop, and it ends ``cancelled``. Returns ``"cancelled"``, or
        the state it had already finished in. Raises :class:`UnknownRequest`."""
        _check_id(rid)
        return cancel_request(self.protocol, rid)

    def finalize(self, rid: str) -> None:
        """Finalizes a streamed request whose producer is gone (the Rust ``Admin::finalize``): no
        more parts will come, and it completes once the parts it has are done. Raises
        :class:`NotOpen` when it is not open for parts (finalized already, finished, or
        unknown)."""
        _check_id(rid)
        finalize_request(self.protocol, key_id(rid), "")

    def requeue(self, rid: str) -> int:
        """Hands a request's dead letters out again, each with a fresh set of attempts; a failed
        request reopens and will end with a new terminal record (the Rust ``requeue_dead``).
        Returns how many were requeued. :class:`NoDeadLetters` unless the request is failed,
        running or queued; :class:`Refused` for one that ended at its deadline (it would end again
        at once: submit it again instead); :class:`UnknownRequest` for an unknown one."""
        _check_id(rid)
        p = self.protocol
        kid = key_id(rid)
        place = p.placement(kid)
        if place is None:
            # A lane request's record holds its dead letters.
            home = self._lane_home(kid)
            pol = p.conn.client.hget(p.keys.record(home, kid), "pol")
            prio = LaneSettings.parse(text(pol)).values[0] if pol is not None else None
            if prio is None or prio > 99:
                raise _unknown(rid)
            return self._lane_requeue(rid, kid, home, prio)
        # A failed request is reopened only after its own lifecycle is announced and sealed, and
        # after `reopen` indexed it again and marked the new lifecycle (Protocol.requeue). Its
        # downstreams that it failed reopen once it completes (its release).
        return p.requeue(kid, place)

    def _lane_requeue(self, rid: str, kid: str, home: int, priority: int) -> int:
        """``lane_requeue`` of lane request ``kid``: the function pushes the lane tokens it wakes."""
        p = self.protocol
        k = p.keys
        lane = lane_key_id(home, priority)
        keys = k.request(lane).all() + [
            k.record(home, kid), k.token_list(home, priority), k.bell(home), k.active(home),
        ]
        args = [lane, kid, max(1, p.settings.lane_tokens), ms(p.settings.census_interval)]
        try:
            reply = fcall_items(p.conn.fcall("lane_requeue", keys, args))
        except Exception as e:
            if refused_state(e):
                raise errors.NoDeadLetters(rid) from e
            raise
        return max(0, integer(reply[0])) if reply else 0

    # ----- priority -----

    def reprioritize(self, rid: str, priority: int) -> Reprioritized:
        """Changes the priority of a request that is queued or running (also a delayed one, or a
        streamed one still open): :meth:`status` shows the new priority at once.

        Its tokens waiting in the old priority's lists move to the new one's now (``relist``), each
        keeping its place in time; a token held by a worker slot goes to the new priority's list
        when the slot hands it back, a parked one when it is woken. Nothing is pushed: no token is
        ever in two lists or in none.

        :class:`Refused` for a request that has finished or is still being submitted, and for a
        small request that took its priority's lane (submit with ``own_stream=True`` to be able to
        change a small request's priority). A request in a tenant group keeps the priority it was
        submitted with: :class:`Refused`, in the library's words. An unknown id is
        :class:`UnknownRequest`."""
        _check_id(rid)
        _priority(priority)
        p = self.protocol
        kid = key_id(rid)
        try:
            r = p.reprioritize(kid, priority)
        except errors.InvalidRequest as e:
            # (The library's SGINVALID: a request in a tenant group keeps its priority. Refused,
            # as the Rust Admin::reprioritize says it.)
            raise errors.Refused(str(e)) from None
        if r.tag == "refused":
            raise _not_reprioritized(rid, r.state)
        if r.tag == "unknown":
            raise self._lane_not_reprioritized(rid, kid)
        queued = 0 if r.old == priority else len(r.elements)
        moved = 0
        # The listing index shows (and filters by) the new priority.
        p.relabel(home_shard(kid, r.shards), kid, priority)
        if r.old != priority:
            # Each shard's elements in its own calls (their lists share that shard's hash tag), a
            # bounded number per call: each call scans near the ends of the lists.
            for shard, group in sorted(by_shard(kid, Placement(r.old, r.shards), r.elements).items()):
                for start in range(0, len(group), RELIST_CHUNK):
                    moved += p.relist(shard, r.old, priority, group[start : start + RELIST_CHUNK])
        return Reprioritized(r.old, priority, moved, max(0, queued - moved))

    def _lane_not_reprioritized(self, rid: str, kid: str) -> errors.SluicegateError:
        """Why a request without keys of its own cannot be reprioritized: it is a lane request
        (live or finished), or unknown."""
        p = self.protocol
        record = {text(k): v for k, v in p.conn.client.hgetall(p.keys.record(self._lane_home(kid), kid)).items()}
        if not record:
            return _unknown(rid)
        meta = record_meta(record)
        state = meta.get("state", "")
        if state not in ("queued", "running"):
            return _not_reprioritized(rid, state)
        prio = meta.get("prio", "?")
        return errors.Refused(
            f'request "{rid}" is a small request that shares the lane of priority {prio} with others: its '
            f"sub-requests already wait in that lane, so its priority cannot be changed and it runs at priority "
            f"{prio}; submit small requests with their own stream (RequestBuilder::own_stream) to be able to "
            f"change their priority, or cancel this one and submit it again"
        )

    # ----- tenant groups -----

    def set_group(self, name: str, limit: int) -> None:
        """Sets tenant group ``name``'s limit: at most ``limit`` (1 to :data:`MAX_GROUP_LIMIT`)
        sub-requests of all its requests run at once (``Producer.submit(group=...)``). Takes effect
        at once: a raised limit adds tokens, a lowered one retires tokens as they come back
        (running parts are never stopped). A bad name or limit is :class:`InvalidRequest` (the
        Rust ``Admin::set_group``)."""
        check_group(name)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_GROUP_LIMIT:
            raise errors.InvalidRequest(f"a group limit is from 1 to {MAX_GROUP_LIMIT}, not {limit!r}")
        p = self.protocol
        p.group_set(group_shard(name, p.settings.token_shards), name, limit)

    def set_group_rate(self, name: str, rate: Optional[Rate]) -> None:
        """Sets tenant group ``name``'s rate limit: at most ``n`` of its parts start per ``per``
        seconds, ``rate=(n, per)``, across all workers (a token bucket in Redis, refilled by time,
        with bursts of up to ``n``; a slot that finds it empty waits for the refill, no polling).
        ``None`` removes it. ``n`` an int from 1 to 1,000,000 and ``per`` from 0.001 (1 ms) to
        86,400 (a day), kept in whole ms as ``Producer.submit(rate=...)``'s; anything else raises
        :class:`InvalidRequest` ("a rate is 1 to 1000000 parts per 1 ms to a day, not ..."), as a
        bad name does. Each part of a rate-limited group is started by a take of its own (one
        part per turn). Kept in the shard's ``gconf`` (``<name>:rate``) and applied at once to a
        group in use; its limit is left as it is (the Rust ``Admin::set_group_rate``)."""
        check_group(name)
        change = "none" if rate is None else _rate_arg(rate)
        p = self.protocol
        p.group_set(group_shard(name, p.settings.token_shards), name, None, change)

    def group(self, name: str) -> GroupStatus:
        """Tenant group ``name`` now (a group nobody used nor configured reads as idle, with the
        default limit). The group's shard follows from this admin's ``token_shards``, which must be
        the namespace's."""
        check_group(name)
        p = self.protocol
        k = p.keys
        client = p.conn.client
        shard = group_shard(name, p.settings.token_shards)
        fields = {text(f): text(v) for f, v in client.hgetall(k.group(shard, name)).items()}
        configured, rate_set = client.hmget(k.group_limits(shard), [name, f"{name}:rate"])
        configured_limit = _opt_digits(None if configured is None else text(configured))
        limit = _opt_digits(fields.get("limit"))
        if limit is None:
            limit = configured_limit if configured_limit is not None else DEFAULT_GROUP_LIMIT
        # The meta's rate when the group is in use, else the one set for it.
        rate = _rate_limit(fields["rate"] if "rate" in fields else (None if rate_set is None else text(rate_set)))
        held = queued = parked = rate_waiting = 0
        for f, v in fields.items():
            if not (f.startswith("t") and _digits(f[1:])):
                continue
            kind = v.split("|", 1)[0]
            if kind == "h":
                held += 1
            elif kind == "q":
                queued += 1
            elif kind == "p":
                parked += 1
            elif kind == "r":
                rate_waiting += 1
        waiting: List[Tuple[int, int]] = []
        for prio in (text(v) for v in client.zrevrange(k.group_work(shard, name), 0, -1)):
            if not _digits(prio) or int(prio) > 99:
                continue
            n = integer(client.llen(k.group_queue(shard, name, int(prio))))
            if n > 0:
                waiting.append((int(prio), n))
        return GroupStatus(
            name, shard, limit, configured_limit is not None, held, queued, parked, waiting, rate_waiting, rate
        )

    def groups(self) -> List[GroupStatus]:
        """Every tenant group in use or configured, by name (at most :data:`MAX_GROUPS_LISTED`)."""
        p = self.protocol
        k = p.keys
        names = set()
        pipe = p.conn.client.pipeline(transaction=False)
        for shard in range(p.settings.token_shards):
            pipe.smembers(k.groups(shard))
            pipe.hkeys(k.group_limits(shard))
        for reply in pipe.execute():
            # (`<name>:rate` fields of gconf hold rates: a group with only a rate set is listed too.)
            names.update(text(n).split(":", 1)[0] for n in reply)
        return [self.group(n) for n in sorted(names)[:MAX_GROUPS_LISTED]]

    # ----- pause -----

    def pause(self, priority: Optional[int] = None) -> None:
        """Pauses the namespace (``None``) or one priority: from their next take, worker slots take
        no token of it; a slot holding one finishes its quantum first, and running handlers finish.
        Submits still work. Kept in Redis until :meth:`resume`. Repeating it changes nothing."""
        name = "all" if priority is None else str(_priority(priority))
        # On every shard a worker may use, not only on this admin's.
        pipe = self.protocol.conn.client.pipeline(transaction=False)
        for shard in range(MAX_TOKEN_SHARDS):
            pipe.hset(self.protocol.keys.paused(shard), name, 1)
        pipe.execute()

    def resume(self, priority: Optional[int] = None) -> None:
        """Undoes pauses: ``None`` resumes everything (the namespace and every priority paused one
        by one); a priority resumes that one only (a pause of the whole namespace stays)."""
        if priority is not None:
            _priority(priority)
        pipe = self.protocol.conn.client.pipeline(transaction=False)
        for shard in range(MAX_TOKEN_SHARDS):
            key = self.protocol.keys.paused(shard)
            if priority is None:
                pipe.delete(key)
            else:
                pipe.hdel(key, str(priority))
        pipe.execute()

    def purge_namespace(self, force: bool = False) -> int:
        """Deletes every key of the namespace (requests queued, running and finished, results,
        events, pauses, schedules, the registry), found with ``SCAN`` on every primary, as the Rust
        ``Admin::purge_namespace`` and ``sluicegate purge --all``. Raises :class:`Refused` while
        workers are registered in it, unless ``force`` (they would go on in an empty namespace:
        stop them first). Returns how many keys were deleted. Producers and listeners of the
        namespace see their requests vanish; a request submitted meanwhile may survive in part,
        so quiesce first."""
        ns = self.protocol.settings.namespace
        workers = self.workers()
        if workers and not force:
            raise errors.Refused(
                f'{len(workers)} worker(s) are registered in namespace "{ns}" '
                f'({", ".join(w.id for w in workers)}): stop them first, or force the purge'
            )
        client = self.protocol.conn.client
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in ns) + ":*"
        deleted = 0
        # Again while a pass finds keys: one written during a scan may be missed by it.
        for _ in range(5):
            found, page = 0, []
            for key in client.scan_iter(match=pattern, count=1000):
                page.append(key)
                if len(page) == 1000:
                    # (A cluster client splits the keys by slot.)
                    found, page = found + int(client.unlink(*page)), []
            if page:
                found += int(client.unlink(*page))
            deleted += found
            if found == 0:
                break
        return deleted

    def workers(self) -> List[WorkerInfo]:
        """The workers whose registration is fresh by Redis's clock (Rust or Python alike), with
        the slots of each that hold a token now (the Rust ``Admin::workers``)."""
        p = self.protocol
        client = p.conn.client
        workers_key = p.keys.workers()
        if isinstance(client, RedisCluster):
            # The registry's own master's clock, which wrote the expiries.
            secs, micros = client.execute_command("TIME", target_nodes=client.get_node_from_key(workers_key))
        else:
            secs, micros = client.time()
        now = int(secs) * 1000 + int(micros) // 1000
        scored = client.zrangebyscore(workers_key, now, "+inf", withscores=True)
        if not scored:
            return []
        infos = client.hmget(p.keys.worker_info(), [w for w, _ in scored])
        busy: Dict[str, List[SlotWork]] = {}
        # Every shard's take records in one round trip (on a cluster, one per master).
        pipe = client.pipeline(transaction=False) if not isinstance(client, RedisCluster) else client.pipeline()
        for shard in range(p.settings.token_shards):
            pipe.hgetall(p.keys.held(shard))
        for shard, records in enumerate(pipe.execute()):
            for holder, record in records.items():
                work = SlotWork.from_record(shard, text(holder), text(record))
                if work is not None:
                    busy.setdefault(work.slot.split("/", 1)[0], []).append(work)
        out: List[WorkerInfo] = []
        for (wid, expires), raw in zip(scored, infos):
            try:
                d = json.loads(raw) if raw is not None else None
                info = WorkerInfo(
                    id=str(d["id"]), slots=int(d["slots"]), pid=int(d.get("pid", 0)), host=str(d.get("host", "")),
                    started_ms=int(d.get("started_ms", 0)), shards=int(d.get("shards", 1)),
                    registration_expires_ms=int(expires), version=d.get("version"), label=d.get("label"),
                )
            except (ValueError, KeyError, TypeError):
                continue  # (a description this version cannot read, as the Rust Admin skips it)
            info.busy = sorted(busy.get(info.id, []), key=lambda w: w.slot)
            out.append(info)
        return out

    def paused(self) -> Paused:
        """What is paused (as the first token shard holds it; every shard holds the same, but for
        a moment during a pause or resume)."""
        paused = Paused()
        for name in (text(f) for f in self.protocol.conn.client.hkeys(self.protocol.keys.paused(0))):
            if _digits(name) and int(name) <= 255:
                paused.priorities.append(int(name))
            elif name == "all":
                paused.all = True
        paused.priorities.sort(reverse=True)
        return paused

    # ----- schedules -----

    def _schedule_state(self, name: str) -> Dict[str, str]:
        raw = self.protocol.conn.client.hgetall(self.protocol.keys.schedule_state(name))
        return {text(k): text(v) for k, v in raw.items()}

    def schedules(self) -> List[Schedule]:
        """Every schedule, by name."""
        specs = self.protocol.conn.client.hgetall(self.protocol.keys.schedules())
        out = [_schedule_from(text(n), text(s), self._schedule_state(text(n))) for n, s in specs.items()]
        return sorted(out, key=lambda s: s.name)

    def schedule(self, name: str) -> Schedule:
        """One schedule; :class:`UnknownSchedule` if there is none of that name."""
        _check_schedule_name(name)
        spec = self.protocol.conn.client.hget(self.protocol.keys.schedules(), name)
        if spec is None:
            raise errors.UnknownSchedule(name)
        return _schedule_from(name, text(spec), self._schedule_state(name))

    def schedule_add(
        self,
        name: str,
        cron: str,
        parts: Iterable[Any],
        *,
        time_zone: Optional[str] = None,
        catch_up: Optional[int] = None,
        priority: int = 50,
        concurrency: int = 1,
        max_attempts: int = 1,
        backoff: float = 1.0,
        backoff_max: float = 60.0,
        timeout: Optional[float] = None,
        delay: Optional[float] = None,
        tags: Sequence[str] = (),
        fail_fast: bool = False,
        own_stream: bool = False,
        unlisted: bool = False,
        discard_results: bool = False,
    ) -> None:
        """Adds a schedule: from now on each tick of the cron pattern ``cron`` submits one request,
        ``<name>@<tick ms>``, tagged ``schedule:<name>`` (unless ``unlisted``), whose parts are
        ``parts`` (stored with the schedule) and whose settings are the rest, as
        :meth:`Producer.submit` takes them (seconds for durations; ``discard_results``: the
        requests store no results). Rust workers fire it (the Rust
        ``Admin::schedule_add``; docs/operations.md, "Schedules"); its first tick is the first
        after now (Redis time).

        ``cron``: five fields (minute hour day-of-month month day-of-week), six with seconds first,
        seven with a year last, or ``@hourly``, ``@daily``, ``@weekly``, ``@monthly``, ``@yearly``,
        as the Rust ``croner`` crate reads them; ``time_zone``: an IANA name (None: UTC);
        ``catch_up``: None skips the ticks missed while no worker ran but the latest, ``n`` (1 to
        100) submits the last ``n``, oldest first.

        Adding the very same spec again changes nothing; another spec under a name in use raises
        :class:`ScheduleExists` (see :meth:`schedule_replace`). The spec is checked first as the
        Rust ``Admin`` checks it, with its messages: a bad name, pattern (one that never fires
        included), time zone, catch-up, attempts, backoff, timeout, no parts, an unlisted request
        that is not small, a spec over 1 MB raise :class:`InvalidSchedule`; a bad priority,
        concurrency or tag :class:`InvalidRequest`."""
        spec = _schedule_spec(name, cron, parts, time_zone, catch_up, priority, concurrency, max_attempts, backoff,
                              backoff_max, timeout, delay, tags, fail_fast, own_stream, unlisted, discard_results)
        if self._sched_add(name, spec, False) == "exists":
            raise errors.ScheduleExists(name)

    def schedule_replace(
        self,
        name: str,
        cron: str,
        parts: Iterable[Any],
        *,
        time_zone: Optional[str] = None,
        catch_up: Optional[int] = None,
        priority: int = 50,
        concurrency: int = 1,
        max_attempts: int = 1,
        backoff: float = 1.0,
        backoff_max: float = 60.0,
        timeout: Optional[float] = None,
        delay: Optional[float] = None,
        tags: Sequence[str] = (),
        fail_fast: bool = False,
        own_stream: bool = False,
        unlisted: bool = False,
        discard_results: bool = False,
    ) -> None:
        """Adds a schedule, or replaces the one of that name (the Rust
        ``Admin::schedule_replace``): the new spec is active (not paused) from now, its first tick
        the first after now; ticks the old one fell due for and no worker fired yet are not owed;
        ticks it owed are submitted with the new template. Arguments and checks as
        :meth:`schedule_add`'s."""
        spec = _schedule_spec(name, cron, parts, time_zone, catch_up, priority, concurrency, max_attempts, backoff,
                              backoff_max, timeout, delay, tags, fail_fast, own_stream, unlisted, discard_results)
        self._sched_add(name, spec, True)

    def _sched_add(self, name: str, spec: str, replace: bool) -> str:
        """``sched_add``: ``added``, ``replaced``, ``same`` or ``exists``."""
        k = self.protocol.keys
        reply = fcall_items(
            self.protocol.conn.fcall(
                "sched_add", [k.schedules(), k.schedules_due(), k.schedule_state(name), k.schedules_gen()],
                [name, spec, "1" if replace else "0"],
            )
        )
        return text(reply[0]) if reply else ""

    def _switch(self, name: str, pause: bool) -> bool:
        _check_schedule_name(name)
        k = self.protocol.keys
        reply = fcall_items(
            self.protocol.conn.fcall(
                "sched_pause", [k.schedules_due(), k.schedule_state(name), k.schedules_gen()], [name, "1" if pause else "0"]
            )
        )
        tag = text(reply[0]) if reply else ""
        if tag == "unknown":
            raise errors.UnknownSchedule(name)
        return tag in ("paused", "resumed")

    def schedule_pause(self, name: str) -> bool:
        """Pauses a schedule: ticks after now are not owed until it is resumed (those due before
        are still fired). Returns False if it was paused already."""
        return self._switch(name, True)

    def schedule_resume(self, name: str) -> bool:
        """Resumes a paused schedule: ticks while it was paused are never owed. Returns False if
        it was not paused."""
        return self._switch(name, False)

    def schedule_remove(self, name: str) -> None:
        """Removes a schedule (its requests stay; ticks it owed and had not submitted are
        dropped); :class:`UnknownSchedule` if there is none of that name."""
        _check_schedule_name(name)
        k = self.protocol.keys
        removed = self.protocol.conn.fcall("sched_del", [k.schedules(), k.schedules_due(), k.schedule_state(name)], [name])
        if integer(removed) != 1:
            raise errors.UnknownSchedule(name)
