"""The swarmd home directory: the node's identity key and its config file.

Layout::

    <home>/              mode 0700 when swarmd creates it
        identity.key     libp2p Ed25519 private key, mode 0600 (see ``transport.identity``)
        config.toml      copy of the documented default configuration, for the operator to edit
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from swarmd.errors import HomeError
from transport import identity as _identity
from transport.identity import Identity

__all__ = [
    "KEY_FILE", "CONFIG_FILE", "HOME_ENV", "InitResult", "resolve_home", "init_home",
    "load_identity", "home_config_path", "default_config_text",
]

KEY_FILE = "identity.key"
CONFIG_FILE = "config.toml"
HOME_ENV = "SWARMD_HOME"
DEFAULT_HOME = "~/.swarmd"


@dataclass(frozen=True)
class InitResult:
    home: Path
    peer_id: str
    key_path: Path
    config_path: Path
    #: False when an identity was already there and has been kept
    identity_created: bool
    #: False when a config file was already there and has been kept
    config_created: bool


def resolve_home(arg: str | None, env: Mapping[str, str]) -> Path:
    """The home directory: ``--home`` flag > ``$SWARMD_HOME`` > ``~/.swarmd``, made absolute."""
    chosen = arg if arg else env.get(HOME_ENV) or DEFAULT_HOME
    return Path(chosen).expanduser().absolute()


def default_config_text() -> str:
    """The documented default configuration shipped with the package."""
    from importlib.resources import files

    return files("swarmd.config").joinpath("default.toml").read_text(encoding="utf-8")


def home_config_path(home: Path) -> Path | None:
    """``<home>/config.toml`` if it exists, else None."""
    path = Path(home) / CONFIG_FILE
    return path if path.exists() else None


def _init_hint(home: Path) -> str:
    return f"run `swarmd init --home {home}`"


def init_home(path: Path) -> InitResult:
    """Create the home directory, identity and config file; keep any that already exist."""
    home = Path(path)
    if home.exists() and not home.is_dir():
        raise HomeError(f"home {home} exists and is not a directory")
    try:
        if not home.exists():
            home.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(home, 0o700)  # whatever the umask
    except OSError as exc:
        raise HomeError(f"cannot create home directory {home}: {exc.strerror}") from None

    key_path = home / KEY_FILE
    identity_created = False
    if key_path.exists() or key_path.is_symlink():
        ident = _identity.load(key_path)  # a broken key is reported, never replaced
    else:
        ident = _identity.generate()
        try:
            _identity.save(ident, key_path, overwrite=False)
            identity_created = True
        except FileExistsError:  # another `swarmd init` won the race: keep its key
            ident = _identity.load(key_path)
        except OSError as exc:
            raise HomeError(f"cannot write identity key {key_path}: {exc.strerror}") from None

    config_path = home / CONFIG_FILE
    config_created = False
    try:
        fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    except OSError as exc:
        raise HomeError(f"cannot write config file {config_path}: {exc.strerror}") from None
    else:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(default_config_text())
        config_created = True

    return InitResult(home=home, peer_id=ident.peer_id, key_path=key_path,
                      config_path=config_path, identity_created=identity_created,
                      config_created=config_created)


def load_identity(home: Path) -> Identity:
    """The identity in ``home``; HomeError telling to run ``swarmd init`` if there is none."""
    home = Path(home)
    if not home.is_dir():
        raise HomeError(f"home directory {home} does not exist: {_init_hint(home)}")
    key_path = home / KEY_FILE
    if not key_path.exists():
        raise HomeError(f"no identity key {key_path} in home {home}: {_init_hint(home)}")
    return _identity.load(key_path)
