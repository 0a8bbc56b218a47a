"""The Docker image's scripts (no Docker needed): the CUDA build argument and the entry point."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("cuda, tag", [("cpu", "cpu"), ("11.8", "cu118"), ("12.4", "cu124"),
                                       ("12.8", "cu128")])
def test_each_known_cuda_version_picks_its_torch_wheels(cuda: str, tag: str) -> None:
    out = subprocess.run(["sh", str(ROOT / "tools/docker_torch.sh"), cuda, "--dry-run"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.rstrip().endswith(f"/whl/{tag}")


@pytest.mark.parametrize("cuda", ["13.7", "12", "cuda", ""])
def test_an_unknown_cuda_version_stops_the_build_with_the_known_ones(cuda: str) -> None:
    out = subprocess.run(["sh", str(ROOT / "tools/docker_torch.sh"), cuda or "x", "--dry-run"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "use one of: cpu 11.8" in out.stderr and not out.stdout


def test_the_dockerfile_documents_the_versions_the_script_knows() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    script = (ROOT / "tools/docker_torch.sh").read_text()
    known = re.findall(r"^  ([0-9.]+|cpu)\)", script, re.M)
    assert "one of: " + " ".join(known) in dockerfile
    assert 'sh /tmp/docker_torch.sh "$CUDA"' in dockerfile and "ARG CUDA=cpu" in dockerfile


def test_the_entry_point_creates_the_home_once_and_runs_swarmd(tmp_path: Path) -> None:
    env = {**os.environ, "SWARMD_HOME": str(tmp_path / "home"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    run = [str(ROOT / "tools/docker-entrypoint.sh"), "id", "--json"]
    first = subprocess.run(run, capture_output=True, text=True, timeout=60, env=env)
    assert first.returncode == 0, first.stderr
    again = subprocess.run(run, capture_output=True, text=True, timeout=60, env=env)
    assert json.loads(first.stdout)["peer_id"] == json.loads(again.stdout)["peer_id"]
