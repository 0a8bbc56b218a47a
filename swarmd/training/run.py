"""``swarmd train``: join a swarm as a trainer and train the model through its stages.

The trainer is a libp2p peer with an identity of its own (created per run), announced in
membership without a stage (so it is never routed to). It waits until every stage has a live
peer, says which stage is missing while one is, then trains: fixed held-out batches measure
validation loss before and after; each step sends ``microbatches`` microbatches through the
swarm; one JSON line per step is appended to ``<home>/train-metrics.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from swarmd.errors import StageUnavailable

#: fixed validation batches (same for every evaluation of a run)
VAL_BATCHES = 4
VIEW_TIMEOUT_S = 120.0


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
                bar: bool = True, until: Callable[[], bool] | None = None) -> TrainResult:
    """Train ``steps`` steps through the swarm, or fewer: ``until`` (when given) is asked
    after every step and ends the run early once it returns true. ``microbatches`` overrides
    ``training.microbatches``. With ``bar``, a progress bar goes to stderr when that is a
    terminal; otherwise (or without a terminal) ``progress`` gets a line every 5% of the run."""
    import torch
    from tqdm import tqdm

    from swarmd.training.data import load_corpus
    from swarmd.node.host_options import codec_spec, host_options
    from swarmd.membership.service import LocalState, MembershipService
    from swarmd.pipeline.trainer import Trainer
    from transport import identity
    from transport.host import Host
    from transport.memory import keep_freed_memory

    keep_freed_memory()
    device, dtype = config.torch_placement()
    microbatches = microbatches or config.training.microbatches
    in_flight = config.training.in_flight or microbatches
    model = config.model_config()
    seq, batch = model.seq_len, config.training.batch_size
    path = data_path if data_path is not None else (Path(config.data.path) if config.data.path
                                                    else None)
    corpus = load_corpus(path, max_bytes=config.data.max_bytes, seq_len=seq)
    me = identity.generate()
    metrics_file = home / "train-metrics.jsonl" if home is not None else None
    async with Host(me, host_options(config, listen)) as host:
        async with MembershipService(host, me, config, lambda: LocalState(None, "online")) as m:
            for addr in bootstrap:
                try:
                    await host.dial(addr)
                except Exception as exc:  # reported; the next address may work
                    progress(f"bootstrap {addr} failed: {exc}")
            trainer = Trainer(host, swarm=config.swarm.name, num_stages=config.swarm.stages,
                              model_config=model, model_hash=config.model_hash(),
                              codec=codec_spec(config), lr=config.training.lr,
                              seed=config.training.seed, peers_of=m.peers_of, device=device,
                              dtype=dtype)
            trainer.start()
            try:
                await _wait_for_stages(m, config.swarm.stages, progress)
                generator = torch.Generator().manual_seed(config.training.seed)
                val = corpus.val_batches(batch, seq, VAL_BATCHES)
                initial = await trainer.evaluate(val)
                progress(f"initial validation loss {initial:.4f}")
                t0 = time.monotonic()
                every = max(1, steps // 20)
                shown = tqdm(total=steps, unit="step", disable=None if bar else True,
                             file=sys.stderr, dynamic_ncols=True, leave=False)
                step = 0
                with shown:
                    for step in range(1, steps + 1):
                        batches = [corpus.sample_batch("train", batch, seq, generator)
                                   for _ in range(microbatches)]
                        loss = await trainer.train_step(batches, concurrency=in_flight)
                        elapsed = time.monotonic() - t0
                        s = trainer.stats
                        line = {"step": step, "loss": loss, "tokens_per_s": s.tokens / elapsed,
                                "rerouted": s.rerouted, "restarted": s.restarted,
                                "lost": s.lost, "peers_used": s.peers_used(),
                                "time": time.time()}
                        if metrics_file is not None:
                            with open(metrics_file, "a") as f:
                                f.write(json.dumps(line) + "\n")
                        routes = "/".join(str(n) for n in s.peers_used())
                        if not shown.disable:
                            shown.set_postfix_str(
                                f"loss {loss:.3f}  {s.tokens / elapsed:,.0f} tok/s  peers "
                                f"{routes}  rerouted {s.rerouted}  restarted {s.restarted}  "
                                f"lost {s.lost}", refresh=False)
                            shown.update(1)
                        elif step % every == 0 or step == steps:
                            progress(f"step {step:>5}/{steps}  loss {loss:.4f}  "
                                     f"{s.tokens / elapsed:,.0f} tok/s  peers per stage "
                                     f"{routes}  rerouted {s.rerouted}  restarted "
                                     f"{s.restarted}  lost {s.lost}")
                        if until is not None and until():
                            break
                final = await trainer.evaluate(val)
                progress(f"final validation loss {final:.4f}")
                s = trainer.stats
                return TrainResult(steps=step, initial_val_loss=initial, final_val_loss=final,
                                   tokens_per_s=s.tokens / max(1e-9, time.monotonic() - t0),
                                   rerouted=s.rerouted, restarted=s.restarted, lost=s.lost,
                                   seconds=time.monotonic() - t0,
                                   metrics_file=str(metrics_file) if metrics_file else None)
            finally:
                trainer.close()


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
