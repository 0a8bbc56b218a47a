"""All-reduce among real hosts on 127.0.0.1 (Noise + yamux), all in this process: results equal
the weighted mean within the codec's tolerance and are bit-identical on every survivor, also
when a peer sends NaN, enters late, or dies mid-round (as a contributor or as an owner)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Sequence

import pytest
import torch
import uvloop

from swarmd.averaging.aggregation import weighted_mean
from swarmd.averaging.allreduce import (
    AllReduceFailed,
    AllReduceResult,
    Averager,
    AveragerOptions,
    protocol_id,
)
from swarmd.averaging.plan import RoundPlan
from transport import identity
from transport.errors import RemoteError
from transport.frames import Message
from transport.host import Host, HostOptions

pytestmark = pytest.mark.integration

PROTOCOL = protocol_id("test")
TOLERANCE = {"none": 1e-6, "fp16": 1e-3, "int8": 2e-2}
DEADLINE_S = 10.0


class Peer:
    def __init__(self, host: Host, averager: Averager) -> None:
        self.host, self.averager = host, averager
        self.peer_id = host.peer_id
        self.task: asyncio.Task[AllReduceResult] | None = None

    def start(self, round_id: str, group: Sequence[str], vector: torch.Tensor,
              weight: float, **kwargs: Any) -> asyncio.Task[AllReduceResult]:
        kwargs.setdefault("deadline_s", DEADLINE_S)
        self.task = asyncio.ensure_future(
            self.averager.all_reduce(round_id, group, vector, weight, **kwargs))
        return self.task

    def counter(self, name: str) -> int:
        return self.averager.counters.get(name)

    async def kill(self) -> None:
        """Disappear mid-round as a dead process does: the round stops and every connection
        closes (``Host.close`` alone leaves this process's sockets open, so the others would
        see a hung peer, not a dead one)."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.averager.__aexit__(None, None, None)
        for peer in await self.host.connected_peers():
            await self.host.disconnect(peer)
        await self.host.close()


def run(n: int, scenario: Callable[[list[Peer]], Awaitable[Any]], *,
        options: AveragerOptions | None = None, seconds: float = 30.0) -> Any:
    """Start ``n`` hosts with averagers, run ``scenario`` under a deadline, close what is
    still open (a scenario may kill peers)."""

    async def main() -> Any:
        peers: list[Peer] = []
        addrs: dict[str, list[str]] = {}
        try:
            for _ in range(n):
                host = Host(identity.generate(), HostOptions(pubsub=None))
                await host.start()
                averager = Averager(host, PROTOCOL, options=options,
                                    addrs_of=lambda p: addrs.get(p, ()))
                peers.append(Peer(host, averager))
                await averager.__aenter__()
                addrs[host.peer_id] = host.addrs
            return await asyncio.wait_for(scenario(peers), seconds)
        finally:
            for p in peers:
                if p.host.bridge.running:
                    await p.averager.__aexit__(None, None, None)
                    await p.host.close()

    return uvloop.run(main())


def vectors(n: int, size: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) for _ in range(n)]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


def assert_identical(results: Sequence[AllReduceResult]) -> None:
    for r in results[1:]:
        assert torch.equal(r.vector, results[0].vector)
        assert r.contributors == results[0].contributors
        assert r.part_weights == results[0].part_weights


async def wait_until(condition: Callable[[], bool], what: str, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


# ---- the happy path ---------------------------------------------------------------------

@pytest.mark.parametrize("n,codec", [(2, "none"), (3, "none"), (3, "fp16"), (2, "int8")])
def test_result_is_the_weighted_mean_and_identical_everywhere(n: int, codec: str) -> None:
    size = 100_003
    xs, weights = vectors(n, size), [1.0 + 2 * i for i in range(n)]

    async def scenario(peers: list[Peer]) -> None:
        group = [p.peer_id for p in peers]
        results = await asyncio.gather(*(p.start("r1", group, x, w, codec=codec)
                                         for p, x, w in zip(peers, xs, weights)))
        assert_identical(results)
        ref = weighted_mean(xs, weights)
        assert rel_err(results[0].vector, ref) < TOLERANCE[codec]
        for r in results:
            assert r.weight == sum(weights) and not r.missing and not r.repaired_parts
            assert set(r.contributors) == set(group)
            assert r.bytes_sent > 0 and r.bytes_received > 0
        for p in peers:
            assert p.counter("rounds") == 1 and p.counter("contributions_refused") == 0
        # a second round with unequal parts (as planned from bandwidths) works the same
        bws = [float(10 ** i) for i in range(n)]
        again = await asyncio.gather(*(p.start("r2", group, x, 1.0, codec=codec, bandwidths=bws)
                                       for p, x in zip(peers, xs)))
        assert_identical(again)
        assert rel_err(again[0].vector, weighted_mean(xs, [1.0] * n)) < TOLERANCE[codec]

    run(n, scenario)


def test_a_peer_with_nan_is_left_out_of_every_part() -> None:
    xs, weights = vectors(3, 30_000, seed=1), [1.0, 2.0, 3.0]
    xs[1][123] = float("nan")  # in the first part only: still out of all of them

    async def scenario(peers: list[Peer]) -> None:
        group = [p.peer_id for p in peers]
        results = await asyncio.gather(*(p.start("nan", group, x, w)
                                         for p, x, w in zip(peers, xs, weights)))
        assert_identical(results)
        ref = weighted_mean([xs[0], xs[2]], [1.0, 3.0])
        assert rel_err(results[0].vector, ref) < TOLERANCE["fp16"]
        assert results[0].missing == (peers[1].peer_id,) and results[0].weight == 4.0
        assert peers[1].counter("local_non_finite") == 1

    run(3, scenario)


def test_owners_refuse_a_non_finite_contribution() -> None:
    """A peer that sends NaN anyway (it skips its own check): each owner refuses and counts
    it, and the others' result leaves it out."""
    xs = vectors(2, 20_000, seed=9)

    async def scenario(peers: list[Peer]) -> None:
        a, b, bad = peers
        group = [p.peer_id for p in peers]
        parts = [0 if g == bad.peer_id else 10_000 for g in sorted(group)]
        plan = RoundPlan.build("evil", group, 20_000, parts=parts)
        tasks = [p.start("evil", group, x, 1.0, parts=parts) for p, x in zip((a, b), xs)]

        async def send_nan(owner: Peer) -> Any:
            j = next(u for u, unit in enumerate(plan.units)
                     if unit.owner == plan.index(owner.peer_id))
            await bad.host.dial(owner.host.addrs[0])
            stream = await bad.host.open_stream(owner.peer_id, PROTOCOL)
            async with stream:
                await stream.send(Message(kind="contribute", meta={
                    "r": "evil", "d": plan.digest, "u": j, "w": 1.0, "t": 5.0},
                    tensors=(torch.full((10_000,), float("nan")),)))
                return await stream.receive(timeout=5)

        replies = await asyncio.gather(send_nan(a), send_nan(b))
        results = await asyncio.gather(*tasks)
        assert_identical(results)
        assert rel_err(results[0].vector, weighted_mean(xs, [1.0, 1.0])) < TOLERANCE["fp16"]
        assert results[0].missing == (bad.peer_id,)
        assert a.counter("contributions_refused") == b.counter("contributions_refused") == 1
        assert all(r.kind == "part" for r in replies)  # it still gets the average

    run(3, scenario)


def test_centered_clip_keeps_a_1000x_peer_from_wrecking_the_result() -> None:
    xs = vectors(3, 30_000, seed=2)
    xs[2] = xs[2] * 1000

    async def scenario(peers: list[Peer]) -> None:
        group = [p.peer_id for p in peers]
        results = await asyncio.gather(*(p.start("cc", group, x, 1.0, aggregator="centered_clip")
                                         for p, x in zip(peers, xs)))
        assert_identical(results)
        honest = weighted_mean(xs[:2], [1.0, 1.0])
        spread = float(torch.dist(xs[0], xs[1]))
        assert float(torch.dist(results[0].vector, honest)) <= spread
        plain = weighted_mean(xs, [1.0] * 3)
        assert float(torch.dist(plain, honest)) > 100 * spread

    run(3, scenario)


def test_a_peer_entering_200ms_late_is_waited_for() -> None:
    xs = vectors(3, 50_000, seed=3)

    async def scenario(peers: list[Peer]) -> None:
        group = [p.peer_id for p in peers]
        early = [p.start("late", group, x, 1.0) for p, x in zip(peers[:2], xs[:2])]
        await asyncio.sleep(0.2)  # the deliberate stagger
        late = peers[2].start("late", group, xs[2], 1.0)
        results = await asyncio.gather(*early, late)
        assert_identical(results)
        assert rel_err(results[0].vector, weighted_mean(xs, [1.0] * 3)) < TOLERANCE["fp16"]
        assert not results[0].missing

    run(3, scenario)


# ---- peers that disappear -----------------------------------------------------------------

def test_a_contributor_dying_after_it_sent_does_not_hang_the_others() -> None:
    """The victim owns no part (a pure contributor). It sends its slices (one is buffered by a
    peer that has not started yet) and dies; the survivors finish with its contribution."""
    xs, weights = vectors(3, 40_000, seed=4), [1.0, 1.0, 2.0]

    async def scenario(peers: list[Peer]) -> None:
        a, b, victim = peers
        group = [p.peer_id for p in peers]
        parts = [0 if g == victim.peer_id else 20_000 for g in sorted(group)]
        kw = {"parts": parts, "codec": "none"}
        ta = a.start("die1", group, xs[0], weights[0], **kw)
        victim.start("die1", group, xs[2], weights[2], **kw)
        # a hears only from the victim (b has not started); b from a and from the victim:
        # b's first slice alone may be a's, and the victim must not die before its own lands
        await wait_until(lambda: a.counter("contributions_received") >= 1
                         and b.counter("contributions_received") >= 2, "the victim's slices",
                         15)
        t0 = time.monotonic()
        await victim.kill()
        tb = b.start("die1", group, xs[1], weights[1], **kw)
        results = await asyncio.gather(ta, tb)
        assert time.monotonic() - t0 < DEADLINE_S
        assert_identical(results)
        ref = weighted_mean([xs[0], xs[1], xs[2]], weights)
        assert rel_err(results[0].vector, ref) < TOLERANCE["none"]
        assert not results[0].repaired_parts

    run(3, scenario)


def test_an_owner_dying_mid_round_is_repaired_by_the_survivors() -> None:
    """The victim got its peers' slices and sent its own, then dies before answering: its part
    is re-aggregated by the next peer of the group from the survivors' contributions, and both
    survivors end with the same vector."""
    size = 60_000
    xs, weights = vectors(3, size, seed=5), [1.0, 2.0, 3.0]

    async def scenario(peers: list[Peer]) -> None:
        a, b, victim = peers
        group = [p.peer_id for p in peers]
        plan = RoundPlan.build("die2", group, size, chunk=7_000)  # 3 units per peer
        kw = {"chunk": 7_000}
        ta = a.start("die2", group, xs[0], weights[0], **kw)
        victim.start("die2", group, xs[2], weights[2], **kw)
        # all slices sent so far arrived (b buffers a's and the victim's, 3 each: it has not
        # started); the victim waits for b's slices, so it cannot answer a yet. (b at 3 was
        # not enough: under load a's 3 came first, the victim died before its own reached b,
        # and b's parts lacked it)
        await wait_until(lambda: victim.counter("contributions_received") >= 3
                         and a.counter("contributions_received") >= 3
                         and b.counter("contributions_received") >= 6, "the first slices")
        t0 = time.monotonic()
        await victim.kill()
        tb = b.start("die2", group, xs[1], weights[1], **kw)
        results = await asyncio.gather(ta, tb)
        assert time.monotonic() - t0 < DEADLINE_S
        assert_identical(results)
        v = plan.index(victim.peer_id)
        victims = tuple(u for u, unit in enumerate(plan.units) if unit.owner == v)
        assert len(victims) == 3
        assert results[0].repaired_parts == victims == results[1].repaired_parts
        full = weighted_mean(xs, weights)
        repaired = weighted_mean([xs[0], xs[1]], weights[:2])
        got = results[0].vector
        for u, unit in enumerate(plan.units):
            ref = repaired if unit.owner == v else full
            assert rel_err(got[unit.span], ref[unit.span]) < TOLERANCE["fp16"], u
        assert results[0].missing == (victim.peer_id,)
        assert sum(p.counter("repaired_parts") for p in (a, b)) == 6

    run(3, scenario)


def test_a_peer_gone_before_the_round_is_repaired_around() -> None:
    xs = vectors(3, 30_000, seed=6)

    async def scenario(peers: list[Peer]) -> None:
        group = [p.peer_id for p in peers]
        await peers[0].kill()
        t0 = time.monotonic()
        results = await asyncio.gather(*(p.start("gone", group, x, 1.0)
                                         for p, x in zip(peers[1:], xs[1:])))
        assert time.monotonic() - t0 < DEADLINE_S / 2  # nobody waited for the dead peer
        assert_identical(results)
        assert rel_err(results[0].vector, weighted_mean(xs[1:], [1.0, 1.0])) < 1e-3
        assert results[0].missing == (peers[0].peer_id,)

    run(3, scenario)


def test_the_last_survivor_finishes_alone() -> None:
    x = vectors(1, 10_000)[0]

    async def scenario(peers: list[Peer]) -> None:
        group = [p.peer_id for p in peers]
        await peers[1].kill()
        result = await peers[0].start("alone", group, x, 1.0, deadline_s=3.0)
        assert torch.allclose(result.vector, x, atol=1e-3)  # its own gradient, through fp16
        assert result.missing == (peers[1].peer_id,)

    run(2, scenario)


def test_a_peer_joining_after_the_others_finished_catches_up() -> None:
    """The others do not wait for it past the deadline; it joins later, gets every part from
    them (the finished round still answers) and ends with the same vector."""
    xs = vectors(2, 10_000, seed=8)

    async def scenario(peers: list[Peer]) -> None:
        group = [p.peer_id for p in peers]
        first = await peers[0].start("slow", group, xs[0], 1.0, deadline_s=1.5)
        assert first.missing == (peers[1].peer_id,)
        late = await peers[1].start("slow", group, xs[1], 1.0, deadline_s=1.5)
        assert_identical([first, late])

    run(2, scenario)


def _hung_peer(host: Host) -> None:
    """Make ``host`` accept all-reduce requests and never answer (a hung process)."""

    async def hang(stream: Any) -> None:
        await stream.receive(timeout=30)
        await asyncio.Event().wait()  # never set: hangs until the host closes and cancels it

    host.set_handler(PROTOCOL, hang)


def test_a_hung_peer_does_not_take_the_round_down() -> None:
    x = vectors(1, 10_000)[0]

    async def scenario(peers: list[Peer]) -> None:
        a, hung = peers
        await hung.averager.__aexit__(None, None, None)
        _hung_peer(hung.host)
        t0 = time.monotonic()
        result = await a.start("hung", [a.peer_id, hung.peer_id], x, 1.0, deadline_s=2.0)
        assert time.monotonic() - t0 < 2.0
        assert result.missing == (hung.peer_id,) and torch.allclose(result.vector, x, atol=1e-2)

    run(2, scenario)


def test_a_round_that_cannot_complete_fails_by_its_deadline() -> None:
    """A peer raises this peer's floor for its own unit (as a repairer does), then never
    answers: that unit has no value at the deadline, and the round fails with a typed error."""

    async def scenario(peers: list[Peer]) -> None:
        a, liar = peers
        await liar.averager.__aexit__(None, None, None)
        _hung_peer(liar.host)
        group = [a.peer_id, liar.peer_id]
        plan = RoundPlan.build("doomed", group, 1000)
        mine = next(u for u, unit in enumerate(plan.units) if unit.owner == plan.index(a.peer_id))
        await liar.host.dial(a.host.addrs[0])
        async with await liar.host.open_stream(a.peer_id, PROTOCOL) as stream:
            await stream.send(Message(kind="probe", meta={
                "r": "doomed", "d": plan.digest, "u": mine, "e": 1, "g": 0.0, "t": 5.0}))
            assert (await stream.receive(timeout=5)).kind == "absent"  # type: ignore[union-attr]
        t0 = time.monotonic()
        with pytest.raises(AllReduceFailed):
            await a.start("doomed", group, torch.ones(1000), 1.0, deadline_s=1.5)
        assert 1.4 < time.monotonic() - t0 < 2.5
        assert a.counter("rounds_failed") == 1

    run(2, scenario)


# ---- bounded buffering, late and foreign messages ---------------------------------------

def test_messages_for_rounds_not_started_are_buffered_within_bounds() -> None:
    options = AveragerOptions(max_pending_rounds=2)

    async def scenario(peers: list[Peer]) -> None:
        client, server = peers

        await client.host.dial(server.host.addrs[0])

        async def contribute(round_id: str, wait: float) -> Any:
            stream = await client.host.open_stream(server.peer_id, PROTOCOL)
            async with stream:
                await stream.send(Message(kind="contribute", meta={
                    "r": round_id, "d": "0" * 16, "u": 0, "w": 1.0, "t": wait},
                    tensors=(torch.zeros(8),)))
                return await stream.receive(timeout=5)

        held = [asyncio.ensure_future(contribute(f"future{i}", 0.5)) for i in range(2)]
        await wait_until(lambda: server.counter("contributions_received") >= 2, "buffering")
        with pytest.raises(RemoteError) as busy:
            await contribute("future2", 0.5)
        assert busy.value.code == "busy"
        for task in held:  # nobody joined those rounds: typed refusals, not hangs
            with pytest.raises(RemoteError) as late:
                await task
            assert late.value.code == "not_joined"
        with pytest.raises(ValueError):  # a round id is never reused
            group = [p.peer_id for p in peers]
            await asyncio.gather(*(p.start("once", group, torch.ones(4), 1.0) for p in peers))
            await server.start("once", group, torch.ones(4), 1.0)

    run(2, scenario, options=options)

