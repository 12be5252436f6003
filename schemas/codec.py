"""MessagePack codec with strict decoding: wrong types, unknown or missing fields are errors."""

from __future__ import annotations

from functools import cache
from typing import Any, TypeVar

import msgspec

from rollway.schemas.messages import SCHEMA_VERSION, Message

M = TypeVar("M", bound=Message)

_encoder = msgspec.msgpack.Encoder()


class DecodeError(ValueError):
    """Bytes that are not a valid message of the expected type and schema version."""


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


@cache
def _decoder(cls: type[M]) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(cls)


def decode(data: bytes | None, cls: type[M]) -> M:
    if data is None:
        raise DecodeError(f"empty message where {cls.__name__} was expected")
    try:
        msg = _decoder(cls).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise DecodeError(f"not a valid {cls.__name__}: {err}") from None
    if msg.schema_version != SCHEMA_VERSION:
        raise DecodeError(
            f"{cls.__name__} has schema_version {msg.schema_version}, this worker reads {SCHEMA_VERSION}")
    return msg


def to_builtins(msg: Message) -> Any:
    """Plain JSON-able data (bytes become base64 strings)."""
    return msgspec.to_builtins(msg)
