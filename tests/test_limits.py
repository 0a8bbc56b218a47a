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
