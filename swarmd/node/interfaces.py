"""This machine's interface addresses, for announcing a host bound to ``0.0.0.0`` or ``::``.

Linux only (``SIOCGIFADDR`` per interface for IPv4, ``/proc/net/if_inet6`` for IPv6); elsewhere
it returns what it can (possibly nothing), and ``network.announce`` says what to announce.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

__all__ = ["interface_ips"]

_SIOCGIFADDR = 0x8915


def _ipv4() -> list[str]:
    out = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return out
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on that interface
                continue
            out.append(socket.inet_ntoa(packed[20:24]))
    return out


def _ipv6() -> list[str]:
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split()
        if len(fields) < 6:
            continue
        ip = ipaddress.IPv6Address(int(fields[0], 16))
        if not ip.is_link_local:  # needs a zone to dial
            out.append(str(ip))
    return out


def interface_ips() -> list[str]:
    """Every IPv4 and IPv6 address of this machine's interfaces (loopback included)."""
    seen: list[str] = []
    for ip in [*_ipv4(), *_ipv6()]:
        if ip not in seen:
            seen.append(ip)
    return seen
