"""The suite's slow-first order (tests/conftest.py) names files that exist."""

from __future__ import annotations

from pathlib import Path

from conftest import SLOW_FILES


def test_every_slow_file_named_first_exists() -> None:
    here = Path(__file__).parent
    assert [name for name in SLOW_FILES if not (here / name).is_file()] == []
    assert len(set(SLOW_FILES)) == len(SLOW_FILES)
