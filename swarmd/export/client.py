"""``swarmd export``'s peer: a client of the swarm for as long as the export takes.

It is a libp2p host of its own (a fresh identity: a running daemon's or trainer's home keeps
its own), announced in membership as ``joining`` with no stage, so that nobody routes to it
and no trainer takes it for a trainer to average with. It dials the bootstrap peers, waits for
a first view (``VIEW_TIMEOUT_S``), and exports (``swarmd.export.run``). When no peer of a stage
serves our model but peers of another model were seen, the error names what differs
(``swarmd.pipeline.model_info``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from swarmd.errors import ModelMismatch, StageUnavailable
from swarmd.export.collect import CollectSettings, PartsSource, Progress
from swarmd.export.run import ExportResult, export_model, parse_dtype
from swarmd.export.target import check_target
from swarmd.models.registry import model_fingerprint_of, model_seam_of
from swarmd.manifest.local import swarm_manifest

__all__ = ["export_from_swarm", "VIEW_TIMEOUT_S"]

VIEW_TIMEOUT_S = 30.0
#: a dial to a peer holding a stage to export
EXPORT_DIAL_TIMEOUT_S = 10.0


async def export_from_swarm(config: Any, *, bootstrap: Sequence[str], out: Path,
                            dtype: str = "float32", trainer_home: Path | None = None,
                            saved_home: Path | None = None,
                            settings: CollectSettings = CollectSettings(),
                            max_shard_size: int | str = "50GB",
                            listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
                            progress: Progress | None = None,
                            say: Callable[[str], None] = lambda line: None) -> ExportResult:
    """Join the swarm at ``bootstrap`` as a client and export its model into ``out``. The
    trainers' parts come from ``trainer_home``'s saved state when given, else from a trainer
    training now, else from ``saved_home``'s saved state (when given)."""
    from swarmd.export.parts import export_kind
    from swarmd.export.trainer_parts import RemoteTrainers, SavedParts
    from swarmd.membership.service import LocalState, MembershipService
    from swarmd.node.host_options import host_options
    from swarmd.node.interfaces import interface_ips
    from transport import identity
    from transport.host import Host

    parse_dtype(dtype)
    check_target(out)  # before any dial: a bad --out costs nothing
    export_kind(model_seam_of(config)[0])
    me = identity.generate()
    async with Host(me, host_options(config, listen)) as host:
        async with MembershipService(host, me, config, lambda: LocalState(None, "joining"),
                                     manifest=swarm_manifest(config).hash,
                                     interfaces=interface_ips) as m:
            await _dial(host, bootstrap, say)
            try:
                async with asyncio.timeout(VIEW_TIMEOUT_S):
                    await m.has_view.wait()
            except TimeoutError:
                raise StageUnavailable(f"no view of the swarm from {', '.join(bootstrap)} "
                                       f"within {VIEW_TIMEOUT_S:.0f} s: is it a peer of swarm "
                                       f"{config.swarm.name!r}?") from None
            parts: PartsSource = (
                SavedParts(trainer_home) if trainer_home is not None else RemoteTrainers(
                    m.trainers, fallback=SavedParts(saved_home) if saved_home else None))
            try:
                return await export_model(host, m, config, out, parts=parts, dtype=dtype,
                                          settings=settings, max_shard_size=max_shard_size,
                                          progress=progress, say=say)
            except StageUnavailable:
                reason = await _explain(host, m, config)
                if reason is not None:
                    raise ModelMismatch(f"{reason}; export with the swarm's model settings "
                                        f"(its config.toml)") from None
                raise


async def _dial(host: Any, bootstrap: Sequence[str], say: Callable[[str], None]) -> None:
    reached, failures = 0, []
    for addr in bootstrap:
        try:
            await host.dial(addr, timeout=EXPORT_DIAL_TIMEOUT_S)
            reached += 1
        except Exception as exc:  # the transport's many failures: the next address may work
            failures.append(f"{addr}: {exc}")
            say(f"bootstrap {addr} failed: {exc}")
    if not reached:
        raise StageUnavailable("cannot reach the swarm: " + ("; ".join(failures) or
                                                             "no bootstrap address"))


async def _explain(host: Any, m: Any, config: Any) -> str | None:
    from swarmd.pipeline.model_info import explain_mismatch, mismatched_peers

    peers = mismatched_peers(m.swarm_info())
    if not peers:
        return None
    return await explain_mismatch(host, config.swarm.name, config.swarm.model,
                                  model_fingerprint_of(config), peers)
