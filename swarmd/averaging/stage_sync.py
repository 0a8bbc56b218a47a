"""The stage's optimizer steps: progress reports, the leader's call, the all-reduce, the step.

The decisions are :class:`swarmd.averaging.trigger.RoundTrigger`'s; this module moves its messages
over ``/swarmd/<swarm>/1/round`` (request/reply, small meta only) and runs the round:

- ``progress`` {stage, step, samples}: a peer that is not the leader reports after each
  backward (coalesced: one report in flight at a time).
- ``prepare`` {stage, step}: the leader, once the target is reached, asks every mate for its
  step and whether it is free; the mates at the leader's step that are free form the group.
  A mate at another step is out of this round; whoever is behind catches up (``on_behind``).
- ``start`` {stage, step, round, group}: the leader tells the group; every member (the leader
  too) takes its gradient snapshot and enters ``Averager.all_reduce`` with the same round id and
  group, then applies the same averaged gradient and moves to the next step.

A peer alone in its stage steps locally when its own samples reach the target. A round that
fails (``AllReduceFailed`` at its deadline) puts the snapshot back into the accumulated
gradients and does not step: the peers that did step are ahead, and this one catches up.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import torch

from swarmd.averaging.allreduce import AllReduceFailed, Averager
from swarmd.errors import SwarmdError
from swarmd.averaging.trigger import RoundTrigger
from transport.errors import RemoteError, TransportError
from transport.frames import Message
from swarmd.protocols import Protocols

log = logging.getLogger("swarmd.sync")

#: how long the leader waits for a mate's answer to ``prepare`` / ``start``
ASK_TIMEOUT_S = 3.0


class RoundRefused(SwarmdError):
    code = "round_refused"


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncSettings:
    compression: str = "fp16"
    aggregator: str = "centered_clip"
    timeout_s: float = 30.0


class StageSync:
    """Owned by the stage server. ``mates()`` returns {peer_id: addrs} of the stage's other
    live peers; ``snapshot()`` takes (mean gradient, samples) and clears the accumulation;
    ``apply(vector)`` sets the gradient and steps; ``give_back(vector, samples)`` undoes a
    snapshot; ``on_behind(peer, step)`` is told of a mate at a later step; ``samples_now()``
    is what this peer accumulated since its last snapshot."""

    def __init__(self, host: Any, *, swarm: str, stage: int, trigger: RoundTrigger,
                 averager: Averager | None, mates: Callable[[], dict[str, tuple[str, ...]]],
                 snapshot: Callable[[], Awaitable[tuple[torch.Tensor, int]]],
                 apply: Callable[[torch.Tensor], Awaitable[None]],
                 give_back: Callable[[torch.Tensor, int], Awaitable[None]],
                 on_behind: Callable[[str, int], None], samples_now: Callable[[], int],
                 on_stepped: Callable[[], None] = lambda: None,
                 step_alone: Callable[[], Awaitable[None]] | None = None,
                 settings: SyncSettings = SyncSettings()) -> None:
        self.host = host
        self.stage = stage
        self.trigger = trigger
        self.averager = averager
        self.mates = mates
        self._snapshot, self._apply, self._give_back = snapshot, apply, give_back
        self._on_behind = on_behind
        self._samples_now = samples_now
        self._on_stepped = on_stepped
        self._step_alone = step_alone or self._snapshot_and_apply
        self.settings = settings
        self.protocol = Protocols(swarm).round
        self.counters: Counter[str] = Counter()
        self._round: asyncio.Task[None] | None = None
        #: bytes per second this peer moved in its last rounds (EMA); sizes its part
        self.bandwidth: float | None = None
        self._reporting: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def step(self) -> int:
        return self.trigger.step

    @property
    def busy(self) -> bool:
        return self._round is not None and not self._round.done()

    def start(self) -> None:
        self.host.set_request_handler(self.protocol, self._serve)

    async def close(self) -> None:
        self.host.remove_handler(self.protocol)
        tasks = [t for t in (self._round, self._reporting, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)

    # ---- events from the stage server --------------------------------------------------------
    def progressed(self, samples: int) -> None:
        """This peer now holds ``samples`` at the current step (after a backward)."""
        self.trigger.samples = samples
        self._consider()

    def _consider(self) -> None:
        if self.busy:
            return
        mates = self.mates()
        self.trigger.forget(mates)
        now = time.time()
        if not mates:
            if self.trigger.samples >= self.trigger.target:
                self._round = self._spawn(self._local_step())
            return
        leader = self.trigger.leader(mates, now)
        if leader == self.trigger.me:
            if self.trigger.ready(mates, now):
                self._round = self._spawn(self._lead(mates))
        elif self._reporting is None or self._reporting.done():
            self._reporting = self._spawn(self._report(leader, mates[leader]))

    # ---- rounds ---------------------------------------------------------------------------
    async def _local_step(self) -> None:
        await self._step_alone()
        self.counters["local_steps"] += 1
        self._stepped()

    async def _snapshot_and_apply(self) -> None:
        vector, _ = await self._snapshot()
        await self._apply(vector)

    async def _lead(self, mates: dict[str, tuple[str, ...]]) -> None:
        step = self.trigger.step
        now = time.time()  # a mate that just failed us is not waited for again
        mates = {p: a for p, a in mates.items() if self.trigger.suspects.get(p, 0.0) <= now}
        answers = await asyncio.gather(*(self._ask(p, addrs, "prepare", {"step": step})
                                         for p, addrs in mates.items()))
        group, bandwidths = [self.trigger.me], [self.bandwidth]
        for peer, reply in zip(mates, answers):
            if reply is None:
                continue
            their = reply.meta.get("step")
            if their == step and reply.meta.get("free") is True:
                group.append(peer)
                bandwidths.append(_bandwidth(reply.meta.get("bandwidth")))
            elif isinstance(their, int) and their > step:
                self._on_behind(peer, their)
                return  # we are behind: no round until we caught up
        round_id = f"{self.stage}:{step}:{secrets.token_hex(4)}"
        if len(group) > 1:
            # everyone told must run the very group it was told: a member that refuses now is
            # missing from the round, whose parts are repaired around it (swarmd.averaging.allreduce)
            started = await asyncio.gather(*(self._ask(
                p, mates[p], "start", {"step": step, "round": round_id, "group": group,
                                      "bandwidths": bandwidths})
                for p in group[1:]))
            self.counters["start_refused"] += sum(r is None for r in started)
        self.counters["rounds_led"] += 1
        await self._average(round_id, group, bandwidths)

    async def _average(self, round_id: str, group: list[str],
                       bandwidths: list[float | None]) -> None:
        """One round: every member passes the same group and bandwidths (the leader's lists),
        so they derive the same parts, each sized by its peer's measured bandwidth."""
        vector, samples = await self._snapshot()
        if len(group) == 1 or self.averager is None:
            await self._apply(vector)
            self.counters["local_steps"] += 1
            self._stepped()
            return
        s = self.settings
        try:
            result = await self.averager.all_reduce(
                round_id, group, vector, float(samples), codec=s.compression,
                aggregator=s.aggregator, deadline_s=s.timeout_s, bandwidths=bandwidths)
        except AllReduceFailed as exc:
            log.warning("stage %d round %s failed (%s): not stepping; catching up later",
                        self.stage, round_id, exc)
            self.counters["rounds_failed"] += 1
            await self._give_back(vector, samples)
            self.trigger.samples = self._samples_now()
            return
        await self._apply(result.vector)
        if result.seconds > 0:
            rate = (result.bytes_sent + result.bytes_received) / result.seconds
            self.bandwidth = rate if self.bandwidth is None else 0.7 * self.bandwidth + 0.3 * rate
        self.counters["rounds"] += 1
        self.counters["peers_missing"] += len(result.missing)
        self._stepped()

    def _stepped(self) -> None:
        log.debug("stage %d stepped to %d", self.stage, self.trigger.step + 1)
        self.trigger.stepped(self.trigger.step + 1, carried=self._samples_now())
        self._on_stepped()
        self._consider()  # samples that arrived during the round may already suffice

    def took_state(self, step: int, samples: int) -> None:
        """The stage's state was replaced by one at ``step`` (downloaded or loaded)."""
        self.trigger.stepped(step, carried=samples)

    # ---- messages ----------------------------------------------------------------------------
    async def _report(self, leader: str, addrs: tuple[str, ...]) -> None:
        sent = None
        while sent != (self.trigger.step, self.trigger.samples):
            sent = (self.trigger.step, self.trigger.samples)
            reply = await self._ask(leader, addrs, "progress",
                                    {"step": sent[0], "samples": sent[1]})
            if reply is None:
                self._consider()  # the leader was suspected: maybe we lead now
                return
            self.counters["reports_sent"] += 1

    async def _ask(self, peer: str, addrs: tuple[str, ...], kind: str,
                   meta: dict[str, Any]) -> Message | None:
        try:
            await self.host.ensure_connected(peer, addrs)
            return await self.host.request(peer, self.protocol, Message(
                kind=kind, meta={"stage": self.stage, **meta}), timeout=ASK_TIMEOUT_S)
        except RemoteError as exc:
            self.counters[f"refused.{exc.code}"] += 1
            return None
        except TransportError as exc:
            log.info("stage %d: %s to %s failed (%s)", self.stage, kind, peer, exc)
            self.trigger.suspect(peer, time.time())
            self.counters["mates_unreachable"] += 1
            return None

    async def _serve(self, message: Message, peer: str) -> Message:
        meta = message.meta
        if meta.get("stage") != self.stage:
            raise RoundRefused(f"this peer serves stage {self.stage}, not {meta.get('stage')}")
        step = meta.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise RoundRefused("a round message needs a non-negative integer step")
        if step > self.trigger.step:
            self._on_behind(peer, step)
        if message.kind == "progress":
            samples = meta.get("samples")
            if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
                raise RoundRefused("progress needs a non-negative integer samples")
            self.trigger.report(peer, step, samples)
            self._consider()
            return Message(kind="ok")
        if message.kind == "prepare":
            return Message(kind="ok", meta={"step": self.trigger.step, "free": not self.busy,
                                            "bandwidth": self.bandwidth})
        if message.kind == "start":
            group, round_id = meta.get("group"), meta.get("round")
            if (not isinstance(group, list) or not isinstance(round_id, str)
                    or self.host.peer_id not in group or len(group) > 1024
                    or not all(isinstance(p, str) for p in group)):
                raise RoundRefused("start needs a round id and a group that includes this peer")
            bandwidths = meta.get("bandwidths")
            if not isinstance(bandwidths, list) or len(bandwidths) != len(group):
                raise RoundRefused("start needs one bandwidth (or null) per group member")
            if step != self.trigger.step or self.busy:
                raise RoundRefused(f"this peer is at step {self.trigger.step}"
                                   f"{' in another round' if self.busy else ''}")
            self._round = self._spawn(self._average(round_id, list(group),
                                                    [_bandwidth(b) for b in bandwidths]))
            return Message(kind="ok")
        raise RoundRefused(f"unknown round message kind {message.kind!r}")

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.counters["round_errors"] += 1
            log.error("stage %d: round task failed: %r", self.stage, task.exception())


def _bandwidth(value: Any) -> float | None:
    """A peer's reported bandwidth, or None when it is not a usable number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e15:
        return float(value)
    return None
