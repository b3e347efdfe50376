"""Which rows make batch `step`: a pure function of (seed, step), the same in every framework.

Each epoch is a fresh permutation drawn from (seed, epoch); the last partial batch is
dropped. Being stateless, the data position of a checkpoint is just its step.
"""

from __future__ import annotations

import numpy as np


class BatchOrder:
    def __init__(self, n_rows: int, *, batch_size: int, seed: int) -> None:
        self.n_rows = n_rows
        self.batch_size = batch_size
        self.seed = seed
        self.per_epoch = n_rows // batch_size
        if self.per_epoch == 0:
            raise ValueError(f"batch_size must be at most the {n_rows} training rows; received {batch_size}")
        self._epoch = -1
        self._order = np.arange(0)

    def rows(self, step: int) -> np.ndarray:
        epoch, index = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._order = self.permutation(epoch)
            self._epoch = epoch
        return self._order[index * self.batch_size : (index + 1) * self.batch_size]

    def permutation(self, epoch: int) -> np.ndarray:
        """Every row in epoch `epoch`'s order: its batches are consecutive slices of it."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)
