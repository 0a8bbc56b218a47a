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
import hashlib
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch

from swarmd.averaging.allreduce import Averager
from swarmd.errors import BadActivation, ModelMismatch, StageBusy, StageUnavailable, WrongStage
from swarmd.training.optim import make_optimizer
from swarmd.averaging.trigger import RoundTrigger
from swarmd.averaging.stage_sync import StageSync, SyncSettings
from swarmd.pipeline.worker import StageWorker
from swarmd.pipeline.wiring import Wiring
from transport.errors import RemoteError, TransportError
from transport.frames import Message
from swarmd.protocols import Protocols

log = logging.getLogger("swarmd.stage")

#: requests waiting for or in compute; more are refused with ``busy`` (the sender reroutes)
MAX_QUEUE = 16
#: how many peers of the next stage a hop tries before giving up
HOP_ATTEMPTS = 4
HOP_TIMEOUT_S = 60.0
#: a step waits at most this long for the microbatches in flight here
DRAIN_S = 20.0
#: most microbatches forwarded as one batch
MAX_BATCH = 8
#: how long a batched microbatch's backward waits for the rest of its batch
JOIN_WAIT_S = 2.0
DRAIN_POLL_S = 0.002
#: weight of each new measurement in the throughput average: slow, because the balancer
#: compares stage totals made of these and must not chase noise
THROUGHPUT_EMA = 0.05


def hop_seconds(reply: Message, round_trip_s: float) -> float:
    """What a hop cost the peer it went to: its queue and compute (``service_s`` in its
    reply) plus the transfer (the round trip less the time it held the request, which
    includes the rest of the chain). The round trip when the reply says nothing usable."""
    service, held = reply.meta.get("service_s"), reply.meta.get("held_s")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e6
               for v in (service, held)) or service > held or held > round_trip_s:
        return round_trip_s
    return float(service) + (round_trip_s - float(held))


def protocols(swarm: str) -> dict[str, str]:
    return Protocols(swarm).pipeline()


class StageServer:
    """Serves one stage. ``peers_of(stage)`` returns {peer_id: (throughput, queue, addrs)}."""

    def __init__(self, host: Any, *, swarm: str, stage: int, num_stages: int,
                 model_config: Any, model_hash: str, codec: Any, lr: float, seed: int,
                 peers_of: Callable[[int], dict[str, tuple[float, int, tuple[str, ...]]]],
                 max_tokens: int, rng: random.Random | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 optimizer: str = "adamw", target_batch_size: int = 1,
                 averager: Averager | None = None, sync: SyncSettings = SyncSettings(),
                 on_behind: Callable[[str, int], None] | None = None,
                 module: torch.nn.Module | None = None, max_batch: int = 1) -> None:
        from swarmd.training.model import build_stage

        self.host = host
        self.stage = stage
        self.num_stages = num_stages
        self.model_hash = model_hash
        self.codec = codec
        self.proto = protocols(swarm)
        self.peers_of = peers_of
        self.module = module if module is not None else build_stage(
            model_config, stage, num_stages, seed, device=device, dtype=dtype)
        self.worker = StageWorker(self.module, width=model_config.width, max_tokens=max_tokens,
                                  device=device, dtype=dtype)
        self.optimizer = make_optimizer(optimizer, self.module.parameters(), lr)
        self._params = [p for p in self.module.parameters() if p.requires_grad]
        self.wiring = Wiring()
        self.counters: dict[str, int] = {"forward": 0, "backward": 0, "rerouted": 0,
                                         "optimizer_steps": 0}
        #: samples per second through this stage's compute (EMA), announced in membership
        self.throughput = 0.0
        self._rng = rng or random.Random()
        self._compute = ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}-compute")
        self._queued = 0
        self._admitted = 0
        self._retiring = False
        #: forwards waiting to be batched, the task that batches them, backward waiting for
        #: the rest of their batch, and small tasks this server owns
        self._pending: list[tuple[str, torch.Tensor, asyncio.Future[Any]]] = []
        self._batcher: asyncio.Task[None] | None = None
        self._joined: dict[str, asyncio.Future[torch.Tensor]] = {}
        self._tasks: set[asyncio.Future[Any]] = set()
        #: most microbatches run as one batch (1: no batching; see ``serving.batch_forwards``)
        self.max_batch = max(1, min(max_batch, MAX_BATCH))
        #: closed while a step waits for the microbatches in flight here to finish backward
        self._open = asyncio.Event()
        self._open.set()
        self.sync = StageSync(
            host, swarm=swarm, stage=stage, averager=averager, settings=sync,
            trigger=RoundTrigger(me=host.peer_id, target=max(1, target_batch_size)),
            mates=lambda: {p: v[2] for p, v in self.peers_of(stage).items()
                           if p != host.peer_id},
            snapshot=lambda: self._run(self._take_gradient),
            apply=self._apply_when_drained,
            give_back=lambda vector, samples: self._run(self._give_back, vector, samples),
            on_behind=on_behind or (lambda peer, step: None),
            samples_now=lambda: self.worker.samples_accumulated,
            on_stepped=lambda: self.on_stepped(),
            step_alone=lambda: self.when_drained(self._step_alone))
        #: called after every step (the keeper saves checkpoints from here)
        self.on_stepped: Callable[[], None] = lambda: None

    def start(self) -> None:
        self.host.set_request_handler(self.proto["forward"], self._on_forward)
        self.host.set_request_handler(self.proto["backward"], self._on_backward)
        self.sync.start()

    async def retire(self, timeout_s: float = DRAIN_S) -> int:
        """Stop taking new microbatches and let those in flight here finish their backward
        (at most ``timeout_s``); returns how many did not (their senders restart them)."""
        self._retiring = True
        await self._drain(timeout_s)
        return self.worker.saved

    async def _drain(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until no microbatch here waits for its backward and
        none is between the gate and its forward."""
        deadline = time.monotonic() + timeout_s
        while (self.worker.saved or self._admitted) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)

    async def close(self) -> None:
        self.host.remove_handler(self.proto["forward"])
        self.host.remove_handler(self.proto["backward"])
        await self.sync.close()
        for task in [*self._tasks, *([self._batcher] if self._batcher else [])]:
            task.cancel()
        self._compute.shutdown(wait=True, cancel_futures=True)

    @property
    def step(self) -> int:
        """Optimizer steps this stage has taken (agreed among its peers)."""
        return self.sync.step

    @property
    def queue(self) -> int:
        """Requests waiting for or in compute (what membership announces as queue length)."""
        return self._queued + len(self._pending)

    # ---- handlers ------------------------------------------------------------------------
    async def _on_forward(self, message: Message, peer: str) -> Message:
        meta = self._check(message, "forward")
        (x,) = message.tensors
        if not meta.get("eval"):
            await self._open.wait()  # not while a step waits to change the weights
            self.worker.expire(time.time())
        if self._retiring:  # checked after the gate too: retiring may begin while we wait
            raise StageBusy(f"this peer is leaving stage {self.stage}: route elsewhere")
        mb = meta["mb"]
        t0 = time.perf_counter()
        if meta.get("eval"):
            y = await self._run(self.worker.infer, x, admit=True)
        else:
            self._admitted += 1  # past the gate, not saved yet: a step must wait for it too
            try:
                y, compute_s = await self._forward_batched(mb, x)
            finally:
                self._admitted -= 1
            self._measured(x.shape[0], compute_s)  # capacity: compute alone, not the queue
        service_s = time.perf_counter() - t0
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
        # the sender's wiring should judge this peer by its own queue and compute, not by the
        # rest of the chain the ok waited for
        return Message(kind="ok", meta={"service_s": service_s,
                                        "held_s": time.perf_counter() - t0})

    async def _on_backward(self, message: Message, peer: str) -> Message:
        meta = self._check(message, "backward")
        (grad,) = message.tensors
        gx = await self._backward_joined(meta["mb"], grad)
        self.counters["backward"] += 1
        self.sync.progressed(self.worker.samples_accumulated)
        if self.stage == 0:
            await self._to_trainer(meta, "grad", Message(kind="grad", meta={"mb": meta["mb"]},
                                                         tensors=(gx,)))
        else:
            previous = meta["path"][self.stage - 1]
            await self.host.request(previous, self.proto["backward"], Message(
                kind="backward", meta={**meta, "stage": self.stage - 1}, tensors=(gx,)),
                codec=self.codec, timeout=HOP_TIMEOUT_S)
        return Message(kind="ok")

    # ---- batching (docs/pipeline.md, "Batching") -----------------------------------------------
    async def _forward_batched(self, mb: str, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Forward ``mb``, batched with the others of its sequence length that queue up while
        the compute thread is busy; returns its output and its share of the compute time."""
        if self._queued + len(self._pending) >= MAX_QUEUE:
            self.counters["busy"] = self.counters.get("busy", 0) + 1
            raise StageBusy(f"{MAX_QUEUE} requests already wait for compute here")
        future: asyncio.Future[tuple[torch.Tensor, float]] = \
            asyncio.get_running_loop().create_future()
        self._pending.append((mb, x, future))
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._run_batches())
        return await future

    async def _run_batches(self) -> None:
        while self._pending:
            length = int(self._pending[0][1].shape[1])
            take, rest, tokens = [], [], 0
            for item in self._pending:
                n = int(item[1].shape[0]) * length
                if int(item[1].shape[1]) == length and tokens + n <= self.worker.max_tokens \
                        and len(take) < self.max_batch:
                    take.append(item)
                    tokens += n
                else:
                    rest.append(item)
            self._pending = rest
            try:
                results = await self._run(self._forward_batch, [(m, x) for m, x, _ in take])
            except BaseException as exc:  # the executor is gone (closing): fail them all
                results = [exc] * len(take)
            for (_, _, future), result in zip(take, results):
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            if len(take) > 1:
                self.counters["batched_forwards"] = (self.counters.get("batched_forwards", 0)
                                                     + len(take))

    def _forward_batch(self, items: list[tuple[str, torch.Tensor]]) -> list[Any]:
        """In the compute thread: check each, run those that pass as one batch."""
        results: list[Any] = [None] * len(items)
        ok = []
        for i, (mb, x) in enumerate(items):
            try:
                self.worker.check_forward(mb, x)
                ok.append(i)
            except Exception as exc:  # that microbatch's sender gets the typed error
                results[i] = exc
        if ok:
            t0 = time.perf_counter()
            try:
                ys = self.worker.forward_many([items[i] for i in ok], time.time())
            except Exception as exc:
                for i in ok:
                    results[i] = exc
                return results
            seconds = time.perf_counter() - t0
            rows = sum(int(items[i][1].shape[0]) for i in ok)
            for i, y in zip(ok, ys):
                results[i] = (y, seconds * int(items[i][1].shape[0]) / rows)
        return results

    async def _backward_joined(self, mb: str, grad: torch.Tensor) -> torch.Tensor:
        """Backward of ``mb``; a microbatch forwarded in a batch waits (at most ``JOIN_WAIT_S``)
        for the rest of its batch, so the batch is back-propagated once."""
        done = await self._run(self.worker.backward_joined, mb, grad, time.time())
        if done is None:
            future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
            self._joined[mb] = future
            timer = asyncio.get_running_loop().call_later(
                JOIN_WAIT_S, lambda: self._spawn(self._finish_batch(mb)))
            try:
                return await future
            finally:
                timer.cancel()
                self._joined.pop(mb, None)
        self._deliver(done)
        return done[mb]

    async def _finish_batch(self, mb: str) -> None:
        if self.worker.waiting(mb):
            self.counters["batches_finished_short"] = (
                self.counters.get("batches_finished_short", 0) + 1)
            self._deliver(await self._run(self.worker.finish, mb))

    def _deliver(self, done: dict[str, torch.Tensor]) -> None:
        for other, g in done.items():
            future = self._joined.get(other)
            if future is not None and not future.done():
                future.set_result(g)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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

    # ---- the optimizer step (in the compute thread) -----------------------------------------
    def _take_gradient(self) -> tuple[torch.Tensor, int]:
        """This peer's mean gradient (flat float32) and its samples; the accumulation restarts."""
        samples = self.worker.samples_accumulated
        vector = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                            .reshape(-1).to("cpu", torch.float32) for p in self._params])
        if samples:
            vector /= samples
        self.worker.zero_grad()
        return vector, samples

    async def _apply_when_drained(self, vector: torch.Tensor) -> None:
        await self.when_drained(self._apply_gradient, vector)

    async def run_exclusive(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` in the compute thread, between two steps (to read the state)."""
        return await self._run(fn, *args)

    def params_fingerprint(self) -> tuple[str, float]:
        """(blake2b-128 of the parameters' bytes, their L2 norm): equal weights, equal digest."""
        h = hashlib.blake2b(digest_size=16)
        total = 0.0
        with torch.no_grad():
            for p in self.module.parameters():
                data = p.detach().to("cpu").clone()  # its own storage, offset 0
                h.update(bytes(data.untyped_storage()))
                total += float(data.float().pow(2).sum())
        return h.hexdigest(), total ** 0.5

    def took_state(self, step: int) -> None:
        """The weights and optimizer were replaced by a state at ``step``."""
        self.sync.took_state(step, self.worker.samples_accumulated)

    async def when_drained(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` (which changes the weights) once no microbatch waits here for its
        backward.

        The optimizer changes the weights in place, and a microbatch's backward needs the
        weights its forward used. So new forwards wait (``_open``) while the ones in flight
        finish, for at most ``DRAIN_S``; those still missing then are dropped (their backward
        gets ``unknown_microbatch`` and the trainer restarts them)."""
        self._open.clear()
        try:
            await self._drain(DRAIN_S)
            if self.worker.saved:
                dropped = self.worker.expire(float("inf"))
                self.counters["dropped_for_step"] = (self.counters.get("dropped_for_step", 0)
                                                     + len(dropped))
                log.warning("stage %d: %d microbatch(es) did not come back within %.0f s; "
                            "dropped before the step", self.stage, len(dropped), DRAIN_S)
            return await self._run(fn, *args)
        finally:
            self._open.set()

    def _apply_gradient(self, vector: torch.Tensor) -> None:
        """Step with ``vector`` as the gradient; what accumulated meanwhile is kept aside."""
        kept = [p.grad for p in self._params]
        for p, g in self._unflatten(vector):
            p.grad = g
        self.optimizer.step()
        for p, g in zip(self._params, kept):
            p.grad = g
        self.counters["optimizer_steps"] += 1

    def _unflatten(self, vector: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, its slice of the flat ``vector`` shaped like it), in ``_take_gradient``
        order."""
        offset = 0
        for p in self._params:
            n = p.numel()
            yield p, vector[offset:offset + n].view_as(p).to(p.device, p.dtype)
            offset += n

    def _step_alone(self) -> None:
        """A peer alone in its stage: its own mean gradient, without flattening it."""
        samples = self.worker.samples_accumulated
        for p in self._params:
            if p.grad is not None and samples:
                p.grad /= samples
        self.optimizer.step()
        self.worker.zero_grad()
        self.counters["optimizer_steps"] += 1

    def _give_back(self, vector: torch.Tensor, samples: int) -> None:
        """Undo ``_take_gradient`` (a round failed): add the snapshot back."""
        for p, g in self._unflatten(vector):
            p.grad = g * samples if p.grad is None else p.grad + g * samples
        self.worker.samples_accumulated += samples

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
                reply = await self.host.request(target, self.proto[kind], message,
                                                codec=self.codec, timeout=HOP_TIMEOUT_S)
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
                                    hop_seconds(reply, time.perf_counter() - t0), kind,
                                    time.time())
                return
        raise StageUnavailable(f"no peer of stage {stage} took the {kind} "
                               f"(tried {len(tried)})")

    async def _to_trainer(self, meta: dict[str, Any], kind: str, message: Message) -> None:
        await self.host.ensure_connected(meta["trainer"], meta.get("trainer_addrs", ()))
        await self.host.request(meta["trainer"], self.proto[kind], message, codec=self.codec,
                                timeout=HOP_TIMEOUT_S)
