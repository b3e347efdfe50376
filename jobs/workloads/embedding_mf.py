"""Matrix factorisation on generated ratings with known low-rank structure: the embedding workload.

Its gradients are sparse by nature (a batch touches a few rows of each table), which is
what optimizers with lazy/sparse row updates are for. The ratings are generated, not
downloaded, from a fixed seed: they are part of the workload's definition, like the
digits split, so every job, seed and framework sees the same data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

import numpy as np

from jobs.workloads.base import Dataset, Target, Task, Workload
from optimizers.hyperparams import Param

GENERATOR_SEED = 20240301
N_USERS = 500
N_ITEMS = 300
TRUE_RANK = 4
N_RATINGS = 20_000  # distinct observed (user, item) cells out of 150,000
VALIDATION_SIZE = 2_000  # 10%
NOISE_STD = 0.1
# Same std in every framework; small, so the initial predictions are ~0 and the initial
# MSE is ~ mean(rating^2) ~ 1 everywhere.
EMBEDDING_INIT_STD = 0.1


@dataclass(frozen=True)
class GeneratedRatings:
    """The generator's ground truth (for tests and curious users) and the split it yields."""

    user_factors: np.ndarray  # (N_USERS, TRUE_RANK) float64
    item_factors: np.ndarray  # (N_ITEMS, TRUE_RANK) float64
    dataset: Dataset


@cache
def generate_ratings() -> GeneratedRatings:
    """rating = <user_factor, item_factor> + N(0, NOISE_STD^2) on N_RATINGS random distinct cells.

    Factors are N(0, TRUE_RANK^-1/2), so the noiseless ratings have variance ~1. The cells
    come out in random order; the first VALIDATION_SIZE are validation.
    """
    rng = np.random.default_rng(GENERATOR_SEED)
    scale = TRUE_RANK**-0.25
    user_factors = rng.normal(0.0, scale, size=(N_USERS, TRUE_RANK))
    item_factors = rng.normal(0.0, scale, size=(N_ITEMS, TRUE_RANK))
    cells = rng.choice(N_USERS * N_ITEMS, size=N_RATINGS, replace=False)
    users, items = np.divmod(cells, N_ITEMS)
    clean = np.einsum("nk,nk->n", user_factors[users], item_factors[items])
    ratings = (clean + rng.normal(0.0, NOISE_STD, size=N_RATINGS)).astype(np.float32)
    pairs = np.stack([users, items], axis=1).astype(np.int64)
    dataset = Dataset(
        x_train=pairs[VALIDATION_SIZE:],
        y_train=ratings[VALIDATION_SIZE:],
        x_val=pairs[:VALIDATION_SIZE],
        y_val=ratings[:VALIDATION_SIZE],
        n_classes=0,
    )
    return GeneratedRatings(user_factors=user_factors, item_factors=item_factors, dataset=dataset)


class EmbeddingMf(Workload):
    """rating(user, item) = sum(user_embedding[user] * item_embedding[item]); no biases.

    x: (N, 2) int64 (user, item) pairs; y: (N,) float32 ratings; the model outputs (N,)
    float32. Embeddings are N(0, 0.1^2) in every framework. `torch_model(..., sparse=True)`
    gives sparse embedding gradients; in Keras (TensorFlow) they arrive as tf.IndexedSlices.
    Layer names match across frameworks (`user_embedding`, `item_embedding`).
    """

    name: ClassVar[str] = "embedding_mf"
    summary: ClassVar[str] = (
        f"matrix factorisation, generated rank-{TRUE_RANK} ratings ({N_USERS} users x {N_ITEMS} items, "
        f"{N_RATINGS - VALIDATION_SIZE} train / {VALIDATION_SIZE} val), dot of two embeddings; MSE"
    )
    task: ClassVar[Task] = "regression"
    frameworks: ClassVar[tuple[str, ...]] = ("torch", "tensorflow")
    default_target: ClassVar[Target] = Target("val/loss", "min", 0.1)
    params: ClassVar[dict[str, Param]] = {
        "dim": Param("dim", "int", 16, low=1, high=256, help="embedding width of users and items"),
    }

    def load_data(self, params: Mapping[str, Any] | None = None) -> Dataset:
        return generate_ratings().dataset

    def torch_model(self, params: Mapping[str, Any], dataset: Dataset, *, sparse: bool = False) -> Any:
        from jobs.workloads.torch_modules import MatrixFactorization

        dim = self.check_params(params)["dim"]
        return MatrixFactorization(N_USERS, N_ITEMS, dim, init_std=EMBEDDING_INIT_STD, sparse=sparse)

    def keras_model(self, params: Mapping[str, Any], dataset: Dataset, *, keras_module: Any) -> Any:
        dim = self.check_params(params)["dim"]
        layers = keras_module.layers

        def embedding(rows: int, name: str) -> Any:
            init = keras_module.initializers.RandomNormal(mean=0.0, stddev=EMBEDDING_INIT_STD)
            return layers.Embedding(rows, dim, embeddings_initializer=init, name=name)

        pairs = keras_module.Input(shape=(2,), dtype="int64", name="pairs")
        users = embedding(N_USERS, "user_embedding")(pairs[:, 0])
        items = embedding(N_ITEMS, "item_embedding")(pairs[:, 1])
        rating = layers.Dot(axes=1, name="dot")([users, items])[:, 0]  # (N, 1) -> (N,)
        return keras_module.Model(pairs, rating, name=self.name)
