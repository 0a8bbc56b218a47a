"""What a peer does with its swarm's manifest: take it, or refuse naming what differs. Pure.

A peer's own manifest is built from its configuration; its *own* settings are the ones its
operator set (a value other than the default: ``swarmd init`` writes every default into
config.toml, so "set in the file" cannot tell them apart). Against the swarm's manifest:

* an own setting that differs from the swarm's is a :class:`Difference`: the peer refuses to
  start with one line per difference (its value and the swarm's);
* every other setting is taken from the swarm (``adopted``): a volunteer with nothing but an
  identity serves the swarm's model, tokenizer and schedule.

The model counts as one setting (``model``: its kind) when the kinds differ; when both are the
same kind, each of its settings (and each config.json key of a Hugging Face model) counts.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

from swarmd.manifest.document import COMMON_KEYS, OPTIONAL_KEYS, Manifest

__all__ = ["Difference", "Settlement", "settle", "differences", "conflict_text"]

class _Absent:
    def __repr__(self) -> str:
        return "(not set)"


_ABSENT = _Absent()


@dataclass(frozen=True, slots=True)
class Difference:
    """One setting whose value here is not the swarm's."""

    key: str
    ours: Any
    theirs: Any

    def line(self) -> str:
        return f"{self.key} = {_show(self.ours)} here, {_show(self.theirs)} in the swarm"


@dataclass(frozen=True, slots=True)
class Settlement:
    """The outcome: ``conflicts`` (refuse when any) and the settings taken from the swarm."""

    conflicts: tuple[Difference, ...]
    adopted: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.conflicts


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _keys(ours: Manifest, theirs: Manifest) -> Iterator[tuple[str, Any, Any]]:
    """Every comparable setting in the swarm's order (then ours), with both values; a model's
    own settings only when both models are of one kind (else the ``model`` line says it)."""
    mine, swarm = ours.flat(), theirs.flat()
    same_kind = mine["model"] == swarm["model"]
    seen: set[str] = set()
    for key in [*swarm, *mine]:
        if key in seen:
            continue
        seen.add(key)
        if not same_kind and key not in COMMON_KEYS and key not in OPTIONAL_KEYS \
                and key not in ("model", "tokenizer"):
            continue
        yield key, mine.get(key, _ABSENT), swarm.get(key, _ABSENT)


def differences(ours: Manifest, theirs: Manifest) -> list[Difference]:
    """Every setting that differs (what a peer that takes nothing from the swarm, such as a
    trainer, must fix; what a peer of another manifest runs)."""
    return [Difference(k, a, b) for k, a, b in _keys(ours, theirs) if a != b]


def settle(ours: Manifest, own: Collection[str], theirs: Manifest) -> Settlement:
    """Compare our manifest, whose settings ``own`` (keys of :meth:`Manifest.flat`) the
    operator set, with the swarm's (module doc)."""
    model_own = "model" in own

    def is_own(key: str) -> bool:
        return key in own or (model_own and key.startswith("config.json "))

    conflicts, adopted = [], []
    for key, a, b in _keys(ours, theirs):
        if a == b:
            continue
        if is_own(key):
            conflicts.append(Difference(key, a, b))
        else:
            adopted.append(key)
    return Settlement(conflicts=tuple(conflicts), adopted=tuple(adopted))


#: what a peer that can take the swarm's settings should do about its own
TAKE_FIX = ("set them as the swarm does, or remove them from this peer's config.toml, "
            "environment and flags to take the swarm's")


def conflict_text(conflicts: Collection[Difference], swarm_hash: str, source: str,
                  fix: str = TAKE_FIX) -> str:
    """The refusal: a first line, one line per difference, then what to do."""
    lines = [f"this peer's own settings differ from its swarm's (manifest {swarm_hash} from "
             f"{source}):"]
    lines += [f"  {d.line()}" for d in conflicts]
    lines.append(f"  {fix}")
    return "\n".join(lines)
