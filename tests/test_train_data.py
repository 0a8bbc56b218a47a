"""`swarmd train`'s side of the data (swarmd.trainer.run): the held-out loss evaluated at the
start, every training.eval_every steps and at the end, each evaluation a metrics line and a
progress line; the data shard in every step's metrics line; batches drawn from the pipeline."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from data_helpers import number_corpus, open_numbers
from swarmd.trainer import run


class _Trainer:
    """Only what _run_steps uses; every batch it is given is remembered."""

    def __init__(self) -> None:
        self.step = 0
        self.seen: list[Any] = []
        self.evaluated: list[int] = []
        self.stats = SimpleNamespace(tokens=0, rerouted=0, restarted=0, lost=0, in_flight=0,
                                     microbatches=0,
                                     in_flight_target=0, round_trip_ms=None,
                                     peers_used=lambda: [1], grad_norm=None, step_phases={},
                                     clip_coefficient=None)
        self.optimizer = SimpleNamespace(skipped=0, last_lr=1e-3, last_grad_norm=None)
        #: what it told the stage peers after each step (``Trainer.progress``)
        self.told: list[Any] = []
        self.counters: dict[str, int] = {}
        #: the step at which its steps were done (it then announces itself leaving)
        self.done_at: int | None = None

    def steps_done(self) -> None:
        self.done_at = self.step

    async def evaluate(self, batches: list[Any]) -> float:
        self.evaluated.append(self.step)
        return 10.0 - self.step

    async def train(self, next_batch: Any, *, steps: int, microbatches: int, window: Any,
                    on_step: Any, barrier: bool = False) -> None:
        for _ in range(steps):
            self.seen += [next_batch() for _ in range(microbatches)]
            self.step += 1
            stop = await on_step(self.step, 1.0)
            self.told.append(getattr(self, "progress", None))
            if stop:
                return


def test_evaluations_at_the_start_every_eval_every_steps_and_at_the_end(tmp_path) -> None:
    data = open_numbers(number_corpus(tmp_path / "c"), tmp_path / "cache", shard="1/2")
    trainer, said = _Trainer(), []
    metrics = tmp_path / "train-metrics.jsonl"
    plan = run._Plan(steps=7, microbatches=2, batch=2, seq=8, metrics_file=metrics,
                     schedule="sync", eval_every=3)
    config = SimpleNamespace(training=SimpleNamespace(in_flight=0))
    result = asyncio.run(run._run_steps(trainer, data, config, plan,
                                        run._Progress(7, said.append, False), None))
    assert trainer.evaluated == [0, 3, 6, 7]
    assert trainer.done_at == 7  # before the final evaluation: announced leaving
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    evals = [x for x in lines if "val_loss" in x]
    steps = [x for x in lines if "loss" in x]
    assert [(x["step"], x["val_loss"]) for x in evals] == [(0, 10.0), (3, 7.0), (6, 4.0), (7, 3.0)]
    assert [x["step"] for x in steps] == list(range(1, 8))
    assert all(x["data_shard"] == "1/2" and x["data_epoch"] == 0 for x in lines)
    assert [s for s in said if "validation loss" in s] == [
        "initial validation loss 10.0000", "step 3 validation loss 7.0000",
        "step 6 validation loss 4.0000", "final validation loss 3.0000"]
    assert (result.initial_val_loss, result.final_val_loss) == (10.0, 3.0)
    assert len(trainer.seen) == 14 and data.state()["index"] == 14 * 2  # windows drawn
    # what the stage peers are told: the step's loss, the latest validation, shard and epoch
    told = [(p.step, p.loss, p.val_step, p.val_loss, p.shard, p.epoch) for p in trainer.told]
    assert told[0] == (1, 1.0, 0, 10.0, "1/2", 0)
    assert told[2] == (3, 1.0, 3, 7.0, "1/2", 0) and told[3][2:4] == (3, 7.0)
    last = trainer.progress
    assert (last.step, last.loss, last.val_step, last.val_loss) == (7, 1.0, 7, 3.0)
    data.close()


def test_eval_every_0_evaluates_only_at_the_start_and_the_end(tmp_path) -> None:
    data = open_numbers(number_corpus(tmp_path / "c"), tmp_path / "cache")
    trainer = _Trainer()
    plan = run._Plan(steps=5, microbatches=1, batch=2, seq=8, metrics_file=None,
                     schedule="sync", eval_every=0)
    asyncio.run(run._run_steps(trainer, data, SimpleNamespace(training=SimpleNamespace(
        in_flight=0)), plan, run._Progress(5, lambda _: None, False), None))
    assert trainer.evaluated == [0, 5]
    data.close()
