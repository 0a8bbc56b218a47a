"""State transfer between real libp2p hosts (Noise + yamux) in this process, on 127.0.0.1.

A joining peer downloads a multi-chunk stage state, verified by digest; when its source dies
mid-transfer it resumes from a peer holding the same snapshot, or starts over with another one;
it prefers the highest step; bad requests get typed error replies and the server keeps serving.
The choice of the next source is also tested alone, without a network (``Plan``)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable

import pytest
import torch
import uvloop

from swarmd.state import encoding as ss
from swarmd.state.encoding import StageState
from swarmd.state.fetch import fetch_state
from swarmd.state.serve import StateServer
from swarmd.state.transfer import Plan, StateInfo, StateTransferFailed
from transport import identity
from transport.errors import RemoteError
from transport.frames import Message
from transport.host import Host, HostOptions

pytestmark = pytest.mark.integration

PROTO = "/swarmd/test/1/state"
HASH = "model-xyz"
CHUNK = 64 * 1024
MAX = 1 << 30


def make_state(step: int, *, stage: int = 1, width: int = 256, seed: int = 0) -> StageState:
    """About 3 x width^2 x 4 bytes (weights and two AdamW moments): 768 KiB at width 256."""
    torch.manual_seed(seed)
    module = torch.nn.Linear(width, width, bias=False)
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return ss.capture(module, optimizer, stage=stage, step=step, model_hash=HASH,
                      meta={"samples": step * 64})


def equal_states(a: StageState, b: StageState) -> bool:
    return ss.encode(a) == ss.encode(b)


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        return await asyncio.wait_for(scenario(), 60)

    return uvloop.run(main())


@contextlib.asynccontextmanager
async def hosts(n: int) -> AsyncIterator[list[Host]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(Host(identity.generate(),
                                                    HostOptions(pubsub=None)))
               for _ in range(n)]


def serve(host: Host, state: StageState | None, **options: Any) -> StateServer:
    async def snapshot() -> StageState | None:
        return state

    server = StateServer(host, PROTO, snapshot, stage=1, model_hash=HASH,
                         chunk_bytes=options.pop("chunk_bytes", CHUNK), **options)
    server.start()
    return server


def source(host: Host) -> tuple[str, list[str]]:
    return host.peer_id, host.addrs


async def fetch(client: Host, sources: list[tuple[str, list[str]]], **options: Any
                ) -> Any:
    return await fetch_state(client, PROTO, sources, stage=options.pop("stage", 1),
                             model_hash=HASH, timeout_s=options.pop("timeout_s", 30),
                             max_bytes=options.pop("max_bytes", MAX), **options)


# ---- happy path -----------------------------------------------------------------------------

def test_multi_chunk_transfer_is_verified_and_reports_progress() -> None:
    state = make_state(step=7)
    size = len(ss.encode(state))
    assert size > 8 * CHUNK

    async def scenario() -> None:
        async with hosts(2) as (a, client):
            server = serve(a, state)
            counters: dict[str, int] = {}
            progress: list[tuple[int, int]] = []
            got = await fetch(client, [source(a)], counters=counters,
                              on_progress=lambda done, total: progress.append((done, total)))
            assert equal_states(got, state) and got.step == 7 and got.meta == {"samples": 448}
            chunks = -(-size // CHUNK)
            assert counters["chunks"] == chunks and counters["bytes"] == size
            assert counters["resumed"] == counters["restarted"] == 0
            assert progress[0] == (0, size) and progress[-1] == (size, size)
            assert [d for d, _ in progress] == sorted(d for d, _ in progress)
            assert server.counters["snapshots"] == 1 and server.counters["chunks"] == chunks
            again = await fetch(client, [source(a)])  # a fresh snapshot is reused
            assert equal_states(again, state) and server.counters["snapshots"] == 1

    run(scenario)


def test_the_highest_step_wins() -> None:
    states = [make_state(step=3, seed=1), make_state(step=9, seed=2), make_state(step=5, seed=3)]

    async def scenario() -> None:
        async with hosts(4) as (*servers, client):
            for host, state in zip(servers, states):
                serve(host, state)
            got = await fetch(client, [source(h) for h in servers])
            assert got.step == 9 and equal_states(got, states[1])
            # a restarted peer with a checkpoint at step 9 keeps it; at step 8 it downloads
            assert await fetch(client, [source(h) for h in servers], newer_than=9) is None
            newer = await fetch(client, [source(h) for h in servers], newer_than=8)
            assert newer is not None and newer.step == 9

    run(scenario)


# ---- a source dies mid-transfer -------------------------------------------------------------

async def fetch_while_killing(first: Host, server: StateServer, rest: list[Host], client: Host,
                              after_chunks: int = 3) -> tuple[StageState, dict[str, int]]:
    """Fetch from [first, *rest]; ``first`` serves ``after_chunks`` chunks, then its host
    closes (every later request to it stays unanswered until the connection drops)."""
    served = 0
    closing: list[asyncio.Task[None]] = []

    async def serve_then_die(message: Message, peer: str) -> Message:
        nonlocal served
        if message.kind == "state_chunk":
            if served >= after_chunks:
                if not closing:
                    closing.append(asyncio.get_running_loop().create_task(first.close()))
                await asyncio.Event().wait()  # cancelled when the host closes
            served += 1
        return await server.serve(message, peer)

    first.set_request_handler(PROTO, serve_then_die)
    counters: dict[str, int] = {}
    try:
        got = await fetch(client, [source(first)] + [source(h) for h in rest],
                          counters=counters, parallel=2)
    finally:
        if closing:
            await closing[0]
    assert closing and served == after_chunks, "the first source was never closed"
    return got, counters


def test_source_dies_then_the_same_snapshot_resumes_from_another_peer() -> None:
    state = make_state(step=4)

    async def scenario() -> None:
        first = Host(identity.generate(), HostOptions(pubsub=None))
        await first.start()
        try:
            async with hosts(2) as (second, client):
                dying = serve(first, state)
                backup = serve(second, state)
                got, counters = await fetch_while_killing(first, dying, [second], client)
                assert equal_states(got, state)
                assert counters["resumed"] >= 1 and counters["restarted"] == 0
                assert counters["sources_failed"] >= 1
                chunks = -(-len(ss.encode(state)) // CHUNK)
                assert counters["chunks"] == chunks  # each chunk stored once
                assert chunks - 3 <= backup.counters["chunks"] < chunks, "only missing ones"
        finally:
            await first.close()

    run(scenario)


def test_source_dies_then_another_snapshot_starts_over() -> None:
    best, other = make_state(step=8, seed=1), make_state(step=6, seed=2)

    async def scenario() -> None:
        first = Host(identity.generate(), HostOptions(pubsub=None))
        await first.start()
        try:
            async with hosts(2) as (second, client):
                dying = serve(first, best)
                serve(second, other)
                got, counters = await fetch_while_killing(first, dying, [second], client)
                assert got.step == 6 and equal_states(got, other)
                assert counters["restarted"] == 1 and counters["resumed"] == 0
        finally:
            await first.close()

    run(scenario)


def test_an_expired_snapshot_is_asked_for_again() -> None:
    state = make_state(step=2)
    clock = [1000.0]

    async def scenario() -> None:
        async with hosts(2) as (a, client):
            server = serve(a, state, keep_s=10.0, clock=lambda: clock[0])
            counters: dict[str, int] = {}

            def on_progress(done: int, total: int) -> None:
                if counters.get("chunks") == 2 and clock[0] == 1000.0:
                    clock[0] += 60.0  # the server forgets the snapshot mid-download

            got = await fetch(client, [source(a)], counters=counters, on_progress=on_progress,
                              parallel=1)
            assert equal_states(got, state)
            assert counters["requeried"] == 1 and counters["resumed"] == 1
            assert server.counters["snapshots"] == 2

    run(scenario)


# ---- failures -------------------------------------------------------------------------------

def test_a_corrupt_chunk_is_caught_by_its_checksum_and_fetched_elsewhere() -> None:
    state = make_state(step=4)

    async def scenario() -> None:
        async with hosts(3) as (liar, honest, client):
            server = serve(liar, state)
            serve(honest, state)

            async def corrupt(message: Message, peer: str) -> Message:
                reply = await server.serve(message, peer)
                if message.kind == "state_chunk" and message.meta["index"] == 2:
                    bad = reply.tensors[0].clone()
                    bad[10] ^= 0xFF
                    return Message(kind=reply.kind, meta=reply.meta, tensors=(bad,))
                return reply

            liar.set_request_handler(PROTO, corrupt)
            counters: dict[str, int] = {}
            got = await fetch(client, [source(liar), source(honest)], counters=counters,
                              parallel=1)
            assert equal_states(got, state)
            assert counters["sources_failed"] == 1 and counters["resumed"] == 1

    run(scenario)



def test_no_working_source_raises_a_typed_error_naming_stage_and_peers() -> None:
    async def scenario() -> None:
        async with hosts(3) as (empty, small, client):
            serve(empty, None)  # a peer that is syncing itself
            serve(small, make_state(step=1))
            gone = Host(identity.generate(), HostOptions(pubsub=None))
            await gone.start()
            gone_source = source(gone)
            await gone.close()
            with pytest.raises(StateTransferFailed) as err:
                await fetch(client, [source(empty), gone_source, source(small)],
                            max_bytes=1000)
            text = str(err.value)
            assert err.value.code == "state_transfer_failed" and "stage 1" in text
            assert empty.peer_id in text and "no_state" in text
            assert gone.peer_id in text and small.peer_id in text and "limit" in text
            with pytest.raises(StateTransferFailed, match="no peer of it is known"):
                await fetch(client, [])

    run(scenario)


def test_bad_requests_get_typed_errors_and_the_server_keeps_serving() -> None:
    state = make_state(step=5)

    async def scenario() -> None:
        async with hosts(2) as (a, client):
            server = serve(a, state)
            await client.dial(a.addrs[0])

            async def ask(kind: str, **meta: Any) -> Message:
                return await client.request(a.peer_id, PROTO, Message(kind=kind, meta=meta),
                                            timeout=10)

            info = (await ask("state_info", stage=1, model_hash=HASH)).meta
            good = {"stage": 1, "model_hash": HASH, "digest": info["digest"]}
            cases = {
                "unknown_snapshot": ("state_chunk", {**good, "digest": "0" * 64, "index": 0}),
                "wrong_stage": ("state_info", {"stage": 2, "model_hash": HASH}),
                "model_hash_mismatch": ("state_chunk", {**good, "model_hash": "x", "index": 0}),
                "bad_state_request": ("state_chunk", {**good, "index": info["chunks"]}),
            }
            more = [("state_chunk", {**good, "index": -1}), ("state_chunk", {**good}),
                    ("state_chunk", {**good, "index": "0"}), ("state_info", {"model_hash": HASH}),
                    ("nonsense", good)]
            for code, (kind, meta) in list(cases.items()) + [("bad_state_request", c)
                                                             for c in more]:
                with pytest.raises(RemoteError) as err:
                    await ask(kind, **meta)
                assert err.value.code == code, (kind, meta, err.value)
            assert server.counters["errors"] == len(cases) + len(more)
            reply = await ask("state_chunk", **good, index=1)
            assert reply.meta["index"] == 1 and reply.tensors[0].numel() == CHUNK
            assert equal_states(await fetch(client, [source(a)]), state)

    run(scenario)


# ---- the plan, alone ------------------------------------------------------------------------

def info(peer: str, step: int, key: str) -> StateInfo:
    return StateInfo(peer=peer, stage=0, step=step, model_hash=HASH, digest=key * 64,
                     total_bytes=10_000, chunk_bytes=1024)


def test_plan_prefers_the_highest_step_then_resumes_the_same_digest() -> None:
    plan = Plan([info("a", 3, "1"), info("b", 5, "2"), info("c", 5, "2"), info("d", 4, "3")])
    chosen, how = plan.next()  # type: ignore[misc]
    assert (chosen.peer, how) == ("b", "start")
    plan.have.update({0, 1, 2})
    plan.failed("b", "reset")
    chosen, how = plan.next()  # type: ignore[misc]
    assert (chosen.peer, how) == ("c", "resume") and plan.missing()[:2] == [3, 4]
    plan.failed("c", "reset")
    chosen, how = plan.next()  # type: ignore[misc]
    assert (chosen.peer, how) == ("d", "restart") and plan.have == set()
    plan.renewed(info("d", 6, "4"))
    plan.bad_snapshot("4" * 64, "bad digest")
    chosen, how = plan.next()  # type: ignore[misc]
    assert (chosen.peer, how) == ("a", "restart")
    plan.failed("a", "gone")
    assert plan.next() is None and set(plan.failures) == {"a", "b", "c", "d"}
