"""Recovery: every worker's share of keeping tokens and entries in circulation (docs/protocol.md
§6.4 step 3 and §6.6; the same call sequences as src/worker/recovery.rs). There is no master:
``claim_due`` spreads the requests over the workers, the beats spread the reaping, and every change
is a compare-and-set on a token's epoch and holder in the library."""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._conn import fcall_items, integer, text
from ._keys import group_of_queue, home_shard
from ._protocol import Placement, Protocol, Unfinished, by_shard, group_item, ms

log = logging.getLogger("sluicegate.recovery")

#: Requests claimed per pass per shard; tokens per census call (src/worker/recovery.rs).
CLAIM_BATCH = 200
CENSUS_CHUNK = 1000
#: Groups one ``group_audit`` call looks at (src/worker/recovery.rs ``GROUP_AUDIT_CHUNK``).
GROUP_AUDIT_CHUNK = 100


def claim_due(p: Protocol, shard: int) -> Tuple[List[Tuple[str, int]], List[str]]:
    """``claim_due`` on ``shard`` with its release outbox (KEYS[3]; no schedules' key: a Python
    worker fires none): the requests whose look is due, each with its claim, and the upstreams
    whose release is due (their finishers died, or stalled past the outbox's due time)."""
    k = p.keys
    reply = fcall_items(
        p.conn.fcall(
            "claim_due", [k.active(shard), k.armed(shard), k.releases(shard)], [CLAIM_BATCH, ms(5 * p.settings.lease)]
        )
    )
    # The requests' pairs, then '', the time, the releases' count and their key ids.
    split = next((i for i, v in enumerate(reply) if text(v) == ""), len(reply))
    pairs = [(text(reply[i]), integer(reply[i + 1])) for i in range(0, split - 1, 2)]
    rest = reply[split + 1 :]
    releases: List[str] = []
    if len(rest) >= 2:
        count = max(0, min(integer(rest[1]), len(rest) - 2))
        releases = [text(v) for v in rest[2 : 2 + count]]
    return pairs, releases


def recovery_pass(p: Protocol) -> int:
    """One pass over each shard's ``active`` index and release outbox: runs the releases that
    fell due, claims the requests whose look is due and censuses each. Returns how many requests
    it looked at."""
    n = 0
    for shard in range(p.settings.token_shards):
        pairs, releases = claim_due(p, shard)
        for ukid in releases:
            log.info("running the release of %s that its finisher left undone", ukid)
            try:
                p.dag_release(shard, ukid)
            except Exception as e:  # noqa: BLE001 - due again when the claim runs out
                log.warning("release of %s failed: %s", ukid, e)
        for kid, claim in pairs:
            n += 1
            try:
                census(p, shard, kid, claim)
            except Exception as e:  # noqa: BLE001 - the next look repeats it
                log.warning("census of %s failed: %s", kid, e)
    return n


def census(p: Protocol, shard: int, kid: str, claim: Optional[int]) -> None:
    """Recovery's look at one request whose home shard is ``shard`` (lua/census.lua)."""
    s = p.settings
    keys = p.keys.request(kid).all()
    start = 0
    look_so_far = ms(s.census_interval)
    while True:
        reply = fcall_items(
            p.conn.fcall(
                "census", keys,
                [kid, ms(s.grace), ms(s.retention), p.keys.done_channel(), start, CENSUS_CHUNK, look_so_far],
            )
        )
        tag = text(reply[0]) if reply else ""
        if tag == "gone":
            k = p.keys
            p.conn.fcall(
                "drop_gone",
                [k.active(shard), k.registrations(shard), k.finish_marks(shard, kid), k.armed(shard)],
                [kid, ms(s.loading_ttl), "" if claim is None else claim, ms(s.grace)],
            )
            return
        if tag == "loading":
            k = p.keys
            p.conn.fcall("arm", [k.active(shard), k.armed(shard)], [kid, ms(s.grace), "" if claim is None else claim])
            return
        if tag == "waiting":
            # A downstream waiting for its upstreams: their releases open it, and this look only
            # checks that none of them vanished without one.
            shards = max(1, min(1024, integer(reply[1], 1))) if len(reply) > 1 else 1
            look = max(1, integer(reply[2], 1)) if len(reply) > 2 else 1
            k = p.keys
            p.conn.fcall("arm", [k.active(shard), k.armed(shard)], [kid, look, "" if claim is None else claim])
            p.check_waiting(kid, shards, [text(u) for u in reply[3:]])
            return
        if tag == "finished":
            p.finish_reported(kid, Unfinished.parse(reply[1:]))
            return
        if tag != "ok" or len(reply) < 8:
            log.warning("unexpected census reply for %s: %r", kid, tag)
            return
        # {'ok', prio, shards, next, look, push, check, held, group ('' for none)}
        place = Placement(
            integer(reply[1]), max(1, min(1024, integer(reply[2], 1))), group_item(reply[8] if len(reply) > 8 else None)
        )
        nxt = integer(reply[3], -1)
        look = integer(reply[4], 1)
        look_so_far = look
        push, check, held = list(reply[5] or []), list(reply[6] or []), list(reply[7] or [])
        _verify(p, kid, place, push, check, (look, claim) if nxt < 0 else None)
        _reclaim_dead_holders(p, kid, place, held)
        if nxt < 0:
            return
        start = nxt


def _verify(p: Protocol, kid: str, place: Placement, push: List[Any], check: List[Any],
            rearm: Optional[Tuple[int, Optional[int]]]) -> None:
    home = home_shard(kid, place.shards)
    pushes = by_shard(kid, place, push)
    checks = by_shard(kid, place, check)
    on = set(pushes) | set(checks)
    if rearm is not None:
        on.add(home)
    missing: List[Any] = []
    k = p.keys
    grace = ms(p.settings.grace)
    for s in sorted(on):
        ps, cs = pushes.get(s, []), checks.get(s, [])
        list_key = place.list(k, s)
        if rearm is not None and s == home:
            look, claim = rearm
            reply = p.conn.fcall(
                "verify", [list_key, k.bell(s), k.active(s), k.armed(s)],
                [kid, look, grace, len(ps), *ps, *cs, "" if claim is None else claim],
            )
        else:
            reply = p.conn.fcall("verify", [list_key, k.bell(s)], [kid, 0, grace, len(ps), *ps, *cs])
        missing.extend(fcall_items(reply))
    if not missing:
        return
    restored = fcall_items(p.conn.fcall("restore", k.request(kid).all(), [kid, *missing]))
    if restored:
        log.warning("restoring %d token(s) of %s whose elements were lost", len(restored), kid)
        p.push(kid, place, restored, p.settings.grace)


def gone(p: Protocol, ids: Sequence[str]) -> Dict[str, bool]:
    """Which worker ids are in neither the registry nor the reaping set."""
    if not ids:
        return {}
    ids = list(ids)
    registered = p.conn.client.execute_command("ZMSCORE", p.keys.workers(), *ids)
    reaping = p.conn.client.execute_command("ZMSCORE", p.keys.reaping(), *ids)
    return {i: r is None and q is None for i, r, q in zip(ids, registered, reaping)}


def _reclaim_dead_holders(p: Protocol, kid: str, place: Placement, held: List[Any]) -> None:
    holds = []
    for h in held:
        if isinstance(h, (list, tuple)) and len(h) == 3:
            holds.append((integer(h[0]), text(h[1]), text(h[2])))
    if not holds:
        return
    dead = gone(p, sorted({h.split("/", 1)[0] for _, _, h in holds}))
    for k, epoch, holder in holds:
        if dead.get(holder.split("/", 1)[0]):
            log.warning("a token of %s is held by a worker that is gone; reclaiming it", kid)
            shard = place.token_shard(kid, k)
            reclaim(p, kid, k, epoch, holder, shard, place.list(p.keys, shard), None)


def reclaim(p: Protocol, kid: str, k: int, epoch: str, holder: str, shard: int, list_key: str,
            take: Optional[Tuple[str, str]]) -> None:
    """Puts back a token a dead slot had taken (``reclaim``), ending its take record (``take``:
    the record's field and take id) in the same step as the push when it is known."""
    tag, rest = p.reclaim(kid, k, epoch, holder, list_key, None)
    if tag == "push":
        elements = rest[:1]
        # The request's priority now: an operator may have changed it since the take (never of a
        # request in a group: its element goes back to the group's queue it came from).
        if len(rest) > 1 and rest[1] is not None and group_of_queue(list_key) is None:
            list_key = p.keys.token_list(shard, integer(rest[1]))
        if take is not None:
            p.give_back(shard, list_key, take[0], take[1], elements)
        else:
            p.push_plain(kid, shard, list_key, elements)
        return
    if tag == "finished":
        p.finish_reported(kid, Unfinished.parse(rest))
    elif tag == "wake":
        placement = p.placement(kid)
        p.arm(kid, placement.shards if placement else 1, integer(rest[0] if rest else 1, 1) / 1000.0)
    if take is not None:
        p.release(shard, take[0], take[1])


def reap(p: Protocol, worker_id: str, description: Optional[str]) -> None:
    """Reclaims every token the slots of dead worker ``worker_id`` had taken, then removes it."""
    slots, shards = 256, p.settings.token_shards
    try:
        info = json.loads(description) if description else None
        if isinstance(info, dict):
            slots, shards = max(1, int(info.get("slots", 256))), max(1, int(info.get("shards", 1)))
    except (ValueError, TypeError):
        pass
    log.warning("worker %s stopped beating; reclaiming what its slots held", worker_id)
    for shard in range(shards):
        fields = [f"{worker_id}/{n}" for n in range(slots)]
        # Its slots' offers of hand-offs end first: nothing more is handed to them, and what was
        # handed already has its record, read next.
        p.conn.client.hdel(p.keys.offers(shard), *fields)
        records = p.conn.client.hmget(p.keys.held(shard), fields)
        for field, record in zip(fields, records):
            if record is not None:
                reclaim_record(p, shard, field, text(record))
    k = p.keys
    p.conn.fcall("reaped", [k.workers(), k.worker_info(), k.reaping()], [worker_id])


def reclaim_record(p: Protocol, shard: int, field: str, record: str) -> None:
    """Reclaims the token of take record ``field`` = ``record`` on ``shard``:
    ``<kid>|<k>|<epoch>|<take>|<list>``, where a grouped request's list (its group's queue) is
    followed by the group token the take holds, ``|<group>|<k>|<epoch>``, which the give back or
    release that ends the record returns (Rust ``TakeRecord``)."""
    parts = record.split("|", 4)
    ok = len(parts) == 5 and parts[1].isdigit() and parts[2].isdigit()
    if not ok:
        log.warning("dropping a malformed take record %s=%s", field, record)
        p.conn.client.hdel(p.keys.held(shard), field)
        return
    kid, k, epoch, take, list_key = parts
    queue, bar, _ = list_key.partition("|")
    if bar and group_of_queue(queue) is not None:
        list_key = queue
    holder = field.split("/lost/", 1)[0]
    reclaim(p, kid, int(k), epoch, holder, shard, list_key, (field, take))


def reclaim_untaken(p: Protocol, shard: int, holder: str, take: int) -> None:
    """After ``untake`` undid take ``take`` of ``holder`` on ``shard``: a lane's token the take
    acquired was kept for recovery as ``<holder>/lost/<take>``; it is reclaimed now (its batch
    orphaned, the token pushed again) rather than at the backstop's next pass (:func:`scan_held`,
    every census interval, and none once the fleet stops). No such record: nothing to do."""
    field = f"{holder}/lost/{take}"
    record = p.conn.client.hget(p.keys.held(shard), field)
    if record is not None:
        reclaim_record(p, shard, field, text(record))


def audit_groups(p: Protocol, shard: int) -> None:
    """Recovery's audit of the tenant groups on ``shard`` (``group_audit``): repairs what the
    function can tell alone (a rate wait missing from ``gwake``, a queued group token whose element
    was lost), and gives back a held group token that no take record names once its holder's
    worker is gone from the registry (a live slot keeps its token even if the shard's records
    expired; Rust ``audit_groups``). Runs before the shard's records are reclaimed, which give
    back the tokens of the records that do exist."""
    cursor = "0"
    while True:
        cursor, repaired, unnamed = p.group_audit(shard, cursor, GROUP_AUDIT_CHUNK)
        if repaired > 0:
            log.warning("repairing %d group token(s) of shard %d (a rate wait or an element lost)", repaired, shard)
        if unnamed:
            dead = gone(p, sorted({holder.split("/", 1)[0] for _, holder in unnamed}))
            ended = [token for token, holder in unnamed if dead.get(holder.split("/", 1)[0])]
            if ended:
                n = p.group_audit_end(shard, ended)
                if n > 0:
                    log.warning(
                        "giving back %d group token(s) of shard %d whose holders are gone without a take record",
                        n, shard,
                    )
        if cursor == "0":
            return


def scan_held(p: Protocol) -> None:
    """The backstop: take records whose worker is gone from the registry, or marked lost; first,
    the group tokens held by records that are gone (:func:`audit_groups`)."""
    for shard in range(p.settings.token_shards):
        audit_groups(p, shard)
        records = {text(f): text(v) for f, v in p.conn.client.hgetall(p.keys.held(shard)).items()}
        if not records:
            continue
        dead = gone(p, sorted({f.split("/", 1)[0] for f in records}))
        for field, record in records.items():
            if "/lost/" in field or dead.get(field.split("/", 1)[0]):
                reclaim_record(p, shard, field, record)
