"""The typed messages of state transfer (swarmd/state/messages.py), and the fetching and serving
sides against hostile peers between real hosts in this process: a source claiming 16 GiB, a NaN
state, a chunk that is not the one asked for, a chunk pushed unasked."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.errors import BadPeerMessage
from swarmd.state import encoding as ss
from swarmd.state.messages import (ChunkRequest, InfoRequest, SizeBound, check_offer,
                                   parse_chunk, parse_info, parse_request)
from swarmd.state.transfer import BadStateRequest, StateInfo, StateTransferFailed
from transport.errors import RemoteError
from transport.frames import Message

from test_state_transfer import CHUNK, HASH, PROTO, fetch, hosts, make_state, serve, source

D = "ab" * 32
GiB = 1 << 30


def info(**over: Any) -> StateInfo:
    values = {"peer": "p", "stage": 1, "step": 3, "model_hash": HASH, "digest": D,
              "total_bytes": 10_000, "chunk_bytes": 4096}
    values.update(over)
    return StateInfo(**values)


def test_requests_are_typed_and_unknown_keys_dropped() -> None:
    assert parse_request("state_info", {"stage": 1, "model_hash": HASH, "x": 1}) == \
        InfoRequest(stage=1, model_hash=HASH)
    chunk = parse_request("state_chunk", {"stage": 1, "model_hash": HASH, "digest": D,
                                          "index": 2})
    assert chunk == ChunkRequest(stage=1, model_hash=HASH, digest=D, index=2)
    assert parse_request("state_chunk", chunk.to_meta()) == chunk


@pytest.mark.parametrize("kind,meta,tensors,reason", [
    ("state_info", {"stage": True, "model_hash": HASH}, (), "stage"),
    ("state_info", {"stage": 1, "model_hash": ""}, (), "model_hash"),
    ("state_chunk", {"stage": 1, "model_hash": HASH, "digest": "zz", "index": 0}, (), "chunk"),
    ("state_chunk", {"stage": 1, "model_hash": HASH, "digest": D, "index": -1}, (), "chunk"),
    ("state_chunk", {"stage": 1, "model_hash": HASH, "digest": D, "index": 0},
     (torch.zeros(4, dtype=torch.uint8),), "unsolicited_data"),
    ("state_push", {}, (), "kind"),
])
def test_malformed_requests_raise_the_typed_error(kind: str, meta: dict[str, Any],
                                                  tensors: tuple[Any, ...], reason: str) -> None:
    with pytest.raises(BadStateRequest) as exc:
        parse_request(kind, meta, tensors)
    assert exc.value.reason == reason


def test_an_offer_is_judged_on_its_claim_before_any_byte_is_taken() -> None:
    bound = SizeBound(5_000, 20_000)
    ok = dict(stage=1, model_hash=HASH, max_bytes=GiB, bound=bound, newer_than=None)
    assert check_offer(info(), **ok) is None
    assert "more than the limit" in check_offer(info(total_bytes=16 * GiB,
                                                     chunk_bytes=1 << 24), **ok)
    assert "this stage's model" in check_offer(info(total_bytes=30_000), **ok)
    assert "this stage's model" in check_offer(info(total_bytes=100), **ok)
    assert "not newer" in check_offer(info(step=3), **{**ok, "newer_than": 3})
    assert "offers stage" in check_offer(info(stage=2), **ok)


def test_a_chunk_reply_must_be_the_chunk_asked_for() -> None:
    offer = info()
    good = torch.zeros(4096, dtype=torch.uint8)
    meta = {"digest": D, "index": 0, "checksum": "0" * 32}
    assert parse_chunk("state_chunk", meta, (good,), info=offer, index=0).index == 0
    last = torch.zeros(10_000 - 2 * 4096, dtype=torch.uint8)
    assert parse_chunk("state_chunk", {**meta, "index": 2}, (last,), info=offer, index=2)
    for kind, m, tensors in [("state_chunk", {**meta, "index": 1}, (good,)),
                             ("state_chunk", {**meta, "digest": "cd" * 32}, (good,)),
                             ("state_chunk", meta, (good[:100],)),
                             ("state_chunk", meta, (good.to(torch.int16),)),
                             ("state_chunk", {**meta, "checksum": 5}, (good,)),
                             ("state_info", meta, (good,)),
                             ("state_chunk", meta, ())]:
        with pytest.raises(BadStateRequest):
            parse_chunk(kind, m, tensors, info=offer, index=0)


_plain = st.recursive(st.none() | st.booleans() | st.integers() | st.floats()
                      | st.text(max_size=70),
                      lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
_keys = st.sampled_from(["stage", "step", "model_hash", "digest", "total_bytes",
                         "chunk_bytes", "chunks", "index", "checksum"])
_metas = st.dictionaries(_keys | st.text(max_size=5), _plain | st.just(D) | st.just(HASH),
                         max_size=9)


@settings(max_examples=400, deadline=None)
@given(kind=st.sampled_from(["state_info", "state_chunk", "other"]), meta=_metas,
       n=st.integers(0, 2))
def test_arbitrary_well_framed_metadata_raises_only_the_typed_error(
        kind: str, meta: dict[str, Any], n: int) -> None:
    tensors = tuple(torch.zeros(4096, dtype=torch.uint8) for _ in range(n))
    for call in (lambda: parse_request(kind, meta, tensors),
                 lambda: parse_info("p", kind, meta),
                 lambda: parse_chunk(kind, meta, tensors, info=info(), index=0)):
        try:
            value = call()
        except BadPeerMessage:
            continue
        if isinstance(value, StateInfo):
            assert 0 <= value.total_bytes and value.chunks < math.inf


def test_a_non_finite_state_is_refused_by_the_typed_check() -> None:
    state = make_state(step=1, width=8)
    ss.check_finite_state(state)
    bad = make_state(step=1, width=8)
    next(iter(bad.params.values()))[0, 0] = float("nan")
    with pytest.raises(ss.NonFiniteState):
        ss.check_finite_state(bad)
    module = torch.nn.Linear(8, 8, bias=False)
    low, high = ss.state_bytes_bound(module)
    assert low == 8 * 8 * 4 and low <= len(ss.encode(state)) <= high


# ---- hostile peers between real hosts ---------------------------------------------------------

def run(scenario: Any) -> Any:
    async def main() -> Any:
        return await asyncio.wait_for(scenario(), 60)
    return uvloop.run(main())


def test_a_source_claiming_16_gib_is_refused_before_anything_is_allocated() -> None:
    async def scenario() -> None:
        async with hosts(2) as (liar, client):
            async def claim(message: Message, peer: str) -> Message:
                if message.kind == "state_chunk":  # never asked: the claim is refused first
                    raise AssertionError("a chunk was requested from the liar")
                huge = info(peer=liar.peer_id, total_bytes=16 * GiB, chunk_bytes=1 << 24)
                return Message(kind="state_info", meta=huge.to_meta())

            liar.set_request_handler(PROTO, claim)
            counters: dict[str, int] = {}
            for bound in (None, SizeBound(1, 1 << 20)):  # the byte limit, then the bound
                with pytest.raises(StateTransferFailed, match="16|more than|model"):
                    await fetch(client, [source(liar)], counters=counters, size_bound=bound,
                                max_bytes=GiB if bound is None else 16 * GiB)
            assert counters["bad_replies"] == 2 and counters["chunks"] == 0

    run(scenario)


def test_a_nan_state_is_neither_served_nor_restored() -> None:
    bad = make_state(step=5)
    next(iter(bad.params.values()))[1, 2] = float("nan")

    async def scenario() -> None:
        async with hosts(3) as (honest, liar, client):
            server = serve(honest, bad)
            with pytest.raises(RemoteError) as refused:  # the honest server will not serve it
                await client.ensure_connected(honest.peer_id, honest.addrs)
                await client.request(honest.peer_id, PROTO, Message(
                    kind="state_info", meta={"stage": 1, "model_hash": HASH}))
            assert refused.value.code == "no_state"
            assert server.counters["non_finite_snapshots"] == 1
            # a liar that serves one anyway (bypassing the check): the client refuses it
            data = ss.encode(bad)
            offer = info(peer=liar.peer_id, step=5, digest=ss.digest(data),
                         total_bytes=len(data), chunk_bytes=CHUNK)

            async def lie(message: Message, peer: str) -> Message:
                if message.kind == "state_info":
                    return Message(kind="state_info", meta=offer.to_meta())
                i = message.meta["index"]
                start, end = offer.chunk_range(i)
                from swarmd.state.transfer import chunk_checksum
                return Message(kind="state_chunk", meta={
                    "digest": offer.digest, "index": i,
                    "checksum": chunk_checksum(data[start:end])},
                    tensors=(torch.frombuffer(bytearray(data[start:end]), dtype=torch.uint8),))

            liar.set_request_handler(PROTO, lie, codec=None)
            counters: dict[str, int] = {}
            with pytest.raises(StateTransferFailed, match="not finite"):
                await fetch(client, [source(liar)], counters=counters)
            assert counters["non_finite_states"] == 1

    run(scenario)


def test_a_chunk_other_than_the_one_asked_for_fails_the_source_and_another_is_used() -> None:
    state = make_state(step=4)

    async def scenario() -> None:
        async with hosts(3) as (honest, liar, client):
            serve(honest, state)
            real = serve(liar, state)  # same snapshot, but the liar answers the wrong chunk

            async def shifted(message: Message, peer: str) -> Message:
                if message.kind == "state_chunk":
                    meta = {**message.meta, "index": message.meta["index"] + 1}
                    return await real.serve(Message(kind="state_chunk", meta=meta), peer)
                return await real.serve(message, peer)

            liar.set_request_handler(PROTO, shifted, codec=None)
            counters: dict[str, int] = {}
            got = await fetch(client, [source(liar), source(honest)], counters=counters)
            assert ss.encode(got) == ss.encode(state)
            assert counters["bad_replies"] >= 1 and counters["sources_failed"] >= 1

    run(scenario)


def test_a_chunk_pushed_unasked_is_refused_and_the_server_keeps_serving() -> None:
    state = make_state(step=2)

    async def scenario() -> None:
        async with hosts(2) as (victim, pusher):
            server = serve(victim, state)
            await pusher.ensure_connected(victim.peer_id, victim.addrs)
            push = Message(kind="state_chunk", meta={"stage": 1, "model_hash": HASH,
                                                     "digest": D, "index": 0},
                           tensors=(torch.zeros(CHUNK, dtype=torch.uint8),))
            with pytest.raises(RemoteError) as refused:
                await pusher.request(victim.peer_id, PROTO, push)
            assert refused.value.code == "bad_state_request"
            assert server.counters["bad_requests.unsolicited_data"] == 1
            got = await fetch(pusher, [source(victim)])
            assert ss.encode(got) == ss.encode(state)

    run(scenario)


# ---- the keeper waits (bounded) for mates it expects ----------------------------------------

class _Server:
    stage = 1
    module = torch.nn.Linear(4, 4)


class _Host:
    peer_id = "me"


def test_a_keeper_that_expects_mates_waits_for_its_view_to_name_one_but_not_forever() -> None:
    from swarmd.state.keeper import StageKeeper

    def keeper(sources: Any, **kw: Any) -> StageKeeper:
        return StageKeeper(_Host(), _Server(), swarm="t", home=None, model_hash=HASH,
                           every_steps=0, sources=sources, **kw)

    calls = {"n": 0}

    def filling() -> list[tuple[str, tuple[str, ...]]]:  # the view names a mate at the 3rd look
        calls["n"] += 1
        return [("mate", ())] if calls["n"] >= 3 else []

    async def scenario() -> None:
        assert await keeper(filling)._wait_for_sources(expected=True) == [("mate", ())]
        calls["n"] = 0
        assert await keeper(filling)._wait_for_sources(expected=False) == []  # a new stage
        calls["n"] = 0
        hinted = keeper(filling, mates_expected=lambda: True)
        assert await hinted._wait_for_sources(expected=False) == [("mate", ())]
        alone = keeper(lambda: [], mates_wait_s=0.3)
        assert await alone._wait_for_sources(expected=True) == []
        assert alone.counters["waited_for_mates"] == 1

    asyncio.run(asyncio.wait_for(scenario(), 30))
