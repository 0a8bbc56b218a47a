"""Packed 4-bit and 2-bit blockwise quantisation: the arithmetic of the ``int4`` and ``int2``
codecs (``transport.codecs`` frames it). Pure: tensors in, tensors out; no I/O, no clock, no
global random state (stochastic rounding takes its dither from a fixed table at an offset
derived from the data itself, so the same input always encodes to the same bytes).

**Levels.** A tensor of ``n`` float32 values is cut into blocks of ``block`` values (the last
one may be shorter). Each block has one non-negative step ``s``; a ``bits``-bit signed code
``c`` in ``-L/2 .. L/2-1`` (``L = 2**bits``) stands for ``(c + 1/2) * s``: a mid-rise uniform
quantiser whose ``L`` levels are ``+-s/2, +-3s/2, ...``. An all-zero block has ``s = 0`` and
decodes to exact zeros.

**Steps.** For nearest rounding, 4 bits: ``absmax / 8``, so every value lies within half a
step of a level; 2 bits: ``CLIP[2] * rms`` (the step of the best uniform 4-level quantiser of
a Gaussian, Max 1960): the largest ~5% of a Gaussian block's values are clipped to the outer
levels, which gives a third of the mean squared error of absmax scaling. For stochastic
rounding (``cover``), ``absmax / (L/2 - 1/2)``, at least: the outer levels reach the block's
largest value, so nothing is clipped.

**Rounding.** ``nearest`` (each value to its closest level), or ``stochastic`` (up or down with
the probabilities that make the decoded value unbiased: with covering steps every value lies
between two levels, so the decoded tensor's expectation is the tensor itself. Clipping is a
bias that does not average out over microbatches: the 2-bit RMS step's clipped gradients
gave a parameter gradient 35% off its float32 direction however many microbatches were summed).

**Packing** (the wire format). The codes are cut into groups of ``GROUP`` values (the last
group shorter), each padded with zero codes to a multiple of ``k = 8 // bits``; a group of
``m`` padded codes is ``m / k`` bytes, and byte ``j`` holds codes ``j, j + m/k, j + 2m/k, ...``
as two's complement fields from the most significant bits down (4 bits: code ``j`` in the
high nibble, ``j + m/2`` in the low one). Planar groups let both sides work on contiguous
slices only, and a field in a byte's top bits read as int8 is ``2**(8-bits) * c`` directly.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

__all__ = ["BITS", "CLIP", "GROUP", "decode_into", "encode", "packed_bytes"]

#: the bit widths this module packs
BITS = (2, 4)
#: per bit width: the step of the MSE-optimal uniform quantiser of a unit Gaussian (Max, 1960)
CLIP = {2: 0.9957, 4: 0.3352}
#: values per packing group (part of the wire format); also the chunk both sides work in:
#: 4 MiB of float32 temporaries, measured faster than L2-sized chunks (fewer torch calls)
GROUP = 1 << 20
#: largest block whose 2-bit codes stay inside int8 before clamping (|x| / rms <= sqrt(block))
_INT8_CLAMP_BLOCK = 8192
#: the dither table for stochastic rounding: float32 values in [0, 1), one group long
_DITHER = GROUP
#: how far the dither moves between groups besides their length (so groups differ)
_DITHER_STRIDE = 7919


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes of ``numel`` packed ``bits``-bit codes (each group padded to whole bytes)."""
    per_byte = 8 // bits
    full, tail = divmod(numel, GROUP)
    return full * (GROUP // per_byte) + -(-tail // per_byte)


def block_rows(flat: torch.Tensor, block: int) -> list[torch.Tensor]:
    """The full blocks as one (n, block) view, then the short last block as (1, tail)."""
    full, tail = divmod(flat.numel(), block)
    rows = [flat[:full * block].view(full, block)] if full else []
    if tail:
        rows.append(flat[full * block:].view(1, tail))
    return rows


def _steps(x: torch.Tensor, block: int, bits: int, cover: bool = False) -> torch.Tensor:
    out = []
    for r in block_rows(x, block):
        if bits == 4 or cover:
            # positive floats order like their bits: an int32 max is faster than a float one
            positive = r.view(torch.int32).amax(1).view(torch.float32)
            top = (1 << (bits - 1)) - 0.5 if cover else 8
            out.append(torch.maximum(positive, r.amin(1).neg_()).mul_(1 / top))
        else:
            norm = torch.linalg.vector_norm(r, dim=1)
            out.append(norm.mul_(CLIP[bits] / math.sqrt(r.shape[1])))
    return out[0] if len(out) == 1 else torch.cat(out)


def _by_channel(op: Any, x: torch.Tensor, mean: torch.Tensor, start: int,
               out: torch.Tensor) -> None:
    """``out = op(x, mean[channel of each value])`` for the flat values ``x`` that begin at
    value ``start`` of a tensor of ``mean.numel()`` channels: the whole rows broadcast ``mean``
    (faster than a per-value copy of it), the partial rows at either end take a slice."""
    channels, size = mean.numel(), x.numel()
    at, done = start % channels, 0
    if at:
        done = min(channels - at, size)
        op(x[:done], mean[at:at + done], out=out[:done])
    rows = (size - done) // channels
    if rows:
        end = done + rows * channels
        op(x[done:end].view(rows, channels), mean, out=out[done:end].view(rows, channels))
        done = end
    if done < size:
        op(x[done:], mean[:size - done], out=out[done:])


def _to_wire(step: torch.Tensor, out: torch.Tensor, cover: bool) -> torch.Tensor | None:
    """Write float32 ``step`` into ``out`` (the steps as sent, in the wire's scale dtype) and
    return them as float32: rounded up where ``cover`` (a step rounded down would clip its
    block's largest value); None when a finite step overflows the scale dtype."""
    if out.dtype == torch.float32:
        return out.copy_(step)
    wire = step.to(out.dtype)
    wide = wire.float()
    if cover:
        low = wide < step
        if bool(low.any()):
            wire = torch.where(low, torch.nextafter(wire, torch.full_like(wire, math.inf)), wire)
            wide = wire.float()
    if bool((wide.isinf() & step.isfinite()).any()):
        return None
    out.copy_(wire)
    return wide


@functools.lru_cache(maxsize=1)
def _dither_table() -> torch.Tensor:
    """A fixed uniform dither in [0, 1), twice over so that any offset reads a whole group."""
    table = torch.rand(_DITHER, generator=torch.Generator().manual_seed(0x5EED))
    return torch.cat([table, table])


def _dither_offset(x: torch.Tensor) -> int:
    """Where in the dither table this tensor starts: a hash of a few of its values' bits."""
    n = x.numel()
    probe = x[torch.tensor([0, n // 3, n // 2, n - 1])].view(torch.int32).tolist()
    return hash(tuple(probe)) % _DITHER


def _scaled_rows(x: torch.Tensor, factor: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """``out = x * factor[block of each value]`` for flat ``x`` starting at a block boundary."""
    for r_x, r_out in zip(block_rows(x, block), block_rows(out, block)):
        torch.mul(r_x, factor[:r_x.shape[0], None], out=r_out)
        factor = factor[r_x.shape[0]:]


def encode(x: torch.Tensor, block: int, bits: int, *, scale_dtype: torch.dtype,
           stochastic: bool = False, mean: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(steps, packed codes)`` of flat float32 ``x`` (less its channels' ``mean``, if
    given): the per-block steps as sent (``scale_dtype``; NaN or inf for a block holding NaN or
    inf) and the codes under those steps as the receiver sees them. ``stochastic``: stochastic
    rounding under covering steps. None when a finite step overflows ``scale_dtype`` (the
    caller sends float32 steps instead).

    One pass over ``x`` a group: centre, step, scale, round and pack each group while it is
    in cache (the steps of a group depend only on its own blocks: ``GROUP`` is a multiple of
    every block size)."""
    n, levels = x.numel(), 1 << bits
    per_byte = 8 // bits
    steps_sent = torch.empty(-(-n // block), dtype=scale_dtype)
    packed = torch.empty(packed_bytes(n, bits), dtype=torch.uint8)
    dither = _dither_table() if stochastic else None
    offset = _dither_offset(x) if stochastic else 0
    # q = floor(x / s + L/2) (nearest) or floor(x / s + L/2 - 1/2 + u) (stochastic), in
    # 0 .. L-1: values are >= 0 once clamped, so the cast's truncation is the floor. The
    # clamp is on the int8 codes when the values fit an int8 before it: with absmax steps
    # (4 bits) |x / s| <= ~8, with RMS steps |x / s| <= sqrt(block) / CLIP
    add = levels // 2 if dither is None else levels // 2 - 0.5
    clamp_ints = bits == 4 or block <= _INT8_CLAMP_BLOCK
    buf = torch.empty(min(n, GROUP))
    codes = torch.zeros(-(-buf.numel() // per_byte) * per_byte, dtype=torch.int8)
    tmp = torch.empty(codes.numel() // per_byte, dtype=torch.int8)
    for start in range(0, n, GROUP):
        size = min(n, start + GROUP) - start
        chunk, source = buf[:size], x[start:start + size]
        if mean is not None:
            _by_channel(torch.sub, source, mean, start, chunk)
            source = chunk
        step = _steps(source, block, bits, stochastic)
        first = start // block
        wide = _to_wire(step, steps_sent[first:first + step.numel()], stochastic)
        if wide is None:
            return None
        _scaled_rows(source, torch.where(wide > 0, wide.reciprocal(), 0.0), block, chunk)
        if dither is not None:
            at = offset % _DITHER
            chunk.add_(dither[at:at + size])
            offset += size + _DITHER_STRIDE
        chunk.add_(add)
        if not clamp_ints:
            chunk.clamp_(0, levels - 1 / 256)
        nbytes = -(-size // per_byte)
        group = codes[:nbytes * per_byte]
        if size % per_byte:
            group.fill_(levels // 2)  # padding: the code 0
        group[:size].copy_(chunk)
        if clamp_ints:
            group.clamp_(0, levels - 1)
        _pack(group, bits, tmp[:nbytes],
              packed[start // per_byte:start // per_byte + nbytes].view(torch.int8))
    return steps_sent, packed


def _pack(q: torch.Tensor, bits: int, tmp: torch.Tensor, out: torch.Tensor) -> None:
    """Unsigned codes ``q`` (0 .. L-1, a multiple of ``8 // bits`` of them) -> one planar
    group of two's complement fields (``c = q - L/2``: flipping the top bit of the field)."""
    parts = q.view(8 // bits, -1)
    torch.bitwise_left_shift(parts[0], 8 - bits, out=out)
    for i in range(1, 8 // bits):
        torch.bitwise_left_shift(parts[i], 8 - bits * (i + 1), out=tmp)
        out.bitwise_or_(tmp)
    out.bitwise_xor_(sum(1 << (8 - bits * (i + 1) + bits - 1) for i in range(8 // bits)))


def decode_into(packed: torch.Tensor, scale: torch.Tensor, block: int, bits: int,
                out: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantise packed codes into the flat float32 ``out`` (``out.numel()`` values), adding
    each value's channel ``mean`` if given."""
    n = out.numel()
    per_byte = 8 // bits
    field = 1 << (8 - bits)  # a field in the top bits, read as int8, is field * c
    low = field // 2  # ... and with this bit set, field * (c + 1/2)
    factor = scale * (1 / field)
    codes = torch.empty(-(-min(n, GROUP) // per_byte) * per_byte, dtype=torch.int8)
    mask = -field  # the top bits, as an int8
    for start in range(0, n, GROUP):
        size = min(n, start + GROUP) - start
        nbytes = -(-size // per_byte)
        p = packed[start // per_byte:start // per_byte + nbytes].view(torch.int8)
        parts = codes[:nbytes * per_byte].view(per_byte, nbytes)
        torch.bitwise_and(p, mask, out=parts[0])
        for i in range(1, per_byte):
            torch.bitwise_left_shift(p, bits * i, out=parts[i])
            if i < per_byte - 1:
                parts[i].bitwise_and_(mask)
        codes[:nbytes * per_byte].bitwise_or_(low)
        chunk = out[start:start + size]
        chunk.copy_(codes[:size])
        if mean is None or not _scaled_and_centred(chunk, factor[start // block:], block,
                                                   mean, start):
            _scaled_rows(chunk, factor[start // block:], block, chunk)
            if mean is not None:
                _by_channel(torch.add, chunk, mean, start, chunk)
    return out


def _scaled_and_centred(chunk: torch.Tensor, factor: torch.Tensor, block: int,
                        mean: torch.Tensor, start: int) -> bool:
    """``chunk = chunk * factor[block] + mean[channel]`` in one pass where the blocks and the
    rows of channels line up (one divides the other, the chunk holds whole rows); False,
    untouched, where they do not."""
    channels, size = mean.numel(), chunk.numel()
    if start % channels or size % channels or size % block:
        return False
    factor = factor[:size // block]
    if channels % block == 0:  # a row holds whole blocks
        shape, means = (-1, channels // block, block), mean.view(channels // block, block)
        steps = factor.view(-1, channels // block, 1)
    elif block % channels == 0:  # a block holds whole rows
        shape, means, steps = (-1, block // channels, channels), mean, factor.view(-1, 1, 1)
    else:
        return False
    view = chunk.view(shape)
    torch.addcmul(means, view, steps, out=view)
    return True
