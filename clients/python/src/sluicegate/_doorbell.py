"""One subscription to a namespace's completion channel, shared by a producer's ``wait`` calls.

docs/protocol.md §6.7: a waiter subscribes to ``<ns>:done`` before it reads the request's
durable record, and reads it again whenever a message names its request (or its poll interval
passes). Each ``wait`` used to open a subscription of its own: a connection per call, and every
waiting call handed every completion message. The doorbell keeps one subscription per producer,
read by a daemon thread, and wakes only the calls waiting for the requests a message names, as
the Rust producer's does (src/producer.rs, ``Doorbell``).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Dict, List, Optional

from ._conn import Conn, text

log = logging.getLogger("sluicegate.producer")

#: How long the thread's read blocks, so that ``close`` is seen within it.
TICK = 0.25
#: The pause before subscribing again after the subscription failed, at most.
RETRY_MAX = 1.0

# Every doorbell of this process, for the fork hook below.
_ALL: "weakref.WeakSet[Doorbell]" = weakref.WeakSet()


class Doorbell:
    """Rings a :class:`threading.Event` per waiting call when a completion names its request."""

    def __init__(self, conn: Conn, channel: str) -> None:
        self._conn = conn
        self._channel = channel
        self._closed = threading.Event()
        self._reset()
        _ALL.add(self)

    def _reset(self) -> None:
        """The state of a doorbell with no subscription and no waits (new, or in a forked child,
        which has none of its parent's threads, and whose lock the parent may have held)."""
        self._lock = threading.Lock()
        self._waiting: Dict[str, List[threading.Event]] = {}
        self._subscribed = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def listen(self, kid: str) -> threading.Event:
        """An event set whenever a completion message names ``kid``, or when what was published
        is unknown (the subscription came back after a loss, or the doorbell closed); starts the
        subscription on first use. Give it back with :meth:`forget`."""
        ring = threading.Event()
        with self._lock:
            self._waiting.setdefault(kid, []).append(ring)
            self._start()
        return ring

    def forget(self, kid: str, ring: threading.Event) -> None:
        with self._lock:
            rings = self._waiting.get(kid, [])
            if ring in rings:
                rings.remove(ring)
            if not rings:
                self._waiting.pop(kid, None)

    def subscribed(self, timeout: float) -> bool:
        """Waits up to ``timeout`` for the subscription to stand; False if it does not (at once
        once closed: waits then poll)."""
        if self._closed.is_set():
            return False
        return self._subscribed.wait(timeout)

    def close(self, join: bool = True) -> None:
        """Ends the subscription (within ``TICK``; with ``join``, before it returns). Waits still
        running poll from then on, and are rung once now, so that they read their records at once
        rather than at their next poll."""
        self._closed.set()
        self._ring(None)
        thread = self._thread
        if join and thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * TICK + 1)

    def _start(self) -> None:
        if self._closed.is_set() or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(target=self._run, name="sluicegate-doorbell", daemon=True)
        self._thread.start()

    def _ring(self, kids: Optional[List[str]]) -> None:
        """Sets the events of ``kids``' waiters, or of every waiter (``None``)."""
        with self._lock:
            if kids is None:
                rings = [r for rs in self._waiting.values() for r in rs]
            else:
                rings = [r for kid in kids for r in self._waiting.get(kid, ())]
        for ring in rings:
            ring.set()

    def _run(self) -> None:
        pause, failing = 0.05, False
        while not self._closed.is_set():
            pubsub: Any = None
            try:
                pubsub = self._conn.pubsub()
                pubsub.subscribe(self._channel)
                while not self._closed.is_set():
                    msg = pubsub.get_message(timeout=TICK)
                    if not msg:
                        continue
                    kind = msg.get("type")
                    if kind == "subscribe":
                        # Standing (again): what was published meanwhile is unknown, so every
                        # waiter reads its record again (the first time, a harmless extra read).
                        if failing:
                            log.info("completion subscription on %s is back", self._channel)
                        pause, failing = 0.05, False
                        self._subscribed.set()
                        self._ring(None)
                    elif kind == "message":
                        lines = text(msg.get("data")).split("\n")
                        self._ring([line.split("|", 1)[0] for line in lines])
            except Exception as e:  # noqa: BLE001 - a lost connection: subscribe again
                self._subscribed.clear()
                if not failing:
                    log.warning("completion subscription on %s lost (%s); waits poll until it is back", self._channel, e)
                failing = True
                self._closed.wait(pause)
                pause = min(pause * 2, RETRY_MAX)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:  # noqa: BLE001
                        pass
        self._subscribed.clear()


def _after_fork_in_child() -> None:
    for bell in list(_ALL):
        bell._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
