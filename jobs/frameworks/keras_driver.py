"""The TensorFlow drivers: Keras 3 (`keras`) and legacy tf.keras (`tf_keras`) optimizers.

One TensorFlow driver with a subclass per style for the few things the two Keras APIs do
differently (module, state creation, applying gradients, schedule class, whole-model
format). The training step is compiled with `tf.function` (optionally XLA). Every
checkpoint proves the optimizer survives a save the Keras way:

1. the whole model saved (`.keras`; legacy: h5) and loaded WITHOUT custom objects must
   bring back the same optimizer class, config, iterations and variables;
2. `tf.train.Checkpoint(model, optimizer)` written and read into freshly built objects
   (optimizer variables created first, so nothing is restored lazily out of sight)
   must compare equal: this is the round-trip of record, and training continues from
   those fresh objects.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from jobs.batches import BatchOrder
from jobs.frameworks.base import (
    Capabilities,
    Checkpointed,
    CheckpointMismatch,
    Driver,
    Evaluation,
    StepRecord,
    TrainingSession,
)
from jobs.spec import JobSpec
from jobs.workloads import Workload
from optimizers.hyperparams import check_all
from optimizers.registry import Entry
from optimizers.schedules import build_schedule


class GraphModeError(RuntimeError):
    """The optimizer's update works eagerly but not inside tf.function."""


@dataclass
class KerasObjects:
    model: Any
    optimizer: Any
    gradients: Callable[..., Any]
    apply: _Compiled


class KerasDriver(Driver):
    """Keras 3 optimizers (`keras.optimizers.Optimizer`) on the TensorFlow backend."""

    style: ClassVar[str] = "keras"
    framework: ClassVar[str] = "tensorflow"
    capabilities: ClassVar[Capabilities] = Capabilities(whole_model_save=True)
    model_suffix: ClassVar[str] = ".keras"

    def __init__(self) -> None:
        import tensorflow as tf

        self.tf = tf
        self.km = self._keras_module()

    def _keras_module(self) -> Any:
        import keras

        return keras

    def schedule_class(self) -> Any:
        from optimizers.keras.schedules import OptlabSchedule

        return OptlabSchedule

    def create_state(self, optimizer: Any, variables: Sequence[Any]) -> None:
        """Make every optimizer variable now, eagerly, before any step is compiled."""
        optimizer.build(list(variables))

    def apply(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        """One update, called the way the style's own training loop calls it."""
        optimizer.apply(list(grads), list(variables))

    def reloads_no_state(self, saved: Any, reloaded: Any) -> bool:
        """Whether a whole-model format gave the optimizer back with no state at all, as it does
        for every optimizer of the style (then it is the format's loss, not the optimizer's)."""
        return False

    def session(self, spec: JobSpec, entry: Entry, workload: Workload, workdir: Path) -> KerasSession:
        return KerasSession(self, spec, entry, workload)

    # -- fresh-process checks --
    fresh_module: ClassVar[str] = "jobs.checks.fresh.keras_child"  # both Keras styles


class LegacyKerasDriver(KerasDriver):
    """Legacy tf.keras optimizers (`tf_keras.optimizers.legacy.Optimizer`, Keras 2's OptimizerV2),
    driven through `tf_keras` directly, so both Keras styles can share one process."""

    style: ClassVar[str] = "tf_legacy"
    # h5 keeps a legacy optimizer's iterations and slots; SavedModel and .keras reload them
    # as zero (the formats' documented behaviour, not the optimizer's).
    model_suffix: ClassVar[str] = ".h5"

    def _keras_module(self) -> Any:
        import tf_keras

        return tf_keras

    def schedule_class(self) -> Any:
        from optimizers.tf_legacy.schedules import OptlabLegacySchedule

        return OptlabLegacySchedule

    def create_state(self, optimizer: Any, variables: Sequence[Any]) -> None:
        optimizer._create_all_weights(list(variables))  # the legacy API's only way to make slots now

    def apply(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        optimizer.apply_gradients(list(zip(grads, variables, strict=True)))

    def reloads_no_state(self, saved: Any, reloaded: Any) -> bool:
        """A whole-model format that gave the optimizer back without any state (legacy optimizers
        from .keras or SavedModel, built-ins too): the format's loss, not the optimizer's."""
        return int(reloaded.iterations) == 0 < int(saved.iterations)


class KerasSession(TrainingSession):
    def __init__(self, driver: KerasDriver, spec: JobSpec, entry: Entry, workload: Workload) -> None:
        self.driver = driver
        self.tf = tf = driver.tf
        self.km = driver.km
        self.spec = spec
        self.entry = entry
        self.workload = workload
        self.dataset = workload.load_data()
        self.regression = workload.task == "regression"
        self.device = self._choose_device(spec.device)
        self.lr_multiplier = build_schedule(spec.schedule.name, spec.schedule.params, total_steps=spec.steps)
        self.base_lr = float(spec.optimizer.params.get("lr", entry.params["lr"].default))
        self.km.utils.set_random_seed(spec.seed)
        tf.config.experimental.enable_op_determinism()
        self.order = BatchOrder(len(self.dataset.x_train), batch_size=spec.batch_size, seed=spec.seed)
        with tf.device(self.device):
            self.x_train, self.y_train = tf.constant(self.dataset.x_train), tf.constant(self.dataset.y_train)
            self.x_val, self.y_val = tf.constant(self.dataset.x_val), tf.constant(self.dataset.y_val)

    def scope(self) -> AbstractContextManager[Any]:
        return self.tf.device(self.device)

    # -- objects ---------------------------------------------------------------------------------------

    def build(self) -> KerasObjects:
        """A fresh model and optimizer as the spec describes them, optimizer variables created."""
        model = self.workload.keras_model(self.spec.workload.params, self.dataset, keras_module=self.km)
        schedule = self.driver.schedule_class()(
            self.base_lr, self.spec.schedule.name, self.spec.schedule.params, self.spec.steps
        )
        optimizer = self.entry.create(self.spec.optimizer.params, learning_rate=schedule)
        self.driver.create_state(optimizer, model.trainable_variables)
        model.compile(optimizer=optimizer)  # so a whole-model save carries the optimizer
        return KerasObjects(model, optimizer, *self._step_functions(model, optimizer))

    def _step_functions(self, model: Any, optimizer: Any) -> tuple[Callable[..., Any], _Compiled]:
        tf = self.tf
        variables = model.trainable_variables
        loss_of = self._loss
        driver = self.driver

        def gradients(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_of(model(x, training=True), y)
            grads = tape.gradient(loss, variables)
            return loss, grads, tf.linalg.global_norm(grads)

        def apply(grads: Any) -> None:
            driver.apply(optimizer, grads, variables)

        jit = self.spec.jit_compile
        return tf.function(gradients, jit_compile=jit), _Compiled(apply, tf.function(apply, jit_compile=jit))

    def _loss(self, output: Any, y: Any) -> Any:
        tf = self.tf
        if self.regression:
            return tf.reduce_mean(tf.square(tf.reshape(output, [-1]) - y))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=output))

    # -- training --------------------------------------------------------------------------------------

    def batch(self, step: int) -> tuple[Any, Any]:
        rows = self.tf.constant(self.order.rows(step))
        return self.tf.gather(self.x_train, rows), self.tf.gather(self.y_train, rows)

    def train_step(self, objects: KerasObjects, batch: Any, step: int) -> StepRecord:
        lr = self.base_lr * self.lr_multiplier(step)
        loss, grads, grad_norm = objects.gradients(*batch)
        optimizer_started = time.perf_counter()
        self._apply(objects, grads, first=step == 0)
        optimizer_ms = (time.perf_counter() - optimizer_started) * 1000
        return StepRecord(loss=float(loss), grad_norm=float(grad_norm), lr=lr, optimizer_ms=optimizer_ms)

    def _apply(self, objects: KerasObjects, grads: Any, *, first: bool) -> None:
        if not first:
            objects.apply.compiled(grads)
            return
        try:
            objects.apply.compiled(grads)
        except Exception as graph_error:
            self._explain_graph_failure(graph_error, grads)
            raise

    def _explain_graph_failure(self, graph_error: Exception, grads: Any) -> None:
        """Retry the first update eagerly on fresh objects: if that works, the optimizer is
        not graph-compatible, and the error says so and where; else the original error stands."""
        fresh = self.build()
        try:
            fresh.apply.eager(grads)
        except Exception:
            return
        where = self._user_frame(graph_error)
        raise GraphModeError(
            f"the update step of optimizer {self.entry.name!r} ({self.entry.style}) works eagerly but not "
            f"inside tf.function{where}: {type(graph_error).__name__}: {graph_error}. Use tensor ops "
            "(tf.where, tf.cond) instead of Python if/while on tensor values, and no .numpy() or "
            "float(tensor) inside update_step"
        ) from graph_error

    def _user_frame(self, error: BaseException) -> str:
        try:
            source = inspect.getsourcefile(self.entry.cls)
        except TypeError:
            return ""
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == source]
        if not frames:
            return f" (class {self.entry.cls.__qualname__} in {source})"
        return f" at {frames[-1].filename}:{frames[-1].lineno} (`{frames[-1].line}`)"

    def evaluate(self, objects: KerasObjects) -> Evaluation:
        output = objects.model(self.x_val, training=False)
        return Evaluation(
            loss=float(self._loss(output, self.y_val)), outputs=np.asarray(output), labels=self.dataset.y_val
        )

    def params_sha256(self, objects: KerasObjects) -> str:
        return weights_sha256(objects.model)

    def details(self, objects: KerasObjects) -> dict[str, Any]:
        return {"style": self.entry.style, "variable_placement": self._placement(objects)}

    # -- checkpoints -----------------------------------------------------------------------------------

    def checkpoint(self, objects: KerasObjects, step: int, folder: Path) -> Checkpointed:
        path = folder / f"step-{step:08d}"
        path.mkdir(exist_ok=True)
        warnings = self._whole_model_roundtrip(objects, path / f"model{self.driver.model_suffix}")
        reloaded = self._checkpoint_of_record(objects, path / "ckpt")
        return Checkpointed(reloaded, path, warnings)

    def _whole_model_roundtrip(self, objects: KerasObjects, path: Path) -> list[str]:
        objects.model.save(path)
        loaded = self.km.models.load_model(path)  # no custom_objects: registered classes by name
        optimizer = loaded.optimizer
        expected = type(objects.optimizer)
        if type(optimizer) is not expected:
            raise CheckpointMismatch(
                f"{path.name}: the optimizer came back as {type(optimizer).__name__}, not "
                f"{expected.__name__}; register the class with register_keras_serializable"
            )
        self._check_config_has_hyperparameters(optimizer, path.name)
        if self.driver.reloads_no_state(objects.optimizer, optimizer):
            # The tf.train.Checkpoint round-trip stays the one of record: warn, do not fail.
            return [
                f"{path.name}: the whole-model format reloaded the optimizer without its state "
                f"(iterations 0, not {int(objects.optimizer.iterations)}); resume from the "
                "tf.train.Checkpoint instead"
            ]
        compare_optimizers(objects.optimizer, optimizer, path.name)
        return []

    def _check_config_has_hyperparameters(self, optimizer: Any, where: str) -> None:
        """Every hyperparameter this job set must come back from the saved config.

        Comparing the saved and the reloaded config cannot see one missing from both, yet
        the reloaded optimizer would silently run with its default.
        """
        config = plain_config(optimizer)
        given = check_all(
            self.spec.optimizer.params, self.entry.params, owner=f"optimizer {self.entry.name!r}"
        )
        for name, value in given.items():
            if name == "lr":
                continue  # carried by the learning-rate schedule, compared with the config
            if name not in config:
                raise CheckpointMismatch(
                    f"{where}: hyperparameter {name!r} is missing from "
                    f"{type(optimizer).__name__}.get_config(); a reloaded optimizer would silently use "
                    "its default. Return every constructor argument"
                )
            if not same_config_value(config[name], value):
                raise CheckpointMismatch(
                    f"{where}: hyperparameter {name!r} was {value!r} but came back as {config[name]!r}"
                )

    def _checkpoint_of_record(self, objects: KerasObjects, prefix: Path) -> KerasObjects:
        tf = self.tf
        written = tf.train.Checkpoint(model=objects.model, optimizer=objects.optimizer).write(str(prefix))
        fresh = self.build()
        status = tf.train.Checkpoint(model=fresh.model, optimizer=fresh.optimizer).read(written)
        try:
            status.assert_consumed()
        except AssertionError as exc:
            raise CheckpointMismatch(
                f"tf.train.Checkpoint: some saved values found no variable in freshly built objects: {exc}"
            ) from None
        for index, (saved, loaded) in enumerate(
            zip(objects.model.get_weights(), fresh.model.get_weights(), strict=True)
        ):
            if not np.array_equal(saved, loaded):
                raise CheckpointMismatch(f"tf.train.Checkpoint: model weight {index} differs after restore")
        compare_optimizers(objects.optimizer, fresh.optimizer, "tf.train.Checkpoint")
        return fresh

    def _placement(self, objects: KerasObjects) -> dict[str, Any]:
        """Where optimizer state lives against its model variables (a GPU performance cliff)."""
        model_devices = sorted({variable_device(v) for v in objects.model.trainable_variables})
        state = [(_name(v), variable_device(v)) for v in optimizer_variables_of(objects.optimizer)]
        return {
            "model_variable_devices": model_devices,
            "optimizer_variable_devices": sorted({device for _, device in state}),
            "optimizer_variables_elsewhere": [name for name, device in state if device not in model_devices],
        }

    def _choose_device(self, requested: str) -> str:
        tf = self.tf
        gpus = tf.config.list_physical_devices("GPU")
        for gpu in gpus:
            # Grow on demand instead of taking the whole card.
            tf.config.experimental.set_memory_growth(gpu, True)
        if requested == "auto":
            return "/GPU:0" if gpus else "/CPU:0"
        if requested == "cpu":
            return "/CPU:0"
        index = int(requested.partition(":")[2] or 0)
        if index >= len(gpus):
            raise ValueError(
                f"device {requested!r} requested, but this host has {len(gpus)} GPUs for TensorFlow"
            )
        return f"/GPU:{index}"


def compare_optimizers(saved: Any, loaded: Any, where: str) -> None:
    """Raise CheckpointMismatch unless config and every optimizer variable came back equal."""
    saved_config, loaded_config = plain_config(saved), plain_config(loaded)
    if saved_config != loaded_config:
        keys = sorted(
            k
            for k in saved_config.keys() | loaded_config.keys()
            if saved_config.get(k) != loaded_config.get(k)
        )
        raise CheckpointMismatch(
            f"{where}: optimizer config differs after reload in {keys}: a constructor argument is "
            "missing from get_config() or not restored by from_config()"
        )
    before, after = _optimizer_variables(saved), _optimizer_variables(loaded)
    if len(after) < len(before):
        missing = [name for name, _ in before[len(after) :]]
        raise CheckpointMismatch(
            f"{where}: {len(before) - len(after)} optimizer variables did not come back "
            f"(e.g. {missing[:3]}); create state with add_variable / add_slot so it is tracked"
        )
    for (name, value), (_, restored) in zip(before, after, strict=False):
        if value.shape != restored.shape or not np.array_equal(value, restored):
            diff = float(np.max(np.abs(value - restored))) if value.shape == restored.shape else math.inf
            raise CheckpointMismatch(
                f"{where}: optimizer variable {name!r} differs after reload (max abs difference {diff:.3g})"
            )


class _Compiled:
    """The update step compiled with tf.function, and the same function uncompiled."""

    def __init__(self, eager: Callable[..., Any], compiled: Callable[..., Any]) -> None:
        self.eager = eager
        self.compiled = compiled

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*args)


def optimizer_variables_of(optimizer: Any) -> list[Any]:
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)  # legacy: a method


def _optimizer_variables(optimizer: Any) -> list[tuple[str, np.ndarray]]:
    return [(_name(v), np.asarray(v.numpy())) for v in optimizer_variables_of(optimizer)]


def _name(variable: Any) -> str:
    return str(getattr(variable, "path", None) or variable.name)


def variable_device(variable: Any) -> str:
    # A Keras 3 Variable wraps the backend's tf.Variable, which knows its device.
    if hasattr(variable, "device"):
        return str(variable.device)
    return str(variable.value.device)


def plain_config(optimizer: Any) -> dict[str, Any]:
    """get_config() with numpy scalars as Python numbers (legacy configs hold float32s)."""
    config = dict(optimizer.get_config())
    config.pop("name", None)  # reloaded optimizers may be renamed
    return {
        key: value.item() if hasattr(value, "item") and np.ndim(value) == 0 else value
        for key, value in config.items()
    }


def same_config_value(restored: Any, given: Any) -> bool:
    if isinstance(given, tuple | list):
        return isinstance(restored, tuple | list) and all(
            same_config_value(r, g) for r, g in zip(restored, given, strict=True)
        )
    if isinstance(given, float) and isinstance(restored, int | float):
        return math.isclose(restored, given, rel_tol=1e-6)  # legacy configs pass through float32
    return bool(restored == given)


def weights_sha256(model: Any) -> str:
    digest = hashlib.sha256()
    for index, weight in enumerate(model.get_weights()):
        array = np.ascontiguousarray(weight)
        digest.update(f"{index}:{array.dtype}:{list(array.shape)}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()
