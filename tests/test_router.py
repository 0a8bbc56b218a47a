"""The hop router's judgement with a fake host and a virtual clock (no network): who is at
fault for each failure, and that every send is bounded in tries and time."""

from __future__ import annotations

import asyncio
import random
from typing import Any, Callable

import pytest
import torch

from swarmd.errors import OutputRefused, StageUnavailable, TrainerUnreachable
from swarmd.pipeline.router import MAX_ATTEMPTS, Router, Verdict, judge
from transport.errors import (
    DeadlineExceeded,
    LocalUsageError,
    MalformedFrame,
    PeerUnavailable,
    RemoteError,
)
from transport.frames import Message

MSG = Message(kind="forward", meta={}, tensors=(torch.zeros(2, 3, 4),))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


class FakeHost:
    """Answers each request with ``behave[peer](n)`` (n: that peer's request count)."""

    def __init__(self, clock: Clock, behave: dict[str, Callable[[int], Any]],
                 unreachable: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.clock, self.behave, self.unreachable = clock, behave, unreachable
        self.requests: list[str] = []
        self.dialed: list[tuple[str, tuple[str, ...]]] = []

    async def connect(self, peer: str, addrs: Any, *, timeout: float) -> None:
        self.dialed.append((peer, tuple(addrs)))
        if peer in self.unreachable:
            raise PeerUnavailable(f"dial {peer} failed")

    async def request(self, peer: str, protocol: str, message: Message, *, codec: Any,
                      timeout: float) -> Message:
        assert timeout > 0
        n = self.requests.count(peer)
        self.requests.append(peer)
        self.clock.now += 0.01
        outcome = self.behave[peer](n)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


OK = Message(kind="ok", meta={"service_s": 0.005, "held_s": 0.008})
BUSY = RemoteError("busy", "full")


def _router(behave: dict[str, Callable[[int], Any]], **kw: Any) -> tuple[Router, FakeHost,
                                                                          Clock]:
    clock = Clock()
    host = FakeHost(clock, behave, kw.pop("unreachable", set()))
    tput = kw.pop("tput", {})  # announced throughputs: the fastest is chosen first
    peers = {p: (tput.get(p, 1.0), 0, (f"/ip4/127.0.0.1/tcp/1/p2p/{p}",)) for p in behave}
    router = Router(host, stage=1, protocol="/p", peers_of=lambda s: dict(peers), codec=None,
                    rng=random.Random(0), clock=clock, sleep=clock.sleep, **kw)
    return router, host, clock


def _send(router: Router, **kw: Any) -> Any:
    return asyncio.run(router.send(MSG, timeout=kw.pop("timeout", 30.0), **kw))


@pytest.mark.parametrize("exc, verdict", [
    (RemoteError("bad_activation", ""), Verdict.OURS),
    (RemoteError("codec_error", ""), Verdict.OURS),
    (RemoteError("limit_exceeded", ""), Verdict.OURS),
    (LocalUsageError("x"), Verdict.OURS),
    (RemoteError("busy", ""), Verdict.BUSY),
    (DeadlineExceeded("x"), Verdict.SLOW),
    (PeerUnavailable("x"), Verdict.BROKEN),
    (MalformedFrame("x"), Verdict.BROKEN),
    (RemoteError("output_refused", ""), Verdict.BROKEN),
    (RemoteError("wrong_stage", ""), Verdict.BROKEN),
    (RemoteError("internal_error", ""), Verdict.BROKEN),
    (RemoteError("stage_unavailable", ""), Verdict.PASS_UP),
    (RemoteError("trainer_unreachable", ""), Verdict.PASS_UP),
    (KeyError("a bug"), Verdict.OURS),
])
def test_judge_says_who_is_at_fault(exc: BaseException, verdict: Verdict) -> None:
    assert judge(exc) is verdict


def test_a_refusal_of_our_output_is_raised_and_bans_nobody() -> None:
    router, host, _ = _router({"a": lambda n: RemoteError("bad_activation", "nan")})
    with pytest.raises(OutputRefused, match="refused our forward"):
        _send(router)
    assert host.requests == ["a"] and router.wiring.banned == 0


def test_busy_tries_another_peer_now_and_bans_nobody() -> None:
    router, host, _ = _router({"a": lambda n: BUSY, "b": lambda n: BUSY, "c": lambda n: OK})
    peer, reply = _send(router)
    assert peer == "c" and reply.service_s == 0.005
    assert router.wiring.banned == 0 and router.counters["hop_busy"] == len(host.requests) - 1


def test_every_peer_busy_for_a_while_is_waited_out_not_failed() -> None:
    router, host, clock = _router({"a": lambda n: BUSY if n < 3 else OK,
                                   "b": lambda n: BUSY if n < 3 else OK})
    peer, _ = _send(router)
    assert router.wiring.banned == 0 and router.counters["waited"] >= 2
    assert clock.now < 30.0


def test_busy_forever_without_wait_gives_up_within_bounds() -> None:
    router, host, clock = _router({"a": lambda n: BUSY, "b": lambda n: BUSY})
    with pytest.raises(StageUnavailable):
        _send(router)
    assert len(host.requests) <= MAX_ATTEMPTS and clock.now <= 30.0


def test_a_dial_failure_bans_and_the_next_peer_takes_it() -> None:
    router, host, _ = _router({"a": lambda n: OK, "b": lambda n: OK}, unreachable={"a", "b"})
    with pytest.raises(StageUnavailable):
        _send(router)
    assert router.wiring.banned == 2 and host.requests == []
    # only the announced addresses were dialed
    assert all(addrs == (f"/ip4/127.0.0.1/tcp/1/p2p/{p}",) for p, addrs in host.dialed)


def test_an_unreachable_peer_is_waited_out_with_wait_and_the_send_ends_by_its_deadline() -> None:
    router, host, clock = _router({"a": lambda n: OK}, unreachable={"a"})
    with pytest.raises(StageUnavailable):
        _send(router, wait=True, timeout=100.0)
    assert 15.0 <= clock.now <= 100.0 + 1.0  # banned 15 s, then 30 s, ... never past it
    assert 2 <= len(host.dialed) <= MAX_ATTEMPTS


def test_a_timeout_is_slow_not_banned() -> None:
    router, host, _ = _router({"a": lambda n: DeadlineExceeded("late"), "b": lambda n: OK},
                              tput={"a": 1000.0})
    peer, _ = _send(router)
    assert peer == "b" and host.requests == ["a", "b"]
    (a, _b) = router.wiring.snapshot(1.0)
    assert a.slow and a.banned_until is None and router.counters["rerouted"] == 1


@pytest.mark.parametrize("code, error", [("stage_unavailable", StageUnavailable),
                                         ("trainer_unreachable", TrainerUnreachable)])
def test_a_later_stage_s_failure_is_passed_up(code: str, error: type) -> None:
    router, host, _ = _router({"a": lambda n: RemoteError(code, "later"), "b": lambda n: OK},
                              tput={"a": 1000.0})
    with pytest.raises(error):
        _send(router)
    assert len(host.requests) == 1 and router.wiring.banned == 0


def test_a_reply_that_is_not_ok_is_the_peer_s_fault() -> None:
    router, host, _ = _router({"a": lambda n: Message(kind="result"), "b": lambda n: OK},
                              tput={"a": 1000.0})
    peer, _ = _send(router)
    assert peer == "b" and router.wiring.banned == 1


def test_on_attempt_is_told_every_peer_before_it_is_sent_to() -> None:
    seen: list[str] = []
    router, host, _ = _router({"a": lambda n: BUSY, "b": lambda n: OK}, tput={"a": 1000.0})
    _send(router, on_attempt=seen.append)
    assert seen == host.requests == ["a", "b"]


def test_a_peer_reached_only_through_a_relay_is_counted_at_a_share_and_a_direct_one_first() -> None:
    from swarmd.pipeline.router import RELAYED_SHARE, announced_throughput

    relayed = ("/ip4/198.18.0.2/tcp/4001/p2p/R/p2p-circuit/p2p/B",)
    both = (*relayed, "/ip4/198.18.0.9/tcp/4001/p2p/B")
    assert announced_throughput(100.0, relayed) == 100.0 * RELAYED_SHARE
    assert announced_throughput(100.0, both) == 100.0  # one direct address suffices
    assert announced_throughput(100.0, ()) == 100.0
    # announcing twice the direct peer's throughput, the relayed peer still comes second
    router, host, _ = _router({"direct": lambda n: OK, "relayed": lambda n: OK},
                              tput={"direct": 1.0, "relayed": 2.0})
    peers = router.peers_of(1)
    router.peers_of = lambda s: {**peers, "relayed": (2.0, 0, relayed)}
    _send(router)
    assert host.requests == ["direct"]


def _with_a_newcomer(answer: Callable[[int], Any]) -> tuple[Router, FakeHost, Clock]:
    """A router to a stage with a measured peer ("old") and one not yet measured ("new")."""
    router, host, clock = _router({"old": lambda n: OK, "new": answer})
    router.wiring.update_peers({"old": (1.0, 0), "new": (1.0, 0)}, 0.0)
    router.wiring.success("old", 2, 0.002, "forward", 0.0)  # 1,000 samples/s
    return router, host, clock


@pytest.mark.parametrize("answer", [BUSY, RemoteError("stage_unavailable", "later")],
                         ids=["busy", "passed_up"])
def test_a_newcomer_whose_tries_end_unmeasured_keeps_being_tried(answer: Exception) -> None:
    # each try of a peer not yet measured holds one of its probes until it ends: one that
    # ends with no measurement (busy: a mover a step behind; a later stage's failure) must
    # free it, or after probe_tasks such tries the peer is never chosen again
    router, host, clock = _with_a_newcomer(lambda n: answer)
    probes = router.wiring.config.probe_tasks
    for _ in range(5 * probes):
        clock.now += 5.0  # past a busy pause
        try:
            _send(router)
        except StageUnavailable:
            pass
    assert host.requests.count("new") > probes, host.requests


def test_a_send_given_up_while_a_newcomer_holds_it_frees_that_probe() -> None:
    router, host, clock = _with_a_newcomer(lambda n: OK)
    probes = router.wiring.config.probe_tasks
    asked: list[str] = []

    async def hang(peer: str, *args: Any, **kwargs: Any) -> Message:
        asked.append(peer)
        await asyncio.Event().wait()  # never answers: the sender gives up first
        raise AssertionError("unreachable")

    async def main() -> None:
        host.request = hang  # type: ignore[method-assign]
        for _ in range(5 * probes):
            task = asyncio.create_task(router.send(MSG, timeout=30.0))
            for _ in range(5):
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    assert len(asked) == 5 * probes and asked.count("new") > probes, asked
