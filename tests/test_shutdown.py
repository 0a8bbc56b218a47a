"""A daemon's stop within ``node.shutdown_grace_s``, piece by piece, without a network: the
budget split (pure), the retiring gate (microbatches finished or handed back), a checkpoint
save abandoned at its deadline (the previous checkpoint intact, no file left) and the
watchdog. The whole stop through real daemons is tests/test_preemption.py."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swarmd.node import shutdown
from swarmd.node.shutdown import BEGIN, HURRY, IGNORE, StopRequests, plan_stop
from swarmd.node.watchdog import Watchdog
from swarmd.pipeline import stepping
from swarmd.pipeline.stepping import Gate
from swarmd.state import checkpoint as ckpt
from swarmd.state import keeper as keeper_module
from swarmd.state.checkpoint import SaveAborted, load_checkpoint, save_checkpoint
from swarmd.state.encoding import capture
from swarmd.state.keeper import StageKeeper
from swarmd.state.replay import ReplayLog

HASH = "model-abc"


# ---- the budget (pure) -------------------------------------------------------------------

@given(grace=st.floats(min_value=1e-3, max_value=3600), now=st.floats(-1e6, 1e6),
       estimate=st.one_of(st.none(), st.floats(min_value=0, max_value=1e5)))
def test_the_phases_are_in_order_and_fill_the_grace(grace: float, now: float,
                                                    estimate: float | None) -> None:
    b = plan_stop(grace, now=now, save_estimate_s=estimate)
    assert b.started_at == now
    assert now <= b.drain_until <= b.save_until <= b.close_until <= b.hard_until
    assert b.close_until == pytest.approx(now + grace)
    assert b.hard_until - b.close_until == pytest.approx(shutdown.HARD_MARGIN_S)
    # the drain always keeps a share of the grace, and so does the close
    eps = 1e-9 * (abs(now) + grace)  # float rounding of the sums
    keep = (1 - shutdown.SAVE_MAX_SHARE) * (1 - shutdown.CLOSE_SHARE) * grace
    assert b.drain_until - now >= keep - eps
    assert b.close_until - b.save_until > 0
    assert b.left(now) == pytest.approx(grace) and b.left(b.hard_until) == 0.0


def test_the_save_gets_what_the_last_one_took_and_the_drain_the_rest() -> None:
    b = plan_stop(20.0, now=100.0, save_estimate_s=2.0)
    assert (b.drain_until, b.save_until, b.close_until) == pytest.approx(
        (100 + 20 - 1.5 - 4.5, 100 + 20 - 1.5, 120.0))
    slow = plan_stop(20.0, now=0.0, save_estimate_s=1000.0)  # at most half of the rest
    assert slow.save_until - slow.drain_until == pytest.approx((20 - 1.5) / 2)
    small = plan_stop(1.0, now=0.0, save_estimate_s=None)  # the close reserve shrinks too
    assert small.close_until - small.save_until == pytest.approx(0.2)


@pytest.mark.parametrize("grace", [0.0, -1.0, float("nan")])
def test_a_grace_of_zero_or_less_is_refused(grace: float) -> None:
    with pytest.raises(ValueError, match="more than 0"):
        plan_stop(grace, now=0.0, save_estimate_s=None)


@given(grace=st.floats(min_value=1e-3, max_value=3600), at=st.floats(0, 4000))
def test_a_second_request_ends_the_drain_and_the_save_and_never_extends(grace: float,
                                                                        at: float) -> None:
    b = plan_stop(grace, now=0.0, save_estimate_s=1.0)
    h = b.hurried(at)
    assert h.drain_until <= min(b.drain_until, at) and h.save_until <= min(b.save_until, at)
    assert h.close_until <= min(b.close_until, at + shutdown.HURRY_S)
    assert h.hard_until <= b.hard_until
    assert h.drain_until <= h.save_until <= h.close_until <= h.hard_until


def test_stop_requests_begin_then_hurry_then_change_nothing() -> None:
    r = StopRequests()
    assert [r.request() for _ in range(4)] == [BEGIN, HURRY, IGNORE, IGNORE]


# ---- the retiring gate -------------------------------------------------------------------

class _Worker:
    """Microbatches held, by the time their forward ran."""

    slowest_backward_s = 0.1

    def __init__(self, held: set[str], age_s: float = 0.0) -> None:
        self.held = {mb: time.monotonic() - age_s for mb in held}

    @property
    def saved(self) -> int:
        return len(self.held)

    def saved_within(self, now: float, age_s: float) -> int:
        return sum(1 for t in self.held.values() if now - t <= age_s)

    def expire(self, now: float) -> list[str]:
        gone, self.held = sorted(self.held), {}
        return gone


def _gate(held: set[str], age_s: float = 0.0) -> tuple[Gate, _Worker, Counter[str]]:
    worker, counters = _Worker(held, age_s), Counter[str]()
    return Gate(worker, None, counters, stage=1), worker, counters  # type: ignore[arg-type]


def test_retiring_waits_for_the_backward_in_flight_then_hands_back_nothing() -> None:
    gate, worker, counters = _gate({"a"})

    async def scenario() -> int:
        async def backward_comes() -> None:
            await asyncio.sleep(0.05)
            worker.held.pop("a")
        task = asyncio.ensure_future(backward_comes())
        handed = await gate.retire(30.0)
        await task
        return handed

    assert asyncio.run(scenario()) == 0
    assert gate.retiring and counters["handed_back"] == 0


def test_what_does_not_come_back_within_the_drain_is_handed_back() -> None:
    gate, worker, counters = _gate({"a", "b"})
    assert asyncio.run(gate.retire(0.05)) == 2
    assert worker.saved == 0 and counters["handed_back"] == 2


def test_a_microbatch_too_old_to_be_alive_is_not_waited_for() -> None:
    gate, worker, counters = _gate({"given-up"}, age_s=stepping.LIVE_MIN_S + 1)

    async def scenario() -> int:
        return await asyncio.wait_for(gate.retire(3600.0), 30)

    assert asyncio.run(scenario()) == 1 and counters["handed_back"] == 1


def test_a_microbatch_is_waited_for_until_it_is_too_old(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stepping, "LIVE_MIN_S", 0.1)  # its backward never comes
    gate, worker, counters = _gate({"slow"})
    assert asyncio.run(asyncio.wait_for(gate.retire(3600.0), 30)) == 1


def test_a_second_request_hands_back_at_once() -> None:
    gate, _, counters = _gate({"a"})

    async def scenario() -> int:
        hurry = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, hurry.set)
        return await asyncio.wait_for(gate.retire(3600.0, hurry=hurry), 30)

    assert asyncio.run(scenario()) == 1 and counters["handed_back"] == 1


def test_retiring_waits_for_a_request_still_passing_its_result_on() -> None:
    gate, _, _ = _gate(set())
    done: list[str] = []

    async def handler(message: Any, peer: str) -> str:
        await asyncio.sleep(0.05)  # e.g. a backward computed here, on its way to stage k-1
        done.append(peer)
        return "ok"

    async def scenario() -> None:
        wrapped = gate.passing(handler)
        request = asyncio.ensure_future(wrapped(None, "p"))
        await asyncio.sleep(0)
        assert gate.in_flight == 1
        assert await gate.retire(30.0) == 0
        assert done == ["p"] and gate.in_flight == 0
        await request

    asyncio.run(scenario())


# ---- a checkpoint save with a deadline ---------------------------------------------------

def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 8))


class _Host:
    peer_id = "me"

    def set_request_handler(self, *args: Any, **kwargs: Any) -> None:
        pass

    def remove_handler(self, *args: Any) -> None:
        pass


class _Server:
    stage = 0

    def __init__(self) -> None:
        self.module = _module()
        self.optimizer = torch.optim.AdamW(self.module.parameters())
        self.step = 0
        self.worker = self
        self.stepper = self  # what the keeper asks of a Stepper: no gradients kept to replay
        self.replay = ReplayLog(max_steps=0, max_bytes=0)

    @property
    def weights_step(self) -> int:
        return self.step

    def forget(self, step: int) -> None:
        pass

    def zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=True)

    async def run_exclusive(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    async def when_drained(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    def took_state(self, step: int) -> None:
        self.step = step


def _keeper(home: Path) -> tuple[StageKeeper, _Server]:
    server = _Server()
    keeper = StageKeeper(_Host(), server, swarm="s", home=home, model_hash=HASH,
                         every_steps=0, sources=lambda: [])
    return keeper, server


def _slow_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk of a checkpoint write takes 10 ms, in chunks of 256 bytes: seconds."""
    monkeypatch.setattr(ckpt, "WRITE_CHUNK", 256)
    real = keeper_module.save_checkpoint

    def slow(dir: Path, state: Any, *, abort: Any = None) -> Path:
        def check() -> bool:
            time.sleep(0.01)
            return bool(abort and abort())
        return real(dir, state, abort=check)

    monkeypatch.setattr(keeper_module, "save_checkpoint", slow)


def _previous_checkpoint(home: Path, step: int) -> None:
    module = _module()
    state = capture(module, torch.optim.AdamW(module.parameters()), stage=0, step=step,
                    model_hash=HASH)
    save_checkpoint(home / "checkpoints", state)


@pytest.mark.parametrize("how", ["deadline", "hurry"])
def test_a_save_that_cannot_finish_is_abandoned_and_the_previous_checkpoint_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    _previous_checkpoint(tmp_path, step=2)
    keeper, server = _keeper(tmp_path)

    async def scenario() -> Any:
        assert await keeper.load() == "checkpoint" and server.step == 2
        server.step = 7
        _slow_writes(monkeypatch)
        if how == "deadline":
            return await keeper.close(deadline=time.monotonic() + 0.2)
        hurry = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, hurry.set)
        return await keeper.close(deadline=time.monotonic() + 3600, hurry=hurry)

    assert asyncio.run(scenario()) is None
    assert keeper.counters["checkpoints_abandoned"] == 1
    assert "checkpoints_saved" not in keeper.counters
    assert os.listdir(tmp_path / "checkpoints") == ["stage-0.swst"], "no temporary file left"
    loaded = load_checkpoint(tmp_path / "checkpoints", 0)
    assert loaded is not None and loaded.step == 2


def test_a_save_within_its_deadline_writes_and_measures_itself(tmp_path: Path) -> None:
    keeper, server = _keeper(tmp_path)

    async def scenario() -> None:
        assert await keeper.load() == "initial"
        server.step = 3
        await keeper.close(deadline=time.monotonic() + 60)

    asyncio.run(scenario())
    loaded = load_checkpoint(tmp_path / "checkpoints", 0)
    assert loaded is not None and loaded.step == 3
    assert keeper.counters["checkpoints_saved"] == 1 and keeper.last_save_s is not None


def test_an_aborted_write_removes_its_file(tmp_path: Path) -> None:
    module = _module()
    state = capture(module, torch.optim.AdamW(module.parameters()), stage=0, step=1,
                    model_hash=HASH)
    calls: list[int] = []

    def abort() -> bool:
        calls.append(1)
        return len(calls) > 1  # after the file was created

    with pytest.raises(SaveAborted, match="previous checkpoint is kept"):
        save_checkpoint(tmp_path, state, abort=abort)
    assert os.listdir(tmp_path) == []


# ---- the watchdog ------------------------------------------------------------------------

def test_the_watchdog_abandons_the_save_then_exits_0_at_its_deadline() -> None:
    fired = threading.Event()
    seen: list[Any] = []
    dog = Watchdog(before_exit=lambda: seen.append("abandon"),
                   exit=lambda status: (seen.append(status), fired.set()))
    dog.arm(time.monotonic() + 3600)
    dog.arm(time.monotonic() + 0.01)  # a later arm replaces the deadline
    assert fired.wait(30)
    assert seen == ["abandon", 0]


def test_the_watchdog_exits_even_when_a_log_handler_is_stuck() -> None:
    """A handler whose lock another thread holds (a thread stuck writing) blocked the
    watchdog's last log line: the process was never ended (the watchdog test failed in
    the full suite, never alone)."""
    import logging

    handler = logging.StreamHandler()
    logging.getLogger().addHandler(handler)
    handler.acquire()  # as a writer stuck on a full pipe holds it
    try:
        fired = threading.Event()
        seen: list[int] = []
        dog = Watchdog(exit=lambda status: (seen.append(status), fired.set()))
        dog.arm(time.monotonic() + 0.01)
        assert fired.wait(30) and seen == [0]
    finally:
        handler.release()
        logging.getLogger().removeHandler(handler)


def test_a_disarmed_watchdog_does_nothing() -> None:
    seen: list[int] = []
    dog = Watchdog(exit=seen.append)
    dog.arm(time.monotonic() + 0.05)
    timer = dog._timer
    assert timer is not None
    dog.disarm()
    timer.join(30)  # the timer's thread ends without calling exit
    assert not timer.is_alive() and seen == []


# ---- the daemon's stop requests ------------------------------------------------------------

def test_the_first_stop_request_plans_the_grace_the_second_hurries(tmp_path: Path) -> None:
    from swarmd.config import load_config
    from swarmd.node.daemon import Daemon, JoinOptions

    config = load_config(None, {"SWARMD_NODE_SHUTDOWN_GRACE_S": "30"})
    daemon = Daemon(JoinOptions(home=tmp_path, config=config))
    budgets: list[Any] = []
    daemon.on_budget = budgets.append
    before = time.monotonic()
    daemon.request_stop()
    assert len(budgets) == 1 and daemon._stop.is_set() and not daemon._hurry.is_set()
    first = budgets[0]
    assert before <= first.started_at and first.close_until == pytest.approx(
        first.started_at + 30)
    daemon.request_stop()
    assert len(budgets) == 2 and daemon._hurry.is_set()
    assert budgets[1].close_until <= time.monotonic() + shutdown.HURRY_S
    daemon.request_stop()  # a third changes nothing
    assert len(budgets) == 2


@pytest.mark.parametrize("value", ["0", "-1", "3600.5", "nan", "soon"])
def test_a_bad_grace_is_a_config_error_naming_the_key(value: str) -> None:
    from swarmd.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="node.shutdown_grace_s") as err:
        load_config(None, {"SWARMD_NODE_SHUTDOWN_GRACE_S": value})
    assert "SWARMD_NODE_SHUTDOWN_GRACE_S" in str(err.value)


def test_the_grace_defaults_to_20_s_and_takes_up_to_an_hour() -> None:
    from swarmd.config import Config, load_config

    assert Config().node.shutdown_grace_s == 20.0
    assert load_config(None, {"SWARMD_NODE_SHUTDOWN_GRACE_S": "3600"}).node.shutdown_grace_s == 3600
