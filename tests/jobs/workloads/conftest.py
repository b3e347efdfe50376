"""A data root holding a tiny npz file (three classes, generated), set as OPTLAB_DATA_ROOTS."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

NPZ_FILE = "tiny.npz"
NPZ_ROWS, NPZ_FEATURES, NPZ_CLASSES = 300, 6, 3


def write_tiny_npz(path: Path) -> None:
    """Three Gaussian blobs in 6-D: learnable in a few steps."""
    rng = np.random.default_rng(7)
    labels = rng.integers(0, NPZ_CLASSES, NPZ_ROWS)
    centres = rng.normal(0.0, 2.0, (NPZ_CLASSES, NPZ_FEATURES))
    features = centres[labels] + rng.normal(0.0, 0.5, (NPZ_ROWS, NPZ_FEATURES))
    np.savez(path, X=features.astype(np.float32), y=labels)


@pytest.fixture(scope="session")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("data-root")
    write_tiny_npz(root / NPZ_FILE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPTLAB_DATA_ROOTS", str(root))
        yield root
