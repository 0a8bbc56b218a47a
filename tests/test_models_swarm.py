"""The model seam through real swarms: a tiny Llama from a save_pretrained directory trained by
``swarmd train`` through two ``swarmd join`` daemons; a trainer of another dtype refused with a
message naming it; a trainer killed with SIGKILL resuming its step, data and weights; bad model
settings reported as one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from daemon_harness import ROOT, start_swarm, stop_all, wait_until
from swarmd.local.zygote import swarmd_popen, swarmd_run

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.integration

ENV = {"SWARMD_SWARM_STAGES": "2", "SWARMD_MODEL_THREADS": "1", "SWARMD_MODEL_SEQ_LEN": "32",
       "SWARMD_TRAINING_BATCH_SIZE": "4", "SWARMD_TRAINING_MICROBATCHES": "2",
       "SWARMD_TRAINING_LR": "0.003", "HF_HUB_OFFLINE": "1"}


def tiny_llama(directory: Path) -> Path:
    """A 4-layer Llama of width 32 over the 256 bytes, saved with its (random) weights."""
    import torch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def text_data(directory: Path) -> Path:
    directory.mkdir()
    lines = [json.dumps({"text": f"the swarm trains model number {i % 7} with care. " * 3})
             for i in range(400)]
    (directory / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def swarmd_train(home: Path, env: dict[str, str], *args: str,
                 timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return swarmd_run(
        ["train", "--home", str(home), "--json", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=timeout,
        env={**os.environ, **env})


def test_tiny_llama_trains_through_two_daemons_with_swarmd_train(tmp_path: Path) -> None:
    model, data = tiny_llama(tmp_path / "llama"), text_data(tmp_path / "data")
    env = {**ENV, "SWARMD_MODEL_HF": str(model), "SWARMD_SWARM_NAME": "hf-swarm"}
    daemons: list[Any] = []
    try:
        first, _ = start_swarm(tmp_path, [0, 1], env=env, into=daemons)
        out = swarmd_train(tmp_path / "trainer", env, "--bootstrap", first.addr, "--data",
                           str(data), "--steps", "25")
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["steps"] == 25 and result["lost"] == 0
        assert result["final_val_loss"] < 0.9 * result["initial_val_loss"]
        assert (tmp_path / "trainer" / "trainer" / "state.pt").is_file()
        # both daemons served the Llama's stages and stepped
        for d in daemons:
            counters = d.get("/api/v0/status")["counters"]
            assert counters["stage.backward"] > 0 and counters["stage.optimizer_steps"] > 0
        # the Llama's embedding is stage 0's (untied): the trainer sent it token ids
        assert [d.get("/api/v0/stage")["takes"] for d in daemons] == ["token ids", "activations"]
    finally:
        stop_all(daemons)


#: a model.factory end to end (the built-in GPT's seam, named as a user's would be), in
#: bfloat16: the float32 masters are part of the trainer's state
BF16_ENV = {**ENV, "SWARMD_SWARM_NAME": "bf16-swarm", "SWARMD_MODEL_WIDTH": "32",
            "SWARMD_MODEL_LAYERS": "2", "SWARMD_MODEL_HEADS": "2",
            "SWARMD_CHECKPOINT_EVERY_STEPS": "1",
            "SWARMD_MODEL_FACTORY": "swarmd.models.builtin:BuiltinGPT",
            "SWARMD_MODEL_DTYPE": "bfloat16"}


@pytest.fixture(scope="module")
def bf16_swarm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two daemons serving the bfloat16 built-in GPT, shared by the tests below: the refused
    trainer only reads from them, the resumed one trains through them."""
    daemons: list[Any] = []
    try:
        yield start_swarm(tmp_path_factory.mktemp("bf16-swarm"), [0, 1], env=BF16_ENV,
                          into=daemons)
    finally:
        stop_all(daemons)


def test_a_trainer_of_another_dtype_is_refused_naming_the_dtype(tmp_path: Path,
                                                                bf16_swarm: Any) -> None:
    first, _ = bf16_swarm
    out = swarmd_train(tmp_path / "trainer", {**BF16_ENV, "SWARMD_MODEL_DTYPE": "float32"},
                       "--bootstrap", first.addr, "--steps", "3", timeout=200)
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("swarmd: error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    # the swarm's manifest names the setting, one line each, after the error's first line
    after = out.stderr[out.stderr.index(errors[0]):].splitlines()
    assert after[1] == "  model.dtype = 'float32' here, 'bfloat16' in the swarm", after
    assert "Traceback" not in out.stderr
    # the daemons are unharmed and still serve
    for d in bf16_swarm:
        assert d.proc.poll() is None and d.get("/api/v0/status")["state"] == "online"


def test_a_trainer_killed_with_sigkill_resumes_its_step_data_and_weights(
        tmp_path: Path, bf16_swarm: Any) -> None:
    from swarmd.state import trainer_state

    data = text_data(tmp_path / "data")
    env = BF16_ENV
    home = tmp_path / "trainer"
    first, _ = bf16_swarm
    proc = swarmd_popen(
        ["train", "--home", str(home), "--json",
         "--bootstrap", first.addr, "--data", str(data), "--steps", "10000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, **env})
    try:
        wait_until(lambda: (trainer_state.load(home) or _NoState).step >= 3, 240,
                   "the trainer saved its state at step 3")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    saved = trainer_state.load(home)
    assert saved is not None and saved.step >= 3
    assert saved.data["kind"] == "windows" and saved.data["index"] > 0  # a shuffled order
    masters = saved.optimizer.get("masters")  # part of the optimizer's state
    assert masters and all(m.dtype == torch.float32 for m in masters)
    digest = trainer_state.params_digest(saved.params)

    out = swarmd_train(home, env, "--bootstrap", first.addr, "--data", str(data),
                       "--steps", str(saved.step + 2), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = [line for line in out.stdout.splitlines() + out.stderr.splitlines()
               if line.startswith(f"resumed from step {saved.step} ")]
    assert resumed, out.stderr[-3000:]
    assert f"weights {digest}" in resumed[0]
    assert json.dumps(saved.data) in resumed[0]  # the data goes on from exactly there
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps"] == saved.step + 2 and result["resumed_from"] == saved.step
    after = trainer_state.load(home)
    assert after is not None and after.step == saved.step + 2
    assert (after.data["epoch"], after.data["index"]) != (saved.data["epoch"],
                                                          saved.data["index"])
    assert after.data["corpus"] == saved.data["corpus"]  # the data went on from there
    steps = [line["step"] for line in map(json.loads, (home / "train-metrics.jsonl")
                                          .read_text().splitlines()) if "loss" in line]
    assert steps[-2:] == [saved.step + 1, saved.step + 2]  # not from 1 again


class _NoState:
    step = -1


@pytest.mark.parametrize("env, expected", [
    ({"SWARMD_MODEL_HF": "/nonexistent/model"},
     "/nonexistent/model/config.json: cannot read the model config"),
    ({"SWARMD_MODEL_FACTORY": "no_such_module:build"},
     'model.factory = "no_such_module:build": cannot import no_such_module'),
    ({"SWARMD_MODEL_FACTORY": "json:dumps"}, 'model.factory = "json:dumps" failed: TypeError'),
    ({"SWARMD_MODEL_FACTORY": "builtins:repr"}, "returned str, not a swarmd.models.seam.ModelSeam"),
])
def test_bad_model_settings_reach_the_user_as_one_line(tmp_path: Path, env: dict[str, str],
                                                       expected: str) -> None:
    commands = (["train", "--bootstrap", "/ip4/127.0.0.1/tcp/9/p2p/"
                 "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN", "--steps", "1"],
                ["join", "--stage", "0", "--listen", "/ip4/127.0.0.1/tcp/0"])
    swarmd_run(["init", "--home", str(tmp_path / "join")],
               check=True, capture_output=True, cwd=ROOT)  # a trainer makes its own
    running = [swarmd_popen(  # both at once
        [command[0], "--home", str(tmp_path / command[0]),
         *command[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, **ENV, **env}) for command in commands]
    for proc in running:
        stdout, stderr = proc.communicate(timeout=120)
        out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        assert out.returncode != 0
        lines = out.stderr.strip().splitlines()
        assert lines and lines[-1].startswith("swarmd: error: ") and expected in lines[-1], \
            out.stderr[-2000:]
        assert "Traceback" not in out.stderr
