"""Which addresses a daemon announces to the swarm (issue 12, "Addresses"). Pure.

What a host is bound to is not what others can dial: ``/ip4/0.0.0.0`` means every interface,
a loopback address reaches only this machine, and a cloud VM's interface holds a private
address while the world reaches it at another. The rules, as kubo's ``Addresses.Announce`` and
``Addresses.NoAnnounce``:

1. ``network.announce``, when set, replaces the bound addresses (the user knows best).
2. Otherwise the bound ones, each unspecified address (``0.0.0.0``, ``::``) expanded to this
   machine's interface addresses of that family, on the same port.
3. Loopback addresses are dropped, unless nothing but loopback is left: a swarm on one machine
   (``swarmd demo``, tests) has nothing else to announce, and its peers are on this machine.
4. ``network.no_announce`` filters (CIDR blocks such as ``10.0.0.0/8``, or whole multiaddrs)
   drop what they match, whichever rule produced it.
5. Every address ends in ``/p2p/<peer id>``, duplicates are dropped, at most ``MAX_ANNOUNCED``.

:class:`ObservedAddresses` keeps what peers say they see us at (identify's observed address):
an address is believed only once ``min_observers`` distinct peers reported it within
``window_s``, so one peer cannot make us announce an address it chose.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["AddressPolicy", "announced_addrs", "parse_filter", "ObservedAddresses",
           "MAX_ANNOUNCED", "at_listen_port"]

#: most addresses in one announcement (membership bounds what it accepts the same way)
MAX_ANNOUNCED = 8

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_filter(text: str) -> Network | str:
    """A ``no_announce`` entry: a CIDR block (``10.0.0.0/8``, ``/ip4/10.0.0.0/ipcidr/8``, a
    bare address as a /32 or /128) or, for anything else starting with ``/``, a multiaddr
    matched whole. Raises ``ValueError`` saying what is accepted."""
    parts = text.strip("/").split("/")
    if text.startswith("/") and len(parts) == 4 and parts[0] in ("ip4", "ip6") \
            and parts[2] == "ipcidr":
        text = f"{parts[1]}/{parts[3]}"
    elif text.startswith("/"):
        if len(parts) < 2 or parts[0] not in ("ip4", "ip6", "dns", "dns4", "dns6"):
            raise ValueError(f"{text!r} is neither a CIDR block nor a multiaddr")
        return text.rstrip("/")
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise ValueError(f"{text!r} is not a CIDR block such as 10.0.0.0/8 or "
                         f"/ip4/10.0.0.0/ipcidr/8, nor a multiaddr") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class AddressPolicy:
    #: replaces the bound addresses when not empty
    announce: tuple[str, ...] = ()
    #: filters; see :func:`parse_filter`
    no_announce: tuple[str, ...] = ()
    _filters: tuple[Network | str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_filters", tuple(parse_filter(f) for f in self.no_announce))

    def blocks(self, addr: str) -> bool:
        """True when a ``no_announce`` filter matches ``addr`` (without its ``/p2p/`` part)."""
        bare = strip_peer_id(addr)
        ip = _ip_of(bare)
        for f in self._filters:
            if isinstance(f, str):
                if bare == f:
                    return True
            elif ip is not None and ip.version == f.version and ip in f:
                return True
        return False


def strip_peer_id(addr: str) -> str:
    head, sep, _ = addr.partition("/p2p/")
    return head if sep else addr


def _ip_of(addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    parts = addr.strip("/").split("/")
    if len(parts) >= 2 and parts[0] in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(parts[1])
        except ValueError:
            return None
    return None


def _expand(addr: str, interfaces: Sequence[str]) -> list[str]:
    """``addr`` with an unspecified IP replaced by each interface IP of its family."""
    ip = _ip_of(addr)
    if ip is None or not ip.is_unspecified:
        return [addr]
    parts = addr.strip("/").split("/")
    out = []
    for text in interfaces:
        try:
            other = ipaddress.ip_address(text)
        except ValueError:
            continue
        if other.version == ip.version and not other.is_unspecified:
            out.append("/" + "/".join([parts[0], str(other), *parts[2:]]))
    return out


def announced_addrs(bound: Iterable[str], interfaces: Sequence[str], policy: AddressPolicy,
                    peer_id: str) -> tuple[str, ...]:
    """What to announce: see the module's rules. ``bound`` are the host's listening multiaddrs,
    ``interfaces`` this machine's interface IPs (text)."""
    if policy.announce:
        candidates = [strip_peer_id(a) for a in policy.announce]
    else:
        candidates = [e for a in bound for e in _expand(strip_peer_id(a), interfaces)]
    ips = [_ip_of(a) for a in candidates]
    only_loopback = all(ip is not None and ip.is_loopback for ip in ips) if ips else False
    out: list[str] = []
    for addr, ip in zip(candidates, ips):
        if not policy.announce and ip is not None and ip.is_loopback and not only_loopback:
            continue
        if policy.blocks(addr):
            continue
        full = f"{addr}/p2p/{peer_id}"
        if full not in out:
            out.append(full)
    return tuple(out[:MAX_ANNOUNCED])


def at_listen_port(observed: str, bound: Sequence[str]) -> str | None:
    """What an observed address (identify) says about where peers could dial us: its IP with
    our listen port. A NAT gives each outbound connection a source port of its own, so the
    observed port is that connection's, never one a dialer can use; a forwarded port, or a
    NAT that keeps ports (a cloud VM's 1:1 NAT), reaches us at the listen port. Kept as is
    when it already is one of our listen ports; None when it is not a TCP address or we
    listen on no TCP port of its family."""
    parts = strip_peer_id(observed).strip("/").split("/")
    ip = _ip_of(strip_peer_id(observed))
    if ip is None or len(parts) != 4 or parts[2] != "tcp" or not parts[3].isdigit():
        return None
    ports = []
    for addr in bound:
        b = strip_peer_id(addr).strip("/").split("/")
        if len(b) >= 4 and b[0] == parts[0] and b[2] == "tcp" and b[3].isdigit():
            ports.append(b[3])
    if not ports:
        return None
    port = parts[3] if parts[3] in ports else ports[0]
    return f"/{parts[0]}/{ip}/tcp/{port}"


@dataclass(slots=True)
class ObservedAddresses:
    """Addresses peers observed us at; believed once several distinct peers agree."""

    min_observers: int = 3
    window_s: float = 600.0
    #: most distinct addresses tracked (a peer reporting many cannot grow this without bound)
    max_tracked: int = 32
    _seen: dict[str, dict[str, float]] = field(default_factory=dict)

    def observed(self, observer: str, addr: str, now: float) -> None:
        """``observer`` says it sees us at ``addr`` (a multiaddr without ``/p2p/``)."""
        addr = strip_peer_id(addr)
        ip = _ip_of(addr)
        if ip is None or ip.is_unspecified or ip.is_loopback:
            return
        self._expire(now)
        for observers in self._seen.values():  # one vote per observer: its latest report
            observers.pop(observer, None)
        if addr not in self._seen and len(self._seen) >= self.max_tracked:
            weakest = min(self._seen, key=lambda a: len(self._seen[a]))
            del self._seen[weakest]
        self._seen.setdefault(addr, {})[observer] = now

    def confirmed(self, now: float) -> tuple[str, ...]:
        """Addresses at least ``min_observers`` distinct peers reported within the window,
        most observers first."""
        self._expire(now)
        ok = [(len(o), a) for a, o in self._seen.items() if len(o) >= self.min_observers]
        return tuple(a for _, a in sorted(ok, key=lambda t: (-t[0], t[1])))

    def _expire(self, now: float) -> None:
        for addr in list(self._seen):
            observers = self._seen[addr]
            for peer in [p for p, t in observers.items() if now - t > self.window_s]:
                del observers[peer]
            if not observers:
                del self._seen[addr]
