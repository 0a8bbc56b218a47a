"""From configuration to the transport: ``[network]``, ``[wire]`` and the rate caps of ``[limits]``
become ``HostOptions``.

Kept apart from ``swarmd.config`` so that loading configuration (``swarmd --help``, ``swarmd id``)
never imports torch or trio.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

from swarmd.config import Config

if TYPE_CHECKING:
    from transport.codecs import CodecSpec
    from transport.host import HostOptions

log = logging.getLogger("swarmd.node.limits")

#: the pipeline messages that carry gradients (swarmd.pipeline.messages)
GRADIENT_KINDS = ("backward", "grad")


#: int2's block when it is centred and ``wire.lowbit_block_size`` is 0: the channel means cost
#: 2 / tokens bytes a value and the steps 2 / block, so blocks of 512 keep a message of 512
#: tokens at a quarter of int8's bytes, as plain int2's 256 do
CENTRED_INT2_BLOCK = 512


def lowbit_block_size(config: Config) -> int | None:
    """The int4/int2 block size ``[wire]`` selects; None: the codec's own."""
    w = config.wire
    if w.lowbit_block_size:
        return w.lowbit_block_size
    if w.lowbit_center and w.codec.split("+")[0] == "int2":
        return CENTRED_INT2_BLOCK
    return None


def codec_spec(config: Config) -> CodecSpec:
    """The tensor codec that ``[wire]`` selects, with its parameters."""
    from transport.codecs import CodecSpec

    w = config.wire
    if w.codec.split("+")[0] in ("int4", "int2"):
        gradients = w.lowbit_rounding == "gradients"
        return CodecSpec.parse(
            w.codec, block_size=lowbit_block_size(config), center=w.lowbit_center,
            rounding="nearest" if gradients else w.lowbit_rounding, zstd_level=w.zstd_level,
            kind_rounding=tuple((kind, "stochastic") for kind in GRADIENT_KINDS) if gradients
            else (), uncentred_kinds=GRADIENT_KINDS,
            zstd_kinds=GRADIENT_KINDS if w.lowbit_zstd == "gradients" else ())
    return CodecSpec.parse(w.codec, block_size=w.int8_block_size,
                           scale_dtype=w.int8_scale_dtype, zstd_level=w.zstd_level)


def host_options(config: Config, listen: Sequence[str] | None = None) -> HostOptions:
    """Transport options from ``config``; ``listen`` overrides ``network.listen``."""
    from transport.host import HostOptions
    from transport.liveness import Liveness

    n = config.network
    return HostOptions(
        liveness=Liveness(dead_after_s=n.tcp_user_timeout_s),
        pings=ping_policy(config),
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


def ping_policy(config: Config) -> Any:
    """``network.liveness_*`` as the transport's ``PingPolicy`` (None: off). Pings go out
    every few seconds of the silence, each given as long to be answered."""
    from transport.liveness_policy import PingPolicy

    n = config.network
    if not n.liveness_dead_after_s:
        return None
    every = min(5.0, (n.liveness_dead_after_s - n.liveness_ping_after_s) / 2)
    return PingPolicy(ping_after_s=n.liveness_ping_after_s, ping_every_s=every,
                      answer_wait_s=every, dead_after_s=n.liveness_dead_after_s, max_pings=3)


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


# ---- [limits] on a running daemon ------------------------------------------------------------

def upload_bytes_per_sample(config: Config, seam: Any) -> float:
    """What one sample costs a stage peer's upload with this configuration's wire codec."""
    from swarmd.node.caps import upload_bytes_per_sample as per_sample
    from swarmd.node.caps import wire_bytes_per_value

    w = config.wire
    tokens = min(int(getattr(seam, "max_seq_len", config.model.seq_len)), config.model.seq_len)
    lowbit = w.codec.split("+")[0] in ("int4", "int2")
    return per_sample(tokens=tokens, width=int(seam.width), bytes_per_value=wire_bytes_per_value(
        w.codec, block_size=lowbit_block_size(config) if lowbit else w.int8_block_size,
        scale_dtype="bfloat16" if lowbit else w.int8_scale_dtype))


def announced_throughput(config: Config, server: Any, host: Any = None,
                         left: Any = None) -> float:
    """The stage server's measured throughput, capped to what ``limits.upload_bytes_s`` and
    ``limits.download_bytes_s`` can carry (``swarmd.node.caps.capped_throughput``): what
    membership announces and routing weighs. With ``host`` and ``left``
    (``swarmd.node.caps.UploadLeft``): the upload cap less what other traffic took of the
    host's upload bucket lately (observed now)."""
    import time

    from swarmd.node.caps import capped_throughput, hop_upload_bytes, tighter_cap

    measured = float(server.throughput)
    upload = config.limits.upload
    per_sample = upload_bytes_per_sample(config, server.seam)
    batch = config.training.batch_size
    bucket = getattr(getattr(host, "throttle", None), "upload", None)
    if upload is not None and left is not None and bucket is not None:
        hops = int(server.counters.get("forward", 0)) + int(server.counters.get("backward", 0))
        left.observe(time.monotonic(), bucket.granted_bytes,
                     hop_upload_bytes(hops, per_sample, batch_size=batch))
        upload = left.left(upload)
    cap = tighter_cap(upload, config.limits.download)
    if cap is None:
        return measured
    return capped_throughput(measured, cap, per_sample, batch_size=batch)


def apply_stage_limits(config: Config, server: Any) -> None:
    """Bound the stage worker's saved activations; refuse a stage that does not fit
    ``limits.device_memory_bytes`` (``ConfigError`` with the numbers)."""
    from swarmd.config import ConfigError
    from swarmd.node.caps import device_memory_refusal

    limits = config.limits
    server.worker.max_saved_bytes = limits.saved_activations
    param_bytes = sum(p.numel() * p.element_size() for p in server.module.parameters())
    why = device_memory_refusal(stage=server.stage, param_bytes=param_bytes,
                                optimizer=config.training.optimizer,
                                cap_bytes=limits.device_memory, device=str(server.worker.device))
    if why is not None:
        raise ConfigError(why)


def stages_that_fit(config: Config, dtype: Any) -> frozenset[int] | None:
    """The stages whose parameters, gradients and optimizer state fit
    ``limits.device_memory_bytes`` (what the balancer and ``--stage auto`` may choose); None
    when there is no cap, or the stages cannot be sized. Each stage is built on torch's meta
    device (shapes, no memory); seconds for a big model: call it in a thread."""
    from swarmd.models.registry import model_seam_of
    from swarmd.node.caps import device_memory_refusal

    cap, stages = config.limits.device_memory, config.swarm.stages
    if cap is None:
        return None
    try:
        seam, _ = model_seam_of(config)
        sizes = [sum(p.numel() * p.element_size() for p in seam.build_stage(
            s, stages, device="meta", dtype=dtype).parameters()) for s in range(stages)]
    except Exception as exc:  # a model that cannot be built on meta: no filter, say why
        log.warning("cannot size the stages for limits.device_memory_bytes (%s): the balancer "
                    "may pick a stage that does not fit, which is then refused", exc)
        return None
    return frozenset(s for s, size in enumerate(sizes) if device_memory_refusal(
        stage=s, param_bytes=size, optimizer=config.training.optimizer, cap_bytes=cap,
        device="meta") is None)


def limits_status(config: Config, host: Any, server: Any, left: Any = None) -> dict[str, Any]:
    """``[limits]`` as set, and what the caps did (``StatusInfo.limits``)."""
    limits = config.limits
    status: dict[str, Any] = dict(host.throttle.status())
    status["saved_activations"] = {
        "bytes": limits.saved_activations,
        "kept_bytes": server.worker.saved_bytes if server is not None else 0,
        "kept_microbatches": server.worker.saved if server is not None else 0,
        "refused": server.worker.refused_for_bytes if server is not None else 0}
    status["device_memory_bytes"] = limits.device_memory
    import torch

    status["cpu_threads"] = {"set": limits.threads, "torch": torch.get_num_threads()}
    if server is not None and (limits.upload is not None or limits.download is not None):
        status["announced_throughput"] = announced_throughput(config, server, host, left)
        if left is not None and limits.upload is not None:
            status["upload_left_bytes_s"] = round(left.left(limits.upload))
            other = left.other_bytes_s()
            status["upload_other_bytes_s"] = round(other) if other is not None else None
        status["measured_throughput"] = float(server.throughput)
    return status
