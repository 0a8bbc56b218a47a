"""The trainer: embeddings, head and loss, and the microbatches it sends through the swarm.

For each microbatch: embed (B, T) bytes, send the activations to a stage-0 peer chosen by
``Wiring`` (another one if it fails: ``rerouted``); the chain ends with the last stage's
``result`` arriving here; compute the loss and its gradient, send it back along the recorded
path; stage 0's ``grad`` finishes the embedding's backward. A microbatch whose chain breaks in
a way no hop could route around (a peer holding its activations died) is run again from the
start (``restarted``). Gradients are added to the parameters only once a microbatch has fully
succeeded, so a restart never counts twice. ``lost`` counts microbatches given up; while some
stage has no peer the trainer waits and says which.

Gradients are sums over samples everywhere (each microbatch's mean loss is scaled by its
sample count): a stage peer divides by the samples it accumulated and its stage averages those
means weighted by samples (``swarmd.averaging.stage_sync``); the trainer divides by its step's samples.
Either way the step applies the mean gradient over the samples, as one process would.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import torch

from swarmd.errors import BadActivation, StageUnavailable
from swarmd.training.model import wire_tensor
from swarmd.training.optim import make_optimizer
from swarmd.pipeline.server import HOP_TIMEOUT_S, hop_seconds, protocols
from swarmd.pipeline.wiring import Wiring
from transport.errors import RemoteError, TransportError
from transport.frames import Message

log = logging.getLogger("swarmd.pipeline.trainer")

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
    #: per stage, how many microbatches each peer served (route statistics)
    routes: list[Counter[str]] = field(default_factory=list)

    def peers_used(self) -> list[int]:
        """Distinct peers each stage's microbatches went through so far."""
        return [len(r) for r in self.routes]


class Trainer:
    """``peers_of(stage)`` returns {peer_id: (throughput, queue, addrs)} from membership."""

    def __init__(self, host: Any, *, swarm: str, num_stages: int, model_config: Any,
                 model_hash: str, codec: Any, lr: float, seed: int,
                 peers_of: Callable[[int], dict[str, tuple[float, int, tuple[str, ...]]]],
                 rng: random.Random | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, optimizer: str = "adamw") -> None:
        from swarmd.training.model import build_embedding, build_head

        self.host = host
        self.num_stages = num_stages
        self.model_hash = model_hash
        self.codec = codec
        self.proto = protocols(swarm)
        self.peers_of = peers_of
        self.device, self.dtype = torch.device(device), dtype
        self.embedding = build_embedding(model_config, seed, device=device, dtype=dtype)
        self.head = build_head(model_config, seed, device=device, dtype=dtype)
        self.params = [*self.embedding.parameters(), *self.head.parameters()]
        self.optimizer = make_optimizer(optimizer, self.params, lr)
        self.step = 0
        self.stats = TrainStats()
        self.wiring = Wiring()
        self._rng = rng or random.Random()
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="trainer-compute")
        self._waiting: dict[tuple[str, str], asyncio.Future[torch.Tensor]] = {}
        self._paths: dict[str, list[str]] = {}
        self._counter = 0
        #: sends whose answer already arrived, finishing in the background
        self._late: set[asyncio.Future[Any]] = set()

    def start(self) -> None:
        self.host.set_request_handler(self.proto["result"], self._on_arrival)
        self.host.set_request_handler(self.proto["grad"], self._on_arrival)

    def close(self) -> None:
        for sender in self._late:
            sender.cancel()
        self._compute.shutdown(wait=True, cancel_futures=True)

    # ---- arrivals from the swarm -----------------------------------------------------------
    async def _on_arrival(self, message: Message, peer: str) -> Message:
        mb = message.meta.get("mb")
        future = self._waiting.get((message.kind, mb)) if isinstance(mb, str) else None
        if future is None or len(message.tensors) != 1:
            return Message(kind="ok", meta={"late": True})  # a restarted microbatch's leftover
        if message.kind == "result":
            path = message.meta.get("path")
            if (not isinstance(path, list) or len(path) != self.num_stages
                    or not all(isinstance(p, str) for p in path)):
                raise BadActivation("path", f"a result's path must name {self.num_stages} "
                                            f"peers, one per stage")
            self._paths[mb] = path
        if not future.done():
            future.set_result(message.tensors[0])
        return Message(kind="ok")

    # ---- one step ---------------------------------------------------------------------------
    async def accumulate(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                         concurrency: int = 4) -> list[float]:
        """Forward and backward every microbatch through the swarm; gradients of the mean loss
        accumulate here and on the stage peers. Returns each microbatch's loss."""
        gate = asyncio.Semaphore(concurrency)

        async def one(x: torch.Tensor, y: torch.Tensor) -> float:
            async with gate:  # gradients are sums over samples everywhere (see the module doc)
                return await self._microbatch(x, y, float(x.shape[0]))

        return list(await asyncio.gather(*(one(x, y) for x, y in batches)))

    async def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                         concurrency: int = 4) -> float:
        """``accumulate``, then step the embedding and head (stage peers step on their own
        once their stage holds ``averaging.target_batch_size`` samples)."""
        losses = await self.accumulate(batches, concurrency)
        await self._run(self._step, sum(int(x.shape[0]) for x, _ in batches))
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        loss = sum(losses) / len(losses)
        self.stats.losses.append(loss)
        return loss

    async def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss on ``batches`` (forward only; stage peers keep nothing)."""
        losses = []
        for x, y in batches:
            h = await self._run(self._embed, x, False)
            out, _ = await self._forward(h, eval_only=True)
            losses.append(await self._run(self._eval_loss, out, y))
        return sum(losses) / len(losses)

    async def _microbatch(self, x: torch.Tensor, y: torch.Tensor, scale: float) -> float:
        failures, tries, patience = 0, 0, time.monotonic() + MISSING_STAGE_PATIENCE_S
        while failures < MAX_RESTARTS:
            if tries:
                self.stats.restarted += 1
            tries += 1
            try:
                loss, grads, path = await self._attempt(x, y, scale)
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
            self._route(path)
            return loss
        self.stats.lost += 1
        raise StageUnavailable(f"a microbatch failed {MAX_RESTARTS} times in a row")

    def _route(self, path: list[str]) -> None:
        while len(self.stats.routes) < len(path):
            self.stats.routes.append(Counter())
        for stage, peer in enumerate(path):
            self.stats.routes[stage][peer] += 1

    async def _attempt(self, x: torch.Tensor, y: torch.Tensor, scale: float
                       ) -> tuple[float, list[torch.Tensor], list[str]]:
        h = await self._run(self._embed, x, True)  # (B, T, width), keeps its graph
        out, mb = await self._forward(h, eval_only=False)
        path = self._paths.pop(mb)
        loss, g_out, g_head = await self._run(self._head_backward, out, y, scale)
        grad_future = self._expect("grad", mb)
        try:
            g_h = await self._sent_then_arrived(self.host.request(
                path[-1], self.proto["backward"], Message(
                    kind="backward", meta=self._meta(mb, self.num_stages - 1, path),
                    tensors=(g_out,)), codec=self.codec, timeout=HOP_TIMEOUT_S), grad_future)
        finally:
            self._waiting.pop(("grad", mb), None)
        g_emb = await self._run(self._embed_backward, h, g_h)
        return loss, [*g_emb, *g_head], path

    # ---- compute (in the compute thread, never on the event loop) ----------------------------
    def _step(self, samples: int) -> None:
        for p in self.params:  # the sums over samples become the batch's mean gradient
            if p.grad is not None:
                p.grad /= samples
        self.optimizer.step()

    def _embed(self, x: torch.Tensor, grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            return self.embedding(x.to(self.device))

    def _head_backward(self, out: torch.Tensor, y: torch.Tensor, scale: float
                       ) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
        out = out.to(self.device, self.dtype).requires_grad_(True)
        loss = self.head.loss(self.head(out), y.to(self.device))
        g_out, *g_head = torch.autograd.grad(loss * scale, [out, *self.head.parameters()])
        return float(loss.detach()), wire_tensor(g_out), g_head

    def _eval_loss(self, out: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            out = out.to(self.device, self.dtype)
            return float(self.head.loss(self.head(out), y.to(self.device)))

    def _embed_backward(self, h: torch.Tensor, g_h: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.autograd.grad(h, list(self.embedding.parameters()),
                                        g_h.to(self.device, h.dtype)))

    # ---- the network -----------------------------------------------------------------------
    async def _forward(self, h: torch.Tensor, *, eval_only: bool) -> tuple[torch.Tensor, str]:
        self._counter += 1
        mb = f"{self.host.peer_id[-10:]}/{self._counter}"
        future = self._expect("result", mb)
        meta = self._meta(mb, 0, [])
        if eval_only:
            meta["eval"] = True
        try:
            sent = self._send_stage0(Message(kind="forward", meta=meta,
                                             tensors=(wire_tensor(h.detach()),)))
            return await self._sent_then_arrived(sent, future), mb
        finally:
            self._waiting.pop(("result", mb), None)

    async def _sent_then_arrived(self, send: Awaitable[Any],
                                 arrival: asyncio.Future[torch.Tensor]) -> torch.Tensor:
        """Send, and return what arrives in answer. The arrival usually beats the sender's
        ``ok`` (which comes back up the whole chain), so it is not waited for: a send that
        fails before anything arrived raises; one that fails after is of no consequence."""
        sender = asyncio.ensure_future(send)
        try:
            async with asyncio.timeout(HOP_TIMEOUT_S):
                await asyncio.wait((sender, arrival), return_when=asyncio.FIRST_COMPLETED)
                if not arrival.done():
                    sender.result()  # raises when the send failed
                    return await arrival
        except BaseException:
            sender.cancel()
            raise
        if not sender.done():
            self._late.add(sender)
            sender.add_done_callback(_finish_late(self._late))
        return arrival.result()

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
                reply = await self.host.request(target, self.proto["forward"], message,
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
                self.wiring.success(target, x_rows(message),
                                    hop_seconds(reply, time.perf_counter() - t0), "forward",
                                    time.time())
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



def _finish_late(late: set[asyncio.Future[Any]]) -> Callable[[asyncio.Future[Any]], None]:
    def done(sender: asyncio.Future[Any]) -> None:
        late.discard(sender)
        if not sender.cancelled() and sender.exception() is not None:
            log.debug("a send failed after its answer arrived: %s", sender.exception())
    return done
