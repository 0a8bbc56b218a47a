"""``swarmd service install|uninstall``: a systemd unit that keeps ``swarmd join`` running.

The unit restarts the daemon on failure with a growing delay (``RestartSteps`` and
``RestartMaxDelaySec`` on systemd 254 and later; 10 s steps before), stops it with SIGTERM and
gives it ``TimeoutStopSec`` to hand back its work and save its checkpoint. ``--user`` installs a
user unit (``~/.config/systemd/user``), else a system unit (``/etc/systemd/system``) that runs
as the invoking user. The file is written atomically: a failed install leaves nothing behind.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from swarmd.errors import SwarmdError

__all__ = ["UnitSpec", "render_unit", "unit_path", "install", "uninstall", "ServiceError",
           "UNIT_NAME"]

UNIT_NAME = "swarmd.service"


class ServiceError(SwarmdError):
    code = "service_error"


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitSpec:
    #: the swarmd executable (absolute path)
    exe: str
    home: Path
    #: system units only: the account the daemon runs as
    user: str | None = None
    user_mode: bool = False
    stop_timeout_s: int = 60


def render_unit(spec: UnitSpec) -> str:
    """The unit file's text. Pure."""
    command = " ".join(shlex.quote(p) for p in (spec.exe, "join", "--home", str(spec.home)))
    lines = [
        "[Unit]",
        "Description=swarmd: SWARM-parallel training daemon",
        "After=network-online.target",
        "Wants=network-online.target",
        "StartLimitIntervalSec=0",
        "",
        "[Service]",
        "Type=simple",
        f"ExecStart={command}",
        "Restart=on-failure",
        "RestartSec=10",
        "RestartSteps=6",
        "RestartMaxDelaySec=600",
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={spec.stop_timeout_s}",
        "Environment=PYTHONUNBUFFERED=1",
    ]
    if not spec.user_mode and spec.user:
        lines.append(f"User={spec.user}")
    lines += ["", "[Install]",
              f"WantedBy={'default.target' if spec.user_mode else 'multi-user.target'}", ""]
    return "\n".join(lines)


def unit_path(user_mode: bool, unit_dir: Path | None = None) -> Path:
    if unit_dir is not None:
        return unit_dir / UNIT_NAME
    if user_mode:
        config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        return config / "systemd" / "user" / UNIT_NAME
    return Path("/etc/systemd/system") / UNIT_NAME


def install(spec: UnitSpec, path: Path) -> Path:
    """Write the unit atomically to ``path``; ``ServiceError`` says what to do on failure."""
    from swarmd.files import write_atomic

    data = render_unit(spec).encode("utf-8")
    try:
        return write_atomic(path, lambda f: f.write(data), mode=0o644)
    except OSError as exc:
        raise ServiceError(_cannot_write(path, exc, spec.user_mode)) from None


def uninstall(path: Path) -> bool:
    """Remove the unit; False when there was none."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise ServiceError(f"cannot remove {path}: {exc.strerror or exc}; remove it as the "
                           f"user that installed it (sudo for a system unit)") from None
    return True


def _cannot_write(path: Path, exc: OSError, user_mode: bool) -> str:
    hint = ("use --user to install a unit for your own account, or run with sudo"
            if not user_mode else "choose another directory with --unit-dir")
    return f"cannot write the unit {path}: {exc.strerror or exc}; {hint}"


def enable_hint(path: Path, user_mode: bool) -> list[str]:
    """What to run next, as shell lines."""
    ctl = "systemctl --user" if user_mode else "sudo systemctl"
    lines = [f"{ctl} daemon-reload", f"{ctl} enable --now {UNIT_NAME}",
             f"journalctl {'--user ' if user_mode else ''}-u {UNIT_NAME} -f   # its log"]
    if user_mode:
        lines.append("loginctl enable-linger \"$USER\"   # keep it running while logged out")
    return lines
