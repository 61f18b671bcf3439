"""Errors the client raises: one class per failure a caller may want to tell apart."""

from __future__ import annotations


class SluicegateError(Exception):
    """Base class of every error this package raises."""


class UnsupportedRedis(SluicegateError):
    """The Redis server is older than sluicegate needs (7.0: Redis Functions)."""

    def __init__(self, found: str, needed: str = "7.0") -> None:
        self.found = found
        self.needed = needed
        super().__init__(
            f"redis server {found} is too old: sluicegate needs Redis {needed} or newer "
            "(it runs as a Redis Functions library)"
        )


class InvalidRequest(SluicegateError):
    """A request's arguments are out of range; the message says which."""


class DuplicateRequestId(SluicegateError):
    """The request id is in use (live, or finished and still retained)."""


class UnknownRequest(SluicegateError):
    """No such request (never submitted, or its retention ran out)."""


class UnknownUpstream(SluicegateError):
    """A request was submitted ``after`` a request that cannot be waited for: unknown (never
    submitted, or its retention ran out), or still being submitted (its submit has not returned).
    Nothing of the new request is kept (the Rust ``Error::UnknownUpstream``). ``id`` is the upstream
    named, ``why`` what is wrong with it."""

    def __init__(self, upstream: str, why: str) -> None:
        self.id = upstream
        self.why = why
        super().__init__(f'upstream request "{upstream}" {why}; nothing of the request submitted after it is kept')


class NoResult(SluicegateError):
    """A part's result asked for (``Context.upstream``) is not there: the part has not ended, or its
    request's results were taken, discarded, or went with its retention (the Rust
    ``Error::NoResult``)."""

    def __init__(self, rid: str, index: int, why: str) -> None:
        self.id = rid
        self.index = index
        self.why = why
        super().__init__(f'request "{rid}" has no result for part {index}: {why}')


class NoDeadLetters(SluicegateError):
    """A request has no dead letters that can be requeued (only a failed, running or queued
    request has)."""

    def __init__(self, rid: str) -> None:
        self.id = rid
        super().__init__(
            f'request "{rid}" has no dead letters that can be requeued (only a failed, running or queued request has)'
        )


class Refused(SluicegateError):
    """An operator's command that the request's state does not allow (purging one that has not
    finished, changing the priority of a finished or lane request); the message says why (the Rust
    ``Error::Refused``)."""


class RedisFull(SluicegateError):
    """Redis is at its ``maxmemory`` and refused a write: nothing of the call was written, and
    reads keep working (the Rust ``Error::Redis`` whose ``is_full()`` holds, with its message)."""

    def __init__(self, said: str) -> None:
        super().__init__(
            "Redis is full (at its maxmemory) and refused a write: nothing was written; free memory, raise "
            f"maxmemory, or shorten the retention, then try again (Redis said: {said})"
        )


class InvalidSchedule(SluicegateError):
    """A schedule that is not one: its name (1 to 55 characters of ``A-Z a-z 0-9 _ . : / = + -``),
    cron pattern, time zone, catch-up or request template; the message names which, and what is
    allowed (the Rust ``Error::InvalidSchedule``)."""


class ScheduleExists(SluicegateError):
    """A schedule of this name exists with another spec (``Admin.schedule_add``; the Rust
    ``Error::ScheduleExists``)."""

    def __init__(self, name: str) -> None:
        super().__init__(f'schedule "{name}" exists with another spec: remove it first, or replace it')
        self.name = name


class UnknownSchedule(SluicegateError):
    """No schedule has this name."""

    def __init__(self, name: str) -> None:
        super().__init__(f'no schedule named "{name}"')
        self.name = name


class InvalidCursor(SluicegateError):
    """A listing cursor is not one a page of this namespace gave."""


class NotOpen(SluicegateError):
    """A streamed request is no longer open for parts (finalized, cancelled, expired)."""


class WaitTimeout(SluicegateError):
    """A wait ran out of time before the request finished."""


class ProtocolError(SluicegateError):
    """Redis state or a reply does not follow sluicegate's protocol."""


class Late(SluicegateError):
    """A step came after its deadline (SGLATE): arm again and retry."""


class PermanentError(Exception):
    """Raised by a handler: the part fails at once, without retries (it is dead-lettered)."""
