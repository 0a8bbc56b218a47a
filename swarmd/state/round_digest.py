"""The round digest of a stage's weights: a cheap fingerprint two peers compare.

A round's leader sends it in its ``start``, a still peer compares it with its mates'
(``state_digest``, the idle drift check), and ``swarmd export`` checks the weights it
downloaded against the one their stage's peers report. Hex blake2b-128 over each parameter's
length and ``DIGEST_PIECES`` pieces of ``DIGEST_PIECE_BYTES`` at evenly spaced places (all of a
smaller one), so that it never hashes a whole big stage; weights that drifted apart differ
nearly everywhere. One device-to-host copy per parameter.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from swarmd.models.gpt import tensor_bytes

__all__ = ["round_digest_of", "DIGEST_PIECES", "DIGEST_PIECE_BYTES"]

#: pieces hashed per parameter, and bytes each
DIGEST_PIECES = 16
DIGEST_PIECE_BYTES = 4096


def round_digest_of(parameters: Iterable[torch.Tensor]) -> str:
    """The round digest of ``parameters`` (a module's ``parameters()``, in their order)."""
    h = hashlib.blake2b(digest_size=16)
    whole = DIGEST_PIECES * DIGEST_PIECE_BYTES
    with torch.no_grad():
        for p in parameters:
            flat = p.detach().contiguous().reshape(-1).view(torch.uint8)
            n = flat.numel()
            h.update(n.to_bytes(8, "little"))
            if n <= whole:
                h.update(tensor_bytes(p))
                continue
            step = (n - DIGEST_PIECE_BYTES) // (DIGEST_PIECES - 1)
            pieces = torch.cat([flat[i * step:i * step + DIGEST_PIECE_BYTES]
                                for i in range(DIGEST_PIECES)])
            h.update(memoryview(pieces.to("cpu").numpy()))
    return h.hexdigest()
