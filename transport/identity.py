"""The local libp2p identity: an Ed25519 key pair kept in one key file.

The key file holds the libp2p protobuf ``PrivateKey`` message (``key_type = Ed25519``), the
format go-libp2p, rust-libp2p and js-libp2p read and write. Its Ed25519 ``data`` is the
standard 64 bytes (32-byte seed followed by the 32-byte public key). ``load`` also accepts the
32-byte seed alone (what py-libp2p's own ``PrivateKey.serialize()`` writes) and the legacy
96-byte go-libp2p form.

``libp2p`` is imported inside the functions: importing it costs about half a second and resets
the ``libp2p`` logger, which programs that only print their version must not pay for.
"""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transport.errors import IdentityError

if TYPE_CHECKING:  # pragma: no cover
    from libp2p.crypto.keys import KeyPair

__all__ = ["Identity", "IdentityError", "generate", "load", "save", "from_private_bytes"]

_SEED_LEN = 32
_PUB_LEN = 32


@dataclass(frozen=True)
class Identity:
    """A libp2p Ed25519 key pair and the peer id derived from its public key."""

    #: the base58 peer id, ``12D3KooW...`` for an Ed25519 key
    peer_id: str
    #: the ``libp2p.crypto.keys.KeyPair``
    key_pair: KeyPair

    def private_bytes(self) -> bytes:
        """The key file contents: a libp2p protobuf ``PrivateKey`` with 64 bytes of Ed25519 data."""
        from libp2p.crypto.pb import crypto_pb2

        seed = self.key_pair.private_key.to_bytes()
        public = self.key_pair.public_key.to_bytes()
        message = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=seed + public)
        return message.SerializeToString()

    def __repr__(self) -> str:  # never print key material
        return f"Identity(peer_id={self.peer_id!r})"


def _from_key_pair(key_pair: Any) -> Identity:
    from libp2p.peer.id import ID

    return Identity(peer_id=ID.from_pubkey(key_pair.public_key).to_base58(), key_pair=key_pair)


def generate() -> Identity:
    """A fresh random Ed25519 identity."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    return _from_key_pair(create_new_key_pair())


def from_private_bytes(data: bytes, *, source: str = "key data") -> Identity:
    """Parse a libp2p protobuf ``PrivateKey`` (Ed25519 only); ``source`` names it in errors."""
    from google.protobuf.message import DecodeError
    from libp2p.crypto.ed25519 import Ed25519PrivateKey
    from libp2p.crypto.keys import KeyPair
    from libp2p.crypto.pb import crypto_pb2

    fix = "restore it from a backup, or move it away and create a new identity"
    if not data:
        raise IdentityError(f"identity key file {source} is empty: {fix}")
    try:
        message = crypto_pb2.PrivateKey.FromString(data)
    except DecodeError:
        message = None
    if message is None or not message.IsInitialized():
        raise IdentityError(
            f"identity key file {source} is not a libp2p private key (corrupt or wrong file): {fix}"
        )
    if message.key_type != crypto_pb2.KeyType.Ed25519:
        known = message.key_type in crypto_pb2.KeyType.values()
        type_name = crypto_pb2.KeyType.Name(message.key_type) if known else f"type {message.key_type}"
        raise IdentityError(
            f"identity key file {source} holds a {type_name} key, only Ed25519 is supported: {fix}"
        )
    raw = bytes(message.data)
    if len(raw) not in (_SEED_LEN, _SEED_LEN + _PUB_LEN, _SEED_LEN + 2 * _PUB_LEN):
        raise IdentityError(
            f"identity key file {source} holds {len(raw)} bytes of Ed25519 key data, "
            f"expected 32, 64 or 96 (corrupt file): {fix}"
        )
    try:
        private_key = Ed25519PrivateKey.from_bytes(raw[:_SEED_LEN])
    except Exception as exc:  # nacl raises its own ValueError subclasses
        raise IdentityError(
            f"identity key file {source} holds an invalid Ed25519 key ({exc}): {fix}"
        ) from None
    public_key = private_key.get_public_key()
    if len(raw) > _SEED_LEN and raw[_SEED_LEN : _SEED_LEN + _PUB_LEN] != public_key.to_bytes():
        raise IdentityError(
            f"identity key file {source} is inconsistent: its public key does not match its "
            f"private key (corrupt file): {fix}"
        )
    return _from_key_pair(KeyPair(private_key, public_key))


def load(path: Path) -> Identity:
    """Read the key file at ``path``; refuses one that group or others may read or write."""
    path = Path(path)
    try:
        # O_NONBLOCK: a FIFO in place of the key is refused below instead of blocking the open
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise IdentityError(f"identity key file {path} does not exist") from None
    except OSError as exc:
        raise IdentityError(f"cannot open identity key file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IdentityError(f"identity key file {path} is not a regular file")
        if os.name == "posix" and st.st_mode & 0o077:
            raise IdentityError(
                f"identity key file {path} is accessible by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):04o}): run `chmod 600 {path}`"
            )
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
            if sum(map(len, chunks)) > 65536:
                raise IdentityError(
                    f"identity key file {path} is far too large for a key (corrupt or wrong file): "
                    "restore it from a backup, or move it away and create a new identity"
                )
    except OSError as exc:
        raise IdentityError(f"cannot read identity key file {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    return from_private_bytes(b"".join(chunks), source=str(path))


def save(identity: Identity, path: Path, *, overwrite: bool = True) -> None:
    """Write ``identity`` to ``path`` atomically with mode 0600.

    The key goes to a new temporary file in the same directory (created 0600, exclusive),
    is fsynced, then renamed over ``path`` and the directory fsynced. With ``overwrite=False``
    the temporary file is hard-linked instead, so an existing ``path`` is never replaced and
    ``FileExistsError`` is raised (two concurrent first-time writers cannot clobber each other).
    """
    path = Path(path)
    directory = path.parent
    data = identity.private_bytes()
    tmp = directory / f".{path.name}.tmp-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            if hasattr(os, "fchmod"):
                os.fchmod(fd, 0o600)  # whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # FileExistsError if present
            os.unlink(tmp)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    if os.name != "posix":
        return
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
