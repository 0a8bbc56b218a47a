"""The stage server in the daemon: forward and backward for this peer's stage over libp2p.

Protocol (docs/pipeline.md): a ``forward`` arrives with activations; the ``StageWorker`` runs the
blocks in the compute thread; the output goes directly to a peer of the next stage chosen by
``Wiring`` (retried on another peer of that stage when a hop fails: ``rerouted``), or, from the
last stage, to the trainer as a ``result``. The reply ``ok`` travels back up the chain once the
rest of it accepted. A ``backward`` walks the recorded path in reverse the same way; stage 0
sends the input gradient to the trainer as ``grad``.

The asyncio loop never runs torch: the worker runs in one compute thread, whose single-slot
executor is the queue that backpressure starts from (a full worker answers ``busy``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from swarmd.errors import BadActivation, ModelMismatch, StageBusy, StageUnavailable, WrongStage
from swarmd.stage_worker import StageWorker
from swarmd.wiring import Wiring
from transport.errors import RemoteError, TransportError
from transport.frames import Message

log = logging.getLogger("swarmd.stage")

#: requests waiting for or in compute; more are refused with ``busy`` (the sender reroutes)
MAX_QUEUE = 16
#: how many peers of the next stage a hop tries before giving up
HOP_ATTEMPTS = 4
HOP_TIMEOUT_S = 60.0
THROUGHPUT_EMA = 0.2


def protocols(swarm: str) -> dict[str, str]:
    return {kind: f"/swarmd/{swarm}/1/{kind}"
            for kind in ("forward", "backward", "result", "grad")}


class StageServer:
    """Serves one stage. ``peers_of(stage)`` returns {peer_id: (throughput, queue, addrs)}."""

    def __init__(self, host: Any, *, swarm: str, stage: int, num_stages: int,
                 model_config: Any, model_hash: str, codec: Any, lr: float, seed: int,
                 peers_of: Callable[[int], dict[str, tuple[float, int, tuple[str, ...]]]],
                 max_tokens: int, rng: random.Random | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        from swarmd.model import build_stage

        self.host = host
        self.stage = stage
        self.num_stages = num_stages
        self.model_hash = model_hash
        self.codec = codec
        self.proto = protocols(swarm)
        self.peers_of = peers_of
        self.module = build_stage(model_config, stage, num_stages, seed, device=device,
                                  dtype=dtype)
        self.worker = StageWorker(self.module, width=model_config.width, max_tokens=max_tokens,
                                  device=device, dtype=dtype)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr)
        self.step = 0
        self.wiring = Wiring()
        self.counters: dict[str, int] = {"forward": 0, "backward": 0, "rerouted": 0,
                                         "optimizer_steps": 0}
        #: samples per second through this stage's compute (EMA), announced in membership
        self.throughput = 0.0
        self._rng = rng or random.Random()
        self._compute = ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}-compute")
        self._step_lock = asyncio.Lock()
        self._queued = 0

    def start(self) -> None:
        self.host.set_request_handler(self.proto["forward"], self._on_forward)
        self.host.set_request_handler(self.proto["backward"], self._on_backward)

    def close(self) -> None:
        self.host.remove_handler(self.proto["forward"])
        self.host.remove_handler(self.proto["backward"])
        self._compute.shutdown(wait=True, cancel_futures=True)

    @property
    def queue(self) -> int:
        """Requests waiting for or in compute (what membership announces as queue length)."""
        return self._queued

    # ---- handlers ------------------------------------------------------------------------
    async def _on_forward(self, message: Message, peer: str) -> Message:
        meta = self._check(message, "forward")
        await self._advance(meta["step"])
        (x,) = message.tensors
        mb = meta["mb"]
        t0 = time.perf_counter()
        if meta.get("eval"):
            y = await self._run(self.worker.infer, x, admit=True)
        else:
            y = await self._run(self.worker.forward, mb, x, time.time(), admit=True)
            self._measured(x.shape[0], time.perf_counter() - t0)
        self.counters["forward"] += 1
        path = [*meta["path"], self.host.peer_id]
        out_meta = {**meta, "path": path, "stage": self.stage + 1}
        try:
            if self.stage == self.num_stages - 1:
                await self._to_trainer(meta, "result", Message(
                    kind="result", meta={"mb": mb, "path": path}, tensors=(y,)))
            else:
                await self._hop(self.stage + 1, "forward",
                                Message(kind="forward", meta=out_meta, tensors=(y,)))
        except BaseException:
            self.worker.forget(mb)  # the chain failed below us: nobody will come back
            raise
        return Message(kind="ok")

    async def _on_backward(self, message: Message, peer: str) -> Message:
        meta = self._check(message, "backward")
        (grad,) = message.tensors
        gx = await self._run(self.worker.backward, meta["mb"], grad, time.time())
        self.counters["backward"] += 1
        if self.stage == 0:
            await self._to_trainer(meta, "grad", Message(kind="grad", meta={"mb": meta["mb"]},
                                                         tensors=(gx,)))
        else:
            previous = meta["path"][self.stage - 1]
            await self.host.request(previous, self.proto["backward"], Message(
                kind="backward", meta={**meta, "stage": self.stage - 1}, tensors=(gx,)),
                codec=self.codec, timeout=HOP_TIMEOUT_S)
        return Message(kind="ok")

    # ---- helpers ---------------------------------------------------------------------------
    def _check(self, message: Message, kind: str) -> dict[str, Any]:
        meta = dict(message.meta)
        if message.kind != kind or len(message.tensors) != 1:
            raise BadActivation("malformed", f"a {kind} carries exactly one tensor")
        for key, typ in (("mb", str), ("stage", int), ("step", int), ("path", list),
                         ("trainer", str), ("model", str)):
            if not isinstance(meta.get(key), typ):
                raise BadActivation("malformed", f"{kind} meta {key!r} missing or not "
                                                 f"{typ.__name__}")
        if meta["model"] != self.model_hash:
            raise ModelMismatch(f"this peer trains model {self.model_hash}, the request is for "
                             f"{meta['model']}")
        if meta["stage"] != self.stage:
            raise WrongStage(f"this peer serves stage {self.stage}, not {meta['stage']}")
        if kind == "backward" and (len(meta["path"]) != self.num_stages
                                   or meta["path"][self.stage] != self.host.peer_id):
            raise BadActivation("path", "the backward path does not lead through this peer")
        return meta

    async def _run(self, fn: Callable[..., Any], *args: Any, admit: bool = False) -> Any:
        """Run ``fn`` in the compute thread. With ``admit`` (new forwards), a full queue
        refuses instead of growing; backward and optimizer steps always get through, since
        they free memory and cannot be routed elsewhere."""
        if admit and self._queued >= MAX_QUEUE:
            self.counters["busy"] = self.counters.get("busy", 0) + 1
            raise StageBusy(f"{MAX_QUEUE} requests already wait for compute here")
        self._queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)
        finally:
            self._queued -= 1

    def _measured(self, samples: int, seconds: float) -> None:
        rate = samples / max(seconds, 1e-6)
        self.throughput = rate if self.throughput == 0 else (
            (1 - THROUGHPUT_EMA) * self.throughput + THROUGHPUT_EMA * rate)

    async def _advance(self, step: int) -> None:
        """The trainer moved to ``step``: apply what was accumulated for earlier steps."""
        if step <= self.step:
            return
        async with self._step_lock:
            if step <= self.step:
                return
            if self.worker.samples_accumulated:
                await self._run(self._optimizer_step)
                self.counters["optimizer_steps"] += 1
            self.step = step

    def _optimizer_step(self) -> None:
        self.optimizer.step()
        self.worker.zero_grad()

    async def _hop(self, stage: int, kind: str, message: Message) -> None:
        """Send to a peer of ``stage``, rerouting to another peer when one fails."""
        tried: set[str] = set()
        peers = self.peers_of(stage)
        # every peer, every time: a peer left out of update_peers would lose its ban
        self.wiring.update_peers({p: (v[0], v[1]) for p, v in peers.items()}, time.time())
        for attempt in range(HOP_ATTEMPTS):
            target = self.wiring.choose(kind, int(message.tensors[0].shape[0]), time.time(),
                                        self._rng) if peers else None
            if target is None or target in tried:  # the failed ones are banned now
                break
            tried.add(target)
            if attempt:
                self.counters["rerouted"] += 1
            t0 = time.perf_counter()
            try:
                await self.host.ensure_connected(target, peers[target][2])
                await self.host.request(target, self.proto[kind], message, codec=self.codec,
                                        timeout=HOP_TIMEOUT_S)
            except RemoteError as exc:
                if exc.code in ("bad_activation", "malformed_frame", "codec_error"):
                    raise  # our own output is bad: another peer would refuse it too
                self.wiring.error(target, time.time())
                log.info("stage %d peer %s refused %s (%s): rerouting", stage, target, kind,
                         exc.code)
            except TransportError as exc:
                self.wiring.error(target, time.time())
                log.info("stage %d peer %s failed %s: %s; rerouting", stage, target, kind, exc)
            else:
                self.wiring.success(target, int(message.tensors[0].shape[0]),
                                    time.perf_counter() - t0, kind, time.time())
                return
        raise StageUnavailable(f"no peer of stage {stage} took the {kind} "
                               f"(tried {len(tried)})")

    async def _to_trainer(self, meta: dict[str, Any], kind: str, message: Message) -> None:
        await self.host.ensure_connected(meta["trainer"], meta.get("trainer_addrs", ()))
        await self.host.request(meta["trainer"], self.proto[kind], message, codec=self.codec,
                                timeout=HOP_TIMEOUT_S)
