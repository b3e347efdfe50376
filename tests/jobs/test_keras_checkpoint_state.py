"""A TensorFlow job's checkpoints see optimizer state kept outside optimizer.variables: state the
checkpoint of record never saves (the probe step after it differs), state only tf.train.Checkpoint
saves (the whole-model format drops it), a dict TensorFlow refuses to save; a correct class that
keeps its variables in a structure of its own still passes."""

from __future__ import annotations

import errno
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from jobs.frameworks.base import CheckpointMismatch
from tests.jobs.test_keras_trainer import job_of, plugin, run, tf_spec

KERAS_MOMENTUM = """
import types

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tests")
class {name}(keras.optimizers.Optimizer):
    def __init__(self, learning_rate=0.01, momentum=0.9, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = momentum

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        zeros = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]
        {keep}

    def update_step(self, gradient, variable, learning_rate):
        buf = {buffers}[self._get_variable_index(variable)]
        buf.assign(self.momentum * buf + gradient)
        variable.assign_sub(tf.cast(learning_rate, variable.dtype) * buf)

    def get_config(self):
        return {{**super().get_config(), "momentum": self.momentum}}
"""

# Keras 3: momentum buffers where tf.train.Checkpoint does not look (a plain namespace), so every
# reload resets them to zeros while the variables it saves compare equal.
NAMESPACE_MOMENTUM = KERAS_MOMENTUM.format(
    name="NamespaceMomentum",
    keep="self.hidden = types.SimpleNamespace(bufs=zeros)",
    buffers="self.hidden.bufs",
)
# Keras 3: a list of raw tf.Variables. tf.train.Checkpoint tracks and restores them; a whole-model
# save (`.keras`) saves only optimizer.variables, so they reload as zeros.
LIST_MOMENTUM = KERAS_MOMENTUM.format(name="ListMomentum", keep="self.bufs = zeros", buffers="self.bufs")
# Keras 3: the same in a dict keyed by int, as QA's probe kept them: TensorFlow refuses to save it.
INT_DICT_MOMENTUM = KERAS_MOMENTUM.format(
    name="IntDictMomentum", keep="self.bufs = dict(enumerate(zeros))", buffers="self.bufs"
)

# Legacy tf.keras: slots in a dict attribute (OptimizerV2 tracks no attribute it is given).
LEGACY_DICT_MOMENTUM = """
import tensorflow as tf
import tf_keras


@tf_keras.utils.register_keras_serializable(package="tests")
class LegacyDictMomentum(tf_keras.optimizers.legacy.Optimizer):
    def __init__(self, learning_rate=0.01, momentum=0.9, name="LegacyDictMomentum", **kwargs):
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)
        self.momentum = momentum
        self._bufs = {}

    def _create_slots(self, var_list):
        for v in var_list:
            if v.ref() not in self._bufs:
                self._bufs[v.ref()] = tf.Variable(tf.zeros_like(v), trainable=False)

    def _resource_apply_dense(self, grad, var, apply_state=None):
        buf = self._bufs[var.ref()]
        buf.assign(self.momentum * buf + grad)
        return var.assign_sub(self._decayed_lr(var.dtype.base_dtype) * buf)

    def get_config(self):
        return {
            **super().get_config(),
            "learning_rate": self._serialize_hyperparameter("learning_rate"),
            "momentum": self.momentum,
        }
"""

# Correct: buffers made with add_variable_from_reference (so among optimizer.variables), kept in a
# dict keyed by name, and a scalar keras.Variable in a plain attribute; all saved and restored.
KEYED_MOMENTUM = """
import keras


@keras.saving.register_keras_serializable(package="tests")
class KeyedMomentum(keras.optimizers.Optimizer):
    def __init__(self, learning_rate=0.01, momentum=0.9, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = momentum

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.bufs = {
            str(i): self.add_variable_from_reference(v, "buf") for i, v in enumerate(variables)
        }
        self.steps_taken = self.add_variable(shape=(), initializer="zeros", name="steps_taken")

    def update_step(self, gradient, variable, learning_rate):
        buf = self.bufs[str(self._get_variable_index(variable))]
        self.assign(buf, self.momentum * buf + gradient)
        self.assign_sub(variable, learning_rate * buf)
        self.assign_add(self.steps_taken, 1.0)

    def get_config(self):
        return {**super().get_config(), "momentum": self.momentum}
"""


def forget(module: str) -> None:
    sys.modules.pop(module, None)  # a plugin module of the same name in the next test's folder


@pytest.mark.parametrize(
    ("name", "style", "source", "says"),
    [
        ("namespace_momentum", "keras", NAMESPACE_MOMENTUM, r"`hidden` hold tf\.Variables"),
        ("legacy_dict_momentum", "tf_legacy", LEGACY_DICT_MOMENTUM, r"`_bufs` hold tf\.Variables"),
    ],
    ids=["keras", "tf_legacy"],
)
@pytest.mark.parametrize("every", [10, 60], ids=["next step follows", "after the last step"])
def test_state_no_checkpoint_saves_fails_the_first_checkpoint_by_its_probe_step(
    name: str, style: str, source: str, says: str, every: int, tmp_path: Path
) -> None:
    """Buffers that tf.train.Checkpoint never sees compare equal in what it saves (both copies lack
    them), but the step after it differs: zeros against the trained buffers. Without the probe, the
    job verified every checkpoint and ended elsewhere at each cadence."""
    dirs = plugin(tmp_path, name, source)
    job = job_of(tf_spec(name, style, {"lr": 0.05}, steps=60, checkpoint_every=every), tmp_path, dirs)
    with pytest.raises(CheckpointMismatch) as failure:
        job.run()
    message = str(failure.value)
    assert f"the step after the checkpoint at step {every} differs" in message
    assert "neither saves nor restores" in message
    assert re.search(says, message), message
    fix = "add_slot in _create_slots" if style == "tf_legacy" else "self.add_variable_from_reference"
    assert fix in message
    assert [(c.step, c.ok) for c in job.verified] == [(every, False)]
    forget(f"tests_{name}")


def test_state_the_whole_model_format_drops_fails_the_first_checkpoint_naming_it(tmp_path: Path) -> None:
    """A list of raw tf.Variables: the checkpoint of record restores it (tracked), `.keras` does
    not (it saves optimizer.variables): the round trip names the buffers and the fix."""
    dirs = plugin(tmp_path, "list_momentum", LIST_MOMENTUM)
    job = job_of(tf_spec("list_momentum", "keras", {"lr": 0.05}), tmp_path, dirs)
    with pytest.raises(CheckpointMismatch) as failure:
        job.run()
    message = str(failure.value)
    assert message.startswith("model.keras: the whole-model format saves only the optimizer's variables")
    assert "tf.Variable(s) the optimizer tracks outside optimizer.variables (optimizer/bufs/0" in message
    assert "self.add_variable / self.add_variable_from_reference" in message
    assert [(c.step, c.ok) for c in job.verified] == [(15, False)]
    forget("tests_list_momentum")


def test_a_dict_tensorflow_cannot_save_fails_saying_so_without_its_values(tmp_path: Path) -> None:
    dirs = plugin(tmp_path, "int_dict_momentum", INT_DICT_MOMENTUM)
    job = job_of(tf_spec("int_dict_momentum", "keras", {"lr": 0.05}), tmp_path, dirs)
    with pytest.raises(CheckpointMismatch) as failure:
        job.run()
    message = str(failure.value)
    assert message.startswith("tf.train.Checkpoint cannot save the optimizer: a dict an attribute holds")
    assert "`bufs` hold tf.Variables outside optimizer.variables" in message
    assert "numpy=" not in message  # TensorFlow's own words print the buffers
    assert [(c.step, c.ok) for c in job.verified] == [(15, False)]
    forget("tests_int_dict_momentum")


def test_a_correct_class_keeping_its_variables_in_a_structure_of_its_own_passes(tmp_path: Path) -> None:
    """No false alarm: every checkpoint verified, the probe steps agree, and the run ends where a
    run with one checkpoint at its end does (so the reloads lost nothing)."""
    dirs = plugin(tmp_path, "keyed_momentum", KEYED_MOMENTUM)
    often = run(tf_spec("keyed_momentum", "keras", {"lr": 0.05}, steps=30), tmp_path / "often", dirs)
    once = run(
        tf_spec("keyed_momentum", "keras", {"lr": 0.05}, steps=30, checkpoint_every=30),
        tmp_path / "once",
        dirs,
    )
    assert [(c.step, c.ok) for c in often.checkpoints] == [(15, True), (30, True)]
    assert once.checkpoints_verified == 1
    assert often.params_sha256 == once.params_sha256
    assert not often.warnings and not once.warnings
    forget("tests_keyed_momentum")


NOISY_SGD = """
import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tests")
class NoisySgd(keras.optimizers.Optimizer):
    '''SGD with gradient noise from TensorFlow's global random stream: no state to lose, but no two
    runs of its step agree.'''

    def __init__(self, learning_rate=0.01, noise=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.noise = noise

    def update_step(self, gradient, variable, learning_rate):
        noisy = gradient + self.noise * tf.random.normal(tf.shape(gradient), dtype=gradient.dtype)
        variable.assign_sub(tf.cast(learning_rate, variable.dtype) * noisy)

    def get_config(self):
        return {**super().get_config(), "noise": self.noise}
"""


@pytest.mark.parametrize("every", [10, 30], ids=["next step follows", "after the last step"])
def test_a_step_that_draws_random_numbers_is_told_not_failed(every: int, tmp_path: Path) -> None:
    """Its step differs from the saved and the restored objects alike, as it differs between any two
    runs: the probe cannot tell lost state from the draws, and says so instead of failing the job (as
    `optlab check` calls such a class's draws by design a warning)."""
    dirs = plugin(tmp_path, "noisy_sgd", NOISY_SGD)
    result = run(
        tf_spec("noisy_sgd", "keras", {"lr": 0.05}, steps=30, checkpoint_every=every), tmp_path, dirs
    )
    assert all(c.ok for c in result.checkpoints)
    (warning,) = result.warnings  # once a job, not at every checkpoint
    assert "draws random numbers (RandomStandardNormal)" in warning
    assert warning.endswith(
        "(told once a job: later checkpoints whose probe step is inconclusive too are not listed)"
    )
    forget("tests_noisy_sgd")


KERAS_NOISY_SGD = """
import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tests")
class KerasNoisySgd(keras.optimizers.Optimizer):
    '''SGD with gradient noise from keras.random without a seed: Keras 3's global SeedGenerator.'''

    def __init__(self, learning_rate=0.01, noise=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.noise = noise

    def update_step(self, gradient, variable, learning_rate):
        noisy = gradient + self.noise * keras.random.normal(ops.shape(gradient), dtype=gradient.dtype)
        self.assign_sub(variable, ops.cast(learning_rate, variable.dtype) * noisy)

    def get_config(self):
        return {**super().get_config(), "noise": self.noise}
"""


@pytest.mark.parametrize("every", [10, 30], ids=["next step follows", "after the last step"])
def test_unseeded_keras_random_draws_are_drawn_alike_by_both_probe_steps(every: int, tmp_path: Path) -> None:
    """Keras 3's global SeedGenerator is put back for the probe, as torch's random state is: the
    saved and the restored objects draw the same numbers and agree (it had failed every such job at
    its first checkpoint, blaming state the checkpoint did not hold)."""
    dirs = plugin(tmp_path, "keras_noisy_sgd", KERAS_NOISY_SGD)
    spec = tf_spec("keras_noisy_sgd", "keras", {"lr": 0.05}, steps=30, checkpoint_every=every)
    result = run(spec, tmp_path, dirs)
    assert all(c.ok for c in result.checkpoints) and not result.warnings, result.warnings
    forget("tests_keras_noisy_sgd")


def keras_module(style: str) -> Any:
    import keras
    import tf_keras

    return keras if style == "keras" else tf_keras


def short_job_spec(name: str, style: str) -> Any:
    """Two steps, one checkpoint (the last: the whole model is saved too)."""
    return tf_spec(name, style, {"lr": 0.05}, steps=2, checkpoint_every=2, eval_every=2)


def a_full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """4,096 bytes free, as `free_space_note` reads it."""
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096)
    )  # type: ignore[attr-defined]


@pytest.mark.parametrize(("style", "model_file"), [("keras", "model.keras"), ("tf_legacy", "model.h5")])
def test_a_whole_model_save_that_meets_a_full_disk_names_its_file_and_leaves_no_part_of_it(
    style: str, model_file: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keras's own words were a bare `OSError: [Errno 28]`, naming no file, and the truncated model
    stayed behind, keeping the disk full."""

    def full(model: Any, filepath: Any, *args: Any, **kwargs: Any) -> None:
        Path(filepath).write_bytes(b"torn")  # a part written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    job = job_of(short_job_spec("sgd", style), tmp_path)
    monkeypatch.setattr(keras_module(style).Model, "save", full)
    a_full_disk(monkeypatch)
    with pytest.raises(OSError) as failure:
        job.run()
    message = str(failure.value)
    assert re.match(
        rf"could not write the checkpoint \S+/step-00000002/{re.escape(model_file)}: OSError: ", message
    )
    assert "No space left on device" in message
    assert message.endswith("has 4,096 bytes free: the disk is full, or nearly"), message
    assert not (job.checkpoint_dir / "step-00000002").exists()  # the checkpoint's folder neither


def test_a_checkpoint_write_that_meets_a_full_disk_names_it_and_leaves_none_of_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorFlow's own words name only SaveV2 and a temp file (`ResourceExhaustedError ... No space
    left on device`), and the files it had written stayed, with the whole model saved before them."""
    import tensorflow as tf

    def full(checkpoint: Any, file_prefix: str, *args: Any, **kwargs: Any) -> str:
        Path(f"{file_prefix}.index").write_bytes(b"torn")
        Path(f"{file_prefix}_temp").mkdir()
        Path(f"{file_prefix}_temp/part-00000-of-00001.data-00000-of-00001").write_bytes(b"torn")
        raise tf.errors.ResourceExhaustedError(None, None, "ckpt_temp/part-00000; No space left on device")

    job = job_of(short_job_spec("sgd", "keras"), tmp_path)
    monkeypatch.setattr(tf.train.Checkpoint, "write", full)
    a_full_disk(monkeypatch)
    with pytest.raises(OSError) as failure:
        job.run()
    message = str(failure.value)
    assert re.match(
        r"could not write the checkpoint \S+/step-00000002/ckpt: ResourceExhaustedError: ", message
    )
    assert message.endswith("has 4,096 bytes free: the disk is full, or nearly"), message
    # Nor the whole model saved before it (it had kept the disk full): the checkpoint's folder is gone.
    assert not (job.checkpoint_dir / "step-00000002").exists()


TENSOR_CONFIG = {
    "keras": """
import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tests")
class TensorConfig(keras.optimizers.SGD):
    '''Returns its beta from get_config as the tensor it keeps.'''

    def __init__(self, learning_rate=0.01, beta=0.9, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta = tf.constant(beta)

    def get_config(self):
        return {**super().get_config(), "beta": self.beta}
""",
    "tf_legacy": """
import tensorflow as tf
import tf_keras


@tf_keras.utils.register_keras_serializable(package="tests")
class TensorConfig(tf_keras.optimizers.legacy.SGD):
    '''Returns its beta from get_config as the tensor it keeps.'''

    def __init__(self, learning_rate=0.01, beta=0.9, name="TensorConfig", **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.beta = tf.constant(beta)

    def get_config(self):
        return {**super().get_config(), "beta": self.beta}
""",
}


@pytest.mark.parametrize(("style", "model_file"), [("keras", "model.keras"), ("tf_legacy", "model.h5")])
def test_a_config_a_saved_model_cannot_hold_is_named_by_its_key(
    style: str, model_file: str, tmp_path: Path
) -> None:
    """tf.keras's h5 save raised a bare `TypeError: Unable to serialize 0.9 to JSON. Unrecognized type
    EagerTensor` (Keras 3 saves it and fails to load it back)."""
    dirs = plugin(tmp_path, "tensor_config", TENSOR_CONFIG[style])
    job = job_of(short_job_spec("tensor_config", style), tmp_path, dirs)
    with pytest.raises(CheckpointMismatch) as failure:
        job.run()
    assert str(failure.value).startswith(
        f"{model_file}: TensorConfig.get_config() returns 'beta' of type EagerTensor, which a saved model's "
        "config cannot hold; return plain Python values from get_config"
    ), failure.value
    assert not (job.checkpoint_dir / "step-00000002" / f"partial-{model_file}").exists()
    forget("tests_tensor_config")


def legacy_scaled_sgd(name: str, stored: str) -> str:
    """A legacy SGD scaled by `scale`, which it keeps as `stored` says and returns from get_config."""
    return f"""
import tf_keras
from tf_keras import backend


@tf_keras.utils.register_keras_serializable(package="tests")
class {name}(tf_keras.optimizers.legacy.Optimizer):
    def __init__(self, learning_rate=0.01, scale=1.0, name="{name}", **kwargs):
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)
        self.scale = {stored}

    def _resource_apply_dense(self, grad, var, apply_state=None):
        return var.assign_sub(self._decayed_lr(var.dtype) * self.scale * grad)

    def get_config(self):
        config = super().get_config()
        config.update(learning_rate=self._serialize_hyperparameter("learning_rate"), scale=self.scale)
        return config
"""


def test_a_class_that_turns_its_input_into_another_value_passes_but_a_round_trip_that_changes_it_fails(
    tmp_path: Path,
) -> None:
    """`epsilon or backend.epsilon()`, as tf.keras's own Adam writes it, makes 0 its 1e-7: the
    job had failed "hyperparameter 'epsilon' was 0 but came back as 1e-07", blaming the save. A
    value that each rebuild changes again (halved when stored, returned halved) still fails."""
    dirs = plugin(
        tmp_path, "defaulting_sgd", legacy_scaled_sgd("DefaultingSgd", "scale or backend.epsilon()")
    )
    spec = tf_spec("defaulting_sgd", "tf_legacy", {"lr": 0.05, "scale": 0.0}, steps=4, checkpoint_every=2)
    assert run(spec, tmp_path / "defaulting", dirs).checkpoints_verified == 2
    forget("tests_defaulting_sgd")

    def refused(name: str, source: str, scale: float) -> str:
        """The job of `source`'s class with `scale` fails its round trip: the failure's words."""
        dirs = plugin(tmp_path, name, source)
        spec = tf_spec(name, "tf_legacy", {"lr": 0.05, "scale": scale}, steps=4, checkpoint_every=2)
        with pytest.raises(CheckpointMismatch) as failure:
            run(spec, tmp_path / name, dirs)
        forget(f"tests_{name}")
        return str(failure.value)

    assert refused("halving_sgd", legacy_scaled_sgd("HalvingSgd", "scale / 2"), 1.0) == (
        "model.h5: hyperparameter 'scale' was 1.0 (the trained optimizer's get_config() gives 0.5) but came "
        "back as 0.25"
    )
    # A get_config() that reports a constant while the class holds the value it was given: still a fault.
    constant = legacy_scaled_sgd("ConstantSgd", "scale").replace("scale=self.scale", "scale=1.0")
    assert refused("constant_sgd", constant, 0.5) == (
        "model.h5: hyperparameter 'scale' was 0.5 (the trained optimizer's get_config() gives 1.0) but came "
        "back as 1.0"
    )
    # A class that ignores a value it was given (holds and reports 1.0 for 0.5): the job would train
    # with another value than it asked for.
    assert refused("ignoring_sgd", legacy_scaled_sgd("IgnoringSgd", "1.0"), 0.5) == (
        "model.h5: hyperparameter 'scale' was 0.5 (the trained optimizer's get_config() gives 1.0) but came "
        "back as 1.0"
    )
