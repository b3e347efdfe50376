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


class SurfacePoint(nn.Module):
    """A test function's parameter vector `point`; forward gives f(point) for each input row.

    The rows carry no information (the data of a test function is only how many rows a batch
    has), so the mean over a batch is f(point) itself. f as `jobs.workloads.surfaces` defines it:
    `hessian` given, 0.5 w^T H w; None, Rosenbrock's function of a 2-vector.
    """

    def __init__(self, start: torch.Tensor, hessian: torch.Tensor | None) -> None:
        super().__init__()
        self.point = nn.Parameter(start.clone())
        # Not in the state dict: a constant of the workload's definition, rebuilt from its params.
        self.register_buffer("hessian", hessian, persistent=False)

    hessian: torch.Tensor | None

    def value(self) -> torch.Tensor:
        w = self.point
        if self.hessian is None:
            x, y = w[0], w[1]
            return (1.0 - x) ** 2 + 100.0 * (y - x**2) ** 2
        return 0.5 * torch.dot(w, torch.mv(self.hessian, w))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.value().expand(rows.shape[0])


class PositionEmbedding(nn.Module):
    """A learned (context, width) table added to the token embeddings (GPT-2's positions)."""

    def __init__(self, context: int, width: int, *, init_std: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(context, width))
        nn.init.normal_(self.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight[: x.shape[1]]


class CausalSelfAttention(nn.Module):
    """Multi-head attention over earlier positions only: `query`, `key`, `value` and `output` are
    (width x width) maps, heads split head-major as Keras' MultiHeadAttention splits them."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)
        self.output = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.view(batch, length, self.heads, width // self.heads).transpose(1, 2)

        attended = nn.functional.scaled_dot_product_attention(
            split(self.query(x)), split(self.key(x)), split(self.value(x)), is_causal=True
        )
        return self.output(attended.transpose(1, 2).reshape(batch, length, width))


class CausalTransformer(nn.Module):
    """A pre-norm GPT-style character model: tokens + learned positions, `layers` blocks of
    x + attention(norm(x)) and x + mlp(norm(x)) (width -> 4 width, GELU, -> width), a final norm
    and untied logits.

    Modules are named as the Keras model's layers (`tok_embedding`, `block_0_attention`, ...,
    `logits`), so weights map across by name. Linear maps Glorot-uniform with zero biases,
    embeddings N(0, init_std^2), norms ones and zeros: the same in Keras.
    """

    def __init__(
        self, *, vocab: int, context: int, width: int, heads: int, layers: int, init_std: float
    ) -> None:
        super().__init__()
        self.layers = layers
        self.tok_embedding = nn.Embedding(vocab, width)
        self.pos_embedding = PositionEmbedding(context, width, init_std=init_std)
        for index in range(layers):
            self.add_module(f"block_{index}_norm_1", nn.LayerNorm(width))
            self.add_module(f"block_{index}_attention", CausalSelfAttention(width, heads))
            self.add_module(f"block_{index}_norm_2", nn.LayerNorm(width))
            self.add_module(f"block_{index}_mlp_in", nn.Linear(width, 4 * width))
            self.add_module(f"block_{index}_mlp_out", nn.Linear(4 * width, width))
        self.final_norm = nn.LayerNorm(width)
        self.logits = nn.Linear(width, vocab)
        glorot_init_(self)
        nn.init.normal_(self.tok_embedding.weight, mean=0.0, std=init_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(N, T) int64 characters -> (N, T, vocab) float32 logits of each next character."""
        x = self.pos_embedding(self.tok_embedding(tokens))
        for index in range(self.layers):
            block = {name: getattr(self, f"block_{index}_{name}") for name in _BLOCK_PARTS}
            x = x + block["attention"](block["norm_1"](x))
            x = x + block["mlp_out"](nn.functional.gelu(block["mlp_in"](block["norm_2"](x))))
        logits: torch.Tensor = self.logits(self.final_norm(x))
        return logits


_BLOCK_PARTS = ("norm_1", "attention", "norm_2", "mlp_in", "mlp_out")
