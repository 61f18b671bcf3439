"""The key schema's text forms, checked against docs/protocol.md's examples."""

from __future__ import annotations

import time
from typing import Any

from sluicegate import Producer
from sluicegate._keys import generate_id, home_shard, key_id, lane_of, raw_id


def test_key_ids_are_percent_encoded_as_the_protocol_says() -> None:
    for raw, kid in (("a:b", "a%3Ab"), ("März", "M%C3%A4rz"), ("x y{1}", "x%20y%7B1%7D"), ("~", "%7E")):
        assert key_id(raw) == kid
        assert raw_id(kid) == raw


def test_generated_ids_are_22_key_safe_digits_that_sort_by_creation() -> None:
    ids = []
    for _ in range(20):
        ids.append(generate_id())
        time.sleep(0.002)
    assert all(len(i) == 22 and key_id(i) == i for i in ids)
    assert sorted(ids) == ids


def test_home_shards_use_fnv1a_and_lanes_live_on_their_own_shard() -> None:
    assert home_shard("a", 1 << 32) == 0xE40C292C
    assert lane_of("~3.50") == (3, 50) and home_shard("~3.50", 8) == 3
    assert lane_of("abc") is None


def test_a_flushed_library_is_loaded_again_on_the_next_call(server: Any, ns: str) -> None:
    p = Producer(server.url, ns)
    p.protocol.conn.client.function_flush()
    handle = p.submit([1, 2], own_stream=True)
    assert p.status(handle.id)["state"] == "queued"


def test_a_small_request_is_handed_to_a_slot_that_offered_to_take_its_priority(server: Any, ns: str) -> None:
    """docs/protocol.md §5, "Hand-offs": a reserved slot's take that finds nothing at or above its
    floor offers it (here a slot of a worker that never registered, floor 90, next take id 1); the
    Python producer's submit of a priority-95 request then records the lane token as that slot's
    and leaves the take's reply on its hand list, rather than pushing the token onto the list."""
    import msgpack

    from sluicegate._conn import fcall_items, text

    p = Producer(server.url, ns)
    k, holder = p.protocol.keys, "w-test/0"
    conn = p.protocol.conn
    reply = fcall_items(
        conn.fcall(
            "take", [k.held(0), k.bell(0), k.active(0), k.armed(0), k.paused(0)],
            [holder, 0, "", "0", "w-test", 4, k.lane_prefix(0), k.record_prefix(0), k.list_prefix(0), "90|1|60000"],
        )
    )
    assert reply == [], reply
    assert conn.client.hexists(k.offers(0), holder)
    p.submit([7], priority=95)
    record = text(conn.client.hget(k.held(0), holder))
    assert record.split("|")[3] == "1", record
    assert conn.client.llen(k.token_list(0, 95)) == 0, "the token was pushed, not handed"
    assert not conn.client.hexists(k.offers(0), holder)
    hand = conn.client.lpop(f"{k.held(0)[: -len('held')]}hand:{holder}")
    listed, element, acquired = msgpack.unpackb(hand, raw=True)
    assert listed.decode() == k.token_list(0, 95) and element.decode().startswith("~0.95|")
    assert acquired[0] == b"run" and len(acquired) == 2, acquired


def test_a_discarding_lane_record_reads_as_a_meta_hash_that_discards() -> None:
    from sluicegate._protocol import record_meta

    meta = record_meta({"state": b"completed", "pol": b"50,4,5", "lc": b"1795571926989000", "left": b"0",
                        "discard": b"4", "e3": b"{}"})
    assert (meta["discard"], meta["discarded"], meta["total"]) == ("1", "4", "5")
    assert "e3" not in meta
    assert "discard" not in record_meta({"state": b"queued", "pol": b"50,4,5"})
