"""The replica's arithmetic of docs/algorithms.md sections 5-7, as pure functions.

Tensors in, tensors out: no store, no threads, no waiting. The synchroniser
gathers what a rule needs (the live fragment, the decoded contributions, the means
that have arrived) and then calls it. Each rule evaluates its terms in exactly the
order the document pins, because algebraically equal forms give other float bits
and the tests compare replicas with the aggregator bit for bit.

The modes' outer gradients: blocking DiLoCo and streaming use the round's mean;
eager's ``pure`` rule the paper's estimate, its ``naive`` rule the previous mean
alone (the baseline it beats); eager's ``adaptive`` rule (the default)
the own fresh part ``w * delta_m^(r)`` plus the others' part of every earlier
round whose mean has arrived, so each contribution is applied once. ``w`` of the
fresh part is ``1 / M``, and a round's correction uses the same ``w``, so a worker
whose true weight differs, or whose contribution was not used, is corrected
exactly when the mean arrives.

Symbols: ``theta_m`` the live fragment, ``theta_out`` its outer parameters,
``delta_m^(r)`` this worker's decoded outer gradient of round ``r``, ``delta^(r)``
the round's mean, ``w`` this worker's weight in it, ``alpha`` the merge weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from diloco.outer import OuterState


class Arrived(NamedTuple):
    """A past round of one fragment whose mean has arrived: ``delta^(k)``, and this
    worker's decoded ``delta_m^(k)`` with the weight ``w`` it applied it with."""

    mean: torch.Tensor
    own: torch.Tensor
    weight: float


# -- sending (sections 1 and 5) --------------------------------------------------------
def outer_gradient(theta_out: torch.Tensor, theta_m: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``delta_m = theta_out - theta_m``, "old minus new" (section 1). ``out``: where
    to write it (may be ``theta_m``, a scratch copy: no second fragment-sized array)."""
    return torch.sub(theta_out, theta_m, out=out)


def with_residual(delta: torch.Tensor, residual: torch.Tensor | None,
                  beta: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Error feedback: what the codec lost last round rides on this round's delta,
    decayed by ``beta`` first (SparseLoCo's accumulator ``e = beta * e + delta``;
    ``float32(beta) * e``, then the sum; beta 1 is plain error feedback, bit for bit).
    ``out``: where to write the sum (may be ``residual`` itself, which it consumes:
    a worker then allocates nothing per round); ignored without a residual."""
    if residual is None:
        return delta
    if beta != 1.0:
        residual = torch.mul(residual, torch.tensor(beta, dtype=torch.float32), out=out)
    return torch.add(delta, residual, out=out)


def residual_of(sent: torch.Tensor, decoded: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x - decode(encode(x))``: the part of ``sent`` the codec did not carry
    (``out``: where to write it, which may be ``sent``)."""
    return torch.sub(sent, decoded, out=out)


# -- merging (section 3) ---------------------------------------------------------------
def merge(
    outer: OuterState, grad: torch.Tensor | None, alpha: float, theta_m: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One outer step on ``grad``, then the fragment's new live value
    ``torch.lerp(theta_new, theta_m, alpha)`` (the pinned form).

    With ``alpha = 0`` the live value is ``theta_new`` itself (no lerp, so no
    ``0 * (theta_m - theta_new)`` term can turn an infinite ``theta_m`` into NaN),
    and ``theta_m`` may be omitted. ``grad = None`` (a round in which every
    contribution was rejected) is no step: the live value merges into the outer
    parameters as they are. ``outer`` is stepped in place; the result with
    ``alpha = 0`` is its own tensor, to be copied, not modified. ``out``: where the
    lerp writes (may be ``theta_m``, a gathered copy: the same bits, one array less)."""
    theta_new = outer.params if grad is None else outer.step(grad)
    if alpha == 0.0:
        return theta_new
    if theta_m is None:
        raise ValueError(f"merge with alpha = {alpha} needs the live fragment theta_m")
    return torch.lerp(theta_new, theta_m, alpha, out=out)


def correct(outer: OuterState, correction: torch.Tensor) -> torch.Tensor:
    """Move the outer parameters by ``-eta * correction`` without a round: the
    momentum is not touched, so a zero correction changes nothing (section 4, the
    eager modes at the end). Returns the outer parameters (the state's own tensor)."""
    with torch.no_grad():
        outer.params.add_(correction, alpha=-outer.lr)
    return outer.params


# -- eager updates (section 4) ---------------------------------------------------------
def others_part(mean: torch.Tensor, own: torch.Tensor, weight: float) -> torch.Tensor:
    """The other workers' part of a round: ``delta^(k) - w * delta_m^(k)``."""
    return mean - weight * own


def pure_eager(own: torch.Tensor, weight: float, previous: Arrived | None) -> torch.Tensor:
    """The paper's estimate ``(delta^(r-1) - w' * delta_m^(r-1)) + w * delta_m^(r)``,
    in exactly that order; ``previous`` is round ``r - 1`` (``None`` in round 0, whose
    stale part is zero), ``w'`` this worker's weight in that round's mean."""
    if previous is None:
        others = torch.zeros_like(own)
    else:
        others = others_part(previous.mean, previous.own, previous.weight)
    return others + weight * own


def naive_delayed(previous_mean: torch.Tensor) -> torch.Tensor:
    """The naive delayed rule at the merge of round ``r``: ``delta^(r-1)``, the whole
    previous mean (this worker's own stale part included), nothing of round ``r``.
    The baseline of the eager-updates paper (arXiv 2502.12996), kept to measure it."""
    return previous_mean.clone()


def adaptive_eager(
    mean: torch.Tensor | None,
    own: torch.Tensor | None,
    weight: float,
    earlier: Sequence[Arrived],
) -> torch.Tensor:
    """The adaptive rule at the merge of round ``r``: every contribution once.

    The fresh part is the round's own mean ``delta^(r)`` when it has arrived (then
    the round is plain streaming), else this worker's part ``w * delta_m^(r)``
    (``own`` is read only then). To it are added, in round order, the others' parts
    of the ``earlier`` rounds whose means have arrived and were not applied yet."""
    if mean is not None:
        grad = mean.clone()
    elif own is None:
        raise ValueError("adaptive_eager needs own (delta_m^(r)) when the mean is late")
    else:
        grad = weight * own
    for k in earlier:
        grad = grad + others_part(k.mean, k.own, k.weight)
    return grad


def outstanding(earlier: Sequence[Arrived]) -> torch.Tensor | None:
    """The sum, in round order, of the others' parts still owed at the end of an
    eager run (``None`` when nothing is owed)."""
    total = None
    for k in earlier:
        part = others_part(k.mean, k.own, k.weight)
        total = part if total is None else total + part
    return total
