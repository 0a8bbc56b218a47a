"""Observed addresses (issue 12, "Addresses"): identify tells each peer where the other sees it;
``transport.observed`` passes that on, ``swarmd.addresses`` turns it into our listen port
at the observed IP and believes it only once several distinct peers agree, and
``swarmd.node.nat`` announces it. Pure parts, real hosts on loopback, and the NAT lab (the NATed
host learns its gateway's public address; skipped, with the reason, where the lab cannot run).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmd.addresses import ObservedAddresses, at_listen_port  # noqa: E402


def test_an_observed_address_takes_our_listen_port() -> None:
    bound = ["/ip4/198.19.3.2/tcp/4001/p2p/QmX", "/ip6/::/tcp/4002"]
    # a NAT mapped this connection's source port: the listen port is what a dialer can use
    assert at_listen_port("/ip4/198.18.3.2/tcp/51234", bound) == "/ip4/198.18.3.2/tcp/4001"
    assert at_listen_port("/ip4/198.18.3.2/tcp/4001/p2p/QmX", bound) == \
        "/ip4/198.18.3.2/tcp/4001"
    assert at_listen_port("/ip6/2001:db8::1/tcp/9", bound) == "/ip6/2001:db8::1/tcp/4002"
    for useless in ("/ip4/1.2.3.4/udp/4001", "/dns4/example.com/tcp/1", "/ip4/1.2.3.4",
                    "garbage", "/ip4/999.1.1.1/tcp/1", "/ip4/1.2.3.4/tcp/x"):
        assert at_listen_port(useless, bound) is None, useless
    assert at_listen_port("/ip4/1.2.3.4/tcp/5", ["/ip6/::/tcp/1"]) is None  # no ip4 listener


@given(st.ip_addresses(v=4), st.integers(1, 65535),
       st.lists(st.integers(1, 65535), min_size=1, max_size=4))
def test_at_listen_port_keeps_the_ip_and_names_one_of_our_ports(ip: Any, port: int,
                                                                 ports: list[int]) -> None:
    bound = [f"/ip4/10.0.0.1/tcp/{p}" for p in ports]
    out = at_listen_port(f"/ip4/{ip}/tcp/{port}", bound)
    assert out is not None
    parts = out.split("/")
    assert parts[2] == str(ip) and int(parts[4]) in ports
    assert int(parts[4]) == (port if port in ports else ports[0])


def test_one_peer_cannot_make_us_believe_an_address() -> None:
    seen = ObservedAddresses(min_observers=3, window_s=3600)
    for i in range(100):  # one liar, many reports, many addresses
        seen.observed("liar", f"/ip4/203.0.113.{i % 50}/tcp/4001", float(i))
    seen.observed("liar", "/ip4/198.18.3.2/tcp/4001", 100.0)
    seen.observed("a", "/ip4/198.18.3.2/tcp/4001", 100.0)
    assert seen.confirmed(100.0) == ()
    seen.observed("b", "/ip4/198.18.3.2/tcp/4001", 101.0)
    assert seen.confirmed(101.0) == ("/ip4/198.18.3.2/tcp/4001",)


def test_hosts_on_loopback_pass_identify_observations_on() -> None:
    from transport.host import Host
    from transport.identity import generate
    from transport.options import HostOptions

    async def main() -> None:
        async with Host(generate(), HostOptions()) as a, Host(generate(), HostOptions()) as b:
            got: list[tuple[str, str]] = []
            b.on_observed = lambda peer, addr: got.append((peer, addr))
            a.on_observed = lambda peer, addr: 1 / 0  # a broken callback is counted, no more
            await a.dial(b.addrs[0])
            for _ in range(250):
                if got and a.counters.get("observed_addrs.callback_errors"):
                    break
                await asyncio.sleep(0.02)
            assert got, b.counters.snapshot()
            peer, addr = got[0]
            assert peer == a.peer_id
            assert addr == b.addrs[0].split("/p2p/")[0]  # a dialed b's listen address
            assert a.counters.get("observed_addrs.callback_errors") == 1
            assert await a.ping(b.peer_id) >= 0  # both hosts still work

    asyncio.run(main())



def test_a_report_made_before_the_callback_is_set_reaches_it_when_set() -> None:
    """A daemon dials its bootstrap peers (the swarm manifest) before its NAT service sets
    ``on_observed``: what those peers said is kept for it, not dropped."""
    from transport.host import Host
    from transport.identity import generate
    from transport.options import HostOptions

    async def main() -> None:
        async with Host(generate(), HostOptions()) as a, Host(generate(), HostOptions()) as b:
            await a.dial(b.addrs[0])
            for _ in range(250):
                if b.counters.get("observed_addrs.reports"):
                    break
                await asyncio.sleep(0.02)
            got: list[tuple[str, str]] = []
            b.on_observed = lambda peer, addr: got.append((peer, addr))
            assert got == [(a.peer_id, b.addrs[0].split("/p2p/")[0])]
            b.on_observed = lambda peer, addr: got.append((peer, addr))
            assert len(got) == 1  # given once

    asyncio.run(main())


def test_a_new_direct_connection_to_a_known_peer_reports_again() -> None:
    """py-libp2p identifies a peer once; after a reconnection (a router restart, a first
    connection through a relay) ``transport.observed.reidentify`` asks again."""
    from transport.host import Host
    from transport.identity import generate
    from transport.options import HostOptions

    async def reports(b: Any, got: list[Any], n: int) -> None:
        for _ in range(500):
            if len(got) >= n:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{len(got)} reports, wanted {n}: {b.counters.snapshot()}")

    async def main() -> None:
        async with Host(generate(), HostOptions()) as a, Host(generate(), HostOptions()) as b:
            got: list[tuple[str, str]] = []
            b.on_observed = lambda peer, addr: got.append((peer, addr))
            await a.dial(b.addrs[0])
            await reports(b, got, 1)
            assert not b.counters.get("observed_addrs.reidentified")
            await a.disconnect(b.peer_id)
            for _ in range(250):
                if not await b.connected_peers():
                    break
                await asyncio.sleep(0.02)
            await a.dial(b.addrs[0])
            # by our second identify, or by py-libp2p's own when it no longer held a's
            # protocols (a race with its disconnect handling): either way, a second report
            await reports(b, got, 2)
            assert {peer for peer, _ in got} == {a.peer_id}

    asyncio.run(main())


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_a_nated_daemon_learns_its_gateways_public_address(wanlab: Any, tmp_path: Path
                                                           ) -> None:
    from daemon_harness import wait_until
    from tools.wanlab import HostSpec, Link
    from tools.wanlab.daemons import start_swarm, stop_all

    # a slot on each of the three public peers: n1 dials each of them itself, so each runs
    # identify over a direct connection (one that dials n1 through a relay observes nothing)
    env = {"SWARMD_BALANCING_ENABLED": "false", "SWARMD_NETWORK_RELAY_RESERVATIONS": "3"}
    link = Link(delay_ms=2.0)
    lab = wanlab(HostSpec(name="pub", link=link), HostSpec(name="p1", link=link),
                 HostSpec(name="p2", link=link), HostSpec(name="n1", link=link, nat=True))
    # the public peers first (together), then n1: it dials each of them itself
    daemons = start_swarm(lab, tmp_path, ("pub", ("--stage", "0")),
                          [("p1", ("--stage", "1")), ("p2", ("--stage", "1"))],
                          [("n1", ("--stage", "1"))], env=env)
    pub, n1 = daemons[0], daemons[-1]
    try:
        port = n1.addr.split("/tcp/")[1].split("/")[0]
        want = f"/ip4/{lab.public_addr('n1')}/tcp/{port}"
        assert lab.public_addr("n1") not in n1.addr  # it is bound to its private address
        try:
            wait_until(lambda: want in n1.get("/api/v0/status")["observed_addrs"], 120,
                       f"n1 to learn it is seen at {want}")
        except AssertionError as exc:
            st = n1.get("/api/v0/status")
            raise AssertionError(f"{exc}: relays {st['relays']}, counters "
                                 f"{ {k: v for k, v in st['counters'].items() if 'obs' in k} }"
                                 ) from None
        status = n1.get("/api/v0/status")
        assert status["counters"].get("observed.reports", 0) >= 3, status["counters"]
        assert status["observed_addrs"] == [want], status["observed_addrs"]
        # n1 announces it, and a public peer receives it in its view of n1 (its membership
        # announcement, shown by /api/v0/peers), so others can dial n1 at its gateway
        n1_id = n1.addr.split("/p2p/")[1]
        assert f"{want}/p2p/{n1_id}" in status["announced_addrs"], status
        try:
            wait_until(lambda: any(want in a for p in pub.get("/api/v0/peers")
                                   if p["peer_id"] == n1_id for a in p["addrs"]), 60,
                       f"pub to receive n1's announced {want}")
        except AssertionError as exc:
            rows = [p for p in pub.get("/api/v0/peers") if p["peer_id"] == n1_id]
            raise AssertionError(f"{exc}: pub sees n1 as {rows}") from None
        # a public peer is observed where it listens: nothing new to announce, same address
        pub_status = pub.get("/api/v0/status")
        assert all(a.split("/tcp/")[0] == pub.addr.split("/tcp/")[0]
                   for a in pub_status["observed_addrs"]), pub_status["observed_addrs"]
        assert all(lab.public_addr("n1") not in a for a in pub_status["announced_addrs"])
    finally:
        stop_all(daemons)


class _Host:
    """What NatService reads of a host before it starts (no network: a unit test)."""

    peer_id = "QmSelf"
    addrs = ["/ip4/198.19.3.2/tcp/4001/p2p/QmSelf"]
    relay = None
    on_observed = None


class _Membership:
    def __init__(self) -> None:
        self.changes = 0

    def changed(self) -> None:
        self.changes += 1


def _nat(**network: Any) -> Any:
    import dataclasses

    from swarmd.config.load import Config
    from swarmd.node.nat import NatService

    config = Config()
    config = dataclasses.replace(config, network=dataclasses.replace(config.network,
                                                                     **network))
    membership = _Membership()
    return NatService(_Host(), membership, config), membership


def test_the_nat_service_announces_an_address_once_three_peers_agree() -> None:
    nat, membership = _nat()
    nat._on_observed("a", "/ip4/198.18.3.2/tcp/50001")
    nat._on_observed("b", "/ip4/198.18.3.2/tcp/50002")  # each connection its own NAT port
    nat._on_observed("liar", "/ip4/203.0.113.9/tcp/4001")
    nat._on_observed("liar", "/ip4/203.0.113.9/tcp/4001")
    assert nat._extra_addrs() == () and membership.changes == 0
    nat._on_observed("c", "/ip4/198.18.3.2/tcp/50003")
    assert nat._extra_addrs() == ("/ip4/198.18.3.2/tcp/4001/p2p/QmSelf",)
    assert nat.status().observed_addrs == ("/ip4/198.18.3.2/tcp/4001",)
    assert membership.changes == 1  # announced now
    nat._on_observed("d", "/ip4/198.18.3.2/tcp/50004")
    assert membership.changes == 1  # nothing new
    nat._on_observed("e", "not an address")
    assert nat.counters["observed.unusable"] == 1


def test_announce_set_or_no_announce_keep_observed_addresses_out() -> None:
    nat, _ = _nat(announce=("/ip4/203.0.113.1/tcp/4001",))
    nat2, _ = _nat(no_announce=("198.18.0.0/15",))
    for n in (nat, nat2):
        for peer in "abc":
            n._on_observed(peer, "/ip4/198.18.3.2/tcp/5000")
        assert n._extra_addrs() == ()
    assert nat.status().observed_addrs == ("/ip4/198.18.3.2/tcp/4001",)  # shown, not announced
    assert nat2.status().observed_addrs == ()


def test_status_and_peers_show_announced_addresses() -> None:
    """``/api/v0/status`` and ``swarmd status`` show what we announce; ``/api/v0/peers`` what
    each peer announces (as our membership view holds it)."""
    import json

    from swarmd.api.types import ConnectedPeer, StatusInfo, peer_rows
    from swarmd.cli.client import text_status

    ours = ("/ip4/198.18.4.2/tcp/4001/p2p/QmSelf", "/ip4/198.19.4.2/tcp/4001/p2p/QmSelf")
    st = StatusInfo(peer_id="QmSelf", swarm="s", version="0", stage=1, state="online",
                    uptime_s=1.0, connected_peers=1, throughput=0.0, queue=0,
                    observed_addrs=("/ip4/198.18.4.2/tcp/4001",), announced_addrs=ours)
    back = StatusInfo.from_json(json.loads(json.dumps({
        f: getattr(st, f) for f in StatusInfo.__dataclass_fields__})))
    assert back == st
    text = text_status(st)
    assert f"announces   {ours[0]}\n            {ours[1]}" in text
    assert "observed    /ip4/198.18.4.2/tcp/4001" in text
    views = {"QmA": ("/ip4/198.18.1.2/tcp/1/p2p/QmA",)}
    rows = peer_rows({"QmA", "QmB"}, {}, addrs_of=lambda p: views.get(p, ()))
    assert [(r.peer_id, r.addrs) for r in rows] == [("QmA", views["QmA"]), ("QmB", ())]
    row = ConnectedPeer.from_json({"peer_id": "QmA", "addrs": list(views["QmA"]), "new": 1})
    assert row.addrs == views["QmA"]
    assert peer_rows({"QmA"}, {})[0].addrs == ()  # no view given: none


def test_peers_show_whether_each_connected_peer_is_reached_directly_or_relayed() -> None:
    """``/api/v0/peers`` says how each connected peer is reached; ``swarmd peers`` adds a PATH
    column only while some peer is relayed."""
    from swarmd.api.types import peer_rows
    from swarmd.cli.client import text_peers

    paths = {"QmA": "relayed", "QmB": "direct", "QmGone": "direct"}
    rows = peer_rows({"QmA", "QmB", "QmC"}, {"QmA": (1, "online")}, paths=paths)
    assert [(r.peer_id, r.path) for r in rows] == [("QmA", "relayed"), ("QmB", "direct"),
                                                   ("QmC", None)]
    assert [r.path for r in peer_rows({"QmA"}, {})] == [None]  # a host without relay code
    text = text_peers(rows)
    assert "PATH" in text.splitlines()[0] and "relayed" in text
    assert "PATH" not in text_peers([r for r in rows if r.path != "relayed"])
