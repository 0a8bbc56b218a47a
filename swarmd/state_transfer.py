"""State transfer between peers of a stage, over one libp2p request protocol.

A peer joining a stage (new, restarted or migrating) downloads the stage's state from a live
peer of it before announcing itself. The server side (:class:`StateServer`) freezes a snapshot
on request, encodes it once and keeps the last few by digest for a while, so a download can
proceed chunk by chunk and resume. Requests (``meta`` always carries ``stage`` and
``model_hash``)::

    state_info  {}                     -> state_info  {stage, step, digest, total_bytes,
                                                       chunk_bytes, chunks, model_hash}
    state_chunk {digest, index}        -> state_chunk {digest, index, checksum} + uint8 tensor

Errors are typed replies: ``wrong_stage``, ``model_hash_mismatch``, ``no_state`` (the peer has
nothing to give yet), ``unknown_snapshot`` (that digest is no longer kept: ask ``state_info``
again), ``bad_state_request``.

The client side (:func:`fetch_state`) asks every source for ``state_info``, downloads the
highest step a few chunks at a time, checks each chunk's checksum and the whole digest, and when
its source fails continues from another source with the same digest (``resumed``) or starts over
with the best other snapshot (``restarted``). Which source comes next is decided by the pure
:class:`Plan`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Sequence

import torch

from swarmd.errors import BadPeerMessage, ModelMismatch, SwarmdError, WrongStage
from swarmd.stage_state import BadStageState, StageState, decode, digest, encode
from transport.codecs import CodecSpec
from transport.errors import (
    LocalUsageError,
    PeerProtocolError,
    PeerUnavailable,
    RemoteError,
    TransportClosed,
    TransportError,
)
from transport.frames import Message

log = logging.getLogger("swarmd.state_transfer")

__all__ = ["StateServer", "StateInfo", "Plan", "fetch_state", "StateTransferFailed",
           "UnknownSnapshot", "NoState", "BadStateRequest", "DEFAULT_CHUNK_BYTES"]

MiB = 1 << 20
DEFAULT_CHUNK_BYTES = 4 * MiB
MIN_CHUNK_BYTES = 1024
MAX_CHUNK_BYTES = 16 * MiB
#: sources asked at most, and times one source is asked again after its snapshot expired
MAX_SOURCES = 16
MAX_REQUERIES = 2
_NONE = CodecSpec(name="none")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")


class StateTransferFailed(SwarmdError):
    """No source could give the stage's state; the message names the stage and the peers."""

    code = "state_transfer_failed"


class UnknownSnapshot(SwarmdError):
    """A chunk of a snapshot this peer no longer keeps: ask ``state_info`` again."""

    code = "unknown_snapshot"


class NoState(SwarmdError):
    """This peer has no state of the stage to give (it is joining or changing stage itself)."""

    code = "no_state"


class BadStateRequest(BadPeerMessage):
    """A state request or reply that is malformed or out of range: the sender is at fault."""

    code = "bad_state_request"


def chunk_checksum(data: bytes | bytearray | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class StateInfo:
    """What a source offers: one frozen snapshot. Validated when built."""

    peer: str
    stage: int
    step: int
    model_hash: str
    digest: str
    total_bytes: int
    chunk_bytes: int

    def __post_init__(self) -> None:
        for name in ("stage", "step", "total_bytes", "chunk_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BadStateRequest("info", f"{name} must be a non-negative integer")
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise BadStateRequest("info", f"chunk size {self.chunk_bytes} outside "
                                          f"{MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}")
        if not isinstance(self.digest, str) or not _HEX64.fullmatch(self.digest):
            raise BadStateRequest("info", "digest must be 64 lowercase hex digits")
        if not isinstance(self.model_hash, str) or not self.model_hash:
            raise BadStateRequest("info", "model_hash must be a non-empty string")

    @property
    def chunks(self) -> int:
        return -(-self.total_bytes // self.chunk_bytes)

    def chunk_range(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)

    def to_meta(self) -> dict[str, Any]:
        return {"stage": self.stage, "step": self.step, "model_hash": self.model_hash,
                "digest": self.digest, "total_bytes": self.total_bytes,
                "chunk_bytes": self.chunk_bytes, "chunks": self.chunks}

    @classmethod
    def from_meta(cls, peer: str, meta: Mapping[str, Any]) -> StateInfo:
        try:
            info = cls(peer=peer, **{k: meta.get(k) for k in (
                "stage", "step", "model_hash", "digest", "total_bytes", "chunk_bytes")})
        except TypeError as exc:
            raise BadStateRequest("info", str(exc)) from None
        if meta.get("chunks") != info.chunks:
            raise BadStateRequest("info", f"{meta.get('chunks')!r} chunks announced, "
                                          f"{info.chunks} implied")
        return info


# ---- server -------------------------------------------------------------------------------

@dataclass(slots=True, eq=False)
class _Cached:
    info: StateInfo
    data: bytes
    whole: torch.Tensor  # uint8 view of data, sliced per chunk (never written)
    checksums: list[str]
    created: float
    used: float


class StateServer:
    """Answers ``state_info`` and ``state_chunk`` on ``protocol`` for one stage.

    ``snapshot()`` captures the live state (between optimizer steps: the daemon's business) or
    returns None while this peer has none to give. A snapshot younger than ``fresh_s`` is reused
    for new ``state_info`` requests; at most ``keep`` snapshots are kept, each until unused for
    ``keep_s``. ``clock`` is a parameter for tests.
    """

    def __init__(self, host: Any, protocol: str,
                 snapshot: Callable[[], Awaitable[StageState | None]], *, stage: int,
                 model_hash: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES, keep: int = 2,
                 keep_s: float = 60.0, fresh_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES or keep < 1 or keep_s <= 0:
            raise ValueError(f"StateServer needs chunk_bytes in {MIN_CHUNK_BYTES}.."
                             f"{MAX_CHUNK_BYTES}, keep >= 1 and keep_s > 0")
        self.host = host
        self.protocol = protocol
        self.stage = stage
        self.model_hash = model_hash
        self.chunk_bytes = chunk_bytes
        self.keep = keep
        self.keep_s = keep_s
        self.fresh_s = fresh_s
        self.counters: dict[str, int] = {"infos": 0, "chunks": 0, "bytes": 0, "snapshots": 0,
                                         "errors": 0}
        self._snapshot = snapshot
        self._clock = clock
        self._cache: dict[str, _Cached] = {}
        self._lock = asyncio.Lock()

    def start(self) -> None:
        # chunks are bytes already: no quantizing or compressing them again
        self.host.set_request_handler(self.protocol, self.serve, codec=_NONE)

    def close(self) -> None:
        self.host.remove_handler(self.protocol)
        self._cache.clear()

    def set_stage(self, stage: int) -> None:
        """Serve another stage from now on (after a migration); cached snapshots are dropped."""
        self.stage = stage
        self._cache.clear()

    @property
    def cached_bytes(self) -> int:
        return sum(len(c.data) for c in self._cache.values())

    async def serve(self, message: Message, peer: str) -> Message:
        try:
            meta = self._check(message)
            if message.kind == "state_info":
                return await self._info()
            return self._chunk(meta)
        except SwarmdError:
            self.counters["errors"] += 1
            raise

    def _check(self, message: Message) -> Mapping[str, Any]:
        if message.kind not in ("state_info", "state_chunk"):
            raise BadStateRequest("kind", f"unknown request kind {message.kind[:64]!r}")
        meta = message.meta
        stage = meta.get("stage")
        if not isinstance(stage, int) or isinstance(stage, bool):
            raise BadStateRequest("stage", "the request names no stage")
        if stage != self.stage:
            raise WrongStage(f"this peer serves stage {self.stage}, not {stage}: ask another")
        if meta.get("model_hash") != self.model_hash:
            raise ModelMismatch(f"this peer trains model {self.model_hash}, the request is for "
                                f"{str(meta.get('model_hash'))[:80]}")
        return meta

    async def _info(self) -> Message:
        self.counters["infos"] += 1
        async with self._lock:
            now = self._clock()
            self._expire(now)
            newest = max(self._cache.values(), key=lambda c: c.created, default=None)
            if newest is None or now - newest.created > self.fresh_s:
                newest = await self._freeze()
            newest.used = self._clock()
        return Message(kind="state_info", meta=newest.info.to_meta())

    async def _freeze(self) -> _Cached:
        state = await self._snapshot()
        if state is None or state.stage != self.stage or state.model_hash != self.model_hash:
            raise NoState(f"this peer has no state of stage {self.stage} to give yet: ask another")
        cached = await asyncio.to_thread(self._encode, state)
        self.counters["snapshots"] += 1
        self._cache[cached.info.digest] = cached
        while len(self._cache) > self.keep:
            oldest = min(self._cache.values(), key=lambda c: c.used)
            del self._cache[oldest.info.digest]
        return cached

    def _encode(self, state: StageState) -> _Cached:
        data = encode(state)
        info = StateInfo(peer=self.host.peer_id, stage=state.stage, step=state.step,
                         model_hash=state.model_hash, digest=digest(data),
                         total_bytes=len(data), chunk_bytes=self.chunk_bytes)
        with warnings.catch_warnings():  # read-only bytes: the tensor is only ever read
            warnings.simplefilter("ignore", UserWarning)
            whole = torch.frombuffer(data, dtype=torch.uint8)
        view = memoryview(data)
        sums = [chunk_checksum(view[slice(*info.chunk_range(i))]) for i in range(info.chunks)]
        now = self._clock()
        return _Cached(info=info, data=data, whole=whole, checksums=sums, created=now, used=now)

    def _chunk(self, meta: Mapping[str, Any]) -> Message:
        key, index = meta.get("digest"), meta.get("index")
        if not isinstance(key, str) or not isinstance(index, int) or isinstance(index, bool):
            raise BadStateRequest("chunk", "a chunk request needs a digest and an integer index")
        now = self._clock()
        self._expire(now)
        cached = self._cache.get(key)
        if cached is None:
            raise UnknownSnapshot(f"snapshot {key[:16]} of stage {self.stage} is no longer kept "
                                  f"here: ask state_info again")
        if not 0 <= index < cached.info.chunks:
            raise BadStateRequest("index", f"chunk {index} of a snapshot of "
                                           f"{cached.info.chunks} chunks")
        cached.used = now
        start, end = cached.info.chunk_range(index)
        self.counters["chunks"] += 1
        self.counters["bytes"] += end - start
        return Message(kind="state_chunk", meta={"digest": key, "index": index,
                                                 "checksum": cached.checksums[index]},
                       tensors=(cached.whole[start:end],))

    def _expire(self, now: float) -> None:
        for key in [k for k, c in self._cache.items() if now - c.used > self.keep_s]:
            del self._cache[key]


# ---- client: which source next (pure) -------------------------------------------------------

@dataclass(slots=True)
class Plan:
    """The sources left, best first (highest step; ties keep the given order), and what is
    downloaded so far. No I/O: the client reports events, the plan says what to do next."""

    candidates: list[StateInfo]
    #: the snapshot being downloaded and the chunk indices already verified
    current: StateInfo | None = None
    have: set[int] = field(default_factory=set)
    failures: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.candidates = sorted(self.candidates, key=lambda i: -i.step)

    def next(self) -> tuple[StateInfo, str] | None:
        """The source to download from and how: ``"start"``, ``"resume"`` (same digest: keep
        the chunks we have) or ``"restart"`` (another snapshot: drop them). None: none left."""
        if not self.candidates:
            return None
        if self.current is not None:
            for info in self.candidates:
                if info.digest == self.current.digest:
                    self.current = info
                    return info, "resume"
        how = "start" if self.current is None else "restart"
        self.current, self.have = self.candidates[0], set()
        return self.current, how

    def failed(self, peer: str, reason: str) -> None:
        self.candidates = [i for i in self.candidates if i.peer != peer]
        self.failures[peer] = reason

    def renewed(self, info: StateInfo) -> None:
        """A source offers a new snapshot (its old one expired): it competes again."""
        self.candidates = sorted([i for i in self.candidates if i.peer != info.peer] + [info],
                                 key=lambda i: -i.step)

    def bad_snapshot(self, key: str, reason: str) -> None:
        """A whole snapshot is unusable: every source offering it is dropped, and so is what
        was downloaded of it."""
        for info in [i for i in self.candidates if i.digest == key]:
            self.failed(info.peer, reason)
        if self.current is not None and self.current.digest == key:
            self.have = set()

    def missing(self) -> list[int]:
        assert self.current is not None
        return [i for i in range(self.current.chunks) if i not in self.have]


# ---- client: the I/O --------------------------------------------------------------------------

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
