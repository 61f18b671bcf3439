"""Several parts to a sub-request: :func:`chunks` on the producer's side, :func:`chunked` on the
worker's (the Rust ``sluicegate::chunks`` and ``Chunked``, src/chunk.rs).

A sub-request costs Redis about the same whatever it carries, so tiny, quick parts are cheaper
packed several to a sub-request (docs/benchmarks.md, "Chunks"). A chunk is retried, timed out and
dead-lettered as one, and its result is the list of its parts' results. Its payload is
``[first, [part, ...]]``, ``first`` the index in the request of its first part (docs/protocol.md
§9), so chunks a Python producer sends run on Rust workers wrapped in ``Chunked`` and the other
way round.

>>> from sluicegate import Producer, Worker, chunked, chunks      # doctest: +SKIP
>>> Worker(url, chunked(lambda ctx, p: p * 2)).start()             # doctest: +SKIP
>>> done = Producer(url).submit(chunks(range(10), 4)).wait()      # doctest: +SKIP
>>> [r for chunk in done.results for r in chunk]                   # doctest: +SKIP
[0, 2, 4, 6, 8, 10, 12, 14, 16, 18]
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable, Iterable, Iterator, List, Tuple

from .errors import InvalidRequest, PermanentError

#: The most parts one chunk may hold.
MAX_CHUNK = 10_000


def chunks(parts: Iterable[Any], size: int, first: int = 0) -> List[List[Any]]:
    """Groups ``parts`` into chunks of ``size`` (the last may hold fewer), each
    ``[first, [part, ...]]``, one sub-request each, for a worker whose handler is
    :func:`chunked`. ``size`` is from 1 to :data:`MAX_CHUNK`; another raises
    :class:`InvalidRequest`. The first part is part ``first`` of the request (0; for a streamed
    request's later ``add``, the number of parts added before: the Rust ``Chunks::from_part``)."""
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_CHUNK:
        raise InvalidRequest(f"a chunk holds from 1 to {MAX_CHUNK} parts, not {size!r}")
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise InvalidRequest(f"a chunk's first part is a number from 0, not {first!r}")
    out: List[List[Any]] = []
    current: List[Any] = []
    for part in parts:
        current.append(part)
        if len(current) == size:
            out.append([first, current])
            first += size
            current = []
    if current:
        out.append([first, current])
    return out


def _parts(ctx: Any, chunk: Any) -> Iterator[Tuple[int, Any, Any]]:
    """The chunk's parts in order, each with its index and a context of its own (sharing the run's
    cancellation and connection); it stops the run, before a part, once the run is cancelled. A
    payload that is not a chunk fails permanently."""
    ok = (
        isinstance(chunk, (list, tuple))
        and len(chunk) == 2
        and isinstance(chunk[0], int)
        and not isinstance(chunk[0], bool)
        and chunk[0] >= 0
        and isinstance(chunk[1], (list, tuple))
    )
    if not ok:
        raise PermanentError(f"a chunk is [first, [part, ...]], not {chunk!r:.80}")
    for index, part in enumerate(chunk[1], chunk[0]):
        if ctx.cancelled:
            raise RuntimeError(f"part {index}: the chunk's run was cancelled")
        part_ctx = copy.copy(ctx)
        part_ctx.index = index
        yield index, part_ctx, part


def _failed(index: int, err: BaseException) -> Exception:
    message = f"part {index}: {str(err) or type(err).__name__}"
    return PermanentError(message) if isinstance(err, PermanentError) else RuntimeError(message)


def chunked(handler: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Wraps a handler of single parts into a handler of :func:`chunks`: it runs each part of a
    chunk in turn, in order, with a context whose ``index`` (and so ``idempotency_key``) is the
    part's own, and returns their results. The first failure ends the chunk (the parts after it do
    not run) and is the chunk's, permanent if the part's was, its message prefixed with
    ``part <index>: ``. A run that is cancelled stops before its next part. ``async`` handlers stay
    ``async``. A payload that is not a chunk fails at once, permanently."""
    is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)
    )
    if is_async:

        async def run_async(ctx: Any, chunk: Any) -> List[Any]:
            out = []
            for index, part_ctx, part in _parts(ctx, chunk):
                try:
                    out.append(await handler(part_ctx, part))
                except Exception as err:  # noqa: BLE001 - the part's failure is the chunk's
                    raise _failed(index, err) from err
            return out

        return run_async

    def run(ctx: Any, chunk: Any) -> List[Any]:
        out = []
        for index, part_ctx, part in _parts(ctx, chunk):
            try:
                out.append(handler(part_ctx, part))
            except Exception as err:  # noqa: BLE001 - the part's failure is the chunk's
                raise _failed(index, err) from err
        return out

    return run
