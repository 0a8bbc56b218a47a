"""The local HTTP API's token: ``<home>/api_token``, mode 0600.

The daemon calls :func:`create_token` when it starts (it reuses a valid token already there, so
a restart keeps the CLI working) and hands the token to :class:`swarmd.api.server.HttpApi`; the
CLI reads it with :func:`read_token` and sends it as ``Authorization: Bearer <token>`` on the
mutating endpoints (``POST /api/v0/stop``). Whoever can read the file can stop the daemon:
that is the operator's own account, as the home directory is mode 0700.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat
from pathlib import Path

from swarmd.errors import HomeError

__all__ = ["TOKEN_FILE", "create_token", "read_token", "token_path"]

TOKEN_FILE = "api_token"

log = logging.getLogger(__name__)

#: what :func:`secrets.token_urlsafe` produces (43 characters for 32 bytes); a token written
#: by hand is accepted if it is of this alphabet and at least as long as 24 random bytes
_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{32,256}")


def token_path(home: Path) -> Path:
    return Path(home) / TOKEN_FILE


def _valid(text: str) -> bool:
    return _TOKEN_RE.fullmatch(text) is not None


def _read_existing(path: Path) -> str | None:
    """The token at ``path`` if it is valid and private to its owner, else None."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise HomeError(f"API token {path} is not a regular file: remove it, and the daemon "
                        f"writes a new one when it starts")
    if st.st_mode & 0o077:
        log.warning("API token %s was readable by others (mode %o): replacing it with a new "
                    "one", path, stat.S_IMODE(st.st_mode))
        return None
    try:
        text = path.read_text(encoding="ascii").strip()
    except (UnicodeDecodeError, OSError):
        return None
    return text if _valid(text) else None


def create_token(home: Path) -> str:
    """The daemon's API token: the one in ``<home>/api_token`` if valid, else a new one.

    A new token is ``secrets.token_urlsafe(32)``, written atomically (a temporary file in the
    home, mode 0600, then renamed over ``api_token``), so a reader never sees half a token.
    """
    home = Path(home)
    path = token_path(home)
    existing = _read_existing(path)
    if existing is not None:
        return existing
    token = secrets.token_urlsafe(32)
    tmp = home / f".{TOKEN_FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="ascii") as out:
                out.write(token + "\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise HomeError(f"cannot write API token {path}: {exc.strerror}") from None
    return token


def read_token(home: Path) -> str:
    """The token the running daemon wrote; HomeError saying what to do if there is none."""
    home = Path(home)
    path = token_path(home)
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        raise HomeError(f"no API token {path}: a daemon writes it when it starts (`swarmd join "
                        f"--home {home}`); if one is running, the file was removed since: stop "
                        f"the daemon with Ctrl-C or `kill` and start it again") from None
    except UnicodeDecodeError:
        text = ""
    except OSError as exc:
        raise HomeError(f"cannot read API token {path}: {exc.strerror}") from None
    if not _valid(text):
        raise HomeError(f"API token {path} is not a valid token: remove it and restart the "
                        f"daemon, which writes a new one")
    return text
