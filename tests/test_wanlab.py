"""tools/wanlab: the emulated WAN. The pure parts run everywhere; the lab tests need root and
are skipped with the reason elsewhere (the ``wanlab`` fixture); CI runs them as root.

The lab tests assert properties of the lab (an RTT near the configured delay, a rate near the
shaped rate, loss near the configured loss) within generous bands; they time no swarmd code.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import signal
import statistics
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.wanlab import netns, probe  # noqa: E402
from tools.wanlab.delayer import DelayLine, acked, gso_config_message, segments  # noqa: E402
from tools.wanlab.spec import (LAB_NET, HostSpec, LabError, Link, LinkState,  # noqa: E402
                               decode_control, encode_control, gateway_inside_addr, host_addr,
                               namespace_names, parse_namespace, private_addr, router_addr,
                               tbf_args)

A, B = b"\xc6\x12\x01\x02", b"\xc6\x12\x02\x02"  # 198.18.1.2, 198.18.2.2


# ---- pure: specs, names, messages ------------------------------------------------------------

def test_spec_module_is_pure():
    from test_import_rules import check_source

    path = ROOT / "tools" / "wanlab" / "spec.py"
    assert check_source(path.read_text(), "tools.wanlab.spec", core=True) == []


def test_addresses_are_lab_addresses_and_distinct():
    addrs = [f(i) for f in (host_addr, router_addr, private_addr, gateway_inside_addr)
             for i in range(250)]
    assert all(ipaddress.ip_address(a) in LAB_NET for a in addrs)
    assert len(set(addrs)) == len(addrs)


def test_namespace_names_parse_back_and_differ_per_lab():
    hosts = [HostSpec(name="s0"), HostSpec(name="t1", nat=True)]
    one, two = namespace_names(123, 1, hosts), namespace_names(123, 2, hosts)
    assert set(one) == {"r", "s0", "t1", "t1-gw"}
    assert set(one.values()).isdisjoint(two.values())
    assert {parse_namespace(n) for n in one.values()} == {(123, 1)}
    assert parse_namespace("swl-x-1-r") is None and parse_namespace("other") is None


@pytest.mark.parametrize("bad", [dict(delay_ms=-1), dict(loss=1.5), dict(down_mbit=0),
                                 dict(up_mbit=-5)])
def test_bad_links_are_refused(bad):
    with pytest.raises(LabError):
        Link(**bad)


@pytest.mark.parametrize("name", ["", "r", "Upper", "a-b", "x" * 13])
def test_bad_host_names_are_refused(name):
    with pytest.raises(LabError):
        HostSpec(name=name)


@pytest.mark.parametrize("mbit", [0.5, 10, 50, 200, 1000, 10_000])
def test_tbf_bucket_covers_a_tick_and_a_jumbo_frame(mbit):
    args = tbf_args(mbit)
    rate = int(args[args.index("rate") + 1].removesuffix("bit"))
    burst, limit = int(args[args.index("burst") + 1]), int(args[args.index("limit") + 1])
    assert rate == int(mbit * 1e6)
    assert burst >= max(9000 * 2, rate / 8 / 100)  # at least rate/HZ for HZ >= 100
    assert limit > burst


def test_control_messages_round_trip_and_drop_unknown_keys():
    states = [LinkState(host="198.18.1.2", delay_ms=12.5, loss=0.1, blocked=True)]
    assert decode_control(encode_control(7, states, stats=True)) == (7, states, True)
    line = json.dumps({"seq": 1, "new": 1, "links": [{"host": "198.18.3.2", "later": 2}]})
    assert decode_control(line.encode()) == (1, [LinkState(host="198.18.3.2")], False)


@pytest.mark.parametrize("line", [b"{", b"[]", b'{"links": []}', b'{"seq": 1, "links": [1]}',
                                  b'{"seq": 1, "links": [{"host": "10.0.0.1"}]}'])
def test_malformed_control_lines_raise_lab_error(line):
    with pytest.raises(LabError):
        decode_control(line)


# ---- pure: the delay line ----------------------------------------------------------------------

def _line(**hosts: LinkState) -> DelayLine[int]:
    line: DelayLine[int] = DelayLine(rng=random.Random(1))
    for state in hosts.values():
        line.configure(0.0, state)
    return line


def test_delay_is_the_sum_of_both_links():
    line = _line(a=LinkState(host="198.18.1.2", delay_ms=10), b=LinkState(host="198.18.2.2",
                                                                          delay_ms=15))
    assert line.offer(1.0, A, B, 1) == "held"
    assert line.due(1.0249) == [] and line.next_due() == pytest.approx(1.025)
    assert line.due(1.025) == [1] and line.counters["late_over_1ms"] == 0
    # released 3 ms after its time (the delayer was not scheduled): counted late
    assert line.offer(2.0, A, B, 2) == "held" and line.due(2.028) == [2]
    assert line.counters["late_over_1ms"] == 1
    assert line.counters["late_max_us"] == pytest.approx(3000, abs=2)


def test_undelayed_packets_pass_and_blocked_or_stalled_ones_drop():
    line = _line(a=LinkState(host="198.18.1.2"))
    assert line.offer(0.0, A, B, 1) == "pass"
    line.configure(1.0, LinkState(host="198.18.1.2", stall_s=2.0))
    assert line.offer(2.9, B, A, 2) == "drop" and line.offer(3.0, B, A, 3) == "pass"
    line.configure(3.0, LinkState(host="198.18.1.2", blocked=True))
    assert line.offer(4.0, A, B, 4) == "drop"
    assert line.counters["blocked"] == 2 and line.counters["passed"] == 2


def test_loss_drops_about_the_configured_share():
    line = _line(a=LinkState(host="198.18.1.2", loss=0.25))
    verdicts = [line.offer(0.0, A, B, i) for i in range(4000)]
    assert 0.2 < verdicts.count("drop") / 4000 < 0.3


def test_a_gso_packet_is_lost_when_any_of_its_segments_would_be():
    line = _line(a=LinkState(host="198.18.1.2", loss=0.25))
    verdicts = [line.offer(0.0, A, B, i, segments=4) for i in range(4000)]
    assert 0.63 < verdicts.count("drop") / 4000 < 0.74  # 1 - 0.75 ** 4 = 0.68


@pytest.mark.parametrize("total,expected", [(60, 1), (1500, 1), (9000, 1), (9001, 2),
                                            (30_000, 4), (65_535, 8), (0, 1)])
def test_a_packet_stands_for_the_segments_its_total_length_needs(total, expected):
    head = bytes([0x45, 0]) + total.to_bytes(2, "big") + bytes(16)
    assert segments(head) == expected
    assert segments(b"") == 1


def test_the_gso_request_is_one_config_message_for_the_queue_and_only_a_zero_error_acks_it():
    msg = gso_config_message(7, seq=3)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", msg)
    assert length == len(msg) == 36 and kind == 0x302 and flags == 5 and seq == 3
    assert int.from_bytes(msg[18:20], "big") == 7  # the queue, in network order

    def error(code: int, seq: int = 1) -> bytes:
        return (struct.pack("=IHHIIi", 36, 2, 0, seq, 0, code) + msg[:16])

    assert acked(error(0)) and not acked(error(-95)) and not acked(error(0, seq=2))
    assert not acked(b"") and not acked(msg)


def test_a_full_line_drops_instead_of_growing():
    line: DelayLine[int] = DelayLine(rng=random.Random(1), max_held=3)
    line.configure(0.0, LinkState(host="198.18.1.2", delay_ms=100))
    assert [line.offer(0.0, A, B, i) for i in range(5)] == ["held"] * 3 + ["drop"] * 2
    assert line.counters["overflow"] == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 0.05), st.floats(0, 200), st.booleans()), max_size=60))
def test_packets_of_a_path_leave_in_order_whatever_the_delay_changes(events):
    line: DelayLine[tuple[bytes, int]] = DelayLine(rng=random.Random(0))
    now, out, sent = 0.0, [], {A: [], B: []}
    for i, (dt, delay, forward) in enumerate(events):
        now += dt
        line.configure(now, LinkState(host="198.18.1.2", delay_ms=delay))
        src, dst = (A, B) if forward else (B, A)
        sent[src].append(i)
        if line.offer(now, src, dst, (src, i)) == "pass":
            out.append((src, i))
        out.extend(line.due(now))
    out.extend(line.due(now + 1.0))
    assert not line.held
    for src in (A, B):
        assert [i for s, i in out if s == src] == sent[src]


# ---- the lab itself (root) -----------------------------------------------------------------

def _lab_namespaces(lab) -> set[str]:
    return set(lab.ns.values())


def test_rtt_is_twice_the_one_way_delay_and_changes_while_running(wanlab):
    lab = wanlab(HostSpec(name="a", link=Link(delay_ms=10)),
                 HostSpec(name="b", link=Link(delay_ms=15)))
    rtt = statistics.median(probe.connect_rtt_ms(lab, "a", "b"))
    assert 50 * 0.95 <= rtt <= 50 + 25, rtt  # 2 x (10 + 15) ms
    lab.set_link("b", delay_ms=40)
    rtt = statistics.median(probe.connect_rtt_ms(lab, "a", "b"))
    assert 100 * 0.95 <= rtt <= 100 + 25, rtt
    assert lab.counters()["counters"]["held"] > 0


def test_rates_are_shaped_per_direction_and_change_while_running(wanlab):
    lab = wanlab(HostSpec(name="home", link=Link(delay_ms=2, down_mbit=40, up_mbit=8)),
                 HostSpec(name="dc"))
    up = probe.tcp_stream_MBps(lab, "home", "dc", seconds=2.5)["second_half_MBps"]
    down = probe.tcp_stream_MBps(lab, "dc", "home", seconds=2.5)["second_half_MBps"]
    assert 1.0 * 0.6 <= up <= 1.0 * 1.1, up  # 8 Mbit/s = 1 MB/s
    assert 5.0 * 0.6 <= down <= 5.0 * 1.1, down  # 40 Mbit/s = 5 MB/s
    lab.set_link("home", rate_up=24)
    up = probe.tcp_stream_MBps(lab, "home", "dc", seconds=2.5)["second_half_MBps"]
    assert 3.0 * 0.6 <= up <= 3.0 * 1.1, up


def test_loss_stall_and_partition(wanlab):
    lab = wanlab(HostSpec(name="a"), HostSpec(name="b"))
    assert probe.udp_delivery(lab, "a", "b", count=200) == 1.0
    lab.set_link("a", loss=0.3)
    share = probe.udp_delivery(lab, "a", "b", count=400)
    assert 0.55 <= share <= 0.85, share
    lab.set_link("a", loss=0.0)
    lab.stall("b", 1.5)
    assert probe.udp_delivery(lab, "a", "b", count=50, wait_s=0.2) == 0.0
    from swarmd.local.swarm import wait_until

    wait_until(lambda: probe.can_connect(lab, "a", "b", timeout=0.5), 10,
               "b reachable again after its stall")
    lab.partition("a")
    assert not probe.can_connect(lab, "a", "b", timeout=0.5)
    lab.set_link("a", delay_ms=1)  # a link change keeps the partition
    assert not probe.can_connect(lab, "a", "b", timeout=0.5)
    lab.heal("a")
    assert probe.can_connect(lab, "a", "b", timeout=2.0)
    assert lab.counters()["counters"]["blocked"] > 0


def test_a_host_behind_nat_reaches_out_and_cannot_be_reached(wanlab):
    import socket

    lab = wanlab(HostSpec(name="home", nat=True, link=Link(delay_ms=5, up_mbit=50)),
                 HostSpec(name="dc"))
    assert lab.addr("home") != lab.public_addr("home")
    with lab.inside("dc"):
        ls = socket.create_server((lab.addr("dc"), 0))
    with lab.inside("home"):
        c = socket.socket()
    with ls, c:
        ls.settimeout(10)
        c.settimeout(10)
        c.connect((lab.addr("dc"), ls.getsockname()[1]))
        peer, _ = ls.accept()
        assert peer.getpeername()[0] == lab.public_addr("home")  # masqueraded
        peer.close()
    rtt = statistics.median(probe.connect_rtt_ms(lab, "home", "dc"))
    assert 10 * 0.95 <= rtt <= 10 + 25, rtt  # the gateway's link carries the delay
    assert not probe.can_connect(lab, "dc", "home", timeout=0.5)


def test_teardown_leaves_nothing_also_after_an_error(wanlab):
    lab = wanlab(HostSpec(name="a"), HostSpec(name="b"))
    names = _lab_namespaces(lab)
    assert names <= set(netns.list_namespaces())
    sleeper = lab.run("a", ["sleep", "60"])
    lab.close()
    assert sleeper.poll() is not None
    assert names.isdisjoint(netns.list_namespaces())
    from tools.wanlab import WanLab

    with pytest.raises(ZeroDivisionError):
        with WanLab(hosts=[HostSpec(name="c")]) as other:
            names = _lab_namespaces(other)
            1 / 0
    assert names.isdisjoint(netns.list_namespaces())


_CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from tools.wanlab import WanLab, HostSpec
with WanLab(hosts=[HostSpec(name="a")]) as lab:
    print(" ".join(lab.ns.values()), flush=True)
    time.sleep(60)  # holds the lab open until the test kills this process (not a wait)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_lab_process_leaves_nothing_after_cleanup(wanlab, sig):
    wanlab(HostSpec(name="probe"))  # skips where the lab cannot run
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(root=str(ROOT))],
                             stdout=subprocess.PIPE, text=True)
    try:
        from swarmd.local.swarm import readline

        names = set(readline(child, 30).split())
        assert len(names) == 2 and names <= set(netns.list_namespaces())
        os.kill(child.pid, sig)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if sig == signal.SIGTERM:  # its handler tore the lab down before the process ended
        assert names.isdisjoint(netns.list_namespaces())
    else:  # nothing could run: the namespaces stay, known as leftovers of a dead process
        assert names <= set(netns.leftover_namespaces())
    netns.cleanup_leftovers()
    assert names.isdisjoint(netns.list_namespaces())


def test_check_explains_what_is_missing(monkeypatch):
    from tools.wanlab import LabUnavailable, WanLab

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(LabUnavailable, match="needs root"):
        WanLab.check()
