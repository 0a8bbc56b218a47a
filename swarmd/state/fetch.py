"""The fetching side of state transfer (:mod:`swarmd.state.transfer`): download, resume, verify."""

import asyncio
import logging
from collections import deque
from typing import Any, Callable, Sequence

import torch

from swarmd.state.encoding import BadStageState, StageState, decode, digest
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
    MAX_REQUERIES, MAX_SOURCES, _HEX32, _NONE, BadStateRequest, Plan, StateInfo,
    StateTransferFailed, UnknownSnapshot, chunk_checksum,
)

log = logging.getLogger("swarmd.state.transfer")


class _SourceFailed(Exception):
    def __init__(self, peer: str, reason: str, *, expired: bool = False) -> None:
        super().__init__(reason)
        self.peer = peer
        self.reason = reason
        self.expired = expired


async def fetch_state(host: Any, protocol: str, sources: Sequence[tuple[str, Sequence[str]]], *,
                      stage: int, model_hash: str, timeout_s: float, max_bytes: int,
                      on_progress: Callable[[int, int], None] | None = None,
                      parallel: int = 4, request_timeout_s: float = 15.0,
                      newer_than: int | None = None,
                      counters: dict[str, int] | None = None) -> StageState | None:
    """Download the state of ``stage`` from the best of ``sources`` ((peer id, multiaddrs)).

    ``on_progress(done_bytes, total_bytes)`` is called after every chunk (and with 0 when a
    download starts or starts over). ``counters`` (if given) is updated: chunks, bytes, resumed,
    restarted, requeried, sources_failed. Raises ``StateTransferFailed`` when no source works
    within ``timeout_s``; ``TransportClosed`` if our own host closes meanwhile.

    With ``newer_than`` (the step of a local checkpoint), offers at or below that step are
    ignored, and None is returned when no source answers with a newer one: keep the local state.
    Without it the result is never None.
    """
    fetch = _Fetch(host, protocol, stage=stage, model_hash=model_hash, max_bytes=max_bytes,
                   on_progress=on_progress, parallel=max(1, parallel),
                   request_timeout_s=request_timeout_s, newer_than=newer_than,
                   counters=counters if counters is not None else {})
    peers = [peer for peer, _ in sources[:MAX_SOURCES]]
    try:
        async with asyncio.timeout(timeout_s):
            return await fetch.run(list(sources[:MAX_SOURCES]))
    except TimeoutError:
        raise StateTransferFailed(_failure_text(stage, peers, fetch.plan,
                                                f"timed out after {timeout_s:.3g} s")) from None


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
                 counters: dict[str, int]) -> None:
        self.host = host
        self.protocol = protocol
        self.stage = stage
        self.model_hash = model_hash
        self.max_bytes = max_bytes
        self.on_progress = on_progress
        self.parallel = parallel
        self.request_timeout_s = request_timeout_s
        self.newer_than = newer_than
        self.counters = counters
        for name in ("chunks", "bytes", "resumed", "restarted", "requeried", "sources_failed"):
            counters.setdefault(name, 0)
        self.plan: Plan | None = None
        self.buffer = bytearray()
        self.done_bytes = 0

    async def run(self, sources: list[tuple[str, Sequence[str]]]) -> StageState | None:
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
            if how != "resume" or len(self.buffer) != info.total_bytes:
                self.buffer = bytearray(info.total_bytes)
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
            if addrs and not await self.host.ensure_connected(
                    peer, addrs, timeout=self.request_timeout_s):
                return "unreachable"
            reply = await self.host.request(
                peer, self.protocol, Message(kind="state_info", meta=self._meta()),
                timeout=self.request_timeout_s, codec=_NONE)
            if reply.kind != "state_info":
                return f"answered state_info with {reply.kind[:40]!r}"
            info = StateInfo.from_meta(peer, reply.meta)
        except (TransportClosed, LocalUsageError):
            raise
        except RemoteError as exc:
            return f"refused: {exc.code}: {exc.remote_message[:200]}"
        except (TransportError, BadStateRequest) as exc:
            return f"{type(exc).__name__}: {exc}"
        if info.stage != self.stage or info.model_hash != self.model_hash:
            return f"offers stage {info.stage} of model {info.model_hash[:16]}"
        if self.newer_than is not None and info.step <= self.newer_than:
            return f"offers step {info.step}, not newer than our {self.newer_than}"
        if info.total_bytes > self.max_bytes:
            return f"offers {info.total_bytes} bytes, more than the limit of {self.max_bytes}"
        limit = self.host.options.limits.max_message_bytes
        if info.chunk_bytes > limit:
            return f"chunks of {info.chunk_bytes} bytes exceed our message limit {limit}"
        return info

    def _meta(self, **extra: Any) -> dict[str, Any]:
        return {"stage": self.stage, "model_hash": self.model_hash, **extra}

    def _progress(self, info: StateInfo) -> None:
        if self.on_progress is not None:
            self.on_progress(self.done_bytes, info.total_bytes)

    async def _download(self, info: StateInfo, plan: Plan) -> _SourceFailed | None:
        todo = deque(plan.missing())
        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(min(self.parallel, len(todo))):
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
            try:
                reply = await self.host.request(
                    info.peer, self.protocol,
                    Message(kind="state_chunk", meta=self._meta(digest=info.digest, index=index)),
                    timeout=self.request_timeout_s, codec=_NONE)
            except (TransportClosed, LocalUsageError):
                raise
            except RemoteError as exc:
                raise _SourceFailed(info.peer, f"refused chunk {index}: {exc.code}",
                                    expired=exc.code == UnknownSnapshot.code) from None
            except (PeerUnavailable, PeerProtocolError) as exc:
                raise _SourceFailed(info.peer, f"{type(exc).__name__}: {exc}") from None
            start, end = info.chunk_range(index)
            payload, checksum = self._chunk_of(reply, info, index, end - start)
            ok = await asyncio.to_thread(self._store, self.buffer, start, payload, checksum)
            if not ok:
                raise _SourceFailed(info.peer, f"chunk {index} does not match its checksum")
            if plan.current is not info or index in plan.have:
                continue  # superseded meanwhile (cannot happen while this task group runs)
            plan.have.add(index)
            self.done_bytes += end - start
            self.counters["chunks"] += 1
            self.counters["bytes"] += end - start
            self._progress(info)

    @staticmethod
    def _chunk_of(reply: Message, info: StateInfo, index: int,
                  size: int) -> tuple[torch.Tensor, str]:
        meta = reply.meta
        ok = (reply.kind == "state_chunk" and meta.get("digest") == info.digest
              and meta.get("index") == index and len(reply.tensors) == 1
              and isinstance(meta.get("checksum"), str) and _HEX32.fullmatch(meta["checksum"]))
        tensor = reply.tensors[0] if ok else None
        if tensor is None or tensor.dtype != torch.uint8 or tuple(tensor.shape) != (size,):
            raise _SourceFailed(info.peer, f"malformed reply to chunk {index}")
        return tensor, meta["checksum"]

    @staticmethod
    def _store(buffer: bytearray, start: int, payload: torch.Tensor, checksum: str) -> bool:
        """Copy a chunk into place and check it (in a worker thread: both touch megabytes)."""
        end = start + payload.numel()
        torch.frombuffer(buffer, dtype=torch.uint8)[start:end].copy_(payload)
        return chunk_checksum(memoryview(buffer)[start:end]) == checksum

    async def _finish(self, info: StateInfo, plan: Plan) -> StageState | None:
        """Verify and decode the whole download; None (and the snapshot dropped) if bad."""
        data = self.buffer
        if await asyncio.to_thread(digest, data) != info.digest:
            plan.bad_snapshot(info.digest, "its chunks do not add up to its digest")
            return None
        try:
            state = await asyncio.to_thread(decode, data, max_bytes=self.max_bytes)
        except BadStageState as exc:
            plan.bad_snapshot(info.digest, f"its snapshot is invalid: {exc}")
            return None
        if state.stage != self.stage or state.model_hash != self.model_hash:
            plan.bad_snapshot(info.digest, "its snapshot is of another stage or model")
            return None
        self.buffer = bytearray()
        log.info("stage %d state: step %d, %d bytes from %s", self.stage, state.step,
                 info.total_bytes, info.peer)
        return state


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out
