"""Resource caps (``[limits]``): the host's upload/download buckets over real libp2p, the
configuration keys, the stage worker's byte bound and the throughput a capped peer announces."""

from __future__ import annotations

import asyncio

import pytest
import torch
import uvloop

from transport import identity
from transport.codecs import CodecSpec
from transport.errors import LocalUsageError
from transport.frames import Message
from transport.host import Host, HostOptions

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
