"""The protocol fuzzer (issue 14): a hostile peer on our own transport sends every case of
tests/fuzz_cases.py to every protocol of two stage daemons and a trainer while that trainer
really trains through them.

Each case must get a typed error (never ``internal_error``: that is our bug), a silent drop, or
an ordinary reply; afterwards every victim is alive and answers ``/api/v0/status``, and the
training run beside the attack finishes with ``lost`` = 0 and a falling loss.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import uvloop

from fuzz_cases import Case, cases
from swarmd.config import load_config
from transport import identity
from transport.errors import RemoteError, TransportError
from transport.frames import Message
from transport.host import Host, HostOptions
from swarmd.local.zygote import swarmd_popen
from swarmd.models.registry import model_hash_of

pytestmark = pytest.mark.integration

ENV = {"SWARMD_DATA_MAX_BYTES": "2000000"}  # the trainer reads 2 MB of text, not 30
#: the typed codes a victim may answer with: every ``code = "..."`` declared in swarmd and
#: transport, less the one that means our own bug
ROOT = Path(__file__).resolve().parents[1]
TYPED = frozenset(m for top in ("swarmd", "transport") for path in (ROOT / top).rglob("*.py")
                  for m in re.findall(r'^\s+code = "([a-z_]+)"', path.read_text(), re.M)
                  ) - {"internal_error"}
#: what each victim serves (a protocol it does not serve costs py-libp2p a 10 s negotiation
#: timeout per stream, and tests nothing of ours)
TRAINER_PROTOCOLS = ("result", "grad", "view", "announce")
DAEMON_PROTOCOLS = ("forward", "backward", "round", "allreduce", "state", "view", "announce")
#: a victim may hold a request it cannot place yet (an all-reduce part before its round):
#: an answer later than this counts as "no_answer", which is allowed
SEND_TIMEOUT_S = 3.0
#: a raw (malformed) frame gets this long for an answer; many are answered by a closed stream
RAW_REPLY_S = 1.0
#: sends in flight to one victim at once
CONCURRENT = 16


async def _send(host: Host, peer: str, case: Case) -> str:
    """What the victim did with ``case``: ``reply:<kind>``, ``error:<code>``, ``closed:...`` or
    ``no_answer``; never longer than twice ``SEND_TIMEOUT_S``."""
    try:
        async with asyncio.timeout(2 * SEND_TIMEOUT_S):
            return await _exchange(host, peer, case)
    except TimeoutError:
        return "no_answer"


async def _exchange(host: Host, peer: str, case: Case) -> str:
    try:
        if case.raw is not None:
            stream = await host.open_stream(peer, case.protocol, timeout=SEND_TIMEOUT_S)
            try:
                await stream.write_raw(case.raw, timeout=SEND_TIMEOUT_S)
                reply = await stream.receive(timeout=RAW_REPLY_S)
            finally:
                stream.reset_soon()
            return f"reply:{reply.kind}" if reply is not None else "closed"
        reply = await host.request(peer, case.protocol, Message(
            kind=case.kind, meta=case.meta, tensors=case.tensors), timeout=SEND_TIMEOUT_S)
        return f"reply:{reply.kind}"
    except RemoteError as exc:
        return f"error:{exc.code}"
    except TransportError as exc:  # the victim reset the stream, or refused the protocol
        return f"closed:{getattr(exc, 'code', type(exc).__name__)}"


async def _attack(targets: dict[str, tuple[str, tuple[str, ...]]], swarm: str,
                  model_hash: str) -> dict[str, Counter[str]]:
    async with Host(identity.generate(), HostOptions(pubsub=None)) as host:
        async def one_target(name: str, peer: str, addrs: tuple[str, ...]) -> Counter[str]:
            seen: Counter[str] = Counter()
            gate = asyncio.Semaphore(CONCURRENT)

            async def one(case: Case) -> None:
                async with gate:
                    outcome = await _send(host, peer, case)
                seen[outcome] += 1
                if outcome == "error:internal_error":
                    seen[f"internal_error:{case.protocol}:{case.name}"] += 1

            served = TRAINER_PROTOCOLS if name == "trainer" else DAEMON_PROTOCOLS
            by_protocol: dict[str, list[Case]] = {}
            for c in cases(swarm, model_hash):
                if c.protocol.rsplit("/", 1)[1] in served:
                    by_protocol.setdefault(c.protocol, []).append(c)
            for group in by_protocol.values():
                # a fresh connection for each protocol's cases, sent all at once: py-libp2p
                # 0.8.1 allows 256 streams a connection (refused requests free theirs: see
                # test_transport_integration's test of 300 refusals in a row)
                await host.disconnect(peer)
                assert await host.ensure_connected(peer, addrs), f"cannot reach {name}"
                await asyncio.gather(*(one(c) for c in group))
            return seen

        results = await asyncio.gather(*(one_target(n, p, a) for n, (p, a) in targets.items()))
    return dict(zip(targets, results))


def _trainer_row(daemon: Any) -> dict[str, Any] | None:
    """The trainer as the daemon's view lists it: the peer without a stage."""
    rows = daemon.get("/api/v0/swarm").get("excluded", ())
    return next((r for r in rows if r.get("reason") == "no_stage" and r["addrs"]), None)


@pytest.mark.timeout(600)
def test_every_protocol_survives_the_fuzzer_while_a_trainer_trains(daemons: Any,
                                                                    tmp_path: Path) -> None:
    from daemon_harness import wait_until
    from swarmd.node.home import init_home

    d0, d1 = daemons(0, 1)
    config = load_config(None, ENV)
    home = tmp_path / "trainer"
    init_home(home)
    log = open(tmp_path / "trainer.stderr", "w")
    trainer = swarmd_popen(
        ["train", "--home", str(home), "--bootstrap", d0.addr,
         "--steps", "60", "--json"], stdout=subprocess.PIPE, stderr=log, text=True,
        env={**os.environ, **ENV})
    try:
        row = wait_until(lambda: _trainer_row(d0), 120, "the trainer in d0's view")
        targets = {"stage0": (d0.peer_id, (d0.addr,)), "stage1": (d1.peer_id, (d1.addr,)),
                   "trainer": (row["peer_id"], tuple(row["addrs"]))}
        t0 = time.monotonic()
        outcomes = uvloop.run(asyncio.wait_for(
            _attack(targets, config.swarm.name, model_hash_of(config)), 400))
        attack_s = time.monotonic() - t0
        for name, seen in outcomes.items():
            bugs = [k for k in seen if k.startswith("internal_error:")]
            assert not bugs, f"{name} answered internal_error (our bug) to: {bugs}"
            untyped = {k: v for k, v in seen.items()
                       if k.startswith("error:") and k[6:] not in TYPED}
            assert not untyped, f"{name} answered with unknown error codes: {untyped}"
        for d in (d0, d1):
            assert d.proc.poll() is None, d.stderr()
            assert d.get("/api/v0/status")["peer_id"] == d.peer_id
        out, _ = trainer.communicate(timeout=600)
        assert trainer.returncode == 0, (tmp_path / "trainer.stderr").read_text()[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result["lost"] == 0 and result["final_val_loss"] < result["initial_val_loss"]
        total = sum(sum(s.values()) for s in outcomes.values())
        print(f"fuzzer: {total} cases sent in {attack_s:.0f} s; outcomes: "
              + json.dumps({k: dict(v) for k, v in outcomes.items()}))
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
        log.close()
