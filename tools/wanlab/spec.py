"""What a lab is made of, as values: links, hosts, addresses, names, the delayer's messages.

Pure: no I/O, no clock, no global random state. :mod:`tools.wanlab.lab` turns these values
into namespaces, veths, qdiscs and iptables rules; :mod:`tools.wanlab.delayer` applies the
per-host delay and loss they describe.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["LAB_NET", "Link", "HostSpec", "LabUnavailable", "LabError", "host_addr", "router_addr",
           "private_addr", "gateway_inside_addr",
           "namespace_names", "parse_namespace", "tbf_args", "LinkState", "encode_control",
           "decode_control", "needs_queue"]

#: every lab address lies in here (RFC 2544 benchmarking space), inside lab namespaces only
LAB_NET = ipaddress.ip_network("198.18.0.0/15")
MAX_HOSTS = 250
NS_PREFIX = "swl"
LAB_MTU = 9000
_HOST_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_NS_NAME = re.compile(rf"^{NS_PREFIX}-(\d+)-(\d+)-([a-z][a-z0-9]*(?:-gw)?)$")


class LabError(Exception):
    """The lab was set up or used wrongly (a bad spec, an unknown host)."""


class LabUnavailable(LabError):
    """This machine cannot run the lab (not root, no namespaces, a tool missing): the reason
    says which, and what would fix it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """One host's access link to the router. ``delay_ms`` is the link's one-way delay (each
    direction): a packet between two hosts crosses both hosts' links, so host A to host B
    takes ``A.delay_ms + B.delay_ms``. Rates in Mbit/s (10**6 bit/s); None: not shaped.
    ``loss`` is the probability that a packet crossing the link (either direction) is lost."""

    delay_ms: float = 0.0
    down_mbit: float | None = None
    up_mbit: float | None = None
    loss: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.delay_ms <= 10_000.0:
            raise LabError(f"Link.delay_ms must be within 0..10000, not {self.delay_ms}")
        for name in ("down_mbit", "up_mbit"):
            rate = getattr(self, name)
            if rate is not None and not 0.01 <= rate <= 100_000.0:
                raise LabError(f"Link.{name} must be None or within 0.01..100000, not {rate}")
        if not 0.0 <= self.loss <= 1.0:
            raise LabError(f"Link.loss is a probability (0..1), not {self.loss}")


@dataclass(frozen=True, slots=True, kw_only=True)
class HostSpec:
    """A lab host: a network namespace with one link to the router. With ``nat``, the host
    sits behind its own NAT gateway (a namespace of its own that masquerades): the host has a
    private address (198.19.<i+1>.2) no other host can reach; its packets leave with the
    gateway's public one (198.18.<i+1>.2), and the link (rates, delay, loss) is the gateway's."""

    name: str
    link: Link = dataclasses.field(default_factory=Link)
    nat: bool = False

    def __post_init__(self) -> None:
        if not _HOST_NAME.match(self.name):
            raise LabError(f"host name {self.name!r}: use 1-12 lowercase letters and digits, "
                           f"starting with a letter")
        if self.name == "r":
            raise LabError("host name 'r' is the router's")


def validate_hosts(hosts: Sequence[HostSpec]) -> None:
    if not hosts:
        raise LabError("a lab needs at least one host")
    if len(hosts) > MAX_HOSTS:
        raise LabError(f"a lab holds at most {MAX_HOSTS} hosts, not {len(hosts)}")
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise LabError(f"host names must be unique: {names}")


def host_addr(index: int) -> str:
    """Host ``index``'s address (its subnet is 198.18.<index+1>.0/24)."""
    return str(LAB_NET.network_address + ((index + 1) << 8) + 2)


def router_addr(index: int) -> str:
    """The router's address on host ``index``'s subnet: the host's gateway."""
    return str(LAB_NET.network_address + ((index + 1) << 8) + 1)


def private_addr(index: int) -> str:
    """A NAT'd host ``index``'s own address, behind its gateway (198.19.<index+1>.2)."""
    return str(LAB_NET.network_address + (1 << 16) + ((index + 1) << 8) + 2)


def gateway_inside_addr(index: int) -> str:
    """A NAT gateway's address on its host's side: the host's route."""
    return str(LAB_NET.network_address + (1 << 16) + ((index + 1) << 8) + 1)


def namespace_names(pid: int, serial: int, hosts: Sequence[HostSpec]) -> dict[str, str]:
    """``{"r": router namespace, host name: host namespace, "<host>-gw": its NAT gateway's}``,
    unique per process and lab."""
    base = f"{NS_PREFIX}-{pid}-{serial}"
    names = {"r": f"{base}-r", **{h.name: f"{base}-{h.name}" for h in hosts}}
    names.update({f"{h.name}-gw": f"{base}-{h.name}-gw" for h in hosts if h.nat})
    return names


def parse_namespace(name: str) -> tuple[int, int] | None:
    """``(pid, serial)`` of a lab namespace name, None for any other name."""
    m = _NS_NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def tbf_args(mbit: float) -> list[str]:
    """``tc qdisc ... tbf`` arguments for ``mbit``: the bucket holds about 20 ms at the rate
    (tbf needs at least rate/HZ; 2 MB worked at 1 Gbit/s) and never less than 64 KiB (seven
    9000-byte packets); the queue behind it holds about 100 ms at the rate, at least 256 KiB."""
    bytes_per_s = mbit * 1e6 / 8
    burst = max(64 << 10, int(bytes_per_s / 50))
    limit = max(256 << 10, int(bytes_per_s / 10)) + burst
    return ["tbf", "rate", f"{int(mbit * 1e6)}bit", "burst", str(burst), "limit", str(limit)]


def needs_queue(link: Link, faulted: bool) -> bool:
    """Whether the host's packets must pass through the delayer (NFQUEUE); packets between
    two hosts that need none bypass it."""
    return link.delay_ms > 0 or link.loss > 0 or faulted


# ---- the delayer's control messages (JSON lines on its stdin) ---------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class LinkState:
    """What the delayer applies to one host's packets. ``blocked``: every packet to or from
    the host is dropped (a partition); ``stall_s``: dropped for that many seconds from when the
    delayer receives the message."""

    host: str  # the host's lab address
    delay_ms: float = 0.0
    loss: float = 0.0
    blocked: bool = False
    stall_s: float = 0.0

    def __post_init__(self) -> None:
        if ipaddress.ip_address(self.host) not in LAB_NET:
            raise LabError(f"{self.host} is not a lab address")
        if not 0.0 <= self.delay_ms <= 10_000.0 or not 0.0 <= self.loss <= 1.0:
            raise LabError(f"bad delay or loss: {self.delay_ms} ms, {self.loss}")
        if not 0.0 <= self.stall_s <= 3600.0:
            raise LabError(f"stall_s must be within 0..3600, not {self.stall_s}")


def encode_control(seq: int, links: Sequence[LinkState] = (), stats: bool = False) -> bytes:
    body: dict[str, Any] = {"seq": seq, "links": [dataclasses.asdict(s) for s in links]}
    if stats:
        body["stats"] = True
    return json.dumps(body).encode() + b"\n"


def decode_control(line: bytes) -> tuple[int, list[LinkState], bool]:
    """One control line: ``(seq, link states, stats wanted)``; unknown keys are dropped and a
    malformed line raises :class:`LabError`."""
    try:
        body = json.loads(line)
        seq = int(body["seq"])
        links = [_link_state(x) for x in body.get("links", [])]
        return seq, links, bool(body.get("stats", False))
    except LabError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LabError(f"bad control line {line[:200]!r}: {exc}") from None


def _link_state(x: Mapping[str, Any]) -> LinkState:
    fields = {f.name for f in dataclasses.fields(LinkState)}
    return LinkState(**{k: v for k, v in x.items() if k in fields})
