"""Framing and strict validation shared by every transfer-plane message.

A message is a 12-byte frame (magic, version, kind, reserved, header length), a UTF-8 JSON
header padded to 8 bytes, and a body of little-endian integer arrays (the layout is spelled out
in `messages.py`). Everything here refuses rather than guesses: any malformed input raises
ValueError.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})
MAGIC = b"PDTX"
KIND_DESCRIPTOR = 1
KIND_NOTICE = 2
MAX_HEADER_BYTES = 1 << 16

FRAME = struct.Struct("<4sHBBI")
U32, U64 = 1 << 32, 1 << 64


# -- validation helpers ------------------------------------------------------------------------


def require_int(what: str, value: object, lo: int, hi: int) -> int:
    """`value` as an int in [lo, hi); bools and floats are refused."""
    if type(value) is not int:
        raise ValueError(f"{what} must be an integer, got {type(value).__name__}")
    if not lo <= value < hi:
        raise ValueError(f"{what} must be in [{lo}, {hi}), got {value}")
    return value


def require_str(what: str, value: object) -> str:
    if type(value) is not str or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    return value


def require_ints(what: str, values: tuple[int, ...], hi: int) -> None:
    if not all(type(v) is int for v in values):
        raise ValueError(f"{what} must hold integers only")
    if values and (min(values) < 0 or max(values) >= hi):
        raise ValueError(f"every entry of {what} must be in [0, {hi})")


def as_tuple(obj: object, name: str) -> None:
    """Freeze a list-valued field of a frozen dataclass into a tuple."""
    value = getattr(obj, name)
    if not isinstance(value, tuple | list):
        raise ValueError(f"{name} must be a tuple or list of integers, got {type(value).__name__}")
    object.__setattr__(obj, name, tuple(value))


def hex64(value: int) -> str:
    return f"{value:016x}"


def parse_hex64(what: str, text: object) -> int:
    if type(text) is not str or len(text) != 16 or text.strip("0123456789abcdef"):
        raise ValueError(f"{what} must be 16 lowercase hex digits, got {text!r}")
    return int(text, 16)


def check_version(version: object) -> None:
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise ValueError(f"protocol version {version!r} is not supported; this build speaks "
                         f"{sorted(SUPPORTED_VERSIONS)} (upgrade the older peer)")


def pack(kind: int, version: int, header: dict[str, Any], arrays: list[np.ndarray]) -> bytes:
    text = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    text += b" " * (-(FRAME.size + len(text)) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(text)} bytes exceeds {MAX_HEADER_BYTES}")
    frame = FRAME.pack(MAGIC, version, kind, 0, len(text))
    return b"".join([frame, text, *(a.tobytes() for a in arrays)])


def unpack(data: bytes | bytearray | memoryview, kind: int) -> tuple[int, object, memoryview]:
    """Check the frame; return (version, parsed JSON header, body bytes)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ValueError(f"expected bytes, got {type(data).__name__}")
    try:
        view = memoryview(data).cast("B")
    except TypeError as e:
        raise ValueError(f"message must be one contiguous byte buffer: {e}") from None
    if len(view) < FRAME.size:
        raise ValueError(f"truncated message: {len(view)} bytes, the frame alone is {FRAME.size}")
    magic, version, got_kind, reserved, hlen = FRAME.unpack_from(view)
    if magic != MAGIC:
        raise ValueError(f"not a pdserve transfer message (magic {bytes(magic)!r})")
    check_version(version)
    if got_kind != kind or reserved != 0:
        raise ValueError(f"expected message kind {kind}, got kind {got_kind} "
                         f"(reserved byte {reserved})")
    if hlen > MAX_HEADER_BYTES or FRAME.size + hlen > len(view):
        raise ValueError(f"truncated message: header of {hlen} bytes does not fit")
    header_end = FRAME.size + hlen
    try:
        header = json.loads(
            bytes(view[FRAME.size : header_end]).decode("utf-8"),
            object_pairs_hook=no_duplicates, parse_constant=no_constants,
        )
    except RecursionError:
        raise ValueError("JSON header nests too deeply") from None
    return version, header, view[header_end:]


def read_arrays(body: memoryview, specs: list[tuple[str, int]]) -> list[list[int]]:
    """Split the body into little-endian arrays of the given (dtype, count); exact length."""
    expected = sum(np.dtype(dt).itemsize * count for dt, count in specs)
    if len(body) != expected:
        raise ValueError(f"message body is {len(body)} bytes; the header announces {expected} "
                         "(truncated or trailing bytes)")
    out, offset = [], 0
    for dt, count in specs:
        out.append(np.frombuffer(body, dtype=dt, count=count, offset=offset).tolist())
        offset += np.dtype(dt).itemsize * count
    return out


def exact_keys(what: str, obj: object, keys: list[str]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(obj).__name__}")
    missing, unknown = set(keys) - obj.keys(), obj.keys() - set(keys)
    if missing or unknown:
        raise ValueError(f"{what}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")
    return obj


def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("JSON header repeats a key")
    return d


def no_constants(name: str) -> None:
    raise ValueError(f"JSON header holds {name}; only finite numbers are allowed")
