"""``swarmd.train(...)`` from Python (inside a running event loop too, as in a notebook) and
``swarmd demo --model DIR``: a Hugging Face model directory trained through a local swarm."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from daemon_harness import ROOT, start_swarm, stop_all
from test_models_swarm import ENV, text_data, tiny_llama
from swarmd.local.zygote import swarmd_run

pytest.importorskip("transformers")

pytestmark = pytest.mark.integration


def test_swarmd_train_from_python_inside_an_event_loop(tmp_path: Path) -> None:
    import swarmd

    model, data = tiny_llama(tmp_path / "llama"), text_data(tmp_path / "data")
    env = {**ENV, "SWARMD_MODEL_HF": str(model), "SWARMD_SWARM_NAME": "api-swarm"}
    daemons: list[Any] = []
    try:
        first, _ = start_swarm(tmp_path, [0, 1], env=env, into=daemons)
        lines: list[str] = []

        async def notebook_cell() -> Any:  # a notebook's code runs inside an event loop
            return swarmd.train(first.addr, model=model, data=data, steps=12,
                                home=tmp_path / "trainer", progress=lines.append,
                                settings={"swarm.name": "api-swarm", "swarm.stages": 2,
                                          "model.seq_len": 32, "model.threads": 1,
                                          "training.batch_size": 4,
                                          "training.microbatches": 2})

        result = asyncio.run(notebook_cell())
        assert result.steps == 12 and result.lost == 0
        assert result.final_val_loss < result.initial_val_loss
        assert any(line.startswith("initial validation loss") for line in lines)
        assert (tmp_path / "trainer" / "trainer" / "state.pt").is_file()
    finally:
        stop_all(daemons)


def test_swarmd_demo_trains_a_hugging_face_model_directory(tmp_path: Path) -> None:
    model = tiny_llama(tmp_path / "llama")
    out = swarmd_run(["demo", "--model", str(model),
                      "--steps", "20", "--json"], capture_output=True, text=True,
                     cwd=ROOT, timeout=400, env={**__import__("os").environ,
                                                 "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["final_val_loss"] < result["initial_val_loss"] and result["lost"] == 0


def test_swarmd_demo_names_a_directory_that_is_not_a_model(tmp_path: Path) -> None:
    out = swarmd_run(["demo", "--model", str(tmp_path),
                      "--steps", "2"], capture_output=True, text=True, cwd=ROOT,
                     timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"swarmd: error: {tmp_path}/config.json: cannot read the model config")
