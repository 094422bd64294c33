"""The replica's pure rules (`diloco.rules`), with the arithmetic written out by hand.

Values are binary fractions (0.25, 0.125, ...), so most results are exact in
float32 and asserted bit for bit; weights are unequal and alpha is not 0.5, so a
rule that swapped two operands or used the wrong weight would give other numbers.
Outer steps follow test_outer.py: SGD-Nesterov's first step moves by
``lr * (1 + mu) * g``.
"""

from __future__ import annotations

import pytest
import torch

from diloco import rules
from diloco.outer import OuterState
from diloco.rules import Arrived


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def exact(a: torch.Tensor, expected: list[float]) -> None:
    assert torch.equal(a, torch.tensor(expected, dtype=torch.float32)), a


# -- sending -----------------------------------------------------------------------------
def test_outer_gradient_is_old_minus_new():
    # [1 - 0.75, 2 - 2.5, -0.5 - -0.5] = [0.25, -0.5, 0]
    exact(rules.outer_gradient(t(1.0, 2.0, -0.5), t(0.75, 2.5, -0.5)), [0.25, -0.5, 0.0])


def test_with_residual_adds_last_rounds_loss():
    delta = t(0.25, -0.5, 0.0)
    assert rules.with_residual(delta, None) is delta  # no residual yet: untouched
    # [0.25 + 0.125, -0.5 + 0, 0 - 0.25] = [0.375, -0.5, -0.25]
    exact(rules.with_residual(delta, t(0.125, 0.0, -0.25)), [0.375, -0.5, -0.25])


def test_residual_is_what_the_codec_lost():
    # sent [0.375, -0.5, -0.25], decoded [0.5, -0.5, 0]:
    # residual = [0.375 - 0.5, -0.5 + 0.5, -0.25 - 0] = [-0.125, 0, -0.25]
    exact(rules.residual_of(t(0.375, -0.5, -0.25), t(0.5, -0.5, 0.0)), [-0.125, 0.0, -0.25])


# -- merging -----------------------------------------------------------------------------
def test_merge_steps_then_lerps_toward_the_live_side():
    outer = OuterState(t(1.0, -1.0), lr=0.5, momentum=0.5)
    # first step moves by 0.5 * 1.5 = 0.75 times g = [0.5, 1]: [0.375, 0.75]
    # theta_new = [1 - 0.375, -1 - 0.75] = [0.625, -1.75]
    # lerp(theta_new, theta_m = [0.25, 0.5], 0.25) = theta_new + 0.25 * (theta_m - theta_new)
    #   = [0.625 + 0.25 * -0.375, -1.75 + 0.25 * 2.25] = [0.53125, -1.1875]
    live = rules.merge(outer, t(0.5, 1.0), 0.25, t(0.25, 0.5))
    exact(live, [0.53125, -1.1875])
    exact(outer.params, [0.625, -1.75])  # the reference of the next round is theta_new
    exact(outer.momentum_buffer, [0.5, 1.0])  # buf = g on the first step


def test_merge_uses_the_pinned_lerp_form_bit_for_bit():
    """docs/algorithms.md section 5 pins ``torch.lerp(theta_new, theta_m, alpha)``; the
    algebraically equal ``(1 - alpha) * theta_new + alpha * theta_m`` has other bits."""
    g = torch.Generator().manual_seed(3)
    start, grad, live = (torch.randn(4096, generator=g) for _ in range(3))
    a, b = OuterState(start, 0.7, 0.9), OuterState(start, 0.7, 0.9)
    got = rules.merge(a, grad, 0.75, live)
    theta_new = b.step(grad)
    assert torch.equal(got, torch.lerp(theta_new, live, 0.75))
    other = (1 - 0.75) * theta_new + 0.75 * live
    assert not torch.equal(got, other)  # so this test tells the forms apart


def test_merge_with_alpha_zero_is_the_outer_value_itself():
    outer = OuterState(t(1.0, -1.0), lr=0.5, momentum=0.0)
    # plain SGD: [1, -1] - 0.5 * [0.5, 1] = [0.75, -1.5]; theta_m is not read, so even
    # an infinite one cannot turn into NaN through 0 * inf
    live = rules.merge(outer, t(0.5, 1.0), 0.0, t(float("inf"), 0.0))
    exact(live, [0.75, -1.5])
    assert live is outer.params
    exact(rules.merge(OuterState(t(1.0, -1.0), 0.5, 0.0), t(0.5, 1.0), 0.0), [0.75, -1.5])


def test_merge_with_alpha_needs_the_live_side():
    with pytest.raises(ValueError, match="alpha = 0.25"):
        rules.merge(OuterState(t(1.0), 0.5, 0.0), t(0.5), 0.25)


def test_correct_moves_by_minus_eta_without_touching_momentum():
    outer = OuterState(t(1.0, -1.0), lr=0.5, momentum=0.5)
    outer.step(t(0.5, 1.0))  # -> [0.625, -1.75], buf [0.5, 1] (as above)
    # [0.625, -1.75] - 0.5 * [0.25, -0.5] = [0.5, -1.5]; buf stays [0.5, 1]
    exact(rules.correct(outer, t(0.25, -0.5)), [0.5, -1.5])
    exact(outer.params, [0.5, -1.5])
    exact(outer.momentum_buffer, [0.5, 1.0])


# -- eager updates -----------------------------------------------------------------------
def test_others_part_removes_this_workers_weighted_share():
    # [0.5, -0.25] - 0.25 * [1, 1] = [0.25, -0.5]
    exact(rules.others_part(t(0.5, -0.25), t(1.0, 1.0), 0.25), [0.25, -0.5])


def test_pure_eager_round_zero_is_the_own_part_alone():
    # no previous mean: 0 + 0.25 * [1, -2] = [0.25, -0.5]
    exact(rules.pure_eager(t(1.0, -2.0), 0.25, None), [0.25, -0.5])


def test_pure_eager_uses_the_previous_rounds_weight():
    # previous: mean [0.5, 0.75], own [1, 2], weight 0.75 (its true weight in that mean)
    # others = [0.5 - 0.75, 0.75 - 1.5] = [-0.25, -0.75]
    # + 0.25 * [1, -2] = [-0.25 + 0.25, -0.75 - 0.5] = [0, -1.25]
    # (with the fresh w = 0.25 for the previous round it would be [0.5, 0.75] - [0.25,
    # 0.5] + [0.25, -0.5] = [0.5, -0.25])
    previous = Arrived(mean=t(0.5, 0.75), own=t(1.0, 2.0), weight=0.75)
    exact(rules.pure_eager(t(1.0, -2.0), 0.25, previous), [0.0, -1.25])


def test_pure_eager_evaluates_the_others_part_first():
    """``(delta^(r-1) - w' * delta_m^(r-1)) + w * delta_m^(r)`` in that order: with
    mean 1, w' * own' = 0.5 * 2 = 1 and a tiny fresh part 0.25 * 4e-8 = 1e-8 the
    pinned order gives (1 - 1) + 1e-8 = 1e-8; ``1 + (1e-8 - 1)`` would give 0 in
    float32 (1 - 1e-8 rounds to 1)."""
    own = t(4e-8)
    got = rules.pure_eager(own, 0.25, Arrived(mean=t(1.0), own=t(2.0), weight=0.5))
    assert torch.equal(got, 0.25 * own) and got.item() != 0.0
    assert (t(1.0) + (0.25 * own - t(1.0))).item() == 0.0  # the other order loses it


def test_adaptive_eager_on_time_is_the_mean_copied():
    mean = t(0.5, -0.25)
    got = rules.adaptive_eager(mean, None, 0.25, [])
    exact(got, [0.5, -0.25])  # streaming: the round's own mean, own part not read
    got += 1.0
    exact(mean, [0.5, -0.25])  # a copy: the mean the poller holds stays intact


def test_adaptive_eager_late_mean_applies_the_own_part_and_arrived_corrections():
    # own fresh part: 0.25 * [1, -2] = [0.25, -0.5]
    # round k1: [0.5, 0.5] - 0.25 * [1, 0] = [0.25, 0.5]
    # round k2: [-0.25, 1] - 0.5 * [0, 2] = [-0.25, 0]   (weight 0.5: unequal on purpose)
    # sum = [0.25 + 0.25 - 0.25, -0.5 + 0.5 + 0] = [0.25, 0]
    earlier = [Arrived(t(0.5, 0.5), t(1.0, 0.0), 0.25), Arrived(t(-0.25, 1.0), t(0.0, 2.0), 0.5)]
    exact(rules.adaptive_eager(None, t(1.0, -2.0), 0.25, earlier), [0.25, 0.0])


def test_adaptive_eager_on_time_with_an_earlier_correction_owed():
    # mean [1, 1] + round k1's others' part [0.25, 0.5] = [1.25, 1.5]
    earlier = [Arrived(t(0.5, 0.5), t(1.0, 0.0), 0.25)]
    exact(rules.adaptive_eager(t(1.0, 1.0), None, 0.25, earlier), [1.25, 1.5])


def test_adaptive_eager_adds_the_corrections_in_round_order():
    """((1 + -1) + 1e-8) = 1e-8, where 1 + (-1 + 1e-8) would be 0 in float32."""
    fresh_own, w = t(2.0), 0.5  # fresh part 0.5 * 2 = 1
    earlier = [Arrived(t(-0.5), t(1.0), 0.5),   # -0.5 - 0.5 * 1 = -1
               Arrived(t(1e-8), t(0.0), 0.5)]  # 1e-8 - 0 = 1e-8
    got = rules.adaptive_eager(None, fresh_own, w, earlier)
    assert torch.equal(got, t(1e-8))


def test_adaptive_eager_all_late_equals_pure_eager_bit_for_bit():
    """Every mean one round late: at round r only round r - 1 has arrived, and the
    adaptive sum ``w * own + others`` equals the pure ``others + w * own`` (float
    addition commutes)."""
    g = torch.Generator().manual_seed(7)
    own, mean_prev, own_prev = (torch.randn(1000, generator=g) for _ in range(3))
    previous = Arrived(mean_prev, own_prev, 0.375)
    assert torch.equal(rules.adaptive_eager(None, own, 0.375, [previous]),
                       rules.pure_eager(own, 0.375, previous))


def test_adaptive_eager_late_mean_needs_the_own_part():
    with pytest.raises(ValueError, match="own"):
        rules.adaptive_eager(None, None, 0.25, [])


def test_outstanding_sums_the_owed_parts_in_round_order():
    assert rules.outstanding([]) is None  # nothing owed: no correction at all
    earlier = [Arrived(t(0.5, 0.5), t(1.0, 0.0), 0.25), Arrived(t(-0.25, 1.0), t(0.0, 2.0), 0.5)]
    # [0.25, 0.5] + [-0.25, 0] = [0, 0.5]
    exact(rules.outstanding(earlier), [0.0, 0.5])
    exact(rules.outstanding(earlier[:1]), [0.25, 0.5])


def test_the_worker_side_arithmetic_written_in_place_has_the_same_bits():
    """``out=`` (a worker's scratch: the gathered fragment, the old residual) gives the
    bits of the fresh-array forms and writes no new array."""
    g = torch.Generator().manual_seed(5)
    outer_p, live, residual, decoded, grad = (torch.randn(4096, generator=g) for _ in range(5))

    scratch = live.clone()
    got = rules.outer_gradient(outer_p, scratch, out=scratch)
    assert got.data_ptr() == scratch.data_ptr() and torch.equal(got, outer_p - live)

    for beta in (1.0, 0.95):
        want = rules.with_residual(live, residual, beta)
        old = residual.clone()
        got = rules.with_residual(live, old, beta, out=old)
        assert got.data_ptr() == old.data_ptr() and torch.equal(got, want)
        assert torch.equal(rules.residual_of(got, decoded, out=got), want - decoded)
    kept = live.clone()
    assert rules.with_residual(kept, None, out=None) is kept

    a, b = OuterState(outer_p, 0.7, 0.9), OuterState(outer_p, 0.7, 0.9)
    scratch = live.clone()
    got = rules.merge(a, grad, 0.5, scratch, out=scratch)
    assert got.data_ptr() == scratch.data_ptr()
    assert torch.equal(got, rules.merge(b, grad, 0.5, live))
