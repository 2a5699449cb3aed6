"""Wire messages: validated construction, exact round-trips, and strict decoding."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common.model_config import ModelConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.transfer import layout as layout_mod
from pdserve.transfer import peer as peer_mod
from pdserve.transfer.checksum import slice_nbytes
from pdserve.transfer.layout import LAYOUT_PAGED_KV, KVLayout
from pdserve.transfer.messages import CompletionNotice, TransferDescriptor, decode_any
from pdserve.transfer.peer import PeerId
from pdserve.transfer.wire import KIND_DESCRIPTOR, KIND_NOTICE

LAYOUT = KVLayout("HuggingFaceTB/SmolLM2-135M-Instruct", "bfloat16", 16, 30, 3, 64)
PREFILL = PeerId(0x0123456789ABCDEF, "10.0.0.1", 7100)
DECODE = PeerId(0xFEDCBA9876543210, "10.0.0.2", 7200)


def _descriptor(n: int = 3, with_crc: bool = True, **overrides) -> TransferDescriptor:
    fields = {
        "transfer_id": 0xDEADBEEF, "sender": PREFILL, "receiver": DECODE,
        "src_block_ids": tuple(range(n)), "dst_block_ids": tuple(range(100, 100 + n)),
        "dst_generations": (7,) * n, "layer_begin": 0, "layer_end": 30, "layout": LAYOUT,
    }
    fields.update(overrides)
    if "checksums" not in fields:
        num_layers = fields["layer_end"] - fields["layer_begin"]
        fields["checksums"] = tuple(range(n * num_layers)) if with_crc else ()
    return TransferDescriptor(**fields)


def _frame(kind: int, header: dict | bytes, body: bytes = b"", version: int = 1) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<4sHBBI", b"PDTX", version, kind, 0, len(text)) + text + body


def _split(message: bytes) -> tuple[dict, bytes]:
    (hlen,) = struct.unpack_from("<I", message, 8)
    return json.loads(message[12 : 12 + hlen]), message[12 + hlen :]


# -- round trips ---------------------------------------------------------------------------------


@st.composite
def descriptors(draw) -> TransferDescriptor:
    n = draw(st.integers(1, 4096))
    rng = random.Random(draw(st.integers(0, 2**32)))
    num_layers = draw(st.integers(1, 64))
    begin = draw(st.integers(0, num_layers - 1))
    end = draw(st.integers(begin + 1, num_layers))
    layout = KVLayout(draw(st.text(min_size=1, max_size=40)),
                      draw(st.sampled_from(sorted(layout_mod.DTYPE_BYTES))),
                      draw(st.integers(1, 256)), num_layers, draw(st.integers(1, 16)),
                      draw(st.integers(1, 512)))
    with_crc = draw(st.booleans())
    return TransferDescriptor(
        transfer_id=rng.getrandbits(64),
        sender=PeerId(rng.getrandbits(64) | 1, draw(st.sampled_from(["h", "::1", "a.b"])),
                      draw(st.integers(1, 65535))),
        receiver=PeerId(rng.getrandbits(64) | 1, "decode-0", 9000),
        src_block_ids=tuple(rng.sample(range(2**32), n)),
        dst_block_ids=tuple(rng.sample(range(2**20), n)),
        dst_generations=tuple(rng.getrandbits(64) for _ in range(n)),
        layer_begin=begin, layer_end=end, layout=layout,
        checksums=tuple(rng.getrandbits(32) for _ in range(n * (end - begin))) if with_crc else (),
    )


@settings(max_examples=40, deadline=None)
@given(descriptors())
def test_descriptor_round_trip(d):
    data = d.encode()
    assert TransferDescriptor.decode(data) == d
    assert decode_any(bytearray(data)) == d
    assert TransferDescriptor.decode(memoryview(data)) == d


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**64 - 1),
    st.lists(st.integers(0, 2**32 - 1), max_size=2000),
    st.none() | st.integers(0, 2**32 - 1),
    st.booleans(),
    st.floats(max_value=0.0, allow_nan=False, allow_infinity=False),
)
def test_notice_round_trip(transfer_id, checksums, token0, with_logprob, logprob):
    notice = CompletionNotice(transfer_id, DECODE, tuple(checksums), token0,
                              logprob if token0 is not None and with_logprob else None)
    assert CompletionNotice.decode(notice.encode()) == notice
    assert decode_any(notice.encode()) == notice


def test_the_bytes_are_the_documented_format():
    d = _descriptor(n=2, with_crc=True, layer_begin=28, dst_generations=(1, 2**64 - 1))
    data = d.encode()
    assert data[:8] == b"PDTX\x01\x00\x01\x00"
    header, body = _split(data)
    assert (len(data) - len(body)) % 8 == 0  # the body starts 8-aligned
    assert header["transfer_id"] == "00000000deadbeef"
    assert header["sender"] == {"instance_id": "0123456789abcdef", "host": "10.0.0.1",
                                "port": 7100}
    assert header["layers"] == [28, 30] and header["num_blocks"] == 2 and header["has_checksums"]
    assert header["layout"]["layout"] == LAYOUT_PAGED_KV
    src, dst, gen = struct.unpack_from("<2I", body), struct.unpack_from("<2I", body, 8), \
        struct.unpack_from("<2Q", body, 16)
    assert (src, dst, gen) == ((0, 1), (100, 101), (1, 2**64 - 1))
    assert struct.unpack_from("<4I", body, 32) == (0, 1, 2, 3) and len(body) == 48


def test_notice_format():
    data = CompletionNotice(5, PREFILL, (0xE3069283,), 42, -0.25).encode()
    assert data[6] == KIND_NOTICE
    header, body = _split(data)
    assert header == {"transfer_id": "0000000000000005", "sender": PREFILL.to_json(),
                      "num_checksums": 1, "token0": 42, "token0_logprob": -0.25}
    assert body == struct.pack("<I", 0xE3069283)


# -- strict decoding -----------------------------------------------------------------------------


def test_every_truncation_and_trailing_bytes_are_refused():
    data = _descriptor(n=2).encode()
    for cut in range(len(data)):
        with pytest.raises(ValueError):
            TransferDescriptor.decode(data[:cut])
    with pytest.raises(ValueError, match="trailing"):
        TransferDescriptor.decode(data + b"\x00")


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda b: b"XXXX" + b[4:], "magic"),
        (lambda b: b[:4] + b"\x02\x00" + b[6:], "version 2"),
        (lambda b: b[:6] + b"\x02" + b[7:], "kind"),
        (lambda b: b[:7] + b"\x01" + b[8:], "reserved"),
        (lambda b: b[:8] + struct.pack("<I", 1 << 20) + b[12:], "header"),
    ],
)
def test_bad_frames_are_refused(mutate, match):
    with pytest.raises(ValueError, match=match):
        TransferDescriptor.decode(mutate(_descriptor().encode()))


def _header_variants() -> list[tuple[str, object, str]]:
    good, _ = _split(_descriptor(n=1, with_crc=False).encode())
    cases = [("missing key", {k: v for k, v in good.items() if k != "layers"}, "missing"),
             ("unknown key", {**good, "extra": 1}, "unknown"),
             ("bool count", {**good, "num_blocks": True}, "num_blocks"),
             ("float count", {**good, "num_blocks": 1.0}, "num_blocks"),
             ("hex upper", {**good, "transfer_id": "00000000DEADBEEF"}, "hex"),
             ("hex short", {**good, "transfer_id": "beef"}, "hex"),
             ("int id", {**good, "transfer_id": 5}, "hex"),
             ("layers shape", {**good, "layers": [0]}, "layers"),
             ("flag type", {**good, "has_checksums": 1}, "has_checksums"),
             ("peer type", {**good, "sender": "10.0.0.1:7100"}, "peer"),
             ("port type", {**good, "sender": {**good["sender"], "port": "7100"}}, "port"),
             ("dtype type", {**good, "layout": {**good["layout"], "dtype": ["bf16"]}}, "dtype"),
             ("layout", {**good, "layout": {**good["layout"], "layout": "mystery"}}, "layout"),
             ("array", [good], "JSON object"),
             ("count", {**good, "num_blocks": 2}, "body")]
    return [(name, header, match) for name, header, match in cases]


@pytest.mark.parametrize(("name", "header", "match"), _header_variants())
def test_bad_headers_are_refused(name, header, match):
    _, body = _split(_descriptor(n=1, with_crc=False).encode())
    with pytest.raises(ValueError, match=match):
        TransferDescriptor.decode(_frame(KIND_DESCRIPTOR, header, body))


@pytest.mark.parametrize(
    ("text", "match"),
    [(b'{"a": 1, "a": 2}', "repeats"), (b"\xff\xfe", "utf-8"), (b"{nope", "Expecting"),
     (b'{"token0_logprob": NaN}', "NaN"), (b"[" * 5000 + b"]" * 5000, "nests")],
)
def test_malformed_json_is_refused(text, match):
    with pytest.raises(ValueError, match=match):
        CompletionNotice.decode(_frame(KIND_NOTICE, text))


def test_length_mismatches_between_arrays_are_refused():
    header, body = _split(_descriptor(n=4, with_crc=True).encode())
    for bad in (body[:-4], body + b"\0" * 4, body[:16]):
        with pytest.raises(ValueError, match="body"):
            TransferDescriptor.decode(_frame(KIND_DESCRIPTOR, header, bad))
    with pytest.raises(ValueError, match="body"):  # claims checksums it does not carry
        TransferDescriptor.decode(_frame(KIND_DESCRIPTOR, {**header, "num_blocks": 4},
                                         body[: 4 * 16]))


def test_a_repeated_destination_on_the_wire_is_refused():
    header, body = _split(_descriptor(n=2, with_crc=False).encode())
    dst = np.frombuffer(body, "<u4", 2, 8).copy()
    dst[1] = dst[0]
    body = body[:8] + dst.tobytes() + body[16:]
    with pytest.raises(ValueError, match="dst_block_ids must not repeat"):
        TransferDescriptor.decode(_frame(KIND_DESCRIPTOR, header, body))


def test_notice_type_checks_on_the_wire():
    good = CompletionNotice(1, PREFILL, ()).encode()
    header, _ = _split(good)
    for bad, match in [({**header, "token0": -1}, "token0"), ({**header, "token0": "a"}, "token0"),
                       ({**header, "token0_logprob": 0.5}, "logprob"),
                       ({**header, "token0": 3, "token0_logprob": "x"}, "logprob")]:
        with pytest.raises(ValueError, match=match):
            CompletionNotice.decode(_frame(KIND_NOTICE, bad))
    with pytest.raises(ValueError, match="kind"):
        CompletionNotice.decode(_descriptor().encode())


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_corrupted_messages_raise_value_error_or_decode(data):
    message = bytearray(_descriptor(n=3).encode())
    for _ in range(data.draw(st.integers(1, 4))):
        message[data.draw(st.integers(0, len(message) - 1))] = data.draw(st.integers(0, 255))
    with contextlib.suppress(ValueError):  # anything else escaping decode is a bug
        decode_any(bytes(message))


# -- construction --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"dst_block_ids": (100, 101)}, "one entry per block"),
        ({"dst_generations": (1, 2, 3, 4)}, "one entry per block"),
        ({"src_block_ids": (), "dst_block_ids": (), "dst_generations": (), "checksums": ()},
         "at least one block"),
        ({"dst_block_ids": (5, 5, 6)}, "dst_block_ids must not repeat"),
        ({"src_block_ids": (0, 0, 1)}, "src_block_ids must not repeat"),
        ({"src_block_ids": (0, 1, -2)}, "src_block_ids"),
        ({"dst_block_ids": (0, 1, 2**32)}, "dst_block_ids"),
        ({"dst_generations": (0, 1, 2**64)}, "dst_generations"),
        ({"dst_generations": (0, True, 1)}, "integers"),
        ({"layer_begin": 30}, "layer_begin"),
        ({"layer_begin": 5, "layer_end": 5}, "layer_end"),
        ({"layer_end": 31}, "layer_end"),
        ({"checksums": (1, 2)}, "one per"),
        ({"checksums": (2**32,) * 90}, "checksums"),
        ({"transfer_id": -1}, "transfer_id"),
        ({"transfer_id": 2**64}, "transfer_id"),
        ({"protocol_version": 2}, "version"),
        ({"sender": ("10.0.0.1", 7100)}, "PeerId"),
        ({"src_block_ids": {1, 2, 3}}, "tuple or list"),
    ],
)
def test_invalid_descriptors_say_what_to_fix(overrides, match):
    with pytest.raises(ValueError, match=match):
        _descriptor(**overrides)


def test_lists_are_frozen_into_tuples():
    d = _descriptor(n=2, with_crc=False, src_block_ids=[3, 4], dst_block_ids=[5, 6],
                    dst_generations=[1, 1])
    assert d.src_block_ids == (3, 4) and isinstance(d.dst_generations, tuple)
    assert d.layers == range(0, 30) and d.num_slices == 60
    hash(d)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"token0_logprob": -1.0}, "without token0"), ({"token0": 1, "token0_logprob": 0.1}, "<= 0"),
     ({"token0": 1, "token0_logprob": float("-inf")}, "finite"), ({"token0": -1}, "token0"),
     ({"checksums": (2**32,)}, "checksums")],
)
def test_invalid_notices(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CompletionNotice(**{"transfer_id": 1, "sender": PREFILL, "checksums": (), **kwargs})


def test_integer_logprob_is_stored_as_float():
    assert CompletionNotice(1, PREFILL, (), 3, 0).token0_logprob == 0.0


# -- layout and peers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("model_id", "other/model"), ("dtype", "float16"), ("block_size", 32), ("num_layers", 24),
     ("kv_heads", 8), ("head_dim", 128)],
)
def test_incompatible_layouts_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"incompatible KV layout: {field} is"):
        LAYOUT.check_compatible(dataclasses.replace(LAYOUT, **{field: value}))
    LAYOUT.check_compatible(dataclasses.replace(LAYOUT))


def test_another_pool_layout_is_one_more_name(monkeypatch):
    """A latent (MLA) pool: one plane of width head_dim per token, no K/V pair."""
    latent = "latent[block,layer,token,latent_dim]"
    monkeypatch.setitem(layout_mod._SLICE_SHAPES, latent,
                        lambda lay: (lay.block_size, lay.head_dim))
    mla = KVLayout("deepseek", "bfloat16", 64, 27, 1, 576, latent)
    assert mla.slice_nbytes == 64 * 576 * 2
    with pytest.raises(ValueError, match="layout is"):
        mla.check_compatible(dataclasses.replace(mla, layout=LAYOUT_PAGED_KV))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"dtype": "bf16"}, "dtype"), ({"block_size": 0}, "block_size"),
     ({"model_id": ""}, "model_id"), ({"head_dim": 1.5}, "head_dim"),
     ({"layout": "[layer,block]"}, "layout")],
)
def test_invalid_layouts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(LAYOUT, **kwargs)


def test_layout_of_a_real_cache():
    model = ModelConfig("LlamaForCausalLM", 64, 32, 64, 3, 4, 2, 8, 128)
    cache = KVCache(model, num_blocks=4, block_size=4, dtype=torch.bfloat16)
    layout = KVLayout.of_cache(cache, "tiny")
    assert layout == KVLayout("tiny", "bfloat16", 4, 3, 2, 8)
    assert layout.slice_nbytes == slice_nbytes(cache.data) == cache.block_nbytes // 3


def test_peer_ids(monkeypatch):
    a, b = PeerId.local("10.0.0.1", 7100), PeerId.local("10.0.0.1", 7200)
    assert a.instance_id == b.instance_id == peer_mod.process_instance_id()
    assert 0 < a.instance_id < 2**64 and PeerId.from_json(a.to_json()) == a
    monkeypatch.setattr(peer_mod, "_instance", peer_mod._instance)  # restored after the test
    monkeypatch.setattr(peer_mod.os, "getpid", lambda: -1)  # a forked child, or a restart
    c = PeerId.local("10.0.0.1", 7100)
    assert c != a and c.same_address(a) and c.instance_id != a.instance_id
    for kwargs, match in [({"instance_id": 0}, "instance_id"), ({"host": ""}, "host"),
                          ({"host": "a b"}, "whitespace"), ({"port": 0}, "port"),
                          ({"port": 65536}, "port")]:
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(a, **kwargs)
