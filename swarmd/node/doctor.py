"""``swarmd doctor``: what stands between this machine and a working ``swarmd join``.

Each check returns a :class:`Check`: a verdict (``ok``, ``warn``, ``fail``), what was found, and
what to do. ``fail`` means joining cannot work as configured: the command then exits 1. The
bootstrap checks dial each address with a throwaway identity (never the home's, which a running
daemon may be using), ask the swarm manifest the peer runs and settle ours against it (what a
joiner would take from the swarm, or each own setting that differs), pull one page of the
peer's membership view over the swarm's protocol and compare its model (peers without a
manifest); the same page gives the peer's clock (announcements carry signed wall-clock time).
"""

from __future__ import annotations

import asyncio
import platform
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Check", "check_all", "local_checks", "bootstrap_checks"]

#: checkpoints need room: below this, warn
MIN_FREE_BYTES = 2 << 30
#: a peer's clock this far off (seconds, beyond its announcement's age) is worth a warning
CLOCK_WARN_S = 30.0
#: how long each of the doctor's probes of a bootstrap peer waits (a person is waiting)
PROBE_TIMEOUT_S = 8.0


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    verdict: str  # ok | warn | fail
    found: str
    fix: str = ""


def local_checks(home: Path, load_config: Any) -> tuple[list[Check], Any]:
    """Python, torch and the device, the config, the home. Returns the checks and the config
    (None when it does not load)."""
    checks = [_python()]
    config = None
    try:
        config = load_config()
    except Exception as exc:  # ConfigError: the message names the key and source
        checks.append(Check("config", "fail", str(exc), "fix the key it names (see "
                                                        "`swarmd init` for a documented file)"))
    else:
        checks.append(_config_diff(config))
        checks.append(_manifest(config))
    checks.append(_torch(config))
    checks += _home(home)
    return checks, config


def _python() -> Check:
    v = sys.version_info
    found = f"Python {platform.python_version()} ({sys.executable})"
    if v < (3, 11):
        return Check("python", "fail", found, "install Python 3.11 or later")
    return Check("python", "ok", found)


def _torch(config: Any) -> Check:
    from swarmd.models.registry import torch_placement_of

    try:
        import torch
    except Exception as exc:
        return Check("torch", "fail", f"torch does not import: {exc}",
                     "install torch 2.x into this environment")
    found = f"torch {torch.__version__}"
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        found += (f", CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)} "
                  f"({free / 2**30:.1f} of {total / 2**30:.1f} GiB free)")
    else:
        found += ", no CUDA device (training runs on the CPU)"
    if config is not None:
        try:
            device, dtype = torch_placement_of(config)
            found += f"; model.device = {config.model.device!r} picks {device}, {dtype}"
        except Exception as exc:
            return Check("torch", "fail", f"{found}; {exc}", "set model.device to one this "
                                                             "machine has (cpu, cuda, cuda:0)")
    return Check("torch", "ok", found)


def _config_diff(config: Any) -> Check:
    from swarmd.config import Config

    default = Config()
    changed = [f"{key} = {config.get(key)!r}" for key in _keys()
               if config.get(key) != default.get(key)]
    return Check("config", "ok", "every key valid; " + (
        "differs from the defaults in " + ", ".join(changed) if changed else "all defaults"))


def _manifest(config: Any) -> Check:
    """The swarm manifest this configuration runs (a joiner takes the swarm's instead, for
    every setting it left at its default)."""
    from swarmd.manifest.local import swarm_manifest

    try:
        manifest = swarm_manifest(config)
    except Exception as exc:  # ModelError: a model directory or tokenizer cannot be read
        return Check("manifest", "fail", str(exc), "fix model.hf or data.tokenizer")
    return Check("manifest", "ok", f"{manifest.hash}: {manifest.model_text()}, swarm "
                                   f"{manifest.swarm!r}")


def _keys() -> list[str]:
    from swarmd.config import field_specs

    return list(field_specs())


def _home(home: Path) -> list[Check]:
    key = home / "identity.key"
    if not key.exists():
        return [Check("home", "fail", f"{home} has no identity key",
                      f"run `swarmd init --home {home}`")]
    mode = stat.S_IMODE(key.stat().st_mode)
    checks = [Check("identity", "ok", f"{key} (mode {mode:04o})") if mode & 0o077 == 0 else
              Check("identity", "warn", f"{key} is readable by others (mode {mode:04o})",
                    f"chmod 600 {key}")]
    free = shutil.disk_usage(home).free
    checks.append(Check("disk", "ok" if free >= MIN_FREE_BYTES else "warn",
                        f"{free / 2**30:.1f} GiB free for checkpoints in {home}",
                        "" if free >= MIN_FREE_BYTES else "free some space: checkpoints are "
                                                          "written next to the home"))
    return checks


async def _probe(host: Any, addr: str, config: Any) -> Check:
    """Dial ``addr``; ask the swarm manifest it runs and settle ours against it (what this
    peer would take, or the settings that differ); pull one page of its view over the
    swarm's protocol; compare model and clock."""
    from transport.errors import DeadlineExceeded, TransportError

    name = f"bootstrap {addr}"
    tcp = await _tcp_reason(addr)
    if tcp is not None:
        return Check(name, "fail", tcp, _unreachable_fix(addr))
    try:
        peer = await host.dial(addr, timeout=PROBE_TIMEOUT_S)
    except DeadlineExceeded:
        return Check(name, "fail", "timed out: nothing answered", _unreachable_fix(addr))
    except TransportError as exc:
        why = "refused" if "refused" in str(exc).lower() else "failed"
        return Check(name, "fail", f"{why}: {exc}", _unreachable_fix(addr))
    settled = await _settle(host, peer, config)
    if isinstance(settled, Check):
        return Check(name, settled.verdict, settled.found, settled.fix)
    swarm_name, manifest_text = settled
    return await _pull(host, peer, name, config, swarm_name, manifest_text)


async def _settle(host: Any, peer: str, config: Any) -> tuple[str, str] | Check:
    """(the swarm's name, what its manifest means for this peer), or a failing check."""
    from swarmd.errors import BadManifest
    from swarmd.manifest.local import manifest_of, own_keys
    from swarmd.manifest.service import ask_manifest
    from swarmd.manifest.settle import settle

    try:
        swarm = await ask_manifest(host, peer, timeout_s=PROBE_TIMEOUT_S)
    except BadManifest as exc:
        return Check("", "fail", f"it sent an unusable swarm manifest ({exc})",
                     "join through another peer of the swarm, or tell its operator")
    except Exception:  # an older daemon: the model hash decides below
        return config.swarm.name, ""
    ours, _ = await asyncio.to_thread(manifest_of, config)
    outcome = settle(ours, own_keys(config, ours), swarm)
    if not outcome.ok:
        return Check("", "fail", f"the swarm runs manifest {swarm.hash} ({swarm.model_text()}); "
                                 f"this peer's own settings differ: "
                     + "; ".join(d.line() for d in outcome.conflicts),
                     "set them as the swarm does, or remove them from this peer's config to "
                     "take the swarm's")
    taken = (f", this peer takes {', '.join(outcome.adopted)} from it" if outcome.adopted
             else ", the same as this peer's")
    return swarm.swarm, f"manifest {swarm.hash} ({swarm.model_text()}){taken}"


async def _pull(host: Any, peer: str, name: str, config: Any, swarm_name: str,
                manifest_text: str) -> Check:
    """One page of the peer's view over ``swarm_name``'s protocol: its announcement, model
    hash (when no manifest settled it) and clock."""
    from swarmd.models.registry import model_hash_of
    from swarmd.membership import View, ViewConfig
    from swarmd.membership.announcement import encode_request
    from swarmd.protocols import Protocols
    from transport.errors import RemoteError, TransportError
    from transport.frames import Message
    from transport.signing import verify

    view = View(ViewConfig(stages=config.swarm.stages, model_hash=model_hash_of(config)), verify)
    try:
        reply = await host.request(peer, Protocols(swarm_name).view, Message(
            kind="pull", meta={"r": encode_request(view.pull_request(time.time(), None))}),
            timeout=PROBE_TIMEOUT_S)
        page = reply.meta.get("p")
        view.apply_page(page if isinstance(page, bytes) else b"", time.time())
    except (RemoteError, TransportError, Exception) as exc:
        return Check(name, "fail", f"connected, but it does not speak swarm "
                                   f"{swarm_name!r} ({type(exc).__name__}: {exc})",
                     "check swarm.name: it must be the same on every peer of a swarm")
    ann = view.get(peer)
    if ann is None:
        return Check(name, "warn", f"speaks swarm {swarm_name!r} but sent no signed "
                                   f"announcement of itself yet", "try again in a few seconds")
    if not manifest_text and ann.model_hash != model_hash_of(config):
        return Check(name, "fail", f"wrong model hash: it trains {ann.model_hash}, this "
                                   f"config trains {model_hash_of(config)}",
                     "use the swarm's [model] settings and swarm.model (its config.toml)")
    skew = time.time() - ann.timestamp
    found = (f"reachable, swarm {swarm_name!r}, "
             + (manifest_text if manifest_text else f"model {ann.model_hash}")
             + f", stage {ann.stage}, {len(view.announcements(time.time()))} peer(s) in its "
               f"view")
    if abs(skew) > ann.period + CLOCK_WARN_S:
        return Check(name, "warn", f"{found}; its clock is about {skew:+.0f} s from ours",
                     "run NTP (timedatectl set-ntp true): announcements from the future or "
                     "the far past are dropped by peers")
    return Check(name, "ok", f"{found}; clocks agree within {abs(skew):.0f} s")


async def _tcp_reason(addr: str) -> str | None:
    """Why a plain TCP connection to ``addr``'s host and port fails (None: it connects, or the
    address is not host + TCP port): resolves, refused, timed out."""
    import socket

    parts = addr.strip("/").split("/")
    if len(parts) < 4 or parts[0] not in ("ip4", "ip6", "dns", "dns4", "dns6") \
            or parts[2] != "tcp":
        return None
    host, port = parts[1], parts[3]
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"{host} does not resolve ({exc.strerror or exc})"
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            _, writer = await asyncio.open_connection(infos[0][4][0], int(port))
    except TimeoutError:
        return f"timed out: nothing answered at {host} port {port} within {PROBE_TIMEOUT_S:.0f} s"
    except ConnectionRefusedError:
        return f"refused: nothing listens at {host} port {port}"
    except OSError as exc:
        return f"cannot connect to {host} port {port}: {exc.strerror or exc}"
    writer.close()
    return None


def _unreachable_fix(addr: str) -> str:
    return (f"check that a daemon runs at {addr} (its `swarmd id`), that the address and "
            f"port are right and that no firewall blocks it")


async def _bootstrap_async(config: Any) -> list[Check]:
    from swarmd.node.host_options import host_options
    from transport import identity
    from transport.host import Host

    import logging

    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # the checks say what failed
    options = host_options(config, ["/ip4/127.0.0.1/tcp/0"])
    async with Host(identity.generate(), options) as host:
        return list(await asyncio.gather(*(_probe(host, a, config)
                                           for a in config.network.bootstrap)))


def bootstrap_checks(config: Any) -> list[Check]:
    if not config.network.bootstrap:
        return [Check("bootstrap", "ok", "none configured: `swarmd join` starts a new swarm")]
    import uvloop

    try:
        return uvloop.run(_bootstrap_async(config))
    except Exception as exc:
        return [Check("bootstrap", "fail", f"could not start a libp2p host to test with: {exc}",
                      "check network.* in the config")]


def reachability_check(home: Path) -> Check:
    """What the daemon running for ``home`` found out from its peers' dial-backs."""
    from swarmd.api.client import DaemonClient

    try:
        status = DaemonClient.for_home(home).status()
    except Exception:
        return Check("reachability", "warn", "unknown: no daemon runs for this home to ask "
                                             "(reachability is found out by a running daemon)",
                     "start `swarmd join`, then run `swarmd doctor` again")
    relays = ", ".join(status.relays) if status.relays else "none"
    if status.reachability == "private":
        return Check("reachability", "warn", f"private: peers cannot dial this machine; "
                                             f"relays in use: {relays}",
                     status.reachability_hint)
    if status.reachability == "public":
        return Check("reachability", "ok", "public: peers dialed this machine back")
    return Check("reachability", "warn", "unknown: not enough peers answered yet",
                 "run `swarmd doctor` again in a minute")


def check_all(home: Path, load_config: Any) -> list[Check]:
    checks, config = local_checks(home, load_config)
    if config is not None:
        checks += bootstrap_checks(config)
        checks.append(reachability_check(home))
    return checks


def blocking(checks: list[Check]) -> bool:
    return any(c.verdict == "fail" for c in checks)
