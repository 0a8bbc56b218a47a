"""The serving side of state transfer (:mod:`swarmd.state.transfer`): snapshots, info, chunks."""

import asyncio
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

import torch

from swarmd.errors import ModelMismatch, SwarmdError, WrongStage
from swarmd.state.encoding import StageState, digest, encode
from transport.frames import Message
from swarmd.state.transfer import (
    DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, _NONE, BadStateRequest, NoState,
    StateInfo, UnknownSnapshot, chunk_checksum,
)

log = logging.getLogger("swarmd.state.transfer")


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
