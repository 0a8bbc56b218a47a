"""The local swarm launcher (swarmd.local_swarm), for integration tests."""

from swarmd.local_swarm import ROOT, DaemonProcess, readline, wait_until  # noqa: F401
