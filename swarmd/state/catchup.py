"""Catching up by replay: the steps a stage took while our state was in transit, re-applied.

A peer that took a mate's state at step ``s`` (a download, ``swarmd.state.keeper``) often
finds the stage at ``s + k`` by the time it is restored: a big state over a slow link takes
longer than a step. Instead of downloading again (and being behind again, forever), it asks a
mate for the ``k`` gradients the stage applied from ``s`` on (``state_replay``: each mate
keeps its last ones, ``swarmd.state.replay``) and applies them in the compute thread exactly
as a round does (``Stepper.apply_gradient``: Adam moments, the lr schedule's count and
``server.step`` advance as the mates' did), with the stage's rounds held by the caller. The
same gradients through the same optimizer on the same device and torch give bitwise the same
weights: the round digest is compared with the mate's (``state_digest``) and a mismatch is
counted (``replay_mismatch``) and left to the drift repair.

Counters (the keeper's, shown as ``state.<name>``): ``replayed_steps``, ``replay_unavailable``
(no mate kept the gradients we needed), ``replay_mismatch``, ``replays_served``.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from swarmd.links import links_for
from swarmd.state.fetch import ask_digest, ask_replay
from swarmd.state.messages import MAX_REPLAY_STEPS, ReplayRequest
from swarmd.state.replay import ReplayLog

log = logging.getLogger("swarmd.keeper")

#: what a mate's compute thread may need besides the link (reading its log, a digest)
SERVE_EXTRA_S = 2.0
#: requests one catch-up makes at most (the stage may step on while we replay)
MAX_REQUESTS = 8
#: mates asked in turn for the gradients, at most
MAX_SOURCES = 4
REPLY_OVERHEAD = 64 << 10


class Replayer:
    """One per stage keeper: serves this peer's logged gradients and replays a mate's."""

    def __init__(self, host: Any, server: Any, *, protocol: str, model_hash: str,
                 counters: dict[str, int]) -> None:
        self.host = host
        self.server = server
        self.protocol = protocol
        self.model_hash = model_hash
        self.counters = counters
        #: the step the last source answering ``replay`` was at (None: no answer)
        self.target: int | None = None

    def caught_up(self) -> bool:
        """Whether the last ``replay`` reached the step its source was at."""
        return self.target is not None and self.server.step >= self.target

    @property
    def log(self) -> ReplayLog:
        return self.server.stepper.replay  # type: ignore[no-any-return]

    @property
    def enabled(self) -> bool:
        return self.log.enabled

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    async def serve(self, since: int, count: int) -> tuple[int, list[torch.Tensor] | None]:
        """(our step, the gradients applied from ``since`` on, at most ``count``), read in
        the compute thread (where they are logged)."""
        def read() -> tuple[int, list[torch.Tensor] | None]:
            return self.server.stepper.weights_step, self.log.between(since, count)
        step, vectors = await self.server.run_exclusive(read)
        if vectors:
            self._count("replays_served")
        return step, vectors

    def _batch(self) -> int:
        """Gradients one request asks for: within our log's bounds and our message limit."""
        numel = self.server.stepper.numel
        size = max(1, numel * 4)
        limit = getattr(getattr(getattr(self.host, "options", None), "limits", None),
                        "max_message_bytes", None)
        room = (limit - REPLY_OVERHEAD) // size if isinstance(limit, int) else MAX_REPLAY_STEPS
        return max(0, min(self.log.max_steps, self.log.max_bytes // size, room,
                          MAX_REPLAY_STEPS))

    async def replay(self, sources: Sequence[tuple[str, Sequence[str]]]) -> int:
        """With the stage's rounds held (the caller's): ask ``sources`` (the first first)
        for the gradients from our step on and apply them, until a source says we are at its
        step or ``MAX_REQUESTS`` were made. Returns the steps replayed."""
        batch = self._batch()
        self.target = None
        if not self.enabled or batch <= 0 or not sources:
            return 0
        done, target, last = 0, None, None
        for _ in range(MAX_REQUESTS):
            since = self.server.step
            reply = await self._ask(sources[:MAX_SOURCES], since, batch)
            if reply is None:
                self._count("replay_unavailable")
                log.info("stage %d: no mate keeps the gradients from step %d: cannot "
                         "replay", self.server.stage, since)
                break
            last, target = reply.peer, reply.step
            self.target = target
            if not reply.vectors:
                break  # the source is at our step: caught up
            await self.server.run_exclusive(self._apply, since, reply.vectors)
            self.server.took_state(since + len(reply.vectors))
            done += len(reply.vectors)
            self._count("replayed_steps", len(reply.vectors))
            if self.server.step >= target:
                break
        if done:
            log.info("stage %d: replayed %d step(s) to step %d", self.server.stage, done,
                     self.server.step)
            await self._compare(last, sources)
        return done

    async def _ask(self, sources: Sequence[tuple[str, Sequence[str]]], since: int,
                   batch: int) -> Any:
        """The first source's answer that has the gradients (or says we are at its step)."""
        request = ReplayRequest(stage=self.server.stage, model_hash=self.model_hash,
                                since=since, count=batch)
        nbytes = batch * 4 * self.server.stepper.numel  # float32 vectors
        for peer, addrs in sources:
            # the deadline follows the link: the bytes asked for at the measured rate and RTT
            timeout = links_for(self.host).deadline(peer, nbytes, round_trips=2,
                                                    extra_s=SERVE_EXTRA_S)
            reply = await ask_replay(self.host, self.protocol, peer, addrs, request=request,
                                     numel=self.server.stepper.numel,
                                     timeout_s=timeout, counters=self.counters)
            if reply is None or reply.step < since:
                continue
            if reply.vectors is not None or reply.step == since:
                return reply
        return None

    def _apply(self, since: int, vectors: Sequence[torch.Tensor]) -> None:
        """In the compute thread: step with each gradient in turn, as a round would."""
        for i, vector in enumerate(vectors):
            # the optimizer may scale or clip the gradient in place: never the reply's tensor
            self.server.stepper.apply_gradient(vector.clone(), at=since + i)

    async def _compare(self, peer: str | None,
                       sources: Sequence[tuple[str, Sequence[str]]]) -> None:
        """Our round digest against ``peer``'s, when it is still at our step."""
        if peer is None:
            return
        addrs = next((a for p, a in sources if p == peer), ())
        theirs = await ask_digest(self.host, self.protocol, peer, addrs,
                                  stage=self.server.stage, model_hash=self.model_hash,
                                  timeout_s=links_for(self.host).deadline(
                                      peer, 0, round_trips=2, extra_s=SERVE_EXTRA_S),
                                  counters=self.counters)
        if theirs is None or theirs.step != self.server.step:
            return  # it stepped on meanwhile (or cannot say): nothing cheap to compare
        ours = await self.server.run_exclusive(self.server.stepper.round_digest)
        if ours != theirs.digest:
            self._count("replay_mismatch")
            log.warning("stage %d: our weights after replaying to step %d differ from %s's; "
                        "the drift repair takes its state", self.server.stage,
                        self.server.step, peer)
        else:
            self._count("replay_matched")
