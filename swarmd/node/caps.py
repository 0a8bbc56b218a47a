"""What ``[limits]`` means for a stage peer, as arithmetic: no I/O, no torch.

* The throughput a peer announces (samples per second, what routing and balancing weigh) is at
  most what its upload cap lets it send: per sample, a stage sends its output activations
  forward and the gradient of its input backward, each ``tokens x width`` values as the wire
  codec encodes them (and receives as much: a download cap binds the same way).
  ``capped_throughput`` takes the smaller of the measured rate and that.
* What the upload cap leaves for the pipeline is the cap less the peer's other traffic through
  it (averaging rounds, state transfer), measured over a minute (``UploadLeft``); the capped
  throughput is taken from that, not from the whole cap (docs/limits.md "Routing").
* A stage whose parameters and optimizer state do not fit ``limits.device_memory_bytes`` is not
  served (``device_memory_refusal`` says why, with the numbers).
"""

from __future__ import annotations

from collections import deque

__all__ = ["wire_bytes_per_value", "upload_bytes_per_sample", "capped_throughput", "tighter_cap",
           "stage_memory_bytes", "device_memory_refusal", "hop_upload_bytes", "UploadLeft"]

#: activations travel as float32 (``swarmd.models.gpt.wire_tensor``) before the codec
_WIRE_FLOAT_BYTES = 4
#: frame headers and message metadata per message, generously
MESSAGE_OVERHEAD_BYTES = 512
#: bytes of optimizer state per parameter byte (AdamW and LAMB: two moments) plus the gradient
OPTIMIZER_STATE_FACTOR = {"adamw": 2, "lamb": 2}


#: bits per value of the packed codecs, and their block size when none is set
_LOWBIT = {"int4": (4, 64), "int2": (2, 256)}


def wire_bytes_per_value(codec: str, *, block_size: int | None = 64,
                         scale_dtype: str = "float16") -> float:
    """Bytes one activation value takes on the wire with ``codec`` (``"int8+zstd"`` etc.;
    zstd is counted as no gain, so a cap is never overestimated). ``block_size`` None: the
    codec's own. The channel means of centring (``wire.lowbit_center``: two bytes per channel
    and message, 2 / tokens per value) are left out."""
    base = codec.split("+", 1)[0]
    if base == "none":
        return float(_WIRE_FLOAT_BYTES)
    if base == "fp16":
        return 2.0
    scale = 4 if scale_dtype == "float32" else 2
    if base == "int8":
        return 1.0 + scale / max(1, block_size or 64)
    if base in _LOWBIT:
        bits, own_block = _LOWBIT[base]
        return bits / 8 + scale / max(1, block_size or own_block)
    raise ValueError(f"unknown codec {codec!r}")


def upload_bytes_per_sample(*, tokens: int, width: int, bytes_per_value: float) -> float:
    """What a stage peer sends per sample: its output forward and its input's gradient back."""
    return 2.0 * tokens * width * bytes_per_value


def capped_throughput(measured: float, cap_bytes_s: int | None, bytes_per_sample: float,
                      *, batch_size: int = 1) -> float:
    """The throughput to announce: ``measured`` (samples/s), or less when the cap (bytes per
    second, the tighter of upload and download) cannot carry it. ``batch_size`` samples travel
    per message (one message overhead each)."""
    if cap_bytes_s is None or bytes_per_sample <= 0:
        return measured
    per_sample = bytes_per_sample + 2.0 * MESSAGE_OVERHEAD_BYTES / max(1, batch_size)
    return max(0.0, min(measured, cap_bytes_s / per_sample))


def hop_upload_bytes(messages: int, bytes_per_sample: float, *, batch_size: int = 1) -> float:
    """What ``messages`` pipeline hops (forwards and backwards, each sending one tensor of
    ``batch_size`` samples: half of ``bytes_per_sample``) took from the upload, at most."""
    return messages * (batch_size * bytes_per_sample / 2.0 + MESSAGE_OVERHEAD_BYTES)


class UploadLeft:
    """What an upload cap leaves for pipeline hops: the cap less the other bytes (averaging,
    state transfer) that went through the bucket in the last ``window_s`` seconds, at least
    ``floor`` of the cap (a peer whose averaging fills its upload still gets a share, and so
    still gets measured). Until ``min_span_s`` are observed: the whole cap. Pure: fed the
    bucket's total bytes and the hop bytes counted so far, with ``now``."""

    def __init__(self, *, window_s: float = 60.0, min_span_s: float = 10.0,
                 floor: float = 0.1, max_samples: int = 1024) -> None:
        if not (0 < min_span_s <= window_s and 0 < floor <= 1 and max_samples >= 2):
            raise ValueError("UploadLeft: need 0 < min_span_s <= window_s, 0 < floor <= 1")
        self.window_s, self.min_span_s, self.floor = window_s, min_span_s, floor
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=max_samples)

    def observe(self, now: float, total_bytes: float, hop_bytes: float) -> None:
        """The bucket's bytes and the hops' bytes so far, at ``now`` (monotonic)."""
        if self._samples and now <= self._samples[-1][0]:
            return
        self._samples.append((now, float(total_bytes), float(hop_bytes)))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def other_bytes_s(self) -> float | None:
        """Bytes/s of other traffic over the window (None: under ``min_span_s`` observed)."""
        if len(self._samples) < 2:
            return None
        (t0, total0, hop0), (t1, total1, hop1) = self._samples[0], self._samples[-1]
        if t1 - t0 < self.min_span_s:
            return None
        return max(0.0, (total1 - total0) - (hop1 - hop0)) / (t1 - t0)

    def left(self, cap_bytes_s: int) -> float:
        """Bytes/s of ``cap_bytes_s`` the hops may count on."""
        other = self.other_bytes_s()
        if other is None:
            return float(cap_bytes_s)
        return max(self.floor * cap_bytes_s, cap_bytes_s - other)


def tighter_cap(*caps: int | None) -> int | None:
    """The smallest of the caps that are set (None: none is)."""
    set_caps = [c for c in caps if c is not None]
    return min(set_caps) if set_caps else None


def stage_memory_bytes(param_bytes: int, *, optimizer: str, grad: bool = True) -> int:
    """Parameters, their gradients and the optimizer's state, in bytes."""
    factor = 1 + (1 if grad else 0) + OPTIMIZER_STATE_FACTOR.get(optimizer, 2)
    return factor * param_bytes


def device_memory_refusal(*, stage: int, param_bytes: int, optimizer: str,
                          cap_bytes: int | None, device: str) -> str | None:
    """None when stage ``stage`` fits ``cap_bytes`` (or there is no cap), else why not."""
    if cap_bytes is None:
        return None
    need = stage_memory_bytes(param_bytes, optimizer=optimizer)
    if need <= cap_bytes:
        return None
    return (f"stage {stage} needs {_gb(need)} on {device} ({_gb(param_bytes)} of parameters, "
            f"as much for their gradients and {OPTIMIZER_STATE_FACTOR.get(optimizer, 2)}x for "
            f"{optimizer}'s state), more than limits.device_memory_bytes = {cap_bytes} "
            f"({_gb(cap_bytes)}): raise the cap, or serve a smaller stage (more swarm.stages)")


def _gb(n: int) -> str:
    if n >= 10**9:
        return f"{n / 10**9:.2f} GB"
    if n >= 10**6:
        return f"{n / 10**6:.1f} MB"
    return f"{n} bytes"
