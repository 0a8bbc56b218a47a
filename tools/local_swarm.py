"""The local swarm launcher, for benchmarks run from tools/ (it lives in swarmd.local_swarm)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmd.local_swarm import ROOT, DaemonProcess, readline, wait_until  # noqa: E402,F401
