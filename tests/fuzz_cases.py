"""The protocol fuzzer's cases: hostile messages for every protocol a daemon or trainer serves.

Cases are deterministic (a seeded generator), bounded in number, and built only from what is on
the wire: protocol ids (swarmd.protocols), message kinds, the metadata keys the receivers read,
and tensors of wrong count, shape, dtype and value. ``cases(protocols, model_hash)`` yields
``Case`` values; a raw case carries bytes written as they are on a fresh stream.
"""

from __future__ import annotations

import math
import random
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from swarmd.protocols import Protocols

#: the kinds each protocol's handlers look at
KINDS: dict[str, tuple[str, ...]] = {
    "forward": ("forward",), "backward": ("backward",), "result": ("result",),
    "grad": ("grad",), "round": ("progress", "prepare", "start"),
    "allreduce": ("part", "contribute", "contribution", "probe", "repair", "absent"),
    "state": ("state_info", "state_chunk", "state_digest", "state_replay"), "view": ("pull",),
    "announce": ("announce",),
}
#: metadata keys any receiver reads
KEYS = ("mb", "stage", "step", "path", "trainer", "trainer_addrs", "model", "model_hash",
        "eval", "round", "group", "samples", "bandwidth", "bandwidths", "free", "digest", "index",
        "checksum", "chunks", "r", "a", "p", "w", "c", "e", "code", "message", "service_s",
        "held_s", "compute_s", "upload_wait_s", "upload_bytes_s", "results", "since", "count",
        "kept")
WEIRD: tuple[Any, ...] = (None, True, -1, 0, 2**63 - 1, -2**63, 1e308, math.nan, math.inf, "",
                          "x" * 5000, [], ["12D3KooW"] * 10_000, {"a": {"b": {"c": [1]}}},
                          b"\x00" * 64, [None, 1, "a"], -0.0, "../../etc/passwd")


@dataclass(frozen=True)
class Case:
    protocol: str
    name: str
    kind: str = ""
    meta: Any = None
    tensors: tuple[torch.Tensor, ...] = ()
    #: bytes written as they are (a malformed frame), instead of a message
    raw: bytes | None = None


def _tensors(rng: random.Random) -> tuple[torch.Tensor, ...]:
    choice = rng.randrange(9)
    if choice == 0:
        return ()
    if choice == 1:
        return (torch.zeros(1),)
    if choice == 2:
        return (torch.full((2, 16, 64), math.nan),)
    if choice == 3:
        return (torch.full((2, 16, 64), math.inf),)
    if choice == 4:
        return (torch.zeros(2, 16, 64, dtype=torch.int64),)
    if choice == 5:
        return (torch.zeros(2, 16, 64), torch.zeros(2, 16, 64))
    if choice == 6:
        return (torch.full((1, 8, 64), 3e38),)
    if choice == 7:
        return (torch.zeros(0, 16, 64),)
    return (torch.randn(4, 16, 64),)


def _value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.randrange(10)
    if roll < 4 or depth > 2:
        return rng.choice(WEIRD)
    if roll < 6:
        return rng.randrange(-10, 10**9)
    if roll < 8:
        return "".join(rng.choice("abc/12D3KooW-_") for _ in range(rng.randrange(40)))
    if roll == 8:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {rng.choice(KEYS): _value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _plausible(kind: str, model_hash: str, rng: random.Random) -> dict[str, Any]:
    """Metadata that passes the first checks (right model, a real stage) but lies elsewhere."""
    return {"mb": f"12D3KooWfake/{rng.randrange(10**6)}", "stage": rng.randrange(2),
            "step": rng.randrange(100), "path": ["12D3KooWnobody"] * rng.randrange(3),
            "trainer": "12D3KooWnobody", "trainer_addrs": ["/ip4/127.0.0.1/tcp/9/p2p/12D3KooWx"],
            "model": model_hash, "model_hash": model_hash, "round": rng.randrange(10**6),
            "samples": rng.choice([1, 10**12, -5, math.nan]), "group": ["12D3KooWnobody"],
            "digest": "0" * 64, "index": rng.randrange(-2, 10**6), "extra_unknown_key": 1}


def _frame(header: dict[str, Any]) -> bytes:
    body = msgpack.packb(header)
    return b"SW\x01\x00" + struct.pack(">I", len(body)) + body


def _raw_frames() -> Iterator[tuple[str, bytes]]:
    yield "empty", b""
    yield "garbage", bytes(random.Random(7).randrange(256) for _ in range(1024))
    yield "truncated_prefix", b"SW\x01"
    yield "huge_header_claim", b"SW\x01\x00" + struct.pack(">I", 2**31 - 1)
    yield "junk_header", b"SW\x01\x00" + struct.pack(">I", 16) + b"\xff" * 16
    yield "http", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def _lowbit_meta(codec: str = "int2", shape: tuple[int, ...] = (2, 16, 64),
                 **params: Any) -> dict[str, Any]:
    """The tensor meta of a packed low-bit tensor (transport.lowbit), with ``params`` changed."""
    bits = 2 if codec.startswith("int2") else 4
    block = params.get("block_size", 256 if bits == 2 else 64)
    numel = math.prod(shape)
    nbytes = -(-numel // max(block, 1)) * 2 + -(-numel * bits // 8)
    merged = {"mode": "packed", "bits": bits, "block_size": block, "scale_dtype": "bfloat16",
              "channels": 0, **params}
    return {"codec": codec, "dtype": "float32", "shape": list(shape), "params": merged,
            "nbytes": nbytes}


def _with_payload(kind: str, meta: dict[str, Any], payload: bytes, n: int | None = None) -> bytes:
    return _frame({"k": kind, "m": {}, "t": [meta], "n": len(payload) if n is None else n}
                  ) + payload


def _lowbit_frames(kind: str) -> Iterator[tuple[str, bytes]]:
    """Packed low-bit tensors that lie: bit width, block count, payload length, NaN or
    negative scales, a decode past ``wire.max_tensor_bytes`` (each refused, typed, before the
    receiver allocates the decoded tensor)."""
    good = _lowbit_meta()
    codes = bytes(range(256)) * (good["nbytes"] // 256 + 1)
    payload = (struct.pack("<H", 0x3F80) * 8 + codes)[:good["nbytes"]]  # bfloat16 1.0 scales
    for bits in (3, 8, 0, -2, 2**40, "2"):
        yield f"lowbit_bits_{bits}", _with_payload(kind, dict(good, params={
            **good["params"], "bits": bits}), payload)
    yield "lowbit_int4_claims_2_bits", _with_payload(kind, dict(good, codec="int4"), payload)
    for block in (8, 48, 0, 1 << 17, 2**62):
        yield f"lowbit_block_{block}", _with_payload(kind, _lowbit_meta(block_size=block),
                                                     payload)
    yield "lowbit_scale_dtype", _with_payload(kind, _lowbit_meta(scale_dtype="int8"), payload)
    for channels in (-1, 7, 2048, 2**40, "64"):  # negative, not dividing, all, huge, a string
        yield f"lowbit_channels_{channels}", _with_payload(kind, _lowbit_meta(
            channels=channels, mean_dtype="float16"), payload)
    centred = dict(_lowbit_meta(channels=64, mean_dtype="float16"))
    centred["nbytes"] += 128
    yield "lowbit_nan_mean", _with_payload(kind, centred, struct.pack("<H", 0x7E00) * 64 + payload)
    yield "lowbit_short_payload", _with_payload(kind, dict(good, nbytes=good["nbytes"] - 1),
                                                payload[:-1])
    yield "lowbit_long_payload", _with_payload(kind, dict(good, nbytes=good["nbytes"] + 7),
                                               payload + bytes(7))
    yield "lowbit_frame_longer", _with_payload(kind, good, payload + bytes(5))
    for name, scale in (("nan", 0x7FC0), ("inf", 0x7F80), ("negative", 0xBF80)):
        bad = struct.pack("<H", scale) + payload[2:]
        yield f"lowbit_{name}_scale", _with_payload(kind, good, bad)
    # 2**28 + 4096 float32 values: past the default 1 GiB decoded, its payload only ~64 MiB
    # (the header alone is sent: the receiver must refuse before reading the payload)
    huge = _lowbit_meta(shape=(2**28 + 4096,))
    yield "lowbit_expands_past_limit", _frame({"k": kind, "m": {}, "t": [huge],
                                               "n": huge["nbytes"]})


def cases(swarm: str, model_hash: str, *, per_kind: int = 6, seed: int = 1) -> Iterator[Case]:
    """Every case for every protocol of ``swarm``: named cases first, then ``per_kind`` random
    ones per kind (seeded), then malformed raw frames."""
    rng = random.Random(seed)
    ids = Protocols(swarm)
    for name, kinds in KINDS.items():
        protocol = getattr(ids, name)
        yield Case(protocol, "unknown_kind", kind="nonsense", meta={})
        for kind in kinds:
            yield Case(protocol, "empty_meta", kind=kind, meta={})
            yield Case(protocol, "non_dict_meta", raw=_frame({"k": kind, "m": [1, 2, 3],
                                                              "t": [], "n": 0}))
            yield Case(protocol, "lying_payload_size", raw=_frame({"k": kind, "m": {},
                                                                  "t": [], "n": 2**40}))
            for key in KEYS:
                value = WEIRD[(zlib.crc32(key.encode()) + len(kind)) % len(WEIRD)]
                meta = _plausible(kind, model_hash, rng)
                meta[key] = value
                yield Case(protocol, f"weird_{key}", kind=kind, meta=meta,
                           tensors=_tensors(rng))
            if kind in ("forward", "backward"):
                # a tensor wider than the stage's (e.g. the model's width sent to a stage of a
                # low-rank boundary, model.boundary_rank): refused by its shape
                for width in (4096, 1):
                    yield Case(protocol, f"width_{width}", kind=kind,
                               meta=_plausible(kind, model_hash, rng),
                               tensors=(torch.randn(1, 4, width),))
            for i in range(per_kind):
                meta = (_plausible(kind, model_hash, rng) if i % 2 else
                        {rng.choice(KEYS): _value(rng) for _ in range(rng.randrange(6))})
                yield Case(protocol, f"random_{i}", kind=kind, meta=meta, tensors=_tensors(rng))
        for raw_name, data in _raw_frames():
            yield Case(protocol, f"raw_{raw_name}", raw=data)
        for frame_name, data in _lowbit_frames(kinds[0]):  # decoded before any handler looks
            yield Case(protocol, frame_name, raw=data)
