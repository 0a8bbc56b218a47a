"""The manifest protocol's messages, as values. Pure: no I/O.

``/swarmd/manifest/1`` is the one protocol id without a swarm name: a joiner asks it before it
knows the swarm's name (the manifest tells it). Requests and replies::

    manifest       {}                           -> manifest      {announcement} + the document
    manifest_file  {sha256, offset}             -> manifest_file {sha256, offset, size} + bytes

``announcement`` is the serving peer's own signed membership announcement
(``swarmd.membership.announcement``), which names the hash of the manifest it runs: the document
must have that hash. A file (the tokenizer.json a manifest names) travels in pieces of at most
``FILE_CHUNK`` bytes from ``offset``. Payloads are raw bytes here (the adapter moves them as
uint8 tensors). Anything malformed raises :class:`~swarmd.errors.BadManifest`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from swarmd.errors import BadManifest
from swarmd.manifest.document import MAX_MANIFEST_BYTES, MAX_TOKENIZER_BYTES, TokenizerRef
from swarmd.protocols import MANIFEST

__all__ = ["PROTOCOL", "FILE_CHUNK", "ManifestRequest", "FileRequest", "ManifestReply",
           "FilePiece", "parse_request", "parse_manifest_reply", "parse_file_reply"]

PROTOCOL = MANIFEST
#: bytes of a file sent per reply
FILE_CHUNK = 1 << 20
#: a signed announcement is at most this long (``membership.announcement.Limits``)
MAX_ANNOUNCEMENT_BYTES = 4096
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class ManifestRequest:
    """``manifest``: which manifest do you run?"""

    def to_meta(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True, slots=True, kw_only=True)
class FileRequest:
    """``manifest_file``: the file of ``sha256`` from byte ``offset`` on."""

    sha256: str
    offset: int

    def __post_init__(self) -> None:
        if type(self.sha256) is not str or not _HEX64.fullmatch(self.sha256):
            raise BadManifest("malformed", "a file request names a 64-hex-digit sha256")
        if type(self.offset) is not int or not 0 <= self.offset < MAX_TOKENIZER_BYTES:
            raise BadManifest("malformed", f"offset {self.offset!r}"[:80])

    def to_meta(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "offset": self.offset}


@dataclass(frozen=True, slots=True, kw_only=True)
class ManifestReply:
    """The serving peer's signed announcement and the manifest document's bytes."""

    announcement: bytes
    document: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class FilePiece:
    """A piece of a file: ``data`` from ``offset``, of a file of ``size`` bytes."""

    sha256: str
    offset: int
    size: int
    data: bytes


def parse_request(kind: str, meta: Mapping[str, Any], payload: tuple[bytes, ...]
                  ) -> ManifestRequest | FileRequest:
    if payload:
        raise BadManifest("malformed", "a manifest request carries no data")
    if not isinstance(meta, Mapping):
        raise BadManifest("malformed", "meta must be a map")
    if kind == "manifest":
        return ManifestRequest()
    if kind == "manifest_file":
        return FileRequest(sha256=meta.get("sha256"), offset=meta.get("offset"))
    raise BadManifest("malformed", f"unknown request {str(kind)[:40]!r}")


def parse_manifest_reply(kind: str, meta: Mapping[str, Any], payload: tuple[bytes, ...],
                         max_bytes: int = MAX_MANIFEST_BYTES) -> ManifestReply:
    """A ``manifest`` reply; its document at most ``max_bytes`` (``oversized``)."""
    if kind != "manifest" or not isinstance(meta, Mapping) or len(payload) != 1:
        raise BadManifest("malformed", f"answered manifest with {str(kind)[:40]!r}")
    announcement = meta.get("announcement")
    if type(announcement) is not bytes or not 0 < len(announcement) <= MAX_ANNOUNCEMENT_BYTES:
        raise BadManifest("malformed", "the reply carries no signed announcement")
    if len(payload[0]) > max_bytes:
        raise BadManifest("oversized", f"a manifest of {len(payload[0])} bytes, over the "
                                       f"limit of {max_bytes}")
    return ManifestReply(announcement=announcement, document=payload[0])


def parse_file_reply(kind: str, meta: Mapping[str, Any], payload: tuple[bytes, ...], *,
                     asked: FileRequest, ref: TokenizerRef) -> FilePiece:
    """A ``manifest_file`` reply to ``asked``, of the file ``ref`` names: the piece asked for,
    not past the file's end, not empty before it."""
    if kind != "manifest_file" or not isinstance(meta, Mapping) or len(payload) != 1:
        raise BadManifest("malformed", f"answered manifest_file with {str(kind)[:40]!r}")
    data = payload[0]
    if meta.get("sha256") != asked.sha256 or meta.get("offset") != asked.offset:
        raise BadManifest("malformed", "the piece is not the one asked for")
    if meta.get("size") != ref.size:
        raise BadManifest("tokenizer_mismatch", f"the file has {meta.get('size')!r} bytes, "
                                                f"the manifest says {ref.size}"[:200])
    if not 0 < len(data) <= FILE_CHUNK or asked.offset + len(data) > ref.size:
        raise BadManifest("malformed", f"a piece of {len(data)} bytes at {asked.offset} of "
                                       f"{ref.size}")
    return FilePiece(sha256=asked.sha256, offset=asked.offset, size=ref.size, data=data)
