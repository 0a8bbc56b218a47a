"""``swarmd train``: join a swarm as a trainer and train the model through its stages.

The trainer is a libp2p peer with an identity of its own (created per run), announced in
membership without a stage (so it is never routed to). It waits until every stage has a live
peer, says which stage is missing while one is, then trains: fixed held-out batches measure
validation loss before and after; each step sends ``microbatches`` microbatches through the
swarm; one JSON line per step is appended to ``<home>/train-metrics.jsonl``.

The steps are pipelined (``Trainer.train``, docs/pipeline.md "Latency hiding"): the trainer
keeps as many microbatches in flight as the measured round trip and throughput call for
(``swarmd.pipeline.inflight``), at most ``training.in_flight`` (0: ``MAX_IN_FLIGHT``), and
the number is shown in the progress and in every metrics line. ``schedule="sync"`` is the
synchronous schedule (a step's microbatches, then the step; nothing in flight across it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from swarmd.errors import StageUnavailable

#: fixed validation batches (same for every evaluation of a run)
VAL_BATCHES = 4
VIEW_TIMEOUT_S = 120.0
#: at most this many microbatches in flight when ``training.in_flight`` is 0 (each holds its
#: activations on every stage peer it passed, and its weights' stash: bounded by memory and
#: by the stages' staleness limit, ``swarmd.pipeline.worker.MAX_STALENESS`` steps)
MAX_IN_FLIGHT = 32
SCHEDULES = ("pipelined", "sync")


@dataclass(frozen=True)
class TrainResult:
    steps: int
    initial_val_loss: float
    final_val_loss: float
    tokens_per_s: float
    rerouted: int
    restarted: int
    lost: int
    seconds: float
    metrics_file: str | None


async def train(config: Any, *, bootstrap: Sequence[str], steps: int,
                data_path: Path | None = None, home: Path | None = None,
                listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
                microbatches: int | None = None, progress: Callable[[str], None] = print,
                bar: bool = True, until: Callable[[], bool] | None = None,
                schedule: str = "pipelined", fixed_in_flight: int | None = None
                ) -> TrainResult:
    """Train ``steps`` steps through the swarm, or fewer: ``until`` (when given) is asked
    after every step and ends the run early once it returns true. ``microbatches`` overrides
    ``training.microbatches``. ``schedule`` is ``pipelined`` or ``sync`` (module doc);
    ``fixed_in_flight`` pins the pipelined schedule's number in flight (experiments). With
    ``bar``, a progress bar goes to stderr when that is a
    terminal; otherwise (or without a terminal) ``progress`` gets a line every 5% of the run."""
    from swarmd.training.data import load_corpus
    from transport.memory import keep_freed_memory

    keep_freed_memory()
    model = config.model_config()
    path = data_path if data_path is not None else (Path(config.data.path) if config.data.path
                                                    else None)
    corpus = load_corpus(path, max_bytes=config.data.max_bytes, seq_len=model.seq_len)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: expected one of {SCHEDULES}")
    plan = _Plan(steps=steps, microbatches=microbatches or config.training.microbatches,
                 batch=config.training.batch_size, seq=model.seq_len, schedule=schedule,
                 fixed_in_flight=fixed_in_flight,
                 metrics_file=home / "train-metrics.jsonl" if home is not None else None)
    async with _joined(config, bootstrap, listen, progress) as (trainer, membership):
        await _wait_for_stages(membership, config.swarm.stages, progress)
        return await _run_steps(trainer, corpus, config, plan, _Progress(
            steps, progress, bar), until)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Plan:
    steps: int
    microbatches: int
    batch: int
    seq: int
    metrics_file: Path | None
    schedule: str = "pipelined"
    fixed_in_flight: int | None = None


@contextlib.asynccontextmanager
async def _joined(config: Any, bootstrap: Sequence[str], listen: Sequence[str],
                  progress: Callable[[str], None]) -> AsyncIterator[tuple[Any, Any]]:
    """A host with a fresh identity, membership (announced with no stage) and a started
    ``Trainer``; torn down in reverse."""
    from swarmd.membership.service import LocalState, MembershipService
    from swarmd.node.host_options import codec_spec, host_options
    from swarmd.pipeline.trainer import Trainer
    from transport import identity
    from transport.host import Host

    device, dtype = config.torch_placement()
    me = identity.generate()
    async with Host(me, host_options(config, listen)) as host:
        async with MembershipService(host, me, config, lambda: LocalState(None, "online")) as m:
            for addr in bootstrap:
                try:
                    await host.dial(addr)
                except Exception as exc:  # reported; the next address may work
                    progress(f"bootstrap {addr} failed: {exc}")
            trainer = Trainer(host, swarm=config.swarm.name, num_stages=config.swarm.stages,
                              model_config=config.model_config(),
                              model_hash=config.model_hash(), codec=codec_spec(config),
                              lr=config.training.lr, seed=config.training.seed,
                              peers_of=m.peers_of, device=device, dtype=dtype)
            trainer.start()
            try:
                yield trainer, m
            finally:
                trainer.close()


async def _run_steps(trainer: Any, corpus: Any, config: Any, plan: _Plan, shown: _Progress,
                     until: Callable[[], bool] | None) -> TrainResult:
    """Validation before, the steps (one metrics line each), validation after."""
    import torch

    from swarmd.pipeline.inflight import InFlight

    generator = torch.Generator().manual_seed(config.training.seed)
    val = corpus.val_batches(plan.batch, plan.seq, VAL_BATCHES)
    initial = await trainer.evaluate(val)
    shown.say(f"initial validation loss {initial:.4f}")
    t0 = time.monotonic()
    last = 0

    def draw() -> Any:
        return corpus.sample_batch("train", plan.batch, plan.seq, generator)

    async def stepped(step: int, loss: float) -> bool:
        nonlocal last
        last = step
        s = trainer.stats
        rate = s.tokens / (time.monotonic() - t0)
        _write_metrics(plan.metrics_file, {
            "step": step, "loss": loss, "tokens_per_s": rate, "rerouted": s.rerouted,
            "restarted": s.restarted, "lost": s.lost, "peers_used": s.peers_used(),
            "in_flight": s.in_flight, "in_flight_target": s.in_flight_target,
            "round_trip_ms": s.round_trip_ms,
            "time": time.time()})  # a record's timestamp for people, not a timer
        shown.stepped(step, loss, rate, s)
        return until is not None and until()

    with shown:
        if plan.schedule == "sync":
            in_flight = config.training.in_flight or plan.microbatches
            trainer.stats.in_flight_target = in_flight
            for step in range(1, plan.steps + 1):
                batches = [draw() for _ in range(plan.microbatches)]
                if await stepped(step, await trainer.train_step(batches, in_flight)):
                    break
        else:
            ceiling = plan.fixed_in_flight or config.training.in_flight or MAX_IN_FLIGHT
            window = InFlight(floor=plan.microbatches, ceiling=ceiling,
                              fixed=plan.fixed_in_flight is not None)
            await trainer.train(draw, steps=plan.steps, microbatches=plan.microbatches,
                                window=window, on_step=stepped)
    final = await trainer.evaluate(val)
    shown.say(f"final validation loss {final:.4f}")
    s = trainer.stats
    seconds = time.monotonic() - t0
    return TrainResult(steps=last, initial_val_loss=initial, final_val_loss=final,
                       tokens_per_s=s.tokens / max(1e-9, seconds), rerouted=s.rerouted,
                       restarted=s.restarted, lost=s.lost, seconds=seconds,
                       metrics_file=str(plan.metrics_file) if plan.metrics_file else None)


def _write_metrics(path: Path | None, line: dict[str, Any]) -> None:
    if path is not None:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


class _Progress:
    """A progress bar on a terminal's stderr, else a ``progress`` line every 5% of the run."""

    def __init__(self, steps: int, progress: Callable[[str], None], bar: bool) -> None:
        from tqdm import tqdm

        self.steps, self.say = steps, progress
        self.every = max(1, steps // 20)
        self.bar = tqdm(total=steps, unit="step", disable=None if bar else True,
                        file=sys.stderr, dynamic_ncols=True, leave=False)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()

    def stepped(self, step: int, loss: float, rate: float, s: Any) -> None:
        routes = "/".join(str(n) for n in s.peers_used())
        if not self.bar.disable:
            self.bar.set_postfix_str(
                f"loss {loss:.3f}  {rate:,.0f} tok/s  in flight {s.in_flight_target}  "
                f"peers {routes}  rerouted {s.rerouted}  "
                f"restarted {s.restarted}  lost {s.lost}", refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == self.steps:
            self.say(f"step {step:>5}/{self.steps}  loss {loss:.4f}  {rate:,.0f} tok/s  in "
                     f"flight {s.in_flight_target}  peers per stage {routes}  rerouted {s.rerouted}  restarted {s.restarted}  "
                     f"lost {s.lost}")


async def _wait_for_stages(m: Any, stages: int, progress: Callable[[str], None]) -> None:
    deadline = time.monotonic() + VIEW_TIMEOUT_S
    said: int | None = None
    while True:
        missing = [s for s in range(stages) if not m.peers_of(s)]
        if not missing:
            return
        if missing[0] != said:
            progress(f"waiting for a peer of stage {missing[0]} "
                     f"({len(missing)} of {stages} stages have none yet)")
            said = missing[0]
        if time.monotonic() > deadline:
            raise StageUnavailable(f"stage {missing[0]} has no live peer after "
                                   f"{VIEW_TIMEOUT_S:.0f} s: start a daemon with "
                                   f"`swarmd join --stage {missing[0]}`")
        await asyncio.sleep(0.2)


def result_json(result: TrainResult) -> dict[str, Any]:
    return asdict(result)
