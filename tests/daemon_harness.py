"""The local swarm launcher (swarmd.local_swarm), for integration tests."""

from swarmd.local_swarm import (  # noqa: F401
    ROOT, DaemonProcess, readline, start_swarm, stop_all, wait_until)
