"""Throughput settings for py-libp2p 0.8.1's yamux, applied process-wide by ``Host``.

Measured on these machines (profile of a Noise + yamux bulk transfer, see CHANGELOG): the cost is
Python and trio overhead per yamux frame and per window update, not crypto or window size.

- Frame size. yamux writes frames of at most ``MAX_MESSAGE_SIZE`` (64 KiB) including its 12-byte
  header, and Noise carries at most 65519 plaintext bytes a message, so every full frame became
  two Noise messages. Larger frames (1 MiB) cut per-byte overhead roughly in half. Only the
  sender's setting matters; py-libp2p receivers accept DATA frames up to 16 MiB, and no frame
  ever exceeds the receiver's announced window, so flow control is unchanged.
- Window updates. By default a receiver sends a WINDOW_UPDATE after every read; batching them
  (go-yamux's behaviour: once half the window is consumed) saves ~20% of receiver CPU. The
  library only offers this through an environment variable read on every call; we replace that
  one predicate instead of mutating ``os.environ``.

Both are module-level in py-libp2p, hence process-wide: the last ``Host`` started wins.
"""

from __future__ import annotations

import logging

log = logging.getLogger("transport.libp2p_tuning")

#: yamux's frame header
YAMUX_HEADER_BYTES = 12
#: the library's own frame size, for reference and for ``frame_bytes=None``
LIBRARY_FRAME_BYTES = 64 * 1024


def apply(frame_bytes: int | None, batch_window_updates: bool) -> int:
    """Set the yamux frame size (None: library default) and window-update batching.

    Returns the payload bytes per full frame, so writers can size their chunks to whole frames
    (a write of 65536 bytes with 64 KiB frames makes a 12-byte runt frame and doubles the cost).
    """
    from libp2p.stream_muxer.yamux import yamux

    size = frame_bytes or LIBRARY_FRAME_BYTES
    if not hasattr(yamux, "MAX_MESSAGE_SIZE") or not hasattr(yamux, "_yamux_release_on_read"):
        log.warning("py-libp2p's yamux changed: throughput tuning skipped (expected 0.8.1)")
        return LIBRARY_FRAME_BYTES - YAMUX_HEADER_BYTES
    yamux.MAX_MESSAGE_SIZE = size
    if batch_window_updates:
        yamux._yamux_release_on_read = _never
    return size - YAMUX_HEADER_BYTES


def _never() -> bool:
    return False
