"""This process's place in its torch.distributed group (none: a group of one)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    """This process's place in its group: the island (diloco) or all workers
    (data_parallel). ``size`` 1 means no torch.distributed."""

    rank: int = 0
    size: int = 1

    @classmethod
    def from_env(cls) -> Group:
        """The place torchrun gives (``RANK``, ``WORLD_SIZE``); a group of one without."""
        return cls(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))

    @property
    def leader(self) -> bool:
        """Rank 0: the one rank of an island that talks to the store."""
        return self.rank == 0
