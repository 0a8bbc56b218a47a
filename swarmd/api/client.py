"""How the CLI finds and talks to a running daemon.

The daemon writes its HTTP API's URL to ``<home>/api`` once it is listening and removes the
file when it exits (``swarmd.runfiles.write_api_file`` and ``remove_api_file``). The CLI reads
it (:func:`find_daemon`) and calls the API with :class:`DaemonClient`, a small synchronous
client (urllib, 5 s timeouts, no proxies) that returns the same typed values the daemon serves.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from swarmd.api.token import token_path
from swarmd.api.types import ConnectedPeer, IdInfo, StatusInfo, SwarmInfo
from swarmd.errors import DaemonReplyError, DaemonUnreachable, HomeError
from swarmd.runfiles import API_FILE

__all__ = ["TIMEOUT_S", "api_file_path", "find_daemon", "DaemonClient", "wait_gone"]

#: every request's deadline (connect and each read)
TIMEOUT_S = 5.0


def api_file_path(home: Path) -> Path:
    return Path(home) / API_FILE


def find_daemon(home: Path) -> str:
    """The URL of the daemon running for ``home``; HomeError saying what to do if none is."""
    home = Path(home)
    path = api_file_path(home)
    try:
        url = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise HomeError(f"no swarmd daemon is running for home {home} (no {path} file): start "
                        f"one with `swarmd join --home {home}`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HomeError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not url.startswith("http://") or any(c.isspace() for c in url):
        raise HomeError(f"{path} does not hold a daemon's URL (http://HOST:PORT): remove it, "
                        f"then start the daemon with `swarmd join --home {home}`")
    return url


class DaemonClient:
    """Synchronous client of one daemon's HTTP API; errors are :class:`SwarmdError`\\ s."""

    def __init__(self, url: str, *, home: Path | None = None,
                 timeout: float = TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self.home = Path(home) if home is not None else None
        self.timeout = timeout
        # never through a proxy: the daemon is local, and http_proxy may be set for the user
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @classmethod
    def for_home(cls, home: Path) -> DaemonClient:
        return cls(find_daemon(home), home=home)

    # ---------------------------------------------------------------------------- commands

    def id_info(self) -> IdInfo:
        return IdInfo.from_json(self._request("GET", "/api/v0/id"))

    def status(self) -> StatusInfo:
        return StatusInfo.from_json(self._request("GET", "/api/v0/status"))

    def swarm(self) -> SwarmInfo:
        return SwarmInfo.from_json(self._request("GET", "/api/v0/swarm"))

    def peers(self) -> list[ConnectedPeer]:
        return [ConnectedPeer.from_json(p) for p in self._request("GET", "/api/v0/peers")]

    def stop(self, token: str) -> None:
        """Ask the daemon to shut down (it answers at once and exits shortly after)."""
        self._request("POST", "/api/v0/stop", token=token)

    # ------------------------------------------------------------------------------ plumbing

    def _stale_hint(self) -> str:
        if self.home is None:
            return "is the daemon still running?"
        return f"if it crashed, remove {api_file_path(self.home)}"

    def _request(self, method: str, path: str, *, token: str | None = None) -> Any:
        headers = {"Accept": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(self.url + path, method=method, headers=headers,
                                         data=b"" if method == "POST" else None)
        where = f"{method} {path}"
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                status, body = response.status, response.read()
        except urllib.error.HTTPError as exc:
            with exc:
                raise self._reply_error(where, exc.code, exc.read()) from None
        except (TimeoutError, socket.timeout):
            raise DaemonUnreachable(f"daemon at {self.url} did not answer {where} within "
                                    f"{self.timeout:g} s: it may be overloaded or stuck; "
                                    f"{self._stale_hint()}") from None
        except (urllib.error.URLError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            detail = getattr(reason, "strerror", None) or str(reason)
            raise DaemonUnreachable(f"daemon at {self.url} does not answer ({detail}); "
                                    f"{self._stale_hint()}") from None
        try:
            return json.loads(body)
        except ValueError:
            raise DaemonReplyError(f"{self.url} answered {where} with {status} but not with "
                                   f"swarmd's JSON: is it another program? {self._stale_hint()}",
                                   status=status) from None

    def _reply_error(self, where: str, status: int, body: bytes) -> DaemonReplyError:
        try:
            error = json.loads(body)["error"]
            code, message = str(error["code"]), str(error["message"])
        except (ValueError, KeyError, TypeError):
            return DaemonReplyError(f"{self.url} answered {where} with HTTP {status} and not "
                                    f"with swarmd's JSON: is it another program? "
                                    f"{self._stale_hint()}", status=status)
        if status in (401, 403) and self.home is not None:
            token_file = token_path(self.home)
            return DaemonReplyError(
                f"the daemon at {self.url} refused the API token from {token_file} ({message}); "
                f"the file must hold the token of the daemon running for home {self.home}: if "
                f"the file was replaced after the daemon started, stop the daemon with Ctrl-C "
                f"or `kill` and start it again", status=status, reply_code=code)
        return DaemonReplyError(f"the daemon at {self.url} answered {where} with HTTP {status} "
                                f"{code}: {message}", status=status, reply_code=code)


def wait_gone(path: Path, timeout: float, *, poll: float = 0.05) -> bool:
    """Whether ``path`` disappeared within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while path.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return True
