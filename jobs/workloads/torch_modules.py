"""Torch building blocks shared by the workloads, initialised the way Keras initialises its layers.

Imported only while a torch model is being built, so `import jobs.workloads` stays light.
"""

from __future__ import annotations

import torch
from torch import nn


def glorot_init_(model: nn.Module) -> nn.Module:
    """Glorot-uniform weights and zero biases for every Linear and Conv2d: Keras' Dense/Conv2D
    defaults, so a workload's initial loss has the same scale in torch and Keras.

    torch's own default (Kaiming-uniform with a=sqrt(5), uniform biases) differs from Keras'.
    The fan-in/fan-out of a torch Conv2d weight (out, in, kh, kw) equals that of the Keras
    kernel (kh, kw, in, out), so the limits agree.
    """
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Conv2d):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return model


class Permute(nn.Module):
    """`x.permute(*dims)`: moves channels between Keras' channels-last and torch's channels-first."""

    def __init__(self, *dims: int) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(*self.dims)

    def extra_repr(self) -> str:
        return f"dims={self.dims}"


class MatrixFactorization(nn.Module):
    """rating(user, item) = <user_embedding[user], item_embedding[item]>, no biases."""

    def __init__(self, n_users: int, n_items: int, dim: int, *, init_std: float, sparse: bool) -> None:
        super().__init__()
        self.user_embedding = nn.Embedding(n_users, dim, sparse=sparse)
        self.item_embedding = nn.Embedding(n_items, dim, sparse=sparse)
        for embedding in (self.user_embedding, self.item_embedding):
            nn.init.normal_(embedding.weight, mean=0.0, std=init_std)

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        """(N, 2) int64 (user, item) pairs -> (N,) float32 predicted ratings."""
        users = self.user_embedding(pairs[:, 0])
        items = self.item_embedding(pairs[:, 1])
        return (users * items).sum(dim=-1)
