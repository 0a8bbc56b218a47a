"""Keep a daemon connected: dial the bootstrap peers at start and whenever every connection
is lost, with backoff (``swarmd.node.reconnect`` decides when), saying why each round failed."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, Sequence

from swarmd.node.reconnect import Backoff, Redialer

log = logging.getLogger("swarmd.node.daemon")

#: how often the connection count is looked at
CONNECTIVITY_CHECK_S = 2.0


async def keep_connected(host: Any, bootstrap: Sequence[str], rng: random.Random,
                         check_s: float = CONNECTIVITY_CHECK_S) -> None:
    """Runs until cancelled (a task of the daemon's group); no failure is fatal."""
    redialer = Redialer(Backoff(initial_s=1.0, max_s=60.0))
    while True:
        now = time.monotonic()
        connected = len(await host.connected_peers())
        if redialer.should_dial(now, connected, bool(bootstrap)):
            errors = []
            for addr in bootstrap:
                try:
                    await host.dial(addr)
                except Exception as exc:  # every failure is reported, none is fatal
                    errors.append(f"{addr}: {exc}")
            if len(errors) < len(bootstrap):
                if redialer.failures:
                    log.info("reconnected to the swarm after %d failed rounds",
                             redialer.failures)
                redialer.succeeded()
            else:
                wait = redialer.failed(now, rng)
                log.warning("no bootstrap peer answered (%s); retrying in %.0f s",
                            "; ".join(errors), wait)
        await asyncio.sleep(check_s)
