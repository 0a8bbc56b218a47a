"""tools/bench_wire_loss.py's pieces that decide its figures: the ``:rotate`` experiment's
rotation is orthogonal and undone exactly, and variants parse or are refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from bench_wire_loss import (hadamard_rotation, variant_forward_hops, variant_specs,  # noqa: E402
                             wire_function)


def test_the_rotation_is_orthogonal_and_its_own_inverse() -> None:
    signs, r = hadamard_rotation(64)
    assert torch.allclose(r @ r.T, torch.eye(64), atol=1e-5)
    x = torch.randn(3, 5, 64)
    assert torch.allclose(((x * signs) @ r @ r) * signs, x, atol=1e-5)
    with pytest.raises(SystemExit, match="power of two"):
        hadamard_rotation(96)


def test_rotating_spreads_an_outlier_channel_before_a_2_bit_codec() -> None:
    forward, backward, _ = variant_specs("int2:rotate")
    x = torch.randn(4, 16, 128, generator=torch.Generator().manual_seed(0))
    x[..., 3] *= 20  # one channel far larger than the rest, as residual streams have

    def error(rotate: bool) -> float:
        y = wire_function(forward, backward, False, rotate)(x)
        return float((y - x).norm() / x.norm())

    assert error(True) < 0.5 * error(False)


def test_error_feedback_carries_what_a_hop_lost_into_its_next_tensor_in_training_only() -> None:
    """Sent k times, a tensor's decoded copies sum to k times it but for the last error
    carried (what is lost is sent next time), both directions; without feedback every copy's
    error adds up; an evaluation (no grad) neither adds nor keeps it."""
    forward, backward, _ = variant_specs("int2")
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))

    def summed_error(ef: bool, k: int = 16) -> tuple[float, float]:
        hop = wire_function(forward, backward, False, False, ef)
        ys, gs = torch.zeros_like(x), torch.zeros_like(x)
        for _ in range(k):
            leaf = x.clone().requires_grad_(True)
            y = hop(leaf)
            y.backward(x)  # the same gradient each time
            ys += y.detach()
            gs += leaf.grad
        return (float((ys - k * x).norm() / (k * x.norm())),
                float((gs - k * x).norm() / (k * x.norm())))

    fed, plain = summed_error(True), summed_error(False)
    assert fed[0] < 0.5 * plain[0] and fed[1] < 0.5 * plain[1], (fed, plain)
    hop = wire_function(forward, backward, False, False, True)
    with torch.no_grad():
        first, second = hop(x), hop(x)
    assert torch.equal(first, second)  # nothing carried in an evaluation


def test_unknown_variant_options_are_refused() -> None:
    with pytest.raises(SystemExit, match="unknown variant options"):
        variant_specs("int2:rotated")


def test_a_short_run_through_rotated_int2_hops_trains() -> None:
    """The tool runs end to end on bench_quality's reference loop (it broke unnoticed once,
    when that loop began to take one batch source per trainer)."""
    import bench_wire_loss

    r = bench_wire_loss.run("demo", "int2:rotate", 2, 0)
    assert r["variant"] == "int2:rotate" and len(r["train_losses"]) == 2
    assert r["final_val_loss"] < r["initial_val_loss"]


def test_the_summary_compares_means_over_seeds_and_pairs_seed_by_seed() -> None:
    """One seed says little (the module doc): the figure is the variant's mean over the seeds
    against the reference's, perturbed reference runs counted in the noisy mean only."""
    from bench_wire_loss import summarize

    def r(variant: str, seed: int, loss: float, perturb: int = 0) -> dict:
        return {"variant": variant, "seed": seed, "final_val_loss": loss, "perturb": perturb}

    runs = [r("none", 0, 2.0), r("none", 1, 3.0), r("none", 0, 2.2, perturb=1),
            r("int8", 0, 2.2), r("int8", 1, 3.0), r("int2", 0, 2.2), r("int2", 1, 3.3)]
    s = summarize(runs, paired_to="int8")
    assert s["none"]["mean_final_val_loss"] == pytest.approx(2.5)
    assert s["int2"]["ratio_of_means"] == pytest.approx(2.75 / 2.5)
    assert s["int2"]["ratio_to_noisy_means"] == pytest.approx(2.75 / (7.2 / 3))
    assert s["int2"]["ratios"] == pytest.approx([1.1, 1.1])
    assert s["int2"]["paired_to"]["ratios"] == pytest.approx([1.0, 1.1])
    assert "paired_to" not in s["int8"]
    # a variant missing a seed is compared over the seeds it ran
    s = summarize(runs[:-1])
    assert s["int2"]["seeds"] == [0] and s["int2"]["ratios"] == pytest.approx([1.1])
    assert s["int2"]["ratio_of_means"] == pytest.approx(1.1)  # against none's seed 0 only
    assert s["int2"]["ratio_to_noisy_means"] == pytest.approx(2.2 / 2.1)


def test_forward_hops_parse_or_are_refused() -> None:
    assert variant_forward_hops("int2:grad-stochastic") is None
    assert variant_forward_hops("int2:fwd-hops=0+2") == {0, 2}
    assert variant_forward_hops("int2:fwd-hops=") == set()
    variant_specs("int2:fwd-hops=1")  # not an unknown option
    with pytest.raises(SystemExit, match="hop numbers"):
        variant_forward_hops("int2:fwd-hops=1,2")
