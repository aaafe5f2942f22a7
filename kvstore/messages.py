"""The store shard's control messages, typed (msgspec, over msgpack, the `op` field naming each).

A shard decodes every message into one of these or answers an error: types, lengths and ranges
are checked by the decoder before any of the shard's code sees a value, so a malformed or hostile
message (a negative size, ten thousand keys, a key of a megabyte, a frame of random bytes) costs an
error reply and nothing else. Replies are plain maps; each names the shard's member-list epoch.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_KEYS = 4096  # per message: a prompt of 1M tokens is 4096 chunks of 256
MAX_KEY_CHARS = 512  # LMCache's keys are ~120 characters

Key = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY_CHARS)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS)]
Size = Annotated[int, msgspec.Meta(gt=0, le=2**40)]
Checksum = Annotated[int, msgspec.Meta(ge=0)]  # xxh3-64; msgpack holds at most 2**64 - 1


class _Op(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, frozen=True):
    pass


class Hello(_Op, tag="hello"):
    """The shard's NIXL agent metadata, to read and write its arena."""


class Reserve(_Op, tag="reserve"):
    """Pages for chunks about to be written: extents per key (None where refused)."""

    keys: Keys
    nbytes: Annotated[list[Size], msgspec.Meta(max_length=MAX_KEYS)]
    checksums: Annotated[list[Checksum], msgspec.Meta(max_length=MAX_KEYS)]


class Commit(_Op, tag="commit"):
    keys: Keys


class Abort(_Op, tag="abort"):
    keys: Keys


class Contains(_Op, tag="contains"):
    keys: Keys


class Lease(_Op, tag="lease"):
    """Pin the stored prefix of `keys` for a reader: their extents and checksums."""

    keys: Keys


class Release(_Op, tag="release"):
    lease: Annotated[int, msgspec.Meta(ge=0)]
    damaged: Keys = []


class Stats(_Op, tag="stats"):
    pass


class Members(_Op, tag="members"):
    pass


class Corrupt(_Op, tag="corrupt"):
    """Fault injection (tests only; a shard started without it refuses)."""

    count: Annotated[int, msgspec.Meta(ge=0, le=MAX_KEYS)]


Request = Hello | Reserve | Commit | Abort | Contains | Lease | Release | Stats | Members | Corrupt
_decoder = msgspec.msgpack.Decoder(Request)
_encoder = msgspec.msgpack.Encoder()


class ProtocolError(ValueError):
    """A message that is not one of the shard's requests."""


def decode(payload: bytes) -> Request:
    try:
        request = _decoder.decode(payload)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise ProtocolError(str(exc)) from None
    if isinstance(request, Reserve) and not len(request.keys) == len(request.nbytes) == len(request.checksums):
        raise ProtocolError("reserve: keys, nbytes and checksums differ in length")
    return request


def encode(message: Request | dict) -> bytes:
    return _encoder.encode(message)


def decode_reply(payload: bytes) -> dict:
    reply = msgspec.msgpack.decode(payload)
    if not isinstance(reply, dict):
        raise ProtocolError("a shard's reply is not a map")
    return reply
