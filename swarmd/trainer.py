"""The trainer: embeddings, head and loss, and the microbatches it sends through the swarm.

For each microbatch: embed (B, T) bytes, send the activations to a stage-0 peer chosen by
``Wiring`` (another one if it fails: ``rerouted``); the chain ends with the last stage's
``result`` arriving here; compute the loss and its gradient, send it back along the recorded
path; stage 0's ``grad`` finishes the embedding's backward. A microbatch whose chain breaks in
a way no hop could route around (a peer holding its activations died) is run again from the
start (``restarted``). Gradients are added to the parameters only once a microbatch has fully
succeeded, so a restart never counts twice. ``lost`` counts microbatches given up; while some
stage has no peer the trainer waits and says which.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from swarmd.errors import StageUnavailable
from swarmd.stage_server import HOP_TIMEOUT_S, protocols
from swarmd.wiring import Wiring
from transport.errors import RemoteError, TransportError
from transport.frames import Message

log = logging.getLogger("swarmd.trainer")

MAX_RESTARTS = 8
#: how long to wait for a missing stage before a microbatch counts as lost
MISSING_STAGE_PATIENCE_S = 300.0


@dataclass
class TrainStats:
    rerouted: int = 0
    restarted: int = 0
    lost: int = 0
    microbatches: int = 0
    tokens: int = 0
    missing_stage: int | None = None
    losses: list[float] = field(default_factory=list)


class Trainer:
    """``peers_of(stage)`` returns {peer_id: (throughput, queue, addrs)} from membership."""

    def __init__(self, host: Any, *, swarm: str, num_stages: int, model_config: Any,
                 model_hash: str, codec: Any, lr: float, seed: int,
                 peers_of: Callable[[int], dict[str, tuple[float, int, tuple[str, ...]]]],
                 rng: random.Random | None = None) -> None:
        from swarmd.model import build_embedding, build_head

        self.host = host
        self.num_stages = num_stages
        self.model_hash = model_hash
        self.codec = codec
        self.proto = protocols(swarm)
        self.peers_of = peers_of
        self.embedding = build_embedding(model_config, seed)
        self.head = build_head(model_config, seed)
        self.params = [*self.embedding.parameters(), *self.head.parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr)
        self.step = 0
        self.stats = TrainStats()
        self.wiring = Wiring()
        self._rng = rng or random.Random()
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="trainer-compute")
        self._waiting: dict[tuple[str, str], asyncio.Future[torch.Tensor]] = {}
        self._paths: dict[str, list[str]] = {}
        self._counter = 0

    def start(self) -> None:
        self.host.set_request_handler(self.proto["result"], self._on_arrival)
        self.host.set_request_handler(self.proto["grad"], self._on_arrival)

    def close(self) -> None:
        self._compute.shutdown(wait=True, cancel_futures=True)

    # ---- arrivals from the swarm -----------------------------------------------------------
    async def _on_arrival(self, message: Message, peer: str) -> Message:
        mb = message.meta.get("mb")
        future = self._waiting.get((message.kind, mb)) if isinstance(mb, str) else None
        if future is None or len(message.tensors) != 1:
            return Message(kind="ok", meta={"late": True})  # a restarted microbatch's leftover
        if message.kind == "result":
            self._paths[mb] = list(message.meta.get("path", []))
        if not future.done():
            future.set_result(message.tensors[0])
        return Message(kind="ok")

    # ---- one step ---------------------------------------------------------------------------
    async def accumulate(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                         concurrency: int = 4) -> list[float]:
        """Forward and backward every microbatch through the swarm; gradients of the mean loss
        accumulate here and on the stage peers. Returns each microbatch's loss."""
        gate = asyncio.Semaphore(concurrency)
        scale = 1.0 / len(batches)

        async def one(x: torch.Tensor, y: torch.Tensor) -> float:
            async with gate:
                return await self._microbatch(x, y, scale)

        return list(await asyncio.gather(*(one(x, y) for x, y in batches)))

    async def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                         concurrency: int = 4) -> float:
        """``accumulate``, then step everyone (stage peers on the next request they get)."""
        losses = await self.accumulate(batches, concurrency)
        await self._run(self.optimizer.step)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1  # stage peers apply their update when they see the new step
        loss = sum(losses) / len(losses)
        self.stats.losses.append(loss)
        return loss

    async def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss on ``batches`` (forward only; stage peers keep nothing)."""
        losses = []
        for x, y in batches:
            with torch.no_grad():
                out, _ = await self._forward(x, eval_only=True)
                logits = self.head(out)
                losses.append(float(self.head.loss(logits, y)))
        return sum(losses) / len(losses)

    async def _microbatch(self, x: torch.Tensor, y: torch.Tensor, scale: float) -> float:
        failures, tries, patience = 0, 0, time.monotonic() + MISSING_STAGE_PATIENCE_S
        while failures < MAX_RESTARTS:
            if tries:
                self.stats.restarted += 1
            tries += 1
            try:
                loss, grads = await self._attempt(x, y, scale)
            except (TransportError, StageUnavailable, TimeoutError) as exc:
                if _stage_unavailable(exc) and time.monotonic() < patience:
                    # a stage has no peer that takes work right now: wait, do not give up
                    log.warning("a stage is unavailable (%s): waiting, then restarting", exc)
                    await asyncio.sleep(1.0)
                    continue
                log.info("microbatch failed (%s): restarting it", exc)
                failures += 1
                continue
            for p, g in zip(self.params, grads):  # only now: a restart never counts twice
                p.grad = g if p.grad is None else p.grad + g
            self.stats.microbatches += 1
            self.stats.tokens += x.numel()
            return loss
        self.stats.lost += 1
        raise StageUnavailable(f"a microbatch failed {MAX_RESTARTS} times in a row")

    async def _attempt(self, x: torch.Tensor, y: torch.Tensor, scale: float
                       ) -> tuple[float, list[torch.Tensor]]:
        h = self.embedding(x)  # (B, T, width), keeps its graph
        out, mb = await self._forward(x, eval_only=False, h=h)
        path = self._paths.pop(mb)
        out = out.detach().requires_grad_(True)
        logits = self.head(out)
        loss = self.head.loss(logits, y)
        head_params = list(self.head.parameters())
        g_out, *g_head = torch.autograd.grad(loss * scale, [out, *head_params])
        grad_future = self._expect("grad", mb)
        try:
            await self.host.request(path[-1], self.proto["backward"], Message(
                kind="backward", meta=self._meta(mb, self.num_stages - 1, path),
                tensors=(g_out,)), codec=self.codec, timeout=HOP_TIMEOUT_S)
            g_h = await asyncio.wait_for(grad_future, HOP_TIMEOUT_S)
        finally:
            self._waiting.pop(("grad", mb), None)
        g_emb = torch.autograd.grad(h, list(self.embedding.parameters()), g_h)
        return float(loss.detach()), [*g_emb, *g_head]

    async def _forward(self, x: torch.Tensor, *, eval_only: bool,
                       h: torch.Tensor | None = None) -> tuple[torch.Tensor, str]:
        if h is None:
            h = self.embedding(x)
        self._counter += 1
        mb = f"{self.host.peer_id[-10:]}/{self._counter}"
        future = self._expect("result", mb)
        meta = self._meta(mb, 0, [])
        if eval_only:
            meta["eval"] = True
        try:
            await self._send_stage0(Message(kind="forward", meta=meta, tensors=(h.detach(),)))
            return await asyncio.wait_for(future, HOP_TIMEOUT_S), mb
        finally:
            self._waiting.pop(("result", mb), None)

    async def _send_stage0(self, message: Message) -> None:
        waited = 0.0
        while True:
            peers = self.peers_of(0)
            self.wiring.update_peers({p: (v[0], v[1]) for p, v in peers.items()}, time.time())
            missing = [s for s in range(self.num_stages) if not self.peers_of(s)]
            if missing or not peers:
                self.stats.missing_stage = missing[0] if missing else 0
                if waited >= MISSING_STAGE_PATIENCE_S:
                    raise StageUnavailable(f"stage {self.stats.missing_stage} has no peer")
                if waited == 0:
                    log.warning("waiting: stage %s has no live peer", self.stats.missing_stage)
                await asyncio.sleep(1.0)
                waited += 1.0
                continue
            self.stats.missing_stage = None
            target = self.wiring.choose("forward", int(x_rows(message)), time.time(), self._rng)
            if target is None:
                await asyncio.sleep(min(1.0, max(0.05, (self.wiring.earliest_unban() or 0)
                                                 - time.time())))
                continue
            t0 = time.perf_counter()
            try:
                await self.host.ensure_connected(target, peers[target][2])
                await self.host.request(target, self.proto["forward"], message,
                                        codec=self.codec, timeout=HOP_TIMEOUT_S)
            except RemoteError as exc:
                if exc.code == "stage_unavailable":  # a later stage failed: count, restart
                    raise
                self.wiring.error(target, time.time())
                self.stats.rerouted += 1
            except TransportError:
                self.wiring.error(target, time.time())
                self.stats.rerouted += 1
            else:
                self.wiring.success(target, x_rows(message), time.perf_counter() - t0,
                                    "forward", time.time())
                return

    def _expect(self, kind: str, mb: str) -> asyncio.Future[torch.Tensor]:
        future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        self._waiting[(kind, mb)] = future
        return future

    def _meta(self, mb: str, stage: int, path: list[str]) -> dict[str, Any]:
        return {"mb": mb, "stage": stage, "step": self.step, "path": path,
                "trainer": self.host.peer_id, "trainer_addrs": list(self.host.addrs)[:4],
                "model": self.model_hash}

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)


def _stage_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, StageUnavailable) or (
        isinstance(exc, RemoteError) and exc.code == "stage_unavailable")


def x_rows(message: Message) -> int:
    return int(message.tensors[0].shape[0])
