"""The export's cut (pure): every stage at one step, or what it waits for; and its target
directory: written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from swarmd.errors import ExportTargetError
from swarmd.export.cut import Cut, Heard, Wait, decide
from swarmd.export.target import keep_newest, staging


def h(peer: str, step: int, digest: str = "d") -> Heard:
    return Heard(peer=peer, step=step, digest=digest)


def test_the_highest_step_every_stage_has_is_taken() -> None:
    cut = decide({0: [h("a", 5), h("b", 6)], 1: [h("c", 6), h("d", 5)]}, 2)
    assert isinstance(cut, Cut) and cut.step == 6
    assert [x.peer for x in cut.sources[0]] == ["b"] and [x.peer for x in cut.sources[1]] == ["c"]


def test_the_digest_most_peers_report_is_expected_and_its_peers_come_first() -> None:
    cut = decide({0: [h("a", 3, "x"), h("b", 3, "y"), h("c", 3, "y")]}, 1)
    assert isinstance(cut, Cut) and cut.expected[0] == "y"
    assert [x.peer for x in cut.sources[0]] == ["b", "c", "a"]


def test_a_stage_nobody_answered_for_is_waited_for_and_named() -> None:
    wait = decide({0: [h("a", 3)], 1: []}, 3)
    assert isinstance(wait, Wait) and wait.unserved == (1, 2)
    assert wait.explain().startswith("stages 1, 2 have no peer serving it")
    assert "`swarmd join --stage 1`" in wait.explain()


def test_a_lagging_stage_is_named_and_a_mixed_cut_takes_each_at_its_highest() -> None:
    heard = {0: [h("a", 7)], 1: [h("b", 6)], 2: [h("c", 7)]}
    wait = decide(heard, 3)
    assert isinstance(wait, Wait) and wait.lagging == ((1, 6),) and wait.lead == 7
    assert "stage 1 at step 6 lags behind step 7" in wait.explain()
    cut = decide(heard, 3, mixed=True)
    assert isinstance(cut, Cut) and cut.step is None and dict(cut.steps) == {0: 7, 1: 6, 2: 7}


def test_a_cut_below_min_step_waits_for_every_stage_below_it() -> None:
    heard = {0: [h("a", 4)], 1: [h("b", 4)]}
    wait = decide(heard, 2, min_step=5)
    assert isinstance(wait, Wait) and wait.lagging == ((0, 4), (1, 4)) and wait.lead == 5
    assert isinstance(decide(heard, 2, min_step=4), Cut)
    assert decide({0: [h("a", 5)], 1: [h("b", 5)]}, 2, min_step=5).step == 5


# ---- the target directory ---------------------------------------------------------------------

def test_a_successful_export_appears_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with staging(out) as tmp:
        assert tmp.parent == tmp_path and not out.exists()
        (tmp / "a").write_text("x")
    assert (out / "a").read_text() == "x" and sorted(os.listdir(tmp_path)) == ["out"]


def test_a_failed_export_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()  # an empty directory is a fine target, and stays empty on failure
    with pytest.raises(RuntimeError):
        with staging(out) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("the network went away")
    assert list(out.iterdir()) == [] and sorted(os.listdir(tmp_path)) == ["out"]


def test_a_non_empty_or_unwritable_target_is_refused_before_anything(tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine").write_text("keep me")
    with pytest.raises(ExportTargetError, match="is not empty"):
        with staging(busy):
            pass
    assert [p.name for p in busy.iterdir()] == ["mine"]
    (tmp_path / "file").write_text("")
    with pytest.raises(ExportTargetError, match="not a directory"):
        with staging(tmp_path / "file"):
            pass
    with pytest.raises(ExportTargetError, match="is not a directory"):
        with staging(tmp_path / "file" / "out"):
            pass
    if Path("/proc/self").is_dir():  # read-only even for root
        with pytest.raises(ExportTargetError, match="cannot"):
            with staging(Path("/proc/swarmd-export-out")):
                pass
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):  # root writes anywhere: checked above through /proc
        with pytest.raises(ExportTargetError, match="cannot write in"):
            with staging(locked / "out"):
                pass


def test_a_temporary_left_by_a_dead_process_is_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".out.partial-999999999-abcd"
    stale.mkdir()
    with staging(tmp_path / "out"):
        pass
    assert not stale.exists()


def test_replace_and_keep_newest(tmp_path: Path) -> None:
    import re

    for n in (1, 2, 3):
        with staging(tmp_path / f"step-{n}") as tmp:
            (tmp / "n").write_text(str(n))
    with staging(tmp_path / "step-3", replace=True) as tmp:
        (tmp / "n").write_text("3 again")
    assert (tmp_path / "step-3" / "n").read_text() == "3 again"
    removed = keep_newest(tmp_path, re.compile(r"step-(?P<n>\d+)"), 2)
    assert [p.name for p in removed] == ["step-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]
