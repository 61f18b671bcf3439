"""Payload and result encoding: MessagePack, as the Rust side encodes a JSON value (rmp-serde)."""

from __future__ import annotations

from typing import Any

import msgpack


def encode(value: Any) -> bytes:
    """MessagePack of a JSON-compatible value (maps with str keys, str as str); bytes as bin."""
    return msgpack.packb(value, use_bin_type=True)


def decode(data: bytes) -> Any:
    """The value of a MessagePack payload or result (str as str, bin as bytes)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)
