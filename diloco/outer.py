"""Outer state of one fragment: its outer parameters and Nesterov momentum.

Workers and the aggregator both keep this state in float32 and step it with
``torch.optim.SGD(lr, momentum, nesterov=True)`` fed the decoded mean as ``.grad``
(docs/algorithms.md section 1). Same input bytes and same kernels: every party that
applies the same means computes the same bits, which the tests check. It lives on
the CPU, or, for a worker with ``sync.outer.device: device``, on its training
device (no host copy of the live fragment per send or merge; on a GPU the SGD
kernels may round differently from the aggregator's CPU ones).
"""

from __future__ import annotations

import torch


class OuterState:
    """theta_out[p] and the SGD-Nesterov optimizer that moves it."""

    def __init__(self, params: torch.Tensor, lr: float, momentum: float,
                 device: torch.device | str = "cpu"):
        self.params = params.detach().to(dtype=torch.float32, device=device).clone()
        self.lr = lr
        self.momentum = momentum
        self._opt = torch.optim.SGD(
            [self.params], lr=lr, momentum=momentum, nesterov=momentum > 0, foreach=False
        )

    def step(self, grad: torch.Tensor) -> torch.Tensor:
        """One outer step with outer gradient ``grad`` ("old minus new"); returns the
        new outer parameters (the state's own tensor, do not modify). ``grad`` should
        be on the state's device already (a CPU one is copied there, blocking)."""
        self.params.grad = grad.to(dtype=torch.float32, device=self.params.device)
        self._opt.step()
        self.params.grad = None
        return self.params

    @property
    def momentum_buffer(self) -> torch.Tensor | None:
        state = self._opt.state.get(self.params, {})
        return state.get("momentum_buffer")

    def state_dict(self) -> dict[str, torch.Tensor | None]:
        """Copies of the parameters and momentum (``None`` before the first step)."""
        buf = self.momentum_buffer
        return {"params": self.params.clone(), "momentum": None if buf is None else buf.clone()}

    def load(self, params: torch.Tensor, momentum_buffer: torch.Tensor | None) -> None:
        """Restore from a checkpoint (``None``: no outer step taken yet)."""
        with torch.no_grad():
            self.params.copy_(params)
        self._opt.state.clear()
        if momentum_buffer is not None:
            self._opt.state[self.params]["momentum_buffer"] = (
                momentum_buffer.detach().to(device=self.params.device, dtype=torch.float32).clone()
            )
