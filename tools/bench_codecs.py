"""Throughput, wire size and error of the tensor codecs in ``transport/codecs.py``.

    python tools/bench_codecs.py --json

MB are 1e6 bytes of the float32 input (so a codec's MB/s compares directly with memcpy's).
Figures are medians over ``repeats`` timed runs after a warm-up. Decode is timed from a
``bytearray`` payload, as the wire hands it over; for codec ``none`` that decode is zero-copy
(the tensor aliases the payload), so its MB/s is very large and measures only the overhead.

Page faults: on the VMs this runs on, first touching a fresh 4 KiB page costs 1.5-10 us, so a
freshly mapped 16 MB buffer can cost 6-40 ms, several times the codec arithmetic, and whether
glibc hands back recycled or freshly mapped memory changes from one call to the next (it trims
freed heap top and maps large blocks). Unless told otherwise, the measuring functions therefore
call ``steady_allocator()`` first: it raises glibc's mmap and trim thresholds for this process so
freed buffers are reused, and all figures (memcpy included) are steady-state, fault-free ones.
That is a process-wide, irreversible setting; pass ``steady=False`` to measure without it.

Other tools import ``measure_codecs`` and ``measure_memcpy`` (with ``tools/`` on ``sys.path``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transport.codecs import CodecSpec, decode, encode  # noqa: E402
from transport.limits import Limits  # noqa: E402
from transport.memory import keep_freed_memory  # noqa: E402

#: codec names; ``:center``, ``:stochastic`` and ``:block=N`` add those options (``spec_of``);
#: ``int2:center:block=512`` is what a swarm with ``wire.codec = "int2"`` sends as activations
CODEC_NAMES = ("none", "fp16", "int8", "int8+zstd", "int4", "int2", "int2:stochastic", "int4:center",
               "int2:center", "int2:center:stochastic", "int2:center:block=512")
DEFAULT_SHAPE = (8, 512, 1024)


def spec_of(name: str) -> CodecSpec:
    """``"int2:center:stochastic"`` -> the int2 spec with channel centring and stochastic
    rounding, ``":block=512"`` its block size; a name without options ->
    ``CodecSpec.parse(name)``."""
    base, *options = name.split(":")
    blocks = [o for o in options if o.startswith("block=")]
    unknown = set(options) - {"center", "stochastic", *blocks}
    if unknown or len(blocks) > 1:
        raise ValueError(f"unknown or repeated codec options {sorted(unknown) or blocks} in "
                         f"{name!r}")
    extra = {"block_size": blocks[0].removeprefix("block=")} if blocks else {}
    if "stochastic" in options:
        extra["rounding"] = "stochastic"
    return CodecSpec.parse(base, center="center" in options, **extra)


def steady_allocator() -> bool:
    """Make glibc reuse freed memory instead of unmapping it (see transport.memory)."""
    return keep_freed_memory()


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _normal(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _rel_rms(approx: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.double()
    return float((approx.double() - exact).norm() / exact.norm().clamp_min(1e-300))


def measure_memcpy(shape: tuple[int, ...] = DEFAULT_SHAPE, repeats: int = 9,
                   threads: int = 1, steady: bool = True) -> float:
    """MB/s of ``tensor.clone()`` for a float32 tensor of ``shape``."""
    if steady:
        steady_allocator()
    x = _normal(shape)
    with _threads(threads):
        seconds = _median_seconds(x.clone, repeats)
    return x.numel() * 4 / 1e6 / seconds


def measure_codecs(shape: tuple[int, ...] = DEFAULT_SHAPE, repeats: int = 7,
                   threads: int = 1, names: tuple[str, ...] = CODEC_NAMES,
                   steady: bool = True) -> dict[str, dict[str, float]]:
    """Per codec name: encode/decode MB/s (of float32 input), wire_ratio and rel_rms_error
    on ``torch.randn(shape)`` data, with torch limited to ``threads`` threads; and
    ``speed_vs_int8``: int8's encode+decode time over this codec's (> 1: faster). The codecs
    take turns within each of the ``repeats`` rounds, so that a load that comes and goes
    weighs on all of them alike."""
    if steady:
        steady_allocator()
    x = _normal(shape)
    mb = x.numel() * 4 / 1e6
    limits = Limits(max_tensor_bytes=max(x.numel() * 8, 1), max_message_bytes=max(x.numel() * 8, 1))
    results: dict[str, dict[str, float]] = {}
    with _threads(threads):
        cases = {}
        for name in names:
            spec = spec_of(name)
            encoded = encode(x, spec)
            meta = encoded.meta()
            payload = memoryview(bytearray(b"".join(encoded.parts)))
            decoded = decode(meta, payload, limits)
            cases[name] = (spec, meta, payload)
            results[name] = {"wire_ratio": encoded.nbytes / (x.numel() * 4),
                             "rel_rms_error": _rel_rms(decoded, x)}
        times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names}
        for round_ in range(repeats + 3):  # the first 3 rounds warm up
            for name, (spec, meta, payload) in cases.items():
                t0 = time.perf_counter()
                encode(x, spec)
                t1 = time.perf_counter()
                decode(meta, payload, limits)
                t2 = time.perf_counter()
                if round_ >= 3:
                    times[name][0].append(t1 - t0)
                    times[name][1].append(t2 - t1)
        for name, (enc, dec) in times.items():
            results[name].update({"encode_MBps": mb / statistics.median(enc),
                                  "decode_MBps": mb / statistics.median(dec),
                                  "seconds": statistics.median(enc) + statistics.median(dec)})
    if "int8" in results:
        for row in results.values():
            row["speed_vs_int8"] = results["int8"]["seconds"] / row["seconds"]
    return results


def outlier_error(block_size: int = 64, shape: tuple[int, ...] = (1 << 20,),
                  fraction: float = 0.001, factor: float = 50.0, seed: int = 0) -> float:
    """int8 relative RMS error on the ordinary values when ``fraction`` of them are scaled by
    ``factor`` (the outliers themselves are left out of the error)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    flat = x.view(-1)
    count = max(1, int(flat.numel() * fraction))
    outliers = torch.randperm(flat.numel(), generator=gen)[:count]
    flat[outliers] *= factor
    encoded = encode(x, CodecSpec(name="int8", block_size=block_size))
    decoded = decode(encoded.meta(), memoryview(bytearray(b"".join(encoded.parts))), Limits())
    ordinary = torch.ones(flat.numel(), dtype=torch.bool)
    ordinary[outliers] = False
    return _rel_rms(decoded.view(-1)[ordinary], flat[ordinary])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shape", default=",".join(map(str, DEFAULT_SHAPE)),
                        help="the float32 tensor's shape (default 8,512,1024: 16 MB; the "
                        "issue's 64 MB: 16,1024,1024); its last dimension is the channels")
    parser.add_argument("--no-steady-allocator", dest="steady", action="store_false",
                        help="leave glibc malloc as it is (figures then include page faults)")
    args = parser.parse_args(argv)
    report = {
        "memcpy_MBps": measure_memcpy(threads=args.threads, steady=args.steady),
        "shape": [int(d) for d in args.shape.split(",")],
        "codecs": measure_codecs(shape=tuple(int(d) for d in args.shape.split(",")),
                                 repeats=args.repeats, threads=args.threads, steady=args.steady),
        "int8_outlier_rel_rms_error": outlier_error(),
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"memcpy {report['memcpy_MBps']:10.0f} MB/s")
    for name, row in report["codecs"].items():
        print(f"{name:22s} encode {row['encode_MBps']:10.0f} MB/s  "
              f"decode {row['decode_MBps']:10.0f} MB/s  wire {row['wire_ratio']:.4f}  "
              f"rel_rms {row['rel_rms_error']:.2e}  vs int8 {row.get('speed_vs_int8', 0):.2f}x")
    print(f"int8 outlier rel_rms {report['int8_outlier_rel_rms_error']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
