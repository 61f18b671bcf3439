"""Listening for requests reaching their terminal state (docs/protocol.md §6.8)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

from ._conn import Conn, text
from ._keys import Keys, raw_id


@dataclass
class Event:
    """A request reached a terminal state. ``cursor`` resumes right after this event."""

    request_id: str
    state: str
    cursor: str


class Listener:
    """Yields completion events from the namespace's events streams (one per token shard).

    ``after``: ``None`` for new events only, ``"0-0"`` to replay every retained event, or the
    ``cursor`` of the last event handled to resume after it (a listener that reconnects misses
    nothing). A cursor is one position per token shard joined by ``,`` (a single one applies to
    every shard), as the Rust ``Cursor``: an entry id of the shard's events stream, read to its end,
    or an entry id and ``/n``, the first ``n`` of that entry's events read (an entry holds the
    events of every lane request one call finished). Events of different shards are not ordered.
    Pub/sub is not used: the events streams are the durable record.
    """

    def __init__(self, url: str, namespace: str = "sluicegate", after: Optional[str] = None, *,
                 block: float = 1.0, token_shards: int = 1) -> None:
        self.conn = Conn(url, load=False)
        self.keys = Keys(namespace)
        self.streams = [self.keys.events(s) for s in range(max(1, token_shards))]
        self.block_ms = max(1, int(block * 1000))
        self._turn = 0
        if after is None:
            ids = []
            for stream in self.streams:
                last = self.conn.client.xrevrange(stream, "+", "-", count=1)
                ids.append(text(last[0][0]) if last else "0-0")
        else:
            ids = after.split(",")
            if len(ids) != len(self.streams):
                ids = [ids[0]] * len(self.streams)
        self.cursors: List[str] = ids
        self._pending: List[Event] = []
        # A position inside an entry: the rest of that entry's events first.
        for shard, position in enumerate(ids):
            entry, _, read = position.partition("/")
            if read:
                self.cursors[shard] = entry
                for entry_id, fields in self.conn.client.xrange(self.streams[shard], entry, entry):
                    self._entry(shard, entry_id, fields, int(read), self._pending)

    @property
    def cursor(self) -> str:
        return ",".join(self.cursors)

    def poll(self, block: bool = True) -> List[Event]:
        """The events after the cursor (up to 256 per shard), waiting up to ``block`` for one."""
        out, self._pending = self._pending, []
        if out:
            return out
        n = len(self.streams)
        if n == 1:
            self._read(0, out, self.block_ms if block else None)
            return out
        for shard in range(n):
            self._read(shard, out, None)
        if not out and block:
            self._turn = (self._turn + 1) % n
            self._read(self._turn, out, max(10, self.block_ms // n))
        return out

    def _read(self, shard: int, out: List[Event], block_ms: Optional[int]) -> None:
        kwargs = {"block": block_ms} if block_ms is not None else {}
        reply = self.conn.client.xread({self.streams[shard]: self.cursors[shard]}, count=256, **kwargs)
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self._entry(shard, entry_id, fields, 0, out)

    def _entry(self, shard: int, entry_id: bytes, fields: Dict[bytes, bytes], skip: int, out: List[Event]) -> None:
        """The events of one entry past the first ``skip``: one request's (``rid``, ``state``), or
        those of every lane request one call finished (``done``: lines ``<key id>|<state>``)."""
        eid = text(entry_id)
        pairs = []
        if b"rid" in fields:
            pairs.append((text(fields.get(b"rid")), text(fields.get(b"state"))))
        for line in text(fields.get(b"done") or b"").splitlines():
            kid, sep, state = line.rpartition("|")
            if sep:
                pairs.append((kid, state))
        for n, (kid, state) in enumerate(pairs):
            self.cursors[shard] = f"{eid}/{n + 1}" if n + 1 < len(pairs) else eid
            if n < skip:
                continue
            try:
                rid = raw_id(kid)
            except UnicodeDecodeError:
                rid = kid
            out.append(Event(rid, state, self.cursor))
        self.cursors[shard] = eid

    def __iter__(self) -> Iterator[Event]:
        while True:
            yield from self.poll()

    def close(self) -> None:
        self.conn.close()
