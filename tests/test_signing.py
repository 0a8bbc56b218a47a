from __future__ import annotations

from transport import identity
from transport.signing import signer, verify


def test_signatures_verify_by_peer_id_alone_and_forgeries_fail() -> None:
    alice, mallory = identity.generate(), identity.generate()
    body = b"stage=1 throughput=12.5"
    sig = signer(alice)(body)
    assert verify(alice.peer_id, body, sig)
    assert not verify(alice.peer_id, body + b"!", sig)               # tampered body
    assert not verify(alice.peer_id, body, signer(mallory)(body))    # someone else's key
    assert not verify(mallory.peer_id, body, sig)                    # claimed by another id
    assert not verify(alice.peer_id, body, b"\0" * 64)
    assert not verify(alice.peer_id, body, b"short")
    assert not verify("not-a-peer-id", body, sig)
    assert not verify("", body, sig)
