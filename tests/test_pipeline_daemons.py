"""Pipeline training through real ``swarmd join`` processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from typing import Any

import pytest
import torch
import uvloop

from daemon_harness import ROOT, wait_until
from swarmd.config import load_config
from swarmd.local.demo import DEMO_ENV
from swarmd.trainer.run import train
from transport import identity
from transport.errors import RemoteError
from transport.frames import Message
from transport.host import Host, HostOptions
from swarmd.local.zygote import swarmd_run
from swarmd.models.registry import model_config_of, model_hash_of

pytestmark = pytest.mark.integration

ENV = {**DEMO_ENV, "SWARMD_MODEL_WIDTH": "64", "SWARMD_MODEL_SEQ_LEN": "32",
       "SWARMD_DATA_MAX_BYTES": "2000000", "SWARMD_SWARM_NAME": "pipeline-test"}


def test_demo_trains_and_reports_one_json_line() -> None:
    out = swarmd_run(["demo", "--steps", "30", "--json"],
                     capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["final_val_loss"] <= 0.8 * result["initial_val_loss"]
    assert result["lost"] == 0 and result["tokens_per_s"] > 0
    assert "watch the swarm at http://127.0.0.1:" in out.stderr


def test_killing_one_of_two_peers_of_a_stage_loses_nothing(daemons: Any) -> None:
    d0, d1, d2 = daemons(0, 1, 1)
    config = load_config(None, {**os.environ, **ENV})
    wait_until(lambda: d0.get("/api/v0/swarm")["stages"][1]["routable_peers"] == 2, 30,
               "both stage-1 peers routable")
    killed = threading.Event()

    def killer() -> None:  # SIGKILL the victim mid-step, once it carries traffic
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for victim in (d1, d2):  # whichever stage-1 peer carries traffic first
                try:
                    if victim.get("/api/v0/status")["counters"].get("stage.forward", 0) >= 3:
                        victim.proc.kill()
                        killed.set()
                        return
                except OSError:
                    continue  # it may be answering slowly under load: ask again
            time.sleep(0.02)

    watcher = threading.Thread(target=killer, daemon=True)
    watcher.start()
    result = uvloop.run(asyncio.wait_for(
        train(config, bootstrap=[d0.addr], steps=40, progress=lambda line: None), 280))
    watcher.join(5)
    assert killed.is_set()
    assert result.lost == 0
    assert result.final_val_loss < result.initial_val_loss
    rerouted = sum(int(d.get("/api/v0/status")["counters"].get("stage.rerouted", 0))
                   for d in (d0, d1, d2) if d.proc.poll() is None)
    assert result.restarted + result.rerouted + rerouted >= 1  # the fault was really hit


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A stage-0 and a stage-1 daemon shared by the tests below: the bad requests are refused
    (they change nothing), then two trainers train through them."""
    from daemon_harness import start_swarm, stop_all

    started: list[Any] = []
    try:
        yield start_swarm(tmp_path_factory.mktemp("two-stages"), [0, 1], env=ENV, into=started)
    finally:
        stop_all(started)


def test_bad_pipeline_requests_get_typed_errors_and_the_daemon_keeps_serving(
        two_stages: Any) -> None:
    d0, _ = two_stages
    config = load_config(None, {**os.environ, **ENV})
    width = model_config_of(config).width
    forward = "/swarmd/pipeline-test/1/forward"
    backward = "/swarmd/pipeline-test/1/backward"

    me = identity.generate()

    def meta(**over: Any) -> dict[str, Any]:
        m = {"mb": "t/1", "stage": 0, "step": 0, "path": [], "trainer": me.peer_id, "model":
             model_hash_of(config)}
        m.update(over)
        return m

    good = torch.randn(2, 8, width)
    cases = [
        (forward, meta(), (torch.randn(2, 8, width + 1),), "bad_activation"),
        (forward, meta(), (torch.full((2, 8, width), float("nan")),), "bad_activation"),
        (forward, meta(), (torch.zeros(2, 8, width, dtype=torch.int64),), "bad_activation"),
        (forward, meta(stage=1), (good,), "wrong_stage"),
        (forward, meta(model="other:0123"), (good,), "model_hash_mismatch"),
        (forward, {"mb": 5}, (good,), "bad_activation"),
        (backward, meta(path=["nobody"]), (good,), "bad_activation"),
        (backward, meta(path=[d0.peer_id, "next"], mb="never-sent"), (good,),
         "unknown_microbatch"),
    ]

    async def scenario() -> list[str]:
        codes = []
        async with Host(me, HostOptions(pubsub=None)) as host:
            await host.dial(d0.addr)
            for proto, m, tensors, _ in cases:
                kind = "forward" if proto == forward else "backward"
                try:
                    await host.request(d0.peer_id, proto, Message(kind=kind, meta=m,
                                                                  tensors=tensors))
                    codes.append("accepted")
                except RemoteError as exc:
                    codes.append(exc.code)
        return codes

    codes = uvloop.run(asyncio.wait_for(scenario(), 120))
    assert codes == [c[3] for c in cases]
    status = d0.get("/api/v0/status")
    assert status["state"] == "online"
    assert status["counters"].get("request_errors.bad_activation", 0) >= 4


@pytest.mark.timeout(300)  # two trainers of 15 steps (each bounded at 200 s) and the reads
def test_two_trainers_feed_one_swarm(two_stages: Any) -> None:
    d0, d1 = two_stages
    config = load_config(None, {**os.environ, **ENV})
    results: list[Any] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            results.append(uvloop.run(asyncio.wait_for(train(
                config, bootstrap=[d0.addr], steps=15, progress=lambda line: None, bar=False),
                200)))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(2)]
    threads[0].start()
    # the second joins a trainer that trains: it takes that one's embedding and head
    wait_until(lambda: d1.get("/api/v0/stage")["step"] >= 2 or errors, 120,
               "the first trainer's steps")
    threads[1].start()
    # the metrics endpoint answers while the stage computes for two trainers: it never waits
    # for the compute thread (a scrape's deadline, 5 s; the slowest is printed)
    import urllib.request
    scrapes, slowest = 0, 0.0
    while threads[1].is_alive() and scrapes < 20:
        t0 = time.monotonic()
        with urllib.request.urlopen(d1.url + "/metrics", timeout=5) as reply:
            assert reply.status == 200 and b"swarmd_up 1.0" in reply.read()
        slowest, scrapes = max(slowest, time.monotonic() - t0), scrapes + 1
        threads[1].join(0.5)
    print(f"metrics under load: {scrapes} scrapes, slowest {slowest:.3f} s")
    for t in threads:
        t.join(240)
    assert not errors, errors
    assert len(results) == 2
    assert scrapes >= 3
    for r in results:
        assert r.lost == 0 and r.final_val_loss < r.initial_val_loss
    first, second = sorted(results, key=lambda r: r.parts_from != "own")
    assert (first.parts_from, second.parts_from) == ("own", "trainers")
    # and they averaged their embedding and head with each other while both trained
    assert first.trainer_rounds >= 1 and second.trainer_rounds >= 1, results
    # the last stage served both trainers' microbatches and stepped on them, once per target
    # batch: while both trained they split each step's microbatches (swarmd.trainer.shares)
    status = d1.get("/api/v0/status")
    counters = status["counters"]
    sent = sum(r.microbatches for r in results)
    assert 15 * config.training.microbatches <= sent < 2 * 15 * config.training.microbatches
    assert counters["stage.backward"] >= sent
    batches = sent // config.training.microbatches
    stage_steps = d1.get("/api/v0/stage")["step"]
    print("two trainers:", [(r.microbatches, r.steps_exact) for r in results], stage_steps)
    # a step that was not exact (the second trainer joining, a round late under load) is
    # flushed: at most one stage step more for each
    not_exact = sum(15 - r.steps_exact for r in results)
    assert batches - 1 <= stage_steps <= batches + not_exact, (stage_steps, results)
    assert sum(r.steps_exact for r in results) >= 15, results  # before: none
    # what each trainer told the stages of its run: loss, validation loss, shard
    for d, last in ((d0, 10), (d1, 15)):  # the last stage hears the final evaluation's step
        rows = d.get("/api/v0/status")["trainers"]
        assert len(rows) == 2, rows
        for row in rows:
            assert row["step"] >= last and row["loss"] > 0 and row["val_loss"] > 0, row
        # each trainer's data shard (swarmd.data.order: "auto" from the trainers it saw)
        assert all(re.fullmatch(r"\d+/\d+", r["shard"]) and r["epoch"] == 0 for r in rows), rows
    # hop and step times as histograms: stage 0 timed its forwards and backwards to stage 1,
    # both timed their steps (/api/v0/status, and /metrics as Prometheus histograms)
    times = d0.get("/api/v0/status")["histograms"]
    assert times["hop_seconds.forward"]["count"] >= 15 * config.training.microbatches, times
    assert times["step_seconds"]["count"] >= 9, times
    assert status["histograms"]["step_seconds"]["count"] >= 9, status["histograms"]
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(d0.url + "/metrics", timeout=15) as reply:
        families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
    assert families["swarmd_hop_seconds"].type == "histogram"
    assert families["swarmd_step_seconds"].type == "histogram"
    curves = d1.get("/api/v0/training")["trainers"]
    assert all(len(t["losses"]) >= 14 and t["val_losses"] for t in curves), curves
    from swarmd.api.types import StatusInfo
    from swarmd.cli.client import text_status
    assert text_status(StatusInfo.from_json(status)).count("  shard ") == 2


def test_batched_forwards_train_the_same_way(tmp_path: Any) -> None:
    from daemon_harness import start_swarm, stop_all

    env = {**ENV, "SWARMD_SERVING_BATCH_FORWARDS": "on"}
    started: list[Any] = []
    try:
        d0, d1 = start_swarm(tmp_path, [0, 1], env=env, into=started)
        config = load_config(None, {**os.environ, **env})
        result = uvloop.run(asyncio.wait_for(train(
            config, bootstrap=[d0.addr], steps=12, progress=lambda line: None, bar=False), 200))
        assert result.lost == 0 and result.restarted == 0
        assert result.final_val_loss < result.initial_val_loss
        counters = [d.get("/api/v0/status")["counters"] for d in (d0, d1)]
        assert sum(c.get("stage.batched_forwards", 0) for c in counters) > 0  # it did batch
    finally:
        stop_all(started)
