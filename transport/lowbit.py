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
from typing import Any, NamedTuple

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


def _steps(rows: list[torch.Tensor], bits: int, cover: bool = False) -> torch.Tensor:
    """The step of each block: ``rows`` are the (blocks, block) views ``block_rows`` gives."""
    out = []
    for r in rows:
        if bits == 4 or cover:
            # positive floats order like their bits: an int32 max is faster than a float one
            positive = r.view(torch.int32).amax(1).view(torch.float32)
            top = (1 << (bits - 1)) - 0.5 if cover else 8
            out.append(torch.maximum(positive, r.amin(1).neg_()).mul_(_const(1 / top)))
        else:
            norm = torch.linalg.vector_norm(r, dim=1)
            out.append(norm.mul_(_const(CLIP[bits] / math.sqrt(r.shape[1]))))
    return out[0] if len(out) == 1 else torch.cat(out)


@functools.lru_cache(maxsize=64)
def _const(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``value`` as a 0-dim tensor of ``dtype``, made once: given a Python number, an op wraps
    and converts it on every call, 2 us of the 3 the call costs (a group makes ~20 calls).
    Only ever read."""
    return torch.tensor(value, dtype=dtype)


class _GroupViews(NamedTuple):
    """The views of a group's work buffers that every group of ``size`` values uses alike
    (made once per size: a view costs a microsecond, a group ~20 of them)."""

    chunk: torch.Tensor  # the float32 values, buf[:size]
    blocks: list[torch.Tensor]  # chunk as block rows (block_rows)
    codes: torch.Tensor  # the group's codes, padded to whole bytes
    planes: tuple[torch.Tensor, ...]  # codes (as uint8) cut into 8 // bits planes


def _group_views(buf: torch.Tensor, codes: torch.Tensor, size: int, block: int,
                 per_byte: int) -> _GroupViews:
    chunk = buf[:size]
    group = codes[:-(-size // per_byte) * per_byte]
    return _GroupViews(chunk, block_rows(chunk, block), group,
                       group.view(torch.uint8).view(per_byte, -1).unbind(0))


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


def _to_wire(step: torch.Tensor, out: torch.Tensor, cover: bool) -> torch.Tensor:
    """Write float32 ``step`` into ``out`` (the steps as sent, in the wire's scale dtype) and
    return them as float32: rounded up where ``cover`` (a step rounded down would clip its
    block's largest value). A finite step that overflows the scale dtype becomes inf here;
    ``_overflowed`` tells, once for the whole tensor."""
    out.copy_(step)
    if out.dtype == torch.float32:
        return out
    wide = out.float()
    if cover:
        low = wide < step
        if bool(low.any()):
            out.copy_(torch.where(low, torch.nextafter(out, torch.full_like(out, math.inf)), out))
            wide = out.float()
    return wide


def _overflowed(steps: list[torch.Tensor], sent: torch.Tensor) -> bool:
    """Whether a finite float32 step became inf in the scale dtype of ``sent``."""
    if sent.dtype == torch.float32:
        return False
    exact = steps[0] if len(steps) == 1 else torch.cat(steps)
    return bool((sent.float().isinf() & exact.isfinite()).any())


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
    if x.numel() % block == 0:  # whole blocks (every packing group but maybe the last)
        torch.mul(x.view(-1, block), factor[:x.numel() // block, None], out=out.view(-1, block))
        return
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
    views: dict[int, _GroupViews] = {}
    exact = []  # each group's float32 steps, for the one overflow check at the end
    for start in range(0, n, GROUP):
        size = min(n, start + GROUP) - start
        v = views.get(size) or views.setdefault(size, _group_views(buf, codes, size, block,
                                                                    per_byte))
        chunk, source, rows = v.chunk, x[start:start + size], v.blocks
        if mean is not None:
            _by_channel(torch.sub, source, mean, start, chunk)
            source = chunk
        step = _steps(rows if source is chunk else block_rows(source, block), bits, stochastic)
        exact.append(step)
        first = start // block
        wide = _to_wire(step, steps_sent[first:first + step.numel()], stochastic)
        # 1 / s, and 0 for an all-zero block's step (its values then code 0)
        inverse = wide.reciprocal().nan_to_num_(posinf=0.0, neginf=0.0)
        _scaled_rows(source, inverse, block, chunk)
        if dither is not None:
            at = offset % _DITHER
            chunk.add_(dither[at:at + size])
            offset += size + _DITHER_STRIDE
        chunk.add_(_const(add))
        if not clamp_ints:
            chunk.clamp_(0, levels - 1 / 256)
        group = v.codes
        if size % per_byte:
            group.fill_(levels // 2)  # padding: the code 0
            group[:size].copy_(chunk)
        else:
            group.copy_(chunk)
        if clamp_ints:
            group.clamp_(0, levels - 1)
        first_byte = start // per_byte
        _pack(v.planes, bits, packed[first_byte:first_byte + group.numel() // per_byte])
    return None if _overflowed(exact, steps_sent) else (steps_sent, packed)


def _pack(planes: tuple[torch.Tensor, ...], bits: int, out: torch.Tensor) -> None:
    """Unsigned codes (uint8, 0 .. L-1) in ``8 // bits`` equal ``planes`` -> one planar group
    of two's complement fields in ``out`` (uint8): ``((q0 * L + q1) * L + q2) ...`` (each
    add-and-scale is one pass; no field overflows into the next), then ``c = q - L/2`` by
    flipping every field's top bit."""
    levels = 1 << bits
    torch.add(planes[1], planes[0], alpha=levels, out=out)
    for plane in planes[2:]:
        torch.add(plane, out, alpha=levels, out=out)
    out.bitwise_xor_(_const(sum(1 << (bits * i + bits - 1) for i in range(8 // bits)),
                            torch.uint8))


def decode_into(packed: torch.Tensor, scale: torch.Tensor, block: int, bits: int,
                out: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantise packed codes into the flat float32 ``out`` (``out.numel()`` values), adding
    each value's channel ``mean`` if given."""
    n = out.numel()
    per_byte = 8 // bits
    field = 1 << (8 - bits)  # a field in the top bits, read as int8, is field * c
    half = _const(field // 2, torch.int8)  # ... and with this bit set, field * (c + 1/2)
    mask = _const(-field, torch.int8)  # the top bits, as an int8
    shifts = [_const(bits * i, torch.int8) for i in range(per_byte)]
    factor = scale * (1 / field)
    codes = torch.empty(-(-min(n, GROUP) // per_byte) * per_byte, dtype=torch.int8)
    planes: dict[int, tuple[torch.Tensor, ...]] = {}
    channels = 0 if mean is None else mean.numel()
    lined_up = None if mean is None else _lined_up(mean, block)
    for start in range(0, n, GROUP):
        size = min(n, start + GROUP) - start
        nbytes = -(-size // per_byte)
        p = packed[start // per_byte:start // per_byte + nbytes].view(torch.int8)
        parts = planes.get(nbytes) or planes.setdefault(
            nbytes, codes[:nbytes * per_byte].view(per_byte, nbytes).unbind(0))
        torch.bitwise_and(p, mask, out=parts[0])
        for i in range(1, per_byte):
            torch.bitwise_left_shift(p, shifts[i], out=parts[i])
            if i < per_byte - 1:
                parts[i].bitwise_and_(mask)
        group = codes if nbytes * per_byte == codes.numel() else codes[:nbytes * per_byte]
        group.bitwise_or_(half)
        chunk = out[start:start + size]
        chunk.copy_(group if size == group.numel() else group[:size])
        steps = factor[start // block:]
        if lined_up is not None and not (start % channels or size % channels or size % block):
            shape, means, steps_shape = lined_up
            view = chunk.view(shape)
            torch.addcmul(means, view, steps[:size // block].view(steps_shape), out=view)
        else:
            _scaled_rows(chunk, steps, block, chunk)
            if mean is not None:
                _by_channel(torch.add, chunk, mean, start, chunk)
    return out


def _lined_up(mean: torch.Tensor, block: int) -> tuple[tuple[int, ...], torch.Tensor,
                                                      tuple[int, ...]] | None:
    """Where the blocks and the rows of ``mean.numel()`` channels line up (one divides the
    other), the shape to view a group's values in, the means and the steps viewed to match,
    so that ``values * steps + means`` is one ``addcmul``; None where they do not."""
    channels = mean.numel()
    if channels % block == 0:  # a row holds whole blocks
        return ((-1, channels // block, block), mean.view(channels // block, block),
                (-1, channels // block, 1))
    if block % channels == 0:  # a block holds whole rows
        return (-1, block // channels, channels), mean, (-1, 1, 1)
    return None
