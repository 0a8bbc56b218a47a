"""The ``[limits]`` section: what a volunteer's machine lends the swarm at most.

Every cap is ``"off"`` (the default: no cap) or a positive number. A cap of 0 or less is an
error that says to write ``"off"``: 0 never silently means unlimited. Byte sizes may carry a
unit, decimal (``"1MB"`` = 1,000,000) or binary (``"1MiB"`` = 1,048,576). Declared like every
other section (see ``swarmd.config.fields``) and assembled into ``swarmd.config.Config``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from swarmd.config.fields import _Invalid, _Section, _opt, _type_name

__all__ = ["LimitsConfig", "OFF", "cap", "parse_bytes"]

OFF = "off"
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}
_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*?)(?:/s)?")
_ZERO = ('{value} is not a cap: a cap is at least 1, and 0 does not mean unlimited here; write '
         '"off" (or leave the key out) for no cap')


def parse_bytes(text: str) -> int:
    """``"1MB"`` -> 1000000, ``"2 MiB"`` -> 2097152, ``"1500000"`` -> 1500000 (may be 0 or
    fractional before rounding down; the caller checks the range). Raises ``ValueError``."""
    m = _SIZE_RE.fullmatch(text.strip().lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"{text!r} is not a size such as 1000000, \"1MB\" or \"512KiB\"")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _cap_of(lo: int, hi: int, *, units: bool) -> Callable[[Any], Any]:
    """A converter: ``"off"``, or a number from ``lo`` to ``hi`` (an integer, a float with no
    fraction that matters, or text, with a unit when ``units``)."""

    def convert(value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.lower() == OFF:
                return OFF
            if text.lstrip().startswith("-"):
                raise _Invalid(_ZERO.format(value=text))
            try:
                number = parse_bytes(text) if units else int(text, 10)
            except ValueError:
                raise _Invalid('not "off" or a number') from None
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Invalid(f"it is {_type_name(value)}")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise _Invalid("not a finite number")
            if value >= 1 and value != int(value):
                raise _Invalid("not a whole number")
            number = int(value)
        else:
            number = value
        if number < 1:
            raise _Invalid(_ZERO.format(value=value))
        if not lo <= number <= hi:
            raise _Invalid("out of range")
        return number

    return convert


def cap(value: Any) -> int | None:
    """A ``[limits]`` value as a number, or None for ``"off"``."""
    return None if value == OFF else int(value)


_RATE = '"off" or a number of bytes per second greater than 0, such as 1000000 or "1MB"'
_SIZE = '"off" or a number of bytes greater than 0, such as 2000000000 or "2GB"'


@dataclass(frozen=True)
class LimitsConfig(_Section):
    SECTION: ClassVar[str] = "limits"
    DOC: ClassVar[str] = ('Caps on what this machine lends the swarm; each is "off" (no cap) '
                          'or a positive number (0 is refused: write "off").')

    upload_bytes_s: int | str = _opt(
        OFF, "Bytes per second sent to peers, all streams together (activations, gradients, "
        "averaging, state transfer); the throughput this peer announces is capped to match.",
        _RATE, convert=_cap_of(1, 1 << 50, units=True),
    )
    download_bytes_s: int | str = _opt(
        OFF, "Bytes per second received from peers, all streams together (flow control slows "
        "the senders down).", _RATE, convert=_cap_of(1, 1 << 50, units=True),
    )
    saved_activation_bytes: int | str = _opt(
        OFF, "Bytes of activations a stage peer keeps for backward passes still to come (as "
        "well as its 64 microbatches); over it, new forwards are refused with busy and go to "
        "another peer of the stage.", _SIZE, convert=_cap_of(1, 1 << 60, units=True),
    )
    device_memory_bytes: int | str = _opt(
        OFF, "Bytes of parameters and optimizer state a stage may need on this peer's device; "
        "a stage that needs more is refused at start, with the numbers.", _SIZE,
        convert=_cap_of(1, 1 << 60, units=True),
    )
    cpu_threads: int | str = _opt(
        OFF, "torch CPU threads of the daemon (torch.set_num_threads at start); off: "
        "model.threads, else torch's default of one per core.",
        '"off" or an integer from 1 to 1024', convert=_cap_of(1, 1024, units=False),
    )

    @property
    def upload(self) -> int | None:
        return cap(self.upload_bytes_s)

    @property
    def download(self) -> int | None:
        return cap(self.download_bytes_s)

    @property
    def saved_activations(self) -> int | None:
        return cap(self.saved_activation_bytes)

    @property
    def device_memory(self) -> int | None:
        return cap(self.device_memory_bytes)

    @property
    def threads(self) -> int | None:
        return cap(self.cpu_threads)
