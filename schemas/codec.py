"""MessagePack codec with strict decoding: wrong types, unknown or missing fields are errors, and
every failure to decode or encode is one typed error (never a RecursionError or OverflowError that
would escape a stage's dead-letter path)."""

from __future__ import annotations

from functools import cache
from typing import Any, TypeVar

import msgspec

from rollway.schemas.messages import SCHEMA_VERSION, Message

M = TypeVar("M", bound=Message)

_encoder = msgspec.msgpack.Encoder()


class DecodeError(ValueError):
    """Bytes that are not a valid message of the expected type and schema version."""


class EncodeError(ValueError):
    """A message MessagePack cannot hold (an integer outside -2**63..2**64-1, nesting too deep, a
    value of a type it has no form for)."""


def encode(msg: Message) -> bytes:
    try:
        return _encoder.encode(msg)
    except Exception as err:  # noqa: BLE001 - msgspec raises OverflowError, RecursionError, TypeError
        raise EncodeError(f"cannot encode this {type(msg).__name__}: {type(err).__name__}: {err}") from None


@cache
def _decoder(cls: type[M]) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(cls)


class _Versioned(msgspec.Struct):
    """Just the version of any message (other fields ignored): read when a full decode fails, so a
    message of another schema version is named as such instead of as a field error."""

    schema_version: int = SCHEMA_VERSION


_version_decoder = msgspec.msgpack.Decoder(_Versioned)


def version_error(what: str, version: object) -> str:
    """What to say about data written under another schema version, and what to do about it."""
    return (f"{what} has schema_version {version}; this rollway reads {SCHEMA_VERSION} (see SCHEMA_VERSION in "
            "schemas/messages.py for what changed). Read it with the rollway version that wrote it, or run the "
            "job again with this one (and a fresh topics.prefix or broker, so old messages are not read)")


def decode(data: bytes | None, cls: type[M]) -> M:
    if data is None:
        raise DecodeError(f"empty message where {cls.__name__} was expected")
    try:
        msg = _decoder(cls).decode(data)
    except Exception as err:  # noqa: BLE001 - hostile bytes also raise RecursionError, MemoryError
        try:
            version = _version_decoder.decode(data).schema_version
        except Exception:  # noqa: BLE001 - as above
            version = SCHEMA_VERSION
        if version != SCHEMA_VERSION:
            raise DecodeError(version_error(f"this {cls.__name__}", version)) from None
        known = isinstance(err, (msgspec.DecodeError, msgspec.ValidationError))
        detail = str(err) if known else f"{type(err).__name__}: {err}"
        raise DecodeError(f"not a valid {cls.__name__}: {detail[:500]}") from None
    if msg.schema_version != SCHEMA_VERSION:
        raise DecodeError(version_error(f"this {cls.__name__}", msg.schema_version))
    return msg


def check_version(record: dict[str, Any], source: str) -> dict[str, Any]:
    """A message read back as JSON (a run folder's trajectories.jsonl and the like), refused with the
    version error when another schema version wrote it."""
    version = record.get("schema_version")
    if version != SCHEMA_VERSION:
        raise DecodeError(version_error(source, version))
    return record


def to_builtins(msg: Message) -> Any:
    """Plain JSON-able data (bytes become base64 strings)."""
    return msgspec.to_builtins(msg)
