"""The packed low-bit codecs (int4, int2; transport/lowbit.py): levels, packing, rounding, and
hostile headers and payloads refused before the decoded tensor is allocated."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport import codecs, lowbit
from transport.codecs import (MEAN_SAMPLE_ROWS, CodecSpec, _channel_means, decode, encode,
                              expected_payload_bytes)
from transport.errors import CodecError, LimitExceeded
from transport.limits import Limits

LIMITS = Limits()


def payload(encoded) -> memoryview:
    return memoryview(bytearray(b"".join(encoded.parts)))


def roundtrip(x: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    encoded = encode(x, spec)
    return decode(encoded.meta(), payload(encoded), LIMITS)


def sent_steps(x: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    """The block steps as the receiver sees them (the payload's first part)."""
    encoded = encode(x, spec)
    dtype = codecs.DTYPES[encoded.params["scale_dtype"]]
    return torch.frombuffer(bytearray(encoded.parts[0]), dtype=dtype).float()


def reference(x: torch.Tensor, steps: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """Nearest rounding, one block at a time, written the slow and obvious way."""
    half, out = 1 << (bits - 1), torch.empty_like(x)
    for b in range(0, x.numel(), block):
        s = float(steps[b // block])
        q = torch.floor(x[b:b + block] / s + half).clamp(0, 2 * half - 1) if s else half
        out[b:b + block] = (q - half + 0.5) * s if s else 0.0
    return out


# ------------------------------------------------------------------------- levels and packing

@pytest.mark.parametrize("name", ["int4", "int2"])
@pytest.mark.parametrize("n", [1, 3, 63, 64, 257, 1000, lowbit.GROUP + 7])
def test_nearest_matches_the_slow_reference(name, n):
    spec = CodecSpec(name=name)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    out = roundtrip(x, spec)
    expected = reference(x, sent_steps(x, spec), spec.block_size, int(name[3]))
    assert torch.equal(out, expected)


def test_packing_layout_is_planar_twos_complement():
    """int4: 4 values, block 16: step absmax / 8 = 1; codes c = floor(x) in -8..7, value
    c + 1/2; byte j holds code j (high nibble) and code j + 2 (low nibble)."""
    x = torch.tensor([8.0, -8.0, 0.2, -0.2])
    encoded = encode(x, CodecSpec(name="int4", block_size=16, scale_dtype="float32"))
    scale, packed = (bytes(p) for p in encoded.parts)
    assert struct.unpack("<f", scale) == (1.0,)
    # codes: 7 (8 clamps), -8, 0, -1 -> nibbles 0x7, 0x8, 0x0, 0xF
    assert packed == bytes([0x70, 0x8F])
    assert decode(encoded.meta(), payload(encoded), LIMITS).tolist() == [7.5, -7.5, 0.5, -0.5]


def test_int2_packs_four_codes_a_byte():
    x = torch.tensor([3.0, -3.0, 0.3, -0.3, 1.2])
    encoded = encode(x, CodecSpec(name="int2", block_size=16))
    assert encoded.nbytes == 2 + 2  # one bfloat16 step, 5 codes padded to 8 in 2 bytes
    out = decode(encoded.meta(), payload(encoded), LIMITS)
    s = float(sent_steps(x, CodecSpec(name="int2", block_size=16))[0])
    assert out.tolist() == pytest.approx([1.5 * s, -1.5 * s, 0.5 * s, -0.5 * s, 0.5 * s])


@pytest.mark.parametrize("name, bound", [("int4", 0.10), ("int2", 0.35)])
def test_error_and_wire_size_on_normal_data(name, bound):
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))
    encoded = encode(x, CodecSpec(name=name))
    out = decode(encoded.meta(), payload(encoded), LIMITS)
    assert float((out - x).norm() / x.norm()) < bound
    int8 = encode(x, CodecSpec(name="int8")).nbytes
    assert encoded.nbytes <= (int8 / 4 if name == "int2" else int8 / 1.9)


def test_all_zero_blocks_decode_to_exact_zeros():
    x = torch.zeros(3, 320)
    x[1] = torch.randn(320, generator=torch.Generator().manual_seed(4))
    for name in ("int4", "int2"):
        out = roundtrip(x, CodecSpec(name=name, block_size=16))
        assert torch.equal(out[0], x[0]) and torch.equal(out[2], x[2])
        assert float((out[1] - x[1]).norm() / x[1].norm()) < 0.5


def test_other_dtypes_and_integers():
    x = torch.randn(5, 70, generator=torch.Generator().manual_seed(2))
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        out = roundtrip(x.to(dtype), CodecSpec(name="int4"))
        assert out.dtype == dtype and float((out.double() - x.double()).norm() / x.norm()) < 0.12
    ints = torch.arange(100, dtype=torch.int16)
    assert torch.equal(roundtrip(ints, CodecSpec(name="int2")), ints)


def test_float16_scales_fall_back_to_float32_when_a_step_overflows():
    x = torch.randn(256, generator=torch.Generator().manual_seed(1)) * 1e7
    encoded = encode(x, CodecSpec(name="int4", scale_dtype="float16"))
    assert encoded.params["scale_dtype"] == "float32"
    out = decode(encoded.meta(), payload(encoded), LIMITS)
    assert float((out - x).norm() / x.norm()) < 0.12


def test_stochastic_rounding_is_unbiased_and_deterministic():
    """A block of one large value and 63 copies of 0.37: nearest rounding moves 0.37 to a level
    (0.3125); stochastic rounding keeps the mean, of the large value too (its step covers it:
    the outer level is at least 1.0, where int4's nearest step, absmax / 8, puts it at 0.9375)."""
    block = torch.full((64,), 0.37)
    block[0] = 1.0
    x = block.repeat(4096)
    near = roundtrip(x, CodecSpec(name="int4")).view(4096, 64)
    spec = CodecSpec(name="int4", rounding="stochastic")
    sto = roundtrip(x, spec).view(4096, 64)
    assert float(near[:, 1:].mean()) == pytest.approx(0.3125)
    assert float(near[:, 0].mean()) == pytest.approx(0.9375)
    assert float(sto[:, 1:].mean()) == pytest.approx(0.37, abs=2e-3)
    assert float(sto[:, 0].mean()) == pytest.approx(1.0, abs=2e-3)
    step = float(sent_steps(x, spec)[0])
    assert set(sto[:, 1:].unique().tolist()) == {2.5 * step, 3.5 * step}
    assert torch.equal(roundtrip(x, spec), roundtrip(x, spec))  # no global random state


@pytest.mark.parametrize("name", ["int2", "int4"])
@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float16", "float32"])
def test_stochastic_steps_clip_nothing(name, scale_dtype):
    """Nearest 2-bit steps clip a Gaussian block's largest values (a bias that no number of
    microbatches averages away); stochastic steps reach every block's largest magnitude after
    the step is rounded to the wire's dtype (rounded up where rounding down would clip), so the
    mean of many encodings is the tensor itself."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-6, 6, 64)[:, None]
    spec = CodecSpec(name=name, rounding="stochastic", scale_dtype=scale_dtype)
    steps = sent_steps(x.reshape(-1), spec).repeat_interleave(spec.block_size)
    top = steps * ((1 << (int(name[3]) - 1)) - 0.5)
    assert bool((x.reshape(-1).abs() <= top).all())
    nearest = CodecSpec(name="int2")
    clipped = x.reshape(-1).abs() > 1.5 * sent_steps(x.reshape(-1), nearest).repeat_interleave(256)
    assert int(clipped.sum()) > 0.03 * x.numel()
    row = x[40]  # many encodings of one block, each with its own dither (the offset differs)
    mean = sum(roundtrip(row * (1 + k * 1e-6), spec) for k in range(400)) / 400
    assert float((mean - row).norm() / row.norm()) < 0.08


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["int4", "int2"]), n=st.integers(1, 3000),
       block=st.sampled_from([16, 64, 256]), rounding=st.sampled_from(["nearest", "stochastic"]),
       scale=st.floats(1e-6, 1e6), seed=st.integers(0, 2**31))
def test_property_every_value_within_its_bound(name, n, block, rounding, scale, seed):
    """Nearest: a value inside the outer levels is within half a step of its decoded value,
    stochastic within a step; a value beyond them decodes to the outer level of its sign
    (stochastic steps leave no value beyond them)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    spec = CodecSpec(name=name, block_size=block, rounding=rounding)
    out = roundtrip(x, spec)
    steps = sent_steps(x, spec).repeat_interleave(block)[:n]
    top = steps * ((1 << (int(name[3]) - 1)) - 0.5)
    inside = x.abs() <= top
    assert rounding == "nearest" or bool(inside.all())
    slack = (0.5 if rounding == "nearest" else 1.0) * steps * (1 + 1e-5) + 1e-30
    assert bool(((out - x).abs() <= slack)[inside].all())
    assert torch.equal(out[~inside], (top * x.sign())[~inside])


# ------------------------------------------------------------------------- hostile input

def meta_and_payload(name: str = "int2", shape=(4, 100)):
    encoded = encode(torch.randn(shape, generator=torch.Generator().manual_seed(3)),
                     CodecSpec(name=name))
    return encoded.meta(), bytes(b"".join(encoded.parts))


@pytest.mark.parametrize("params", [
    {"bits": 3}, {"bits": 4}, {"bits": 8}, {"bits": 0}, {"bits": -2}, {"bits": "2"},
    {"bits": True}, {"bits": None}, {"block_size": 8}, {"block_size": 48},
    {"block_size": 1 << 17}, {"block_size": 0}, {"scale_dtype": "int8"},
    {"mode": "int8"}, {"extra": 1}, {"channels": -1}, {"channels": 7}, {"channels": 400},
    {"channels": 4, "mean_dtype": "bfloat16"}, {"channels": 4}, {"channels": "4"},
    {"channels": 0, "mean_dtype": "float16"}, {"channels": 2**40, "mean_dtype": "float16"},
])
def test_bad_params_are_codec_errors_before_decoding(params, monkeypatch):
    meta, data = meta_and_payload()
    bad = dict(meta, params={**meta["params"], **params})
    if params.get("bits", 0) is None:
        del bad["params"]["bits"]
    monkeypatch.setattr(codecs, "_unpack_into", lambda *a: pytest.fail("decoded"))
    with pytest.raises(CodecError):
        expected_payload_bytes(bad, LIMITS)
    with pytest.raises(CodecError):
        decode(bad, memoryview(bytearray(data)), LIMITS)


@pytest.mark.parametrize("cut", [-1, 1, -len(b"xx")])
def test_payload_shorter_or_longer_than_the_header(cut):
    meta, data = meta_and_payload()
    data = data[:cut] if cut < 0 else data + bytes(cut)
    with pytest.raises(CodecError):
        decode(meta, memoryview(bytearray(data)), LIMITS)
    with pytest.raises(CodecError):
        expected_payload_bytes(dict(meta, nbytes=len(data)), LIMITS)


@pytest.mark.parametrize("scale_dtype, bad", [
    ("bfloat16", 0x7FC0), ("bfloat16", 0x7F80), ("bfloat16", 0xBF80), ("bfloat16", 0xFF80),
    ("float16", 0x7E00), ("float16", 0x7C00), ("float16", 0xBC00),
    ("float32", 0x7FC00000), ("float32", 0xBF800000),
])
def test_nan_inf_or_negative_scales_are_refused_before_the_output_exists(scale_dtype, bad,
                                                                         monkeypatch):
    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(5))
    encoded = encode(x, CodecSpec(name="int4", scale_dtype=scale_dtype))
    data = bytearray(b"".join(encoded.parts))
    size = 4 if scale_dtype == "float32" else 2
    data[3 * size:4 * size] = bad.to_bytes(size, "little")
    allocations: list = []
    real_empty = torch.empty
    monkeypatch.setattr(codecs.torch, "empty", lambda *a, **k: allocations.append(a)
                        or real_empty(*a, **k))
    with pytest.raises(CodecError, match="finite and non-negative"):
        decode(encoded.meta(), memoryview(data), LIMITS)
    monkeypatch.undo()
    assert allocations == []


def test_a_tensor_sent_with_nan_is_refused_by_its_receiver():
    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(6))
    x[2, 5] = math.nan
    encoded = encode(x, CodecSpec(name="int2", block_size=16))
    with pytest.raises(CodecError):
        decode(encoded.meta(), payload(encoded), LIMITS)


def test_decode_past_max_tensor_bytes_is_refused_from_the_header():
    """int2 sends a sixteenth of float32's bytes: the decoded size is what is bounded."""
    limits = Limits(max_tensor_bytes=1 << 20, max_message_bytes=1 << 20)
    numel = (1 << 18) + 256  # 1 MiB + 1 KiB decoded, ~66 KiB on the wire
    meta = {"codec": "int2", "dtype": "float32", "shape": [numel],
            "params": {"mode": "packed", "bits": 2, "block_size": 256,
                       "scale_dtype": "bfloat16", "channels": 0},
            "nbytes": numel // 256 * 2 + numel // 4}
    assert expected_payload_bytes(meta, Limits()) == meta["nbytes"]
    with pytest.raises(LimitExceeded):
        expected_payload_bytes(meta, limits)


# ------------------------------------------------------------------------- specs

# ------------------------------------------------------------------------- centring

def test_centring_sends_channel_means_and_removes_a_shared_offset():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(8, 64, 128, generator=gen) * 0.05 + torch.randn(128, generator=gen) * 3
    plain = CodecSpec(name="int2", block_size=512)
    centred = CodecSpec(name="int2", block_size=512, center=True)
    encoded = encode(x, centred)
    assert encoded.params["channels"] == 128 and encoded.params["mean_dtype"] == "float16"
    assert encoded.nbytes == encode(x, plain).nbytes + 128 * 2
    assert encoded.nbytes <= encode(x, CodecSpec(name="int8")).nbytes / 4
    err = {s.center: float((roundtrip(x, s) - x).norm() / x.norm()) for s in (plain, centred)}
    assert err[True] < 0.01 < 0.3 < err[False]


def test_centring_is_skipped_where_there_are_no_rows():
    for x in (torch.randn(100), torch.randn(1, 100)):
        encoded = encode(x, CodecSpec(name="int4", center=True))
        assert encoded.params["channels"] == 0 and "mean_dtype" not in encoded.params


def test_nan_channel_means_are_refused(monkeypatch):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(8))
    encoded = encode(x, CodecSpec(name="int2", center=True, block_size=16))
    data = bytearray(b"".join(encoded.parts))
    data[0:2] = (0x7E00).to_bytes(2, "little")
    monkeypatch.setattr(codecs, "_unpack_into", lambda *a: pytest.fail("decoded"))
    with pytest.raises(CodecError, match="means"):
        decode(encoded.meta(), memoryview(data), LIMITS)


def test_spec_defaults_and_validation():
    assert (CodecSpec(name="int2").block_size, CodecSpec(name="int2").scale_dtype) == (
        256, "bfloat16")
    assert (CodecSpec(name="int4").block_size, CodecSpec(name="int8").scale_dtype) == (
        64, "float16")
    assert CodecSpec.parse("int4+zstd", block_size="128").block_size == 128
    with pytest.raises(ValueError, match="bfloat16"):
        CodecSpec(name="int8", scale_dtype="bfloat16")
    with pytest.raises(ValueError, match="rounding"):
        CodecSpec(name="int2", rounding="up")


def test_a_message_kind_can_have_its_own_rounding():
    from transport.frames import Message, encode_message

    spec = CodecSpec(name="int4", kind_rounding=(("backward", "stochastic"),))
    assert spec.for_kind("backward").rounding == "stochastic" and spec.for_kind("x") is spec
    centred = CodecSpec(name="int2", center=True, kind_rounding=(("backward", "stochastic"),),
                        uncentred_kinds=("backward",))
    backward = centred.for_kind("backward")
    assert (backward.rounding, backward.center, backward.kind_rounding) == ("stochastic", False, ())
    assert centred.for_kind("forward") is centred
    with pytest.raises(ValueError, match="uncentred_kinds"):
        CodecSpec(name="int2", uncentred_kinds=("backward", 3))
    block = torch.full((64,), 0.37)
    block[0] = 1.0
    x = block.repeat(64)

    def sent(kind: str) -> bytes:
        frame = encode_message(Message(kind=kind, tensors=(x,)), spec)
        return b"".join(bytes(p) for p in frame.parts)

    assert sent("backward") != sent("forward")
    assert sent("backward")[-100:] == b"".join(
        encode(x, CodecSpec(name="int4", rounding="stochastic")).parts)[-100:]
    with pytest.raises(ValueError, match="kind_rounding"):
        CodecSpec(name="int2", kind_rounding=(("grad", "up"),))


def test_stochastic_gradients_compressed_with_zstd_decode_the_same_and_shrink():
    """``zstd_kinds``: a gradient's stochastic int2 codes crowd the two inner levels (the
    covering step is absmax / 1.5), so zstd takes a quarter or more off them; the decoded
    tensor is the one the same codes give without zstd."""
    spec = CodecSpec(name="int2", center=True, block_size=512,
                     kind_rounding=(("backward", "stochastic"),), uncentred_kinds=("backward",),
                     zstd_kinds=("backward",))
    zipped = spec.for_kind("backward")
    assert (zipped.name, zipped.rounding, zipped.center) == ("int2+zstd", "stochastic", False)
    assert spec.for_kind("forward") is spec
    assert CodecSpec(name="int2+zstd", zstd_kinds=("backward",)).for_kind("backward").name == (
        "int2+zstd")
    with pytest.raises(ValueError, match="zstd_kinds"):
        CodecSpec(name="int2", zstd_kinds="backward")  # type: ignore[arg-type]
    torch.manual_seed(4)
    g = torch.distributions.StudentT(3.0).sample((8, 128, 256)) * 1e-3  # heavy tails
    plain = CodecSpec(name="int2", block_size=512, rounding="stochastic")
    small, large = encode(g, zipped), encode(g, plain)
    assert small.nbytes < 0.8 * large.nbytes, (small.nbytes, large.nbytes)
    assert torch.equal(decode(small.meta(), payload(small), LIMITS),
                       decode(large.meta(), payload(large), LIMITS))


@pytest.mark.parametrize("shape", [(3, (1 << 20) // 768 + 5, 768), (2, 1000, 130), (5, 7),
                                   (2, 1030, 1024), (4, 1000, 128), (3, 999, 128)])
def test_centring_equals_centring_by_hand_across_groups(shape):
    """Channels that do not divide a packing group, blocks that hold whole rows or rows that
    hold whole blocks (decoded in one pass), neither: the means line up with the values."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(*shape, generator=gen) * 0.05 + torch.randn(shape[-1], generator=gen) * 3
    centred = CodecSpec(name="int2", block_size=512, center=True)
    encoded = encode(x, centred)
    # the means as sent (a recomputed mean may round to another float16 on another thread count)
    mean = torch.frombuffer(payload(encoded)[:2 * shape[-1]], dtype=torch.float16).float()
    # (from a sample of the rows where there are more than 2,048: within a tenth of the spread)
    assert torch.allclose(mean, x.reshape(-1, shape[-1]).mean(0), rtol=1e-3, atol=5e-3)
    by_hand = roundtrip((x.reshape(-1, shape[-1]) - mean).reshape(shape),
                        CodecSpec(name="int2", block_size=512))
    by_hand = (by_hand.reshape(-1, shape[-1]) + mean).reshape(shape)
    assert torch.equal(decode(encoded.meta(), payload(encoded), LIMITS), by_hand)


def test_channel_means_are_exact_for_small_tensors_and_a_fair_sample_of_large_ones():
    """Up to 2,048 rows every row counts; beyond, an odd stride samples every token position
    of power-of-two sequences alike: a position-0 outlier (as a Llama's first token has)
    weighs what it weighs in the whole tensor, and the means are within a few standard
    errors of the exact ones."""
    gen = torch.Generator().manual_seed(3)
    small = torch.randn(2 * MEAN_SAMPLE_ROWS - 1, 64, generator=gen) + 5
    assert torch.allclose(_channel_means(small), small.mean(0), atol=1e-5)
    batch, seq, channels = 16, 1024, 32
    x = torch.randn(batch, seq, channels, generator=gen)
    x[:, 0, 0] += 1000.0  # the whole tensor's mean of channel 0 moves by 1000 / seq
    rows = x.view(-1, channels)
    sampled, exact = _channel_means(rows), rows.mean(0)
    stderr = 1 / math.sqrt(MEAN_SAMPLE_ROWS // 2)  # at least half as many rows are read
    assert torch.allclose(sampled[1:], exact[1:], atol=5 * stderr)
    assert abs(float(sampled[0]) - 1000 / seq) < 1000 / seq * 0.5 + 5 * stderr
