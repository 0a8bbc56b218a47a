"""``swarmd train``: join a swarm as a trainer and train the model through its stages.

The trainer is a libp2p peer with its home's identity, announced in membership without a stage
(so it is never routed to); its state is checkpointed in the home and resumed on restart. It waits until every stage has a live
peer, says which stage is missing while one is, then trains: fixed held-out batches
(``training.val_batches``, ``swarmd.data``) measure validation loss before, every
``training.eval_every`` steps and after; each step sends ``microbatches`` microbatches through
the swarm, drawn from this trainer's data shard (``data.shard``); one JSON line per step, and
one per evaluation (``"val_loss"``), is appended to ``<home>/train-metrics.jsonl``. The last
step's loss, the latest validation loss, the shard and the epoch are also told to the stage
peers in the trainer's replies (``Trainer.progress``): their ``swarmd status`` and status page
show them.

The steps are pipelined (``Trainer.train``, docs/pipeline.md "Latency hiding"): the trainer
keeps as many microbatches in flight as the measured round trip and throughput call for
(``swarmd.pipeline.inflight``), at most ``training.in_flight`` (0: ``MAX_IN_FLIGHT``), and
the number is shown in the progress and in every metrics line. ``schedule="sync"`` is the
synchronous schedule (a step's microbatches, then the step; nothing in flight across it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Sequence

from swarmd.errors import ModelMismatch, StageUnavailable

VIEW_TIMEOUT_S = 120.0
#: at most this many microbatches in flight when ``training.in_flight`` is 0 (each holds its
#: activations on every stage peer it passed, and its weights' stash: bounded by memory and
#: by the stages' staleness limit, ``swarmd.pipeline.worker.MAX_STALENESS`` steps)
MAX_IN_FLIGHT = 32
#: the synchronous schedule's floor of microbatches in flight when ``training.in_flight`` is 0
#: (a step's opening burst goes up to the ceiling: ``InFlight.opening``). A stage peer then
#: queued 16 for compute and refused more with busy, so a step's 64 sent at once drew 120
#: refusals a step, each pausing the peer, and ran a step a minute on loopback
SYNC_IN_FLIGHT = 8
SCHEDULES = ("sync", "pipelined")


@dataclass(frozen=True)
class TrainResult:
    #: the trainer's step at the end (counting the steps of earlier runs it resumed)
    steps: int
    initial_val_loss: float
    final_val_loss: float
    tokens_per_s: float
    rerouted: int
    restarted: int
    lost: int
    seconds: float
    metrics_file: str | None
    #: the step the run resumed from (0: a fresh start)
    resumed_from: int = 0
    #: steps skipped because a float16 gradient overflowed
    skipped_steps: int = 0
    #: where the embedding and head came from: "own" (initial or the home's) or "trainers"
    #: (taken from another trainer training then); rounds averaged with other trainers
    parts_from: str = "own"
    trainer_rounds: int = 0
    #: microbatches this run trained on (with other trainers, its shares of the steps)
    microbatches: int = 0
    #: steps every part of the model took on exactly their target batch, clipped together
    #: (``swarmd.pipeline.exact``)
    steps_exact: int = 0
    #: exact steps whose opening burst went before the step before it was taken (its norm
    #: notes sent: ``Trainer.train``'s early start)
    steps_started_early: int = 0


async def train(config: Any, *, bootstrap: Sequence[str], steps: int,
                data_path: Path | None = None, home: Path | None = None,
                listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
                progress: Callable[[str], None] = print,
                bar: bool = True, until: Callable[[], bool] | None = None,
                schedule: str | None = None, fixed_in_flight: int | None = None
                ) -> TrainResult:
    """Train through the swarm until the trainer's step reaches ``steps``, or fewer: ``until``
    (when given) is asked after every step and ends the run early once it returns true.

    With a ``home``, the trainer is the home's identity (created when missing) and its state
    (``swarmd.state.trainer_state``) is saved there every ``checkpoint.every_steps`` steps
    and at the end; a restarted trainer resumes its step, weights, optimizer and data.
    A step is ``training.microbatches`` microbatches, as the swarm's manifest says (the stages
    step on that many samples: a trainer of another step size would make no exact step).
    ``schedule`` (default
    ``training.schedule``) is ``sync`` or ``pipelined`` (module doc); ``fixed_in_flight`` pins the pipelined schedule's number in flight
    (experiments). With ``bar``, a progress bar goes to stderr when that is a terminal;
    otherwise (or without a terminal) ``progress`` gets a line every 5% of the run."""
    from swarmd.models.registry import model_seam_of
    from swarmd.export.periodic import periodic_export
    from swarmd.training.batches import make_batches
    from swarmd.trainer.trainer_sync import trainer_sync
    from transport.memory import keep_freed_memory

    schedule = schedule or config.training.schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: expected one of {SCHEDULES}")
    keep_freed_memory()
    seam, tokenizer = model_seam_of(config)
    seq_len = min(config.model.seq_len, seam.max_seq_len)
    plan = _Plan(steps=steps, microbatches=config.training.microbatches,
                 batch=config.training.batch_size, seq=seq_len, home=home,
                 every=config.checkpoint.every_steps, schedule=schedule,
                 fixed_in_flight=fixed_in_flight, eval_every=config.training.eval_every,
                 metrics_file=home / "train-metrics.jsonl" if home is not None else None)
    batches = await asyncio.to_thread(  # reads and may tokenize the corpus: not on the loop
        lambda: make_batches(config, tokenizer, data_path=data_path, batch=plan.batch,
                             seq_len=seq_len, val_batches=config.training.val_batches,
                             say=progress))
    with _home_lock(home) if home is not None else contextlib.nullcontext(), batches:
        async with _board(config, plan) as board, \
                _joined(config, seam, home, bootstrap, listen, progress) as (trainer, m), \
                trainer_sync(trainer.host, trainer, m, config,
                             gradients=schedule == "sync",
                             target=plan.microbatches * plan.batch) as parts, \
                periodic_export(config, trainer, m, home, progress):
            resumed = _resume(trainer, batches, home, progress)
            await _wait_for_stages(m, config.swarm.stages, progress,
                                   _mismatch_explainer(trainer.host, m, config))
            batches.place(trainer.host.peer_id, m.trainers())  # data.shard, prefetch starts
            progress(batches.describe())
            if await parts.join() == "trainers":
                progress("took the embedding and head of the trainers training now")
            result = await _run_steps(trainer, batches, config, plan, _Progress(
                max(0, steps - resumed), progress, bar), until, resumed, board)
            return dataclasses.replace(result, parts_from=parts.parts_from,
                                       trainer_rounds=parts.rounds)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Plan:
    steps: int
    microbatches: int
    batch: int
    seq: int
    metrics_file: Path | None
    home: Path | None = None
    #: save the trainer state every this many steps (0: only at the end)
    every: int = 0
    schedule: str = "pipelined"
    fixed_in_flight: int | None = None
    #: evaluate every this many steps (0: only before and after)
    eval_every: int = 0


@contextlib.contextmanager
def _home_lock(home: Path) -> Iterator[None]:
    """The home's lock, held while training (the home created with an identity when it has
    none, as ``swarmd init`` does): a trainer is its home's peer, so no daemon or other trainer
    may run with that home meanwhile."""
    from swarmd.errors import HomeError
    from swarmd.node.home import KEY_FILE, init_home
    from swarmd.runfiles import HomeLock

    if not (home / KEY_FILE).exists():
        init_home(home)
    lock = HomeLock(home)
    try:
        lock.acquire()
    except HomeError as exc:
        raise HomeError(f"{exc} (a trainer is its home's peer: a trainer and a daemon each need "
                        f"a home of their own)") from None
    try:
        yield
    finally:
        lock.release()


def _resume(trainer: Any, batches: Any, home: Path | None,
            progress: Callable[[str], None]) -> int:
    """Load the trainer state saved in ``home`` into ``trainer`` and ``batches``; its step."""
    from swarmd.state import trainer_state

    state = trainer_state.load(home) if home is not None else None
    if state is None:
        return 0
    trainer_state.restore(trainer, state)
    batches.restore(state.data)
    digest = trainer_state.params_digest(trainer.parts.state_dict())  # what was loaded
    progress(f"resumed from step {state.step} ({trainer_state.state_path(home)}): weights "
             f"{digest}, data {json.dumps(_plain_data(batches.state()))}")
    return state.step


def _plain_data(state: dict[str, Any]) -> dict[str, Any]:
    """The data position as plain values (a generator state is shown by its size)."""
    return {k: (f"<{v.numel()} bytes>" if hasattr(v, "numel") else v) for k, v in state.items()}


async def _save(trainer: Any, batches: Any, home: Path | None) -> None:
    """Save the trainer's state (between steps, so nothing changes it meanwhile)."""
    from swarmd.state import trainer_state

    if home is not None:
        data = batches.state(trainer.drawn_ahead)  # the first batch of the next step
        await asyncio.to_thread(
            lambda: trainer_state.save(home, trainer_state.capture(trainer, data)))


@contextlib.asynccontextmanager
async def _joined(config: Any, seam: Any, home: Path | None, bootstrap: Sequence[str],
                  listen: Sequence[str], progress: Callable[[str], None]
                  ) -> AsyncIterator[tuple[Any, Any]]:
    """A host with the home's identity (a fresh one without a home), membership (announced
    with no stage) and a started ``Trainer``; torn down in reverse."""
    from swarmd.manifest.local import swarm_manifest
    from swarmd.models.registry import model_hash_of, torch_placement_of
    from swarmd.manifest.join import check_trainer
    from swarmd.membership.service import LocalState, MembershipService
    from swarmd.node.home import load_identity
    from swarmd.node.interfaces import interface_ips
    from swarmd.node.host_options import codec_spec, host_options
    from swarmd.trainer.trainer import Trainer
    from swarmd.training.swarm_optim import OptimSettings
    from transport import identity
    from transport.host import Host

    device, dtype = torch_placement_of(config)
    me = load_identity(home) if home is not None else identity.generate()
    #: announced online while it trains, leaving once its steps are done (``steps_done``)
    announced = {"state": "online"}
    parts = await asyncio.to_thread(  # seconds for a big model: not on the event loop
        lambda: seam.build_trainer(seed=config.training.seed, device=device, dtype=dtype,
                                   weights=seam.own_weights()))
    async with Host(me, host_options(config, listen)) as host:
        async with MembershipService(host, me, config,
                                     lambda: LocalState(None, announced["state"]),
                                     manifest=swarm_manifest(config).hash,
                                     interfaces=interface_ips) as m:
            dialed = []
            for addr in bootstrap:
                try:
                    dialed.append(await host.dial(addr))
                except Exception as exc:  # reported; the next address may work
                    progress(f"bootstrap {addr} failed: {exc}")
            await check_trainer(host, config, dialed)  # its settings are the swarm's, or stop
            trainer = Trainer(host, swarm=config.swarm.name, num_stages=config.swarm.stages,
                              seam=seam, parts=parts, model_hash=model_hash_of(config),
                              codec=codec_spec(config), lr=config.training.lr,
                              seed=config.training.seed,
                              optim=OptimSettings.from_config(config.training),
                              peers_of=m.peers_of, device=device, dtype=dtype,
                              clip_whole_model=config.training.grad_clip_scope == "model")
            trainer.other_trainers = lambda: list(m.trainers())
            trainer.steps_of = m.steps_of

            def steps_done() -> None:
                """The other trainers stop splitting their steps with this one now, not
                once its announcement expires (its final validation still runs)."""
                announced["state"] = "leaving"
                m.changed()

            trainer.steps_done = steps_done
            trainer.start()
            try:
                yield trainer, m
            finally:
                trainer.close()


async def _run_steps(trainer: Any, batches: Any, config: Any, plan: _Plan, shown: _Progress,
                     until: Callable[[], bool] | None, resumed: int = 0,
                     board: Any = None) -> TrainResult:
    """Validation before, the steps (one metrics line each, the state saved every
    ``plan.every`` steps and at the end, validation every ``plan.eval_every``), validation
    after; the same series and the validation losses to ``board`` (TensorBoard), when given."""
    from swarmd.training.tensorboard import Board

    board = board or Board()
    initial = await _evaluate(trainer, batches, plan, shown.say, "initial", board)
    t0 = time.monotonic()
    saved = trainer.step

    async def stepped(step: int, loss: float) -> bool:
        nonlocal saved
        s = trainer.stats
        rate = s.tokens / (time.monotonic() - t0)
        line = {
            "step": step, "loss": loss, "tokens_per_s": rate, "rerouted": s.rerouted,
            "restarted": s.restarted, "lost": s.lost, "peers_used": s.peers_used(),
            "in_flight": s.in_flight, "in_flight_target": s.in_flight_target,
            "round_trip_ms": s.round_trip_ms, "data_shard": str(batches.shard),
            "data_epoch": batches.epoch, "lr": trainer.optimizer.last_lr,
            "grad_norm_trainer": trainer.optimizer.last_grad_norm,
            "grad_norm": s.grad_norm, "clip_coefficient": s.clip_coefficient,
            "phases": {k: round(v, 4) for k, v in s.step_phases.items()},
            "time": time.time()}  # a record's timestamp for people, not a timer
        _write_metrics(plan.metrics_file, line)
        _tell(trainer, batches, loss=loss)
        board.log_step(step, line)
        shown.stepped(step - resumed, loss, rate, s)
        if plan.eval_every and step % plan.eval_every == 0 and step < plan.steps:
            await _evaluate(trainer, batches, plan, shown.say, f"step {step}", board)
        if plan.every and step % plan.every == 0:
            await _save(trainer, batches, plan.home)
            saved = step
        return until is not None and until()

    try:
        with shown:
            await _steps(trainer, batches, config, plan, stepped)
    finally:
        if trainer.step != saved:  # the steps done are kept, whatever ended the run
            await _save(trainer, batches, plan.home)
    trainer.steps_done()
    final = await _evaluate(trainer, batches, plan, shown.say, "final", board)
    s = trainer.stats
    seconds = time.monotonic() - t0
    return TrainResult(steps=trainer.step, initial_val_loss=initial, final_val_loss=final,
                       tokens_per_s=s.tokens / max(1e-9, seconds), rerouted=s.rerouted,
                       restarted=s.restarted, lost=s.lost, seconds=seconds,
                       metrics_file=str(plan.metrics_file) if plan.metrics_file else None,
                       resumed_from=resumed, skipped_steps=trainer.optimizer.skipped,
                       microbatches=s.microbatches,
                       steps_exact=trainer.counters.get("steps_exact", 0),
                       steps_started_early=trainer.counters.get("steps_started_early", 0))


async def _steps(trainer: Any, batches: Any, config: Any, plan: _Plan,
                 stepped: Callable[[int, float], Awaitable[bool]]) -> None:
    """The steps left until ``plan.steps``, in ``plan.schedule``; ``stepped(step, loss)``
    after each returns True to stop early."""
    from swarmd.pipeline.inflight import InFlight

    left = plan.steps - trainer.step
    if left <= 0:
        return
    exact = trainer.exact = plan.schedule == "sync"  # exact steps (swarmd.pipeline.exact)
    ceiling = plan.fixed_in_flight or config.training.in_flight or MAX_IN_FLIGHT
    # the synchronous schedule starts from a few in flight and grows to what the round trip
    # calls for (``InFlight``), never more than a step's microbatches (nothing crosses a step)
    floor = min(plan.microbatches, SYNC_IN_FLIGHT) if exact else plan.microbatches
    window = InFlight(floor=min(floor, ceiling),
                      ceiling=min(ceiling, plan.microbatches) if exact else ceiling,
                      fixed=plan.fixed_in_flight is not None)
    await trainer.train(batches.next, steps=left, microbatches=plan.microbatches,
                        window=window, on_step=stepped, barrier=exact)


async def _evaluate(trainer: Any, batches: Any, plan: _Plan, say: Callable[[str], None],
                    when: str, board: Any) -> float:
    """The validation loss on the held-out batches, said, written as a metrics line
    (``"val_loss"`` and the step; step lines have ``"loss"`` instead) and to ``board``."""
    loss = await trainer.evaluate(batches.val)
    _tell(trainer, batches, val_loss=loss)
    board.log_eval(trainer.step, loss)
    _write_metrics(plan.metrics_file, {"step": trainer.step, "val_loss": loss,
                                       "data_shard": str(batches.shard),
                                       "data_epoch": batches.epoch, "time": time.time()})
    say(f"{when} validation loss {loss:.4f}")
    return loss


def _tell(trainer: Any, batches: Any, *, loss: float | None = None,
          val_loss: float | None = None) -> None:
    """The trainer's progress for the stage peers (``TrainerProgress``) after a step (its
    ``loss``) or an evaluation (``val_loss``, at the trainer's step); a loss that is not a
    finite number is told as not known."""
    from swarmd.pipeline.messages import MAX_LOSS, MAX_STEP, TrainerProgress, is_shard

    def usable(x: float | None) -> float | None:
        return x if x is not None and math.isfinite(x) and abs(x) < MAX_LOSS else None

    last = getattr(trainer, "progress", None)
    step = trainer.step
    if val_loss is None and last is not None:
        val_loss, val_step = last.val_loss, last.val_step
    else:
        val_loss = usable(val_loss)
        val_step = step if val_loss is not None else None
    if loss is None and last is not None and last.step == step:
        loss = last.loss
    shard, epoch = str(getattr(batches, "shard", "")), getattr(batches, "epoch", None)
    trainer.progress = TrainerProgress(
        step=step, loss=usable(loss), val_loss=val_loss, val_step=val_step,
        shard=shard if is_shard(shard) else None,
        epoch=epoch if type(epoch) is int and 0 <= epoch < MAX_STEP else None)


def _board(config: Any, plan: _Plan) -> Any:
    """TensorBoard's event files when ``training.tensorboard_dir`` is set (else nothing is
    written), with the run's settings."""
    from swarmd.training.tensorboard import open_board

    return open_board(config.training.tensorboard_dir,
                      {"config": config.to_dict(), "run": asdict(plan)})


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


async def _wait_for_stages(m: Any, stages: int, progress: Callable[[str], None],
                           explain: Callable[[], Awaitable[str | None]] | None = None) -> None:
    """Until every stage has a live peer (saying which is missing meanwhile). A stage served
    only by peers of another model ends the wait with :class:`ModelMismatch` naming what
    differs (``explain``)."""
    deadline = time.monotonic() + VIEW_TIMEOUT_S
    said: int | None = None
    while True:
        missing = [s for s in range(stages) if not m.peers_of(s)]
        if not missing:
            return
        if explain is not None:
            reason = await explain()
            if reason is not None:
                raise ModelMismatch(f"{reason}; every peer of a swarm needs the same model")
        if missing[0] != said:
            progress(f"waiting for a peer of stage {missing[0]} "
                     f"({len(missing)} of {stages} stages have none yet)")
            said = missing[0]
        if time.monotonic() > deadline:
            raise StageUnavailable(f"stage {missing[0]} has no live peer after "
                                   f"{VIEW_TIMEOUT_S:.0f} s: start a daemon with "
                                   f"`swarmd join --stage {missing[0]}`")
        await asyncio.sleep(0.2)


def _mismatch_explainer(host: Any, m: Any, config: Any) -> Callable[[], Awaitable[str | None]]:
    """Asks each peer kept out for another model once (bounded) what its model is."""
    from swarmd.pipeline.model_info import explain_mismatch, mismatched_peers

    asked: set[str] = set()

    async def explain() -> str | None:
        from swarmd.models.registry import model_fingerprint_of

        peers = [p for p in mismatched_peers(m.swarm_info()) if p[0] not in asked]
        asked.update(p for p, _ in peers[:3])
        if not peers:
            return None
        return await explain_mismatch(host, config.swarm.name, config.swarm.model,
                                      model_fingerprint_of(config), peers)

    return explain
