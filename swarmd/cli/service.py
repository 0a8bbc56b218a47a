"""``swarmd service install|uninstall``: the systemd unit (swarmd.node.service)."""

from __future__ import annotations

import argparse
import getpass
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from swarmd.cli.common import add_home_argument, home_from_args


def _service_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("install", "uninstall"))
    add_home_argument(parser)
    parser.add_argument("--user", action="store_true",
                        help="a user unit (~/.config/systemd/user) instead of a system unit")
    parser.add_argument("--unit-dir", type=Path, metavar="DIR",
                        help="write the unit here instead of systemd's directory")


@dataclass(frozen=True)
class ServiceResult:
    action: str
    unit: str
    #: uninstall: whether there was a unit to remove
    changed: bool
    #: what to run next
    next_steps: tuple[str, ...]
    #: systemd-analyze verify's complaints (None: not run, the tool is not installed)
    verify: str | None = None


def cmd_service(args: argparse.Namespace) -> ServiceResult:
    from swarmd.node import service

    path = service.unit_path(args.user, args.unit_dir)
    if args.action == "uninstall":
        removed = service.uninstall(path)
        ctl = "systemctl --user" if args.user else "sudo systemctl"
        steps = (f"{ctl} disable --now {service.UNIT_NAME}   # before, if it was enabled",
                 f"{ctl} daemon-reload")
        return ServiceResult("uninstall", str(path), removed, steps if removed else ())
    exe = shutil.which("swarmd") or str(Path(sys.executable).with_name("swarmd"))
    spec = service.UnitSpec(exe=str(Path(exe).resolve()), home=home_from_args(args).resolve(),
                            user=None if args.user else getpass.getuser(), user_mode=args.user)
    service.install(spec, path)
    return ServiceResult("install", str(path), True,
                         tuple(service.enable_hint(path, args.user)), _verify(path))


def _verify(path: Path) -> str | None:
    import subprocess

    tool = shutil.which("systemd-analyze")
    if tool is None:
        return None
    try:
        out = subprocess.run([tool, "verify", str(path)], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"systemd-analyze verify could not run: {exc}"
    text = "\n".join(line for line in (out.stdout + out.stderr).splitlines()
                     if "Unknown key 'Restart" not in line)  # newer keys, ignored by older systemd
    return text.strip() if out.returncode or text.strip() else ""


def text_service(result: ServiceResult) -> str:
    if result.action == "uninstall":
        if not result.changed:
            return f"no unit at {result.unit}: nothing to remove"
        return "\n".join([f"removed {result.unit}", "then:", *(f"  {s}" for s in result.next_steps)])
    lines = [f"wrote {result.unit}"]
    if result.verify:
        lines.append(f"systemd-analyze verify says:\n  {result.verify}")
    return "\n".join([*lines, "to start it now and at every boot:",
                      *(f"  {s}" for s in result.next_steps)])
