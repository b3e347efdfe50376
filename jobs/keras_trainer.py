"""Train one TensorFlow job with a Keras 3 (`keras`) or legacy tf.keras (`tf_keras`) optimizer.

The same spec, workloads, schedules and metrics as the PyTorch path. The training step
is compiled with `tf.function` (optionally XLA). Every `checkpoint_every` steps (and
after the last) the job proves the optimizer survives a checkpoint the Keras way:

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
import shutil
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jobs.batches import BatchOrder
from jobs.errors import Diverged
from jobs.report import Reporter
from jobs.spec import JobSpec
from jobs.torch_checkpoint import CheckpointMismatch
from jobs.tracking import Tracker
from jobs.workloads import Dataset, get_workload
from optimizers.hyperparams import check_all
from optimizers.registry import Entry, Registry
from optimizers.schedules import build_schedule


class GraphModeError(RuntimeError):
    """The optimizer's update works eagerly but not inside tf.function."""


@dataclass
class KerasObjects:
    model: Any
    optimizer: Any
    gradients: Callable[..., Any]
    apply: Callable[..., Any]


class KerasJob:
    def __init__(
        self,
        spec: JobSpec,
        *,
        registry: Registry,
        workdir: Path,
        tracker: Tracker,
        reporter: Reporter,
    ) -> None:
        import tensorflow as tf

        self.tf = tf
        self.spec = spec
        self.style = spec.optimizer.style or "keras"
        self.entry: Entry = registry.get(spec.optimizer.name, self.style)
        if self.style == "keras":
            import keras

            from optimizers.keras.schedules import OptlabSchedule

            self.km: Any = keras
            self.schedule_class: Any = OptlabSchedule
            self.model_suffix = ".keras"
        else:
            import tf_keras

            from optimizers.tf_legacy.schedules import OptlabLegacySchedule

            self.km = tf_keras
            self.schedule_class = OptlabLegacySchedule
            # h5 keeps a legacy optimizer's iterations and slots; SavedModel and .keras
            # reload them as zero (the formats' documented behaviour, not the optimizer's).
            self.model_suffix = ".h5"
        self.workdir = workdir
        self.tracker = tracker
        self.reporter = reporter
        self.workload = get_workload(spec.workload.name)
        self.dataset: Dataset = self.workload.load_data()
        self.task = self.workload.task
        self.device = self._choose_device(spec.device)
        self.checkpoint_dir = workdir / "checkpoints"
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.warnings: list[str] = []
        self.verified: list[dict[str, Any]] = []
        self.last_checkpoint: Path | None = None
        self.lr_multiplier = build_schedule(spec.schedule.name, spec.schedule.params, total_steps=spec.steps)
        self.base_lr = float(spec.optimizer.params.get("lr", self.entry.params["lr"].default))

    # -- objects ---------------------------------------------------------------------------------------

    def build(self) -> KerasObjects:
        """A fresh model and optimizer as the spec describes them, optimizer variables created."""
        model = self.workload.keras_model(self.spec.workload.params, self.dataset, keras_module=self.km)
        schedule = self.schedule_class(
            self.base_lr, self.spec.schedule.name, self.spec.schedule.params, self.spec.steps
        )
        optimizer = self.entry.create(self.spec.optimizer.params, learning_rate=schedule)
        variables = model.trainable_variables
        if self.style == "keras":
            optimizer.build(variables)
        else:
            optimizer._create_all_weights(variables)  # the legacy API's only way to make slots now
        model.compile(optimizer=optimizer)  # so a whole-model save carries the optimizer
        return KerasObjects(model, optimizer, *self._step_functions(model, optimizer))

    def _step_functions(self, model: Any, optimizer: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
        tf = self.tf
        variables = model.trainable_variables
        loss_of = self._loss

        def gradients(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_of(model(x, training=True), y)
            grads = tape.gradient(loss, variables)
            return loss, grads, tf.linalg.global_norm(grads)

        if self.style == "keras":

            def apply(grads: Any) -> None:
                optimizer.apply(grads, variables)

        else:

            def apply(grads: Any) -> None:
                optimizer.apply_gradients(zip(grads, variables, strict=True))

        jit = self.spec.jit_compile
        return tf.function(gradients, jit_compile=jit), _Compiled(apply, tf.function(apply, jit_compile=jit))

    def _loss(self, output: Any, y: Any) -> Any:
        tf = self.tf
        if self.task == "regression":
            return tf.reduce_mean(tf.square(tf.reshape(output, [-1]) - y))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=output))

    # -- training --------------------------------------------------------------------------------------

    def run(self, *, resume_from: Path | None = None, stop_after: int | None = None) -> dict[str, Any]:
        if resume_from is not None:
            raise ValueError("--resume is available for torch jobs only so far")
        spec, tf = self.spec, self.tf
        self._seed()
        end = min(stop_after, spec.steps) if stop_after is not None else spec.steps
        order = BatchOrder(len(self.dataset.x_train), batch_size=spec.batch_size, seed=spec.seed)
        with tf.device(self.device):
            objects = self.build()
            x_train, y_train = tf.constant(self.dataset.x_train), tf.constant(self.dataset.y_train)
            x_val, y_val = tf.constant(self.dataset.x_val), tf.constant(self.dataset.y_val)

            def batch(step: int) -> tuple[Any, Any]:
                rows = tf.constant(order.rows(step))
                return tf.gather(x_train, rows), tf.gather(y_train, rows)

            step_ms: list[float] = []
            optimizer_ms: list[float] = []
            train_loss, evaluation, started = math.nan, {}, time.monotonic()
            for step in range(end):
                train_loss = self._train_step(objects, batch(step), step, step_ms, optimizer_ms)
                done = step + 1
                if done % spec.eval_every == 0 or done == end:
                    evaluation = self._evaluate(objects.model, x_val, y_val, done)
                if done % spec.checkpoint_every == 0 or done == end:
                    objects = self._checkpoint_roundtrip(objects, done)
                self.reporter.progress(
                    step=done, total=spec.steps, loss=train_loss, force=done == end, **evaluation
                )
            placement = self._placement(objects)

        seconds = sum(step_ms) / 1000
        return {
            "steps_completed": end,
            "style": self.style,
            "final": {"train_loss": train_loss, **evaluation},
            "params_sha256": weights_sha256(objects.model),
            "samples_per_sec": end * spec.batch_size / seconds if seconds else None,
            "step_time_ms_median": statistics.median(step_ms) if step_ms else None,
            "optimizer_step_ms_median": statistics.median(optimizer_ms) if optimizer_ms else None,
            "checkpoints": self.verified,
            "checkpoints_verified": sum(1 for c in self.verified if c["ok"]),
            "device": self.device,
            "variable_placement": placement,
            "train_seconds": time.monotonic() - started,
            "warnings": self.warnings,
        }

    def _seed(self) -> None:
        self.km.utils.set_random_seed(self.spec.seed)
        self.tf.config.experimental.enable_op_determinism()

    def _train_step(
        self,
        objects: KerasObjects,
        batch: tuple[Any, Any],
        step: int,
        step_ms: list[float],
        optimizer_ms: list[float],
    ) -> float:
        lr = self.base_lr * self.lr_multiplier(step)
        started = time.perf_counter()
        loss, grads, grad_norm = objects.gradients(*batch)
        optimizer_started = time.perf_counter()
        self._apply(objects, grads, first=step == 0)
        finished = time.perf_counter()
        loss_value = float(loss)
        if not math.isfinite(loss_value):
            raise Diverged(step, "train/loss", loss_value)
        step_ms.append((finished - started) * 1000)
        optimizer_ms.append((finished - optimizer_started) * 1000)
        for key, value in (
            ("train/loss", loss_value),
            ("train/lr", lr),
            ("train/grad_norm", float(grad_norm)),
            ("perf/step_time_ms", step_ms[-1]),
            ("perf/optimizer_step_ms", optimizer_ms[-1]),
            ("perf/samples_per_sec", self.spec.batch_size / (step_ms[-1] / 1000)),
        ):
            self.tracker.metric(key, value, step)
        return loss_value

    def _apply(self, objects: KerasObjects, grads: Any, *, first: bool) -> None:
        apply = objects.apply
        assert isinstance(apply, _Compiled)
        if not first:
            apply.compiled(grads)
            return
        try:
            apply.compiled(grads)
        except Exception as graph_error:
            self._explain_graph_failure(graph_error, grads)
            raise

    def _explain_graph_failure(self, graph_error: Exception, grads: Any) -> None:
        """Retry the first update eagerly on fresh objects: if that works, the optimizer is
        not graph-compatible, and the error says so and where; else the original error stands."""
        fresh = self.build()
        try:
            fresh.apply.eager(grads)  # type: ignore[attr-defined]
        except Exception:
            return
        where = self._user_frame(graph_error)
        raise GraphModeError(
            f"the update step of optimizer {self.entry.name!r} ({self.style}) works eagerly but not "
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

    def _evaluate(self, model: Any, x: Any, y: Any, step: int) -> dict[str, float]:
        output = model(x, training=False)
        loss = float(self._loss(output, y))
        if not math.isfinite(loss):
            raise Diverged(step, "val/loss", loss)
        self.tracker.metric("val/loss", loss, step)
        if self.task == "regression":
            rmse = math.sqrt(loss)
            self.tracker.metric("val/rmse", rmse, step)
            return {"val_loss": loss, "val_rmse": rmse}
        accuracy = float(np.mean(np.argmax(np.asarray(output), axis=1) == np.asarray(y)))
        self.tracker.metric("val/accuracy", accuracy, step)
        return {"val_loss": loss, "val_accuracy": accuracy}

    # -- checkpoints -----------------------------------------------------------------------------------

    def _checkpoint_roundtrip(self, objects: KerasObjects, step: int) -> KerasObjects:
        folder = self.checkpoint_dir / f"step-{step:08d}"
        folder.mkdir(exist_ok=True)
        try:
            self._whole_model_roundtrip(objects, folder / f"model{self.model_suffix}")
            reloaded = self._checkpoint_of_record(objects, folder / "ckpt")
        except CheckpointMismatch:
            self.tracker.metric("checkpoint/roundtrip_ok", 0.0, step)
            self.verified.append({"step": step, "ok": False, "path": str(folder)})
            raise
        self.tracker.metric("checkpoint/roundtrip_ok", 1.0, step)
        self.verified.append({"step": step, "ok": True, "path": str(folder)})
        if self.last_checkpoint is not None and self.last_checkpoint != folder:
            shutil.rmtree(self.last_checkpoint, ignore_errors=True)  # keep only the latest verified one
        self.last_checkpoint = folder
        return reloaded

    def _whole_model_roundtrip(self, objects: KerasObjects, path: Path) -> None:
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
        if self.style == "tf_legacy" and int(optimizer.iterations) == 0 < int(objects.optimizer.iterations):
            # The format reloaded no optimizer state at all (a legacy optimizer from .keras or
            # SavedModel does this for every class, built-ins too): the format's loss, not the
            # optimizer's. Warn; the tf.train.Checkpoint round-trip stays the one of record.
            warning = (
                f"{path.name}: the whole-model format reloaded the optimizer without its state "
                f"(iterations 0, not {int(objects.optimizer.iterations)}); resume from the "
                "tf.train.Checkpoint instead"
            )
            if warning not in self.warnings:
                self.warnings.append(warning)
            return
        self._compare_optimizers(objects.optimizer, optimizer, path.name)

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
        self._compare_optimizers(objects.optimizer, fresh.optimizer, "tf.train.Checkpoint")
        return fresh

    def _compare_optimizers(self, saved: Any, loaded: Any, where: str) -> None:
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
                    f"{where}: optimizer variable {name!r} differs after reload "
                    f"(max abs difference {diff:.3g})"
                )

    def _placement(self, objects: KerasObjects) -> dict[str, Any]:
        """Where optimizer state lives against its model variables (a GPU performance cliff)."""
        model_devices = sorted({variable_device(v) for v in objects.model.trainable_variables})
        optimizer_devices = sorted(
            {device for _, _, device in _optimizer_variable_devices(objects.optimizer)}
        )
        elsewhere = [
            name
            for name, _, device in _optimizer_variable_devices(objects.optimizer)
            if device not in model_devices
        ]
        return {
            "model_variable_devices": model_devices,
            "optimizer_variable_devices": optimizer_devices,
            "optimizer_variables_elsewhere": elsewhere,
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


def _optimizer_variable_devices(optimizer: Any) -> list[tuple[str, Any, str]]:
    return [(_name(v), v, variable_device(v)) for v in optimizer_variables_of(optimizer)]


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
