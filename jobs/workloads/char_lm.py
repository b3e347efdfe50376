"""`char_lm`: a small causal transformer language model over characters of real text.

The corpus every machine has without a download: the Python standard library's own source
files (the interpreter's `Lib` folder, `sysconfig.get_paths()["stdlib"]`). Or a UTF-8 text file
under a configured data root (`text_file`, see jobs/data_roots.py).

- Files: every `*.py` below the stdlib folder except those in EXCLUDED_FOLDERS (tests, bundled
  code, generated tables: `test`, `tests`, `idlelib`, `lib2to3`, `site-packages`, `__pycache__`,
  `pydoc_data`, `encodings`), ordered by the SHA-256 of their path
  relative to the folder (a fixed shuffle, so a size cap takes a varied sample).
- Split by file: a file whose path's SHA-256 starts with a byte divisible by 10 (about one in
  ten) is validation, every other one training. Files are read in that order and joined until
  `corpus_chars` training characters and a tenth of that in validation characters are reached.
  A `text_file` is split by position instead: its last tenth is validation.
- Vocabulary: 128 ids, the ASCII code points; any other character becomes id 0 (NUL, which
  source text never holds), so the vocabulary is fixed whatever the text.
- Rows: non-overlapping windows of `context` characters, x = characters i..i+T-1 and
  y = characters i+1..i+T (every position predicts its next character); training rows from the
  training text; validation: VALIDATION_WINDOWS of the validation text's windows, evenly spaced.

The corpus depends on the interpreter's version (its stdlib), not on the framework: torch,
Keras 3 and legacy tf.keras read the same rows. Metrics: `val/loss` (nats per character) and
`val/bits_per_char` (= val/loss / ln 2).
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from jobs.data_roots import data_roots_from_environment, resolve_data_path
from jobs.workloads.base import Dataset, MetricMode, Target, Task, Workload
from optimizers.hyperparams import Param

if TYPE_CHECKING:
    from jobs.frameworks.base import Evaluation

VOCAB = 128
VALIDATION_WINDOWS = 128
# Tests, bundled third-party code and generated tables (pydoc_data's 750 kB help text, the codecs'
# mapping tables) are left out: the corpus is hand-written source.
EXCLUDED_FOLDERS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "pydoc_data", "encodings"}
)
# Embedding tables N(0, 0.02^2) in every framework (GPT-2's).
EMBEDDING_INIT_STD = 0.02


def encode(text: str) -> np.ndarray:
    """Characters -> int64 ids: ASCII code points, anything else 0."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    codes[codes >= VOCAB] = 0
    return codes


def _path_hash(relative: str) -> bytes:
    return hashlib.sha256(relative.encode()).digest()


@cache
def stdlib_files() -> tuple[tuple[str, bool], ...]:
    """(path relative to the stdlib folder, is validation) of every corpus file, in corpus order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    relative = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(name for name in subfolders if name not in EXCLUDED_FOLDERS)
        base = Path(folder).relative_to(root)
        relative += [(base / name).as_posix() for name in files if name.endswith(".py")]
    ordered = sorted(relative, key=_path_hash)
    return tuple((name, _path_hash(name)[0] % 10 == 0) for name in ordered)


def _read_stdlib(train_chars: int, val_chars: int) -> tuple[str, str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: dict[bool, list[str]] = {False: [], True: []}
    wanted = {False: train_chars, True: val_chars}
    have = {False: 0, True: 0}
    for name, validation in stdlib_files():
        if have[validation] >= wanted[validation]:
            if all(have[split] >= wanted[split] for split in wanted):
                break
            continue
        text = (root / name).read_text(encoding="utf-8", errors="replace")
        parts[validation].append(text)
        have[validation] += len(text)
    return "".join(parts[False])[:train_chars], "".join(parts[True])[:val_chars]


def _read_text_file(path: Path, train_chars: int, val_chars: int) -> tuple[str, str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    cut = len(text) - len(text) // 10
    return text[:cut][:train_chars], text[cut:][:val_chars]


def windows(ids: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping (x, y) windows, y shifted by one character."""
    rows = (len(ids) - 1) // context
    return ids[: rows * context].reshape(rows, context), ids[1 : rows * context + 1].reshape(rows, context)


@cache
def load_corpus(text_file: str, corpus_chars: int, context: int) -> Dataset:
    val_chars = max(corpus_chars // 10, VALIDATION_WINDOWS * context + 1)
    if text_file:
        path = resolve_data_path(text_file, data_roots_from_environment(), field="workload.params.text_file")
        train_text, val_text = _read_text_file(path, corpus_chars, val_chars)
        source = f"text_file {text_file!r}"
    else:
        train_text, val_text = _read_stdlib(corpus_chars, val_chars)
        source = "the standard library corpus"
    x_train, y_train = windows(encode(train_text), context)
    x_val, y_val = windows(encode(val_text), context)
    # Windows spread evenly over the whole validation text, not its first file alone.
    chosen = np.unique(
        np.linspace(0, len(x_val) - 1, min(VALIDATION_WINDOWS, len(x_val))).round().astype(int)
    )
    x_val, y_val = x_val[chosen], y_val[chosen]
    if len(x_train) == 0 or len(x_val) == 0:
        raise ValueError(
            f"workload.params: {source} gives {len(x_train)} training and {len(x_val)} validation windows "
            f"of context {context}; it needs at least one of each (more text, or a smaller context)"
        )
    return Dataset(x_train=x_train, y_train=y_train, x_val=x_val, y_val=y_val, n_classes=VOCAB)


class CharLm(Workload):
    """tokens + learned positions -> `layers` pre-norm blocks (causal self-attention, GELU MLP of
    4 x width) -> final norm -> logits over 128 characters; see torch_modules.CausalTransformer.

    Keras builds the same with its own layers (Embedding, LayerNormalization with torch's
    epsilon 1e-5, MultiHeadAttention with use_causal_mask, Dense) and one registered layer for
    the positions. Init in both: Glorot-uniform (width x width) maps for query, key, value and
    output (Keras' attention kernels are (width, heads, head) tensors, so their uniform limit is
    set to that of a (width x width) map explicitly), Glorot-uniform dense kernels, zero biases,
    embeddings N(0, 0.02^2), norms ones and zeros.
    """

    name: ClassVar[str] = "char_lm"
    summary: ClassVar[str] = (
        "character transformer LM on the Python stdlib's source (split by file) or a text file; "
        "pre-norm causal blocks, learned positions, 128-char vocabulary"
    )
    task: ClassVar[Task] = "classification"
    frameworks: ClassVar[tuple[str, ...]] = ("torch", "tensorflow")
    # adamw at lr=3e-3 (cosine, 50 warm-up steps, batch 32) reaches val/loss 2.22 in the default 600 steps.
    default_target: ClassVar[Target] = Target("val/loss", "min", 2.3)
    multiple_of: ClassVar[tuple[tuple[str, str], ...]] = (("width", "heads"),)
    data_params: ClassVar[tuple[str, ...]] = ("context", "corpus_chars", "text_file")
    params: ClassVar[dict[str, Param]] = {
        "layers": Param("layers", "int", 2, low=1, high=48, help="transformer blocks"),
        "width": Param("width", "int", 64, low=8, high=4096, help="model width; a multiple of heads"),
        "heads": Param("heads", "int", 4, low=1, high=64, help="attention heads"),
        "context": Param("context", "int", 64, low=8, high=2048, help="characters per training window"),
        "corpus_chars": Param(
            "corpus_chars",
            "int",
            1_000_000,
            low=10_000,
            high=200_000_000,
            help="training characters at most (the stdlib corpus holds about 8 million)",
        ),
        "text_file": Param(
            "text_file", "path", "", help='a UTF-8 text file under a data root; "" for the stdlib corpus'
        ),
    }

    def load_data(self, params: Mapping[str, Any] | None = None) -> Dataset:
        checked = self.check_params(params or {})
        return load_corpus(checked["text_file"], checked["corpus_chars"], checked["context"])

    def validation_metrics(self, params: Mapping[str, Any], evaluation: Evaluation) -> dict[str, float]:
        return {"val_bits_per_char": evaluation.loss / math.log(2)}

    def target_metrics(self) -> dict[str, MetricMode]:
        return {"train/loss": "min", "val/loss": "min", "val/bits_per_char": "min"}

    def torch_model(self, params: Mapping[str, Any], dataset: Dataset, *, sparse: bool = False) -> Any:
        from jobs.workloads.torch_modules import CausalTransformer

        checked = self.check_params(params)
        return CausalTransformer(
            vocab=dataset.n_classes,
            context=dataset.x_train.shape[1],
            width=checked["width"],
            heads=checked["heads"],
            layers=checked["layers"],
            init_std=EMBEDDING_INIT_STD,
        )

    def keras_model(self, params: Mapping[str, Any], dataset: Dataset, *, keras_module: Any) -> Any:
        from jobs.workloads.keras_layers import layers_for

        checked = self.check_params(params)
        width, heads = checked["width"], checked["heads"]
        context, vocab = dataset.x_train.shape[1], dataset.n_classes
        km, layers = keras_module, keras_module.layers

        def glorot() -> dict[str, Any]:
            return {"kernel_initializer": "glorot_uniform", "bias_initializer": "zeros"}

        def norm(name: str) -> Any:
            return layers.LayerNormalization(epsilon=1e-5, name=name)

        limit = math.sqrt(6.0 / (width + width))  # Glorot-uniform of a (width x width) map
        tokens = km.Input(shape=(context,), dtype="int64", name="tokens")
        embed = km.initializers.RandomNormal(mean=0.0, stddev=EMBEDDING_INIT_STD)
        x = layers.Embedding(vocab, width, embeddings_initializer=embed, name="tok_embedding")(tokens)
        x = layers_for(km).PositionEmbedding(context, width, EMBEDDING_INIT_STD, name="pos_embedding")(x)
        for index in range(checked["layers"]):
            attention = layers.MultiHeadAttention(
                num_heads=heads,
                key_dim=width // heads,
                kernel_initializer=km.initializers.RandomUniform(-limit, limit),
                bias_initializer="zeros",
                name=f"block_{index}_attention",
            )
            h = norm(f"block_{index}_norm_1")(x)
            x = layers.Add()([x, attention(h, h, use_causal_mask=True)])
            h = norm(f"block_{index}_norm_2")(x)
            h = layers.Dense(4 * width, activation="gelu", name=f"block_{index}_mlp_in", **glorot())(h)
            x = layers.Add()([x, layers.Dense(width, name=f"block_{index}_mlp_out", **glorot())(h)])
        logits = layers.Dense(vocab, name="logits", **glorot())(norm("final_norm")(x))
        return km.Model(tokens, logits, name=self.name)
