"""Sign with this peer's key; verify what another peer signed, knowing only its peer id.

Ed25519 peer ids (``12D3KooW...``) embed the public key (identity multihash), so a signature
can be checked with nothing but the peer id. Peer ids that only hash their key (RSA) cannot be
verified this way and are refused.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from transport.identity import Identity


def signer(identity: Identity) -> Callable[[bytes], bytes]:
    key = identity.key_pair.private_key

    def sign(body: bytes) -> bytes:
        return key.sign(body)

    return sign


@functools.lru_cache(maxsize=16384)
def _public_key(peer_id: str) -> Any:
    from libp2p.peer.id import ID

    try:
        return ID.from_base58(peer_id).extract_public_key()
    except Exception:
        return None


def verify(peer_id: str, body: bytes, signature: bytes) -> bool:
    """True only if ``signature`` over ``body`` was made by ``peer_id``'s key."""
    key = _public_key(peer_id)
    if key is None:
        return False
    try:
        return bool(key.verify(body, signature))
    except Exception:  # malformed signature bytes: not valid, never a crash
        return False
