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

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FRAMEWORKS = ("torch", "keras", "tf_keras")
NAMES = sorted(WORKLOADS)
# Small non-default sizes keep every shape distinct from the defaults' and the tests quick.
SMALL = {"digits_mlp": {"hidden": 32}, "digits_cnn": {"filters": 4}, "embedding_mf": {"dim": 8}}
OUTPUT_SHAPE = {"digits_mlp": (5, 10), "digits_cnn": (5, 10), "embedding_mf": (5,)}
FIRST_ROWS = 256


def build(framework: str, workload: Workload, seed: int, params: dict[str, Any] | None = None) -> Any:
    """A fresh model as a trainer would build it, after seeding the framework's RNG."""
    dataset = workload.load_data()
    if framework == "torch":
        import torch

        torch.manual_seed(seed)
        return workload.torch_model(params or {}, dataset)
    keras_module = importlib.import_module(framework)
    keras_module.utils.set_random_seed(seed)
    return workload.keras_model(params or {}, dataset, keras_module=keras_module)


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
    """Cross-entropy of logits (classification) or MSE (regression), framework-neutral."""
    if task == "classification":
        shifted = outputs - outputs.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        return float(-log_probs[np.arange(len(y)), y].mean())
    return float(np.mean((outputs - y) ** 2))


def keras_weights_in_torch_layout(torch_model: Any, keras_model: Any) -> dict[str, np.ndarray]:
    """Every Keras weight, named and shaped as the torch parameter it corresponds to.

    Layers are paired by name, which the workloads keep equal across frameworks.
    """
    from torch import nn

    modules = dict(torch_model.named_modules())
    weighted = {name for name, module in modules.items() if list(module.parameters(recurse=False))}
    keras_layers = {layer.name: layer for layer in keras_model.layers if layer.weights}
    assert set(keras_layers) == weighted
    converted: dict[str, np.ndarray] = {}
    for name, layer in keras_layers.items():
        module = modules[name]
        if isinstance(module, nn.Embedding):
            converted[f"{name}.weight"] = np.asarray(layer.embeddings)
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
    return converted


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("name", NAMES)
def test_output_shape_on_a_batch(name: str, framework: str) -> None:
    workload = WORKLOADS[name]
    model = build(framework, workload, seed=0, params=SMALL[name])
    outputs = predict(framework, model, workload.load_data().x_train[:5])
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
    expected_default = {
        "digits_mlp": 64 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10,
        "digits_cnn": 9 * 16 + 16 + 9 * 16 * 16 + 16 + 8 * 8 * 16 * 10 + 10,
        "embedding_mf": (500 + 300) * 16,
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
    x = workload.load_data().x_val[:64]
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
            if key.endswith(".bias"):
                assert not torch_value.any() and not keras_value.any(), key
            else:
                assert 0.85 < torch_value.std() / keras_value.std() < 1.15, (framework, key)
                assert abs(torch_value.mean()) < 0.2 * torch_value.std(), key


@pytest.mark.parametrize("name", NAMES)
def test_initial_loss_has_the_same_scale_in_every_framework(name: str) -> None:
    workload = WORKLOADS[name]
    dataset = workload.load_data()
    x, y = dataset.x_train[:FIRST_ROWS], dataset.y_train[:FIRST_ROWS]
    # Near-uniform logits: ln(classes); near-zero predictions: the mean squared rating.
    expected = np.log(dataset.n_classes) if workload.task == "classification" else float(np.mean(y**2))
    for seed in (0, 1, 2):
        losses = {fw: loss(workload.task, predict(fw, build(fw, workload, seed), x), y) for fw in FRAMEWORKS}
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
    dataset = workload.load_data()
    model = build("torch", workload, seed=0, params=SMALL[name])
    x, y = torch.from_numpy(dataset.x_train[:32]), torch.from_numpy(dataset.y_train[:32])
    loss_fn = nn.CrossEntropyLoss() if workload.task == "classification" else nn.MSELoss()
    loss_fn(model(x), y).backward()
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
    x = workload.load_data().x_val[:16]
    np.testing.assert_array_equal(predict(framework, model, x), predict(framework, reloaded, x))
