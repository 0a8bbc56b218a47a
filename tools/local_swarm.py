"""The local swarm launcher, for benchmarks run from tools/ (it lives in swarmd.local.swarm)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmd.local.swarm import (  # noqa: E402,F401
    DaemonProcess, readline, start_swarm, stop_all, wait_until)
