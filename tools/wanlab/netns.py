"""Thin wrappers over ``ip``, ``tc`` and ``iptables-legacy``, and entering a namespace.

Every command has a deadline; a failing one raises :class:`LabError` with its stderr.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

from tools.wanlab.spec import LabError, LabUnavailable, parse_namespace

COMMAND_TIMEOUT_S = 15.0
CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"
IPTABLES = "iptables-legacy"


def sh(argv: Sequence[str], *, check: bool = True, timeout: float = COMMAND_TIMEOUT_S) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LabError(f"{' '.join(argv)}: no answer within {timeout:.0f} s") from None
    except FileNotFoundError:
        raise LabUnavailable(f"{argv[0]} is not installed (run tools/setup.sh --test as "
                             f"root)") from None
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def in_ns(ns: str, argv: Sequence[str], *, check: bool = True) -> str:
    return sh(["ip", "netns", "exec", ns, *argv], check=check)


def add_namespace(ns: str) -> None:
    sh(["ip", "netns", "add", ns])
    sh(["ip", "-n", ns, "link", "set", "lo", "up"])


def list_namespaces() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def namespace_pids(ns: str) -> list[int]:
    out = sh(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in out.split() if x.isdigit()]


def kill_namespace_processes(ns: str, grace_s: float = 0.0) -> None:
    """SIGKILL every process inside ``ns`` (after SIGTERM and ``grace_s`` when given)."""
    pids = namespace_pids(ns)
    if grace_s > 0 and pids:
        _signal_all(pids, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and namespace_pids(ns):
            time.sleep(0.05)
        pids = namespace_pids(ns)
    _signal_all(pids, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and namespace_pids(ns):
        time.sleep(0.02)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        if pid == os.getpid():
            continue  # never ourselves (a thread of ours may sit inside the namespace)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def delete_namespace(ns: str) -> None:
    """Kill what runs in ``ns`` and delete it; its veths (and their qdiscs) and its iptables
    rules go with it. No error when it is already gone."""
    if ns not in list_namespaces():
        return
    kill_namespace_processes(ns)
    sh(["ip", "netns", "del", ns], check=False)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftover_namespaces(names: Sequence[str] | None = None) -> list[str]:
    """Lab namespaces whose creating process is dead."""
    found = []
    for name in list_namespaces() if names is None else names:
        parsed = parse_namespace(name)
        if parsed is not None and not pid_alive(parsed[0]):
            found.append(name)
    return found


def cleanup_leftovers() -> list[str]:
    """Delete the namespaces of labs whose process died (killed, crashed); return their names."""
    gone = leftover_namespaces()
    for ns in gone:
        delete_namespace(ns)
    return gone


_libc = None


def _setns(fd: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextmanager
def entered(ns: str) -> Iterator[None]:
    """Run the body with this thread inside network namespace ``ns`` (other threads stay
    where they are). Sockets created in the body belong to ``ns`` for their whole life, also
    when used afterwards from any thread."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(os.path.join(NETNS_DIR, ns), os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


NETLINK_NETFILTER = 12
#: ctnetlink's "delete" with no tuple: the whole table (what ``conntrack -F`` sends)
_CT_FLUSH = (1 << 8) | 2  # NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_DELETE
_NLM_F_REQUEST_ACK = 0x1 | 0x4
_NLMSG_ERROR = 2


def flush_conntrack(ns: str) -> None:
    """Forget every connection the namespace's netfilter tracks (its NAT mappings too), as a
    router that restarts does: ``conntrack -F`` without the conntrack tool, over netlink."""
    with entered(ns):
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sock.settimeout(COMMAND_TIMEOUT_S)
        sock.bind((0, 0))
        body = struct.pack("=BBH", socket.AF_INET, 0, 0)  # nfgenmsg: family, version, res_id
        sock.send(struct.pack("=IHHII", 16 + len(body), _CT_FLUSH, _NLM_F_REQUEST_ACK, 1, 0)
                  + body)
        reply = sock.recv(4096)
    except OSError as exc:
        raise LabError(f"flushing conntrack in {ns} failed: {exc}") from None
    finally:
        sock.close()
    kind = struct.unpack("=H", reply[4:6])[0] if len(reply) >= 20 else None
    err = struct.unpack("=i", reply[16:20])[0] if kind == _NLMSG_ERROR else None
    if err not in (0, -2):  # 0: done; -ENOENT: nothing was tracked
        raise LabError(f"flushing conntrack in {ns}: the kernel answered {kind}/{err}")


def check_host(python: str) -> None:
    """Raise :class:`LabUnavailable` saying why this machine cannot run a lab."""
    if os.geteuid() != 0:
        raise LabUnavailable("the WAN lab needs root (network namespaces, tc, iptables); "
                             "run as root, as CI does")
    for tool in ("ip", "tc", IPTABLES):
        if shutil.which(tool) is None:
            raise LabUnavailable(f"{tool} is not installed: run tools/setup.sh --test as root "
                                 f"(apt packages iproute2, iptables)")
    probe = subprocess.run([python, "-c", "import netfilterqueue"], capture_output=True,
                           timeout=COMMAND_TIMEOUT_S)
    if probe.returncode != 0:
        raise LabUnavailable(f"{python} cannot import netfilterqueue: run tools/setup.sh --test "
                             f"as root (apt libnetfilter-queue-dev, pip netfilterqueue)")
    ns = f"swl-{os.getpid()}-0-probe"
    try:
        add_namespace(ns)
        in_ns(ns, [IPTABLES, "-w", "-A", "FORWARD", "-j", "NFQUEUE", "--queue-num", "0"])
    except LabError as exc:
        raise LabUnavailable(f"network namespaces or NFQUEUE do not work here: {exc}") from None
    finally:
        delete_namespace(ns)
