"""Settling a peer's configuration against its swarm's manifest, before it serves anything.

* No bootstrap peer (it starts the swarm): its own manifest is the swarm's; kept in the home.
* A bootstrap peer answers: the swarm's manifest is fetched and checked
  (``swarmd.manifest.service``); own settings that differ stop the peer with one line per
  setting (:class:`~swarmd.errors.ManifestConflict`); the rest is taken from the swarm
  (``swarmd.manifest.local.adopt``) and the manifest kept in the home.
* No bootstrap peer answers: the manifest the home keeps (a volunteer restarting while its
  bootstrap peer is down), else its own settings, said in a warning.

A trainer takes nothing from the swarm (its data and model are built before it joins), so
:func:`check_trainer` refuses any difference.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmd.config import Config
from swarmd.errors import BadManifest, ManifestConflict
from swarmd.manifest.document import Manifest
from swarmd.manifest.local import adopt, keep, kept, kept_tokenizer, manifest_of, own_keys
from swarmd.manifest.service import Fetched, ask_manifest, fetch_manifest
from swarmd.manifest.settle import conflict_text, differences, settle

__all__ = ["Settled", "settle_config", "check_trainer"]

log = logging.getLogger("swarmd.manifest")


@dataclass(frozen=True, slots=True)
class Settled:
    """The configuration to run, its manifest and tokenizer bytes, and where it came from:
    ``own`` (this peer's: it starts the swarm, or nobody answered), ``swarm`` (a bootstrap
    peer's), ``kept`` (the home's, nobody answered); ``adopted``: settings taken."""

    config: Config
    manifest: Manifest
    tokenizer: bytes | None
    origin: str
    source: str = ""
    adopted: tuple[str, ...] = ()


async def settle_config(host: Any, config: Config, home: Path | None,
                        bootstrap: Sequence[str], *,
                        counters: Counter[str] | None = None) -> Settled:
    """The configuration this peer runs (module doc)."""
    ours, data = await asyncio.to_thread(manifest_of, config)
    if not bootstrap:
        await _keep(home, ours)
        return Settled(config, ours, data, "own", "this peer's configuration")
    fetched = await fetch_manifest(
        host, bootstrap, counters=counters,
        have_file=lambda ref: kept_tokenizer(home, ref) if home is not None else None)
    if fetched is None:
        held = kept(home) if home is not None else None
        tok = kept_tokenizer(home, held.tokenizer) if home is not None and held else None
        if held is None or held.hash == ours.hash or (held.tokenizer and tok is None):
            log.warning("no bootstrap peer said which manifest the swarm runs: running this "
                        "peer's own settings (manifest %s, %s); peers of another manifest "
                        "are kept out of routing", ours.hash, ours.model_text())
            return Settled(config, ours, data, "own", "this peer's configuration")
        fetched = Fetched(held, tok, "")
        origin, source = "kept", f"{home}/manifest.json (no bootstrap peer answered)"
    else:
        origin, source = "swarm", f"peer {fetched.peer}"
    swarm = fetched.manifest
    outcome = settle(ours, own_keys(config, ours), swarm)
    if not outcome.ok:
        raise ManifestConflict(conflict_text(outcome.conflicts, swarm.hash, source))
    if swarm.hash == ours.hash:
        await _keep(home, swarm)
        return Settled(config, ours, data, origin, source)
    if home is None:
        raise ManifestConflict(conflict_text(differences(ours, swarm), swarm.hash, source))
    result = await asyncio.to_thread(adopt, config, swarm, fetched.tokenizer, home,
                                     outcome.adopted)
    await _keep(home, swarm)
    log.info("took the swarm's manifest %s from %s: %s; settings taken: %s", swarm.hash,
             source, swarm.model_text(), ", ".join(outcome.adopted))
    return Settled(result, swarm, fetched.tokenizer, origin, source, outcome.adopted)


async def _keep(home: Path | None, manifest: Manifest) -> None:
    if home is not None:
        await asyncio.to_thread(keep, home, manifest)


async def check_trainer(host: Any, config: Config, peers: Sequence[str]) -> Manifest:
    """A trainer's manifest, compared with the first of ``peers`` (connected peer ids) that
    answers: any difference raises :class:`ManifestConflict` naming each setting. A peer that
    does not answer, or answers badly, is skipped (membership keeps peers of another
    manifest out of routing anyway)."""
    ours, _ = await asyncio.to_thread(manifest_of, config)
    for peer in peers:
        try:
            swarm = await ask_manifest(host, peer)
        except BadManifest as exc:
            log.warning("peer %s sent an unusable swarm manifest: %s", peer, exc)
            continue
        except Exception as exc:  # unreachable or an older peer: the next one
            log.debug("peer %s did not say its manifest: %s", peer, exc)
            continue
        found = differences(ours, swarm)
        if found:
            raise ManifestConflict(conflict_text(
                found, swarm.hash, f"peer {peer}", fix="set them as the swarm does (a trainer "
                                                       "takes no settings from the swarm)"))
        return ours
    return ours
