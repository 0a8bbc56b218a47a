"""The messages of state transfer (:mod:`swarmd.state.transfer`), as values. Pure: no I/O.

Requests (served by :class:`swarmd.state.serve.StateServer`) are parsed in one place,
:func:`parse_request`; replies (read by :mod:`swarmd.state.fetch`) in :func:`parse_info`,
:func:`parse_digest`, :func:`parse_replay` (gradients to replay: ``swarmd.state.catchup``) and
:func:`parse_chunk`, checked against what the fetching side asked and expects: the chunk of the
snapshot and index it asked that very source for, of the size the offer implies, and an offer
whose size fits the stage's model (:func:`check_offer`). Unknown keys are dropped; anything
invalid raises :class:`~swarmd.state.transfer.BadStateRequest` with a short ``reason``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from swarmd.state.transfer import _HEX32, _HEX64, BadStateRequest, StateInfo

__all__ = ["ChunkReply", "ChunkRequest", "DigestReply", "DigestRequest", "InfoRequest",
           "ReplayReply", "ReplayRequest", "SizeBound", "check_offer", "parse_chunk",
           "parse_digest", "parse_info", "parse_replay", "parse_request"]

MAX_MODEL_HASH_CHARS = 256
#: the most chunks a snapshot may have (16 GiB of 1 KiB chunks would be 16 Mi)
MAX_CHUNKS = 1 << 24
#: the most gradients one ``state_replay`` asks for (``state.replay_steps`` is at most this)
MAX_REPLAY_STEPS = 1024


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class InfoRequest:
    """``state_info``: what snapshot of ``stage`` of ``model_hash`` do you offer?"""

    stage: int
    model_hash: str

    def __post_init__(self) -> None:
        if not _is_int(self.stage) or not 0 <= self.stage < 1 << 16:
            raise BadStateRequest("stage", "the request names no valid stage")
        if not isinstance(self.model_hash, str) or not (
                0 < len(self.model_hash) <= MAX_MODEL_HASH_CHARS):
            raise BadStateRequest("model_hash", "the request names no valid model hash")

    def to_meta(self) -> dict[str, Any]:
        return {"stage": self.stage, "model_hash": self.model_hash}


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkRequest(InfoRequest):
    """``state_chunk``: chunk ``index`` of the snapshot named ``digest``."""

    digest: str
    index: int

    def __post_init__(self) -> None:
        InfoRequest.__post_init__(self)
        if not isinstance(self.digest, str) or not _HEX64.fullmatch(self.digest):
            raise BadStateRequest("chunk", "a chunk request needs a 64-hex-digit digest")
        if not _is_int(self.index) or not 0 <= self.index < MAX_CHUNKS:
            raise BadStateRequest("chunk", f"chunk index {self.index!r}"[:80])

    def to_meta(self) -> dict[str, Any]:
        return {**InfoRequest.to_meta(self), "digest": self.digest, "index": self.index}


@dataclass(frozen=True, slots=True, kw_only=True)
class DigestRequest(InfoRequest):
    """``state_digest``: at what step are your weights of ``stage``, and their round digest?
    Asked of the stage's mates while no round runs (idle drift, ``swarmd.state.keeper``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DigestReply:
    """A mate's answer to ``state_digest``: its step and the sampled digest of its weights
    (``Stepper.round_digest``, 32 hex digits), attributed to the peer asked."""

    peer: str
    step: int
    digest: str

    def __post_init__(self) -> None:
        if not _is_int(self.step) or not 0 <= self.step < 1 << 62:
            raise BadStateRequest("digest_reply", f"step {self.step!r}"[:80])
        if not isinstance(self.digest, str) or not _HEX32.fullmatch(self.digest):
            raise BadStateRequest("digest_reply", "a digest reply needs 32 hex digits")

    def to_meta(self) -> dict[str, Any]:
        return {"step": self.step, "digest": self.digest}


def parse_digest(peer: str, kind: str, meta: Mapping[str, Any],
                 tensors: Sequence[Any] = ()) -> DigestReply:
    """A mate's ``state_digest`` reply, attributed to ``peer``, the mate asked."""
    if kind != "state_digest" or not isinstance(meta, Mapping) or tensors:
        raise BadStateRequest("digest_reply", f"answered state_digest with {kind[:40]!r}")
    return DigestReply(peer=peer, step=meta.get("step"), digest=meta.get("digest"))


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayRequest(InfoRequest):
    """``state_replay``: the gradients you applied at steps ``since`` .. ``since + count - 1``
    (``swarmd.state.replay``), as many of them as you keep, and your step."""

    since: int
    count: int

    def __post_init__(self) -> None:
        InfoRequest.__post_init__(self)
        if not _is_int(self.since) or not 0 <= self.since < 1 << 62:
            raise BadStateRequest("replay", f"since {self.since!r}"[:80])
        if not _is_int(self.count) or not 1 <= self.count <= MAX_REPLAY_STEPS:
            raise BadStateRequest("replay", f"count {self.count!r}"[:80])

    def to_meta(self) -> dict[str, Any]:
        return {**InfoRequest.to_meta(self), "since": self.since, "count": self.count}


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayReply:
    """A mate's answer to ``state_replay``: its step, and the gradients it applied from step
    ``since`` on (``vectors``, checked), or None when it does not keep them (``not kept``)."""

    peer: str
    since: int
    step: int
    vectors: tuple[torch.Tensor, ...] | None

    def to_meta(self) -> dict[str, Any]:
        return {"since": self.since, "step": self.step, "kept": self.vectors is not None}


def parse_replay(peer: str, kind: str, meta: Mapping[str, Any], tensors: Sequence[Any], *,
                 asked: ReplayRequest, numel: int) -> ReplayReply:
    """``peer``'s reply to ``asked``: at most ``asked.count`` flat float32 vectors of
    ``numel`` finite values, answering from ``asked.since``, at a step no lower than what
    they take the state to; or a ``not kept`` answer with no tensors."""
    if kind != "state_replay" or not isinstance(meta, Mapping):
        raise BadStateRequest("replay_reply", f"answered state_replay with {kind[:40]!r}")
    step, kept = meta.get("step"), meta.get("kept")
    if meta.get("since") != asked.since or not isinstance(kept, bool) or not _is_int(step) \
            or not 0 <= step < 1 << 62:
        raise BadStateRequest("replay_reply", "a replay reply needs since, step and kept")
    if not kept:
        if tensors:
            raise BadStateRequest("replay_reply", "a not-kept reply carries no tensors")
        return ReplayReply(peer=peer, since=asked.since, step=step, vectors=None)
    if not 0 < len(tensors) <= asked.count or asked.since + len(tensors) > step:
        raise BadStateRequest("replay_reply", f"{len(tensors)} vectors answer {asked.count} "
                                              f"steps from {asked.since} to step {step}")
    for vector in tensors:
        if not (isinstance(vector, torch.Tensor) and vector.dtype == torch.float32
                and tuple(vector.shape) == (numel,)):
            raise BadStateRequest("replay_reply", f"a replayed gradient must be {numel} "
                                                  f"float32 values")
        if not bool(torch.isfinite(vector).all()):
            raise BadStateRequest("replay_reply", "a replayed gradient holds NaN/Inf")
    return ReplayReply(peer=peer, since=asked.since, step=step, vectors=tuple(tensors))


def parse_request(kind: str, meta: Mapping[str, Any],
                  tensors: Sequence[Any] = ()) -> InfoRequest | ChunkRequest:
    """A state request from the wire. Requests carry no tensors: a peer pushing a chunk
    nobody asked it for is refused here."""
    if kind not in ("state_info", "state_chunk", "state_digest", "state_replay"):
        raise BadStateRequest("kind", f"unknown request kind {kind[:64]!r}")
    if tensors:
        raise BadStateRequest("unsolicited_data", f"a {kind} request carries no tensors")
    if not isinstance(meta, Mapping):
        raise BadStateRequest("meta", "meta must be a map")
    base = {"stage": meta.get("stage"), "model_hash": meta.get("model_hash")}
    if kind == "state_info":
        return InfoRequest(**base)
    if kind == "state_digest":
        return DigestRequest(**base)
    if kind == "state_replay":
        return ReplayRequest(**base, since=meta.get("since"), count=meta.get("count"))
    return ChunkRequest(**base, digest=meta.get("digest"), index=meta.get("index"))


def parse_info(peer: str, kind: str, meta: Mapping[str, Any]) -> StateInfo:
    """A source's ``state_info`` reply (its offer), attributed to ``peer``, the source asked."""
    if kind != "state_info" or not isinstance(meta, Mapping):
        raise BadStateRequest("info", f"answered state_info with {kind[:40]!r}")
    return StateInfo.from_meta(peer, meta)


@dataclass(frozen=True, slots=True)
class SizeBound:
    """The fewest and most bytes a state of this peer's stage can take (from its module)."""

    low: int
    high: int


def check_offer(info: StateInfo, *, stage: int, model_hash: str, max_bytes: int,
                bound: SizeBound | None, newer_than: int | None) -> str | None:
    """Why an offer is not worth downloading, or None when it is. A size is judged on the
    claim before a byte is taken: over ``max_bytes`` or outside ``bound`` it is refused."""
    if info.stage != stage or info.model_hash != model_hash:
        return f"offers stage {info.stage} of model {info.model_hash[:16]}"
    if newer_than is not None and info.step <= newer_than:
        return f"offers step {info.step}, not newer than our {newer_than}"
    if info.total_bytes > max_bytes:
        return f"offers {info.total_bytes} bytes, more than the limit of {max_bytes}"
    if bound is not None and not bound.low <= info.total_bytes <= bound.high:
        return (f"offers {info.total_bytes} bytes; a state of this stage's model takes "
                f"{bound.low}..{bound.high}")
    if info.chunks > MAX_CHUNKS:
        return f"offers {info.chunks} chunks, more than {MAX_CHUNKS}"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkReply:
    """One chunk of a snapshot, as the source sent it (not yet checked against its sum)."""

    digest: str
    index: int
    checksum: str
    payload: torch.Tensor


def parse_chunk(kind: str, meta: Mapping[str, Any], tensors: Sequence[Any], *,
                info: StateInfo, index: int) -> ChunkReply:
    """The reply to our request for chunk ``index`` of ``info`` (made to ``info.peer``): it
    must be that chunk of that snapshot, of the size the offer implies, as uint8 bytes."""
    start, end = info.chunk_range(index)
    ok = (kind == "state_chunk" and isinstance(meta, Mapping) and len(tensors) == 1
          and meta.get("digest") == info.digest and meta.get("index") == index
          and isinstance(meta.get("checksum"), str) and bool(_HEX32.fullmatch(meta["checksum"])))
    payload = tensors[0] if ok else None
    if not (isinstance(payload, torch.Tensor) and payload.dtype == torch.uint8
            and tuple(payload.shape) == (end - start,)):
        raise BadStateRequest("chunk_reply", f"malformed reply to chunk {index}")
    return ChunkReply(digest=info.digest, index=index, checksum=meta["checksum"],
                      payload=payload)
