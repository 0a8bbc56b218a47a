"""A NATed daemon whose home router restarts (issue 12, "Recovery"), in the WAN lab.

The lab's ``gateway_outage`` makes a NAT gateway drop every packet for N seconds and forget its
NAT table, as a router that restarts. First the lab itself: nothing passes while it is down, a
connection made before it does not survive it, new ones work after it. Then the figure: a NATed
stage peer serving a running trainer, its gateway down for 30 s: within 60 s of the recovery it
serves microbatches again. Skipped, with the reason, where the lab cannot run (not root).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytestmark = pytest.mark.integration

#: the trainer reads 2 MB of text, not 30 (seconds of its start)
#: the default configuration's liveness (network.liveness_*): no TCP user timeout
ENV = {"SWARMD_BALANCING_ENABLED": "false", "SWARMD_TRAINING_MICROBATCHES": "4",
       "SWARMD_DATA_MAX_BYTES": "2000000"}
OUTAGE_S = 30.0
#: the figure: serving again within this long of the recovery
RECOVERY_S = 60.0


def test_a_gateway_outage_drops_everything_and_forgets_its_connections(wanlab: Any) -> None:
    from tools.wanlab import HostSpec
    from tools.wanlab.spec import LabError

    lab = wanlab(HostSpec(name="home", nat=True), HostSpec(name="dc"))
    with lab.inside("dc"):
        ls = socket.create_server((lab.addr("dc"), 0))
    port = ls.getsockname()[1]
    with lab.inside("home"):
        before = socket.create_connection((lab.addr("dc"), port), timeout=5)
    with ls, before:
        ls.settimeout(5)
        peer, _ = ls.accept()
        with pytest.raises(LabError, match="not behind a NAT"):
            lab.gateway_down("dc")
        lab.gateway_down("home")
        assert lab.gateway_is_down("home")
        with lab.inside("home"):
            with pytest.raises(OSError):
                socket.create_connection((lab.addr("dc"), port), timeout=1.0)
        lab.gateway_up("home")
        assert not lab.gateway_is_down("home")
        # the gateway forgot the mapping: what the far end sends meets a reset
        peer.settimeout(5)
        peer.sendall(b"x" * 1000)
        before.settimeout(5)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):  # not a timeout
            for _ in range(50):  # bounded: the reset arrives within a few round trips
                before.sendall(b"y" * 1000)
                data = before.recv(1000)
                if not data:
                    raise ConnectionResetError("closed")
                time.sleep(0.05)
        peer.close()
        with lab.inside("home"):
            after = socket.create_connection((lab.addr("dc"), port), timeout=5)
        after.close()
        lab.gateway_outage("home", 0.5)  # and back by itself
        from daemon_harness import wait_until

        wait_until(lambda: not lab.gateway_is_down("home"), 10, "the gateway to come back")


def _forwards(d: Any) -> int:
    try:
        return int(d.get("/api/v0/status")["counters"].get("stage.forward", 0))
    except OSError:  # a busy daemon may miss one status deadline: ask again
        return -1


def _counter(d: Any, name: str) -> int:
    try:
        return int(d.get("/api/v0/status")["counters"].get(name, 0))
    except OSError:
        return -1


def _diagnose(daemons: list[Any]) -> str:
    lines = []
    for d in daemons:
        try:
            st = d.get("/api/v0/status")
            peers = d.get("/api/v0/peers")
        except Exception as exc:
            lines.append(f"{d.host}: status failed: {exc!r}")
            continue
        counters = {k: v for k, v in st["counters"].items()
                    if k.startswith(("relay", "liveness", "stage.forward", "dial"))}
        lines.append(f"{d.host}: {st.get('reachability')} relays={st.get('relays')} "
                     f"{counters}\n  peers={peers}")
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_nated_peer_serves_again_after_its_router_restarts(wanlab: Any, tmp_path: Path
                                                              ) -> None:
    from daemon_harness import wait_until
    from tools.wanlab import HostSpec, Link
    from tools.wanlab.daemons import start_swarm, stop_all

    link = Link(delay_ms=2.0)
    lab = wanlab(HostSpec(name="pub", link=link), HostSpec(name="p1", link=link),
                 HostSpec(name="n1", link=link, nat=True), HostSpec(name="tr", link=link))
    daemons = start_swarm(lab, tmp_path, ("pub", ("--stage", "0")),
                          [("p1", ("--stage", "1")), ("n1", ("--stage", "1"))], env=ENV)
    pub, n1 = daemons[0], daemons[2]
    trainer = None
    try:
        wait_until(lambda: n1.get("/api/v0/status")["relays"], 120, "n1 to hold a relay slot")
        home = tmp_path / "trainer"
        home.mkdir()
        err = open(home / "train.stderr", "w")
        trainer = lab.run("tr", [sys.executable, "-m", "swarmd", "train", "--home", str(home),
                                 "--json", "--bootstrap", pub.addr, "--steps", "100000",
                                 "--listen", f"/ip4/{lab.addr('tr')}/tcp/0"],
                          stdout=subprocess.DEVNULL, stderr=err, cwd=home,
                          env={**os.environ, "SWARMD_LOG_LEVEL": "info", **ENV})
        err.close()
        wait_until(lambda: _forwards(n1) >= 8, 180, "n1 to serve microbatches")
        lab.gateway_outage("n1", OUTAGE_S)
        wait_until(lambda: not lab.gateway_is_down("n1"), OUTAGE_S + 15, "the gateway back")
        at_recovery, t_recovery = _forwards(n1), time.monotonic()
        assert trainer.poll() is None, (home / "train.stderr").read_text()[-3000:]
        # more than one step's microbatches (4): at least one is new work, not a straggler
        # from the step in flight at the outage (two steps' worth, 8, measured throughput
        # instead: n1, capped at a third of the stage, served 6 in 60 s on a loaded machine)
        try:
            wait_until(lambda: _forwards(n1) >= at_recovery + 5, RECOVERY_S,
                       f"n1 to serve again within {RECOVERY_S:.0f} s of the recovery "
                       f"(served {at_recovery} before)")
        except AssertionError as exc:
            # the trainer picks each microbatch's path: its log says where it sent them
            log = (home / "train.stderr").read_text(errors="replace").splitlines()[-40:]
            raise AssertionError(f"{exc}\n{_diagnose(daemons)}\ntrainer's log, last lines:\n"
                                 + "\n".join(log)) from None
        dead = [_counter(d, "liveness.dead_closed") for d in daemons]
        print(f"n1 served again {time.monotonic() - t_recovery:.1f} s after its gateway "
              f"came back; connections closed as dead (pub, p1, n1): {dead}")  # shown with -s
    finally:
        stop_all(daemons, trainer=trainer)


def test_the_router_counts_bytes_between_two_hosts(wanlab: Any) -> None:
    from tools.wanlab import HostSpec

    lab = wanlab(HostSpec(name="a"), HostSpec(name="b"), HostSpec(name="c"))
    assert lab.bytes_between("a", "b") == 0
    with lab.inside("b"):
        ls = socket.create_server((lab.addr("b"), 0))
    with ls:
        with lab.inside("a"):
            c = socket.create_connection((lab.addr("b"), ls.getsockname()[1]), timeout=5)
        with c:
            peer, _ = ls.accept()
            c.sendall(b"x" * 100_000)
            got = 0
            peer.settimeout(5)
            while got < 100_000:
                got += len(peer.recv(65536))
            peer.close()
    assert lab.bytes_between("a", "b") >= 100_000
    assert lab.bytes_between("b", "a") >= 100_000  # the same pair
    assert lab.bytes_between("a", "c") == 0


def test_a_lost_relay_is_reserved_again_and_given_up_after_three_failures() -> None:
    """NatService._rejoin, with a stand-in relay client (a unit test: no network)."""
    import asyncio

    from swarmd.config.load import Config
    from swarmd.node.nat import REJOIN_TRIES, NatService
    from transport.errors import PeerUnavailable

    class Relay:
        def __init__(self) -> None:
            self.reserved: list[str] = []
            self.released: list[str] = []
            self.down = {"gone"}

        async def reserve(self, peer: str, addrs: Any = ()) -> None:
            self.reserved.append(peer)
            if peer in self.down:
                raise PeerUnavailable(f"dial {peer} failed")

        async def release(self, peer: str) -> None:
            self.released.append(peer)

    class Host:
        peer_id, addrs, relay = "QmSelf", ["/ip4/198.19.3.2/tcp/4001"], Relay()

    class Membership:
        changes = 0
        view: dict[str, Any] = {}

        def changed(self) -> None:
            self.changes += 1

    nat = NatService(Host(), Membership(), Config())

    async def main() -> None:
        await nat._rejoin({"back", "gone"})
        assert Host.relay.reserved == ["back", "gone"] and nat.counters["relay.rejoined"] == 1
        for _ in range(REJOIN_TRIES - 1):
            await nat._rejoin({"gone"})
        assert Host.relay.released == ["gone"]
        assert nat.counters["relay.abandoned"] == 1
        assert nat.counters["relay.rejoin_failed"] == REJOIN_TRIES

    asyncio.run(main())
