"""transport.identity: generate/save/load, file modes, atomic save, corrupt and foreign key files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport import identity
from transport.errors import IdentityError, TransportError


@pytest.fixture(scope="module")
def ident() -> identity.Identity:
    return identity.generate()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def write_key(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    os.chmod(path, 0o600)
    return path


def test_generate_gives_ed25519_peer_id(ident):
    assert ident.peer_id.startswith("12D3KooW")
    assert identity.generate().peer_id != ident.peer_id
    signature = ident.key_pair.private_key.sign(b"hello")
    assert ident.key_pair.public_key.verify(b"hello", signature)


def test_round_trip_same_peer_id_and_key(tmp_path, ident):
    path = tmp_path / "identity.key"
    identity.save(ident, path)
    loaded = identity.load(path)
    assert loaded.peer_id == ident.peer_id
    assert loaded.key_pair.private_key == ident.key_pair.private_key
    assert loaded.key_pair.public_key == ident.key_pair.public_key
    assert loaded.private_bytes() == ident.private_bytes() == path.read_bytes()


def test_key_file_is_standard_libp2p_protobuf(ident):
    from libp2p.crypto.pb import crypto_pb2
    from libp2p.peer.id import ID

    message = crypto_pb2.PrivateKey.FromString(ident.private_bytes())
    assert message.key_type == crypto_pb2.KeyType.Ed25519
    # go/rust/js-libp2p layout: 32-byte seed then 32-byte public key
    assert len(message.data) == 64
    assert message.data[:32] == ident.key_pair.private_key.to_bytes()
    assert message.data[32:] == ident.key_pair.public_key.to_bytes()
    assert ID.from_pubkey(ident.key_pair.public_key).to_base58() == ident.peer_id


def test_loads_py_libp2p_seed_only_and_go_legacy_forms(tmp_path, ident):
    from libp2p.crypto.pb import crypto_pb2

    seed_only = ident.key_pair.private_key.serialize()  # what py-libp2p itself writes
    assert identity.load(write_key(tmp_path / "a.key", seed_only)).peer_id == ident.peer_id
    data = crypto_pb2.PrivateKey.FromString(ident.private_bytes()).data
    legacy = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519,
                                   data=data + data[32:]).SerializeToString()
    assert identity.load(write_key(tmp_path / "b.key", legacy)).peer_id == ident.peer_id


def test_saved_file_is_0600_whatever_the_umask(tmp_path, ident):
    old = os.umask(0)
    try:
        identity.save(ident, tmp_path / "identity.key")
    finally:
        os.umask(old)
    assert mode(tmp_path / "identity.key") == 0o600


@pytest.mark.parametrize("bad_mode", [0o644, 0o640, 0o604, 0o660, 0o666, 0o620])
def test_refuses_key_readable_or_writable_by_others(tmp_path, ident, bad_mode):
    path = tmp_path / "identity.key"
    identity.save(ident, path)
    os.chmod(path, bad_mode)
    with pytest.raises(IdentityError) as info:
        identity.load(path)
    message = str(info.value)
    assert str(path) in message
    assert f"run `chmod 600 {path}`" in message
    assert f"{bad_mode:04o}" in message
    os.chmod(path, 0o600)
    assert identity.load(path).peer_id == ident.peer_id
    os.chmod(path, 0o400)
    assert identity.load(path).peer_id == ident.peer_id


def test_identity_error_is_a_transport_error():
    assert issubclass(IdentityError, TransportError)
    assert IdentityError.code == "identity"


@pytest.mark.parametrize(("content", "needle"), [
    (b"", "is empty"),
    (b"not a key at all", "not a libp2p private key"),
    (b"\x08\x01", "not a libp2p private key"),  # key_type without data
    (b"\x08\x01\x12\x05abcde", "5 bytes of Ed25519 key data"),
])
def test_corrupt_key_files(tmp_path, content, needle):
    path = write_key(tmp_path / "identity.key", content)
    with pytest.raises(IdentityError) as info:
        identity.load(path)
    message = str(info.value)
    assert str(path) in message and needle in message
    assert "restore it from a backup, or move it away and create a new identity" in message


def test_wrong_key_type(tmp_path):
    from libp2p.crypto.secp256k1 import create_new_key_pair

    path = write_key(tmp_path / "identity.key", create_new_key_pair().private_key.serialize())
    with pytest.raises(IdentityError, match="holds a Secp256k1 key, only Ed25519 is supported"):
        identity.load(path)


def test_inconsistent_public_key(tmp_path, ident):
    from libp2p.crypto.pb import crypto_pb2

    data = bytearray(crypto_pb2.PrivateKey.FromString(ident.private_bytes()).data)
    data[40] ^= 1
    bad = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=bytes(data))
    path = write_key(tmp_path / "identity.key", bad.SerializeToString())
    with pytest.raises(IdentityError, match="public key does not match"):
        identity.load(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(IdentityError, match="does not exist"):
        identity.load(tmp_path / "nope.key")
    os.chmod(tmp_path, 0o700)
    with pytest.raises(IdentityError, match="not a regular file"):
        identity.load(tmp_path)


def test_save_replaces_atomically_and_leaves_no_temp_files(tmp_path, ident):
    path = tmp_path / "identity.key"
    other = identity.generate()
    identity.save(other, path)
    identity.save(ident, path)
    assert identity.load(path).peer_id == ident.peer_id
    assert sorted(os.listdir(tmp_path)) == ["identity.key"]


def test_save_without_overwrite_keeps_existing(tmp_path, ident):
    path = tmp_path / "identity.key"
    identity.save(ident, path)
    with pytest.raises(FileExistsError):
        identity.save(identity.generate(), path, overwrite=False)
    assert identity.load(path).peer_id == ident.peer_id
    assert sorted(os.listdir(tmp_path)) == ["identity.key"]
    identity.save(ident, tmp_path / "new.key", overwrite=False)
    assert mode(tmp_path / "new.key") == 0o600


def test_failed_save_keeps_old_file_and_cleans_up(tmp_path, ident, monkeypatch):
    path = tmp_path / "identity.key"
    identity.save(ident, path)

    def broken_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        identity.save(identity.generate(), path)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["identity.key"]
    assert identity.load(path).peer_id == ident.peer_id


def test_repr_does_not_leak_the_key(ident):
    assert repr(ident) == f"Identity(peer_id={ident.peer_id!r})"


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200))
def test_random_bytes_load_or_raise_identity_error(tmp_path, data):
    path = write_key(tmp_path / "fuzz.key", data)
    try:
        loaded = identity.load(path)
    except IdentityError as exc:
        assert str(path) in str(exc)
    else:
        assert loaded.peer_id.startswith("12D3KooW")
