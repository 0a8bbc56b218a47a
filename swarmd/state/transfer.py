"""State transfer between peers of a stage, over one libp2p request protocol.

A peer joining a stage (new, restarted or migrating) downloads the stage's state from a live
peer of it before announcing itself. The server side (:class:`swarmd.state.serve.StateServer`) freezes a snapshot
on request, encodes it once and keeps the last few by digest for a while, so a download can
proceed chunk by chunk and resume. Requests (``meta`` always carries ``stage`` and
``model_hash``)::

    state_info  {}                     -> state_info  {stage, step, digest, total_bytes,
                                                       chunk_bytes, chunks, model_hash}
    state_chunk {digest, index}        -> state_chunk {digest, index, checksum} + uint8 tensor

Errors are typed replies: ``wrong_stage``, ``model_hash_mismatch``, ``no_state`` (the peer has
nothing to give yet), ``unknown_snapshot`` (that digest is no longer kept: ask ``state_info``
again), ``bad_state_request``.

The client side (:func:`swarmd.state.fetch.fetch_state`) asks every source for ``state_info``, downloads the
highest step a few chunks at a time, checks each chunk's checksum and the whole digest, and when
its source fails continues from another source with the same digest (``resumed``) or starts over
with the best other snapshot (``restarted``). Which source comes next is decided by the pure
:class:`Plan`. This module holds the offer (:class:`StateInfo`), the errors and the plan; the
requests and the other replies are parsed in :mod:`swarmd.state.messages`; ``serve`` and
``fetch`` are the two sides. Requests carry no tensors (a chunk pushed unasked is refused:
``bad_state_request``, reason ``unsolicited_data``); an offer is judged on its claimed size
before a byte is taken, and a state holding NaN/Inf is neither served nor restored.
"""

from __future__ import annotations
import hashlib
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Mapping


from swarmd.errors import BadPeerMessage, SwarmdError
from transport.codecs import CodecSpec

log = logging.getLogger("swarmd.state_transfer")

__all__ = ["StateInfo", "Plan", "StateTransferFailed", "UnknownSnapshot", "NoState",
           "BadStateRequest", "DEFAULT_CHUNK_BYTES", "chunk_checksum"]

MiB = 1 << 20
DEFAULT_CHUNK_BYTES = 4 * MiB
MIN_CHUNK_BYTES = 1024
MAX_CHUNK_BYTES = 16 * MiB
#: sources asked at most, and times one source is asked again after its snapshot expired
MAX_SOURCES = 16
MAX_REQUERIES = 2
_NONE = CodecSpec(name="none")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")


class StateTransferFailed(SwarmdError):
    """No source could give the stage's state; the message names the stage and the peers."""

    code = "state_transfer_failed"


class UnknownSnapshot(SwarmdError):
    """A chunk of a snapshot this peer no longer keeps: ask ``state_info`` again."""

    code = "unknown_snapshot"


class NoState(SwarmdError):
    """This peer has no state of the stage to give (it is joining or changing stage itself)."""

    code = "no_state"


class BadStateRequest(BadPeerMessage):
    """A state request or reply that is malformed or out of range: the sender is at fault."""

    code = "bad_state_request"


def chunk_checksum(data: bytes | bytearray | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class StateInfo:
    """What a source offers: one frozen snapshot. Validated when built."""

    peer: str
    stage: int
    step: int
    model_hash: str
    digest: str
    total_bytes: int
    chunk_bytes: int
    #: the source's upload cap (``limits.upload_bytes_s``), bytes/s; None: uncapped or not
    #: said (an older source). The fetcher's chunk deadlines follow it (swarmd.links)
    upload_bytes_s: int | None = None

    def __post_init__(self) -> None:
        for name in ("stage", "step", "total_bytes", "chunk_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BadStateRequest("info", f"{name} must be a non-negative integer")
        cap = self.upload_bytes_s
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise BadStateRequest("info", "upload_bytes_s must be None or a positive integer")
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise BadStateRequest("info", f"chunk size {self.chunk_bytes} outside "
                                          f"{MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}")
        if not isinstance(self.digest, str) or not _HEX64.fullmatch(self.digest):
            raise BadStateRequest("info", "digest must be 64 lowercase hex digits")
        if not isinstance(self.model_hash, str) or not self.model_hash:
            raise BadStateRequest("info", "model_hash must be a non-empty string")

    @property
    def chunks(self) -> int:
        return -(-self.total_bytes // self.chunk_bytes)

    def chunk_range(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)

    def to_meta(self) -> dict[str, Any]:
        meta = {"stage": self.stage, "step": self.step, "model_hash": self.model_hash,
                "digest": self.digest, "total_bytes": self.total_bytes,
                "chunk_bytes": self.chunk_bytes, "chunks": self.chunks}
        if self.upload_bytes_s is not None:
            meta["upload_bytes_s"] = self.upload_bytes_s
        return meta

    @classmethod
    def from_meta(cls, peer: str, meta: Mapping[str, Any]) -> StateInfo:
        try:
            info = cls(peer=peer, **{k: meta.get(k) for k in (
                "stage", "step", "model_hash", "digest", "total_bytes", "chunk_bytes",
                "upload_bytes_s")})
        except TypeError as exc:
            raise BadStateRequest("info", str(exc)) from None
        if meta.get("chunks") != info.chunks:
            raise BadStateRequest("info", f"{meta.get('chunks')!r} chunks announced, "
                                          f"{info.chunks} implied")
        return info


# ---- client: which source next (pure) -------------------------------------------------------

@dataclass(slots=True)
class Plan:
    """The sources left, best first (highest step; ties keep the given order), and what is
    downloaded so far. No I/O: the client reports events, the plan says what to do next."""

    candidates: list[StateInfo]
    #: the snapshot being downloaded and the chunk indices already verified
    current: StateInfo | None = None
    have: set[int] = field(default_factory=set)
    failures: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.candidates = sorted(self.candidates, key=lambda i: -i.step)

    def next(self) -> tuple[StateInfo, str] | None:
        """The source to download from and how: ``"start"``, ``"resume"`` (same digest: keep
        the chunks we have) or ``"restart"`` (another snapshot: drop them). None: none left."""
        if not self.candidates:
            return None
        if self.current is not None:
            for info in self.candidates:
                if info.digest == self.current.digest:
                    self.current = info
                    return info, "resume"
        how = "start" if self.current is None else "restart"
        self.current, self.have = self.candidates[0], set()
        return self.current, how

    def failed(self, peer: str, reason: str) -> None:
        self.candidates = [i for i in self.candidates if i.peer != peer]
        self.failures[peer] = reason

    def renewed(self, info: StateInfo) -> None:
        """A source offers a new snapshot (its old one expired): it competes again."""
        self.candidates = sorted([i for i in self.candidates if i.peer != info.peer] + [info],
                                 key=lambda i: -i.step)

    def bad_snapshot(self, key: str, reason: str) -> None:
        """A whole snapshot is unusable: every source offering it is dropped, and so is what
        was downloaded of it."""
        for info in [i for i in self.candidates if i.digest == key]:
            self.failed(info.peer, reason)
        if self.current is not None and self.current.digest == key:
            self.have = set()

    def missing(self) -> list[int]:
        assert self.current is not None
        return [i for i in range(self.current.chunks) if i not in self.have]
