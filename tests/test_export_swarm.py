"""``swarmd export`` and ``swarmd sample`` through a real swarm: a tiny Hugging Face Llama
trained a few steps by ``swarmd train`` through two ``swarmd join`` daemons, exported by the
trainer itself (``training.export_every``) and by ``swarmd export``; ``transformers`` loads both
exports, and its loss on the trainer's own validation batches is the trainer's last reported
validation loss; ``swarmd sample`` prints text; a stage nobody serves any more is named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from daemon_harness import start_swarm, stop_all
from test_models_swarm import ENV, swarmd_train, text_data, tiny_llama
from swarmd.models.registry import model_seam_of

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]  # daemons, a run, exports

STEPS = 3


def held_out_loss(directory: Path, env: dict[str, str], data: Path) -> float:
    """The loss ``transformers`` computes on the trainer's own validation batches."""
    from swarmd.config import load_config
    from swarmd.training.batches import make_batches

    config = load_config(None, env)
    seam, tokenizer = model_seam_of(config)
    batches = make_batches(config, tokenizer, data_path=data, batch=config.training.batch_size,
                           seq_len=min(config.model.seq_len, seam.max_seq_len),
                           val_batches=config.training.val_batches)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    losses = []
    with torch.no_grad():
        for x, y in batches.val:
            logits = model(input_ids=x).logits
            losses.append(float(torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))))
    return sum(losses) / len(losses)


def test_a_trained_swarm_exports_a_model_transformers_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from swarmd.cli import main

    model, data = tiny_llama(tmp_path / "llama"), text_data(tmp_path / "data")
    env = {**ENV, "SWARMD_MODEL_HF": str(model), "SWARMD_SWARM_NAME": "export-swarm",
           "SWARMD_WIRE_CODEC": "none", "SWARMD_TRAINING_EXPORT_EVERY": str(STEPS),
           "SWARMD_TRAINING_WARMUP_STEPS": "0"}
    daemons: list[Any] = []
    try:
        first, second = start_swarm(tmp_path, [0, 1], env=env, into=daemons)
        trainer = tmp_path / "trainer"
        out = swarmd_train(trainer, env, "--bootstrap", first.addr, "--data", str(data),
                           "--steps", str(STEPS))
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["steps"] == STEPS and result["lost"] == 0
        reported = result["final_val_loss"]

        # the trainer's own export, at its last step
        own = trainer / "exports" / f"step-{STEPS}"
        assert f"exported step {STEPS} to {own}" in out.stderr, out.stderr[-3000:]
        manifest = json.loads((own / "swarmd-export.json").read_text())
        assert manifest["step"] == STEPS and all(p["verified"] for p in manifest["parts"])

        # swarmd export, the trainer gone: its parts from the state it saved in its home
        monkey = pytest.MonkeyPatch()
        for key, value in env.items():
            monkey.setenv(key, value)
        try:
            exported = tmp_path / "export"  # the swarm reached through a daemon's home
            status = main(["export", "--home", str(first.home), "--out", str(exported),
                           "--trainer-home", str(trainer), "--json"])
            printed = capsys.readouterr()
            assert status == 0, printed.err[-3000:]
            report = json.loads(printed.out.strip().splitlines()[-1])
            assert report["step"] == STEPS and report["kind"] == "hf"
            assert [(p["part"], p["step"]) for p in report["parts"]] == [
                ("stage 0", STEPS), ("stage 1", STEPS), ("trainers", STEPS)]
            assert {"config.json", "model.safetensors", "generation_config.json"} <= {
                p.name for p in exported.iterdir()}

            for directory in (own, exported):
                loss = held_out_loss(directory, env, data)
                assert abs(loss - reported) <= 1e-3 * reported, (directory, loss, reported)
            # the check tells the trained weights from the initial ones
            initial = held_out_loss(model, env, data)
            assert abs(initial - result["initial_val_loss"]) <= 1e-3 * initial
            assert abs(initial - reported) > 1e-2 * reported, (initial, reported)

            assert main(["sample", "--model", str(exported), "--prompt", "the swarm",
                         "--max-new-tokens", "12", "--seed", "1"]) == 0
            text = capsys.readouterr().out
            assert text.startswith("the swarm") and len(text.strip()) > len("the swarm")

            # a stage nobody serves any more: named, and nothing written
            stop_all([second])
            gone = tmp_path / "gone"
            status = main(["export", "--home", str(tmp_path / "exporter"), "--bootstrap",
                           first.addr, "--out", str(gone), "--trainer-home", str(trainer),
                           "--timeout", "2"])
            errors = capsys.readouterr().err.strip().splitlines()
            assert status == 1 and errors[-1].startswith("swarmd: error: ")
            assert "stage 1 has no peer serving it" in errors[-1]
            assert not gone.exists()
        finally:
            monkey.undo()
    finally:
        stop_all(daemons)


def test_an_export_into_a_non_empty_directory_is_refused_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from swarmd.cli import main

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    status = main(["export", "--home", str(tmp_path / "h"), "--bootstrap",
                   "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
                   "--out", str(busy)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1
    assert err[0] == (f"swarmd: error: --out {busy}: it is not empty; choose a new directory "
                      f"or remove what is in it (an export never mixes with other files)")
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
