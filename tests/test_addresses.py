"""What a daemon announces (swarmd.addresses): pure rules, then real daemons."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmd.addresses import (MAX_ANNOUNCED, AddressPolicy, ObservedAddresses,
                                   announced_addrs, parse_filter)
from swarmd.node.interfaces import interface_ips

PID = "12D3KooWExample"
ENV: dict[str, str] = {}


def test_unspecified_is_expanded_and_loopback_dropped() -> None:
    got = announced_addrs(["/ip4/0.0.0.0/tcp/4001/p2p/" + PID],
                          ["127.0.0.1", "192.0.2.2", "::1", "fd00::2"], AddressPolicy(), PID)
    assert got == (f"/ip4/192.0.2.2/tcp/4001/p2p/{PID}",)


def test_ipv6_unspecified_expands_to_ipv6_only() -> None:
    got = announced_addrs(["/ip6/::/tcp/4001"], ["192.0.2.2", "fd00::2", "::1"],
                          AddressPolicy(), PID)
    assert got == (f"/ip6/fd00::2/tcp/4001/p2p/{PID}",)


def test_only_loopback_is_kept_for_a_swarm_on_one_machine() -> None:
    got = announced_addrs([f"/ip4/127.0.0.1/tcp/5/p2p/{PID}"], [], AddressPolicy(), PID)
    assert got == (f"/ip4/127.0.0.1/tcp/5/p2p/{PID}",)


def test_unspecified_with_no_interfaces_announces_nothing() -> None:
    assert announced_addrs(["/ip4/0.0.0.0/tcp/5"], [], AddressPolicy(), PID) == ()


def test_announce_replaces_and_no_announce_filters() -> None:
    policy = AddressPolicy(announce=("/ip4/203.0.113.7/tcp/31337", "/ip4/10.1.2.3/tcp/31337"),
                           no_announce=("10.0.0.0/8",))
    got = announced_addrs(["/ip4/10.1.2.3/tcp/31337"], ["10.1.2.3"], policy, PID)
    assert got == (f"/ip4/203.0.113.7/tcp/31337/p2p/{PID}",)


@pytest.mark.parametrize("text, addr, blocked", [
    ("/ip4/192.168.0.0/ipcidr/16", "/ip4/192.168.4.5/tcp/1", True),
    ("192.168.0.0/16", "/ip4/192.169.4.5/tcp/1", False),
    ("fd00::/8", "/ip6/fd00::2/tcp/1", True),
    ("fd00::/8", "/ip4/10.0.0.1/tcp/1", False),
    ("/ip4/1.2.3.4/tcp/9", f"/ip4/1.2.3.4/tcp/9/p2p/{PID}", True),
    ("/ip4/1.2.3.4/tcp/9", "/ip4/1.2.3.4/tcp/10", False),
    ("1.2.3.4", "/ip4/1.2.3.4/tcp/10", True),
])
def test_filters(text: str, addr: str, blocked: bool) -> None:
    assert AddressPolicy(no_announce=(text,)).blocks(addr) is blocked


@pytest.mark.parametrize("bad", ["bogus", "/tcp/5", "10.0.0.0/99", "/ip4/x/ipcidr/8"])
def test_bad_filters_say_what_is_accepted(bad: str) -> None:
    with pytest.raises(ValueError, match="CIDR block|multiaddr"):
        parse_filter(bad)


ips = st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6)).map(str)
addrs = st.builds(lambda ip, port: f"/ip{ipaddress.ip_address(ip).version}/{ip}/tcp/{port}",
                  ips, st.integers(1, 65535))


@given(bound=st.lists(addrs, max_size=12), interfaces=st.lists(ips, max_size=6),
       filters=st.lists(st.builds(lambda ip: f"{ip}/24" if ":" not in ip else f"{ip}/64", ips)
                        .filter(lambda t: _valid(t)), max_size=3))
def test_announced_is_bounded_unique_filtered_and_never_unspecified(bound: list[str],
                                                                    interfaces: list[str],
                                                                    filters: list[str]) -> None:
    policy = AddressPolicy(no_announce=tuple(filters))
    got = announced_addrs(bound, interfaces, policy, PID)
    assert len(got) <= MAX_ANNOUNCED and len(set(got)) == len(got)
    for a in got:
        assert a.endswith(f"/p2p/{PID}") and not policy.blocks(a)
        assert not ipaddress.ip_address(a.split("/")[2]).is_unspecified
    if any(not ipaddress.ip_address(a.split("/")[2]).is_loopback for a in got):
        assert all(not ipaddress.ip_address(a.split("/")[2]).is_loopback for a in got)


def _valid(text: str) -> bool:
    try:
        parse_filter(text)
        return True
    except ValueError:
        return False


def test_an_observed_address_is_believed_only_when_several_peers_saw_it() -> None:
    seen = ObservedAddresses(min_observers=3, window_s=60)
    for i in range(5):  # one peer repeating itself is one vote
        seen.observed("liar", "/ip4/198.51.100.66/tcp/1", now=float(i))
    assert seen.confirmed(5.0) == ()
    for peer in ("a", "b", "c"):
        seen.observed(peer, "/ip4/203.0.113.7/tcp/4001", now=10.0)
    assert seen.confirmed(11.0) == ("/ip4/203.0.113.7/tcp/4001",)
    assert seen.confirmed(71.0) == ()  # the reports expired


def test_observed_moves_a_peer_vote_and_bounds_what_it_tracks() -> None:
    seen = ObservedAddresses(min_observers=2, window_s=60, max_tracked=4)
    seen.observed("a", "/ip4/203.0.113.7/tcp/1", 0.0)
    seen.observed("b", "/ip4/203.0.113.7/tcp/1", 0.0)
    seen.observed("a", "/ip4/203.0.113.8/tcp/1", 1.0)  # a changed its mind
    assert seen.confirmed(2.0) == ()
    for i in range(100):  # a peer spraying addresses cannot grow the table
        seen.observed(f"p{i}", f"/ip4/198.51.100.{i}/tcp/1", 3.0)
    assert len(seen._seen) <= 4
    seen.observed("x", "/ip4/127.0.0.1/tcp/1", 4.0)  # loopback is never believed
    seen.observed("y", "/ip4/127.0.0.1/tcp/1", 4.0)
    assert "/ip4/127.0.0.1/tcp/1" not in seen.confirmed(4.0)


# ---- real daemons ---------------------------------------------------------------------------

@pytest.mark.integration
def test_a_daemon_bound_to_all_interfaces_announces_dialable_addresses(tmp_path: Path) -> None:
    from daemon_harness import DaemonProcess, stop_all, wait_until

    others = [ip for ip in interface_ips()
              if ipaddress.ip_address(ip).version == 4 and not ipaddress.ip_address(ip).is_loopback]
    started: list[Any] = []
    try:
        first = DaemonProcess(tmp_path / "a", "--stage", "0", env=ENV)
        started.append(first)
        first.wait_started()
        second = DaemonProcess(tmp_path / "b", "--stage", "1", "--bootstrap", first.addr,
                               "--listen", "/ip4/0.0.0.0/tcp/0",
                               env={"SWARMD_NETWORK_NO_ANNOUNCE": "/ip4/203.0.113.0/ipcidr/24"})
        started.append(second)
        second.wait_started()

        def announced() -> tuple[str, ...]:
            rows = [p for stage in first.get("/api/v0/swarm")["stages"] for p in stage["peers"]
                    if p["peer_id"] == second.peer_id]
            return tuple(rows[0]["addrs"]) if rows else ()

        wait_until(lambda: announced(), 30, "the second daemon's announcement")
        got = announced()
        assert not any("/0.0.0.0/" in a for a in got), got
        if others:  # this machine has a non-loopback address: loopback is not announced
            assert got and not any("/127.0.0.1/" in a for a in got), got
            assert {a.split("/")[2] for a in got} <= set(others), got
    finally:
        stop_all(started)
