"""Resource caps (``[limits]``): the host's upload/download buckets over real libp2p, the
configuration keys, the stage worker's byte bound and the throughput a capped peer announces."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import uvloop

from transport import identity
from transport.codecs import CodecSpec
from transport.errors import LocalUsageError
from transport.frames import Message
from transport.host import Host, HostOptions
from swarmd.local.zygote import swarmd_run
from swarmd.models.registry import model_seam_of

MB = 1_000_000
ECHO = "/test/limits/sink/1"


async def _pair(sender: HostOptions, receiver: HostOptions, scenario) -> None:
    async with Host(identity.generate(), sender) as a, Host(identity.generate(), receiver) as b:
        async def sink(message: Message, peer: str) -> Message:
            t = message.tensors[0]
            return Message(kind="got", meta={"bytes": int(t.numel()), "sum": int(t.sum())})

        b.set_request_handler(ECHO, sink)
        await a.dial(b.addrs[0])
        await asyncio.wait_for(scenario(a, b), 120)


def _payload(nbytes: int) -> torch.Tensor:
    return torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)


def _send_3mb(a: Host, b: Host) -> "asyncio.Future[Message]":
    data = _payload(3 * MB)
    return a.request(b.peer_id, ECHO, Message(kind="data", tensors=(data,)), timeout=60,
                     codec=CodecSpec(name="none"))


@pytest.mark.integration
def test_a_3_mb_send_over_an_upload_capped_host_spans_at_least_2_s_of_bucket_time() -> None:
    async def scenario(a: Host, b: Host) -> None:
        reply = await _send_3mb(a, b)
        assert reply.meta == {"bytes": 3 * MB, "sum": int(_payload(3 * MB).sum())}
        up = a.throttle.upload
        assert up is not None and a.throttle.download is None
        assert up.granted_bytes >= 3 * MB
        assert up.throttled_bytes > 2 * MB
        # the bucket's own accounting: N bytes at rate r with burst B span >= (N - B) / r
        assert up.paid_until - up.started_at >= (3 * MB - up.burst) / MB - 1e-6
        assert up.paid_until - up.started_at >= 2.0
        counters = a.counters.snapshot()
        assert counters["ratelimit.upload_throttled_bytes"] == up.throttled_bytes
        assert counters["ratelimit.upload_wait_ms"] > 0
        assert b.throttle.upload is None  # the receiver is not capped
        status = a.throttle.status()
        assert status["upload"]["bytes_s"] == MB and status["download"] == {"bytes_s": None}

    uvloop.run(_pair(HostOptions(pubsub=None, upload_bytes_s=MB), HostOptions(pubsub=None),
                     scenario))


@pytest.mark.integration
def test_a_download_capped_host_reads_at_its_cap_and_the_sender_is_held_back() -> None:
    async def scenario(a: Host, b: Host) -> None:
        reply = await _send_3mb(a, b)
        assert reply.meta["bytes"] == 3 * MB
        down = b.throttle.download
        assert down is not None and down.granted_bytes >= 3 * MB
        assert down.paid_until - down.started_at >= (3 * MB - down.burst) / MB - 1e-6
        assert b.counters.snapshot()["ratelimit.download_throttled_bytes"] > 0
        assert a.throttle.upload is None

    uvloop.run(_pair(HostOptions(pubsub=None), HostOptions(pubsub=None, download_bytes_s=MB),
                     scenario))


@pytest.mark.parametrize("name", ["upload_bytes_s", "download_bytes_s", "rate_burst_bytes"])
@pytest.mark.parametrize("value", [0, -5, 1.5, True])
def test_host_options_refuse_caps_that_are_not_positive_integers(name: str, value: object):
    with pytest.raises(LocalUsageError, match=name):
        HostOptions(**{name: value})


# ---- the stage worker's byte bound (limits.saved_activation_bytes) --------------------------

from torch import nn  # noqa: E402

from swarmd.errors import StageBusy  # noqa: E402
from swarmd.pipeline.worker import StageWorker  # noqa: E402

W = 16


def _blocks(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(W, 4 * W), nn.GELU(), nn.Linear(4 * W, W), nn.LayerNorm(W))


def test_saved_bytes_are_measured_and_a_forward_over_the_bound_gets_busy() -> None:
    x = torch.randn(4, 8, W)
    probe = StageWorker(_blocks(0), width=W, max_tokens=1000, max_saved_bytes=1 << 40)
    probe.forward("a", x, now=0.0)
    one = probe.saved_bytes
    # at least the input, the output and the 4W-wide hidden activations of 32 tokens
    assert one >= 32 * (W + W + 4 * W) * 4
    w = StageWorker(_blocks(0), width=W, max_tokens=1000, max_saved_bytes=one + one // 2)
    w.forward("a", x, now=0.0)
    assert w.saved_bytes == one
    with pytest.raises(StageBusy, match="saved_activation_bytes"):
        w.forward("b", x, now=0.0)
    assert w.refused_for_bytes == 1 and w.saved == 1
    w.forward("small", torch.randn(1, 4, W), now=0.0)  # an eighth of the tokens still fits
    w.backward("a", torch.ones(4, 8, W), now=1.0)
    w.backward("small", torch.ones(1, 4, W), now=1.0)
    assert w.saved_bytes == 0
    w.forward("b", x, now=2.0)  # room again once the backward freed it
    assert w.saved == 1


def test_an_empty_worker_takes_one_microbatch_however_small_the_bound() -> None:
    w = StageWorker(_blocks(0), width=W, max_tokens=1000, max_saved_bytes=1)
    w.forward("a", torch.randn(2, 8, W), now=0.0)
    with pytest.raises(StageBusy):
        w.forward("b", torch.randn(2, 8, W), now=0.0)
    w.expire(now=1e9)
    assert w.saved_bytes == 0
    w.forward("c", torch.randn(2, 8, W), now=1e9)


def test_measuring_what_autograd_saves_changes_no_gradient() -> None:
    x, g = torch.randn(3, 5, W), torch.randn(3, 5, W)
    plain, bounded = _blocks(7), _blocks(7)
    results = []
    for module, cap in ((plain, None), (bounded, 1 << 30)):
        w = StageWorker(module, width=W, max_tokens=1000, max_saved_bytes=cap)
        y = w.forward("a", x, now=0.0)
        results.append((y, w.backward("a", g, now=1.0)))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    for p, q in zip(plain.parameters(), bounded.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_batch_is_bounded_as_a_whole() -> None:
    x = torch.randn(2, 8, W)
    probe = StageWorker(_blocks(0), width=W, max_tokens=1000, max_saved_bytes=1 << 40)
    probe.forward("p", x, now=0.0)
    w = StageWorker(_blocks(0), width=W, max_tokens=1000, max_saved_bytes=probe.saved_bytes * 2)
    w.forward("a", x, now=0.0)
    with pytest.raises(StageBusy):
        w.forward_many([("b", x), ("c", x)], now=0.0)
    assert w.saved == 1


# ---- [limits] in the configuration ---------------------------------------------------------

from swarmd.config import Config, ConfigError, LimitsConfig, load_config  # noqa: E402
from swarmd.config.limits import parse_bytes  # noqa: E402
from swarmd.node.host_options import host_options  # noqa: E402


def _error(tmp_path, text: str = "", env: dict[str, str] | None = None) -> str:
    path = tmp_path / "swarmd.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env or {})
    return str(info.value)


def test_limits_are_off_by_default_and_reach_the_transport_when_set(tmp_path) -> None:
    config = Config()
    assert config.limits == LimitsConfig()
    assert (config.limits.upload, config.limits.download, config.limits.saved_activations,
            config.limits.device_memory, config.limits.threads) == (None,) * 5
    options = host_options(config)
    assert options.upload_bytes_s is None and options.download_bytes_s is None
    path = tmp_path / "swarmd.toml"
    path.write_text('[limits]\nupload_bytes_s = "1MB"\ndownload_bytes_s = 2500000\n'
                    'saved_activation_bytes = "2GiB"\ncpu_threads = 2\n')
    config = load_config(path, {"SWARMD_LIMITS_DEVICE_MEMORY_BYTES": "8GB"})
    assert config.limits.upload == 1_000_000 and config.limits.download == 2_500_000
    assert config.limits.saved_activations == 2 << 30
    assert config.limits.device_memory == 8 * 10**9 and config.limits.threads == 2
    options = host_options(config)
    assert (options.upload_bytes_s, options.download_bytes_s) == (1_000_000, 2_500_000)


@pytest.mark.parametrize("value", ["0", "-1", '"0"', '"-2MB"', "0.4"])
@pytest.mark.parametrize("key", ["upload_bytes_s", "download_bytes_s", "saved_activation_bytes",
                                 "device_memory_bytes", "cpu_threads"])
def test_a_cap_of_0_or_less_says_to_write_off(tmp_path, key: str, value: str) -> None:
    message = _error(tmp_path, f"[limits]\n{key} = {value}\n")
    assert f"limits.{key}" in message and str(tmp_path) in message
    assert 'write "off"' in message and "does not mean unlimited" in message


@pytest.mark.parametrize("value", ['"fast"', "true", "[1]", '"1 parsec"', '"1e"'])
def test_a_cap_that_is_no_number_is_refused_saying_what_is_expected(tmp_path, value) -> None:
    message = _error(tmp_path, f"[limits]\nupload_bytes_s = {value}\n")
    assert "limits.upload_bytes_s" in message and 'expected "off" or a number' in message


def test_environment_and_flags_parse_caps_too() -> None:
    config = load_config(None, {"SWARMD_LIMITS_UPLOAD_BYTES_S": "512KiB",
                                "SWARMD_LIMITS_CPU_THREADS": "off"},
                         {"limits.download_bytes_s": "3MB/s"})
    assert config.limits.upload == 512 << 10 and config.limits.threads is None
    assert config.limits.download == 3_000_000
    with pytest.raises(ConfigError, match="SWARMD_LIMITS_UPLOAD_BYTES_S.*write \"off\""):
        load_config(None, {"SWARMD_LIMITS_UPLOAD_BYTES_S": "0"})
    with pytest.raises(ConfigError, match="limits.cpu_threads"):
        load_config(None, {"SWARMD_LIMITS_CPU_THREADS": "2000"})


def test_cpu_threads_and_model_threads_must_agree(tmp_path) -> None:
    message = _error(tmp_path, "[limits]\ncpu_threads = 2\n[model]\nthreads = 3\n")
    assert "limits.cpu_threads" in message and "model.threads" in message
    both = tmp_path / "both.toml"
    both.write_text("[limits]\ncpu_threads = 2\n[model]\nthreads = 2\n")
    assert load_config(both, {}).limits.threads == 2


def test_parse_bytes_units() -> None:
    assert parse_bytes("1MB") == 10**6 and parse_bytes("1 MiB") == 1 << 20
    assert parse_bytes("2.5kb") == 2500 and parse_bytes("7") == 7
    assert parse_bytes("1e6") == 10**6 and parse_bytes("1MB/s") == 10**6
    for bad in ("", "MB", "1 XB", "1..2", "-1"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


# ---- what a capped peer announces (swarmd.node.caps) ----------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from swarmd.node import caps  # noqa: E402


def test_wire_bytes_per_value_follow_the_codec() -> None:
    assert caps.wire_bytes_per_value("none") == 4.0
    assert caps.wire_bytes_per_value("fp16+zstd") == 2.0
    assert caps.wire_bytes_per_value("int8", block_size=64) == pytest.approx(1 + 2 / 64)
    assert caps.wire_bytes_per_value("int8", block_size=64, scale_dtype="float32") == \
        pytest.approx(1 + 4 / 64)
    with pytest.raises(ValueError):
        caps.wire_bytes_per_value("gzip")


def test_a_capped_peer_announces_what_its_upload_can_carry() -> None:
    # 128 tokens x width 128, int8: ~17 kB per sample each way, ~34 kB a sample in all
    per_sample = caps.upload_bytes_per_sample(tokens=128, width=128,
                                              bytes_per_value=caps.wire_bytes_per_value("int8"))
    assert per_sample == pytest.approx(2 * 128 * 128 * (1 + 2 / 64))
    capped = caps.capped_throughput(100.0, 1_000_000, per_sample, batch_size=8)
    assert 14.0 < capped < 1_000_000 / per_sample
    assert caps.capped_throughput(5.0, 1_000_000, per_sample) == 5.0  # the cap is not binding
    assert caps.capped_throughput(100.0, None, per_sample) == 100.0  # no cap
    assert caps.tighter_cap(None, 5, 3) == 3 and caps.tighter_cap(None, None) is None


@settings(max_examples=200, deadline=None)
@given(measured=st.floats(0, 1e6), cap=st.integers(1, 10**12),
       per_sample=st.floats(1, 1e9), batch=st.integers(1, 4096))
def test_announced_throughput_never_exceeds_the_measured_one_nor_the_cap(measured, cap,
                                                                          per_sample, batch):
    got = caps.capped_throughput(measured, cap, per_sample, batch_size=batch)
    assert 0.0 <= got <= measured
    assert got * per_sample <= cap * (1 + 1e-9)
    assert caps.capped_throughput(measured, cap * 2, per_sample, batch_size=batch) >= got


def test_what_the_cap_leaves_is_the_cap_less_the_other_traffic_of_the_last_minute() -> None:
    left = caps.UploadLeft(window_s=60.0, min_span_s=10.0, floor=0.1)
    assert left.left(200_000) == 200_000  # nothing observed: the whole cap
    hop_bytes = 0.0
    for t in range(0, 21):  # 20 s: 50 kB/s of averaging besides 100 kB/s of hops
        hop_bytes = 100_000.0 * t
        left.observe(float(t), 150_000.0 * t, hop_bytes)
        if t < 10:
            assert left.left(200_000) == 200_000  # under min_span_s: the whole cap
    assert left.other_bytes_s() == pytest.approx(50_000)
    assert left.left(200_000) == pytest.approx(150_000)
    for t in range(21, 100):  # then hops only: the averaging ages out of the window
        left.observe(float(t), 150_000.0 * 20 + 100_000.0 * (t - 20), 100_000.0 * t)
    assert left.other_bytes_s() == pytest.approx(0.0) and left.left(200_000) == 200_000
    full = caps.UploadLeft(min_span_s=1.0, window_s=10.0, floor=0.1)
    full.observe(0.0, 0, 0)
    full.observe(5.0, 5 * 400_000, 0)  # other traffic over the cap: the floor is left
    assert full.left(200_000) == pytest.approx(20_000)
    full.observe(5.0, 0, 0)  # not after the last: ignored
    full.observe(4.0, 0, 0)
    assert full.left(200_000) == pytest.approx(20_000)
    with pytest.raises(ValueError):
        caps.UploadLeft(floor=0)


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.floats(0.01, 30), st.floats(0, 1e7), st.floats(0, 1e7)),
                      min_size=1, max_size=50), cap=st.integers(1, 10**10))
def test_what_the_cap_leaves_is_between_the_floor_and_the_cap(steps, cap) -> None:
    left = caps.UploadLeft(floor=0.1)
    now = total = hops = 0.0
    for dt, sent, hop in steps:
        now, total, hops = now + dt, total + sent, hops + min(hop, sent)
        left.observe(now, total, hops)
        assert 0.1 * cap * (1 - 1e-9) <= left.left(cap) <= cap


def test_hop_bytes_count_half_a_sample_each_way_and_an_overhead() -> None:
    assert caps.hop_upload_bytes(10, 1000.0, batch_size=8) == \
        10 * (8 * 500.0 + caps.MESSAGE_OVERHEAD_BYTES)


def test_a_stage_that_does_not_fit_the_device_memory_cap_is_refused_with_the_numbers() -> None:
    assert caps.device_memory_refusal(stage=1, param_bytes=10**9, optimizer="adamw",
                                      cap_bytes=None, device="cuda:0") is None
    assert caps.device_memory_refusal(stage=1, param_bytes=10**9, optimizer="adamw",
                                      cap_bytes=4 * 10**9, device="cuda:0") is None
    why = caps.device_memory_refusal(stage=1, param_bytes=10**9, optimizer="adamw",
                                     cap_bytes=3 * 10**9, device="cuda:0")
    assert why is not None
    assert "stage 1 needs 4.00 GB on cuda:0" in why and "1.00 GB of parameters" in why
    assert "limits.device_memory_bytes = 3000000000" in why


# ---- a daemon with [limits] -----------------------------------------------------------------

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from daemon_harness import ROOT, DaemonProcess, stop_all, wait_until  # noqa: E402
from swarmd.local.demo import DEMO_ENV  # noqa: E402

DAEMON_ENV = {**DEMO_ENV, "SWARMD_MODEL_WIDTH": "64", "SWARMD_MODEL_SEQ_LEN": "32",
              "SWARMD_SWARM_STAGES": "1", "SWARMD_SWARM_NAME": "limits-test",
              "SWARMD_LIMITS_UPLOAD_BYTES_S": "1MB", "SWARMD_LIMITS_DOWNLOAD_BYTES_S": "off",
              "SWARMD_LIMITS_SAVED_ACTIVATION_BYTES": "64MiB", "SWARMD_LIMITS_CPU_THREADS": "1"}


@pytest.mark.integration
def test_a_daemon_shows_its_caps_in_status_and_announces_its_capped_throughput(tmp_path) -> None:
    d = DaemonProcess(tmp_path / "home", "--stage", "0", env=DAEMON_ENV)
    try:
        d.wait_started()
        status = wait_until(lambda: (s := d.get("/api/v0/status"))["limits"]
                        .get("announced_throughput") is not None and s, 30,
                            "the stage server's announced throughput in status")
        limits = status["limits"]
        assert limits["upload"]["bytes_s"] == 1_000_000
        assert limits["download"] == {"bytes_s": None}
        assert limits["saved_activations"]["bytes"] == 64 << 20
        assert limits["cpu_threads"] == {"set": 1, "torch": 1}
        assert limits["device_memory_bytes"] is None
        assert limits["announced_throughput"] <= limits["measured_throughput"]
        text = subprocess.run([sys.executable, "-m", "swarmd", "status", "--home", str(d.home)],
                              capture_output=True, text=True, cwd=ROOT, timeout=60,
                              env={**os.environ, **DAEMON_ENV})
        assert text.returncode == 0, text.stderr
        assert "limits      upload 1.0 MB/s (throttled" in text.stdout
        assert "download off" in text.stdout and "saved activations 67.1 MB" in text.stdout
        as_json = subprocess.run([sys.executable, "-m", "swarmd", "status", "--json", "--home",
                                  str(d.home)], capture_output=True, text=True, cwd=ROOT,
                                 timeout=60, env={**os.environ, **DAEMON_ENV})
        assert json.loads(as_json.stdout)["limits"]["upload"]["bytes_s"] == 1_000_000
    finally:
        stop_all([d])
    assert "Traceback" not in d.stderr_path.read_text()


@pytest.mark.integration
def test_a_stage_over_the_device_memory_cap_is_refused_with_the_numbers(tmp_path) -> None:
    d = DaemonProcess(tmp_path / "home", "--stage", "0",
                      env={**DAEMON_ENV, "SWARMD_LIMITS_DEVICE_MEMORY_BYTES": "100kB"})
    try:
        code = d.wait(90)
    finally:
        stop_all([d])
    err = d.stderr_path.read_text()
    assert code != 0
    assert "limits.device_memory_bytes = 100000" in err and "stage 0 needs" in err, err[-2000:]
    assert "Traceback" not in err
    assert not (d.home / "api").exists()


@pytest.mark.integration
def test_join_with_a_cap_of_0_stops_with_a_message_saying_to_write_off(tmp_path) -> None:
    home = tmp_path / "home"
    out = swarmd_run(["join", "--home", str(home)],
                     capture_output=True, text=True, cwd=ROOT, timeout=60,
                     env={**os.environ, "SWARMD_LIMITS_UPLOAD_BYTES_S": "0"})
    assert out.returncode == 2
    assert "SWARMD_LIMITS_UPLOAD_BYTES_S" in out.stderr and 'write "off"' in out.stderr
    assert "Traceback" not in out.stderr


def _free_then_capped(tmp_path: Path, env: dict[str, str], cap: int, capped_stage: int,
                      started: list[DaemonProcess]) -> tuple[DaemonProcess, DaemonProcess]:
    """A stage-0 daemon, then one of ``capped_stage`` with its upload capped at ``cap``
    bootstrapped from it; both started (and added to ``started``, for the caller to stop)."""
    free = DaemonProcess(tmp_path / "free", "--stage", "0", env=env)
    started.append(free)
    free.wait_started()
    capped = DaemonProcess(tmp_path / "capped", "--stage", str(capped_stage), "--bootstrap",
                           free.addr, env={**env, "SWARMD_LIMITS_UPLOAD_BYTES_S": str(cap)})
    started.append(capped)
    capped.wait_started()
    return free, capped


@pytest.mark.integration
@pytest.mark.timeout(300)  # two daemon starts and a training run; slow on a loaded machine
def test_training_goes_through_an_upload_capped_peer_that_announces_its_capped_rate(tmp_path):
    """Two peers serve the one stage, one of them with its upload capped: training loses
    nothing, the capped peer carries microbatches, its upload bucket throttled them, and what
    its stage-mate sees it announce is within what the cap can carry."""
    from swarmd.trainer.run import train

    base = {k: v for k, v in DAEMON_ENV.items() if not k.startswith("SWARMD_LIMITS_")}
    cap = 200_000
    started: list[DaemonProcess] = []
    try:
        free, capped = _free_then_capped(tmp_path, base, cap, 0, started)
        wait_until(lambda: free.get("/api/v0/swarm")["stages"][0]["routable_peers"] == 2, 30,
                   "both peers of the stage routable")
        config = load_config(None, {**os.environ, **base})
        result = uvloop.run(asyncio.wait_for(
            train(config, bootstrap=[free.addr], steps=8, progress=lambda line: None,
                  bar=False), 240))
        assert result.lost == 0
        status = capped.get("/api/v0/status")
        assert status["counters"].get("stage.forward", 0) >= 1  # routing still uses it
        upload = status["limits"]["upload"]
        assert upload["bytes_s"] == cap and upload["throttled_bytes"] > 0
        from swarmd.node.host_options import upload_bytes_per_sample

        seam, _ = model_seam_of(config)
        most = cap / upload_bytes_per_sample(config, seam)
        assert status["limits"]["announced_throughput"] <= most
        # what it announces is taken from what averaging left of its cap, which it measured
        limits = wait_until(lambda: (lm := capped.get("/api/v0/status")["limits"])
                            .get("upload_other_bytes_s") and lm, 60,
                            "the capped peer's averaging traffic measured")
        assert 0 < limits["upload_left_bytes_s"] < cap
        assert limits["upload_left_bytes_s"] == pytest.approx(
            max(cap // 10, cap - limits["upload_other_bytes_s"]), abs=1)
        assert limits["announced_throughput"] <= \
            limits["upload_left_bytes_s"] / upload_bytes_per_sample(config, seam) + 1e-6

        def seen() -> float | None:
            rows = free.get("/api/v0/swarm")["stages"][0]["peers"]
            return next((p["throughput"] for p in rows if p["peer_id"] == capped.peer_id), None)

        wait_until(lambda: (t := seen()) is not None and 0 < t <= most, 30,
                   "the capped peer's announced throughput, within its cap, in its mate's view")
    finally:
        stop_all(started)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_peers_shows_the_wiring_s_ceiling_and_compute_share_of_a_capped_next_stage(tmp_path):
    """Stage 0 routes to an upload-capped stage-1 peer: its ``/api/v0/peers`` row (real HTTP)
    says the ceiling it announced, the compute share and compute time its hops said, the
    routing ceiling (their product), the rate routing uses (that, at most twice its hop rate)
    and that the cap binds; ``swarmd peers`` prints the same."""
    from swarmd.node.host_options import upload_bytes_per_sample
    from swarmd.trainer.run import train

    base = {**{k: v for k, v in DAEMON_ENV.items() if not k.startswith("SWARMD_LIMITS_")},
            "SWARMD_SWARM_STAGES": "2", "SWARMD_SWARM_NAME": "limits-peers"}
    cap = 200_000
    started: list[DaemonProcess] = []
    try:
        first, capped = _free_then_capped(tmp_path, base, cap, 1, started)
        wait_until(lambda: all(s["routable_peers"] == 1
                               for s in first.get("/api/v0/swarm")["stages"]), 30,
                   "both stages routable")
        config = load_config(None, {**os.environ, **base})

        def run(steps: int) -> None:
            result = uvloop.run(asyncio.wait_for(
                train(config, bootstrap=[first.addr], steps=steps, progress=lambda line: None,
                      bar=False), 240))
            assert result.lost == 0

        def announced() -> float:
            rows = first.get("/api/v0/swarm")["stages"][1]["peers"]
            return next((p["throughput"] for p in rows if p["peer_id"] == capped.peer_id), 0)

        run(2)  # it measures its compute, then announces what its cap carries
        wait_until(lambda: announced() > 0, 60, "the capped peer's announcement in stage 0's view")
        run(2)  # stage 0's router now holds it to that
        seam, _ = model_seam_of(config)
        most = cap / upload_bytes_per_sample(config, seam)
        row = next(p for p in first.get("/api/v0/peers") if p["peer_id"] == capped.peer_id)
        assert row["stage"] == 1 and row["routing"] == "ok" and row["measured"] is True
        assert 0 < row["ceiling"] <= most  # what it announced, within its cap
        assert 0 < row["compute_share"] and row["compute_s"] > 0
        assert row["routing_ceiling"] == pytest.approx(row["ceiling"] * row["compute_share"],
                                                       rel=1e-3, abs=1e-3)
        assert row["rate"] == pytest.approx(min(2 * row["throughput"], row["routing_ceiling"]),
                                            rel=1e-3, abs=1e-3)
        # the tiny model computes hundreds of samples/s; the cap carries about a dozen
        assert row["capped"] is True and row["rate"] < row["throughput"]
        text = subprocess.run([sys.executable, "-m", "swarmd", "peers", "--home",
                               str(first.home)], capture_output=True, text=True, cwd=ROOT,
                              timeout=60, env={**os.environ, **base})
        assert text.returncode == 0, text.stderr
        line = next(ln for ln in text.stdout.splitlines() if capped.peer_id in ln)
        assert f"capped {row['ceiling']:.1f} x" in line and "compute " in line, text.stdout
    finally:
        stop_all(started)


@settings(max_examples=100, deadline=None)
@given(rate=st.integers(1, 1 << 50), size=st.integers(1, 1 << 60),
       threads=st.one_of(st.just("off"), st.integers(1, 1024)))
def test_caps_round_trip_through_the_rendered_file(tmp_path_factory, rate, size, threads):
    from swarmd.config import render_toml

    config = Config(limits=LimitsConfig(upload_bytes_s=rate, saved_activation_bytes=size,
                                        cpu_threads=threads))
    path = tmp_path_factory.mktemp("rt") / "swarmd.toml"
    path.write_text(render_toml(config))
    assert load_config(path, {}) == config


@settings(max_examples=100, deadline=None)
@given(value=st.one_of(st.integers(max_value=0), st.floats(max_value=0.99, allow_nan=False,
                                                          allow_infinity=False)))
def test_no_cap_below_1_is_ever_accepted(value):
    with pytest.raises(ConfigError, match='write "off"'):
        LimitsConfig(download_bytes_s=value)
