"""Tests of transport/codecs.py: round trips, error bounds, hostile metas and payloads."""

from __future__ import annotations

import gc
import math
import random
import struct
import warnings

import msgpack
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from transport.codecs import (CODECS, DTYPES, CodecSpec, EncodedTensor, decode, encode,
                              expected_payload_bytes)
from transport.errors import (CodecError, LimitExceeded, LocalUsageError, PeerProtocolError,
                              UnknownCodec)
from transport.limits import Limits

LIMITS = Limits()
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INTEGERS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]
ALL_CODECS = ["none", "fp16", "int8", "int4", "int2", "none+zstd", "fp16+zstd", "int8+zstd",
              "int4+zstd", "int2+zstd"]


def payload_of(encoded: EncodedTensor) -> memoryview:
    """The parts joined into writable memory, as the wire hands them to decode."""
    return memoryview(bytearray(b"".join(encoded.parts)))


def roundtrip(x: torch.Tensor, spec: CodecSpec | str, limits: Limits = LIMITS) -> torch.Tensor:
    if isinstance(spec, str):
        spec = CodecSpec.parse(spec)
    encoded = encode(x, spec)
    meta = msgpack.unpackb(msgpack.packb(encoded.meta()))  # exactly what a peer receives
    assert expected_payload_bytes(meta, limits) == encoded.nbytes
    out = decode(meta, payload_of(encoded), limits)
    assert out.dtype == x.dtype and out.shape == x.shape
    return out


def rel_rms(approx: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.double()
    return float((approx.double() - exact).norm() / exact.norm())


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bytes, for bit-exact comparisons (NaN payloads included)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(view) if t.dtype != torch.bool else t


def some_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**62)), min(info.max, 2**62)
    x = torch.randint(low, high, shape, generator=gen, dtype=torch.int64).to(dtype)
    if x.numel() >= 2:  # the extremes must survive too
        x.view(-1)[0], x.view(-1)[1] = info.min, info.max
    return x


# ------------------------------------------------------------------------- reference int8

def reference_int8(x: torch.Tensor, block: int, scale_dtype: str):
    """Straightforward blockwise absmax quantisation: padded copy, abs, float64 division.
    Returns the scale dtype used (float16 scales that overflow fall back to float32), the
    scales and the unrounded x / scale."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block)
    padded[:n] = flat
    s = padded.view(blocks, block).abs().amax(1) / 127
    scale = s.clamp_min(torch.finfo(torch.float32).tiny)
    if scale_dtype == "float16":
        half = s.clamp_min(2.0**-24).to(torch.float16)
        up = torch.nextafter(half, torch.full_like(half, math.inf))
        half = torch.where(half.float() < s.clamp_min(2.0**-24), up, half)
        if torch.isinf(half).any():
            scale_dtype = "float32"
        else:
            scale = half.float()
    ratio = padded.view(blocks, block).double() / scale.double()[:, None]
    return scale_dtype, scale, ratio.reshape(-1)[:n]


def split_int8_payload(encoded: EncodedTensor):
    params = encoded.params
    payload = bytes(b"".join(encoded.parts))
    n = math.prod(encoded.shape)
    itemsize = 2 if params["scale_dtype"] == "float16" else 4
    blocks = -(-n // params["block_size"])
    assert len(payload) == blocks * itemsize + n
    if n == 0:
        return torch.empty(0), torch.empty(0, dtype=torch.int8)
    scales = torch.frombuffer(bytearray(payload[:blocks * itemsize]),
                              dtype=DTYPES[params["scale_dtype"]]).float()
    return scales, torch.frombuffer(bytearray(payload[blocks * itemsize:]), dtype=torch.int8)


def check_against_reference(x: torch.Tensor, block: int, scale_dtype: str) -> None:
    spec = CodecSpec(name="int8", block_size=block, scale_dtype=scale_dtype)
    encoded = encode(x, spec)
    used, ref_scale, ratio = reference_int8(x, block, scale_dtype)
    assert encoded.params == {"mode": "int8", "block_size": block, "scale_dtype": used}
    scales, q = split_int8_payload(encoded)
    assert torch.equal(scales, ref_scale)
    if q.numel():
        assert int(q.int().abs().max()) <= 127
        diff = (q.double() - ratio.round()).abs()
        assert float(diff.max()) <= 1
        # x * (1/scale) may round differently from x / scale, but only next to a tie
        near_tie = ((ratio - ratio.floor()) - 0.5).abs() < 1e-4
        assert bool((near_tie | (diff == 0)).all())
    out = decode(encoded.meta(), payload_of(encoded), LIMITS)
    expected = (q.float().view(-1) * ref_scale.repeat_interleave(block)[:q.numel()]).to(x.dtype)
    assert torch.equal(out.reshape(-1), expected)


# ------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("dtype", FLOATS + INTEGERS)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7, 13), (3, 0, 2), (1000,)])
def test_none_is_bit_exact(dtype, shape):
    x = some_tensor(dtype, shape)
    if dtype.is_floating_point and x.numel() > 3:
        x.view(-1)[:3] = torch.tensor([math.nan, math.inf, -0.0], dtype=dtype)
    out = roundtrip(x, "none")
    assert torch.equal(bits(out), bits(x))
    assert torch.equal(bits(roundtrip(x, "none+zstd")), bits(x))


def test_bfloat16_bit_patterns_survive_none():
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(roundtrip(x, "none").view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("codec", ALL_CODECS)
@pytest.mark.parametrize("dtype", INTEGERS)
def test_integers_and_bool_are_lossless_under_every_codec(codec, dtype):
    x = some_tensor(dtype, (5, 67), seed=3)
    encoded = encode(x, CodecSpec.parse(codec))
    if codec.split("+")[0] != "none":
        assert encoded.params["mode"] == "raw"
    assert torch.equal(roundtrip(x, codec), x)


@pytest.mark.parametrize("codec", ALL_CODECS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(), (0,), (0, 4), (1,), (63,), (65,), (3, 129), (4096,)])
def test_floats_roundtrip_every_codec(codec, dtype, shape):
    x = some_tensor(dtype, shape, seed=1)
    out = roundtrip(x, codec)
    if x.numel() == 0 or codec.startswith("none"):
        assert torch.equal(bits(out), bits(x))
        return
    bound = {"fp16": 1e-3, "int8": 0.012, "int4": 0.13, "int2": 0.5}[codec.split("+")[0]]
    if dtype == torch.bfloat16 and codec.startswith("fp16"):
        bound = 1e-2  # bfloat16 -> float16 -> bfloat16 may round twice
    assert rel_rms(out, x) <= bound


def test_fp16_error_on_normal_data_and_float16_input_exact():
    x = some_tensor(torch.float32, (64, 1024), seed=5)
    assert rel_rms(roundtrip(x, "fp16"), x) <= 5e-4
    h = x.half()
    assert torch.equal(roundtrip(h, "fp16"), h)
    assert encode(x, CodecSpec(name="fp16")).nbytes == x.numel() * 2


def test_int8_error_and_wire_ratio_on_normal_data():
    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(7))
    encoded = encode(x, CodecSpec(name="int8"))
    assert encoded.nbytes / (x.numel() * 4) <= 0.27
    out = decode(encoded.meta(), payload_of(encoded), LIMITS)
    assert rel_rms(out, x) <= 0.01
    assert rel_rms(roundtrip(x, CodecSpec(name="int8", block_size=16, scale_dtype="float32")),
                   x) <= 0.01


def test_int8_outliers_do_not_ruin_the_other_values():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1 << 18, generator=gen)
    outliers = torch.randperm(x.numel(), generator=gen)[: x.numel() // 1000]
    x[outliers] *= 50
    out = roundtrip(x, "int8")
    ordinary = torch.ones_like(x, dtype=torch.bool)
    ordinary[outliers] = False
    assert rel_rms(out[ordinary], x[ordinary]) <= 0.06
    assert rel_rms(out[outliers], x[outliers]) <= 0.01


@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
@pytest.mark.parametrize("block", [16, 64, 256])
def test_int8_matches_reference_on_fixed_cases(block, scale_dtype):
    gen = torch.Generator().manual_seed(block)
    cases = [torch.zeros(0), torch.tensor(2.5), torch.zeros(block * 3 + 5),
             torch.randn(block * 4 + 1, generator=gen) * 1e-6,  # subnormal float16 scales
             torch.randn(2 * block - 1, generator=gen) * 1e4,
             torch.tensor([0.5, -0.5, 1.5, -1.5, 127.0, -127.0] * block)]
    for x in cases:
        check_against_reference(x, block, scale_dtype)


def test_all_zero_blocks_decode_to_zero_not_nan():
    x = torch.zeros(3, 64)
    x[1, 5] = -4.0
    out = roundtrip(x, "int8")
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros(64)) and torch.equal(out[2], torch.zeros(64))
    assert float(out[1, 5]) == pytest.approx(-4.0, rel=1e-3)


def test_int8_nan_and_inf_only_spoil_their_block():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    x[1, 3], x[2, 7] = math.nan, math.inf
    out = roundtrip(x, "int8")
    assert not torch.isfinite(out[1]).any() and not torch.isfinite(out[2]).any()
    assert rel_rms(out[[0, 3]], x[[0, 3]]) <= 0.01


def test_int8_float16_scale_overflow_falls_back_to_float32_scales():
    x = torch.randn(256, generator=torch.Generator().manual_seed(4))
    x[70] = 1e9  # absmax / 127 is far above the float16 range
    encoded = encode(x, CodecSpec(name="int8"))
    assert encoded.params["scale_dtype"] == "float32"
    out = decode(encoded.meta(), payload_of(encoded), LIMITS)
    assert out[70] == pytest.approx(1e9, rel=1e-6)
    assert rel_rms(out[:64], x[:64]) <= 0.01


def test_int8_tiny_values_with_float16_scales_stay_within_half_a_step():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(9)) * 1e-4
    encoded = encode(x, CodecSpec(name="int8"))
    scales, _ = split_int8_payload(encoded)
    out = decode(encoded.meta(), payload_of(encoded), LIMITS)
    step = scales.repeat_interleave(64)[:1000]
    assert bool(((out - x).abs() <= step * 0.5001).all())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(0, 300), two_dims=st.booleans(), block=st.sampled_from([16, 32, 64, 128]),
       scale_dtype=st.sampled_from(["float16", "float32"]),
       dtype=st.sampled_from(FLOATS), exponent=st.integers(-12, 10), zeros=st.booleans(),
       seed=st.integers(0, 2**31))
def test_int8_property_matches_reference(size, two_dims, block, scale_dtype, dtype, exponent,
                                         zeros, seed):
    if dtype == torch.float16:
        exponent = min(exponent, 3)  # stay finite in float16
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, generator=gen) * 10.0**exponent
    if zeros:
        x[torch.rand(size, generator=gen) < 0.5] = 0
    x = x.to(dtype)
    if two_dims and size % 3 == 0:
        x = x.view(3, -1)
    check_against_reference(x, block, scale_dtype)


def test_noncontiguous_grad_and_zero_dim_inputs():
    base = torch.randn(32, 48, generator=torch.Generator().manual_seed(1))
    t = base.t()
    assert not t.is_contiguous()
    assert torch.equal(roundtrip(t, "none"), t)
    assert torch.equal(roundtrip(t, "int8"), roundtrip(t.contiguous(), "int8"))
    g = base.clone().requires_grad_(True)
    assert torch.equal(roundtrip(g, "fp16"), base.half().float())
    assert roundtrip(torch.tensor(3.0), "int8").item() == pytest.approx(3.0, rel=1e-2)


def test_zstd_compresses_and_records_raw_length():
    x = torch.zeros(64, 1024)
    for name in ("none", "fp16", "int8"):
        for level in (1, 19):
            plain = encode(x, CodecSpec(name=name))
            packed = encode(x, CodecSpec(name=name + "+zstd", zstd_level=level))
            assert packed.params["raw_nbytes"] == plain.nbytes
            assert packed.nbytes < plain.nbytes / 50
            assert torch.equal(decode(packed.meta(), payload_of(packed), LIMITS), x)


def test_encoded_tensor_parts_and_meta():
    x = torch.randn(10, 10)
    encoded = encode(x, CodecSpec(name="int8"))
    assert all(isinstance(p, memoryview) and p.readonly for p in encoded.parts)
    meta = encoded.meta()
    assert set(meta) == {"codec", "dtype", "shape", "params", "nbytes"}
    assert meta["nbytes"] == sum(p.nbytes for p in encoded.parts) == encoded.nbytes
    assert msgpack.unpackb(msgpack.packb(meta)) == meta


def test_parts_keep_their_tensor_alive():
    encoded = encode(torch.arange(1000, dtype=torch.int64) * 7, CodecSpec(name="none"))
    gc.collect()
    torch.ones(10000)  # reuse of freed memory would show up as wrong bytes
    out = decode(encoded.meta(), payload_of(encoded), LIMITS)
    assert torch.equal(out, torch.arange(1000, dtype=torch.int64) * 7)


def test_none_decode_aliases_writable_payload_and_copies_read_only():
    x = torch.arange(16, dtype=torch.float32)
    encoded = encode(x, CodecSpec(name="none"))
    payload = payload_of(encoded)
    out = decode(encoded.meta(), payload, LIMITS)
    payload[0:4] = struct.pack("<f", 42.0)
    assert out[0] == 42.0  # zero-copy: the tensor is the payload
    frozen = bytes(b"".join(encoded.parts))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy = decode(encoded.meta(), memoryview(frozen), LIMITS)
    copy[1] = -1.0  # writable and not the caller's bytes
    assert frozen == bytes(b"".join(encoded.parts))


def test_bool_payload_bytes_are_normalised():
    meta = {"codec": "none", "dtype": "bool", "shape": [4], "params": {}, "nbytes": 4}
    out = decode(meta, memoryview(bytearray([0, 1, 2, 255])), LIMITS)
    assert out.view(torch.uint8).tolist() == [0, 1, 1, 1]


def test_misaligned_payload_decodes_correctly():
    x = torch.randn(33, dtype=torch.float64)
    for codec in ("none", "fp16", "int8"):
        encoded = encode(x, CodecSpec(name=codec))
        buf = bytearray(1) + bytearray(b"".join(encoded.parts))
        out = decode(encoded.meta(), memoryview(buf)[1:], LIMITS)
        assert torch.equal(out, decode(encoded.meta(), payload_of(encoded), LIMITS))


def test_encode_rejects_what_it_cannot_send():
    with pytest.raises(LocalUsageError):
        encode(torch.zeros(3, dtype=torch.complex64), CodecSpec(name="none"))
    with pytest.raises(LocalUsageError):
        encode([1.0, 2.0], CodecSpec(name="none"))  # type: ignore[arg-type]
    with pytest.raises(LocalUsageError):
        encode(torch.zeros(3), "int8")  # type: ignore[arg-type]


def test_registering_a_codec_is_one_object(monkeypatch):
    class Negate:
        name = "neg"

        def encode(self, x, spec):
            return {}, (x.neg(),)

        def payload_bytes(self, dtype, numel, params):
            if params:
                raise CodecError("no params")
            return numel * DTYPES[dtype].itemsize

        def decode(self, payload, dtype, numel, params):
            return torch.frombuffer(payload, dtype=DTYPES[dtype]).neg()

    monkeypatch.setitem(CODECS, "neg", Negate())
    x = torch.randn(5, 3)
    assert torch.equal(roundtrip(x, "neg"), x)
    assert torch.equal(roundtrip(x, "neg+zstd"), x)


# ------------------------------------------------------------------------- CodecSpec

def test_codec_spec_parse_accepts_valid_text():
    spec = CodecSpec.parse(" int8+zstd ", block_size="128", scale_dtype="float32", zstd_level=3)
    assert (spec.name, spec.base, spec.zstd) == ("int8+zstd", "int8", True)
    assert (spec.block_size, spec.scale_dtype, spec.zstd_level) == (128, "float32", 3)
    assert CodecSpec.parse("fp16").zstd is False


@pytest.mark.parametrize("text, options, bad", [
    ("int9", {}, "int9"), ("int8+lz4", {}, "lz4"), ("", {}, "''"),
    ("int8+zstd+zstd", {}, "zstd+zstd"),
    ("int8", {"block_size": 100}, "100"), ("int8", {"block_size": 8}, "8"),
    ("int8", {"block_size": 131072}, "131072"), ("int8", {"block_size": True}, "True"),
    ("int8", {"block_size": "abc"}, "abc"), ("int8", {"scale_dtype": "bfloat16"}, "bfloat16"),
    ("int8+zstd", {"zstd_level": 0}, "0"), ("int8+zstd", {"zstd_level": 23}, "23"),
    ("int8", {"colour": "red"}, "colour"),
])
def test_codec_spec_parse_names_the_bad_part(text, options, bad):
    with pytest.raises(ValueError) as info:
        CodecSpec.parse(text, **options)
    assert bad in str(info.value)


def test_codec_spec_validates_when_built_directly():
    with pytest.raises(ValueError, match="48"):
        CodecSpec(name="int8", block_size=48)
    with pytest.raises(ValueError, match="bogus"):
        CodecSpec(name="bogus")


# ------------------------------------------------------------------------- hostile metas

def good_meta(codec: str = "int8", dtype=torch.float32, shape=(4, 20)):
    x = some_tensor(dtype, shape)
    encoded = encode(x, CodecSpec.parse(codec))
    return encoded.meta(), bytes(b"".join(encoded.parts))


def with_(meta: dict, **changes) -> dict:
    out = dict(meta, params=dict(meta["params"]))
    for key, value in changes.items():
        if key.startswith("p_"):
            if value is None:
                out["params"].pop(key[2:], None)
            else:
                out["params"][key[2:]] = value
        elif value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("codec", ["int3", "int8+lz4", "zstd", "INT8", "int8+", "+zstd"])
def test_unknown_codec(codec):
    meta, payload = good_meta()
    with pytest.raises(UnknownCodec):
        expected_payload_bytes(with_(meta, codec=codec), LIMITS)
    with pytest.raises(UnknownCodec):
        decode(with_(meta, codec=codec), memoryview(bytearray(payload)), LIMITS)


@pytest.mark.parametrize("changes", [
    {"codec": 5}, {"codec": None}, {"codec": b"int8"},
    {"dtype": "complex64"}, {"dtype": None}, {"dtype": ["float32"]},
    {"shape": [-1, 20]}, {"shape": [4.0, 20]}, {"shape": [True, 20]}, {"shape": "4,20"},
    {"shape": None}, {"shape": [4, 21]}, {"shape": [81]},
    {"params": None}, {"params": [1]}, {"params": {1: 2}}, {"params": {"block_size": 1.5}},
    {"p_block_size": 48}, {"p_block_size": None}, {"p_block_size": 2**70},
    {"p_scale_dtype": "bfloat16"}, {"p_mode": "raw"}, {"p_extra": 1},
    {"nbytes": -1}, {"nbytes": None}, {"nbytes": True}, {"nbytes": 1.0}, {"nbytes": 99},
])
def test_malformed_meta_is_a_codec_error(changes):
    meta, payload = good_meta()
    bad = with_(meta, **changes)
    with pytest.raises(CodecError):
        expected_payload_bytes(bad, LIMITS)
    with pytest.raises(CodecError):
        decode(bad, memoryview(bytearray(payload)), LIMITS)


def test_meta_params_must_match_dtype_and_codec():
    meta, _ = good_meta("fp16", torch.int32)
    with pytest.raises(CodecError):
        expected_payload_bytes(with_(meta, p_mode="half"), LIMITS)
    meta, _ = good_meta("int8", torch.int16)
    with pytest.raises(CodecError):
        expected_payload_bytes(with_(meta, p_mode="int8", p_block_size=64,
                                     p_scale_dtype="float16"), LIMITS)
    meta, _ = good_meta("none")
    with pytest.raises(CodecError):
        expected_payload_bytes(with_(meta, p_block_size=64), LIMITS)
    with pytest.raises(CodecError):
        expected_payload_bytes(["not", "a", "map"], LIMITS)  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", ALL_CODECS)
def test_payload_length_must_match(codec):
    meta, payload = good_meta(codec)
    for wrong in (payload[:-1], payload + b"\0", b""):
        with pytest.raises(CodecError):
            decode(meta, memoryview(bytearray(wrong)), LIMITS)
    with pytest.raises(LocalUsageError):
        decode(meta, 12345, LIMITS)  # type: ignore[arg-type]


def test_sizes_over_limits_are_refused_before_allocating(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("allocation attempted")

    huge = {"codec": "none", "dtype": "float32", "shape": [2**40], "params": {}, "nbytes": 2**42}
    huge_int8 = {"codec": "int8+zstd", "dtype": "float32", "shape": [2**20, 2**20],
                 "params": {"mode": "int8", "block_size": 64, "scale_dtype": "float16",
                            "raw_nbytes": 2**40 + 2**35}, "nbytes": 100}
    for name in ("empty", "zeros", "frombuffer", "empty_like", "full"):
        monkeypatch.setattr(torch, name, boom)
    monkeypatch.setattr(zstandard, "ZstdDecompressor", boom)
    for meta in (huge, huge_int8, dict(huge, shape=[0, 2**40]), dict(huge, shape=[2**62] * 8)):
        with pytest.raises(LimitExceeded):
            expected_payload_bytes(meta, LIMITS)
        with pytest.raises(LimitExceeded):
            decode(meta, memoryview(bytearray(100)), LIMITS)


def test_other_limits():
    meta, payload = good_meta("none", torch.float32, (10, 30))  # 1200 bytes
    with pytest.raises(LimitExceeded):
        decode(meta, memoryview(bytearray(payload)), Limits(max_tensor_bytes=1000))
    with pytest.raises(LimitExceeded):
        decode(meta, memoryview(bytearray(payload)), Limits(max_message_bytes=1000))
    exact = Limits(max_tensor_bytes=1200, max_message_bytes=1200)
    assert decode(meta, memoryview(bytearray(payload)), exact).numel() == 300
    with pytest.raises(LimitExceeded):
        expected_payload_bytes(with_(meta, shape=[1] * 9), LIMITS)
    assert expected_payload_bytes(with_(meta, shape=[1] * 7 + [300]), LIMITS) == 1200


def test_zstd_frame_errors():
    meta, payload = good_meta("int8+zstd")
    raw = meta["params"]["raw_nbytes"]
    plain = zstandard.ZstdDecompressor().decompress(payload)

    def attempt(params_change, data):
        bad = with_(meta, nbytes=len(data), **params_change)
        with pytest.raises(CodecError):
            decode(bad, memoryview(bytearray(data)), LIMITS)

    attempt({}, b"\x28\xb5\x2f\xfd" + b"garbage" * 5)
    attempt({}, payload + b"extra")
    attempt({}, payload + payload)
    attempt({}, payload[:-3])
    attempt({"p_raw_nbytes": raw + 1}, payload)
    attempt({"p_raw_nbytes": None}, payload)
    attempt({"p_raw_nbytes": "many"}, payload)
    # a frame whose header declares another size, and frames without a declared size
    attempt({}, zstandard.ZstdCompressor().compress(plain + b"x"))
    no_size = zstandard.ZstdCompressor(write_content_size=False)
    attempt({}, no_size.compress(plain + b"x" * 1000))
    attempt({}, no_size.compress(plain[:-1]))
    ok = no_size.compress(plain)
    assert decode(with_(meta, nbytes=len(ok)), memoryview(bytearray(ok)), LIMITS).shape == (4, 20)


# ------------------------------------------------------------------------- fuzzing decode

SMALL = Limits(max_tensor_bytes=1 << 14, max_message_bytes=1 << 14)
CODEC_NAMES = st.sampled_from(ALL_CODECS + ["bogus", "int8+lz4", "", "none+zstd+zstd"])
ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6)
    | st.binary(max_size=6),
    lambda inner: (st.lists(inner, max_size=4)
                   | st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8)
PARAM_VALUES = (st.sampled_from(["int8", "half", "raw", "packed", "float16", "float32",
                                 "bfloat16"])
                | st.integers(-2, 2**17))
PARAMS = (st.sampled_from([{}, {"mode": "raw"}, {"mode": "half"}])
          | st.builds(lambda b, s: {"mode": "int8", "block_size": b, "scale_dtype": s},
                      st.sampled_from([16, 64, 48, 0]), st.sampled_from(["float16", "float32", "x"]))
          | st.builds(lambda bits, b, s, c: {"mode": "packed", "bits": bits, "block_size": b,
                                             "scale_dtype": s, "channels": c,
                                             **({"mean_dtype": "float16"} if c else {})},
                      st.sampled_from([2, 4, 3, 8, 0, -4, 2**40]), st.sampled_from([16, 256, 48, 0]),
                      st.sampled_from(["bfloat16", "float16", "float32", "x"]),
                      st.sampled_from([0, 1, 2, 3, 12, -1, 2**40]))
          | st.dictionaries(st.sampled_from(["mode", "bits", "block_size", "scale_dtype",
                                             "channels", "mean_dtype", "raw_nbytes", "x"]),
                            PARAM_VALUES, max_size=5))
METAS = st.fixed_dictionaries({
    "codec": CODEC_NAMES | ANY,
    "dtype": st.sampled_from(list(DTYPES) + ["complex64"]) | ANY,
    "shape": st.lists(st.integers(0, 12), max_size=3) | st.lists(st.integers(-1, 40), max_size=9)
    | ANY,
    "params": PARAMS | ANY,
    "nbytes": st.integers(-1, 1 << 15) | ANY,
})


def made_consistent(meta: dict, rng: random.Random):
    """Best effort: fix ``nbytes`` (and ``raw_nbytes``, with a real zstd frame around random
    bytes) so that fuzzing also reaches the codecs' decode paths. None if it cannot."""
    try:
        base, _, suffix = meta["codec"].partition("+")
        params = {k: v for k, v in meta["params"].items() if k != "raw_nbytes"}
        raw_len = CODECS[base].payload_bytes(meta["dtype"], math.prod(meta["shape"]), params)
    except Exception:  # noqa: BLE001 - any junk meta simply stays as it is
        return None
    if not isinstance(raw_len, int) or not 0 <= raw_len <= SMALL.max_tensor_bytes:
        return None
    payload = rng.randbytes(raw_len)
    if suffix:
        params["raw_nbytes"] = raw_len
        payload = zstandard.ZstdCompressor().compress(payload)
    return dict(meta, params=params, nbytes=len(payload)), payload


def decode_or_protocol_error(meta, payload: bytes, limits: Limits = SMALL) -> None:
    try:
        out = decode(meta, memoryview(bytearray(payload)), limits)
    except PeerProtocolError as exc:
        if currently_in_test_context():
            event(type(exc).__name__)
        return
    if currently_in_test_context():
        event(f"decoded {meta['codec']}")
    assert isinstance(out, torch.Tensor)
    assert out.dtype == DTYPES[meta["dtype"]]
    assert list(out.shape) == list(meta["shape"])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(meta=METAS | ANY, payload=st.binary(max_size=2048), seed=st.integers(0, 2**32),
       consistent=st.booleans())
def test_fuzz_random_metas_and_payloads(meta, payload, seed, consistent):
    rng = random.Random(seed)
    fixed = made_consistent(meta, rng) if consistent and isinstance(meta, dict) else None
    if fixed is not None:
        meta, payload = fixed
    try:
        need = expected_payload_bytes(meta, SMALL)
    except PeerProtocolError:
        decode_or_protocol_error(meta, payload)
        return
    # a meta that passed validation: give it random bytes of exactly the announced size
    assert 0 <= need <= SMALL.max_message_bytes
    decode_or_protocol_error(meta, payload if len(payload) == need else rng.randbytes(need))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(codec=st.sampled_from(ALL_CODECS), dtype=st.sampled_from(list(DTYPES)),
       shape=st.lists(st.integers(0, 12), max_size=3), block=st.sampled_from([16, 32, 64]),
       scale_dtype=st.sampled_from(["float16", "float32"]), odd_params=st.none() | PARAMS,
       seed=st.integers(0, 2**32))
def test_fuzz_consistent_metas_with_random_payloads(codec, dtype, shape, block, scale_dtype,
                                                    odd_params, seed):
    base = codec.partition("+")[0]
    if odd_params is not None:
        params = odd_params
    elif base == "none":
        params = {}
    elif not DTYPES[dtype].is_floating_point:
        params = {"mode": "raw"}
    elif base == "fp16":
        params = {"mode": "half"}
    elif base in ("int4", "int2"):
        params = {"mode": "packed", "bits": int(base[3]), "block_size": block,
                  "scale_dtype": scale_dtype, "channels": 0}
    else:
        params = {"mode": "int8", "block_size": block, "scale_dtype": scale_dtype}
    meta = {"codec": codec, "dtype": dtype, "shape": shape, "params": params, "nbytes": 0}
    fixed = made_consistent(meta, random.Random(seed))
    if fixed is not None:
        decode_or_protocol_error(*fixed)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(codec=st.sampled_from(ALL_CODECS), dtype=st.sampled_from(FLOATS + INTEGERS),
       size=st.integers(0, 200),
       key=st.none() | st.sampled_from(["codec", "dtype", "shape", "params", "nbytes", "p_mode",
                                        "p_block_size", "p_scale_dtype", "p_raw_nbytes",
                                        "p_bits", "p_channels", "p_mean_dtype"]),
       value=ANY | PARAM_VALUES,
       flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
       cut=st.just(0) | st.integers(-3, 3))
def test_fuzz_mutated_valid_messages(codec, dtype, size, key, value, flips, cut):
    x = some_tensor(dtype, (size,), seed=size)
    encoded = encode(x, CodecSpec.parse(codec))
    meta = encoded.meta()
    payload = bytearray(b"".join(encoded.parts))
    if key is not None:
        meta = with_(meta, **{key: value})
    for position, byte in flips:
        if payload:
            payload[position % len(payload)] = byte
    if cut > 0:
        payload += bytes(cut)
    elif cut < 0:
        del payload[cut:]
    decode_or_protocol_error(meta, bytes(payload), LIMITS)


def test_fuzz_helper_can_fail(monkeypatch):
    """The fuzz check is not vacuous: a codec that leaks a bare error is caught."""
    class Leaky:
        name = "leaky"

        def encode(self, x, spec):
            return {}, (x,)

        def payload_bytes(self, dtype, numel, params):
            return numel * DTYPES[dtype].itemsize

        def decode(self, payload, dtype, numel, params):
            if payload[0] == 0:
                raise KeyError("bare error")
            return torch.zeros(numel + 1)

    monkeypatch.setitem(CODECS, "leaky", Leaky())
    meta = {"codec": "leaky", "dtype": "uint8", "shape": [4], "params": {}, "nbytes": 4}
    with pytest.raises(KeyError):
        decode_or_protocol_error(meta, b"\0abc", LIMITS)
    decode_or_protocol_error(meta, b"xabc", LIMITS)  # decode() itself catches the bad tensor
