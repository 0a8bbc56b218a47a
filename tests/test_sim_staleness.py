"""The staleness simulator's compensations, on their own: the math each run relies on."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from sim_staleness import _compensate, stale_beta1  # noqa: E402


def test_delay_compensation_moves_only_the_late_gradients_by_g_squared_times_the_change() -> None:
    grads = [torch.tensor([0.5, -1.0]), torch.tensor([2.0])]
    live = {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([3.0])}
    then = {"a": torch.tensor([0.0, 2.0]), "b": torch.tensor([0.0])}
    _compensate(grads, ["a", "b"], ["a"], live, then, dc=2.0, per_step=2)
    # g (of the microbatch's loss) = 2 x the summand; + 2 x g^2 x (now - then), back / 2
    assert torch.allclose(grads[0], torch.tensor([(1.0 + 2 * 1.0 * 1.0) / 2,
                                                  (-2.0 + 2 * 4.0 * -1.0) / 2]))
    assert torch.equal(grads[1], torch.tensor([2.0]))  # not late: untouched


@given(st.floats(0.5, 0.99), st.floats(0, 10), st.floats(0, 5))
def test_stale_beta1_only_lowers_and_stays_a_beta(base: float, lateness: float,
                                                   k: float) -> None:
    beta = stale_beta1(base, lateness, k=k)
    assert 0.0 <= beta <= base
    assert beta == base or (lateness > 0 and k > 0)
