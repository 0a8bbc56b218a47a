"""Saying which setting differs when a peer trains another model.

Membership keeps a peer whose announced model hash is not ours out of routing (reason
``model_hash_mismatch``), but a hash does not say what differs. Every daemon answers ``model``
requests with its model's fingerprint: the hash and the settings it digests
(``swarmd.models.seam.Fingerprint``). A trainer or daemon that sees only such peers asks one and
names the differences (``dtype: 'bfloat16' here vs 'float32' there``) in one line.

The message is a frozen dataclass built and checked in :func:`parse_model_info` (unknown keys
dropped; at most ``MAX_FIELDS`` settings of bounded size).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from swarmd.errors import BadActivation, ModelMismatch
from swarmd.models.seam import Fingerprint, check_fingerprint
from swarmd.protocols import Protocols
from transport.frames import Message

__all__ = ["ModelInfo", "parse_model_info", "protocol", "serve_model_info", "explain_mismatch",
           "MODEL_INFO_TIMEOUT_S"]

MAX_FIELDS = 512
MAX_TEXT = 128
MAX_VALUE_CHARS = 4096
MODEL_INFO_TIMEOUT_S = 5.0


def protocol(swarm: str) -> str:
    return Protocols(swarm).model


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    """A peer's model: ``name`` (swarm.model), the fingerprint's ``hash`` and ``fields``."""

    name: str
    hash: str
    fields: Mapping[str, Any] = field(default_factory=dict)

    def wire(self) -> dict[str, Any]:
        return {"kind": "model", "meta": {"name": self.name, "hash": self.hash,
                                          "fields": dict(self.fields)}}


def parse_model_info(message: Any) -> ModelInfo:
    """A ``model`` reply; :class:`BadActivation` (the peer's fault) when malformed."""
    meta = getattr(message, "meta", None)
    if getattr(message, "kind", None) != "model" or not isinstance(meta, Mapping):
        raise BadActivation("malformed", "a model info reply is kind 'model' with a meta map")
    name, digest, fields = meta.get("name"), meta.get("hash"), meta.get("fields")
    for key, value in (("name", name), ("hash", digest)):
        if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT:
            raise BadActivation("malformed", f"model info {key!r} must be a string of 1.."
                                             f"{MAX_TEXT} characters")
    if not isinstance(fields, Mapping) or len(fields) > MAX_FIELDS or not all(
            isinstance(k, str) and len(k) <= MAX_TEXT and len(repr(v)) <= MAX_VALUE_CHARS
            for k, v in fields.items()):
        raise BadActivation("malformed", f"model info 'fields' must map at most {MAX_FIELDS} "
                                         f"setting names to short values")
    return ModelInfo(name=name, hash=digest, fields={k: _plain(v) for k, v in fields.items()})


def _plain(value: Any) -> Any:
    """msgpack gives lists where JSON (the fingerprint's canonical form) has them too."""
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def serve_model_info(host: Any, swarm: str, name: str, fingerprint: Fingerprint) -> None:
    """Answer ``model`` requests with this peer's model."""
    reply = ModelInfo(name=name, hash=fingerprint.hash, fields=fingerprint.fields)

    async def serve(message: Message, peer: str) -> Message:
        return Message(**reply.wire())

    host.set_request_handler(protocol(swarm), serve)


def mismatched_peers(swarm_info: Any) -> list[tuple[str, tuple[str, ...]]]:
    """(peer id, addresses) of the stage peers membership keeps out for another model."""
    rows = [p for s in swarm_info.stages for p in s.peers]
    rows += [p for p in getattr(swarm_info, "excluded", ()) if p.stage is not None]
    return [(p.peer_id, tuple(p.addrs)) for p in rows if p.reason == "model_hash_mismatch"]


async def explain_mismatch(host: Any, swarm: str, name: str, ours: Fingerprint,
                           peers: list[tuple[str, tuple[str, ...]]]) -> str | None:
    """Ask the first of ``peers`` that answers (at most 3, ``MODEL_INFO_TIMEOUT_S`` each)
    for its model; the :class:`ModelMismatch` message naming what differs, or None when none
    answered usefully."""
    for peer, addrs in peers[:3]:
        try:
            if addrs:
                await host.connect(peer, addrs)
            reply = await host.request(peer, protocol(swarm), Message(kind="model", meta={}),
                                       timeout=MODEL_INFO_TIMEOUT_S)
            info = parse_model_info(reply)
        except Exception:  # an old peer, gone, or malformed: try the next one
            continue
        if info.name != name:
            return (f"peer {peer} trains model {info.name!r}, this one {name!r} (swarm.model "
                    f"differs)")
        try:
            check_fingerprint(ours, info.hash, info.fields)
        except ModelMismatch as exc:
            return f"peer {peer} trains another model: {exc}"
    return None
