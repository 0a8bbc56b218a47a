"""Errors of the transport, typed by who is at fault.

- ``PeerProtocolError``: the remote peer sent something it must not (malformed frame, size over
  a limit, unknown codec or kind, truncated message). The stream is reset and the peer may be
  penalised; nothing on our side is wrong.
- ``PeerUnavailable``: the peer could not be reached or went away (dial failure, reset, deadline).
- ``TransportClosed``: the local host is shutting down or was never started.
- ``LocalUsageError``: our own caller passed something invalid (a bug on this side).
- ``IdentityError``: the local identity key file is missing, unreadable, corrupt or too widely
  readable; the operator must act (the message says what to do).
"""

from __future__ import annotations


class TransportError(Exception):
    """Base of every error raised by ``transport``."""

    #: short machine-readable code, sent to peers in error replies and used as a counter label
    code = "transport_error"


class PeerProtocolError(TransportError):
    """The remote peer violated the wire protocol."""

    code = "protocol_violation"


class MalformedFrame(PeerProtocolError):
    code = "malformed_frame"


class LimitExceeded(PeerProtocolError):
    """A size announced by the peer is above a configured limit; refused before allocating."""

    code = "limit_exceeded"


class TruncatedMessage(PeerProtocolError):
    """The stream ended (EOF or reset) in the middle of a frame."""

    code = "truncated"


class UnknownCodec(PeerProtocolError):
    code = "unknown_codec"


class UnknownKind(PeerProtocolError):
    code = "unknown_kind"


class CodecError(PeerProtocolError):
    """Payload does not match the tensor metadata (size, dtype, codec parameters)."""

    code = "codec_error"


class PeerUnavailable(TransportError):
    """The peer cannot be reached, reset the stream, or missed a deadline."""

    code = "peer_unavailable"


class DeadlineExceeded(PeerUnavailable):
    code = "deadline"


class TransportClosed(TransportError):
    code = "closed"


class LocalUsageError(TransportError):
    """Our own caller passed something invalid: a bug on this side, not the peer's."""

    code = "local_usage"


class RemoteError(TransportError):
    """The remote peer answered with an error reply; ``code`` and ``message`` are theirs."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"peer replied with error {code}: {message}")
        self.code = code
        self.remote_message = message


class IdentityError(TransportError):
    """The local identity key file cannot be used; the message names the file and the fix."""

    code = "identity"


class HandlerFailure(TransportError):
    """Our own handler failed; what the peer is told (``code``: ours, e.g. internal_error)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def cause_of(exc: BaseException) -> str:
    """The messages of a (libp2p) exception chain, innermost last, for error messages."""
    parts: list[str] = []
    while exc is not None and len(parts) < 4:
        text = str(exc) or type(exc).__name__
        if text not in parts:
            parts.append(text)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return ": ".join(parts)
