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

import torch

__all__ = ["BITS", "CLIP", "GROUP", "decode_into", "encode", "packed_bytes", "steps"]

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


def steps(x: torch.Tensor, block: int, bits: int, mean: torch.Tensor | None = None,
          cover: bool = False) -> torch.Tensor:
    """Per-block float32 steps of a flat float32 tensor (NaN or inf for a block holding NaN
    or inf); with ``mean`` (one value per channel), of ``x`` less its channels' means;
    ``cover``: steps whose outer levels reach each block's largest magnitude (for stochastic
    rounding: nothing clipped, so nothing biased)."""
    if mean is None:
        return _steps(x, block, bits, cover)
    buf, tiled = torch.empty(min(x.numel(), GROUP)), _tiled(mean, min(x.numel(), GROUP))
    out = []
    for start in range(0, x.numel(), GROUP):
        chunk = _centred(x, start, mean.numel(), tiled, buf)
        out.append(_steps(chunk, block, bits, cover))
    return out[0] if len(out) == 1 else torch.cat(out)


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


def _tiled(mean: torch.Tensor, size: int) -> torch.Tensor:
    """``mean`` repeated to cover ``size`` values from any channel on: the per-value means of
    a group are one contiguous slice of it."""
    channels = mean.numel()
    return mean.repeat(-(-size // channels) + 1)


def _centred(x: torch.Tensor, start: int, channels: int, tiled: torch.Tensor,
             buf: torch.Tensor) -> torch.Tensor:
    """The group of ``x`` at ``start`` less its values' channel means, in ``buf``."""
    size = min(x.numel(), start + GROUP) - start
    at = start % channels
    return torch.sub(x[start:start + size], tiled[at:at + size], out=buf[:size])


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


def encode(x: torch.Tensor, scale: torch.Tensor, block: int, bits: int,
           stochastic: bool = False, mean: torch.Tensor | None = None) -> torch.Tensor:
    """The packed codes of flat float32 ``x`` (less its channels' ``mean``, if given) under
    per-block steps ``scale`` (float32, as the receiver will see them: already rounded to the
    wire's scale dtype)."""
    n, levels = x.numel(), 1 << bits
    per_byte = 8 // bits
    inverse = torch.where(scale > 0, scale.reciprocal(), 0.0)
    packed = torch.empty(packed_bytes(n, bits), dtype=torch.uint8)
    dither = _dither_table() if stochastic else None
    offset = _dither_offset(x) if stochastic else 0
    # q = floor(x / s + L/2) (nearest) or floor(x / s + L/2 - 1/2 + u) (stochastic), in
    # 0 .. L-1: values are >= 0 once clamped, so the cast's truncation is the floor. The
    # clamp is on the int8 codes when the values fit an int8 before it: with absmax steps
    # (4 bits) |x / s| <= ~8, with RMS steps |x / s| <= sqrt(block) / CLIP
    add = levels // 2 if dither is None else levels // 2 - 0.5
    clamp_ints = bits == 4 or block <= _INT8_CLAMP_BLOCK
    clamp_floats = not clamp_ints
    buf = torch.empty(min(n, GROUP))
    tiled = None if mean is None else _tiled(mean, buf.numel())
    codes = torch.zeros(-(-buf.numel() // per_byte) * per_byte, dtype=torch.int8)
    tmp = torch.empty(codes.numel() // per_byte, dtype=torch.int8)
    for start in range(0, n, GROUP):
        size = min(n, start + GROUP) - start
        chunk = buf[:size]
        if tiled is None:
            _scaled_rows(x[start:start + size], inverse[start // block:], block, chunk)
        else:
            _centred(x, start, mean.numel(), tiled, buf)  # type: ignore[union-attr]
            _scaled_rows(chunk, inverse[start // block:], block, chunk)
        if dither is not None:
            at = offset % _DITHER
            chunk.add_(dither[at:at + size])
            offset += size + _DITHER_STRIDE
        chunk.add_(add)
        if clamp_floats:
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
    return packed


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
    tiled = None if mean is None else _tiled(mean, min(n, GROUP))
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
        if tiled is not None:
            at = start % mean.numel()  # type: ignore[union-attr]
            centre = tiled[at:at + size]
        for r in block_rows(chunk, block):
            r.mul_(factor[start // block:start // block + r.shape[0], None])
            start += r.numel()
        if tiled is not None:
            chunk.add_(centre)
    return out
