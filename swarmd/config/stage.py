"""Configuration sections of a stage's shared training state: averaging and checkpoints.

Declared like every other section (see ``swarmd.config.fields``) and assembled into
``swarmd.config.Config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from swarmd.config.fields import _Invalid, _Section, _int_range, _one_of, _opt, _positive

#: ``averaging.aggregator`` values (``swarmd.averaging.aggregation``)
AGGREGATORS = ("mean", "centered_clip")
#: ``averaging.compression`` values: what gradients are compressed to on the wire
AVERAGING_CODECS = ("none", "fp16", "int8")
def _range(lo: float, hi: float):  # type: ignore[no-untyped-def]
    def check(value: float) -> None:
        if not lo <= value <= hi:
            raise _Invalid("out of range")
    return check


#: ``training.optimizer`` values
OPTIMIZERS = ("adamw", "lamb")


@dataclass(frozen=True)
class AveragingConfig(_Section):
    SECTION: ClassVar[str] = "averaging"
    DOC: ClassVar[str] = ("How the peers of a stage combine their gradients before each "
                          "optimizer step.")

    target_batch_size: int = _opt(
        0, "Samples a stage accumulates, over all its peers, before it steps (0: "
        "training.batch_size x training.microbatches, one trainer's step).",
        "an integer from 0 to 2**31", _int_range(0, 1 << 31),
    )
    compression: str = _opt(
        "fp16", "Compression of gradients during averaging: none, fp16 or int8.",
        "one of " + ", ".join(f'"{c}"' for c in AVERAGING_CODECS), _one_of(AVERAGING_CODECS),
    )
    aggregator: str = _opt(
        "centered_clip", "How contributions are combined: mean, or centered_clip (bounds the "
        "influence of one peer's gradients).",
        "one of " + ", ".join(f'"{a}"' for a in AGGREGATORS), _one_of(AGGREGATORS),
    )
    timeout_s: float = _opt(
        600.0, "The longest one averaging round may take: its deadline follows the bytes and "
        "the measured links (swarmd/links.py), at most this; peers that miss it are left out.",
        "a number of seconds greater than 0", _positive,
    )


@dataclass(frozen=True)
class CheckpointConfig(_Section):
    SECTION: ClassVar[str] = "checkpoint"
    DOC: ClassVar[str] = ("Stage state saved in the home (<home>/checkpoints), so a restarted "
                          "daemon resumes.")

    every_steps: int = _opt(
        50, "Save the stage's state every this many optimizer steps (0: only on shutdown).",
        "an integer from 0 to 2**31", _int_range(0, 1 << 31),
    )


@dataclass(frozen=True)
class StateSection(_Section):
    SECTION: ClassVar[str] = "state"
    DOC: ClassVar[str] = ("How a stage peer that downloaded its mates' state catches up with "
                          "the steps they took meanwhile (swarmd/state/catchup.py).")

    replay_steps: int = _opt(
        8, "Keep the gradients of this many last optimizer steps, so that a mate whose "
        "downloaded state is that many steps old replays them instead of downloading again "
        "(0: off). Memory: one float32 copy of the stage's trainable parameters per step kept.",
        "an integer from 0 to 1024", _int_range(0, 1024),
    )
    replay_max_bytes: int = _opt(
        256 << 20, "The most bytes those kept gradients take (the oldest are dropped first; a "
        "stage whose float32 gradient is bigger keeps none).",
        "an integer from 0 to 2**40", _int_range(0, 1 << 40),
    )


@dataclass(frozen=True)
class BalancingSection(_Section):
    SECTION: ClassVar[str] = "balancing"
    DOC: ClassVar[str] = ("When a peer moves to the stage that limits the pipeline "
                          "(swarmd/balancing/policy.py).")

    enabled: bool = _opt(
        True, "Move to the bottleneck stage when that raises the pipeline's throughput.",
        "true or false",
    )
    threshold: float = _opt(
        0.05, "Move only while rebalancing would raise the slowest stage by more than this "
        "fraction.", "a number from 0 to 10", _range(0.0, 10.0),
    )
    confirmations: int = _opt(
        3, "Consecutive checks that must agree before a peer moves.",
        "an integer from 1 to 100", _int_range(1, 100),
    )
    check_period_s: float = _opt(
        30.0, "Mean seconds between checks (randomized by +-50%).",
        "a number of seconds greater than 0", _positive,
    )
    confirm_period_s: float = _opt(
        10.0, "Mean seconds between checks while a move is being confirmed.",
        "a number of seconds greater than 0", _positive,
    )


@dataclass(frozen=True)
class ServingSection(_Section):
    SECTION: ClassVar[str] = "serving"
    DOC: ClassVar[str] = "How a stage peer runs the microbatches it is sent."

    batch_forwards: str = _opt(
        "auto", "Run microbatches that queue up together as one batch (their backward then "
        "waits up to 2 s for each other): auto (on for CUDA devices, off on CPUs, where "
        "measured it cost more in waiting than it saved), on or off.",
        '"auto", "on" or "off"', _one_of(("auto", "on", "off")),
    )
    step_drains: str = _opt(
        "off", "Whether this peer's optimizer step first waits for the microbatches in flight "
        "here, and once a step's worth was forwarded the next forwards wait for that step, so "
        "that no gradient reaches its step late: off (latency hidden, gradients up to a few "
        "steps late), first (only while serving stage 0, where lateness costs most: 1.28 -> "
        "1.02 of the synchronous run's loss measured at 16 in flight, for a pause of one round "
        "trip through the later stages per step) or all (docs/pipeline.md, \"Latency "
        "hiding\").",
        '"off", "first" or "all"', _one_of(("off", "first", "all")),
    )

    def max_batch(self, device_type: str, most: int) -> int:
        """Most microbatches forwarded as one batch on a ``device_type`` device."""
        on = self.batch_forwards == "on" or (self.batch_forwards == "auto"
                                             and device_type == "cuda")
        return most if on else 1

    def drains(self, stage: int) -> bool:
        """Whether a peer serving ``stage`` drains before its steps."""
        return self.step_drains == "all" or (self.step_drains == "first" and stage == 0)
