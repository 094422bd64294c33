"""The training losses of a worker, read from the device only when they are logged."""

from __future__ import annotations

import torch


class LossLog(list):
    """Per-step training losses. A step's loss stays a tensor on the device until
    `flush` (log steps, the end), so an inner step never waits for the device."""

    def __init__(self, values=()) -> None:  # values: as a list takes them (copy.deepcopy)
        super().__init__(values)
        self._pending: list[torch.Tensor] = []

    def add(self, loss: torch.Tensor) -> None:
        self._pending.append(loss)

    def flush(self) -> LossLog:
        if self._pending:  # one device-to-host copy for the steps since the last flush
            self.extend(torch.stack(self._pending).tolist())
            self._pending.clear()
        return self
