"""The frame layout alone: every size is checked before allocation; only typed errors."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transport import frames
from transport.codecs import CodecSpec
from transport.errors import CodecError, LimitExceeded, LocalUsageError, MalformedFrame, PeerProtocolError
from transport.frames import Message
from transport.limits import Limits

LIMITS = Limits(max_header_bytes=4096, max_message_bytes=1 << 20, max_tensor_bytes=4 << 20)


def roundtrip(message: Message, spec: CodecSpec = CodecSpec(name="none")) -> Message:
    frame = frames.encode_message(message, spec)
    header_len = frames.parse_prefix(frame.head[:frames.PREFIX_BYTES], LIMITS)
    header = frames.parse_header(frame.head[frames.PREFIX_BYTES:], LIMITS)
    assert header_len == len(frame.head) - frames.PREFIX_BYTES
    payload = bytearray(b"".join(bytes(p) for p in frame.parts))
    assert len(payload) == header.payload_bytes == frame.payload_bytes
    return frames.decode_message(header, memoryview(payload), LIMITS)


def test_roundtrip_kind_meta_and_tensors() -> None:
    x, ids = torch.randn(4, 5), torch.arange(7)
    got = roundtrip(Message(kind="forward", meta={"mb": "a1", "hop": 2}, tensors=(x, ids)))
    assert got.kind == "forward" and got.meta == {"mb": "a1", "hop": 2}
    assert torch.equal(got.tensors[0], x) and torch.equal(got.tensors[1], ids)


def test_message_without_tensors_has_empty_payload() -> None:
    frame = frames.encode_message(Message(kind="hello"), CodecSpec(name="none"))
    assert frame.payload_bytes == 0 and frame.parts == ()
    assert roundtrip(Message(kind="hello")).tensors == ()


def test_message_is_validated_when_built() -> None:
    with pytest.raises(LocalUsageError):
        Message(kind="")
    with pytest.raises(LocalUsageError):
        Message(kind="x" * 65)
    with pytest.raises(LocalUsageError):
        frames.encode_message(Message(kind="x", meta={"f": object()}), CodecSpec(name="none"))


def prefix(header_len: int, magic: bytes = frames.MAGIC, version: int = frames.VERSION) -> bytes:
    return frames.PREFIX.pack(magic, version, header_len)


@pytest.mark.parametrize("data, error", [
    (prefix(10, magic=b"GE"), MalformedFrame),
    (prefix(10, version=9), MalformedFrame),
    (prefix(0), MalformedFrame),
    (prefix(4097), LimitExceeded),
    (prefix(2**32 - 1), LimitExceeded),
    (b"SW", MalformedFrame),
])
def test_bad_prefixes(data: bytes, error: type) -> None:
    with pytest.raises(error):
        frames.parse_prefix(data, LIMITS)


def header(**fields) -> bytes:
    base = {"k": "x", "m": {}, "t": [], "n": 0}
    base.update(fields)
    return msgpack.packb({k: v for k, v in base.items() if v is not ...})


def meta(**fields):
    base = {"codec": "none", "dtype": "float32", "shape": [4], "params": {}, "nbytes": 16}
    base.update(fields)
    return base


@pytest.mark.parametrize("body, error", [
    (b"\xc1", MalformedFrame),
    (msgpack.packb([1, 2]), MalformedFrame),
    (header(k=""), MalformedFrame),
    (header(k=5), MalformedFrame),
    (header(m=[]), MalformedFrame),
    (header(t={}), MalformedFrame),
    (header(n=-1), MalformedFrame),
    (header(n=True), MalformedFrame),
    (header(n=...), MalformedFrame),
    (header(n=(1 << 20) + 1), LimitExceeded),
    (header(t=[meta()] * 65, n=16 * 65), LimitExceeded),
    (header(t=[meta()], n=17), MalformedFrame),
    (header(t=[meta(nbytes=15)], n=15), CodecError),
    (header(t=[meta(shape=[2**40], nbytes=2**42)], n=2**42), LimitExceeded),
    (header(t=["x"], n=0), MalformedFrame),
    (msgpack.packb({1: 2}), MalformedFrame),
])
def test_bad_headers(body: bytes, error: type) -> None:
    with pytest.raises(error):
        frames.parse_header(body, LIMITS)


def test_payload_must_match_header() -> None:
    h = frames.parse_header(header(t=[meta()], n=16), LIMITS)
    with pytest.raises(MalformedFrame):
        frames.decode_message(h, memoryview(bytearray(15)), LIMITS)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_header_bytes_give_only_typed_errors(body: bytes) -> None:
    try:
        header = frames.parse_header(body, LIMITS)
    except PeerProtocolError:
        return  # refused with a typed error: what untrusted bytes must get
    assert 0 <= header.payload_bytes <= LIMITS.max_message_bytes  # accepted: within limits


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["k", "m", "t", "n", "x"]), json_values, max_size=5))
def test_random_structured_headers_give_only_typed_errors(fields: dict) -> None:
    try:
        body = msgpack.packb(fields)
    except (OverflowError, TypeError, ValueError):
        return
    try:
        h = frames.parse_header(body, LIMITS)
    except PeerProtocolError:
        return
    # accepted: the sizes it announces are within limits
    assert 0 <= h.payload_bytes <= LIMITS.max_message_bytes


def test_a_parsed_header_knows_the_whole_frame_size() -> None:
    frame = frames.encode_message(Message(kind="k", meta={"a": 1}, tensors=(torch.ones(3),)),
                                  CodecSpec(name="none"))
    header = frames.parse_header(frame.head[frames.PREFIX_BYTES:], LIMITS)
    assert header.frame_bytes == frame.total_bytes  # what the sender counts, the receiver counts
