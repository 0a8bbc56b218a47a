"""A checkpoint of a stage its peer no longer serves, offered to that stage's peers.

A restarting daemon placed away from the stage its home holds a checkpoint of (the placement's
``needed``: another stage had no peer) may hold that stage's newest training: after a whole
swarm restarted, the peer now serving it can have started from the initial weights. So the
moved daemon offers the checkpoint:

* it serves it, read from its home when asked, on ``/swarmd/<swarm>/1/offered-state`` (the
  state protocol's messages and checks: ``swarmd.state.serve``; a protocol of its own, so it
  never stands in for the stage it serves now);
* it tells each live peer of the old stage, over ``/swarmd/<swarm>/1/offer``, the checkpoint's
  stage and step (:class:`StateOffer`), again every ``TELL_EVERY_S`` for ``TELL_FOR_S`` until
  each says it is at that step or later;
* a peer of that stage whose step is lower downloads it from there and takes it over as it
  takes a mate's newer state (``StageKeeper.offered``); its mates then catch up from it as
  from any mate ahead of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmd.errors import SwarmdError
from swarmd.protocols import Protocols
from swarmd.state.checkpoint import CorruptCheckpoint, load_checkpoint
from swarmd.state.encoding import StageState
from swarmd.state.serve import StateServer
from swarmd.state.transfer import BadStateRequest
from transport.frames import Message

__all__ = ["StateOffer", "CheckpointOffer", "serve_offers", "TELL_EVERY_S", "TELL_FOR_S"]

log = logging.getLogger("swarmd.state.offer")

TELL_EVERY_S = 5.0
TELL_FOR_S = 120.0
OFFER_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class StateOffer:
    """``state_offer``: I hold ``stage``'s state of ``model_hash`` at ``step``."""

    stage: int
    step: int
    model_hash: str

    def __post_init__(self) -> None:
        for name in ("stage", "step"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value < 1 << 62:
                raise BadStateRequest("offer", f"{name} must be a non-negative integer")
        if type(self.model_hash) is not str or not 0 < len(self.model_hash) <= 256:
            raise BadStateRequest("offer", "model_hash must be a non-empty string")

    def to_meta(self) -> dict[str, Any]:
        return {"stage": self.stage, "step": self.step, "model_hash": self.model_hash}

    @classmethod
    def from_message(cls, message: Message) -> StateOffer:
        meta = message.meta
        if message.kind != "state_offer" or not isinstance(meta, Mapping) or message.tensors:
            raise BadStateRequest("offer", "a state offer is kind 'state_offer', no tensors")
        return cls(stage=meta.get("stage"), step=meta.get("step"),
                   model_hash=meta.get("model_hash"))


def serve_offers(host: Any, swarm: str, on_offer: Callable[[str, StateOffer], int | None]
                 ) -> None:
    """Answer offers: ``on_offer(peer, offer)`` starts taking it when it wants it and returns
    this peer's step of that stage (None: it serves another, or has nothing yet)."""
    async def serve(message: Message, peer: str) -> Message:
        offer = StateOffer.from_message(message)
        return Message(kind="state_offer", meta={"step": on_offer(peer, offer)})

    host.set_request_handler(Protocols(swarm).offer, serve)


class CheckpointOffer:
    """Offers ``dir``'s checkpoint of ``stage`` (module doc) to ``peers()`` ((peer id,
    addresses) of the stage's live peers)."""

    def __init__(self, host: Any, *, swarm: str, dir: Path, stage: int, step: int,
                 model_hash: str, peers: Callable[[], list[tuple[str, tuple[str, ...]]]],
                 counters: dict[str, int] | None = None) -> None:
        self.host = host
        self.offer = StateOffer(stage=stage, step=step, model_hash=model_hash)
        self.dir = dir
        self.peers = peers
        self.protocol = Protocols(swarm).offer
        self.counters: dict[str, int] = counters if counters is not None else {}
        self._server = StateServer(host, Protocols(swarm).offered_state, self._snapshot,
                                   stage=stage, model_hash=model_hash,
                                   counters=self.counters, keep=1, keep_s=600.0,
                                   fresh_s=600.0)

    async def _snapshot(self) -> StageState | None:
        try:
            state = await asyncio.to_thread(  # our own file: its size bounds it
                lambda: load_checkpoint(self.dir, self.offer.stage, max_bytes=1 << 62))
        except CorruptCheckpoint as exc:
            log.warning("stage %d: the offered checkpoint is unusable now: %s",
                        self.offer.stage, exc)
            return None
        return state if state is not None and state.step == self.offer.step else None

    async def run(self, *, every_s: float = TELL_EVERY_S, for_s: float = TELL_FOR_S) -> None:
        """Serve the checkpoint and tell the stage's peers until each is at its step (or
        ``for_s`` passed); the checkpoint stays served until :meth:`close`."""
        self._server.start()
        deadline = time.monotonic() + for_s
        done: set[str] = set()
        while time.monotonic() < deadline:
            for peer, addrs in self.peers():
                if peer not in done and await self._tell(peer, addrs):
                    done.add(peer)
            await asyncio.sleep(every_s)

    async def _tell(self, peer: str, addrs: tuple[str, ...]) -> bool:
        """Tell ``peer``; whether it needs telling no more (at our step or later)."""
        try:
            await self.host.connect(peer, addrs, timeout=OFFER_TIMEOUT_S)
            reply = await self.host.request(peer, self.protocol, Message(
                kind="state_offer", meta=self.offer.to_meta()), timeout=OFFER_TIMEOUT_S)
        except (SwarmdError, Exception) as exc:  # gone, busy or an older peer: next round
            log.debug("offering stage %d's checkpoint to %s failed: %s", self.offer.stage,
                      peer, exc)
            return False
        step = reply.meta.get("step") if isinstance(reply.meta, Mapping) else None
        self.counters["offers_told"] = self.counters.get("offers_told", 0) + 1
        return type(step) is int and step >= self.offer.step

    def close(self) -> None:
        self._server.close()
