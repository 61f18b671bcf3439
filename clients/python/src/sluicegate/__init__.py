"""sluicegate: distributed batch processing on Redis, the Python client.

A **producer** submits a request, an ordered list of parts, with a priority and a concurrency
limit; **workers** run a handler on each part, never more than the limit at once per request,
highest priority first; the producer waits for the results in part order. Producers and workers
of Python and Rust interoperate: they speak the same protocol (docs/protocol.md) through the same
Redis Functions library, shipped with this package.

>>> from sluicegate import Producer, Worker          # doctest: +SKIP
>>> Worker("redis://127.0.0.1:6379", lambda ctx, p: p["n"] * 2).start()  # doctest: +SKIP
>>> Producer("redis://127.0.0.1:6379").submit([{"n": 1}, {"n": 2}]).wait().results  # doctest: +SKIP
[2, 4]
"""

from ._conn import library_source
from .admin import (
    DEFAULT_GROUP_LIMIT,
    MAX_GROUP_LIMIT,
    Admin,
    DeadLetter,
    GroupStatus,
    IndexedError,
    ListedRequest,
    ListPage,
    Paused,
    RateLimit,
    Reprioritized,
    RequestStatus,
    Schedule,
    SlotWork,
    Upstream,
    WorkerInfo,
)
from .errors import (
    DuplicateRequestId,
    InvalidCursor,
    InvalidRequest,
    InvalidSchedule,
    NoDeadLetters,
    NoResult,
    NotOpen,
    PermanentError,
    ProtocolError,
    RedisFull,
    Refused,
    ScheduleExists,
    SluicegateError,
    UnknownRequest,
    UnknownSchedule,
    UnknownUpstream,
    UnsupportedRedis,
    WaitTimeout,
)
from .chunk import MAX_CHUNK, chunked, chunks
from .events import Event, Listener
from .producer import Completion, OpenRequest, PartError, Producer, RequestHandle, ResultsPage
from .worker import Context, Worker

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_GROUP_LIMIT",
    "MAX_CHUNK",
    "MAX_GROUP_LIMIT",
    "Admin",
    "Completion",
    "Context",
    "DeadLetter",
    "DuplicateRequestId",
    "Event",
    "GroupStatus",
    "IndexedError",
    "InvalidCursor",
    "InvalidRequest",
    "InvalidSchedule",
    "ListPage",
    "ListedRequest",
    "Listener",
    "NoDeadLetters",
    "NoResult",
    "NotOpen",
    "OpenRequest",
    "PartError",
    "Paused",
    "PermanentError",
    "Producer",
    "ProtocolError",
    "RateLimit",
    "RedisFull",
    "Refused",
    "Reprioritized",
    "RequestHandle",
    "RequestStatus",
    "ResultsPage",
    "Schedule",
    "ScheduleExists",
    "SlotWork",
    "SluicegateError",
    "UnknownRequest",
    "UnknownSchedule",
    "UnknownUpstream",
    "UnsupportedRedis",
    "Upstream",
    "WaitTimeout",
    "WorkerInfo",
    "Worker",
    "chunked",
    "chunks",
    "library_source",
]
