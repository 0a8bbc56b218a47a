"""The sections of swarmd's typed configuration: one frozen dataclass per TOML table.

Every key is declared once, as a field of a section dataclass whose ``metadata["spec"]`` holds
its one-line doc, what a valid value looks like and its validator. Validation, the error
messages and the documented default file (``swarmd/config/default.toml``) all come from these
declarations; :mod:`swarmd.config.load` applies the sources and renders the file.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from swarmd.config.fields import (  # the declarations' vocabulary
    _Invalid, _Section, _device, _host_port, _int_range, _is_loopback, _multiaddrs, _one_of, _opt,
    _positive, _positive_seconds, _power_of_two, _show, _swarm_name, split_host_port,
)
from swarmd.config.stage import OPTIMIZERS
from transport.limits import Limits


#: prefix of the environment variables that set configuration keys
ENV_PREFIX = "SWARMD_"
#: ``SWARMD_*`` variables that are not configuration keys; the loader ignores them
RESERVED_ENV = frozenset({"SWARMD_HOME"})
#: allowed values of ``wire.codec``
CODECS = tuple(f"{base}{suffix}" for base in ("none", "fp16", "int8", "int4", "int2")
               for suffix in ("", "+zstd"))
LOG_LEVELS = ("debug", "info", "warning", "error")


def _zero_or(check: Any) -> Any:
    """``check``, except that 0 (meaning: the default) also passes."""
    def zero_or(value: int) -> None:
        if value != 0:
            check(value)
    return zero_or

#: allowed values of ``model.dtype`` (the names of ``swarmd.models.gpt.DTYPES``, kept torch-free here)
DTYPES = ("float32", "bfloat16", "float16")

#: allowed values of ``data.reader`` and ``data.mode`` (kept equal to swarmd.data's READERS, MODES)
DATA_READERS = ("auto", "swarmd", "datasets")
DATA_MODES = ("cached", "stream")
#: allowed values of ``training.lr_schedule``
LR_SCHEDULES = ("constant", "cosine")
#: ``training.schedule`` values (``swarmd.trainer.run``)
SCHEDULES = ("sync", "pipelined")
#: ``model.factory``: "package.module:callable" (kept equal to swarmd.models.registry.FACTORY_RE)
_FACTORY_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")

_LIMITS = Limits()


def _address_filters(values: tuple[str, ...]) -> None:
    from swarmd.addresses import parse_filter  # pure

    for index, text in enumerate(values, 1):
        try:
            parse_filter(text)
        except ValueError as exc:
            raise _Invalid(f"entry {index}: {exc}") from None


def _factory(value: str) -> None:
    if value and not _FACTORY_RE.fullmatch(value):
        raise _Invalid(None)


def _non_negative(value: float) -> None:
    if not value >= 0:
        raise _Invalid("must be 0 or more")


def _shard(value: str) -> None:
    from swarmd.data.order import parse_shard  # pure

    try:
        parse_shard(value)
    except ValueError:
        raise _Invalid(None) from None


def _non_empty(value: str) -> None:
    if not value:
        raise _Invalid("must not be empty")


@dataclass(frozen=True)
class SwarmConfig(_Section):
    SECTION: ClassVar[str] = "swarm"
    DOC: ClassVar[str] = "The swarm this node belongs to."

    name: str = _opt(
        "swarmd-default",
        "Name of the swarm; peers only work with peers of the same name, keeping swarms apart.",
        'a name of 1 to 64 letters, digits, ".", "_" or "-", starting with a letter or digit',
        _swarm_name,
    )
    stages: int = _opt(
        2,
        "Number of pipeline stages the model is cut into; peers announcing another stage are "
        "kept out of routing.",
        "an integer from 1 to 4096",
        _int_range(1, 4096),
    )
    model: str = _opt(
        "swarmd-default",
        "Identifier of the model this swarm trains; peers announcing another are kept out of "
        "routing.",
        'a name of 1 to 64 letters, digits, ".", "_" or "-", starting with a letter or digit',
        _swarm_name,
    )


@dataclass(frozen=True)
class ModelSection(_Section):
    SECTION: ClassVar[str] = "model"
    DOC: ClassVar[str] = ("The model: the built-in byte-level GPT, a Hugging Face causal LM "
                          "(model.hf) or a user's own (model.factory); every peer of a swarm "
                          "needs the same model (compared by its hash).")

    width: int = _opt(
        128, "Width of the residual stream (embedding size); a multiple of model.heads.",
        "an integer from 1 to 65536", _int_range(1, 65536),
    )
    heads: int = _opt(
        4, "Attention heads per layer.", "an integer from 1 to 1024", _int_range(1, 1024),
    )
    layers: int = _opt(
        4, "Transformer layers, counting each application of a shared layer.",
        "an integer from 1 to 4096", _int_range(1, 4096),
    )
    seq_len: int = _opt(
        128, "Longest sequence (context) in bytes.", "an integer from 1 to 1048576",
        _int_range(1, 1 << 20),
    )
    share_layers: int = _opt(
        1, "Consecutive layers sharing one set of weights (1: none shared); divides model.layers.",
        "an integer from 1 to 4096", _int_range(1, 4096),
    )
    boundary_rank: int = _opt(
        0, "Width of the activation sent between stages (docs/compression.md): each part ends "
        "with a learned projection to this many values a token and the next begins with one "
        "back to the model's width, trained with the model; 0: off (the model's own width). "
        "Below the model's width; shared by the swarm (its manifest); swarmd export refuses it.",
        "an integer from 0 to 65536", _int_range(0, 65536),
    )
    dtype: str = _opt(
        "float32", "Type of parameters and activations: float32, bfloat16 or float16.",
        "one of " + ", ".join(f'"{d}"' for d in DTYPES), _one_of(DTYPES),
    )
    device: str = _opt(
        "auto", "Where this node computes: auto (CUDA when available, else CPU), cpu, cuda or "
        "cuda:N.", '"auto", "cpu", "cuda" or "cuda:N"', _device,
    )
    factory: str = _opt(
        "", 'A user\'s own model: "package.module:callable", called with the [model] keys, '
        "returning a swarmd.models.seam.ModelSeam; empty: model.hf or the built-in GPT.",
        'empty or "package.module:callable"', _factory,
    )
    hf: str = _opt(
        "", "Directory of a Hugging Face causal LM (Llama, Mistral, Qwen2, Qwen3 or GPT-2): its "
        "config.json, optionally *.safetensors weights and tokenizer.json, read offline; "
        "empty: the built-in GPT (width, heads, layers and share_layers apply to it only).",
        'a directory path, or ""',
    )
    threads: int = _opt(
        0, "torch CPU threads of this process (0: torch's default, one per core). Set it when "
        "several swarmd processes share one machine's cores, as `swarmd demo` does.",
        "an integer from 0 to 1024", _int_range(0, 1024),
    )


@dataclass(frozen=True)
class TrainingConfig(_Section):
    SECTION: ClassVar[str] = "training"
    DOC: ClassVar[str] = "How the trainer trains: microbatches, learning rate, seed."

    batch_size: int = _opt(
        8, "Sequences per microbatch, the unit that travels through the pipeline.",
        "an integer from 1 to 65536", _int_range(1, 65536),
    )
    microbatches: int = _opt(
        64, "Microbatches per optimizer step of a trainer. A step's last microbatch must come "
        "back before the next step starts (training.schedule = \"sync\"), so each step "
        "pays one round trip through the pipeline: 64 keeps that under a tenth of a step on "
        "a 50 ms link (docs/pipeline.md, \"Exact steps\"); on one machine a few suffice.",
        "an integer from 1 to 65536", _int_range(1, 65536),
    )
    in_flight: int = _opt(
        0, "Most microbatches a trainer keeps in the pipeline at once (0: as many as the "
        "measured round trip calls for, at most 32 and, with the sync schedule, a step's).",
        "an integer from 0 to 4096", _int_range(0, 4096),
    )
    schedule: str = _opt(
        "sync", "How a trainer's steps follow each other: sync (a step's microbatches "
        "travel through the pipeline together, then every part of the model steps once on "
        "exactly their gradient, as one process would: docs/pipeline.md, \"Exact steps\") or "
        "pipelined (the next step's microbatches start before the last ones came back: "
        "latency hidden, gradients up to a few steps late).",
        "one of " + ", ".join(f'"{s}"' for s in SCHEDULES), _one_of(SCHEDULES),
    )
    lr: float = _opt(
        3e-3, "Learning rate.", "a number greater than 0", _positive,
    )
    optimizer: str = _opt(
        "adamw", "Optimizer of every stage and trainer: adamw or lamb.",
        "one of " + ", ".join(f'"{o}"' for o in OPTIMIZERS), _one_of(OPTIMIZERS),
    )
    seed: int = _opt(
        0, "Seed of the initial weights (with the model hash) and of batch sampling.",
        "an integer from 0 to 2**63 - 1", _int_range(0, (1 << 63) - 1),
    )
    lr_schedule: str = _opt(
        "constant", "Learning rate after warm-up: constant, or cosine (decaying to a tenth of "
        "training.lr at training.decay_steps).",
        "one of " + ", ".join(f'"{s}"' for s in LR_SCHEDULES), _one_of(LR_SCHEDULES),
    )
    warmup_steps: int = _opt(
        50, "Optimizer steps over which the learning rate rises linearly from 0 (0: none). "
        "Delayed gradients (the pipelined schedule) hurt most while the loss falls fast: with "
        "a warm-up and grad_clip they train as well as the synchronous schedule "
        "(docs/pipeline.md, \"Training quality\").",
        "an integer from 0 to 2**31", _int_range(0, 1 << 31),
    )
    decay_steps: int = _opt(
        10000, "Step at which the cosine schedule reaches its lowest learning rate.",
        "an integer from 1 to 2**31", _int_range(1, 1 << 31),
    )
    grad_clip: float = _opt(
        1.0, "Largest gradient norm; larger gradients are scaled down to it (0: no clipping). "
        "Whose norm: training.grad_clip_scope.", "a number, 0 or more",
        _non_negative,
    )
    grad_clip_scope: str = _opt(
        "model", "Whose gradient norm training.grad_clip bounds: model (the whole model's, "
        "every stage's and the trainer's parts together, as torch.nn.utils.clip_grad_norm_ over "
        "one model: each stage reports its part's norm to the trainer every step, with the "
        "synchronous schedule and one trainer; otherwise each part clips its own) or part "
        "(each stage and the trainer clip their own part).",
        '"model" or "part"', _one_of(("model", "part")),
    )
    weight_decay: float = _opt(
        0.0, "Decoupled weight decay of the optimizer (AdamW's and LAMB's), 0 for none.",
        "a number, 0 or more", _non_negative,
    )
    val_batches: int = _opt(
        32, "Validation batches (of training.batch_size windows, from documents held out of "
        "training) each evaluation averages the loss over.",
        "an integer from 1 to 65536", _int_range(1, 65536),
    )
    eval_every: int = _opt(
        100, "Evaluate the validation loss every this many steps (0: only at the start and the "
        "end); each evaluation goes to train-metrics.jsonl and the progress.",
        "an integer from 0 to 2**31", _int_range(0, 1 << 31),
    )
    export_every: int = _opt(
        0, "A trainer with a home exports the whole model (as `swarmd export` does: every "
        "stage fetched from its peers) into <home>/exports/step-<N> every this many of its "
        "steps, in model.dtype (0: never).",
        "an integer from 0 to 2**31", _int_range(0, 1 << 31),
    )
    export_keep: int = _opt(
        3, "How many of a trainer's periodic exports are kept (the newest).",
        "an integer from 1 to 1000", _int_range(1, 1000),
    )
    tensorboard_dir: str = _opt(
        "", "Directory the trainer writes TensorBoard event files to (loss, learning rate, "
        "gradient norm, tokens/s, rerouted/restarted/lost per step, every validation loss, "
        "the run's settings); needs pip install swarmd[tensorboard]; empty: none.",
        'a directory path such as "~/runs/swarmd", or ""',
    )


@dataclass(frozen=True)
class DataConfig(_Section):
    SECTION: ClassVar[str] = "data"
    DOC: ClassVar[str] = ("What the trainer trains on: text, as bytes or tokens, held out by "
                          "document, shuffled and sharded (docs/data.md).")

    path: str = _opt(
        "", "Text, JSONL or Parquet file, a directory tree of them (binary files skipped), or a "
        "directory saved by Hugging Face datasets' save_to_disk; empty: the Python standard "
        "library's sources.",
        'a path, or "" for the standard library sources',
    )
    max_bytes: int = _opt(
        32 << 20, "Most bytes of text read from the corpus (32 MiB); the rest is left out.",
        "a positive integer", _int_range(1),
    )
    tokenizer: str = _opt(
        "auto", "How text becomes tokens: auto (the tokenizer.json of the model.hf directory "
        "when it has one, else bytes), bytes (one token per byte), or the path of a "
        "tokenizer.json (see `swarmd tokenizer train`) whose vocabulary fits the model's.",
        '"auto", "bytes" or the path of a tokenizer.json', _non_empty,
    )
    text_field: str = _opt(
        "text", "Field holding a document's text in JSONL lines and the column in Parquet files "
        "and datasets.",
        "a non-empty field name", _non_empty,
    )
    reader: str = _opt(
        "auto", "Who reads data.path: auto (swarmd's readers; a save_to_disk directory through "
        "datasets), swarmd, or datasets (local JSON and Parquet files through load_dataset, "
        "streamed; needs `pip install swarmd[datasets]`).",
        "one of " + ", ".join(f'"{r}"' for r in DATA_READERS), _one_of(DATA_READERS),
    )
    mode: str = _opt(
        "cached", "cached: tokenize the corpus once into a token file (data.cache_dir) and read "
        "it in a seeded random order; stream: for corpora too large for that, read and "
        "tokenize as training goes, files in a seeded order, windows shuffled in blocks of "
        "data.shuffle_buffer.",
        "one of " + ", ".join(f'"{m}"' for m in DATA_MODES), _one_of(DATA_MODES),
    )
    cache_dir: str = _opt(
        "", "Directory of the token files (one per corpus and tokenizer, rebuilt when either "
        "changes); empty: $XDG_CACHE_HOME/swarmd/tokens, else ~/.cache/swarmd/tokens.",
        'a directory path, or ""',
    )
    shard: str = _opt(
        "auto", "Which part of the training windows this trainer reads, so that trainers never "
        "read the same window: \"i/n\" (trainer i of n), or auto (its place among the "
        "trainers in view when it starts, kept in its state; give each trainer its own i/n "
        "where trainers start together or come and go).",
        '"auto" or "i/n" such as "0/2"', _shard,
    )
    shuffle_buffer: int = _opt(
        4096, "Windows shuffled together in data.mode = stream.",
        "an integer from 1 to 1048576", _int_range(1, 1 << 20),
    )


@dataclass(frozen=True)
class NetworkConfig(_Section):
    SECTION: ClassVar[str] = "network"
    DOC: ClassVar[str] = "Peer-to-peer networking (libp2p)."

    listen: tuple[str, ...] = _opt(
        ["/ip4/0.0.0.0/tcp/31337"],
        "Multiaddrs to accept peer connections on.",
        'a list of multiaddrs such as "/ip4/0.0.0.0/tcp/31337"',
        _multiaddrs(need_peer_id=False),
    )
    bootstrap: tuple[str, ...] = _opt(
        [],
        "Peers to join through, as multiaddrs ending in /p2p/<peer id>; empty starts a new swarm.",
        'a list of multiaddrs ending in /p2p/<peer id>, such as '
        '"/ip4/192.0.2.7/tcp/31337/p2p/12D3KooW..."',
        _multiaddrs(need_peer_id=True),
    )
    announce: tuple[str, ...] = _opt(
        [],
        "Addresses to announce instead of the ones listened on (e.g. the public address a cloud "
        "VM is reached at); empty: the listened ones, 0.0.0.0 expanded to the interfaces' "
        "addresses, loopback left out unless nothing else is left.",
        'a list of multiaddrs such as "/ip4/203.0.113.7/tcp/31337"',
        _multiaddrs(need_peer_id=False),
    )
    no_announce: tuple[str, ...] = _opt(
        [],
        "Addresses never to announce: CIDR blocks (\"10.0.0.0/8\", \"/ip4/10.0.0.0/ipcidr/8\") "
        "or whole multiaddrs.",
        'a list of CIDR blocks such as "192.168.0.0/16" or multiaddrs',
        _address_filters,
    )
    relay: str = _opt(
        "on", "Relays for peers behind NAT: on (serve as a relay within the limits below, and "
        "use relays when not reachable), client (only use relays), off.",
        '"on", "client" or "off"', _one_of(("on", "client", "off")),
    )
    relay_reservations: int = _opt(
        2, "Relays a daemon behind NAT keeps a reservation on.", "an integer from 1 to 8",
        _int_range(1, 8),
    )
    relay_max_reservations: int = _opt(
        128, "Peers this daemon relays for at most, as a relay.", "an integer from 1 to 100000",
        _int_range(1, 100_000),
    )
    relay_max_circuits: int = _opt(
        256, "Relayed connections through this daemon at once.", "an integer from 1 to 100000",
        _int_range(1, 100_000),
    )
    relay_max_circuit_bytes: int = _opt(
        8 << 30, "Bytes one relayed connection may carry (8 GiB: sized for activations).",
        "an integer from 65536 to 1099511627776", _int_range(1 << 16, 1 << 40),
    )
    relay_max_circuit_s: float = _opt(
        3600.0, "Seconds one relayed connection may last.", "a number of seconds from 1",
        _positive_seconds,
    )
    hole_punch: bool = _opt(
        True, "Try to turn relayed connections into direct ones (DCUtR).", "true or false",
    )
    tcp_user_timeout_s: float = _opt(
        0.0, "Seconds sent data may stay unacknowledged before a TCP connection is dropped "
        "(0: the kernel's, many minutes). Not needed to find connections through a restarted "
        "router (liveness_* does); it also drops a live peer that stops reading that long (a "
        "big averaging round over a slow link), so it is off by default.", "a number of seconds, 0 or more",
        _non_negative,
    )
    liveness_ping_after_s: float = _opt(
        10.0, "Seconds a connection may stay silent (nothing received) before it is pinged.",
        "a number of seconds greater than 0", _positive_seconds,
    )
    liveness_dead_after_s: float = _opt(
        25.0, "Seconds of silence after which a connection whose pings went unanswered is "
        "closed and re-dialed (a restarted home router's connections); a peer that sends or "
        "acknowledges anything, however slowly, is never dropped. 0: never.",
        "0, or a number of seconds greater than liveness_ping_after_s", _non_negative,
    )
    max_connections: int = _opt(
        1024, "Most peer connections open at once.", "an integer from 1 to 1000000",
        _int_range(1, 1_000_000),
    )
    handshake_timeout_s: float = _opt(
        5.0, "Seconds allowed for the security and multiplexer handshake of a new connection.",
        "a number of seconds greater than 0", _positive_seconds,
    )
    dial_timeout_s: float = _opt(
        10.0, "Seconds allowed to dial a peer before giving up.",
        "a number of seconds greater than 0", _positive_seconds,
    )
    request_timeout_s: float = _opt(
        30.0, "Seconds allowed for one request and its reply.",
        "a number of seconds greater than 0", _positive_seconds,
    )


@dataclass(frozen=True)
class WireConfig(_Section):
    SECTION: ClassVar[str] = "wire"
    DOC: ClassVar[str] = "How tensors travel between peers, and what a peer may send us."

    codec: str = _opt(
        "int8",
        "Tensor encoding: none, fp16, int8 (blockwise), int4 or int2 (blockwise, packed; "
        "docs/compression.md), each optionally followed by +zstd.",
        "one of " + ", ".join(f'"{c}"' for c in CODECS),
        _one_of(CODECS),
    )
    int8_block_size: int = _opt(
        64, "Values per scale block of the int8 codec.",
        "a power of two from 16 to 65536", _power_of_two(16, 65536),
    )
    int8_scale_dtype: str = _opt(
        "float16", "Type of the per-block scales of the int8 codec.",
        '"float16" or "float32"', _one_of(("float16", "float32")),
    )
    lowbit_block_size: int = _opt(
        0, "Values per scale block of the int4 and int2 codecs; 0: the codec's own (64 for "
        "int4; 256 for int2, 512 when centred).",
        "0 or a power of two from 16 to 65536", _zero_or(_power_of_two(16, 65536)),
    )
    lowbit_rounding: str = _opt(
        "gradients", "Rounding of the int4 and int2 codecs: nearest, stochastic (unbiased), or "
        "gradients (stochastic for gradients, nearest for activations).",
        '"nearest", "stochastic" or "gradients"', _one_of(("nearest", "stochastic", "gradients")),
    )
    lowbit_center: bool = _opt(
        True, "int4 and int2: subtract each channel's mean over the tokens before quantising, "
        "and send the means (two bytes a channel).",
        "true or false",
    )
    lowbit_zstd: str = _opt(
        "gradients", "int4 and int2: compress with zstd the gradients (rounded stochastically, "
        "their codes compress to about 0.6-0.7), or nothing more than the codec name says (off).",
        '"gradients" or "off"', _one_of(("gradients", "off")),
    )
    zstd_level: int = _opt(
        1, "zstd level of the +zstd codecs: 1 is fastest, 22 smallest.",
        "an integer from 1 to 22", _int_range(1, 22),
    )
    max_header_bytes: int = _opt(
        _LIMITS.max_header_bytes, "Largest frame header accepted from a peer, in bytes (64 KiB).",
        "a positive integer", _int_range(1),
    )
    max_message_bytes: int = _opt(
        _LIMITS.max_message_bytes,
        "Largest message payload accepted from a peer, in bytes (256 MiB).",
        "a positive integer", _int_range(1),
    )
    max_tensor_bytes: int = _opt(
        _LIMITS.max_tensor_bytes,
        "Largest decoded tensor accepted from a peer, in bytes (1 GiB).",
        "a positive integer", _int_range(1),
    )
    chunk_bytes: int = _opt(
        _LIMITS.chunk_bytes, "Size of the pieces a payload is streamed in, in bytes (1 MiB).",
        "a positive integer", _int_range(1),
    )


@dataclass(frozen=True)
class HttpConfig(_Section):
    SECTION: ClassVar[str] = "http"
    DOC: ClassVar[str] = "The local HTTP API that `swarmd status` and the other commands talk to."

    listen: str = _opt(
        "127.0.0.1:8411", "Address (host:port) the HTTP API listens on; port 0 picks a free one.",
        'host:port with an IP address or localhost, such as "127.0.0.1:8411"', _host_port,
    )
    allow_non_loopback: bool = _opt(
        False,
        "Allow a non-loopback http.listen (the API has no authentication: keep it private).",
        "true or false",
    )


@dataclass(frozen=True)
class LogConfig(_Section):
    SECTION: ClassVar[str] = "log"
    DOC: ClassVar[str] = "Logging."

    level: str = _opt(
        "info", "Least severe level logged: debug, info, warning or error.",
        "one of " + ", ".join(f'"{v}"' for v in LOG_LEVELS), _one_of(LOG_LEVELS),
    )
    format: str = _opt(
        "text", "Log line format: text for people, json for machines (one object per line).",
        '"text" or "json"', _one_of(("text", "json")),
    )
    file: str = _opt(
        "", "Also log to this file, rotated by size; empty: stderr only (journald, docker).",
        'a file path such as "~/.swarmd/swarmd.log", or ""',
    )
    max_bytes: int = _opt(
        10 << 20, "Rotate log.file when it reaches this many bytes (10 MiB).",
        "an integer from 4096 to 1099511627776", _int_range(4096, 1 << 40),
    )
    backups: int = _opt(
        5, "Rotated log files kept besides log.file.", "an integer from 0 to 1000",
        _int_range(0, 1000),
    )


def _grace_seconds(value: float) -> None:
    if not 0 < value <= 3600:
        raise _Invalid("must be more than 0 and at most 3600")


@dataclass(frozen=True)
class NodeConfig(_Section):
    SECTION: ClassVar[str] = "node"
    DOC: ClassVar[str] = "The daemon's own lifecycle."

    shutdown_grace_s: float = _opt(
        20.0, "On SIGTERM, SIGINT or `swarmd stop`: seconds to finish the microbatches in "
        "flight here (the rest are handed back to their senders) and save the checkpoint "
        "before exiting 0; a second signal stops at once.",
        "a number of seconds greater than 0 and at most 3600", _grace_seconds,
    )


def _cross_checks(get: Callable[[str], Any],
                  blame: Callable[..., str]) -> Iterator[tuple[str, str]]:
    """Checks spanning several keys: yields ``(key to blame, message)``.

    ``blame(*keys)`` picks, among keys that are only wrong together, the one set by the
    strongest source (a flag before an environment variable before the file before a default).
    """
    http_listen = get("http.listen")
    host, _ = split_host_port(http_listen)
    if not get("http.allow_non_loopback") and not _is_loopback(host):
        yield "http.listen", (
            f"http.listen = {_show(http_listen)} is not a loopback address and the HTTP API has "
            f"no authentication: listen on 127.0.0.1, or set http.allow_non_loopback = true "
            f"to expose it anyway"
        )
    threads, cpu_threads = get("model.threads"), get("limits.cpu_threads")
    if threads and cpu_threads != "off" and threads != cpu_threads:
        key = blame("limits.cpu_threads", "model.threads")
        yield key, (f"{key} = {get(key)} is invalid: limits.cpu_threads ({cpu_threads}) and "
                    f"model.threads ({threads}) disagree; set one of them (limits.cpu_threads "
                    f"wins when model.threads is 0)")
    ping_after, dead_after = get("network.liveness_ping_after_s"), \
        get("network.liveness_dead_after_s")
    if dead_after and dead_after <= ping_after:
        key = blame("network.liveness_dead_after_s", "network.liveness_ping_after_s")
        yield key, (f"{key} = {get(key)} is invalid: network.liveness_dead_after_s "
                    f"({dead_after}) must be more than network.liveness_ping_after_s "
                    f"({ping_after}), or 0 (never)")
    width, heads = get("model.width"), get("model.heads")
    if width % heads:
        key = blame("model.heads", "model.width")
        yield key, (f"{key} = {get(key)} is invalid: model.width ({width}) must be a multiple of "
                    f"model.heads ({heads})")
    rank = get("model.boundary_rank")
    if rank and not get("model.hf") and not get("model.factory") and rank >= width:
        key = blame("model.boundary_rank", "model.width")
        yield key, (f"{key} = {get(key)} is invalid: model.boundary_rank ({rank}) must be below "
                    f"model.width ({width}), or 0 (off)")
    layers, share = get("model.layers"), get("model.share_layers")
    if layers % share:
        key = blame("model.share_layers", "model.layers")
        yield key, (f"{key} = {get(key)} is invalid: model.share_layers ({share}) must divide "
                    f"model.layers ({layers})")
    elif get("swarm.stages") > layers // share:
        key = blame("swarm.stages", "model.layers", "model.share_layers")
        groups = layers // share
        yield key, (f"{key} = {get(key)} is invalid: swarm.stages ({get('swarm.stages')}) is more "
                    f"than the {groups} group(s) of layers (model.layers {layers} / "
                    f"model.share_layers {share}) a stage boundary can fall between; use at most "
                    f"{groups} stage(s), or more layers")
