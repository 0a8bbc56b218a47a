"""From configuration to the transport: ``[network]``, ``[wire]`` and the rate caps of ``[limits]``
become ``HostOptions``.

Kept apart from ``swarmd.config`` so that loading configuration (``swarmd --help``, ``swarmd id``)
never imports torch or trio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from swarmd.config import Config

if TYPE_CHECKING:
    from transport.codecs import CodecSpec
    from transport.host import HostOptions


def codec_spec(config: Config) -> CodecSpec:
    """The tensor codec that ``[wire]`` selects, with its parameters."""
    from transport.codecs import CodecSpec

    w = config.wire
    return CodecSpec.parse(w.codec, block_size=w.int8_block_size,
                           scale_dtype=w.int8_scale_dtype, zstd_level=w.zstd_level)


def host_options(config: Config, listen: Sequence[str] | None = None) -> HostOptions:
    """Transport options from ``config``; ``listen`` overrides ``network.listen``."""
    from transport.host import HostOptions

    n = config.network
    return HostOptions(
        listen=tuple(listen) if listen else tuple(n.listen),
        max_connections=n.max_connections,
        handshake_timeout_s=n.handshake_timeout_s,
        dial_timeout_s=n.dial_timeout_s,
        request_timeout_s=n.request_timeout_s,
        limits=config.wire_limits(),
        codec=codec_spec(config),
        relay=relay_options(config),
        upload_bytes_s=config.limits.upload,
        download_bytes_s=config.limits.download,
    )


def relay_options(config: Config) -> Any:
    """``[network] relay*`` as the transport's ``RelayOptions`` (None: relays off)."""
    from transport.options import RelayOptions
    from transport.relay.policy import RelayLimits

    n = config.network
    if n.relay == "off":
        return None
    return RelayOptions(serve=n.relay == "on", hole_punch=n.hole_punch, limits=RelayLimits(
        max_reservations=n.relay_max_reservations, max_circuits=n.relay_max_circuits,
        max_circuit_bytes=n.relay_max_circuit_bytes,
        max_circuit_duration_s=max(1.0, n.relay_max_circuit_s)))
