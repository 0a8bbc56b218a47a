"""Which step an export takes each stage at: a consistent cut, or why not yet. Pure.

Every stage peer answers ``state_digest`` with the step its weights are at and their round
digest (``swarmd.state.round_digest``). From those answers (:class:`Heard`, per stage) an
export decides (:func:`decide`):

* :class:`Cut` at step S: every stage has a peer at S, S the highest such step (and at least
  ``min_step`` when one is asked for). For each stage, the peers at S, those reporting the
  digest most of them report first, and that digest, which the downloaded weights must match;
* :class:`Wait`: a stage nobody answered for (``unserved``), or stages behind the others
  (``lagging``). The caller asks again until its deadline, then raises what
  :meth:`Wait.explain` says;
* with ``mixed`` (the deadline passed and the user accepts it), a :class:`Cut` with no single
  step: each stage at its highest step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Heard", "Cut", "Wait", "decide"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Heard:
    """One peer's answer: its weights of the stage are at ``step``, with round ``digest``."""

    peer: str
    step: int
    digest: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Cut:
    """Take stage k at ``steps[k]`` from one of ``sources[k]`` (best first); its weights
    must have round digest ``expected[k]``. ``step`` is the one step of them all (None: a
    mixed cut)."""

    step: int | None
    steps: Mapping[int, int]
    sources: Mapping[int, tuple[Heard, ...]]
    expected: Mapping[int, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Wait:
    """No cut yet: ``unserved`` stages nobody answered for; ``lagging`` (stage, its highest
    step) below ``lead``, the step the cut waits for."""

    unserved: tuple[int, ...] = ()
    lagging: tuple[tuple[int, int], ...] = ()
    lead: int | None = None

    def explain(self) -> str:
        """One line: what keeps the cut from being taken (for the error at the deadline)."""
        if self.unserved:
            stages = ", ".join(str(s) for s in self.unserved)
            word = "stage" if len(self.unserved) == 1 else "stages"
            return (f"{word} {stages} {'has' if len(self.unserved) == 1 else 'have'} no peer "
                    f"serving it with this model that answers: start one with `swarmd join "
                    f"--stage {self.unserved[0]}` (with the swarm's settings), or check the "
                    f"model settings match the swarm's (`swarmd doctor`)")
        behind = ", ".join(f"stage {s} at step {step}" for s, step in self.lagging)
        return (f"the stages were not all at one step: {behind} lags behind step {self.lead}; "
                f"export again once training paused, give it longer (--timeout), or accept "
                f"parts from different steps (--any-step)")


def decide(heard: Mapping[int, Sequence[Heard]], num_stages: int, *,
           min_step: int | None = None, mixed: bool = False) -> Cut | Wait:
    """The cut to take from ``heard`` (answers per stage), or what it waits for."""
    unserved = tuple(s for s in range(num_stages) if not heard.get(s))
    if unserved:
        return Wait(unserved=unserved)
    steps = {s: {h.step for h in heard[s]} for s in range(num_stages)}
    highest = {s: max(found) for s, found in steps.items()}
    common = set.intersection(*steps.values())
    if common and (min_step is None or max(common) >= min_step):
        at = max(common)
        return _cut(heard, {s: at for s in range(num_stages)}, step=at)
    if mixed:
        return _cut(heard, highest, step=None)
    lead = max(highest.values()) if min_step is None else max(min_step, *highest.values())
    return Wait(lagging=tuple((s, h) for s, h in sorted(highest.items()) if h < lead),
                lead=lead)


def _cut(heard: Mapping[int, Sequence[Heard]], steps: Mapping[int, int], *,
         step: int | None) -> Cut:
    sources: dict[int, tuple[Heard, ...]] = {}
    expected: dict[int, str] = {}
    for stage, at in steps.items():
        there = [h for h in heard[stage] if h.step == at]
        votes = Counter(h.digest for h in there)
        # the digest most peers at the step report (ties: the smallest, so all agree on one)
        best = min(votes, key=lambda d: (-votes[d], d))
        expected[stage] = best
        sources[stage] = tuple(sorted(there, key=lambda h: (h.digest != best, h.peer)))
    return Cut(step=step, steps=dict(steps), sources=sources, expected=expected)
