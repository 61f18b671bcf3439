"""Listening for requests reaching their terminal state (docs/protocol.md §6.8)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

from ._conn import Conn, text
from ._keys import Keys, raw_id


@dataclass
class Event:
    """A request reached a terminal state. ``cursor`` resumes right after this event."""

    request_id: str
    state: str
    cursor: str


class Listener:
    """Yields completion events from the namespace's events stream (one token shard).

    ``after``: ``None`` for new events only, ``"0-0"`` to replay every retained event, or the
    ``cursor`` of the last event handled to resume after it (a listener that reconnects misses
    nothing). Pub/sub is not used: the events stream is the durable record.
    """

    def __init__(self, url: str, namespace: str = "sluicegate", after: Optional[str] = None, *, block: float = 1.0) -> None:
        self.conn = Conn(url, load=False)
        self.keys = Keys(namespace)
        self.stream = self.keys.events(0)
        self.block_ms = max(1, int(block * 1000))
        if after is None:
            last = self.conn.client.xrevrange(self.stream, "+", "-", count=1)
            after = text(last[0][0]) if last else "0-0"
        self.cursor: str = after

    def poll(self, block: bool = True) -> list:
        """The events after the cursor (up to 256), waiting up to ``block`` seconds for one."""
        kwargs = {"block": self.block_ms} if block else {}
        reply = self.conn.client.xread({self.stream: self.cursor}, count=256, **kwargs)
        out = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self.cursor = text(entry_id)
                rid = text(fields.get(b"rid"))
                try:
                    rid = raw_id(rid)
                except UnicodeDecodeError:
                    pass
                out.append(Event(rid, text(fields.get(b"state")), self.cursor))
        return out

    def __iter__(self) -> Iterator[Event]:
        while True:
            yield from self.poll()

    def close(self) -> None:
        self.conn.close()
