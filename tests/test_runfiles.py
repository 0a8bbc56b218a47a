"""The home lock and the api file, in real processes where it matters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarmd.errors import HomeError
from swarmd.runfiles import API_FILE, HomeLock, remove_api_file, write_api_file


def test_second_lock_on_the_same_home_is_refused_with_the_holders_pid(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, pathlib; sys.path.insert(0, %r);"
        "from swarmd.runfiles import HomeLock;"
        "l = HomeLock(pathlib.Path(%r)); l.acquire(); print('locked', flush=True);"
        "sys.stdin.read()") % (str(Path(__file__).parents[1]), str(tmp_path))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(HomeError) as err:
            HomeLock(tmp_path).acquire()
        assert f"pid {holder.pid}" in str(err.value) and "swarmd stop" in str(err.value)
    finally:
        holder.kill()
        holder.wait()
    with HomeLock(tmp_path) as lock:  # the kernel dropped the dead holder's lock
        assert lock.path.read_text().strip() == str(os.getpid())


def test_lock_is_reusable_after_release(tmp_path: Path) -> None:
    lock = HomeLock(tmp_path)
    lock.acquire()
    lock.release()
    with HomeLock(tmp_path) as again:
        assert again.path.read_text().strip() == str(os.getpid())


def test_api_file_is_written_whole_and_removed_only_if_ours(tmp_path: Path) -> None:
    path = write_api_file(tmp_path, "http://127.0.0.1:1234")
    assert path.read_text() == "http://127.0.0.1:1234\n"
    assert (path.stat().st_mode & 0o777) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [API_FILE]  # no temp file left
    remove_api_file(tmp_path, "http://127.0.0.1:9999")  # another daemon's URL: kept
    assert path.exists()
    remove_api_file(tmp_path, "http://127.0.0.1:1234")
    assert not path.exists()
    remove_api_file(tmp_path, "http://127.0.0.1:1234")  # already gone: fine
