"""OuterState: SGD with Nesterov momentum fed the outer gradient "old minus new"
(docs/algorithms.md section 1), with the arithmetic written out by hand.

torch's SGD, Nesterov, no weight decay, for gradient g:
  first step:  buf = g
  later steps: buf = mu * buf + g
  update = g + mu * buf;  theta = theta - lr * update
So the first step moves by lr * (1 + mu) * g.
"""

from __future__ import annotations

import pytest
import torch

from diloco.outer import OuterState

DELTA = torch.tensor([1.0, -2.0])


def close(a: torch.Tensor, expected: list[float]) -> None:
    """Equal up to float32 rounding (relative 1e-6, docs/algorithms.md section 4)."""
    torch.testing.assert_close(a, torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_first_step_moves_by_lr_one_plus_mu_delta():
    state = OuterState(torch.zeros(2), lr=0.7, momentum=0.9)
    new = state.step(DELTA)
    # 0.7 * 1.9 = 1.33: [0, 0] - 1.33 * [1, -2] = [-1.33, 2.66]
    close(new, [-1.33, 2.66])
    assert new is state.params
    # buf = g on the first step
    close(state.momentum_buffer, [1.0, -2.0])


def test_second_step_nesterov_by_hand():
    state = OuterState(torch.zeros(2), lr=0.7, momentum=0.9)
    state.step(DELTA)
    new = state.step(DELTA)
    # buf    = 0.9 * [1, -2] + [1, -2]          = [1.9, -3.8]
    # update = [1, -2] + 0.9 * [1.9, -3.8]      = [2.71, -5.42]
    # theta  = [-1.33, 2.66] - 0.7 * [2.71, -5.42]
    #        = [-1.33 - 1.897, 2.66 + 3.794]    = [-3.227, 6.454]
    close(state.momentum_buffer, [1.9, -3.8])
    close(new, [-3.227, 6.454])


def test_step_from_nonzero_start_and_other_hyperparameters():
    # lr 0.4, mu 0.5, theta [1, 2], g [0.5, 0.25]:
    # first step moves by 0.4 * 1.5 = 0.6 times g = [0.3, 0.15] -> [0.7, 1.85]
    state = OuterState(torch.tensor([1.0, 2.0]), lr=0.4, momentum=0.5)
    close(state.step(torch.tensor([0.5, 0.25])), [0.7, 1.85])


def test_momentum_zero_is_plain_sgd():
    state = OuterState(torch.zeros(2), lr=0.7, momentum=0.0)
    # theta = [0, 0] - 0.7 * [1, -2] = [-0.7, 1.4]
    close(state.step(DELTA), [-0.7, 1.4])
    # again, no momentum carried: [-0.7, 1.4] - [0.7, -1.4] = [-1.4, 2.8]
    close(state.step(DELTA), [-1.4, 2.8])
    assert state.momentum_buffer is None


def test_lr_one_momentum_zero_lands_on_the_new_parameters():
    # FedAvg (section 2): theta_out - 1.0 * (theta_out - theta_new) = theta_new
    old = torch.tensor([3.0, -1.0, 0.5])
    new = torch.tensor([2.5, 0.0, 0.75])
    state = OuterState(old, lr=1.0, momentum=0.0)
    assert torch.equal(state.step(old - new), new)  # 3 - 0.5, -1 + 1, 0.5 + 0.25 exact


def test_state_is_float32_cpu_copy():
    src = torch.tensor([1.0, 2.0], dtype=torch.float64)
    state = OuterState(src, lr=0.7, momentum=0.9)
    assert state.params.dtype == torch.float32 and state.params.device.type == "cpu"
    state.step(torch.tensor([1.0, 1.0], dtype=torch.float64))  # grad cast to float32
    assert torch.equal(src, torch.tensor([1.0, 2.0], dtype=torch.float64))  # not aliased
    assert state.params.grad is None


def test_step_does_not_modify_the_gradient():
    g = DELTA.clone()
    state = OuterState(torch.zeros(2), lr=0.7, momentum=0.9)
    state.step(g)
    state.step(g)
    assert torch.equal(g, DELTA)


@pytest.mark.parametrize("momentum", [0.9, 0.5, 0.0])
def test_load_then_step_equals_uninterrupted(momentum):
    torch.manual_seed(0)
    start = torch.randn(1000)
    grads = [torch.randn(1000) for _ in range(4)]

    straight = OuterState(start, lr=0.7, momentum=momentum)
    for g in grads[:2]:
        straight.step(g)
    params = straight.params.clone()
    buf = None if straight.momentum_buffer is None else straight.momentum_buffer.clone()
    for g in grads[2:]:
        straight.step(g)

    resumed = OuterState(torch.zeros(1000), lr=0.7, momentum=momentum)
    resumed.step(torch.ones(1000))  # some unrelated history that load() must erase
    resumed.load(params, buf)
    for g in grads[2:]:
        resumed.step(g)
    assert torch.equal(resumed.params, straight.params)
    if momentum > 0:
        assert torch.equal(resumed.momentum_buffer, straight.momentum_buffer)
    else:
        assert resumed.momentum_buffer is None


def test_load_copies_the_buffer():
    state = OuterState(torch.zeros(2), lr=0.7, momentum=0.9)
    buf = torch.tensor([1.0, 1.0])
    state.load(torch.zeros(2), buf)
    state.step(DELTA)
    assert torch.equal(buf, torch.tensor([1.0, 1.0]))  # the caller's tensor is untouched


def test_load_with_none_momentum_resets():
    state = OuterState(torch.zeros(2), lr=0.7, momentum=0.9)
    state.step(DELTA)
    state.step(DELTA)
    state.load(torch.zeros(2), None)
    assert state.momentum_buffer is None
    # the next step is a first step again: [-1.33, 2.66], buf = g
    close(state.step(DELTA), [-1.33, 2.66])
    close(state.momentum_buffer, [1.0, -2.0])
