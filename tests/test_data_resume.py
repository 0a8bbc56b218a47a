"""A trainer process killed with SIGKILL continues its data exactly: the position it saved in
its trainer state (swarmd.state.trainer_state, written atomically after every batch)
restores the same shuffled order, the next batch first."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap

from daemon_harness import ROOT, wait_until
from data_helpers import number_corpus, open_numbers
from swarmd.state import trainer_state

#: the trainer's data loop: a batch, its digest logged, the state saved (as `swarmd train`
#: saves it between steps)
CHILD = textwrap.dedent("""
    import hashlib, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[4])
    from data_helpers import open_numbers
    from swarmd.state import trainer_state

    root, cache, home = map(Path, sys.argv[1:4])
    data = open_numbers(root, cache, shard="1/2", seed=11)
    with open(home / "batches.log", "a") as log:
        for step in range(1, 100_000):
            x, y = data.next()
            log.write(hashlib.sha256(x.numpy().tobytes()).hexdigest() + "\\n")
            log.flush()
            trainer_state.save(home, trainer_state.TrainerState(
                step=step, model_hash="m", params={}, optimizer={}, data=data.state()))
""")


def _digest(batch) -> str:  # type: ignore[no-untyped-def]
    return hashlib.sha256(batch[0].numpy().tobytes()).hexdigest()


def test_a_trainer_killed_with_sigkill_continues_the_same_order(tmp_path) -> None:
    root, cache, home = number_corpus(tmp_path / "c", docs=60), tmp_path / "cache", tmp_path / "h"
    home.mkdir()
    open_numbers(root, cache).close()  # the token cache, built once before
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(cache), str(home),
                             str(ROOT / "tests")], cwd=ROOT, env=os.environ.copy(),
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: proc.poll() is not None or (
            (s := trainer_state.load(home)) is not None and s.step >= 200), 120,
            "the child saved its state past step 200 (more than an epoch of its shard)")
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(30)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    saved = trainer_state.load(home)
    assert saved is not None and saved.data["kind"] == "windows" and saved.data["epoch"] >= 1
    logged = (home / "batches.log").read_text().split()
    assert len(logged) >= saved.step

    reference = open_numbers(root, cache, shard="1/2", seed=11)  # never interrupted
    order = [_digest(reference.next()) for _ in range(saved.step + 20)]
    assert logged[:saved.step] == order[:saved.step]  # the killed run read this very order
    resumed = open_numbers(root, cache, shard="1/2", seed=11)
    resumed.restore(saved.data)
    assert [_digest(resumed.next()) for _ in range(20)] == order[saved.step:]
    reference.close(), resumed.close()
