"""The fetching side of state transfer (:mod:`swarmd.state.transfer`): download, resume, verify.

Deadlines follow the link (``swarmd.links``): a chunk request's is derived from the bytes in
flight to its source (``parallel`` chunks at a time share the link) and what was measured with
it, at most ``request_timeout_s``; each chunk received feeds the estimates. An offer
(``state_info``) may make the source capture and encode its state first: ``INFO_COMPUTE_S``
is added for that.

A rate cap binds the link (``[limits]``, docs/limits.md): the tighter of the source's upload cap
(said in its offer) and our own download cap. Through it, fewer chunks are asked at a time
(``swarmd.links.chunks_in_flight``: as many as the cap carries within ``request_timeout_s``, at
least one) and a chunk's deadline is at least ``slack x`` the bytes in flight over the cap,
even past ``request_timeout_s`` (a 4 MiB chunk at 64 kB/s takes 65 s by itself), but never
past ``CAPPED_CHUNK_MAX_S``: a source claiming a tiny cap cannot hold a download up for long.
"""

import asyncio
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from swarmd.links import LinkEstimates, chunks_in_flight, links_for
from swarmd.state.encoding import BadStageState, NonFiniteState, StageState, check_finite_state
from swarmd.state.layout import byte_view
from swarmd.state.spool import Spool
from swarmd.state.messages import (DigestReply, DigestRequest, ReplayReply, ReplayRequest,
                                   SizeBound, check_offer, parse_chunk, parse_digest, parse_info,
                                   parse_replay)
from transport.errors import (
    LocalUsageError,
    PeerProtocolError,
    PeerUnavailable,
    RemoteError,
    TransportClosed,
    TransportError,
)
from transport.frames import Message
from swarmd.state.transfer import (
    MAX_REQUERIES, MAX_SOURCES, _NONE, BadStateRequest, Plan, StateInfo, StateTransferFailed,
    UnknownSnapshot, chunk_checksum,
)

log = logging.getLogger("swarmd.state.transfer")

#: what a source may spend capturing and encoding its state before it answers ``state_info``
INFO_COMPUTE_S = 15.0
#: the longest a chunk's deadline grows for a rate cap (4 MiB with 3x slack: 21 kB/s)
CAPPED_CHUNK_MAX_S = 600.0


class _SourceFailed(Exception):
    def __init__(self, peer: str, reason: str, *, expired: bool = False) -> None:
        super().__init__(reason)
        self.peer = peer
        self.reason = reason
        self.expired = expired


async def fetch_state(host: Any, protocol: str, sources: Sequence[tuple[str, Sequence[str]]], *,
                      stage: int, model_hash: str, timeout_s: float, max_bytes: int,
                      on_progress: Callable[[int, int], None] | None = None,
                      parallel: int = 4, request_timeout_s: float = 120.0,
                      newer_than: int | None = None,
                      counters: dict[str, int] | None = None,
                      size_bound: SizeBound | None = None,
                      links: LinkEstimates | None = None,
                      spool_dir: Path | None = None) -> StageState | None:
    """Download the state of ``stage`` from the best of ``sources`` ((peer id, multiaddrs)).

    ``on_progress(done_bytes, total_bytes)`` is called after every chunk (and with 0 when a
    download starts or starts over). ``counters`` (if given) is updated: chunks, bytes, resumed,
    restarted, requeried, sources_failed, bad_replies, non_finite_states. Raises
    ``StateTransferFailed`` when no source works within ``timeout_s``; ``TransportClosed`` if
    our own host closes meanwhile. Each request's deadline follows the link (the module doc),
    at most ``request_timeout_s``; ``links`` defaults to the host's shared estimates.

    An offer over ``max_bytes`` or outside ``size_bound`` (what the stage's model implies) is
    refused before a byte is taken; each chunk is accepted only as the reply of the source it
    was asked of, checked and written at its offset in a temporary file in ``spool_dir``
    (``swarmd.state.spool``; the system's temporary directory when None), which is checked
    whole and decoded from piece by piece: beside the state, memory holds the chunks in
    flight, whatever the stage's size. A state that decodes but holds NaN/Inf is refused like
    a corrupt one (``non_finite_states``).

    With ``newer_than`` (the step of a local checkpoint), offers at or below that step are
    ignored, and None is returned when no source answers with a newer one: keep the local state.
    Without it the result is never None.
    """
    fetch = _Fetch(host, protocol, stage=stage, model_hash=model_hash, max_bytes=max_bytes,
                   on_progress=on_progress, parallel=max(1, parallel),
                   request_timeout_s=request_timeout_s, newer_than=newer_than,
                   counters=counters if counters is not None else {}, size_bound=size_bound,
                   links=links if links is not None else links_for(host), spool_dir=spool_dir)
    peers = [peer for peer, _ in sources[:MAX_SOURCES]]
    try:
        async with asyncio.timeout(timeout_s):
            return await fetch.run(list(sources[:MAX_SOURCES]))
    except TimeoutError:
        raise StateTransferFailed(_failure_text(stage, peers, fetch.plan,
                                                f"timed out after {timeout_s:.3g} s")) from None


async def ask_digest(host: Any, protocol: str, peer: str, addrs: Sequence[str], *, stage: int,
                     model_hash: str, timeout_s: float,
                     counters: dict[str, int]) -> DigestReply | None:
    """A mate's step and weights digest (``state_digest``, the idle drift check), or None:
    unreachable, refused (no state yet, an older peer), or malformed (``bad_digest_replies``
    counted). Each call within ``timeout_s`` for the dial and again for the request."""
    ask = DigestRequest(stage=stage, model_hash=model_hash)
    try:
        if addrs and not await host.ensure_connected(peer, addrs, timeout=timeout_s):
            return None
        reply = await host.request(peer, protocol, Message(kind="state_digest",
                                                           meta=ask.to_meta()),
                                   timeout=timeout_s, codec=_NONE)
        return parse_digest(peer, reply.kind, reply.meta, reply.tensors)
    except (TransportClosed, LocalUsageError):
        raise
    except BadStateRequest:
        counters["bad_digest_replies"] = counters.get("bad_digest_replies", 0) + 1
        return None
    except (RemoteError, TransportError):
        return None


async def ask_replay(host: Any, protocol: str, peer: str, addrs: Sequence[str], *,
                     request: ReplayRequest, numel: int, timeout_s: float,
                     counters: dict[str, int]) -> ReplayReply | None:
    """The gradients ``peer`` applied from ``request.since`` on (``state_replay``), checked
    (``parse_replay``), or None: unreachable, refused (an older peer), or malformed
    (``bad_replay_replies`` counted). Within ``timeout_s`` for the dial and for the request."""
    try:
        if addrs and not await host.ensure_connected(peer, addrs, timeout=timeout_s):
            return None
        reply = await host.request(peer, protocol, Message(kind="state_replay",
                                                           meta=request.to_meta()),
                                   timeout=timeout_s, codec=_NONE)
        return parse_replay(peer, reply.kind, reply.meta, reply.tensors, asked=request,
                            numel=numel)
    except (TransportClosed, LocalUsageError):
        raise
    except BadStateRequest as exc:
        counters["bad_replay_replies"] = counters.get("bad_replay_replies", 0) + 1
        log.warning("stage %d: a malformed replay reply from %s: %s", request.stage, peer, exc)
        return None
    except (RemoteError, TransportError):
        return None


def _failure_text(stage: int, peers: list[str], plan: Plan | None, why: str) -> str:
    if not peers:
        return f"cannot fetch the state of stage {stage}: no peer of it is known"
    reasons = plan.failures if plan is not None else {}
    tried = "; ".join(f"{p}: {reasons.get(p, 'no answer')}" for p in peers[:8])
    more = f" and {len(peers) - 8} more" if len(peers) > 8 else ""
    return f"cannot fetch the state of stage {stage} ({why}); tried {tried}{more}"


class _Fetch:
    def __init__(self, host: Any, protocol: str, *, stage: int, model_hash: str,
                 max_bytes: int, on_progress: Callable[[int, int], None] | None,
                 parallel: int, request_timeout_s: float, newer_than: int | None,
                 counters: dict[str, int], size_bound: SizeBound | None,
                 links: LinkEstimates, spool_dir: Path | None = None) -> None:
        self.host = host
        self.links = links
        #: this download from its source: when it began, and the bytes received since (the
        #: link's rate is what arrives over time, whatever order the source answers in)
        self.download_t0 = 0.0
        self.download_bytes = 0
        self.protocol = protocol
        self.stage = stage
        self.model_hash = model_hash
        self.max_bytes = max_bytes
        self.on_progress = on_progress
        self.parallel = parallel
        self.request_timeout_s = request_timeout_s
        self.newer_than = newer_than
        self.counters = counters
        self.size_bound = size_bound
        for name in ("chunks", "bytes", "resumed", "restarted", "requeried", "sources_failed",
                     "bad_replies", "non_finite_states"):
            counters.setdefault(name, 0)
        self.plan: Plan | None = None
        #: the verified chunks of the snapshot being downloaded, on disk at their offsets:
        #: the file grows as bytes arrive, never on what a source claims
        self.spool: Spool | None = None
        self.spool_dir = spool_dir
        self.done_bytes = 0

    async def run(self, sources: list[tuple[str, Sequence[str]]]) -> StageState | None:
        try:
            return await self._run(sources)
        finally:
            self._drop_spool()

    def _drop_spool(self) -> None:
        if self.spool is not None:
            self.spool.close()
            self.spool = None

    async def _run(self, sources: list[tuple[str, Sequence[str]]]) -> StageState | None:
        peers = [peer for peer, _ in sources]
        self.plan = plan = Plan([])
        try:
            async with asyncio.TaskGroup() as tg:
                asks = [tg.create_task(self._ask(peer, addrs)) for peer, addrs in sources]
        except BaseExceptionGroup as group:  # our host closed, or our bug
            raise _leaves(group)[0] from None
        for peer, result in zip(peers, (t.result() for t in asks)):
            if isinstance(result, StateInfo):
                plan.candidates.append(result)
            else:
                plan.failures[peer] = result
        plan.candidates.sort(key=lambda i: -i.step)
        if self.newer_than is not None and not plan.candidates:
            return None
        requeries: dict[str, int] = {}
        while (choice := plan.next()) is not None:
            info, how = choice
            if how != "resume":
                self._drop_spool()
                self.spool = await asyncio.to_thread(  # read back a chunk at a time
                    lambda: Spool(info.total_bytes, self.spool_dir, piece=info.chunk_bytes))
                self.done_bytes = 0
            if how in ("resume", "restart"):
                self.counters[{"resume": "resumed", "restart": "restarted"}[how]] += 1
                log.info("stage %d state: %s from %s at step %d (%d of %d bytes kept)",
                         self.stage, how, info.peer, info.step, self.done_bytes,
                         info.total_bytes)
            self._progress(info)
            failure = await self._download(info, plan)
            if failure is None:
                state = await self._finish(info, plan)
                if state is not None:
                    return state
                continue
            self.counters["sources_failed"] += 1
            log.info("stage %d state: source %s failed: %s", self.stage, failure.peer,
                     failure.reason)
            plan.failed(failure.peer, failure.reason)
            if failure.expired and requeries.get(failure.peer, 0) < MAX_REQUERIES:
                requeries[failure.peer] = requeries.get(failure.peer, 0) + 1
                self.counters["requeried"] += 1
                renewed = await self._ask(failure.peer, ())
                if isinstance(renewed, StateInfo):
                    plan.renewed(renewed)
                    plan.failures.pop(failure.peer, None)
                else:
                    plan.failures[failure.peer] = renewed
        raise StateTransferFailed(_failure_text(self.stage, peers, plan, "no source is left"))

    async def _ask(self, peer: str, addrs: Sequence[str]) -> StateInfo | str:
        """A source's offer, or why it has none."""
        try:
            timeout = self.links.deadline(peer, 0, round_trips=2, extra_s=INFO_COMPUTE_S,
                                          cap_s=self.request_timeout_s)
            if addrs and not await self.host.ensure_connected(peer, addrs, timeout=timeout):
                return "unreachable"
            reply = await self.host.request(
                peer, self.protocol, Message(kind="state_info", meta=self._meta()),
                timeout=timeout, codec=_NONE)
            info = parse_info(peer, reply.kind, reply.meta)
        except (TransportClosed, LocalUsageError):
            raise
        except RemoteError as exc:
            return f"refused: {exc.code}: {exc.remote_message[:200]}"
        except BadStateRequest as exc:
            self.counters["bad_replies"] += 1
            return f"{type(exc).__name__}: {exc}"
        except TransportError as exc:
            return f"{type(exc).__name__}: {exc}"
        why = check_offer(info, stage=self.stage, model_hash=self.model_hash,
                          max_bytes=self.max_bytes, bound=self.size_bound,
                          newer_than=self.newer_than)
        if why is not None:
            if not why.startswith("offers step"):
                self.counters["bad_replies"] += 1
            return why
        limit = self.host.options.limits.max_message_bytes
        if info.chunk_bytes > limit:
            return f"chunks of {info.chunk_bytes} bytes exceed our message limit {limit}"
        return info

    def _meta(self, **extra: Any) -> dict[str, Any]:
        return {"stage": self.stage, "model_hash": self.model_hash, **extra}

    def _progress(self, info: StateInfo) -> None:
        if self.on_progress is not None:
            self.on_progress(self.done_bytes, info.total_bytes)

    def _rate_cap(self, info: StateInfo) -> int | None:
        """The rate cap on this download: the source's upload cap or our download cap."""
        ours = getattr(getattr(self.host, "options", None), "download_bytes_s", None)
        caps = [c for c in (info.upload_bytes_s, ours) if isinstance(c, int) and c > 0]
        return min(caps) if caps else None

    def _in_flight(self, info: StateInfo) -> int:
        """Chunks asked of the source at a time (fewer through a rate cap: module doc)."""
        return min(max(1, info.chunks), chunks_in_flight(
            self.parallel, info.chunk_bytes, self._rate_cap(info),
            within_s=self.request_timeout_s, slack=self.links.policy.slack))

    async def _download(self, info: StateInfo, plan: Plan) -> _SourceFailed | None:
        todo = deque(plan.missing())
        self.download_t0, self.download_bytes = time.monotonic(), 0
        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(min(self._in_flight(info), len(todo))):
                    tg.create_task(self._worker(info, plan, todo))
        except BaseExceptionGroup as group:
            errors = _leaves(group)
            others = [e for e in errors if not isinstance(e, _SourceFailed)]
            if others:
                raise others[0]
            return errors[0]  # type: ignore[return-value]
        return None

    async def _worker(self, info: StateInfo, plan: Plan, todo: deque[int]) -> None:
        while todo:
            index = todo.popleft()
            start, end = info.chunk_range(index)
            reply = await self._request_chunk(info, index, end - start)
            try:
                chunk = parse_chunk(reply.kind, reply.meta, reply.tensors, info=info,
                                    index=index)
            except BadStateRequest:
                self.counters["bad_replies"] += 1
                raise _SourceFailed(info.peer, f"malformed reply to chunk {index}") from None
            if plan.current is not info or index in plan.have:
                continue  # superseded meanwhile (cannot happen while this task group runs)
            spool = self.spool
            assert spool is not None
            if not await asyncio.to_thread(self._stored, spool, start, chunk.payload,
                                           chunk.checksum):
                self.counters["bad_replies"] += 1
                raise _SourceFailed(info.peer, f"chunk {index} does not match its checksum")
            plan.have.add(index)
            self.done_bytes += end - start
            self.counters["chunks"] += 1
            self.counters["bytes"] += end - start
            self._progress(info)

    async def _request_chunk(self, info: StateInfo, index: int, nbytes: int) -> Message:
        """Chunk ``index`` of ``info`` by its derived deadline; the link's estimates learn
        from it (the bytes this download received over the time since it began)."""
        # the chunks in flight share the link (and its rate cap): this one may wait on all
        timeout = min(max(self.request_timeout_s, CAPPED_CHUNK_MAX_S), self.links.deadline(
            info.peer, nbytes * self._in_flight(info), cap_s=self.request_timeout_s,
            max_bandwidth=self._rate_cap(info)))
        try:
            reply = await self.host.request(
                info.peer, self.protocol,
                Message(kind="state_chunk", meta=self._meta(digest=info.digest, index=index)),
                timeout=timeout, codec=_NONE)
        except (TransportClosed, LocalUsageError):
            raise
        except RemoteError as exc:
            raise _SourceFailed(info.peer, f"refused chunk {index}: {exc.code}",
                                expired=exc.code == UnknownSnapshot.code) from None
        except (PeerUnavailable, PeerProtocolError) as exc:
            raise _SourceFailed(info.peer, f"{type(exc).__name__}: {exc} (deadline "
                                           f"{timeout:.3g} s)") from None
        now = time.monotonic()
        self.download_bytes += nbytes
        self.links.observe_transfer(info.peer, self.download_bytes, now - self.download_t0, now)
        return reply

    @staticmethod
    def _stored(spool: Spool, offset: int, payload: torch.Tensor, checksum: str) -> bool:
        """Whether a chunk's bytes match their checksum; if so they are written at their
        offset (in a worker thread: both touch megabytes; no copy of the reply is made)."""
        view = byte_view(payload.detach().to("cpu").contiguous())
        if chunk_checksum(view) != checksum:
            return False
        spool.write(offset, view)
        return True

    def _decoded(self, spool: Spool) -> StageState:
        """In a thread: decode and check a downloaded state (BadStageState if unusable)."""
        state = spool.decode(self.max_bytes)
        check_finite_state(state)
        return state

    async def _finish(self, info: StateInfo, plan: Plan) -> StageState | None:
        """Verify and decode the whole download; None (and the snapshot dropped) if bad."""
        spool = self.spool
        if spool is None or sorted(plan.have) != list(range(info.chunks)):
            plan.bad_snapshot(info.digest, "chunks are missing")
            return None
        if await asyncio.to_thread(spool.digest) != info.digest:
            plan.bad_snapshot(info.digest, "its chunks do not add up to its digest")
            return None
        try:
            state = await asyncio.to_thread(self._decoded, spool)
        except NonFiniteState as exc:
            self.counters["non_finite_states"] += 1
            log.warning("stage %d state: refused the snapshot of %s: %s", self.stage,
                        info.peer, exc)
            plan.bad_snapshot(info.digest, f"its snapshot is not finite: {exc}")
            return None
        except BadStageState as exc:
            plan.bad_snapshot(info.digest, f"its snapshot is invalid: {exc}")
            return None
        if state.stage != self.stage or state.model_hash != self.model_hash:
            plan.bad_snapshot(info.digest, "its snapshot is of another stage or model")
            return None
        log.info("stage %d state: step %d, %d bytes from %s", self.stage, state.step,
                 info.total_bytes, info.peer)
        return state


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out
