"""The local swarm launcher (swarmd.local.swarm), for integration tests; ``ROOT`` is the checkout."""

from pathlib import Path

from swarmd.local.swarm import (  # noqa: F401
    DaemonProcess, readline, start_swarm, stop_all, wait_until)

ROOT = Path(__file__).resolve().parents[1]
