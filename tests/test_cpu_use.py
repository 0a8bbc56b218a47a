"""tools/cpu_use.py: a benchmark tells its own CPU use (its children's included) from other
processes' (a test run beside it)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

cpu_use = pytest.importorskip("cpu_use")

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux /proc")

SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def spin(seconds: float) -> list[str]:
    return [sys.executable, "-c", SPIN.format(s=seconds)]


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps orphans here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_child_that_ran_and_was_reaped_counts_as_ours() -> None:
    share = cpu_use.OthersShare().start()
    subprocess.run(spin(0.6), check=True, timeout=60)
    got = share.stop()
    ours_s = got["ours_share"] * got["seconds"] * cpu_use.os.cpu_count()
    assert ours_s >= 0.5


def test_a_live_grandchild_counts_as_ours() -> None:
    # the child runs the grandchild (and reaps it) once told to, then waits
    child = subprocess.Popen([sys.executable, "-c",
                              "import subprocess, sys\n"
                              "sys.stdin.readline()\n"
                              f"subprocess.run({spin(0.6)!r}, check=True)\n"
                              "print('done', flush=True)\n"
                              "sys.stdin.read()\n"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        share = cpu_use.OthersShare().start()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        got = share.stop()
    finally:
        child.communicate("", timeout=60)
    ours_s = got["ours_share"] * got["seconds"] * cpu_use.os.cpu_count()
    assert ours_s >= 0.5


def test_a_process_outside_our_tree_counts_as_others(tmp_path: Path) -> None:
    # started in a new session by a shell that exits at once (not our descendant any more);
    # it spins once the file ``go`` exists and then exits
    go, pid_file = tmp_path / "go", tmp_path / "pid"
    code = (f"import os, time\nd = time.monotonic() + 60\n"
            f"while not os.path.exists({str(go)!r}) and time.monotonic() < d: time.sleep(0.01)\n"
            + SPIN.format(s=0.6))
    script = tmp_path / "outside.py"
    script.write_text(code)
    subprocess.run(["sh", "-c", f"setsid {sys.executable} {script} >/dev/null 2>&1 & "
                                f"echo $! > {pid_file}"], check=True, timeout=10)
    pid = int(pid_file.read_text())
    assert pid not in cpu_use.descendants(cpu_use.os.getpid())
    share = cpu_use.OthersShare().start()
    go.touch()
    deadline = time.monotonic() + 60
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    got = share.stop()
    assert got["others_share"] * got["seconds"] * cpu_use.os.cpu_count() >= 0.5
    assert got["ours_share"] * got["seconds"] * cpu_use.os.cpu_count() < 0.3


def test_descendants_finds_children_and_not_ourselves() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        found = cpu_use.descendants(cpu_use.os.getpid())
    finally:
        child.communicate(b"", timeout=30)
    assert child.pid in found
    assert cpu_use.os.getpid() not in found
