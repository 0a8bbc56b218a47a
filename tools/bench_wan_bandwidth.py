"""Issue 26's bandwidth-bound profile of the WAN benchmark (``bench_wan.py --bandwidth-bound``).

The lab's other profiles are latency-bound: the demo model sends about 17 KB a microbatch hop,
nothing next to their link rates. A volunteer's stage is the other way round (a 7B-sized stage
sends megabytes a hop over a 20 Mbit/s uplink). Scaled to this machine: the built-in model
``--widths`` wide (4 layers, 8 x 128 tokens a microbatch, the swarm's default 64 microbatches
a step, ``--microbatches`` to change it; before 2026-12-06, 8: see docs/compression.md) over the
``uplink`` profile (10 ms one way, the same rate both ways on every host's link), each width
against the unshaped lab in the same run, once per ``--codecs`` codec. The rate is
``--uplink-mbit``, or (0, the default) chosen once from the first unshaped run so that an
int8 hop's transfer takes ``TARGET_RATIO`` times its compute (the issue's regime on whatever
machine runs it), then kept for every width and codec (one link: the sweep compares them):

- ``hop_bytes``: what one microbatch's hop moves with that codec, its output and its input
  gradient (encoded here with the swarm's codec settings);
- ``compute_s``: one microbatch's tokens over the unshaped pipeline's tokens/s (the machine's
  compute per microbatch, every process sharing its cores, as the issue measures it);
- ``transfer_s``: ``hop_bytes`` over the link rate (a stage's uplink carries its output
  forward and its input gradient back); ``transfer_over_compute``: the regime, which must be
  at least 2 for int8 (bandwidth is the limit);
- ``pipeline_ratio_vs_unshaped``: the uplink run's tokens/s over the unshaped run's, lost.

Bigger blocks are relatively cheaper to pipeline (compute grows as width^2, bytes as width:
SWARM's square-cube law): ``--widths 256,512,1024`` sweeps that at one link.
"""

from __future__ import annotations

import os
import time
from typing import Any

#: the wide model's settings besides its width (heads: width / heads stays a whole number
#: for every width a sweep takes)
BANDWIDTH_MODEL = {
    "SWARMD_MODEL_LAYERS": "4", "SWARMD_MODEL_HEADS": "8", "SWARMD_MODEL_SEQ_LEN": "128",
    "SWARMD_TRAINING_BATCH_SIZE": "8",
    "SWARMD_TRAINING_VAL_BATCHES": "2",
}
#: issue 26: the regime counts as bandwidth-bound from this transfer / compute ratio (int8)
BOUND_RATIO = 2.0
#: the ratio the link rate is chosen for when not given (``uplink_rate_for``)
TARGET_RATIO = 2.5


def uplink_rate_for(int8_hop_bytes: int, tokens: int, unshaped_tokens_per_s: float,
                    ratio: float = TARGET_RATIO) -> float:
    """The link rate (Mbit/s) at which an int8 hop's transfer takes ``ratio`` times the
    compute of its microbatch (its tokens over the unshaped pipeline's tokens/s)."""
    compute_s = tokens / unshaped_tokens_per_s
    return int8_hop_bytes * 8 / (ratio * compute_s) / 1e6


def hop_bytes(env: dict[str, str]) -> dict[str, Any]:
    """Bytes one microbatch's hop moves with ``env``'s codec (its output forward, its input
    gradient back), encoded here with the swarm's codec settings."""
    import torch

    from swarmd.config import load_config
    from swarmd.models.registry import model_seam_of
    from swarmd.node.host_options import codec_spec
    from transport.codecs import encode

    config = load_config(None, {**os.environ, **env})
    # the model's own shape (a Hugging Face model's, not [model]'s built-in defaults), the
    # sequence cut as the trainer cuts it
    seam = model_seam_of(config)[0]
    width = config.model.boundary_rank or seam.width
    shape = (config.training.batch_size, min(config.model.seq_len, seam.max_seq_len), width)
    g = torch.Generator().manual_seed(0)
    x, spec = torch.randn(shape, generator=g), codec_spec(config)
    # the output forward and the input's gradient back, each as its kind is sent (int2 centres
    # activations only: GRADIENT_KINDS are uncentred)
    both = encode(x, spec.for_kind("forward")).nbytes + encode(x, spec.for_kind("backward")).nbytes
    return {"codec": config.wire.codec, "shape": list(shape), "wire_width": width,
            "tokens": shape[0] * shape[1], "hop_bytes": both,
            "bytes_per_token": both / (shape[0] * shape[1])}


def measure_bandwidth_bound(widths: list[int], *, uplink_mbit: float, steps: int,
                            repeats: int = 1, codecs: tuple[str, ...] = ("int8",),
                            overrides: dict[str, str] | None = None) -> dict[str, Any]:
    from bench_wan import PROFILES, measure, say

    t0 = time.monotonic()
    rate_given = bool(uplink_mbit)
    load_before = os.getloadavg()[0]
    rate = {"mbit": uplink_mbit or None}

    def set_rate(mbit: float) -> None:
        rate["mbit"] = mbit
        PROFILES["uplink"] = (PROFILES["uplink"][0], mbit, mbit)

    if uplink_mbit:
        set_rate(uplink_mbit)
    runs: list[dict[str, Any]] = []
    for width in widths:
        for codec in codecs:
            env = {**BANDWIDTH_MODEL, "SWARMD_MODEL_WIDTH": str(width),
                   "SWARMD_WIRE_CODEC": codec, **(overrides or {})}
            wire = hop_bytes(env)
            int8_bytes = hop_bytes({**env, "SWARMD_WIRE_CODEC": "int8"})["hop_bytes"]

            def after(name: str, result: dict[str, Any]) -> None:
                if name == "unshaped" and rate["mbit"] is None:
                    set_rate(uplink_rate_for(int8_bytes, wire["tokens"],
                                             result["pipeline_tokens_per_s"]))
                    say(f"uplink: {rate['mbit']:.2f} Mbit/s (an int8 hop's transfer "
                        f"{TARGET_RATIO}x its compute here)")

            r = measure(False, ["unshaped", "uplink"], membership=False, overrides=env,
                        repeats=repeats, steps=steps, secondary=False, after_profile=after)
            uplink_mbit = rate["mbit"]
            unshaped = r["profiles"]["unshaped"]["pipeline_tokens_per_s"]
            uplink = r["profiles"]["uplink"]
            compute_s = wire["tokens"] / unshaped if unshaped else None
            transfer_s = wire["hop_bytes"] * 8 / (uplink_mbit * 1e6)
            runs.append({
                "width": width, **wire, "compute_s": compute_s, "transfer_s": transfer_s,
                "transfer_over_compute": transfer_s / compute_s if compute_s else None,
                "unshaped_tokens_per_s": unshaped,
                "uplink_tokens_per_s": uplink["pipeline_tokens_per_s"],
                "pipeline_ratio_vs_unshaped": uplink["pipeline_ratio_vs_unshaped"],
                "pipeline_ratios": uplink["pipeline_ratios"],
                "lost": sum(p["pipeline"]["lost"] or 0 for p in r["profiles"].values()),
                "uplink_restarted": uplink["pipeline"]["restarted"],
                "uplink_rerouted": uplink["pipeline"]["rerouted"],
                "contended_rounds": uplink["pipeline_contended_rounds"],
                "model": r["model"], "targets": r["targets"]})
    int8 = {x["width"]: x for x in runs if x["codec"] == "int8"}
    return {
        "uplink": {"one_way_ms": PROFILES["uplink"][0], "mbit": rate["mbit"],
                   "chosen_for_ratio": None if rate_given else TARGET_RATIO},
        "steps": steps, "repeats": repeats, "runs": runs,
        "bandwidth_bound": {str(w): (x["transfer_over_compute"] or 0.0) >= BOUND_RATIO
                            for w, x in int8.items()},
        "bytes_vs_int8": {f"{x['codec']}@{x['width']}": x["hop_bytes"] / int8[x["width"]][
            "hop_bytes"] for x in runs if x["width"] in int8},
        "cores": os.cpu_count(), "loadavg_before_after": [load_before, os.getloadavg()[0]],
        "seconds": time.monotonic() - t0,
    }
