"""The host's upload and download caps: one token bucket each, shared by every framed stream.

Waits happen on the trio side, inside the one bridge crossing of a whole message
(``Stream._t_write`` / ``Stream._t_read_into``): a writer takes tokens for each piece before
writing it; a reader takes tokens for what it just read before reading more, so a peer sending
to us is slowed by yamux flow control (its window is not given back while we wait). The
buckets are touched only in the trio thread; ``status()`` may be read from anywhere.

What the caps cover: every message on a ``Stream`` (requests, replies, pipeline activations,
state transfer, all-reduce parts). Not covered: gossipsub, identify/ping and relayed circuits
served for other peers (small, or bounded by ``[network] relay_*``).
"""

from __future__ import annotations

import time
from typing import Any

import trio

from transport.counters import Counters
from transport.ratelimit import TokenBucket

__all__ = ["Throttle"]


class Throttle:
    """``upload`` and ``download`` buckets (None: that direction is unlimited)."""

    def __init__(self, upload_bytes_s: int | None, download_bytes_s: int | None,
                 burst: int | None, counters: Counters) -> None:
        self.upload = TokenBucket(upload_bytes_s, burst) if upload_bytes_s else None
        self.download = TokenBucket(download_bytes_s, burst) if download_bytes_s else None
        self._counters = counters

    def write_piece(self, chunk: int) -> int:
        """How much to write at once: at most one burst while capped, so a capped sender sends
        steadily rather than a whole chunk after a long wait."""
        if self.upload is None:
            return chunk
        return max(1, min(chunk, self.upload.burst))

    async def t_before_write(self, n: int) -> None:
        """Trio side: wait until ``n`` more bytes may be written."""
        if self.upload is not None:
            await self._wait(self.upload, n, "upload")

    async def t_after_read(self, n: int) -> None:
        """Trio side: account ``n`` bytes just read; wait before the next read if over."""
        if self.download is not None:
            await self._wait(self.download, n, "download")

    async def _wait(self, bucket: TokenBucket, n: int, direction: str) -> None:
        wait = bucket.take(n, time.monotonic())
        if wait > 0:
            self._counters.add(f"ratelimit.{direction}_throttled_bytes", n)
            self._counters.add(f"ratelimit.{direction}_wait_ms", round(wait * 1000))
            await trio.sleep(wait)

    def upload_wait(self, n: int, now: float | None = None) -> float | None:
        """How long a write of ``n`` more bytes would wait in the upload bucket at ``now``
        (the debt of what others reserved before it; takes nothing); None: upload uncapped.
        Read from the asyncio side too: the bucket's floats are read, never written, so the
        worst a concurrent take does is make this a moment stale."""
        bucket = self.upload
        if bucket is None:
            return None
        tokens = bucket.available(time.monotonic() if now is None else now)
        return max(0.0, (n - tokens) / bucket.rate)

    def status(self) -> dict[str, Any]:
        """The caps and what they did: per direction, the cap (None: off), bytes through the
        bucket, bytes that had to wait and the seconds waited (summed over callers)."""
        return {direction: _bucket_status(bucket)
                for direction, bucket in (("upload", self.upload), ("download", self.download))}


def _bucket_status(bucket: TokenBucket | None) -> dict[str, Any]:
    if bucket is None:
        return {"bytes_s": None}
    return {"bytes_s": int(bucket.rate), "burst_bytes": bucket.burst,
            "bytes": bucket.granted_bytes, "throttled_bytes": bucket.throttled_bytes,
            "waited_s": round(bucket.waited_s, 3),
            "span_s": round((bucket.paid_until or 0.0) - (bucket.started_at or 0.0), 3)}
