"""Application-level liveness (issue 12): the pure decision (transport.liveness_policy), unit and
property tests, and the adapter (transport.liveness_watch) on real hosts over loopback. A
connection through a restarted router is found dead in the lab: tests/test_nat_recovery.py."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from transport.errors import LocalUsageError
from transport.liveness_policy import DEAD, PING, WAIT, ConnClock, PingPolicy

P = PingPolicy()  # ping after 10 s of silence, every 5 s, dead after 25 s, 5 s to answer


def _run(clock: ConnClock, policy: PingPolicy, until: float, step: float,
         heard_at: list[float] = (), answer_s: float | None = None) -> tuple[float | None, int]:
    """Check every ``step`` s from 0 to ``until``; bytes arrive at each of ``heard_at``; each
    ping is answered ``answer_s`` later (None: never). (time it went dead, pings sent)."""
    pending = sorted(heard_at)
    answers: list[float] = []
    pings, now = 0, 0.0
    while now <= until:
        for at in [a for a in pending + answers if a <= now]:
            clock.heard(at)
        pending = [a for a in pending if a > now]
        answers = [a for a in answers if a > now]
        verdict = clock.decide(now, policy)
        if verdict == DEAD:
            return now, pings
        if verdict == PING:
            clock.pinged(now)
            pings += 1
            if answer_s is not None:
                answers.append(now + answer_s)
        now = round(now + step, 9)
    return None, pings


def test_a_silent_connection_is_pinged_then_declared_dead() -> None:
    clock = ConnClock(last_heard=0.0)
    assert clock.decide(9.9, P) == WAIT
    assert clock.decide(10.0, P) == PING
    clock.pinged(10.0)
    assert clock.decide(12.0, P) == WAIT  # too soon for another
    assert clock.decide(15.0, P) == PING
    clock.pinged(15.0)
    clock.pinged(20.0)
    assert clock.decide(24.9, P) == WAIT  # not silent long enough
    assert clock.decide(25.0, P) == DEAD
    assert len(clock.pings) == P.max_pings


def test_anything_heard_answers_the_pings_sent_before_it() -> None:
    clock = ConnClock(last_heard=0.0)
    clock.pinged(10.0)
    clock.heard(11.0)
    assert clock.pings == [] and clock.decide(30.0, P) == PING  # silent again: a new ping
    clock.heard(5.0)  # an older report changes nothing
    assert clock.last_heard == 11.0


def test_never_dead_without_a_ping_old_enough_to_have_been_answered() -> None:
    clock = ConnClock(last_heard=0.0)
    assert clock.decide(1000.0, P) == PING  # the checker was stalled: ping first
    clock.pinged(1000.0)
    assert clock.decide(1004.9, P) == WAIT
    assert clock.decide(1005.0, P) == DEAD


@pytest.mark.parametrize("bad", [dict(ping_after_s=0), dict(ping_every_s=-1),
                                 dict(dead_after_s=12.0), dict(answer_wait_s=0),
                                 dict(max_pings=0), dict(max_pings=1000)])
def test_the_policy_refuses_nonsense(bad: dict[str, Any]) -> None:
    with pytest.raises(LocalUsageError):
        PingPolicy(**bad)


policies = st.builds(
    lambda after, every, wait, extra, n: PingPolicy(
        ping_after_s=after, ping_every_s=every, answer_wait_s=wait,
        dead_after_s=after + wait + extra, max_pings=n),
    st.floats(0.5, 20), st.floats(0.5, 10), st.floats(0.5, 10), st.floats(0, 20),
    st.integers(1, 6))


@settings(max_examples=200, deadline=None)
@given(policies, st.lists(st.floats(0, 200), max_size=30), st.floats(0.1, 2.0))
@example(PingPolicy(ping_after_s=1.0, ping_every_s=1.0, dead_after_s=10.0, answer_wait_s=9.0,
                    max_pings=1), [1.625], 0.1)  # found by the full suite: float rounding
def test_a_connection_heard_within_dead_after_is_never_dead(
        policy: PingPolicy, heard: list[float], step: float) -> None:
    clock = ConnClock(last_heard=0.0)
    dead_at, _ = _run(clock, policy, 200.0, step, heard_at=heard)
    if dead_at is not None:
        last = max([0.0] + [h for h in heard if h <= dead_at])
        assert dead_at - last >= policy.dead_after_s
        # and a ping sent after the last byte had its time to be answered
        # (written as decide() compares: ``p <= dead_at - wait`` rounds differently)
        assert any(p > last and dead_at - p >= policy.answer_wait_s for p in clock.pings)


@settings(max_examples=200, deadline=None)
@given(policies, st.floats(0.1, 2.0), st.floats(0, 1))
def test_a_peer_answering_pings_in_time_is_never_dead(policy: PingPolicy, step: float,
                                                      frac: float) -> None:
    clock = ConnClock(last_heard=0.0)
    dead_at, pings = _run(clock, policy, 300.0, step, answer_s=frac * policy.answer_wait_s * 0.99)
    assert dead_at is None
    assert pings >= 1


@settings(max_examples=200, deadline=None)
@given(policies, st.floats(0.1, 2.0), st.floats(0, 100))
def test_a_dead_peer_is_found_within_a_bound_with_a_bounded_number_of_pings(
        policy: PingPolicy, step: float, last: float) -> None:
    clock = ConnClock(last_heard=last)  # the last byte ever arrives at ``last``
    dead_at, pings = _run(clock, policy, 1000.0, step)
    assert dead_at is not None
    assert dead_at - last >= policy.dead_after_s
    assert dead_at - last <= policy.dead_after_s + policy.answer_wait_s + 2 * step
    assert 1 <= pings <= policy.max_pings


# ---- the adapter, on real hosts over loopback ------------------------------------------------

FAST = PingPolicy(ping_after_s=0.5, ping_every_s=0.5, answer_wait_s=1.0, dead_after_s=2.0)


def test_an_idle_connection_is_pinged_and_stays_up() -> None:
    from transport.host import Host
    from transport.identity import generate
    from transport.options import HostOptions

    async def main() -> None:
        # only ``a`` pings fast: were ``b`` to ping too, whichever pinged first would keep the
        # other from ever being silent long enough to ping (2 pings of ``a`` in 30 s, once,
        # in a loaded full run); ``b`` answers, and hears ``a`` often enough to stay quiet
        async with Host(generate(), HostOptions(pings=FAST)) as a, \
                Host(generate(), HostOptions()) as b:
            await a.dial(b.addrs[0])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while a.counters.get("liveness.pings") < 3 and loop.time() < deadline:
                await asyncio.sleep(0.2)
            assert a.counters.get("liveness.pings") >= 3, a.counters.snapshot()
            await asyncio.sleep(FAST.dead_after_s + 1)  # longer than the dead window
            assert b.peer_id in await a.connected_peers()
            assert a.counters.get("liveness.dead_closed") == 0
            assert b.counters.get("liveness.dead_closed") == 0
            await a.ping(b.peer_id)

    asyncio.run(main())


def test_kernel_heard_sees_unread_bytes_and_recent_acknowledgements() -> None:
    from transport.liveness_watch import kernel_heard

    with socket.create_server(("127.0.0.1", 0)) as ls:
        c = socket.create_connection(ls.getsockname())
        p, _ = ls.accept()
        with c, p:
            p.sendall(b"x")
            for _ in range(100):  # bounded: loopback delivers at once
                if kernel_heard(c, 100.0) == 100.0:
                    break
            assert kernel_heard(c, 100.0) == 100.0  # waiting unread: heard now
            c.recv(1)
            at = kernel_heard(c, 100.0)
            if hasattr(socket, "TCP_INFO"):
                assert at is not None and 95.0 < at <= 100.0


def test_network_liveness_keys_become_the_hosts_ping_policy() -> None:
    from swarmd.config import Config, ConfigError, load_config
    from swarmd.node.host_options import ping_policy

    def config(**keys: float) -> Config:
        return load_config(None, {}, {f"network.{k}": v for k, v in keys.items()})

    policy = ping_policy(Config())
    assert policy == PingPolicy(ping_after_s=10.0, ping_every_s=5.0, answer_wait_s=5.0,
                                dead_after_s=25.0, max_pings=3)
    assert ping_policy(config(liveness_dead_after_s=0)) is None
    short = ping_policy(config(liveness_ping_after_s=2, liveness_dead_after_s=3))
    assert short.ping_after_s + short.answer_wait_s <= short.dead_after_s
    with pytest.raises(ConfigError, match="liveness_dead_after_s"):
        config(liveness_ping_after_s=30, liveness_dead_after_s=20)
    with pytest.raises(ConfigError, match="liveness_ping_after_s"):
        config(liveness_ping_after_s=0)
