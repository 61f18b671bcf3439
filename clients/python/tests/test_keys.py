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
