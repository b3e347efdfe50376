"""The training loop with the Keras drivers: both TensorFlow styles train, verify checkpoints
the Keras way, and explain failures."""

from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jobs.errors import Diverged
from jobs.frameworks import driver_for
from jobs.frameworks.base import CheckpointMismatch, Driver
from jobs.frameworks.keras_driver import GraphModeError, KerasSession
from jobs.report import Reporter
from jobs.result import TrainOutcome
from jobs.run import checkpoints_so_far
from jobs.spec import JobSpec
from jobs.tracking import NullTracker
from jobs.training.loop import TrainingJob
from optimizers.registry import load_registry


def tf_spec(optimizer: str, style: str, params: dict[str, Any], **overrides: Any) -> JobSpec:
    body: dict[str, Any] = {
        "framework": "tensorflow",
        "workload": {"name": "digits_mlp"},
        "optimizer": {"name": optimizer, "style": style, "params": params},
        "schedule": {"name": "cosine", "params": {"warmup_steps": 5}},
        "steps": 40,
        "batch_size": 32,
        "seed": 3,
        "checkpoint_every": 15,
        "eval_every": 20,
        **overrides,
    }
    return JobSpec.model_validate(body)


def job_of(spec: JobSpec, tmp_path: Path, plugin_dirs: list[str] | None = None) -> TrainingJob:
    assert spec.optimizer.style is not None
    registry = load_registry(plugin_dirs=plugin_dirs or [], styles=(spec.optimizer.style,))
    return TrainingJob(
        spec, registry=registry, workdir=tmp_path, tracker=NullTracker(), reporter=Reporter(tmp_path)
    )


def run(spec: JobSpec, tmp_path: Path, plugin_dirs: list[str] | None = None) -> TrainOutcome:
    return job_of(spec, tmp_path, plugin_dirs).run()


def session_of(job: TrainingJob) -> KerasSession:
    assert isinstance(job.session, KerasSession)
    return job.session


@pytest.mark.parametrize(("style", "jit_compile"), [("keras", False), ("tf_legacy", False), ("keras", True)])
def test_the_one_compiled_step_trains_bitwise_as_the_two_graphs_did(
    style: str, jit_compile: bool, tmp_path: Path
) -> None:
    """The fused step (gradients, norm and update in one graph) against the job's two graphs
    before it (gradients, then the update), from the same weights: same weights, losses, norms."""
    session = session_of(job_of(tf_spec("adamw_ref", style, {"lr": 0.01}, jit_compile=jit_compile), tmp_path))
    with session.scope():
        fused, halves = session.build(), session.build()
        halves.model.set_weights(fused.model.get_weights())
        records, losses, norms = [], [], []
        for step in range(6):
            records.append(session.train_step(fused, session.batch(step), step))
            loss, grads, norm = halves.gradients(*session.batch(step))
            halves.apply.compiled(grads)
            losses.append(float(loss))
            norms.append(float(norm))
        assert session.to_floats([r.loss for r in records]) == losses
        assert session.to_floats([r.grad_norm for r in records]) == norms
        for after_fused, after_halves in zip(
            fused.model.get_weights(), halves.model.get_weights(), strict=True
        ):
            assert np.array_equal(after_fused, after_halves)


def test_step_values_stay_tensors_and_are_read_in_one_transfer(tmp_path: Path) -> None:
    session = session_of(job_of(tf_spec("ema_momentum", "keras", {"lr": 0.5}), tmp_path))
    tf = session.tf
    with session.scope():
        objects = session.build()
        records = [session.train_step(objects, session.batch(step), step) for step in range(50)]
    assert all(tf.is_tensor(r.loss) and tf.is_tensor(r.grad_norm) for r in records)
    values = [v for r in records for v in (r.loss, r.grad_norm, r.lr, r.optimizer_ms)]

    class CountingStacks:
        """TensorFlow, counting the stacks `to_floats` makes (one per transfer to the host)."""

        def __init__(self) -> None:
            self.stacks = 0

        def __getattr__(self, name: str) -> Any:
            return getattr(tf, name)

        def stack(self, tensors: list[Any]) -> Any:
            self.stacks += 1
            return tf.stack(tensors)

    counting = CountingStacks()
    session.tf = counting
    try:
        floats = session.to_floats(values)
    finally:
        session.tf = tf
    assert counting.stacks == 1  # 100 float32 tensors, one read
    assert floats == [float(v) for v in values]  # in order; host floats passed through


@pytest.mark.parametrize("style", ["keras", "tf_legacy"])
def test_trains_and_verifies_every_checkpoint(style: str, tmp_path: Path) -> None:
    result = run(tf_spec("ema_momentum", style, {"lr": 0.5}), tmp_path)
    assert [c.step for c in result.checkpoints] == [15, 30, 40]
    assert result.checkpoints_verified == 3
    assert result.final["val_accuracy"] > 0.6  # 40 small steps: well above chance (0.1)
    assert result.variable_placement.optimizer_variables_elsewhere == []
    assert len(list((tmp_path / "checkpoints").iterdir())) == 1  # only the latest is kept
    assert_damage_is_told(driver_for(style), tmp_path / "checkpoints" / "step-00000040")
    assert result.gpu_memory_peak_mb is None  # on the CPU


def test_a_gpu_jobs_peak_memory_is_in_its_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    session = session_of(job_of(tf_spec("adamw_ref", "keras", {"lr": 0.01}), tmp_path))
    with session.scope():
        objects = session.build()
    asked: list[str] = []
    tf = session.tf
    monkeypatch.setattr(
        tf.config.experimental, "get_memory_info", lambda device: asked.append(device) or {"peak": 5 * 2**20}
    )
    session.device = "/GPU:0"  # as a job on a GPU has it
    assert session.details(objects)["gpu_memory_peak_mb"] == 5.0
    assert asked == ["GPU:0"]


def assert_damage_is_told(driver: Driver, checkpoint: Path) -> None:
    """What a resume checks first (jobs.resume.readable_checkpoint): TensorFlow's CRC-32C of each
    tensor, and the `resume.json` written last."""
    assert driver.checkpoint_damage(checkpoint) is None
    (data,) = checkpoint.glob("ckpt.data-*")
    whole = data.read_bytes()
    flipped = bytearray(whole)
    flipped[len(whole) // 2] ^= 0xFF
    data.write_bytes(bytes(flipped))
    damage = driver.checkpoint_damage(checkpoint) or ""
    assert (
        damage.startswith("its tensors do not read back as written (") and "Checksum does not match" in damage
    )
    data.write_bytes(whole[: len(whole) // 2])
    assert "do not read back as written" in (driver.checkpoint_damage(checkpoint) or "")
    data.write_bytes(whole)
    (checkpoint / "resume.json").unlink()
    assert "resume.json cannot be read, so it is not a finished checkpoint" in (
        driver.checkpoint_damage(checkpoint) or ""
    )


def test_deterministic_and_checkpoints_lose_nothing(tmp_path: Path) -> None:
    """Same seed, same weights; and checkpointing (continuing from restored objects) changes nothing."""
    often = run(tf_spec("adamw_ref", "keras", {"lr": 0.01}, checkpoint_every=7), tmp_path / "a")
    again = run(tf_spec("adamw_ref", "keras", {"lr": 0.01}, checkpoint_every=7), tmp_path / "b")
    rarely = run(tf_spec("adamw_ref", "keras", {"lr": 0.01}, checkpoint_every=1000), tmp_path / "c")
    assert often.params_sha256 == again.params_sha256 == rarely.params_sha256


def test_the_two_keras_styles_agree_on_a_training_run(tmp_path: Path) -> None:
    keras3 = run(tf_spec("lion", "keras", {"lr": 0.003}), tmp_path / "k")
    legacy = run(tf_spec("lion", "tf_legacy", {"lr": 0.003}), tmp_path / "l")
    assert keras3.final["train_loss"] == pytest.approx(legacy.final["train_loss"], rel=1e-4)


SCALED_LOSS_SGD = """
import keras


@keras.saving.register_keras_serializable(package="tests")
class ScaledLossSgd(keras.optimizers.SGD):
    '''SGD with Keras's fixed loss scale: fit multiplies the loss by it, apply() divides it back.'''

    def __init__(self, learning_rate=0.01, **kwargs):
        kwargs.setdefault("loss_scale_factor", 128.0)
        super().__init__(learning_rate=learning_rate, **kwargs)
"""


def test_a_loss_scale_factor_is_applied_to_the_loss_as_fit_does(tmp_path: Path) -> None:
    """Keras's apply() divides the gradients by `loss_scale_factor`; a loop that does not multiply
    the loss first trains with gradients 128 times too small (digits at chance after 150 steps).
    Scaled by a power of two, the job is bitwise plain SGD's, its loss and gradient norms too."""
    dirs = plugin(tmp_path, "scaled_loss_sgd", SCALED_LOSS_SGD)
    first_norms = []
    for name, plugin_dirs in (("scaled_loss_sgd", dirs), ("sgd", None)):
        session = session_of(job_of(tf_spec(name, "keras", {"lr": 0.1}), tmp_path / name, plugin_dirs))
        with session.scope():
            record = session.train_step(session.build(), session.batch(0), 0)
        first_norms.append(session.to_floats([record.loss, record.grad_norm]))
    assert first_norms[0] == first_norms[1]
    scaled = run(tf_spec("scaled_loss_sgd", "keras", {"lr": 0.1}, steps=12), tmp_path / "scaled", dirs)
    plain = run(tf_spec("sgd", "keras", {"lr": 0.1}, steps=12), tmp_path / "plain")
    assert scaled.params_sha256 == plain.params_sha256


EMA_ADAM = """
import keras


@keras.saving.register_keras_serializable(package="tests")
class EmaAdam(keras.optimizers.Adam):
    '''Adam keeping a moving average of the weights (Keras's use_ema).'''

    def __init__(self, learning_rate=0.01, **kwargs):
        kwargs.setdefault("use_ema", True)
        kwargs.setdefault("ema_momentum", 0.5)
        super().__init__(learning_rate=learning_rate, **kwargs)
"""


def test_a_use_ema_optimizer_is_evaluated_at_its_moving_average_and_trains_on(tmp_path: Path) -> None:
    """As Keras's SwapEMAWeights callback evaluates (and fit leaves the model): the evaluation is
    of the average the optimizer keeps, and the trained weights come back bitwise."""
    dirs = plugin(tmp_path, "ema_adam", EMA_ADAM)
    session = session_of(job_of(tf_spec("ema_adam", "keras", {"lr": 0.01}), tmp_path / "job", dirs))
    with session.scope():
        objects = session.build()
        for step in range(3):
            session.train_step(objects, session.batch(step), step)
        trained = objects.model.get_weights()
        evaluation = session.evaluate(objects)
        assert all(np.array_equal(a, b) for a, b in zip(trained, objects.model.get_weights(), strict=True))
        averages = objects.optimizer._model_variables_moving_average
        assert not all(np.array_equal(w, a.numpy()) for w, a in zip(trained, averages, strict=True))
        objects.model.set_weights([a.numpy() for a in averages])
        output = objects.model(session.x_val, training=False)
        assert evaluation.loss == float(session._loss(output, session.y_val))


def test_divergence_names_the_step(tmp_path: Path) -> None:
    job = job_of(tf_spec("sgd", "keras", {"lr": 1e6}, schedule={"name": "constant"}), tmp_path)
    with pytest.raises(Diverged) as diverged:
        job.run()
    assert diverged.value.step < 40
    # Its result gives no steps_completed (the flush that found it came later): the job's step is
    # the one its error names, diverged_at_step.
    assert checkpoints_so_far(job, diverged=True)["steps_completed"] is None
    assert job.steps_completed is not None and job.steps_completed >= diverged.value.step


EAGER_ONLY = """
import keras
import tensorflow as tf


class EagerOnly(keras.optimizers.Optimizer):
    '''Decides with a Python `if` on a tensor: fine eagerly, broken under tf.function.'''

    def __init__(self, learning_rate=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        if tf.reduce_sum(gradient) > 0:
            self.assign_sub(variable, learning_rate * gradient)
        else:
            self.assign_sub(variable, 0.5 * learning_rate * gradient)
"""

FORGETFUL = """
import keras


@keras.saving.register_keras_serializable(package="tests")
class Forgetful(keras.optimizers.Optimizer):
    '''Takes `decay` but leaves it out of get_config: reloading silently changes it.'''

    def __init__(self, learning_rate=0.01, decay=0.5, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.decay = decay

    def update_step(self, gradient, variable, learning_rate):
        self.assign_sub(variable, learning_rate * self.decay * gradient)

    def get_config(self):
        config = super().get_config()
        return config  # `decay` forgotten
"""


def plugin(tmp_path: Path, name: str, source: str) -> list[str]:
    folder = tmp_path / "plugins"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    return [str(folder)]


EAGER_ONLY_LEGACY = """
import tensorflow as tf
import tf_keras


class EagerOnlyLegacy(tf_keras.optimizers.legacy.Optimizer):
    '''The same Python `if` on a tensor, in a legacy tf.keras update.'''

    def __init__(self, learning_rate=0.01, name="EagerOnlyLegacy", **kwargs):
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)

    def _resource_apply_dense(self, grad, var, apply_state=None):
        if tf.reduce_sum(grad) > 0:
            return var.assign_sub(self._decayed_lr(var.dtype) * grad)
        return var.assign_sub(0.5 * self._decayed_lr(var.dtype) * grad)

    def get_config(self):
        config = super().get_config()
        config.update(learning_rate=self._serialize_hyperparameter("learning_rate"))
        return config
"""


NO_UPDATE_OP_LEGACY = """
import tf_keras


class NoUpdateOpLegacy(tf_keras.optimizers.legacy.Optimizer):
    '''Assigns in its update and returns nothing: tf_keras groups the None inside tf.function.'''

    def __init__(self, learning_rate=0.01, name="NoUpdateOpLegacy", **kwargs):
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)

    def _resource_apply_dense(self, grad, var, apply_state=None):
        var.assign_sub(self._decayed_lr(var.dtype) * grad)

    def get_config(self):
        config = super().get_config()
        config.update(learning_rate=self._serialize_hyperparameter("learning_rate"))
        return config
"""

USE_TENSOR_OPS = "Use tensor ops (tf.where, tf.cond) instead of Python if/while"


@pytest.mark.parametrize(
    ("style", "name", "source", "words"),
    [
        ("keras", "eager_only", EAGER_ONLY, ("if tf.reduce_sum(gradient) > 0:", USE_TENSOR_OPS)),
        (
            "tf_legacy",
            "eager_only_legacy",
            EAGER_ONLY_LEGACY,
            ("if tf.reduce_sum(grad) > 0:", USE_TENSOR_OPS),
        ),
        # Its known cause, not the advice about Python `if` on tensors, which the class does not have.
        (
            "tf_legacy",
            "no_update_op_legacy",
            NO_UPDATE_OP_LEGACY,
            ("Received 'None'", "Return the update op from _resource_apply_dense and _resource_apply_sparse"),
        ),
    ],
    ids=["keras", "tf_legacy", "tf_legacy_no_update_op"],
)
def test_a_graph_incompatible_update_says_so_and_where(
    style: str, name: str, source: str, words: tuple[str, ...], tmp_path: Path
) -> None:
    """The first compiled step fails and an eager retry of the update on fresh objects works: the
    error says the update is not graph-compatible, naming the user's file, and why."""
    dirs = plugin(tmp_path, name, source)
    with pytest.raises(GraphModeError) as failed:
        run(tf_spec(name, style, {"lr": 0.01}), tmp_path, dirs)
    message = str(failed.value)
    assert "works eagerly but not inside tf.function" in message
    assert f"{name}.py" in message
    for word in words:
        assert word in message, message
    assert (USE_TENSOR_OPS in message) == ("no_update_op" not in name), message


def test_a_hyperparameter_missing_from_get_config_fails_the_round_trip(tmp_path: Path) -> None:
    dirs = plugin(tmp_path, "forgetful", FORGETFUL)
    job = job_of(tf_spec("forgetful", "keras", {"lr": 0.01, "decay": 0.25}), tmp_path / "set", dirs)
    with pytest.raises(CheckpointMismatch) as failed:
        job.run()
    assert "hyperparameter 'decay' is missing from Forgetful.get_config()" in str(failed.value)
    # The failed job's result says where it stopped: at the first checkpoint, after step 15.
    assert checkpoints_so_far(job)["steps_completed"] == 15
    # Left at its default, `decay` is the default after a reload too: this job loses nothing.
    result = run(
        tf_spec("forgetful", "keras", {"lr": 0.01}, steps=20, checkpoint_every=10), tmp_path / "unset", dirs
    )
    assert result.checkpoints_verified == 2
    sys.modules.pop("tests_forgetful", None)


UNREGISTERED = """
import keras


class Unregistered(keras.optimizers.Optimizer):
    '''Plain SGD, never registered with Keras's serialization (a published class subclassed in a plugin).'''

    def __init__(self, learning_rate=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        self.assign_sub(variable, learning_rate * gradient)
"""


def legacy_sgd(class_name: str, *, registered: bool, methods: str = "") -> str:
    """A legacy tf.keras SGD plugin's source, registered with Keras's serialization or not."""
    register = '@tf_keras.utils.register_keras_serializable(package="tests")\n' if registered else ""
    return f"""
import tf_keras


{register}class {class_name}(tf_keras.optimizers.legacy.Optimizer):
    def __init__(self, learning_rate=0.01, name="{class_name}", **kwargs):
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)

    def _resource_apply_dense(self, grad, var, apply_state=None):
        return var.assign_sub(self._decayed_lr(var.dtype) * grad)

    def get_config(self):
        config = super().get_config()
        config.update(learning_rate=self._serialize_hyperparameter("learning_rate"))
        return config
{methods}"""


# The Model Garden's LARS is published unregistered.
UNREGISTERED_LEGACY = legacy_sgd("UnregisteredLegacy", registered=False)


@pytest.mark.parametrize(
    ("style", "name", "source", "decorator"),
    [
        ("keras", "unregistered", UNREGISTERED, "@keras.saving.register_keras_serializable"),
        (
            "tf_legacy",
            "unregistered_legacy",
            UNREGISTERED_LEGACY,
            "@tf_keras.utils.register_keras_serializable",
        ),
    ],
    ids=["keras", "tf_legacy"],
)
def test_a_class_a_saved_model_cannot_reload_by_name_fails_the_round_trip_saying_how_to_register_it(
    style: str, name: str, source: str, decorator: str, tmp_path: Path
) -> None:
    """Not Keras's own "Unknown optimizer" error with a traceback: which class, and the fix."""
    dirs = plugin(tmp_path, name, source)
    with pytest.raises(CheckpointMismatch) as failed:
        run(tf_spec(name, style, {"lr": 0.01}), tmp_path, dirs)
    message = str(failed.value)
    assert "load_model could not find the optimizer class Unregistered" in message, message
    assert f"{decorator}(package=...)" in message


# Rebuilds itself with `cls(**config)`, as the Model Garden's LARS does: a schedule stays a dict.
NAIVE_FROM_CONFIG = legacy_sgd(
    "NaiveFromConfig",
    registered=True,
    methods="""
    @classmethod
    def from_config(cls, config, custom_objects=None):
        return cls(**config)
""",
)


def test_a_saved_model_that_does_not_load_back_fails_the_round_trip_naming_from_config(
    tmp_path: Path,
) -> None:
    dirs = plugin(tmp_path, "naive_from_config", NAIVE_FROM_CONFIG)
    with pytest.raises(CheckpointMismatch) as failed:
        run(tf_spec("naive_from_config", "tf_legacy", {"lr": 0.01}), tmp_path, dirs)
    message = str(failed.value)
    assert "load_model of the saved model raised ValueError" in message, message
    assert "NaiveFromConfig.from_config(get_config()) must rebuild the optimizer" in message


LATE_LOST = """
import keras


@keras.saving.register_keras_serializable(package="tests")
class LateLost(keras.optimizers.Optimizer):
    '''SGD plus a `late` state variable that starts moving at step 20, which its whole-model
    reload (load_own_variables) forgets.'''

    def __init__(self, learning_rate=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def build(self, variables):
        super().build(variables)
        self.late = self.add_variable(shape=(), initializer="zeros", name="late")

    def update_step(self, gradient, variable, learning_rate):
        self.assign_add(self.late, keras.ops.cast(self.iterations >= 20, "float32"))
        self.assign_sub(variable, learning_rate * gradient)

    def load_own_variables(self, store):
        for index, variable in enumerate(self.variables):
            if variable is not self.late:
                variable.assign(store[str(index)])
"""


def test_state_the_whole_model_format_loses_is_caught_by_the_last_checkpoint(tmp_path: Path) -> None:
    """The whole-model round trip runs at the first checkpoint and the last: a variable it loses
    that still holds its freshly built value at the first (0 until step 20) fails the last one
    (before phase 2: the one at step 30, the first to see it move)."""
    dirs = plugin(tmp_path, "late_lost", LATE_LOST)
    job = job_of(tf_spec("late_lost", "keras", {"lr": 0.01}), tmp_path, dirs)
    with pytest.raises(CheckpointMismatch, match=r"model\.keras: optimizer variable .*late.* differs"):
        job.run()
    assert [(c.step, c.ok) for c in job.verified] == [(15, True), (30, True), (40, False)]
    sys.modules.pop("tests_late_lost", None)


UNTRACKED = """
import types

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tests")
class Untracked(keras.optimizers.Optimizer):
    '''SGD scaled by a `scale` variable listed among its variables but kept where
    tf.train.Checkpoint does not look (a plain namespace); `drift` moves it each step.'''

    def __init__(self, learning_rate=0.01, drift=0.0, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.drift = drift

    def build(self, variables):
        super().build(variables)
        self.hidden = types.SimpleNamespace(scale=tf.Variable(1.0, name="scale"))

    @property
    def variables(self):
        return [*super().variables, self.hidden.scale]

    def update_step(self, gradient, variable, learning_rate):
        self.hidden.scale.assign_add(self.drift)
        self.assign_sub(variable, learning_rate * self.hidden.scale * gradient)

    def get_config(self):
        return {**super().get_config(), "drift": self.drift}
"""


def test_state_the_checkpoint_of_record_does_not_restore_fails_the_first_checkpoint(tmp_path: Path) -> None:
    dirs = plugin(tmp_path, "untracked", UNTRACKED)
    job = job_of(tf_spec("untracked", "keras", {"lr": 0.01, "drift": 0.01}), tmp_path, dirs)
    with pytest.raises(
        CheckpointMismatch, match=r"tf\.train\.Checkpoint: optimizer variable .*scale.* differs"
    ):
        job.run()
    assert [(c.step, c.ok) for c in job.verified] == [(15, False)]


def test_the_reused_target_holds_fresh_values_so_an_unrestored_variable_still_shows(tmp_path: Path) -> None:
    """From the second checkpoint on, the target is the objects training left at the previous one,
    reset to what a fresh build holds: a variable the restore does not write shows as it would in
    fresh objects, even where the spare's stale copy equals the saved value."""
    dirs = plugin(tmp_path, "untracked", UNTRACKED)
    session = session_of(job_of(tf_spec("untracked", "keras", {"lr": 0.01}), tmp_path, dirs))
    folder = tmp_path / "checkpoints"

    def train(objects: Any, steps: range) -> None:
        for step in steps:
            session.train_step(objects, session.batch(step), step)

    with session.scope():
        first = session.build()
        train(first, range(3))
        second = session.checkpoint(first, 3, folder).objects  # freshly built; scale 1.0 == 1.0
        assert second is not first
        train(second, range(3, 6))
        third = session.checkpoint(second, 6, folder).objects
        assert third is first  # reused, not rebuilt
        train(third, range(6, 9))
        for objects in (second, third):  # the live scale and the spare's stale one agree
            objects.optimizer.hidden.scale.assign(7.0)
        with pytest.raises(CheckpointMismatch, match="scale"):
            session.checkpoint(third, 9, folder)  # a fresh build's scale is 1.0
    sys.modules.pop("tests_untracked", None)


def test_a_format_that_drops_all_optimizer_state_is_a_warning_not_a_failure(tmp_path: Path) -> None:
    """SavedModel reloads a legacy optimizer with iterations 0 and no slots, for every class:
    the format's behaviour. The job warns and relies on the tf.train.Checkpoint round-trip."""
    spec = tf_spec("adam", "tf_legacy", {"lr": 0.003}, steps=10, checkpoint_every=10)
    registry = load_registry(plugin_dirs=[], styles=("tf_legacy",))
    job = TrainingJob(
        spec, registry=registry, workdir=tmp_path, tracker=NullTracker(), reporter=Reporter(tmp_path)
    )
    job.driver.model_suffix = ""  # type: ignore[misc]  # no suffix: tf_keras writes a SavedModel folder
    result = job.run()
    assert result.checkpoints_verified == 1
    assert any("iterations 0, not 10" in warning for warning in result.warnings), result.warnings


@pytest.mark.parametrize(
    ("optimizer", "says"),
    [
        ({"base": {"name": "sgd", "params": {}}}, r"^optimizer\.base: tensorflow jobs build no wrapper"),
        ({"needs": {"closure": True}}, r"^optimizer\.name: optimizer 'adam' needs closure"),
    ],
    ids=["a base", "a closure"],
)
def test_a_job_keras_cannot_serve_is_refused_when_it_starts(
    tmp_path: Path, optimizer: dict[str, Any], says: str
) -> None:
    """What the API refuses at submission, the job refuses too (a spec stored before a catalogue
    changed), by field, before it loads any data."""
    spec = tf_spec("adam", "keras", {})
    spec = spec.model_copy(update={"optimizer": spec.optimizer.model_copy(update=optimizer)})
    spec = JobSpec.model_validate(spec.model_dump())
    with pytest.raises(ValueError, match=says):
        TrainingJob(
            spec,
            registry=load_registry(plugin_dirs=[], styles=("keras",)),
            workdir=tmp_path,
            tracker=NullTracker(),
            reporter=Reporter(tmp_path),
        )


DENSE_ONLY = """
import keras


@keras.saving.register_keras_serializable(package="tests")
class DenseOnly(keras.optimizers.Optimizer):
    '''Written for dense gradients, as most are: `rate * gradient` has no meaning for tf.IndexedSlices.'''

    def __init__(self, learning_rate=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        variable.assign_sub(keras.ops.cast(learning_rate, variable.dtype) * gradient)
"""


@pytest.mark.parametrize(
    ("style", "name", "source"),
    [
        ("keras", "dense_only", DENSE_ONLY),
        ("tf_legacy", "dense_only_legacy", legacy_sgd("DenseOnlyLegacy", registered=True)),
    ],
    ids=["keras", "tf_legacy"],
)
def test_a_class_that_does_not_declare_sparse_support_gets_an_embeddings_gradient_dense(
    style: str, name: str, source: str, tmp_path: Path
) -> None:
    """As a torch job gives every class: it had failed at its first step (`float * IndexedSlices`;
    legacy: no _resource_apply_sparse)."""
    dirs = plugin(tmp_path, name, source)
    spec = tf_spec(
        name,
        style,
        {"lr": 0.05},
        workload={"name": "embedding_mf"},
        steps=6,
        checkpoint_every=3,
        eval_every=3,
    )
    result = run(spec, tmp_path, dirs)
    assert result.checkpoints_verified == 2 and np.isfinite(result.final["train_loss"])


RATE_AS_NUMBER = """
import tf_keras


@tf_keras.utils.register_keras_serializable(package="tests")
class RateAsNumber(tf_keras.optimizers.legacy.Optimizer):
    '''Reads its rate as the number it was given, as a class written for fixed rates does.'''

    def __init__(self, learning_rate=0.01, name="RateAsNumber", **kwargs):
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)

    def _resource_apply_dense(self, grad, var, apply_state=None):
        return var.assign_sub(self._get_hyper("learning_rate", var.dtype) * grad)

    def get_config(self):
        config = super().get_config()
        config.update(learning_rate=self._serialize_hyperparameter("learning_rate"))
        return config
"""


def test_a_class_that_reads_its_rate_as_a_number_is_told_a_job_gives_it_a_schedule(tmp_path: Path) -> None:
    """TensorFlow names only the object ("Expected float32, but got <...OptlabLegacySchedule...>"),
    and on the constant schedule the user asked for none."""
    dirs = plugin(tmp_path, "rate_as_number", RATE_AS_NUMBER)
    spec = tf_spec("rate_as_number", "tf_legacy", {"lr": 0.05}, schedule={"name": "constant"}, steps=4)
    with pytest.raises(TypeError) as failed:
        run(spec, tmp_path, dirs)
    message = str(failed.value)
    assert message.startswith(
        "optimizer 'rate_as_number' (tf_legacy) reads its learning rate as a number at "
    )
    assert "rate_as_number.py:" in message
    assert (
        "a job always gives it a LearningRateSchedule (OptlabLegacySchedule, which follows spec.schedule"
        in message
    )
    assert "self._decayed_lr(var_dtype)" in message
    sys.modules.pop("tests_rate_as_number", None)


CENTRED_SGD = """
import keras


@keras.saving.register_keras_serializable(package="tests")
class CentredSgd(keras.optimizers.SGD):
    '''Gradient centralization (https://arxiv.org/abs/2004.01461) in apply_gradients, as TF ports
    write it: each kernel's gradient loses its mean over the input axis, then plain SGD.'''

    def apply_gradients(self, grads_and_vars):
        centred = [
            (g - keras.ops.mean(g, axis=0, keepdims=True) if len(g.shape) > 1 else g, v)
            for g, v in grads_and_vars
        ]
        return super().apply_gradients(centred)
"""

CENTRED_SGD_LEGACY = """
import tensorflow as tf
import tf_keras


@tf_keras.utils.register_keras_serializable(package="tests")
class CentredSgdLegacy(tf_keras.optimizers.legacy.SGD):
    '''Gradient centralization in _compute_gradients, which tf.keras's fit runs through minimize.'''

    def __init__(self, learning_rate=0.01, name="CentredSgdLegacy", **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        pairs = super()._compute_gradients(loss, var_list, grad_loss=grad_loss, tape=tape)
        return [
            (g - tf.reduce_mean(g, axis=0, keepdims=True) if len(g.shape) > 1 else g, v) for g, v in pairs
        ]
"""


@pytest.mark.parametrize(
    ("style", "name", "source"),
    [("keras", "centred_sgd", CENTRED_SGD), ("tf_legacy", "centred_sgd_legacy", CENTRED_SGD_LEGACY)],
    ids=["keras apply_gradients", "tf_legacy _compute_gradients"],
)
def test_a_class_that_changes_its_gradients_where_fit_calls_it_is_stepped_through_that(
    style: str, name: str, source: str, tmp_path: Path
) -> None:
    """Keras 3's fit calls apply_gradients, tf.keras's minimize (its _compute_gradients, then
    apply_gradients): a job had called apply() (legacy: taken the gradients from the tape itself),
    so the centralizing class trained exactly as plain SGD. Centred, SGD moves every kernel column
    by a change whose mean over the inputs is zero."""
    dirs = plugin(tmp_path, name, source)
    spec = tf_spec(name, style, {"lr": 0.5}, schedule={"name": "constant"})
    session = session_of(job_of(spec, tmp_path, dirs))
    with session.scope():
        objects = session.build()
        kernels = [v for v in objects.model.trainable_variables if len(v.shape) > 1]
        before = [np.array(v.numpy()) for v in kernels]
        for step in range(3):
            session.train_step(objects, session.batch(step), step)
        for kernel, start in zip(kernels, before, strict=True):
            change = np.asarray(kernel.numpy()) - start
            assert np.abs(change).max() > 1e-3  # it trains
            assert np.abs(change.mean(axis=0)).max() < 1e-6, np.abs(change.mean(axis=0)).max()
    sys.modules.pop(f"tests_{name}", None)


def test_the_checks_step_a_keras_class_through_its_apply_gradients_too() -> None:
    """`optlab check` steps through the driver's `step`, which calls what a job calls."""
    import keras

    calls: list[int] = []

    class Counting(keras.optimizers.SGD):
        def apply_gradients(self, grads_and_vars: Any) -> Any:
            calls.append(1)
            return super().apply_gradients(grads_and_vars)

    driver = driver_for("keras")
    variables = driver.variables([np.ones((2, 2), np.float32)])
    optimizer = driver.optimizer_over(lambda _: Counting(learning_rate=0.1), variables)
    driver.step(optimizer, variables, [np.ones((2, 2), np.float32)])
    assert calls == [1]
    assert np.allclose(driver.values(variables)[0], 0.9)


MINIMIZING_LEGACY = legacy_sgd(
    "MinimizingLegacy",
    registered=True,
    methods="""
    def minimize(self, loss, var_list, grad_loss=None, name=None, tape=None):
        return super().minimize(loss, var_list, grad_loss=grad_loss, name=name, tape=tape)
""",
)


def test_a_legacy_class_overriding_minimize_is_refused_when_its_job_starts(tmp_path: Path) -> None:
    """fit calls minimize; a job takes the gradients and applies them itself, so the override would
    be bypassed without a word."""
    dirs = plugin(tmp_path, "minimizing_legacy", MINIMIZING_LEGACY)
    with pytest.raises(ValueError) as refused:
        job_of(tf_spec("minimizing_legacy", "tf_legacy", {"lr": 0.01}), tmp_path, dirs)
    message = str(refused.value)
    assert message.startswith(
        "optimizer.name: optimizer 'minimizing_legacy': MinimizingLegacy overrides "
        "minimize(), which tf.keras's fit calls but a job does not"
    ), message
    assert "_compute_gradients" in message and "apply_gradients" in message
    sys.modules.pop("tests_minimizing_legacy", None)


ACCUMULATING_SGD = """
import keras


@keras.saving.register_keras_serializable(package="tests")
class AccumulatingSgd(keras.optimizers.Optimizer):
    '''SGD over the mean gradient of two batches: Keras's gradient_accumulation_steps, set by the class.'''

    def __init__(self, learning_rate=0.05, **kwargs):
        kwargs.setdefault("gradient_accumulation_steps", 2)
        super().__init__(learning_rate=learning_rate, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        self.assign_sub(variable, keras.ops.cast(learning_rate, variable.dtype) * gradient)
"""


def test_a_class_that_accumulates_gradients_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    """Keras's `iterations` is then the update count (a tensor: apply() calls // 2): the probe step
    after the last checkpoint had failed assigning it, and a resume refused "restored 7 iterations,
    not its step 15". The weights change every second step, as the README says."""
    dirs = plugin(tmp_path, "accumulating_sgd", ACCUMULATING_SGD)
    spec = tf_spec("accumulating_sgd", "keras", {"lr": 0.1}, steps=20, checkpoint_every=15)
    job = job_of(spec, tmp_path / "job", dirs)
    session = session_of(job)
    with session.scope():
        objects = session.build()
        moved = []
        for step in range(4):
            before = objects.model.get_weights()
            session.train_step(objects, session.batch(step), step)
            after = objects.model.get_weights()
            moved.append(any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True)))
        assert moved == [False, True, False, True]
    result = job.run()
    assert [(c.step, c.ok) for c in result.checkpoints] == [(15, True), (20, True)]
    resumed = session_of(job_of(spec, tmp_path / "again", dirs))
    with resumed.scope():
        trained = resumed.build()
        for step in range(15):
            resumed.train_step(trained, resumed.batch(step), step)
        (tmp_path / "ckpts").mkdir()
        path = resumed.checkpoint(trained, 15, tmp_path / "ckpts", next_step_follows=True).path
        restored, step = resumed.resume(path)
    assert step == 15 and int(restored.optimizer.iterations) == 7  # 15 batches, 7 updates
    for saved, back in zip(trained.model.get_weights(), restored.model.get_weights(), strict=True):
        assert np.array_equal(saved, back)
    sys.modules.pop("tests_accumulating_sgd", None)


HOST_ROUND_TRIP = """
import keras
import tensorflow as tf


class HostRoundTrip(keras.optimizers.Optimizer):
    '''SGD whose update passes the gradient through Python (tf.py_function): any tf.function runs it,
    XLA cannot compile it.'''

    def __init__(self, learning_rate=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        passed = tf.py_function(lambda g: g, [gradient], gradient.dtype)
        passed.set_shape(gradient.shape)
        self.assign_sub(variable, keras.ops.cast(learning_rate, variable.dtype) * passed)
"""


def test_an_update_only_xla_cannot_compile_is_told_so_under_jit_compile(tmp_path: Path) -> None:
    """It had been told it "works eagerly but not inside tf.function" and to use tf.where, though it
    runs under tf.function: `optlab check`'s graph_mode words it as XLA's, and so does the job."""
    dirs = plugin(tmp_path, "host_round_trip", HOST_ROUND_TRIP)
    with pytest.raises(GraphModeError) as failed:
        run(
            tf_spec("host_round_trip", "keras", {"lr": 0.01}, jit_compile=True, steps=2),
            tmp_path / "xla",
            dirs,
        )
    message = str(failed.value)
    assert message.startswith(
        "the update step of optimizer 'host_round_trip' (keras) works under tf.function but not with "
        "jit_compile=True (XLA) (class HostRoundTrip in "
    ), message
    assert message.endswith(
        ": XLA cannot compile EagerPyFunc. Avoid ops XLA cannot compile in the update (tf.py_function, "
        "tf.print, string ops), or set the job's jit_compile to false"
    ), message
    assert USE_TENSOR_OPS not in message
    spec = tf_spec("host_round_trip", "keras", {"lr": 0.01}, steps=2, checkpoint_every=2, eval_every=2)
    session = session_of(job_of(spec, tmp_path / "graph", dirs))
    with session.scope():  # without XLA its compiled step runs
        session.train_step(session.build(), session.batch(0), 0)
    sys.modules.pop("tests_host_round_trip", None)


RATE_CHECKED = """
import keras


class RateChecked(keras.optimizers.SGD):
    '''Checks its rate as a number when it is built, a common habit.'''

    def __init__(self, learning_rate=0.01, **kwargs):
        if float(learning_rate) <= 0:
            raise ValueError(f"learning_rate must be positive, got {learning_rate}")
        super().__init__(learning_rate=learning_rate, **kwargs)
"""


def test_a_class_that_checks_its_rate_as_a_number_when_built_is_told_a_job_gives_it_a_schedule(
    tmp_path: Path,
) -> None:
    """Python's words had been "float() argument must be a string or a real number, not
    'OptlabSchedule'": the explanation given at the first step was not given at the build."""
    dirs = plugin(tmp_path, "rate_checked", RATE_CHECKED)
    with pytest.raises(TypeError) as failed:
        run(tf_spec("rate_checked", "keras", {"lr": 0.05}, steps=2), tmp_path, dirs)
    message = str(failed.value)
    assert message.startswith("optimizer 'rate_checked' (keras) reads its learning rate as a number at "), (
        message
    )
    assert "rate_checked.py:" in message and "(`if float(learning_rate) <= 0:`)" in message
    assert "a job always gives it a LearningRateSchedule (OptlabSchedule" in message
    sys.modules.pop("tests_rate_checked", None)


def test_a_job_mirrored_over_logical_cpus_under_xla_is_refused_before_it_starts(tmp_path: Path) -> None:
    """It failed at its first step with XLA's "Trying to access resource .../replica_1/... located in
    device CPU:1 from device CPU:0" (device `auto` on a host without GPUs: the API cannot tell)."""
    spec = tf_spec(
        "adam", "keras", {"lr": 0.01}, jit_compile=True, distribution={"strategy": "mirrored", "devices": 2}
    )
    with pytest.raises(
        ValueError, match=r"^jit_compile: XLA cannot compile a step mirrored over 2 logical CPUs"
    ):
        job_of(spec, tmp_path)


@pytest.mark.parametrize(("style", "name"), [("keras", "sign_step"), ("tf_legacy", "legacy_sign_step")])
def test_a_class_that_takes_no_learning_rate_trains_without_one(
    style: str, name: str, tmp_path: Path
) -> None:
    """Built with the `learning_rate` its catalogue entry had made up, it failed at its build with a
    TypeError (A2Grad, AliG, COCOB). Its steps log no rate, as a torch class without one (AliG)."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    shutil.copy(Path(__file__).parents[1] / "checks" / "rateless_keras.py", folder / "rateless.py")
    spec = tf_spec(
        name, style, {}, schedule={"name": "constant"}, steps=20, checkpoint_every=10, eval_every=10
    )
    job = job_of(spec, tmp_path / "job", [str(folder)])
    assert session_of(job).base_lr is None
    result = job.run()
    assert result.checkpoints_verified == 2
    assert result.steps_completed == 20


PORTED_WITH_LEGACY_METHODS = """
import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tests")
class PortedCentralizedAdam(keras.optimizers.Adam):
    '''A tf.keras port: gradient centralization in Keras 2's get_gradients, Keras 3 never calls it.'''

    def get_gradients(self, loss, params):
        return [g - tf.reduce_mean(g) for g in super().get_gradients(loss, params)]


@keras.saving.register_keras_serializable(package="tests")
class LegacyUpdateOnKerasThree(keras.optimizers.Optimizer):
    '''Keras 3's base with tf.keras's update method only.'''

    def __init__(self, learning_rate=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def _resource_apply_dense(self, grad, var, apply_state=None):
        var.assign_sub(self.learning_rate * grad)
"""


def test_a_method_of_another_optimizer_api_that_never_ran_is_in_the_job_s_warnings(tmp_path: Path) -> None:
    """Keras 3 never calls tf.keras's methods: a job of a class that inherits an update in their place
    trains with it, and says so in its result; one that inherits none fails at its first step with
    Keras's bare NotImplementedError, which its warnings explain. Counted while the job trains: a
    class that calls the method in a way no reading of its code finds is told nothing."""
    dirs = plugin(tmp_path, "ported_with_legacy_methods", PORTED_WITH_LEGACY_METHODS)
    spec = tf_spec(
        "ported_centralized_adam", "keras", {"lr": 0.01}, steps=4, checkpoint_every=4, eval_every=4
    )
    outcome = job_of(spec, tmp_path / "ported", dirs).run()
    assert outcome.warnings == [
        "PortedCentralizedAdam.get_gradients never runs: it is a method of tf.keras's legacy optimizer API "
        "(Keras 2's OptimizerV2), which Keras 3 never calls; Keras 3 calls apply_gradients in its place, "
        "which the class inherits from BaseOptimizer (keras): the gradients reach the update as they were "
        "taken"
    ]
    job = job_of(tf_spec("legacy_update_on_keras_three", "keras", {"lr": 0.01}), tmp_path / "bare", dirs)
    with pytest.raises(Exception, match="NotImplementedError"):
        job.run()
    assert len(job.warnings) == 1 and job.warnings[0].startswith(
        "LegacyUpdateOnKerasThree._resource_apply_dense never runs"
    )
    assert "leaves unimplemented (a step raises NotImplementedError)" in job.warnings[0]
    assert job_of(tf_spec("adam", "keras", {"lr": 0.01}, steps=2), tmp_path / "adam").run().warnings == []
    sys.modules.pop("tests_ported_with_legacy_methods", None)
