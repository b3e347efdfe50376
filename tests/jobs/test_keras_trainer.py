"""The training loop with the Keras drivers: both TensorFlow styles train, verify checkpoints
the Keras way, and explain failures."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from jobs.errors import Diverged
from jobs.frameworks.base import CheckpointMismatch
from jobs.frameworks.keras_driver import GraphModeError
from jobs.report import Reporter
from jobs.result import TrainOutcome
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


def run(spec: JobSpec, tmp_path: Path, plugin_dirs: list[str] | None = None) -> TrainOutcome:
    assert spec.optimizer.style is not None
    registry = load_registry(plugin_dirs=plugin_dirs or [], styles=(spec.optimizer.style,))
    job = TrainingJob(
        spec, registry=registry, workdir=tmp_path, tracker=NullTracker(), reporter=Reporter(tmp_path)
    )
    return job.run()


@pytest.mark.parametrize("style", ["keras", "tf_legacy"])
def test_trains_and_verifies_every_checkpoint(style: str, tmp_path: Path) -> None:
    result = run(tf_spec("ema_momentum", style, {"lr": 0.5}), tmp_path)
    assert [c.step for c in result.checkpoints] == [15, 30, 40]
    assert result.checkpoints_verified == 3
    assert result.final["val_accuracy"] > 0.6  # 40 small steps: well above chance (0.1)
    assert result.variable_placement.optimizer_variables_elsewhere == []
    assert len(list((tmp_path / "checkpoints").iterdir())) == 1  # only the latest is kept


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


def test_divergence_names_the_step(tmp_path: Path) -> None:
    with pytest.raises(Diverged) as diverged:
        run(tf_spec("sgd", "keras", {"lr": 1e6}, schedule={"name": "constant"}), tmp_path)
    assert diverged.value.step < 40


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


def test_a_graph_incompatible_update_says_so_and_where(tmp_path: Path) -> None:
    dirs = plugin(tmp_path, "eager_only", EAGER_ONLY)
    with pytest.raises(GraphModeError) as failed:
        run(tf_spec("eager_only", "keras", {"lr": 0.01}), tmp_path, dirs)
    message = str(failed.value)
    assert "works eagerly but not inside tf.function" in message
    assert "eager_only.py" in message


def test_a_hyperparameter_missing_from_get_config_fails_the_round_trip(tmp_path: Path) -> None:
    dirs = plugin(tmp_path, "forgetful", FORGETFUL)
    with pytest.raises(CheckpointMismatch) as failed:
        run(tf_spec("forgetful", "keras", {"lr": 0.01, "decay": 0.25}), tmp_path, dirs)
    assert "get_config" in str(failed.value)
    sys.modules.pop("tests_forgetful", None)


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
