"""State chunks through a rate cap (issue 15): a source says its upload cap in its offer, and
the fetcher asks fewer chunks at a time with deadlines the cap can meet. Pure parts first
(swarmd.links, the offer's meta), then a real capped daemon serving its state to a joiner."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import DaemonProcess, stop_all, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.links import LinkEstimates, chunks_in_flight
from swarmd.local.demo import DEMO_ENV
from swarmd.state.transfer import BadStateRequest, StateInfo

MiB = 1 << 20


def test_a_known_cap_lengthens_a_chunk_deadline_past_the_callers_cap() -> None:
    links = LinkEstimates()
    # unmeasured: the default bandwidth (1 MB/s) says 4 MiB take 4 s, 3x slack: 13.5 s
    plain = links.deadline("src", 4 * MiB, cap_s=120.0)
    assert plain == pytest.approx(3 * (0.3 + 4 * MiB / 1e6))
    # through 64 kB/s the same chunk takes 65.5 s: the deadline is 3x that, past 120 s
    capped = links.deadline("src", 4 * MiB, cap_s=120.0, max_bandwidth=64_000)
    assert capped >= 3 * 4 * MiB / 64_000 > 120.0
    # a measured link faster than the cap changes nothing: the cap binds
    links.observe_transfer("src", 8 * MiB, 0.1, 0.0)
    assert links.deadline("src", 4 * MiB, cap_s=120.0, max_bandwidth=64_000) == capped
    # a cap above what the link does is no help: the measured rate stays
    links.observe_transfer("slow", 1 * MiB, 20.0, 0.0)
    assert (links.deadline("slow", 4 * MiB, cap_s=600.0, max_bandwidth=1e9)
            == links.deadline("slow", 4 * MiB, cap_s=600.0))


@pytest.mark.parametrize("bad", [None, 0, -1, math.nan, math.inf, True])
def test_an_unusable_cap_is_none(bad: Any) -> None:
    links = LinkEstimates()
    assert (links.deadline("p", 4 * MiB, cap_s=120.0, max_bandwidth=bad)
            == links.deadline("p", 4 * MiB, cap_s=120.0))
    assert chunks_in_flight(4, 4 * MiB, bad, within_s=120.0, slack=3.0) == 4


def test_chunks_in_flight_through_a_cap() -> None:
    assert chunks_in_flight(4, 4 * MiB, None, within_s=120.0, slack=3.0) == 4
    assert chunks_in_flight(4, 4 * MiB, 64_000, within_s=120.0, slack=3.0) == 1
    assert chunks_in_flight(4, 4 * MiB, 1_000_000, within_s=120.0, slack=3.0) == 4
    assert chunks_in_flight(4, 4 * MiB, 200_000, within_s=120.0, slack=3.0) == 1
    assert chunks_in_flight(4, 1 * MiB, 200_000, within_s=120.0, slack=3.0) == 4
    assert chunks_in_flight(0, 4 * MiB, None, within_s=120.0, slack=3.0) == 1


@settings(max_examples=200, deadline=None)
@given(parallel=st.integers(1, 16), chunk=st.integers(1024, 16 * MiB),
       cap=st.floats(1.0, 1e10), within=st.floats(1.0, 3600.0), slack=st.floats(1.0, 10.0),
       rtt=st.floats(0.001, 2.0))
def test_through_any_cap_the_chunks_in_flight_get_a_deadline_the_cap_can_meet(
        parallel: int, chunk: int, cap: float, within: float, slack: float,
        rtt: float) -> None:
    """Never more than asked, at least one; the deadline for the bytes in flight is at least
    slack times what the cap needs for them, whatever the caller's cap."""
    n = chunks_in_flight(parallel, chunk, cap, within_s=within, slack=slack)
    assert 1 <= n <= parallel
    if n > 1:  # more than one only when they fit the caller's time through the cap
        assert n * chunk * slack / cap <= within * (1 + 1e-9)
    links = LinkEstimates()
    links.observe_rtt("p", rtt, 0.0)
    deadline = links.deadline("p", n * chunk, cap_s=within, max_bandwidth=cap)
    assert deadline >= min(links.policy.cap_s, links.policy.slack * n * chunk / cap) - 1e-6


def _info(**kw: Any) -> StateInfo:
    return StateInfo(**{"peer": "p", "stage": 0, "step": 3, "model_hash": "m", "digest": "a" * 64,
                        "total_bytes": 10 * MiB, "chunk_bytes": 4 * MiB, **kw})


def test_the_offer_carries_the_source_s_upload_cap_and_an_older_one_none() -> None:
    info = _info(upload_bytes_s=64_000)
    assert info.to_meta()["upload_bytes_s"] == 64_000
    assert StateInfo.from_meta("p", info.to_meta()) == info
    older = _info()
    assert "upload_bytes_s" not in older.to_meta()
    assert StateInfo.from_meta("p", older.to_meta()).upload_bytes_s is None


@pytest.mark.parametrize("bad", [0, -5, 1.5, "64kB", True, [1]])
def test_an_offer_with_a_bad_cap_is_refused(bad: Any) -> None:
    with pytest.raises(BadStateRequest):
        StateInfo.from_meta("p", {**_info().to_meta(), "upload_bytes_s": bad})


# ---- a real daemon capped at 64 kB/s serves its state to a joiner ---------------------------

CAP = 64_000
ENV = {**DEMO_ENV, "SWARMD_MODEL_LAYERS": "2",
       "SWARMD_MODEL_SEQ_LEN": "32", "SWARMD_SWARM_STAGES": "2",
       "SWARMD_SWARM_NAME": "state-caps-test"}


def _stage(d: DaemonProcess) -> dict[str, Any]:
    return wait_until(lambda: d.get("/api/v0/stage", timeout=15), 60, "the stage info")


@pytest.mark.timeout(240)
def test_a_source_capped_at_64_kB_s_serves_its_state_to_a_joiner(tmp_path: Path) -> None:
    """The stage state (one block of width 128, no optimizer moments yet) is about 0.8 MB:
    12 s through the cap, longer than the 5 s deadline an unmeasured link got before (the
    default 1 MB/s, 3x slack), so this failed then and the joiner started from the initial
    weights."""
    started: list[DaemonProcess] = []
    try:
        src = DaemonProcess(tmp_path / "src", "--stage", "0",
                            env={**ENV, "SWARMD_LIMITS_UPLOAD_BYTES_S": str(CAP)})
        started.append(src)
        src.wait_started()
        wait_until(lambda: _stage(src)["state"] == "online", 60, "the source serving")
        # the joiner takes the view from the source: wait for its "online" announcement
        # (syncing at step 0 it holds nothing to take); a daemon forked from the zygote asks
        # within a second, before the announcement follows the state
        wait_until(lambda: any(p["peer_id"] == src.peer_id and p["state"] == "online"
                               for row in src.get("/api/v0/swarm")["stages"]
                               for p in row["peers"]), 60, "the source announcing online")
        joiner = DaemonProcess(tmp_path / "joiner", "--stage", "0", "--bootstrap", src.addr,
                               env=ENV)
        started.append(joiner)
        joiner.wait_started()
        info = wait_until(lambda: (lambda i: i if i["state"] == "online" else None)(
            _stage(joiner)), 120, "the joiner online, its state loaded")
        counters = joiner.get("/api/v0/status")["counters"]
        assert info["state_from"] == "peers", (counters, joiner.stderr()[-3000:])
        assert info["params_digest"] == _stage(src)["params_digest"]
        assert counters["state.bytes"] > CAP * 8  # longer through the cap than the old deadline
        upload = src.get("/api/v0/status")["limits"]["upload"]
        assert upload["bytes_s"] == CAP and upload["throttled_bytes"] > 0
    finally:
        stop_all(started)


def test_a_source_claiming_a_tiny_cap_cannot_hold_a_download_up_for_long() -> None:
    """A source says 1 byte/s: its chunk's deadline grows past request_timeout_s, but no
    further than CAPPED_CHUNK_MAX_S; the download then fails over (here: no source left)."""
    import asyncio
    from types import SimpleNamespace

    from swarmd.state.fetch import CAPPED_CHUNK_MAX_S, fetch_state
    from swarmd.state.transfer import StateTransferFailed
    from transport.errors import PeerUnavailable
    from transport.frames import Message

    offer = _info(peer="liar", upload_bytes_s=1, total_bytes=4 * MiB)
    timeouts: list[float] = []

    class Liar:
        options = SimpleNamespace(limits=SimpleNamespace(max_message_bytes=64 * MiB),
                                  download_bytes_s=None)

        async def ensure_connected(self, peer: str, addrs: Any, *, timeout: float) -> bool:
            return True

        async def request(self, peer: str, protocol: str, message: Message, *, timeout: float,
                          codec: Any) -> Message:
            if message.kind == "state_info":
                return Message(kind="state_info", meta=offer.to_meta())
            timeouts.append(timeout)
            raise PeerUnavailable("it never sends")

    async def go() -> None:
        await fetch_state(Liar(), "/state", [("liar", ())], stage=0, model_hash="m",
                          timeout_s=30.0, max_bytes=64 * MiB, request_timeout_s=120.0)

    with pytest.raises(StateTransferFailed):
        asyncio.run(go())
    assert timeouts and all(120.0 < t <= CAPPED_CHUNK_MAX_S for t in timeouts)
