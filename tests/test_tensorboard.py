"""training.tensorboard_dir: the trainer's curves as TensorBoard event files, read back with
TensorBoard's own reader; a directory that cannot be written is said once and training goes on."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from swarmd.training.tensorboard import STEP_SERIES, Board, open_board

#: the series of one metrics line, as the trainer writes it
LINE = {"step": 1, "loss": 5.5, "tokens_per_s": 1234.5, "rerouted": 1, "restarted": 2,
        "lost": 0, "lr": 3e-4, "grad_norm_trainer": 0.75, "peers_used": [1, 1], "time": 0.0}


def _reader(directory: Path) -> Any:
    """TensorBoard's own event reader over ``directory``, loaded."""
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="TensorBoard is not installed (pip install 'swarmd[tensorboard]')")
    reader = event_accumulator.EventAccumulator(str(directory), size_guidance={
        event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0})
    reader.Reload()
    return reader


def _scalars(reader: Any, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in reader.Scalars(tag)]


def _settings_text(reader: Any) -> str:
    (event,) = reader.Tensors("settings/text_summary")
    return event.tensor_proto.string_val[0].decode()


def _offs(caplog: Any) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", "") == "tensorboard_off"]


# ------------------------------------------------------------------------------- the board

def test_steps_evaluations_and_settings_are_read_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoard is not installed "
                                              "(pip install 'swarmd[tensorboard]')")
    board = open_board(str(tmp_path / "runs"), {"config": {"training": {"lr": 3e-4}}})
    assert board.writing
    board.log_eval(0, 5.6)
    board.log_step(1, LINE)
    board.log_step(2, {**LINE, "loss": 5.0, "grad_norm_trainer": None})  # no norm: left out
    board.log_eval(2, 4.9)
    board.close()
    reader = _reader(tmp_path / "runs")
    assert _scalars(reader, "train/loss") == [(1, 5.5), (2, 5.0)]
    assert _scalars(reader, "train/grad_norm_trainer") == [(1, 0.75)]
    for key in ("lr", "tokens_per_s", "rerouted", "restarted", "lost"):
        assert [v for _, v in _scalars(reader, STEP_SERIES[key])] == pytest.approx(
            [LINE[key]] * 2)
    assert [(s, round(v, 4)) for s, v in _scalars(reader, "val/loss")] == [(0, 5.6), (2, 4.9)]
    assert '"lr": 0.0003' in _settings_text(reader)


def test_an_unwritable_directory_is_said_once_and_nothing_breaks(tmp_path: Path,
                                                                caplog: Any) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoard is not installed "
                                              "(pip install 'swarmd[tensorboard]')")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING):
        board = open_board(str(blocker / "runs"), {"x": 1})
        board.log_step(1, LINE)
        board.log_eval(1, 1.0)
        board.close()
    assert not board.writing
    (said,) = _offs(caplog)
    assert "training.tensorboard_dir" in said.getMessage()
    assert "choose a writable directory" in said.getMessage()


class _FailingWriter:
    def __init__(self) -> None:
        self.calls = 0

    def add_scalar(self, *args: Any) -> None:
        self.calls += 1
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_write_failing_later_is_said_once_then_the_board_is_off(caplog: Any) -> None:
    writer = _FailingWriter()
    board = Board(writer, "/runs")
    with caplog.at_level(logging.WARNING):
        for step in range(1, 4):
            board.log_step(step, LINE)
            board.log_eval(step, 1.0)
    assert writer.calls == 1 and not board.writing
    (said,) = _offs(caplog)
    assert "No space left on device" in said.getMessage()


def test_without_tensorboard_installed_the_trainer_says_how_to_get_it(monkeypatch: Any,
                                                                     caplog: Any) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with caplog.at_level(logging.WARNING):
        board = open_board("/tmp/never-made", {})
    assert not board.writing
    (said,) = _offs(caplog)
    assert "pip install 'swarmd[tensorboard]'" in said.getMessage()
    assert not Path("/tmp/never-made").exists()


def test_no_directory_writes_nothing() -> None:
    board = open_board("", {"x": 1})
    board.log_step(1, LINE)
    assert not board.writing


# --------------------------------------------------------------------- a trainer, for real

@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_training_run_writes_its_curves_and_keeps_the_metrics_lines(tmp_path: Path,
                                                                      caplog: Any) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoard is not installed "
                                              "(pip install 'swarmd[tensorboard]')")
    import uvloop

    from daemon_harness import start_swarm, stop_all
    from swarmd.config import load_config
    from swarmd.local.demo import DEMO_ENV
    from swarmd.trainer.run import train

    env = {**DEMO_ENV, "SWARMD_MODEL_WIDTH": "64", "SWARMD_MODEL_SEQ_LEN": "32",
           "SWARMD_DATA_MAX_BYTES": "2000000", "SWARMD_SWARM_NAME": "tensorboard-test",
           "SWARMD_SWARM_STAGES": "1"}
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    daemons: list[Any] = []
    try:
        (daemon,) = start_swarm(tmp_path / "swarm", [0], env=env, into=daemons)
        runs: dict[str, Any] = {}
        for name, directory in (("written", tmp_path / "runs"), ("unwritable", blocker / "x")):
            config = load_config(None, {**os.environ, **env,
                                        "SWARMD_TRAINING_TENSORBOARD_DIR": str(directory)})
            with caplog.at_level(logging.WARNING):
                caplog.clear()
                runs[name] = uvloop.run(train(config, bootstrap=[daemon.addr], steps=3,
                                              home=tmp_path / name, bar=False,
                                              progress=lambda line: None))
                runs[name + " said"] = _offs(caplog)
    finally:
        stop_all(daemons)
    # a directory that cannot be written: said once, and the run trained all the same
    assert runs["unwritable"].steps == 3 and len(runs["unwritable said"]) == 1
    assert not runs["written said"]
    result = runs["written"]
    every = [json.loads(x) for x in (tmp_path / "written" / "train-metrics.jsonl")
             .read_text().splitlines()]
    lines = [x for x in every if "loss" in x]  # the steps' lines (evaluations have val_loss)
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert [x["step"] for x in every if "val_loss" in x] == [0, 3]
    reader = _reader(tmp_path / "runs")
    for key, tag in STEP_SERIES.items():  # the same series in both places
        assert [(x["step"], pytest.approx(x[key], rel=1e-6)) for x in lines] == \
            _scalars(reader, tag), key
    assert all(x["lr"] > 0 and x["grad_norm_trainer"] > 0 for x in lines)
    val = _scalars(reader, "val/loss")
    assert [s for s, _ in val] == [0, 3]
    assert [v for _, v in val] == pytest.approx([result.initial_val_loss, result.final_val_loss],
                                                rel=1e-6)
    assert '"tensorboard_dir"' in _settings_text(reader)
