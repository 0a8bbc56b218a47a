"""The serving side of state transfer (:mod:`swarmd.state.transfer`): snapshots, info, chunks."""

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import torch

from swarmd.errors import BadPeerMessage, ModelMismatch, SwarmdError, WrongStage
from swarmd.state.encoding import NonFiniteState, StageState, check_finite_state, layout
from swarmd.state.layout import Layout
from swarmd.state.messages import (ChunkRequest, DigestReply, DigestRequest, InfoRequest,
                                   ReplayReply, ReplayRequest, parse_request)
from transport.frames import Message
from swarmd.state.transfer import (
    DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, _NONE, BadStateRequest, NoState,
    StateInfo, UnknownSnapshot,
)

log = logging.getLogger("swarmd.state.transfer")

#: bytes a ``state_replay`` reply takes besides its vectors' values, at most
REPLY_OVERHEAD = 64 << 10


def _message_limit(host: Any) -> int | None:
    """The host's largest message, if it says (``transport.limits``)."""
    limit = getattr(getattr(getattr(host, "options", None), "limits", None),
                    "max_message_bytes", None)
    return limit if isinstance(limit, int) and limit > 0 else None


@dataclass(slots=True, eq=False)
class _Cached:
    info: StateInfo
    #: the snapshot's encoding, its bytes read from the snapshot's own tensors per chunk
    layout: Layout
    checksums: list[str]
    created: float
    used: float


class StateServer:
    """Answers ``state_info`` and ``state_chunk`` on ``protocol`` for one stage.

    ``snapshot()`` captures the live state (between optimizer steps: the daemon's business) or
    returns None while this peer has none to give. A snapshot younger than ``fresh_s`` is reused
    for new ``state_info`` requests, unless ``step()`` (the step the live state is at, if given)
    has moved past it: a mate catching up must be offered the step we are at now; at most ``keep`` snapshots are kept, each until unused for
    ``keep_s``. ``clock`` is a parameter for tests. A state holding NaN/Inf is never served
    (``no_state`` to the requester, counted as ``non_finite_snapshots``). ``counters`` (a dict
    to update, e.g. the keeper's) defaults to a new one. ``weights_digest()`` (optional) gives
    (step, round digest) of the live weights for ``state_digest`` (the idle drift check); a
    server without one answers it ``no_state``. ``replay(since, count)`` (optional) gives
    (step, the gradients applied from ``since`` on or None) for ``state_replay``.
    """

    def __init__(self, host: Any, protocol: str,
                 snapshot: Callable[[], Awaitable[StageState | None]], *, stage: int,
                 model_hash: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES, keep: int = 2,
                 keep_s: float = 60.0, fresh_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 counters: dict[str, int] | None = None,
                 step: Callable[[], int] | None = None,
                 weights_digest: Callable[[], Awaitable[tuple[int, str] | None]] | None = None,
                 replay: Callable[[int, int], Awaitable[tuple[int, list[torch.Tensor] | None]]]
                 | None = None) -> None:
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
        self.counters: dict[str, int] = counters if counters is not None else {}
        for name in ("infos", "chunks", "bytes", "snapshots", "errors"):
            self.counters.setdefault(name, 0)
        self._snapshot = snapshot
        self._step = step
        self._weights_digest = weights_digest
        self._replay = replay
        self._clock = clock
        self._cache: dict[str, _Cached] = {}
        self._lock = asyncio.Lock()

    def start(self) -> None:
        # chunks are bytes already: no quantizing or compressing them again
        self.host.set_request_handler(self.protocol, self.serve, codec=_NONE)

    def close(self) -> None:
        self.host.remove_handler(self.protocol)
        self._cache.clear()

    @property
    def cached_bytes(self) -> int:
        return sum(c.layout.total for c in self._cache.values())

    async def serve(self, message: Message, peer: str) -> Message:
        try:
            request = parse_request(message.kind, message.meta, message.tensors)
            self._check(request)
            if isinstance(request, ChunkRequest):
                return self._chunk(request)
            if isinstance(request, DigestRequest):
                return await self._digest()
            if isinstance(request, ReplayRequest):
                return await self._replayed(request)
            return await self._info()
        except BadPeerMessage as exc:
            self._count(f"bad_requests.{exc.reason}")
            self.counters["errors"] += 1
            raise
        except SwarmdError:
            self.counters["errors"] += 1
            raise

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def _check(self, request: InfoRequest) -> None:
        if request.stage != self.stage:
            raise WrongStage(f"this peer serves stage {self.stage}, not {request.stage}: "
                             f"ask another")
        if request.model_hash != self.model_hash:
            raise ModelMismatch(f"this peer trains model {self.model_hash}, the request is for "
                                f"{request.model_hash[:80]}")

    async def _info(self) -> Message:
        self.counters["infos"] += 1
        async with self._lock:
            now = self._clock()
            self._expire(now)
            newest = max(self._cache.values(), key=lambda c: c.created, default=None)
            if newest is None or now - newest.created > self.fresh_s or (
                    self._step is not None and newest.info.step != self._step()):
                newest = await self._freeze()
            newest.used = self._clock()
        return Message(kind="state_info", meta=newest.info.to_meta())

    async def _digest(self) -> Message:
        self._count("digests")
        found = await self._weights_digest() if self._weights_digest is not None else None
        if found is None:
            raise NoState(f"this peer has no weights of stage {self.stage} to compare yet")
        step, digest_ = found
        reply = DigestReply(peer=self.host.peer_id, step=step, digest=digest_)
        return Message(kind="state_digest", meta=reply.to_meta())

    async def _replayed(self, request: ReplayRequest) -> Message:
        """The gradients applied from ``request.since`` on (at most ``request.count``), or
        ``kept: false`` (none kept that far back, or this server keeps none)."""
        self._count("replays")
        if self._replay is None:
            raise NoState(f"this peer keeps no gradients of stage {self.stage} to replay")
        step, vectors = await self._replay(request.since, request.count)
        limit = _message_limit(self.host)
        if vectors and limit is not None:  # as many as one message carries (at least one)
            room = max(0, (limit - REPLY_OVERHEAD) // max(1, vectors[0].numel() * 4))
            vectors = vectors[:room]
        if not vectors:
            self._count("replays_not_kept")
            vectors = None
        reply = ReplayReply(peer=self.host.peer_id, since=request.since, step=step,
                            vectors=tuple(vectors) if vectors else None)
        return Message(kind="state_replay", meta=reply.to_meta(), tensors=reply.vectors or ())

    async def _freeze(self) -> _Cached:
        state = await self._snapshot()
        if state is None or state.stage != self.stage or state.model_hash != self.model_hash:
            raise NoState(f"this peer has no state of stage {self.stage} to give yet: ask another")
        try:
            cached = await asyncio.to_thread(self._encode, state)
        except NonFiniteState as exc:
            log.error("stage %d: not serving this peer's state: %s", self.stage, exc)
            self._count("non_finite_snapshots")
            raise NoState(f"this peer's state of stage {self.stage} is not usable (NaN/Inf): "
                          f"ask another") from None
        self.counters["snapshots"] += 1
        self._cache[cached.info.digest] = cached
        while len(self._cache) > self.keep:
            oldest = min(self._cache.values(), key=lambda c: c.used)
            del self._cache[oldest.info.digest]
        return cached

    def _encode(self, state: StageState) -> _Cached:
        """In a thread: check a snapshot, then its digest and chunk checksums in one pass
        over its encoding, read from its own tensors (no copy of the state is made)."""
        check_finite_state(state)
        encoded = layout(state)
        whole = hashlib.blake2b(digest_size=32)
        sums = []
        chunks = -(-encoded.total // self.chunk_bytes)
        for i in range(chunks):
            start = i * self.chunk_bytes
            one = hashlib.blake2b(digest_size=16)  # transfer.chunk_checksum, piece by piece
            for view in encoded.ranges(start, min(start + self.chunk_bytes, encoded.total)):
                one.update(view)
                whole.update(view)
            sums.append(one.hexdigest())
        info = StateInfo(peer=self.host.peer_id, stage=state.stage, step=state.step,
                         model_hash=state.model_hash, digest=whole.hexdigest(),
                         total_bytes=encoded.total, chunk_bytes=self.chunk_bytes,
                         upload_bytes_s=getattr(getattr(self.host, "options", None),
                                                "upload_bytes_s", None))
        now = self._clock()
        return _Cached(info=info, layout=encoded, checksums=sums, created=now, used=now)

    def _chunk(self, request: ChunkRequest) -> Message:
        key, index = request.digest, request.index
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
        piece = torch.frombuffer(cached.layout.read(start, end), dtype=torch.uint8)
        return Message(kind="state_chunk", meta={"digest": key, "index": index,
                                                 "checksum": cached.checksums[index]},
                       tensors=(piece,))

    def _expire(self, now: float) -> None:
        for key in [k for k, c in self._cache.items() if now - c.used > self.keep_s]:
            del self._cache[key]
