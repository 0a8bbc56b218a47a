"""The daemon's side of a graceful stop: leaving its stage within the stop's budget (the phases
and their deadlines are ``swarmd.node.shutdown``'s; the checkpoint is the keeper's)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from swarmd.node.shutdown import StopBudget

log = logging.getLogger("swarmd.node.daemon")

#: how long the ``leaving`` announcement is pushed to the connected peers, at most
LEAVE_PUSH_S = 2.0


async def leave_stage(*, server: Any, membership: Any, budget: StopBudget,
                      hurry: asyncio.Event, stage: int | None) -> None:
    """Refuse new microbatches at once and announce ``leaving`` (so routers stop choosing this
    peer); let those in flight here finish their backward until ``budget.drain_until`` (or
    until ``hurry`` is set) and hand back the rest (``StageServer.retire``). ``server`` is
    None for a peer that serves no stage yet."""
    now = time.monotonic()
    if server is not None:
        server.gate.retiring = True  # before the announcement: a forward now is refused
    announcing = asyncio.create_task(membership.leave(
        timeout=max(0.0, min(LEAVE_PUSH_S, budget.drain_until - now))))
    if server is not None:
        held = server.in_flight
        handed = await server.retire(max(0.0, budget.drain_until - now), hurry=hurry)
        log.info("leaving stage %s: %d microbatch(es) were in flight here, %d handed back to "
                 "their senders", stage, held, handed)
    hurried = asyncio.create_task(hurry.wait())
    try:  # bounded by its own timeout; a second stop request does not wait for it
        await asyncio.wait((announcing, hurried), return_when=asyncio.FIRST_COMPLETED)
    finally:
        hurried.cancel()
        announcing.cancel()
    log.info("announced leaving; %.1f s into the stop", time.monotonic() - budget.started_at)
