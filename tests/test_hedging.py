"""Hedged hops (issue 28): a forward that runs well past its stage's usual hop time is sent a
second time to another peer of the stage and the first ``ok`` wins. The pure book
(``swarmd.pipeline.hedging``) first, then the router with a fake host (real short waits: a
silent peer is one whose request never returns), the trainer's duplicate arrivals, and a
silent liar claiming 1e12 samples/s at stage 1 of a real in-process swarm."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

import pytest
import torch
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.pipeline.hedging import HedgeConfig, Hedging, percentile
from swarmd.pipeline.router import Router
from transport.errors import DeadlineExceeded, RemoteError
from transport.frames import Message

from inprocess_swarm import two_stage_swarm

FAST = HedgeConfig(floor_s=0.02, cold_s=0.05, min_hops=1)


# ---- the book --------------------------------------------------------------------------------

def test_the_delay_is_cold_until_measured_then_a_multiple_of_the_percentile_within_bounds() -> None:
    h = Hedging(HedgeConfig(multiple=3.0, percentile=0.9, floor_s=0.5, cap_s=30.0, cold_s=10.0,
                            min_hops=4))
    assert h.delay() == 10.0
    for s in (0.1, 0.1, 0.1):
        h.observe(s)
    assert h.delay() == 10.0  # three hops: still cold
    h.observe(0.4)
    assert h.delay() == pytest.approx(1.2)  # 3 x p90 (0.4)
    for s in (float("nan"), float("inf"), -1.0):
        h.observe(s)  # ignored
    assert h.delay() == pytest.approx(1.2)
    for _ in range(64):
        h.observe(0.01)  # the window forgets the slow one; the floor holds
    assert h.delay() == 0.5
    for _ in range(64):
        h.observe(100.0)
    assert h.delay() == 30.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=200),
       st.floats(1.0, 10.0), st.floats(0.05, 1.0))
def test_the_delay_is_bounded_and_few_kept_hops_take_longer_than_a_third_of_it(
        hops: list[float], multiple: float, q: float) -> None:
    cfg = HedgeConfig(multiple=multiple, percentile=q, floor_s=0.5, cap_s=60.0, min_hops=1)
    h = Hedging(cfg)
    for s in hops:
        h.observe(s)
    d = h.delay()
    assert cfg.floor_s <= d <= cfg.cap_s
    kept = hops[-cfg.window:]
    if d < cfg.cap_s:  # not clamped from above: at most 1 - q of the kept hops take longer
        slower = sum(1 for s in kept if s > d / multiple * (1 + 1e-9))
        assert slower <= (1 - q) * len(kept) + 1e-9
    assert percentile(kept, q) in kept


def test_a_peer_losing_races_in_a_row_is_marked_slow_and_a_win_forgives() -> None:
    h = Hedging(HedgeConfig(slow_after=2, keep=3))
    assert h.lost("a") is False and h.losses("a") == 1
    h.won("a")
    assert h.lost("a") is False  # the win ended the streak
    assert h.lost("a") is True and h.losses("a") == 0  # two in a row: slow, starts over
    for p in "bcde":
        h.lost(p)
    assert h.losses("b") == 0 and h.losses("e") == 1  # at most ``keep`` remembered


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), max_size=300),
       st.floats(0.0, 0.5), st.floats(0.0, 20.0))
def test_needless_hedges_are_bounded_by_the_budget_and_needed_ones_are_not(
        sends: list[tuple[bool, bool]], share: float, burst: float) -> None:
    """Each send: (it runs long, its hedge would win). Hedges the first try beat anyway are
    at most ``burst + share x sends``; once the budget allows one, a winning hedge never
    stops the next from being sent (it is refunded)."""
    h = Hedging(HedgeConfig(budget_share=share, budget_burst=burst))
    needless = 0
    for long, wins in sends:
        h.sent()
        if long and h.may_hedge():
            h.hedged()
            if wins:
                before = h.tokens
                h.hedge_won()
                assert h.may_hedge() or before + 1 > burst  # (capped by the burst only)
            else:
                needless += 1
    assert needless <= burst + share * len(sends) + 1e-9


def test_a_stalled_peer_is_hedged_every_time_while_needless_hedges_run_out() -> None:
    h = Hedging(HedgeConfig(budget_share=0.1, budget_burst=2.0))
    for _ in range(50):  # every hedge wins: a silent peer
        h.sent()
        assert h.may_hedge()
        h.hedged()
        h.hedge_won()
    for _ in range(2):  # needless hedges: the burst, then nothing until earned again
        h.sent()
        h.hedged()
    h.sent()
    assert not h.may_hedge()
    for _ in range(9):
        h.sent()
    assert h.may_hedge()


@pytest.mark.parametrize("bad", [dict(multiple=0.5), dict(percentile=0.0), dict(floor_s=-1.0),
                                 dict(cap_s=0.1, floor_s=1.0), dict(window=0),
                                 dict(cold_s=float("nan")), dict(slow_after=1.5),
                                 dict(budget_share=-0.1), dict(budget_burst=float("inf"))])
def test_a_bad_config_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        HedgeConfig(**bad)


# ---- the router (a fake host) ----------------------------------------------------------------

MSG = Message(kind="forward", meta={}, tensors=(torch.zeros(2, 3, 4),))
OK = Message(kind="ok", meta={"service_s": 0.005, "held_s": 0.008})


class SilentHost:
    """Peers in ``silent`` never answer (until the request's own deadline); the others answer
    ``ok`` at once, or after ``lag`` seconds."""

    def __init__(self, silent: set[str], lag: dict[str, float] | None = None,
                 busy: dict[str, set[int]] | None = None) -> None:
        self.silent, self.lag, self.busy = silent, lag or {}, busy or {}
        self.requests: list[str] = []
        self.cancelled: list[str] = []

    async def connect(self, peer: str, addrs: Any, *, timeout: float) -> None:
        pass

    async def request(self, peer: str, protocol: str, message: Message, *, codec: Any,
                      timeout: float) -> Message:
        n = self.requests.count(peer)
        self.requests.append(peer)
        if n in self.busy.get(peer, set()):
            raise RemoteError("busy", "full")
        try:
            if peer in self.silent:
                await asyncio.sleep(timeout)
                raise DeadlineExceeded(f"{peer} said nothing in {timeout:.1f} s")
            await asyncio.sleep(self.lag.get(peer, 0.0))
            return OK
        except asyncio.CancelledError:
            self.cancelled.append(peer)
            raise


def _router(host: SilentHost, tput: dict[str, float], **kw: Any) -> Router:
    peers = {p: (t, 0, (f"/ip4/127.0.0.1/tcp/1/p2p/{p}",)) for p, t in tput.items()}
    return Router(host, stage=1, protocol="/p", peers_of=lambda s: dict(peers), codec=None,
                  rng=random.Random(0), hedging=Hedging(kw.pop("config", FAST)), **kw)


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_forward_held_by_a_silent_liar_is_hedged_and_the_honest_answer_wins() -> None:
    """A liar claiming 1e12 beside a measured honest peer: it gets its probes; each forward
    it holds is re-sent to the honest peer once past the stage's usual hop time, the honest
    ``ok`` wins, the liar's try is cancelled and, never having answered, marked slow."""
    host = SilentHost({"liar"})
    router = _router(host, {"honest": 1.0})
    told: list[str] = []

    async def scenario() -> list[str]:
        await router.send(MSG, timeout=20.0)  # measures the honest peer
        router.peers_of = lambda s: {"honest": (1.0, 0, ("/ip4/127.0.0.1/tcp/1/p2p/honest",)),
                                     "liar": (1e12, 0, ("/ip4/127.0.0.1/tcp/1/p2p/liar",))}
        winners = []
        for _ in range(2):
            peer, _reply = await router.send(MSG, timeout=20.0, on_attempt=told.append)
            winners.append(peer)
        assert host.cancelled == ["liar"]  # the second loss; the first runs on as its probe
        await router.aclose()
        return winners

    winners = _run(scenario())
    assert winners == ["honest", "honest"]
    assert told == ["liar", "honest", "liar", "honest"]  # the liar first (its claim), hedged
    assert router.counters["hedged"] == 2 and router.counters["hedge_lost"] == 2
    assert router.counters["hedge_won"] == 2 and router.counters["hedge_slow"] == 2
    assert router.counters["hedge_probe"] == 1  # one probe a peer
    assert router.counters["hop_slow"] == 0  # no try waited out its deadline
    assert host.cancelled == ["liar", "liar"]  # and the probe, by close
    (row,) = [r for r in router.wiring.snapshot(0.0) if r.peer_id == "liar"]
    assert row.slow and row.timeouts == 2  # it never answered: slow at each loss
    # its probes were all freed: a peer not yet measured is still tried, at a smaller share
    assert router.wiring._peers["liar"].probing == 0


def test_a_hedge_answered_busy_is_sent_again_once_the_peer_is_back() -> None:
    """The honest peer answers the hedge ``busy`` (a step behind, its queue full): it sits
    out its pause, and the silent try is hedged to it again once it is back, not left to
    run to its deadline."""
    host = SilentHost({"liar"}, busy={"honest": {1}})
    router = _router(host, {"honest": 1.0})

    async def scenario() -> str:
        await router.send(MSG, timeout=20.0)  # measures the honest peer
        router.peers_of = lambda s: {"honest": (1.0, 0, ("/ip4/127.0.0.1/tcp/1/p2p/honest",)),
                                     "liar": (1e12, 0, ("/ip4/127.0.0.1/tcp/1/p2p/liar",))}
        peer, _ = await router.send(MSG, timeout=20.0)
        return peer

    assert _run(scenario()) == "honest"
    assert host.requests == ["honest", "liar", "honest", "honest"]
    assert router.counters["hedged"] == 2 and router.counters["hop_busy"] == 1
    assert router.counters["hedge_no_peer"] == 1 and router.counters["hedge_won"] == 1
    assert router.counters.get("hop_slow", 0) == 0


def test_a_hedge_goes_to_a_peer_that_answered_before_not_to_another_claim() -> None:
    """Eight silent identities claiming 1e12 beside one measured honest peer: every forward a
    liar holds is hedged to the honest peer, never to another liar (which would be silent
    too)."""
    liars = {f"liar{i}" for i in range(8)}
    host = SilentHost(liars)
    router = _router(host, {"honest": 1.0})

    async def scenario() -> list[str]:
        await router.send(MSG, timeout=20.0)  # measures the honest peer
        listed = {p: (1e12, 0, (f"/ip4/127.0.0.1/tcp/1/p2p/{p}",)) for p in liars}
        listed["honest"] = (1.0, 0, ("/ip4/127.0.0.1/tcp/1/p2p/honest",))
        router.peers_of = lambda s: dict(listed)
        sends = [router.send(MSG, timeout=20.0) for _ in range(8)]
        return [peer for peer, _ in await asyncio.gather(*sends)]

    winners = _run(scenario())
    assert winners == ["honest"] * 8
    assert router.counters["hedged"] == router.counters["hedge_won"] >= 1
    assert host.requests.count("honest") == 1 + 8  # each send answered by it, once
    assert router.counters.get("hop_slow", 0) == 0


def test_a_peer_alone_in_its_stage_is_not_hedged_and_waits_out_its_deadline() -> None:
    host = SilentHost({"liar"})
    router = _router(host, {"liar": 1e12})
    from swarmd.errors import StageUnavailable
    with pytest.raises(StageUnavailable):
        _run(router.send(MSG, timeout=0.3))
    assert router.counters["hedged"] == 0 and router.counters["hedge_no_peer"] == 1
    assert router.counters["hop_slow"] == 1


def test_hedges_the_first_try_wins_anyway_stop_when_the_budget_is_spent() -> None:
    """A loaded stage where every hop is slow but answers: the first hedge is sent, loses to
    the first try (``hedge_first_won``), and with no budget left the next is not sent."""
    host = SilentHost(set(), lag={"a": 0.3, "b": 5.0})
    router = _router(host, {"a": 10.0, "b": 1.0},
                     config=HedgeConfig(floor_s=0.02, cold_s=0.05, min_hops=4,
                                        budget_share=0.0, budget_burst=1.0))

    async def scenario() -> None:
        for _ in range(2):
            await router.send(MSG, timeout=20.0)

    _run(scenario())
    assert router.counters["hedged"] == 1 and router.counters["hedge_first_won"] == 1
    assert router.counters["hedge_over_budget"] >= 1 and host.requests.count("b") == 1


def test_a_peer_that_answered_before_is_marked_slow_only_after_two_lost_races() -> None:
    lag = {"a": 0.0, "b": 0.0}
    host = SilentHost(set(), lag=lag)
    router = _router(host, {"a": 1.0, "b": 1.0})

    async def scenario() -> None:
        while not {"a", "b"} <= set(host.requests):  # both measured (answered at once)
            await router.send(MSG, timeout=20.0)
        # now every hop takes 0.5 s, hedged after 0.05 s: the first try always wins
        router.hedging = Hedging(HedgeConfig(floor_s=0.02, cold_s=0.05, min_hops=4))
        lag.update(a=0.5, b=0.5)
        for _ in range(4):
            await router.send(MSG, timeout=20.0)

    _run(scenario())
    assert router.counters["hedged"] == 4 and router.counters["hedge_lost"] == 4
    # each race lost by whichever went second; a streak of 2 marks slow, a win ends it
    assert router.counters["hedge_slow"] < router.counters["hedge_lost"]
    assert router.counters.get("hop_slow", 0) == 0


def test_an_unmeasured_peer_slow_to_first_answer_is_measured_by_the_race_it_loses() -> None:
    """A newcomer whose path is cold (its first answer takes 0.3 s, later ones none: a relayed
    connection, a loaded machine) beside a measured peer hedged after 0.02 s: it loses its
    first race, but that try runs on as its probe, answers, and measures it; from then on it
    wins its share. Cancelled instead, it would lose every race it is given, never answer,
    and never be measured (issue 28's starved relayed peer)."""
    answered: set[str] = set()

    class ColdHost(SilentHost):
        async def request(self, peer: str, protocol: str, message: Message, *, codec: Any,
                          timeout: float) -> Message:
            self.lag[peer] = 0.0 if peer in answered or peer == "warm" else 0.3
            reply = await super().request(peer, protocol, message, codec=codec,
                                          timeout=timeout)
            answered.add(peer)
            return reply

    host = ColdHost(set())
    router = _router(host, {"warm": 1.0})
    winners: list[str] = []

    async def scenario() -> None:
        await router.send(MSG, timeout=20.0)  # measures the warm peer
        router.peers_of = lambda s: {p: (1.0, 0, (f"/ip4/127.0.0.1/tcp/1/p2p/{p}",))
                                     for p in ("warm", "cold")}
        while "cold" not in host.requests:
            await router.send(MSG, timeout=20.0)
        await asyncio.gather(*router._probes)  # its answer, 0.3 s after it was sent
        for _ in range(40):
            peer, _ = await router.send(MSG, timeout=20.0)
            winners.append(peer)
        await router.aclose()

    _run(scenario())
    assert "cold" not in router.wiring.unmeasured()
    assert winners.count("cold") >= 5, winners  # its share, not starved
    (row,) = [r for r in router.wiring.snapshot(0.0) if r.peer_id == "cold"]
    assert not row.slow  # its answer ended the mark its loss gave it
    assert router.counters["hedge_probe_answered"] == router.counters["hedge_probe"] == 1
    assert "cold" not in host.cancelled
    assert router.wiring._peers["cold"].probing == 0


def test_a_backward_is_never_hedged() -> None:
    """Only the peer that saved a forward's activations can run its backward."""
    host = SilentHost({"a"})
    router = _router(host, {"a": 10.0, "b": 1.0})
    from swarmd.errors import StageUnavailable
    with pytest.raises(StageUnavailable):
        _run(router.send(MSG, timeout=0.3, kind="backward"))
    assert router.counters["hedged"] == 0 and "b" not in host.requests[:1]


def test_when_the_first_try_answers_before_the_hedge_the_hedge_is_the_loser() -> None:
    host = SilentHost(set(), lag={"a": 0.3, "b": 5.0})
    router = _router(host, {"a": 10.0, "b": 1.0})
    peer, _ = _run(router.send(MSG, timeout=20.0))
    assert peer == "a" and host.requests == ["a", "b"]
    assert router.counters["hedge_first_won"] == 1 and router.counters["hedge_lost"] == 1
    assert host.cancelled == ["b"]
    assert router.hedging is not None and router.hedging.losses("b") == 1
    assert router.counters["hedge_slow"] == 1  # b never answered yet: slow at once


def test_without_hedging_the_send_waits_for_the_silent_peer() -> None:
    """The same liar with hedging off: the forward it holds waits out the whole deadline
    (what the tests above show hedging avoids)."""
    host = SilentHost({"liar"})
    router = _router(host, {"honest": 1.0})
    router.hedging = None
    from swarmd.errors import StageUnavailable

    async def scenario() -> None:
        await router.send(MSG, timeout=20.0)  # measures the honest peer
        router.peers_of = lambda s: {"honest": (1.0, 0, ("/ip4/127.0.0.1/tcp/1/p2p/honest",)),
                                     "liar": (1e12, 0, ("/ip4/127.0.0.1/tcp/1/p2p/liar",))}
        await router.send(MSG, timeout=0.5)

    with pytest.raises(StageUnavailable):
        _run(scenario())
    assert host.requests == ["honest", "liar"] and router.counters["hop_slow"] == 1
    assert router.counters["hedged"] == 0


# ---- the trainer: a hedge's second result or grad -----------------------------------------------

def test_a_second_result_or_grad_of_a_microbatch_is_ignored_and_counted() -> None:
    from swarmd.models.gpt import ModelConfig

    config = ModelConfig(width=32, heads=2, layers=2, seq_len=16)

    async def scenario() -> None:
        from swarmd.trainer.trainer import Trainer
        from transport import identity
        from transport.codecs import CodecSpec
        from transport.host import Host, HostOptions

        codec = CodecSpec(name="none")  # the handler alone: the host is never started
        host = Host(identity.generate(), HostOptions(pubsub=None, codec=codec))
        trainer = Trainer(host, swarm="hedge-dup", num_stages=2, model_config=config,
                          model_hash=config.model_hash(), codec=codec, lr=1e-3, seed=0,
                          peers_of=lambda s: {})
        s0, s1 = (identity.generate().peer_id for _ in range(2))
        try:
            other = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBInPUJtB6hq7QZ"
            shape = (2, 16, 32)
            first = torch.ones(shape)
            expected = trainer._expect("result", "m/1", shape, first={s0})
            meta = {"mb": "m/1", "path": [s0, s1]}
            reply = await trainer._on_arrival(
                Message(kind="result", meta=meta, tensors=(first,)), s1)
            assert "late" not in reply.meta
            # the hedge's copy through another last-stage peer: the first one counts
            reply = await trainer._on_arrival(Message(kind="result", meta={
                "mb": "m/1", "path": [s0, other]}, tensors=(torch.zeros(shape),)), other)
            assert reply.meta["late"] is True and trainer.counters["duplicate_results"] == 1
            assert expected.path == (s0, s1) and torch.equal(expected.future.result(), first)
            grad = trainer._expect("grad", "m/1", shape, first={s0})
            for g in (first, torch.zeros(shape)):
                await trainer._on_arrival(Message(kind="grad", meta={"mb": "m/1"},
                                                  tensors=(g,)), s0)
            assert trainer.counters["duplicate_grads"] == 1
            assert torch.equal(grad.future.result(), first)
        finally:
            trainer.close()

    uvloop.run(asyncio.wait_for(scenario(), 60))


# ---- the figure: a silent liar at stage 1 of a real swarm ---------------------------------------

@pytest.mark.parametrize("liars,leads", [(1, False), (8, False), (1, True), (8, True)])
def test_a_silent_liar_claiming_1e12_at_stage_1_costs_hedges_not_deadlines(liars: int,
                                                                          leads: bool) -> None:
    """Issue 28's figure, in process: two stages on real libp2p hosts, exact steps, then a
    host listed at stage 1 announcing 1e12 samples/s that takes forwards and never answers
    (or 8 such hosts, 8 identities). ``leads``: the liars' ids sort before the honest peer's
    and they take the stage's round messages too, never answering them: by id alone a liar
    would lead stage 1's rounds (the honest peer's steps waited for its answers).
    The trainer trains on: nothing lost, no hop waited out its deadline, every forward the
    liar took was hedged and answered by the honest peer (which served every path). The
    longest gap between steps over the median step is printed (issue 28: at most 3)."""
    from swarmd.models.gpt import ModelConfig
    from swarmd.pipeline.inflight import InFlight
    from swarmd.pipeline.server import protocols
    from swarmd.protocols import Protocols
    from transport import identity
    from transport.codecs import CodecSpec
    from transport.host import Host, HostOptions

    config = ModelConfig(width=32, heads=2, layers=2, seq_len=16)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 256, (2, 16), generator=g),
                torch.randint(0, 256, (2, 16), generator=g)) for _ in range(4 * 20)]

    async def scenario() -> tuple[list[float], dict[str, Any], Any, list[str], Any, Any,
                                  dict[str, Any]]:
        view: dict[int, dict[str, Any]] = {}
        hosts: list[Host] = []
        taken: list[str] = []
        rounds: list[str] = []
        never = asyncio.Event()

        async def on_forward(message: Message, peer: str) -> Message:
            taken.append(str(message.meta.get("mb")))
            await never.wait()
            return Message(kind="ok")

        async def on_round(message: Message, peer: str) -> Message:
            rounds.append(message.kind)
            await never.wait()
            return Message(kind="ok")

        try:
            async with two_stage_swarm(config, target_batch_size=8, swarm="hedge-liar",
                                       view=view) as (servers, trainer):
                trainer.exact = True
                honest_id = servers[1].host.peer_id
                for _ in range(100_000):  # ids sort at random: bounded, a few hundred at most
                    if len(hosts) == liars:
                        break
                    ident = identity.generate()
                    if (ident.peer_id < honest_id) == leads:
                        hosts.append(Host(ident, HostOptions(pubsub=None,
                                                             codec=CodecSpec(name="none"))))
                assert len(hosts) == liars, "no id sorting as wanted was drawn"
                for liar in hosts:
                    await liar.start()
                    liar.set_request_handler(protocols("hedge-liar")["forward"], on_forward)
                    if leads:
                        liar.set_request_handler(Protocols("hedge-liar").round, on_round)
                drawn = iter(batches)
                stamps: list[float] = []

                async def stepped(step: int, loss: float) -> bool:
                    stamps.append(time.monotonic())
                    if step == 8:  # the honest peers are measured (32 hops, so the first,
                        # cold ones are above the p90): the liar joins stage 1
                        for liar in hosts:
                            view[1][liar.peer_id] = (1e12, 0, tuple(liar.addrs))
                    return False

                stamps.append(time.monotonic())
                await trainer.train(lambda: next(drawn), steps=20, microbatches=4,
                                    window=InFlight(floor=4, ceiling=4), on_step=stepped,
                                    barrier=True)
                gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                assert servers[0].router is not None and servers[0].router.hedging is not None
                print(f"\nstage 1's hedge delay at the end: "
                      f"{servers[0].router.hedging.delay():.3f} s")
                print("trainer:", {k: v for k, v in trainer.counters.items()
                                   if "report" in k or "hop" in k or "hedge" in k},
                      "stage 1:", {k: v for k, v in servers[1].counters.items()
                                   if k not in ("forward", "backward")})
                return (gaps, dict(servers[0].counters), trainer.stats, taken,
                        servers[1].host.peer_id, dict(trainer.counters),
                        dict(servers[1].sync.counters) | {"liar_round_messages": len(rounds)})
        finally:
            never.set()
            for liar in hosts:
                await liar.close()

    gaps, s0, stats, taken, honest, tc, sync = uvloop.run(asyncio.wait_for(scenario(), 120))
    after = gaps[8:]
    print(f"\nstage 1's rounds: {sync}")
    print(f"\n{liars} silent liar(s) at stage 1{' sorting first' if leads else ''}: "
          f"{len(taken)} forwards taken by them, "
          f"hedged {s0['hedged']}, "
          f"longest gap / median step = {max(after) / statistics.median(gaps):.2f} "
          f"(median {statistics.median(gaps):.3f} s, {statistics.median(gaps[:8]):.3f} s "
          f"before it joined, {statistics.median(after):.3f} s after; longest "
          f"{max(after):.3f} s; gaps "
          f"{' '.join(f'{g:.2f}' for g in gaps)})")
    assert stats.lost == 0 and len(gaps) == 20
    assert taken, "the liar was never sent a forward: the figure tests nothing"
    # each forward the liar took was hedged; or it was itself a hedge (its first try, at the
    # honest peer, slow under load, then won its race: 5 won for 7 taken in one loaded run)
    assert s0["hedged"] >= len(set(taken)) and s0["hedge_won"] >= 1
    assert s0.get("hop_slow", 0) == 0  # no forward waited out its deadline on the liar
    assert stats.routes[1].keys() == {honest}  # every path went through the honest peer
    assert s0.get("hedge_slow", 0) >= 1  # a peer that keeps losing is marked slow
    assert tc.get("hedged", 0) == 0  # one stage-0 peer: the trainer had nobody to hedge to
    # every step's reports came (a backward's source once landed in the stage's next step:
    # that stage step was not exact, and the trainer waited 60 s for its report)
    assert tc.get("reports_missed", 0) == 0
    if leads:  # the liars got round messages (probes), and no step waited for their answer
        assert sync["liar_round_messages"] >= 1 and sync["probes"] >= 1
        assert sync.get("answer_late.progress", 0) == sync.get("reports_sent", 0) == 0


def test_a_stalled_stage_peer_is_hedged_around_and_no_gradient_counts_twice() -> None:
    """Two peers at stage 1, one stalls (the forwards it takes wait, as a SIGSTOPped peer's
    would, until the trainer took 4 more steps, then run): stage 0 hedges the forwards it holds to
    its mate, training goes on, nothing is lost, and every microbatch's backward ran exactly
    once at each stage (the stalled peer's late forwards never get one): no gradient twice."""
    from swarmd.models.gpt import ModelConfig
    from swarmd.pipeline.inflight import InFlight

    config = ModelConfig(width=32, heads=2, layers=2, seq_len=16)
    g = torch.Generator().manual_seed(5)
    steps, per_step = 10, 4
    batches = [(torch.randint(0, 256, (2, 16), generator=g),
                torch.randint(0, 256, (2, 16), generator=g)) for _ in range(steps * per_step)]

    async def scenario() -> tuple[dict[str, Any], list[dict[str, Any]], Any, dict[str, Any],
                                  list[str], int]:
        async with two_stage_swarm(config, target_batch_size=8, swarm="hedge-stall",
                                   stage1_peers=2) as (servers, trainer):
            trainer.exact = True
            resume = asyncio.Event()
            held: list[str] = []
            #: the stage-1 peer that stalls: the first to take a forward from step 2 on (the
            #: router may send a few steps' forwards all to one of them: a fixed choice of
            #: peer then held nothing, and the test tested nothing)
            stalled: list[int] = []

            def stalling_at(i: int) -> Any:
                serve = servers[i].handlers._forward

                async def stalling(message: Message, peer: str) -> Message:
                    if not resume.is_set() and stalled in ([], [i]):
                        stalled[:] = [i]
                        held.append(str(message.meta.get("mb")))
                        await resume.wait()
                    return await serve(message, peer)
                return stalling

            drawn = iter(batches)

            async def stepped(step: int, loss: float) -> bool:
                if step == 2:  # one's forwards stall from now on (the handler's work behind it)
                    for i in (1, 2):
                        servers[i].handlers._forward = stalling_at(i)  # type: ignore[method-assign]
                if step == 6:
                    resume.set()
                return False

            await trainer.train(lambda: next(drawn), steps=steps, microbatches=per_step,
                                window=InFlight(floor=4, ceiling=4), on_step=stepped,
                                barrier=True)
            resume.set()
            for _ in range(400):  # the stages apply the last step once the trainer answered
                if all(s.step == steps for s in servers):
                    break
                await asyncio.sleep(0.05)
            return (dict(servers[0].counters),
                    [{**s.counters, **{f"sync.{k}": v for k, v in s.sync.counters.items()}}
                     for s in servers[1:]],
                    trainer.stats, dict(trainer.counters), held,
                    trainer.board.samples_mismatch)

    s0, s1, stats, tc, held, mismatch = uvloop.run(asyncio.wait_for(scenario(), 120))
    total = steps * per_step
    print(f"\nstalled stage-1 peer held {len(held)} forwards; stage 0 hedged "
          f"{s0.get('hedged', 0)}, "
          f"won {s0.get('hedge_won', 0)}, marked slow {s0.get('hedge_slow', 0)}; trainer: "
          f"duplicate results {tc.get('duplicate_results', 0)}, late "
          f"{tc.get('late_arrivals', 0)}, restarted {stats.restarted}; stage 1: "
          f"{[{k: v for k, v in c.items() if k.startswith(('sync.', 'stage.busy'))} for c in s1]}")
    assert stats.lost == 0 and stats.microbatches == total
    assert held, "no forward reached the stalled peer: the test tests nothing"
    # every forward the stalled peer held was hedged, or was itself a hedge (its first try, at
    # the mate, slow under load: a race the first try won; 6 of 7 held ones won in one loaded
    # run), so not every held forward is a race its hedge won
    assert s0.get("hedged", 0) >= len(held) and s0.get("hedge_won", 0) >= 1
    assert s0.get("hop_slow", 0) == 0  # no forward waited out its deadline
    # each microbatch that came back whole ran its backward once at each stage
    if stats.restarted == 0:  # (a restart may have run a backward at stage 1 only)
        assert s0["backward"] == total == sum(c["backward"] for c in s1)
    # every stage stepped on each sample once: the stalled peer's forwards counted nowhere
    assert s0["stepped_samples"] == 2 * total == sum(c["stepped_samples"] for c in s1)
    assert mismatch == 0  # every stage step held exactly its trainer step's samples
