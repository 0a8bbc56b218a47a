"""The local swarm launcher of tools/, for integration tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from local_swarm import ROOT, DaemonProcess, readline, wait_until  # noqa: E402,F401
