"""One workload, one model, in torch, Keras 3 and legacy tf.keras.

The strongest check is the weight transfer: Keras weights copied into the torch model give
the same outputs, so architecture, layer order, padding and flattening order all agree.
The rest checks what users compare: parameter counts, initialisation and initial loss.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jobs.workloads import WORKLOADS, Workload
from jobs.workloads.char_lm import VOCAB
from jobs.workloads.surfaces import quadratic_hessian, quadratic_start, quadratic_value, rosenbrock_value
from tests.jobs.workloads.conftest import NPZ_CLASSES, NPZ_FEATURES, NPZ_FILE

pytestmark = pytest.mark.usefixtures("one_torch_thread", "data_root")

FRAMEWORKS = ("torch", "keras", "tf_keras")
NAMES = sorted(WORKLOADS)
# What a workload needs given (npz: its file, under the data root of the `data_root` fixture).
REQUIRED: dict[str, dict[str, Any]] = {"npz": {"path": NPZ_FILE}}
# Small non-default sizes keep every shape distinct from the defaults' and the tests quick.
SMALL: dict[str, dict[str, Any]] = {
    "digits_mlp": {"hidden": 32},
    "digits_cnn": {"filters": 4},
    "embedding_mf": {"dim": 8},
    "quadratic": {"dim": 5, "condition": 10.0},
    "rosenbrock": {"start_x": 0.5, "start_y": -0.5},
    "char_lm": {"layers": 1, "width": 16, "heads": 2, "context": 12, "corpus_chars": 20_000},
    "npz": {"hidden": 8, "layers": 1},
}
OUTPUT_SHAPE = {
    "digits_mlp": (5, 10),
    "digits_cnn": (5, 10),
    "embedding_mf": (5,),
    "quadratic": (5,),
    "rosenbrock": (5,),
    "char_lm": (5, 12, VOCAB),
    "npz": (5, NPZ_CLASSES),
}
FIRST_ROWS = 256


def params_of(workload: Workload, params: dict[str, Any] | None) -> dict[str, Any]:
    return {**REQUIRED.get(workload.name, {}), **(params or {})}


def data_of(workload: Workload, params: dict[str, Any] | None = None) -> Any:
    return workload.load_data(params_of(workload, params))


def build(framework: str, workload: Workload, seed: int, params: dict[str, Any] | None = None) -> Any:
    """A fresh model as a trainer would build it, after seeding the framework's RNG."""
    params = params_of(workload, params)
    dataset = workload.load_data(params)
    if framework == "torch":
        import torch

        torch.manual_seed(seed)
        return workload.torch_model(params, dataset)
    keras_module = importlib.import_module(framework)
    keras_module.utils.set_random_seed(seed)
    return workload.keras_model(params, dataset, keras_module=keras_module)


def predict(framework: str, model: Any, x: np.ndarray) -> np.ndarray:
    if framework == "torch":
        import torch

        with torch.no_grad():
            return np.asarray(model(torch.from_numpy(x)).numpy())
    return np.asarray(model(x, training=False))


def trainable_count(framework: str, model: Any) -> int:
    if framework == "torch":
        return sum(p.numel() for p in model.parameters() if p.requires_grad)
    return sum(int(np.prod(w.shape)) for w in model.trainable_weights)


def loss(task: str, outputs: np.ndarray, y: np.ndarray) -> float:
    """Cross-entropy of logits (classification; any leading shape) or MSE (regression), framework-neutral;
    a test function's output is its loss."""
    if task == "objective":
        return float(np.mean(outputs))
    if task == "classification":
        shifted = outputs - outputs.max(axis=-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
        return float(-np.take_along_axis(log_probs, y[..., None], axis=-1).mean())
    return float(np.mean((outputs.reshape(-1) - y) ** 2))


def task_of(workload: Workload) -> str:
    return workload.task_of(data_of(workload))


def keras_weights_in_torch_layout(torch_model: Any, keras_model: Any) -> dict[str, np.ndarray]:
    """Every Keras weight, named and shaped as the torch parameter it corresponds to.

    Layers are paired by name, which the workloads keep equal across frameworks.
    """
    from torch import nn

    modules = dict(torch_model.named_modules())
    keras_layers = {layer.name: layer for layer in keras_model.layers if layer.weights}
    converted: dict[str, np.ndarray] = {}
    for name, layer in keras_layers.items():
        module = modules[name]
        if isinstance(module, nn.Embedding) or type(module).__name__ == "PositionEmbedding":
            converted[f"{name}.weight"] = np.asarray(layer.embeddings)
            continue
        if type(module).__name__ == "SurfacePoint":
            converted[f"{name}.point"] = np.asarray(layer.point)
            continue
        if isinstance(module, nn.LayerNorm):
            converted[f"{name}.weight"], converted[f"{name}.bias"] = (
                np.asarray(layer.gamma),
                np.asarray(layer.beta),
            )
            continue
        if type(module).__name__ == "CausalSelfAttention":
            # Keras keeps (width, heads, head) kernels and (heads, head) biases; torch (width x width) maps.
            # Keras 3 names the parts `query_dense`...; tf_keras keeps them private (`_query_dense`).
            parts = {
                part: getattr(layer, f"{inner}_dense", None) or getattr(layer, f"_{inner}_dense")
                for part, inner in (
                    ("query", "query"),
                    ("key", "key"),
                    ("value", "value"),
                    ("output", "output"),
                )
            }
            width = np.asarray(parts["query"].kernel).shape[0]
            for part, dense in parts.items():
                converted[f"{name}.{part}.weight"] = np.asarray(dense.kernel).reshape(width, width).T
                converted[f"{name}.{part}.bias"] = np.asarray(dense.bias).reshape(width)
            continue
        kernel = np.asarray(layer.kernel)
        if isinstance(module, nn.Linear):
            converted[f"{name}.weight"] = kernel.T  # (in, out) -> (out, in)
        elif isinstance(module, nn.Conv2d):
            converted[f"{name}.weight"] = kernel.transpose(
                3, 2, 0, 1
            )  # (kh, kw, in, out) -> (out, in, kh, kw)
        else:
            raise AssertionError(f"no Keras mapping for torch module {name}: {type(module).__name__}")
        converted[f"{name}.bias"] = np.asarray(layer.bias)
    assert set(converted) == set(torch_model.state_dict())
    return converted


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("name", NAMES)
def test_output_shape_on_a_batch(name: str, framework: str) -> None:
    workload = WORKLOADS[name]
    model = build(framework, workload, seed=0, params=SMALL[name])
    outputs = predict(framework, model, data_of(workload, SMALL[name]).x_train[:5])
    assert outputs.shape == OUTPUT_SHAPE[name]
    assert outputs.dtype == np.float32
    if framework != "torch":
        assert getattr(model, "optimizer", None) is None  # handed over uncompiled
        assert model.name == name


@pytest.mark.parametrize("name", NAMES)
def test_same_trainable_parameter_count_everywhere(name: str) -> None:
    workload = WORKLOADS[name]
    for params in ({}, SMALL[name]):
        counts = {fw: trainable_count(fw, build(fw, workload, seed=0, params=params)) for fw in FRAMEWORKS}
        assert len(set(counts.values())) == 1, counts
    width, context = 64, 64  # char_lm's defaults, two blocks
    block = (
        2 * 2 * width
        + 4 * (width * width + width)
        + (width * 4 * width + 4 * width)
        + (4 * width * width + width)
    )
    expected_default = {
        "digits_mlp": 64 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10,
        "digits_cnn": 9 * 16 + 16 + 9 * 16 * 16 + 16 + 8 * 8 * 16 * 10 + 10,
        "embedding_mf": (500 + 300) * 16,
        "quadratic": 2,
        "rosenbrock": 2,
        "char_lm": VOCAB * width + context * width + 2 * block + 2 * width + width * VOCAB + VOCAB,
        "npz": NPZ_FEATURES * 64 + 64 + 64 * 64 + 64 + 64 * NPZ_CLASSES + NPZ_CLASSES,
    }[name]
    assert trainable_count("torch", build("torch", workload, seed=0)) == expected_default


@pytest.mark.parametrize("framework", ["keras", "tf_keras"])
@pytest.mark.parametrize("name", NAMES)
def test_keras_weights_in_torch_give_the_same_outputs(name: str, framework: str) -> None:
    import torch

    workload = WORKLOADS[name]
    torch_model = build("torch", workload, seed=0, params=SMALL[name])
    keras_model = build(framework, workload, seed=1, params=SMALL[name])
    converted = keras_weights_in_torch_layout(torch_model, keras_model)
    torch_model.load_state_dict(
        {key: torch.from_numpy(np.ascontiguousarray(v)) for key, v in converted.items()}
    )
    x = data_of(workload, SMALL[name]).x_val[:64]
    np.testing.assert_allclose(
        predict("torch", torch_model, x), predict(framework, keras_model, x), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("name", NAMES)
def test_same_initialisation_scheme(name: str) -> None:
    """Per weight tensor: the same spread in every framework; biases exactly zero."""
    workload = WORKLOADS[name]
    torch_model = build("torch", workload, seed=0)
    torch_weights = {key: value.detach().numpy() for key, value in torch_model.state_dict().items()}
    for framework in ("keras", "tf_keras"):
        keras_weights = keras_weights_in_torch_layout(torch_model, build(framework, workload, seed=0))
        assert set(keras_weights) == set(torch_weights)
        for key, keras_value in keras_weights.items():
            torch_value = torch_weights[key]
            if np.array_equal(torch_value, keras_value):
                continue  # a fixed start (a test function's point), LayerNorm's ones: the same values
            if key.endswith(".bias"):
                assert not torch_value.any() and not keras_value.any(), key
            else:
                assert 0.85 < torch_value.std() / keras_value.std() < 1.15, (framework, key)
                assert abs(torch_value.mean()) < 0.2 * torch_value.std(), key


INITIAL_VALUE = {
    "quadratic": float(quadratic_value(quadratic_start(2), quadratic_hessian(2, 100.0))),
    "rosenbrock": float(rosenbrock_value(np.array(-1.2), np.array(1.0))),
}


@pytest.mark.parametrize("name", NAMES)
def test_initial_loss_has_the_same_scale_in_every_framework(name: str) -> None:
    workload = WORKLOADS[name]
    dataset = data_of(workload)
    task = task_of(workload)
    rows = FIRST_ROWS // dataset.x_train.shape[1] if name == "char_lm" else FIRST_ROWS  # windows of chars
    x, y = dataset.x_train[:rows], dataset.y_train[:rows]
    # Near-uniform logits: ln(classes); near-zero predictions: the mean squared rating; a test
    # function: its value at the documented start.
    expected = {
        "classification": lambda: np.log(dataset.n_classes),
        "regression": lambda: float(np.mean(y**2)),
        "objective": lambda: INITIAL_VALUE[name],
    }[task]()
    for seed in (0, 1, 2):
        losses = {fw: loss(task, predict(fw, build(fw, workload, seed), x), y) for fw in FRAMEWORKS}
        assert max(losses.values()) / min(losses.values()) < 1.5, (seed, losses)
        for framework, value in losses.items():
            assert expected / 1.5 < value < expected * 1.5, (seed, framework, value, expected)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_seeded_initialisation_is_reproducible(framework: str) -> None:
    workload = WORKLOADS["digits_cnn"]
    x = workload.load_data().x_train[:8]
    same = [
        predict(framework, build(framework, workload, seed=3, params=SMALL["digits_cnn"]), x) for _ in "ab"
    ]
    other = predict(framework, build(framework, workload, seed=4, params=SMALL["digits_cnn"]), x)
    np.testing.assert_array_equal(same[0], same[1])
    assert not np.array_equal(same[0], other)


@pytest.mark.parametrize("name", NAMES)
def test_torch_trains_on_the_dataset_arrays_as_they_are(name: str) -> None:
    """The torch trainer feeds `torch.from_numpy` rows; the loss follows the task."""
    import torch
    from torch import nn

    workload = WORKLOADS[name]
    dataset = data_of(workload, SMALL[name])
    model = build("torch", workload, seed=0, params=SMALL[name])
    x, y = torch.from_numpy(dataset.x_train[:32]), torch.from_numpy(dataset.y_train[:32])
    output = model(x)
    task = task_of(workload)
    if task == "objective":
        output.mean().backward()
    elif task == "classification":
        nn.CrossEntropyLoss()(output.flatten(0, -2), y.flatten()).backward()
    else:
        nn.MSELoss()(output.reshape(-1), y).backward()
    assert all(p.grad is not None and not p.grad.is_sparse for p in model.parameters())


@pytest.mark.parametrize("sparse", [True, False])
def test_torch_sparse_embeddings_give_sparse_gradients(sparse: bool) -> None:
    import torch

    workload = WORKLOADS["embedding_mf"]
    dataset = workload.load_data()
    torch.manual_seed(0)
    model = workload.torch_model({}, dataset, sparse=sparse)
    x, y = torch.from_numpy(dataset.x_train[:64]), torch.from_numpy(dataset.y_train[:64])
    torch.nn.functional.mse_loss(model(x), y).backward()
    for embedding in (model.user_embedding, model.item_embedding):
        assert embedding.sparse is sparse
        assert embedding.weight.grad.is_sparse is sparse
    touched = model.user_embedding.weight.grad.coalesce().indices() if sparse else None
    if touched is not None:
        assert set(touched[0].tolist()) == set(dataset.x_train[:64, 0].tolist())


def test_sparse_flag_is_ignored_without_embeddings() -> None:
    import torch

    for name in ("digits_mlp", "digits_cnn"):
        workload = WORKLOADS[name]
        torch.manual_seed(0)
        dense = workload.torch_model({}, workload.load_data())
        torch.manual_seed(0)
        flagged = workload.torch_model({}, workload.load_data(), sparse=True)
        for a, b in zip(dense.state_dict().values(), flagged.state_dict().values(), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("framework", ["keras", "tf_keras"])
def test_keras_embedding_gradients_are_indexed_slices(framework: str) -> None:
    import tensorflow as tf

    workload = WORKLOADS["embedding_mf"]
    dataset = workload.load_data()
    model = build(framework, workload, seed=0)
    with tf.GradientTape() as tape:
        predictions = model(dataset.x_train[:64], training=True)
        mse = tf.reduce_mean(tf.square(predictions - dataset.y_train[:64]))
    gradients = tape.gradient(mse, model.trainable_weights)
    assert len(gradients) == 2
    assert all(isinstance(gradient, tf.IndexedSlices) for gradient in gradients)


# Keras 3's own saving code converts tf variables with np.array(..., copy=False) and numpy 2 warns.
@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")
@pytest.mark.filterwarnings("ignore:You are saving your model as an HDF5 file")
@pytest.mark.parametrize(
    ("framework", "suffix"), [("keras", ".keras"), ("tf_keras", ".keras"), ("tf_keras", ".h5")]
)
@pytest.mark.parametrize("name", NAMES)
def test_keras_model_survives_a_whole_model_file_round_trip(
    name: str, framework: str, suffix: str, tmp_path: Path
) -> None:
    """The Keras trainer saves whole models (Keras 3: `.keras`; legacy: h5) and loads them without
    custom objects, so no layer here may need one."""
    keras_module = importlib.import_module(framework)
    workload = WORKLOADS[name]
    model = build(framework, workload, seed=0, params=SMALL[name])
    path = tmp_path / f"{name}{suffix}"
    model.save(path)
    reloaded = keras_module.models.load_model(path)
    for saved, loaded in zip(model.get_weights(), reloaded.get_weights(), strict=True):
        np.testing.assert_array_equal(saved, loaded)
    x = data_of(workload, SMALL[name]).x_val[:16]
    np.testing.assert_array_equal(predict(framework, model, x), predict(framework, reloaded, x))
