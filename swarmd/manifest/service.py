"""The manifest protocol over libp2p (``swarmd.manifest.wire``): a peer serves the manifest it
runs and the tokenizer.json it names; a joiner fetches them from its bootstrap peers.

The joiner checks, per peer: the reply's shape and size, the peer's signed announcement (made
by that very peer, within the clock limits), that the document has the hash the announcement
names (``hash_mismatch``: a forged manifest), that its settings are a valid configuration, and
that the tokenizer's bytes have the sha256 the manifest names (``tokenizer_mismatch``). A peer
failing a check is counted (``refused.<reason>``) and the next bootstrap peer asked; every
request has a deadline.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarmd.errors import (BadAnnouncement, BadManifest, ManifestUnavailable, SwarmdError)
from swarmd.manifest.document import Manifest, TokenizerRef, decode, file_sha256
from swarmd.manifest.local import validate
from swarmd.manifest.wire import (FILE_CHUNK, PROTOCOL, FileRequest, ManifestRequest,
                                  parse_file_reply, parse_manifest_reply, parse_request)
from transport.codecs import CodecSpec
from transport.errors import LocalUsageError, RemoteError, TransportClosed, TransportError
from transport.frames import Message

__all__ = ["ManifestServer", "Fetched", "fetch_manifest", "ask_manifest",
           "MANIFEST_FETCH_TIMEOUT_S"]

log = logging.getLogger("swarmd.manifest")

#: each dial and each request of a fetch, at most
MANIFEST_FETCH_TIMEOUT_S = 10.0
_NONE = CodecSpec(name="none")


class ManifestNotReady(SwarmdError):
    """This peer has not announced itself yet: ask again in a moment, or another peer."""

    code = "manifest_not_ready"


class UnknownFile(SwarmdError):
    """This peer's manifest names no file of that sha256."""

    code = "unknown_file"


def _to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _payload(tensors: Sequence[Any]) -> tuple[bytes, ...]:
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
            raise BadManifest("malformed", "a payload is a flat uint8 tensor")
        out.append(t.numpy().tobytes())
    return tuple(out)


class ManifestServer:
    """Answers ``/swarmd/manifest/1`` with ``manifest`` and its tokenizer; ``announcement()``
    gives this peer's latest signed announcement (None before the first)."""

    def __init__(self, host: Any, manifest: Manifest, tokenizer: bytes | None,
                 announcement: Callable[[], bytes | None],
                 counters: Counter[str] | None = None) -> None:
        self.host = host
        self.manifest = manifest
        self.tokenizer = tokenizer
        self.announcement = announcement
        self.counters: Counter[str] = counters if counters is not None else Counter()

    def start(self) -> None:
        self.host.set_request_handler(PROTOCOL, self.serve, codec=_NONE)

    async def serve(self, message: Message, peer: str) -> Message:
        try:
            request = parse_request(message.kind, message.meta, _payload(message.tensors))
        except BadManifest as exc:
            self.counters[f"served.bad_requests.{exc.reason}"] += 1
            raise
        if isinstance(request, ManifestRequest):
            signed = self.announcement()
            if signed is None:
                raise ManifestNotReady("this peer has not announced itself yet: ask again")
            self.counters["served.manifests"] += 1
            return Message(kind="manifest", meta={"announcement": signed},
                           tensors=(_to_tensor(self.manifest.to_bytes()),))
        return self._file(request)

    def _file(self, request: FileRequest) -> Message:
        ref, data = self.manifest.tokenizer, self.tokenizer
        if ref is None or data is None or request.sha256 != ref.sha256:
            raise UnknownFile(f"this peer's manifest names no file {request.sha256[:16]}")
        if request.offset >= len(data):
            raise BadManifest("malformed", f"offset {request.offset} past the file's "
                                           f"{len(data)} bytes")
        self.counters["served.file_pieces"] += 1
        piece = data[request.offset:request.offset + FILE_CHUNK]
        return Message(kind="manifest_file", meta={"sha256": ref.sha256, "offset":
                                                   request.offset, "size": len(data)},
                       tensors=(_to_tensor(piece),))


@dataclass(frozen=True, slots=True)
class Fetched:
    """A swarm's manifest that passed every check, its tokenizer's bytes, the peer."""

    manifest: Manifest
    tokenizer: bytes | None
    peer: str


async def ask_manifest(host: Any, peer: str, *, timeout_s: float = MANIFEST_FETCH_TIMEOUT_S,
                       now: Callable[[], float] = time.time) -> Manifest:
    """The manifest ``peer`` (connected) runs, checked against its signed announcement."""
    from swarmd.membership.announcement import Limits, decode_signed
    from transport.signing import verify

    reply = await host.request(peer, PROTOCOL, Message(kind="manifest",
                                                       meta=ManifestRequest().to_meta()),
                               timeout=timeout_s, codec=_NONE)
    got = parse_manifest_reply(reply.kind, reply.meta, _payload(reply.tensors))
    try:
        ann = decode_signed(got.announcement, verify, Limits(), now())
    except BadAnnouncement as exc:
        raise BadManifest("bad_announcement", f"its announcement: {exc}") from None
    if ann.peer_id != peer:
        raise BadManifest("bad_announcement", "the announcement is another peer's")
    if not ann.manifest:
        raise BadManifest("bad_announcement", "its announcement names no manifest")
    manifest = decode(got.document, expect_hash=ann.manifest)
    validate(manifest)
    return manifest


async def _file(host: Any, peer: str, ref: TokenizerRef, timeout_s: float) -> bytes:
    data = bytearray()
    while len(data) < ref.size:
        asked = FileRequest(sha256=ref.sha256, offset=len(data))
        reply = await host.request(peer, PROTOCOL, Message(kind="manifest_file",
                                                           meta=asked.to_meta()),
                                   timeout=timeout_s, codec=_NONE)
        data += parse_file_reply(reply.kind, reply.meta, _payload(reply.tensors), asked=asked,
                                 ref=ref).data
    if file_sha256(bytes(data)) != ref.sha256:
        raise BadManifest("tokenizer_mismatch", f"its tokenizer.json has sha256 "
                                                f"{file_sha256(bytes(data))[:16]}, the "
                                                f"manifest names {ref.sha256[:16]}")
    return bytes(data)


async def fetch_manifest(host: Any, addrs: Sequence[str], *,
                         have_file: Callable[[TokenizerRef], bytes | None] = lambda ref: None,
                         counters: Counter[str] | None = None,
                         timeout_s: float = MANIFEST_FETCH_TIMEOUT_S,
                         now: Callable[[], float] = time.time) -> Fetched | None:
    """The swarm's manifest from the first of ``addrs`` (bootstrap multiaddrs) whose answer
    passes the checks (module doc); the tokenizer it names from ``have_file`` when that has
    it, else from the same peer. None when no peer answered at all (unreachable, not ready);
    :class:`ManifestUnavailable` naming each peer when some answered but none passed."""
    counters = counters if counters is not None else Counter()
    failures: list[str] = []
    refused = False
    for addr in addrs:
        try:
            peer = await host.dial(addr, timeout=timeout_s)
            manifest = await ask_manifest(host, peer, timeout_s=timeout_s, now=now)
            data = None
            if manifest.tokenizer is not None:
                data = have_file(manifest.tokenizer)
                if data is None:
                    data = await _file(host, peer, manifest.tokenizer, timeout_s)
                    counters["tokenizer_fetched"] += 1
            counters["fetched"] += 1
            return Fetched(manifest, data, peer)
        except BadManifest as exc:
            refused = True
            counters[f"refused.{exc.reason}"] += 1
            log.warning("bootstrap %s sent an unusable swarm manifest: %s", addr, exc)
            failures.append(f"{addr}: {exc}")
        except (TransportClosed, LocalUsageError):
            raise
        except RemoteError as exc:  # not ready yet, or an error of ours it reports
            counters["unanswered"] += 1
            failures.append(f"{addr}: refused ({exc.code})")
        except TransportError as exc:  # unreachable, gone, or it does not speak the protocol
            counters["unanswered"] += 1
            failures.append(f"{addr}: {type(exc).__name__}: {exc}"[:300])
    if refused:
        raise ManifestUnavailable(
            "no bootstrap peer gave a usable swarm manifest (" + "; ".join(failures) + "); "
            "join through another peer of the swarm (--bootstrap), or ask its operator")
    if failures:
        log.warning("no bootstrap peer answered for the swarm manifest: %s", "; ".join(failures))
    return None
