"""Lazy sparse updates for torch optimizers: apply the dense math to the touched rows only.

`nn.Embedding(sparse=True)` produces a sparse gradient whose rows may repeat; they are
summed (coalesced), the parameter and state rows are gathered, updated by the same
kernel as dense tensors, and scattered back. Untouched rows and their state are left
exactly as they were, as in LazyAdam and the TensorFlow styles.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor


def coalesced_rows(grad: Tensor) -> tuple[Tensor, Tensor]:
    """The touched row indices (each once) and their summed gradient rows."""
    if grad.sparse_dim() != 1:
        raise RuntimeError(
            f"sparse gradients must be sparse along their first dimension only; got sparse_dim="
            f"{grad.sparse_dim()}"
        )
    grad = grad.coalesce()
    return grad.indices()[0], grad.values()


@contextmanager
def touched_rows(rows: Tensor, *tensors: Tensor) -> Iterator[list[Tensor]]:
    """Yield the `rows` of each tensor as dense tensors; write them back on exit."""
    gathered = [tensor.index_select(0, rows) for tensor in tensors]
    yield gathered
    for tensor, updated in zip(tensors, gathered, strict=True):
        tensor.index_copy_(0, rows, updated)
