"""The TensorFlow check tables (the common checks plus Keras's own), one check at a time:
correct optimizers pass (or get a truthful warn), each broken one in tests/checks/broken fails
with a message that names the problem and points at its own file. Keras 3 and legacy tf_keras
run in this one process.

The full runs (every check on every broken file, on every built-in) are the table tests in
test_broken_corpus.py and test_every_optimizer_passes.py; these stay small and fast.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from jobs.checks.context import CheckContext
from jobs.checks.report import CHECK_IDS, ONLY_FOR_STYLES, Outcome
from jobs.checks.runner import checks_for_style, validated_params
from jobs.checks.target import UsageError
from tests.checks.tables import BROKEN_DIR, target_of


def _context(text: str, tmp_path: Path, style: str | None = None) -> CheckContext:
    return CheckContext(target=target_of(text, style), params={}, workdir=tmp_path)


def _broken(name: str, tmp_path: Path) -> CheckContext:
    path = BROKEN_DIR / f"{name}.py"
    class_name = next(
        line.split("class ", 1)[1].split("(", 1)[0]
        for line in path.read_text().splitlines()
        if line.startswith("class ")
    )
    return _context(f"{path}:{class_name}", tmp_path)


def _run(check_id: str, ctx: CheckContext) -> Outcome:
    return checks_for_style(ctx.target.style)[check_id](ctx)


def _assert_fails_here(outcome: Outcome, broken: str, *words: str) -> None:
    assert outcome.status == "fail", outcome
    assert f"{broken}.py:" in outcome.where, outcome
    assert "Fix:" in outcome.detail
    for word in words:
        assert word in outcome.detail, outcome.detail


@pytest.mark.parametrize("style", ["keras", "tf_legacy"])
def test_table_covers_every_tensorflow_check(style: str) -> None:
    torch_only = {check for check, styles in ONLY_FOR_STYLES.items() if styles == ("torch",)}
    assert set(checks_for_style(style)) == set(CHECK_IDS) - torch_only


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("keras-checks")


# -- good optimizers: no false alarm ----------------------------------------------------------------------

GOOD = [
    ("keras.optimizers:Adam", None),
    ("tf_keras.optimizers.legacy:SGD", None),
    ("lion", "keras"),
    ("lion", "tf_legacy"),
]


@pytest.mark.parametrize(
    "check_id",
    [
        "construct",
        "dense_step",
        "descends",
        "none_grads",
        "schedule",
        "config_roundtrip",
        "state_roundtrip",
        "mixed_precision",
    ],
)
@pytest.mark.parametrize(("text", "style"), GOOD, ids=lambda v: str(v))
def test_good_optimizers_pass(check_id: str, text: str, style: str | None, workdir: Path) -> None:
    outcome = _run(check_id, _context(text, workdir, style))
    assert outcome.status == "pass", outcome


class AccumulatingAdam(keras.optimizers.Adam):
    """Adam through Keras's own gradient accumulation: one update every two apply() calls."""

    def __init__(self, learning_rate: float = 0.01, **kwargs: object) -> None:
        kwargs.setdefault("gradient_accumulation_steps", 2)
        super().__init__(learning_rate=learning_rate, **kwargs)  # type: ignore[arg-type]


class AccumulatingAdamByFour(keras.optimizers.Adam):
    """As a TPU-memory recipe: one update every four apply() calls, more than the three steps
    graph_mode and mixed_precision compare."""

    def __init__(self, learning_rate: float = 0.01, **kwargs: object) -> None:
        kwargs.setdefault("gradient_accumulation_steps", 4)
        super().__init__(learning_rate=learning_rate, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["AccumulatingAdam", "AccumulatingAdamByFour"])
@pytest.mark.parametrize(
    "check_id",
    ["dense_step", "descends", "schedule", "state_roundtrip", "graph_mode", "mixed_precision"],
)
def test_keras_gradient_accumulation_set_by_the_class_is_no_false_alarm(
    check_id: str, name: str, workdir: Path
) -> None:
    """A check's step is one update: with the option, that many apply() calls (the schedule check
    had failed: every other call moves nothing; mixed_precision's three calls had made no update of
    a class accumulating four, a fail saying the wrapped optimizer must apply the gradients)."""
    outcome = _run(check_id, _context(f"{__name__}:{name}", workdir))
    assert outcome.status == "pass", outcome


class AccumulatingPythonCounterRMSprop(keras.optimizers.Optimizer):
    """A Python step counter in apply(), frozen when traced, behind an accumulation of four."""

    def __init__(self, learning_rate: float = 1e-3, **kwargs: object) -> None:
        kwargs.setdefault("gradient_accumulation_steps", 4)
        super().__init__(learning_rate=learning_rate, **kwargs)  # type: ignore[arg-type]
        self._t = 0

    def build(self, var_list: list[keras.Variable]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._ms = self.add_optimizer_variables(var_list, "ms")

    def apply(self, grads: list[object], trainable_variables: object = None) -> object:
        self._t += 1
        return super().apply(grads, trainable_variables)  # type: ignore[arg-type]

    def update_step(self, gradient: object, variable: keras.Variable, learning_rate: object) -> None:
        ms = self._ms[self._get_variable_index(variable)]
        g = keras.ops.cast(gradient, variable.dtype)
        self.assign(ms, 0.9 * ms + 0.1 * keras.ops.square(g))
        correction = 1.0 - 0.9**self._t
        rate = keras.ops.cast(learning_rate, variable.dtype)
        self.assign_sub(variable, rate * g / (keras.ops.sqrt(ms / correction) + 1e-7))


def test_graph_mode_compares_updates_not_calls_of_an_accumulating_class(workdir: Path) -> None:
    """Three apply() calls of a class accumulating four updated nothing, eagerly or traced: the
    Python counter frozen by tf.function passed graph_mode, as it fails without accumulation."""
    outcome = _run("graph_mode", _context(f"{__name__}:AccumulatingPythonCounterRMSprop", workdir))
    assert outcome.status == "fail", outcome
    assert "frozen when the function is traced" in outcome.detail, outcome.detail


class AveragedSGD(keras.optimizers.SGD):
    """SGD with Keras's own moving average of the weights (`use_ema`), at a momentum whose rounding
    moves the average of a variable that does not move."""

    def __init__(self, learning_rate: float = 0.01, **kwargs: object) -> None:
        kwargs.setdefault("use_ema", True)
        kwargs.setdefault("ema_momentum", 0.9)
        super().__init__(learning_rate=learning_rate, **kwargs)  # type: ignore[arg-type]


def test_keras_weight_averaging_set_by_the_class_is_no_false_alarm_of_none_grads(workdir: Path) -> None:
    """Keras averages every trainable variable each step, by design: a frozen one's average changed
    by float rounding (1.2e-7), and none_grads had failed the framework's own SGD with `use_ema`."""
    outcome = _run("none_grads", _context(f"{__name__}:AveragedSGD", workdir))
    assert outcome.status == "pass", outcome


class ScaledLossAdam(keras.optimizers.Adam):
    """Adam with Keras's fixed loss scale, whose apply() divides an IndexedSlices by a float."""

    def __init__(self, learning_rate: float = 0.01, **kwargs: object) -> None:
        kwargs.setdefault("loss_scale_factor", 128.0)
        super().__init__(learning_rate=learning_rate, **kwargs)  # type: ignore[arg-type]


def test_a_sparse_crash_in_the_framework_s_own_code_is_not_blamed_on_the_class_s_update(
    workdir: Path,
) -> None:
    """A real crash (a job with an Embedding meets it), but the class's update never ran: the fail
    names Keras's line and the option, not "handle tf.IndexedSlices" in an update it did not write."""
    outcome = _run("sparse", _context(f"{__name__}:ScaledLossAdam", workdir))
    assert outcome.status == "fail", outcome
    assert "crashed in the framework's code with none of the class's on the way" in outcome.detail
    assert "base_optimizer.py:" in outcome.detail and "loss_scale_factor" in outcome.detail


def test_lazy_sparse_update_passes_and_dense_one_is_a_truthful_warn(workdir: Path) -> None:
    assert _run("sparse", _context("lion", workdir, "keras")).status == "pass"
    adam = _run("sparse", _context("keras.optimizers:Adam", workdir))
    assert adam.status == "warn"
    assert "densifies" in adam.detail and "repeated index" in adam.detail


def test_declared_ranges_are_probed(workdir: Path) -> None:
    outcome = _run("construct", _context("lion", workdir, "keras"))
    assert outcome.status == "pass" and outcome.figure == 4.0, outcome  # lr, beta_1, beta_2, weight_decay


def test_legacy_whole_model_formats_warn_only_for_what_every_optimizer_loses(workdir: Path) -> None:
    outcome = _run("save_load_model", _context("tf_keras.optimizers.legacy:Adam", workdir))
    assert outcome.status == "warn", outcome
    assert ".keras" in outcome.detail and "h5" in outcome.detail


def test_keras_model_save_passes(workdir: Path) -> None:
    assert _run("save_load_model", _context("keras.optimizers:Adam", workdir)).status == "pass"


def test_graph_mode_passes_and_state_is_untrainable(workdir: Path) -> None:
    ctx = _context("adam", workdir, "tf_legacy")
    assert _run("graph_mode", ctx).status == "pass"
    assert _run("state_untrainable", ctx).status == "pass"


def test_mixed_precision_restores_the_global_policies(workdir: Path) -> None:
    before = (keras.mixed_precision.global_policy().name, tf_keras.mixed_precision.global_policy().name)
    assert _run("mixed_precision", _context("keras.optimizers:SGD", workdir)).status == "pass"
    assert _run("mixed_precision", _context("tf_keras.optimizers.legacy:SGD", workdir)).status == "pass"
    after = (keras.mixed_precision.global_policy().name, tf_keras.mixed_precision.global_policy().name)
    assert after == before


def test_device_placement_skips_without_a_gpu(workdir: Path) -> None:
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("a GPU is visible: the check runs for real")
    outcome = _run("device_placement", _context("keras.optimizers:Adam", workdir))
    assert outcome.status == "skip" and "GPU" in outcome.detail


# -- broken optimizers: caught, named, located -----------------------------------------------------------


@pytest.mark.parametrize(
    ("broken", "check_id", "words"),
    [
        ("keras_construct", "construct", ("beta=", "accepted")),
        ("keras_dense_step", "dense_step", ("unchanged", "(3,)")),
        ("keras_descends", "descends", ("loss went from",)),
        ("keras_none_grads", "none_grads", ("None",)),
        ("keras_schedule", "schedule", ("LearningRateSchedule", "left every variable unchanged")),
        ("legacy_sparse", "sparse", ("IndexedSlices", "InvalidArgumentError")),
        ("keras_config_roundtrip", "config_roundtrip", ("'nesterov' is not in get_config() after",)),
        ("legacy_state_roundtrip", "state_roundtrip", ("next step differs",)),
        ("keras_save_load_model", "save_load_model", ("register_keras_serializable",)),
        ("keras_graph_mode", "graph_mode", ("tf.function", "bool")),
        ("legacy_mixed_precision", "mixed_precision", ("experimental_aggregate_gradients",)),
        ("keras_state_untrainable", "state_untrainable", ("trainable",)),
    ],
)
def test_broken_optimizer_fails_its_check(
    broken: str, check_id: str, words: tuple[str, ...], workdir: Path
) -> None:
    _assert_fails_here(_run(check_id, _broken(broken, workdir)), broken, *words)


def test_graph_failure_points_at_the_users_if(workdir: Path) -> None:
    outcome = _run("graph_mode", _broken("keras_graph_mode", workdir))
    source = (BROKEN_DIR / "keras_graph_mode.py").read_text().splitlines()
    line = int(outcome.where.rsplit(":", 1)[1])
    assert source[line - 1].strip().startswith("if "), outcome.where


def test_slow_update_warns_with_the_ratio(workdir: Path) -> None:
    outcome = _run("step_cost", _broken("keras_step_cost", workdir))
    assert outcome.status == "warn" and outcome.figure is not None and outcome.figure > 3, outcome
    assert "SelfAdjointEig" in outcome.detail  # where the time goes


def test_deprecated_call_warns_at_the_users_line(workdir: Path) -> None:
    outcome = _run("deprecations", _broken("legacy_deprecations", workdir))
    assert outcome.status == "warn" and "to_float" in outcome.detail, outcome
    source = (BROKEN_DIR / "legacy_deprecations.py").read_text().splitlines()
    assert "to_float" in source[int(outcome.where.rsplit(":", 1)[1]) - 1]


class OldApiLion(keras.optimizers.Optimizer):
    """Written for the tf.keras 2.11 optimizer, as lion-tf is: Keras 3's base requires learning_rate."""

    def __init__(self, learning_rate: float = 1e-4, name: str = "OldApiLion", **kwargs: object) -> None:
        super().__init__(name=name, **kwargs)  # type: ignore[call-arg, arg-type]
        self._learning_rate = learning_rate

    def _resource_apply_dense(self, grad: object, var: object, apply_state: object = None) -> None:
        raise AssertionError("never reached: the class is not built under Keras 3")


class PositionalNameOptimizer(keras.optimizers.Optimizer):
    """Written for OptimizerV2's `__init__(name, **kwargs)`, as adabelief-tf is: Keras 3 takes the name
    for the learning rate and refuses it."""

    def __init__(self, learning_rate: float = 1e-3, name: str = "PositionalName", **kwargs: object) -> None:
        super().__init__(name, **kwargs)  # type: ignore[arg-type]

    def _resource_apply_dense(self, grad: object, var: object, apply_state: object = None) -> None:
        raise AssertionError("never reached: the class is not built under Keras 3")


@pytest.mark.parametrize(
    ("class_name", "error"),
    [
        ("OldApiLion", "missing 1 required positional argument: 'learning_rate'"),
        ("PositionalNameOptimizer", "Received instead: learning_rate=PositionalName"),
    ],
)
def test_a_class_written_for_an_older_optimizer_api_fails_construct(
    class_name: str, error: str, workdir: Path
) -> None:
    outcome = _run("construct", _context(f"{__name__}:{class_name}", workdir))
    assert outcome.status == "fail", outcome.detail
    assert error in outcome.detail and "in the constructor of a base class" in outcome.detail
    source = Path(__file__).read_text().splitlines()
    assert "super().__init__(" in source[int(outcome.where.rsplit(":", 1)[1]) - 1]


class DerivedBeta(keras.optimizers.Optimizer):
    """SGD with momentum whose `beta: float | None = None` means "derive it": the config stores the
    derived value, and a reload that passes it on builds the same optimizer."""

    def __init__(self, learning_rate: float = 0.01, beta: float | None = None, **kwargs: object) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)  # type: ignore[arg-type]
        self.beta = 0.9 if beta is None else beta

    def build(self, variables: list[keras.Variable]) -> None:
        super().build(variables)
        self.velocities = [self.add_variable_from_reference(v, "velocity") for v in variables]

    def update_step(self, gradient: object, variable: keras.Variable, learning_rate: object) -> None:
        velocity = self.velocities[self._get_variable_index(variable)]
        self.assign(velocity, keras.ops.add(keras.ops.multiply(velocity, self.beta), gradient))
        self.assign_sub(variable, keras.ops.multiply(velocity, keras.ops.cast(learning_rate, variable.dtype)))

    def get_config(self) -> dict[str, object]:
        return {**super().get_config(), "beta": self.beta}


@pytest.mark.parametrize("params", [{}, {"beta": 0.5}], ids=["derived", "given"])
def test_an_optional_number_left_to_the_class_passes_config_roundtrip(
    params: dict[str, float], workdir: Path
) -> None:
    target = target_of(f"{__name__}:DerivedBeta")
    assert target.entry.params["beta"].type == "float" and target.entry.params["beta"].default is None
    ctx = CheckContext(target=target, params=params, workdir=workdir)
    outcome = _run("config_roundtrip", ctx)
    assert outcome.status == "pass", outcome.detail


class OwnRateSGD(keras.optimizers.Optimizer):
    """SGD stepping with a rate of its own built from the one given, as the Model Garden's SGDTorch
    keeps a bias rate and an "other" rate: a schedule reaches it, a rate set by hand does not."""

    def __init__(self, learning_rate: object = 0.01, **kwargs: object) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)  # type: ignore[arg-type]
        self.other_rate = learning_rate

    def update_step(self, gradient: object, variable: keras.Variable, learning_rate: object) -> None:
        rate = self.other_rate(self.iterations) if callable(self.other_rate) else self.other_rate
        self.assign_sub(variable, keras.ops.multiply(gradient, keras.ops.cast(rate, variable.dtype)))


class OwnRateLegacySGD(tf_keras.optimizers.legacy.Optimizer):
    """The same in the legacy style, with the second rate a hyperparameter as SGDTorch has it."""

    def __init__(
        self, learning_rate: object = 0.01, name: str = "OwnRateLegacySGD", **kwargs: object
    ) -> None:
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)
        self._set_hyper("other_learning_rate", learning_rate)

    def _resource_apply_dense(self, grad: object, var: object, apply_state: object = None) -> object:
        rate = self._get_hyper("other_learning_rate", var.dtype.base_dtype)  # type: ignore[attr-defined]
        if isinstance(rate, tf_keras.optimizers.schedules.LearningRateSchedule):
            rate = tf_keras.backend.cast(rate(self.iterations), var.dtype.base_dtype)  # type: ignore[attr-defined]
        return var.assign_sub(rate * grad)  # type: ignore[attr-defined, operator]

    def get_config(self) -> dict[str, object]:
        config: dict[str, object] = super().get_config()
        config["learning_rate"] = self._serialize_hyperparameter("learning_rate")
        return config


@pytest.mark.parametrize("name", ["OwnRateSGD", "OwnRateLegacySGD"])
def test_a_schedule_followed_where_a_rate_set_by_hand_is_not_is_a_warn(name: str, workdir: Path) -> None:
    """Not "the schedule was not followed" (a false alarm on SGDTorch): the schedule is followed, as the
    same rates fed through a schedule object show; the hand-set rate is what the class leaves aside."""
    outcome = _run("schedule", _context(f"{__name__}:{name}", workdir))
    assert outcome.status == "warn", outcome.detail
    assert "matched the same rates set by hand in a schedule object each step" in outcome.detail
    assert "is not the rate the class steps with: after step 0" in outcome.detail
    assert "optimizer.learning_rate = rate" in outcome.detail and "optlab's jobs pass" in outcome.detail


class WarmupByDefaultSGD(keras.optimizers.Optimizer):
    """SGD whose default rate is a warm-up schedule of its own, as published classes ship one: Keras
    lets no rate set by hand replace a schedule, so a run that sets rates by hand must build it with a
    plain rate, as a user who sets rates by hand does."""

    def __init__(self, learning_rate: object = None, **kwargs: object) -> None:
        if learning_rate is None:
            learning_rate = keras.optimizers.schedules.CosineDecay(
                0.0, decay_steps=100, warmup_target=0.01, warmup_steps=10
            )
        super().__init__(learning_rate=learning_rate, **kwargs)  # type: ignore[arg-type]

    def update_step(self, gradient: object, variable: keras.Variable, learning_rate: object) -> None:
        self.assign_sub(variable, keras.ops.multiply(gradient, keras.ops.cast(learning_rate, variable.dtype)))


def test_a_class_whose_default_rate_is_a_schedule_follows_a_schedule(workdir: Path) -> None:
    outcome = _run("schedule", _context(f"{__name__}:WarmupByDefaultSGD", workdir))
    assert outcome.status == "pass", outcome.detail
    assert "zero-rate steps left the variables alone" in outcome.detail


class OwnCounterSGD(keras.optimizers.Optimizer):
    """SGD with a step counter of its own per variable, a scalar tf.Variable rather than an
    optimizer variable: a checkpoint keeps it, a whole-model save does not."""

    def build(self, var_list: list[keras.Variable]) -> None:
        super().build(var_list)
        self.counters = [tf.Variable(0.0, trainable=False) for _ in var_list]

    def update_step(self, gradient: object, variable: keras.Variable, learning_rate: object) -> None:
        counter = self.counters[self._get_variable_index(variable)]
        counter.assign_add(1.0)
        rate = keras.ops.cast(learning_rate, variable.dtype) / keras.ops.sqrt(counter)
        self.assign_sub(variable, keras.ops.multiply(gradient, rate))


def test_a_scalar_tf_variable_of_the_class_s_own_is_state_a_whole_model_save_drops(workdir: Path) -> None:
    outcome = _run("save_load_model", _context(f"{__name__}:OwnCounterSGD", workdir))
    assert outcome.status == "fail", outcome.detail
    assert "tf.Variable(s) the optimizer tracks are not among optimizer.variables" in outcome.detail


class HyperRateSGD(tf_keras.optimizers.legacy.Optimizer):
    """Legacy SGD reading its rate with `_get_hyper`, which hands back a schedule object as it is: the
    math on it crashes in every job, each of which builds the optimizer with its schedule."""

    def __init__(self, learning_rate: object = 0.01, name: str = "HyperRateSGD", **kwargs: object) -> None:
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)

    def _resource_apply_dense(self, grad: object, var: object, apply_state: object = None) -> object:
        rate = self._get_hyper("learning_rate", var.dtype.base_dtype)  # type: ignore[attr-defined]
        return var.assign_sub(rate * grad)  # type: ignore[attr-defined, operator]

    def get_config(self) -> dict[str, object]:
        config: dict[str, object] = super().get_config()
        config["learning_rate"] = self._serialize_hyperparameter("learning_rate")
        return config


def test_a_legacy_class_whose_math_crashes_on_a_schedule_fails_schedule(workdir: Path) -> None:
    """Not "refuses a schedule with a clear error" because the crash quotes the schedule's repr."""
    outcome = _run("schedule", _context(f"{__name__}:HyperRateSGD", workdir))
    assert outcome.status == "fail", outcome.detail
    assert "(as a job builds it, with its schedule) the class crashes: ValueError" in outcome.detail
    assert "_decayed_lr" in outcome.detail


def test_a_legacy_class_without_a_sparse_path_is_told_to_write_one_or_refuse(workdir: Path) -> None:
    outcome = _run("sparse", _context(f"{__name__}:HyperRateSGD", workdir))
    assert outcome.status == "fail", outcome.detail
    assert (
        "reached `_resource_apply_sparse`, which the class leaves to the framework's base" in outcome.detail
    )
    assert "implement _resource_apply_sparse" in outcome.detail


class DenseOnlyLegacySGD(HyperRateSGD):
    """Refuses sparse gradients in its own sparse method, in words that never say "sparse"."""

    def _resource_apply_dense(self, grad: object, var: object, apply_state: object = None) -> object:
        return var.assign_sub(self._decayed_lr(var.dtype.base_dtype) * grad)  # type: ignore[attr-defined, operator]

    def _resource_apply_sparse(
        self, grad: object, var: object, indices: object, apply_state: object = None
    ) -> object:
        raise NotImplementedError("DenseOnlyLegacySGD: not implemented")


class DenseOnlyMomentum(keras.optimizers.SGD):
    """Refuses a row-sparse gradient by what it takes: "dense gradients only"."""

    def update_step(self, gradient: object, variable: object, learning_rate: object) -> None:
        if isinstance(gradient, tf.IndexedSlices):
            raise ValueError("DenseOnlyMomentum supports dense gradients only; densify the embedding's rows")
        super().update_step(gradient, variable, learning_rate)


@pytest.mark.parametrize("name", ["DenseOnlyLegacySGD", "DenseOnlyMomentum"])
def test_a_refusal_of_sparse_gradients_in_other_words_is_a_refusal(workdir: Path, name: str) -> None:
    """Both had failed as "crashed inside the update", with the fix to raise a clear error: what they do."""
    outcome = _run("sparse", _context(f"{__name__}:{name}", workdir))
    assert outcome.status == "pass", outcome.detail
    assert outcome.detail.startswith("refuses sparse gradients with a clear error: ")


class SortedIdsLegacySGD(HyperRateSGD):
    """Legacy SGD whose sparse path sorts the ids (for locality) and leaves their values in batch
    order: right only while the ids come sorted, which an Embedding's do not."""

    def _resource_apply_dense(self, grad: object, var: object, apply_state: object = None) -> object:
        return var.assign_sub(self._decayed_lr(var.dtype.base_dtype) * grad)  # type: ignore[attr-defined, operator]

    def _resource_apply_sparse(
        self, grad: object, var: object, indices: object, apply_state: object = None
    ) -> object:
        rate = self._decayed_lr(var.dtype.base_dtype)  # type: ignore[attr-defined]
        return self._resource_scatter_add(var, tf.sort(indices), -rate * grad)  # type: ignore[operator]


def test_a_sparse_path_right_only_for_sorted_ids_fails_at_the_sparse_method(workdir: Path) -> None:
    """A class that has its _resource_apply_sparse is told where its math differs, not (as it had
    been) to implement it."""
    outcome = _run("sparse", _context(f"{__name__}:SortedIdsLegacySGD", workdir))
    assert outcome.status == "fail", outcome.detail
    assert "differ by up to" in outcome.detail
    assert "the class's _resource_apply_sparse computes them otherwise than its _resource_apply_dense" in (
        outcome.detail
    )
    assert "Fix: make _resource_apply_sparse compute on the touched rows" in outcome.detail, outcome.detail
    assert "implement _resource_apply_sparse" not in outcome.detail, outcome.detail
    line = int(outcome.where.rsplit(":", 1)[1])
    assert "def _resource_apply_sparse" in Path(__file__).read_text().splitlines()[line - 1]


class NoUpdateOpLegacySGD(SortedIdsLegacySGD):
    """Legacy SGD whose dense update assigns and returns nothing (as google/automl's Lion for TF2):
    eagerly fine; inside tf.function tf_keras groups what it returns, and None cannot be grouped."""

    def _resource_apply_dense(self, grad: object, var: object, apply_state: object = None) -> None:  # type: ignore[override]
        var.assign_sub(self._decayed_lr(var.dtype.base_dtype) * grad)  # type: ignore[attr-defined]


def test_a_legacy_update_that_returns_no_op_is_told_to_return_it(workdir: Path) -> None:
    """Not the usual advice about Python `if` on tensors, which such a class does not have."""
    outcome = _run("graph_mode", _context(f"{__name__}:NoUpdateOpLegacySGD", workdir))
    assert outcome.status == "fail", outcome.detail
    assert "Received 'None'" in outcome.detail
    assert "Fix: return the update op from _resource_apply_dense and _resource_apply_sparse" in outcome.detail
    assert "if/while" not in outcome.detail
    # The timed update runs in a graph too: its skip says the same (it quoted TensorFlow's words only).
    cost = _run("step_cost", _context(f"{__name__}:NoUpdateOpLegacySGD", workdir / "cost"))
    assert cost.status == "skip", cost.detail
    assert "Fix: return the update op from _resource_apply_dense" in cost.detail


class Wrapping(keras.optimizers.Optimizer):
    """A wrapper in the shape of the Model Garden's ExponentialMovingAverage: the optimizer it wraps is
    a required argument."""

    def __init__(
        self, optimizer: keras.optimizers.Optimizer, average_decay: float = 0.99, **kwargs: object
    ) -> None:
        super().__init__(learning_rate=0.01, **kwargs)  # type: ignore[arg-type]
        self.inner, self.average_decay = optimizer, average_decay

    def apply(self, grads: object, trainable_variables: object = None) -> None:
        self.inner.apply(grads, trainable_variables)


def test_a_keras_wrapper_is_told_that_no_base_serves_it_not_to_name_one(workdir: Path) -> None:
    """The construct skip had said to name a base (optimizer.base), and --base then said Keras builds
    no wrapper: each message sent the user to the other."""
    outcome = _run("construct", _context(f"{__name__}:Wrapping", workdir))
    assert outcome.status == "skip", outcome.detail
    assert "wraps a base optimizer (its 'optimizer' argument)" in outcome.detail, outcome.detail
    assert "tensorflow jobs and checks build no wrapper" in outcome.detail
    assert "optimizer.base" not in outcome.detail


class NaiveFromConfig(tf_keras.optimizers.legacy.Optimizer):
    """Rebuilds itself with `cls(**config)`, as the Model Garden's LARS does: a schedule in the config
    stays a dict, which the constructor stores without a word and the first read cannot convert."""

    def __init__(self, learning_rate: object = 0.01, name: str = "NaiveFromConfig", **kwargs: object) -> None:
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)

    def _resource_apply_dense(self, grad: object, var: object, apply_state: object = None) -> object:
        return var.assign_sub(self._decayed_lr(var.dtype.base_dtype) * grad)  # type: ignore[attr-defined, operator]

    def get_config(self) -> dict[str, object]:
        config: dict[str, object] = super().get_config()
        config["learning_rate"] = self._serialize_hyperparameter("learning_rate")
        return config

    @classmethod
    def from_config(cls, config: dict[str, object], custom_objects: object = None) -> NaiveFromConfig:
        return cls(**config)


def test_a_from_config_that_leaves_the_schedule_serialized_fails_config_roundtrip(workdir: Path) -> None:
    """It had passed: the rebuilt optimizer's config compares equal, dict and all."""
    outcome = _run("config_roundtrip", _context(f"{__name__}:NaiveFromConfig", workdir))
    assert outcome.status == "fail", outcome.detail
    assert "built an optimizer whose learning rate cannot be read" in outcome.detail
    assert "with an unsupported type (<class 'dict'>)" in outcome.detail
    assert "from_config must turn a serialized schedule" in outcome.detail


class KeepsItsGradients(keras.optimizers.SGD):
    """Keeps each step's gradients as an attribute, a list of tensors, which tf.train.Checkpoint
    tracks and cannot walk: its own error had been a bare "The truth value of an array with more
    than one element is ambiguous"."""

    def _backend_update_step(self, grads: list, trainable_variables: list, learning_rate: object) -> None:
        self.grads = grads
        grads[0] = grads[0] * 1.0  # clipped in place, as NoteDance's Lamb does: the tracked list changed
        for gradient, variable in zip(grads, trainable_variables, strict=True):
            self.update_step(gradient, variable, learning_rate)


def test_state_tf_cannot_checkpoint_is_named_by_its_attribute(workdir: Path) -> None:
    from jobs.frameworks import driver_for
    from jobs.frameworks.base import StateNotSaved

    driver = driver_for("keras")
    variables = driver.variables([np.ones((3, 2)), np.ones(2)])
    optimizer = driver.optimizer_over(lambda _: KeepsItsGradients(learning_rate=0.1), variables)
    driver.step(optimizer, variables, [np.ones((3, 2)), np.ones(2)])
    with pytest.raises(StateNotSaved, match=r"cannot save the optimizer: `grads` hold\(s\) tensors in a"):
        driver.save_state(optimizer, variables, workdir / "saved")


class BuildFails(keras.optimizers.SGD):
    """A fault in `build`, which Keras runs at the first apply: every check that builds state had
    failed on it (13 fails for one line of NoteDance's RAdam)."""

    def build(self, variables: list) -> None:
        super().build(variables)
        raise RuntimeError("build_fails: a slot this class never finished")


def test_a_fault_in_build_fails_dense_step_once_and_the_other_checks_say_so(workdir: Path) -> None:
    from jobs.checks.runner import run_checks

    report = run_checks(target_of(f"{__name__}:BuildFails"), {}, workdir=workdir)
    failed = {c.id: c for c in report.checks if c.status == "fail"}
    assert set(failed) == {"dense_step"}, {c.id: c.detail for c in failed.values()}
    assert "build_fails: a slot this class never finished" in failed["dense_step"].detail
    assert "test_keras_checks.py:" in failed["dense_step"].where


class HostRoundTripSGD(keras.optimizers.Optimizer):
    """SGD passing each gradient through Python: any tf.function runs it, XLA cannot compile it."""

    def __init__(self, learning_rate: float = 0.01, **kwargs: object) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)  # type: ignore[arg-type]

    def update_step(self, gradient: object, variable: object, learning_rate: object) -> None:
        passed = tf.py_function(lambda g: g, [gradient], gradient.dtype)  # type: ignore[attr-defined]
        passed.set_shape(gradient.shape)  # type: ignore[attr-defined]
        self.assign_sub(variable, keras.ops.cast(learning_rate, variable.dtype) * passed)  # type: ignore[attr-defined]


def test_an_update_xla_cannot_compile_is_a_warn_naming_the_op(workdir: Path) -> None:
    """In the words a job with jit_compile says it in (one wording, in the Keras driver)."""
    outcome = _run("graph_mode", _context(f"{__name__}:HostRoundTripSGD", workdir))
    assert outcome.status == "warn", outcome.detail
    assert (
        "the update works under tf.function but not with jit_compile=True (XLA): XLA cannot compile "
        "EagerPyFunc; jobs with jit_compile will fail" in outcome.detail
    ), outcome.detail
    assert "Fix: avoid ops XLA cannot compile in the update (tf.py_function" in outcome.detail


# -- classes that take no learning rate --------------------------------------------------------------

RATELESS = Path(__file__).parent / "rateless_keras.py"


@pytest.mark.parametrize("name", ["SignStep", "LegacySignStep"])
def test_a_class_that_takes_no_learning_rate_is_built_without_one(name: str, workdir: Path) -> None:
    """Its catalogue entry had an `lr` no constructor took: `construct` failed it with a TypeError
    (Keras 3: "got multiple values for keyword argument 'learning_rate'"; legacy: "Unexpected keyword
    argument"), and so did every job. Every check passes it now, but for the whole-model format's loss
    of every legacy optimizer's state (a warn said of the framework's SGD too)."""
    from jobs.checks.runner import run_checks

    target = target_of(f"{RATELESS}:{name}")
    assert "lr" not in target.entry.params
    report = run_checks(target, {}, workdir=workdir)
    outcomes = {r.id: r for r in report.checks}
    assert [r.id for r in report.checks if r.status == "fail"] == [], report.checks
    warned = [r.id for r in report.checks if r.status == "warn"]
    assert warned == ([] if name == "SignStep" else ["save_load_model"]), warned
    assert outcomes["schedule"].status == "skip"
    assert "the class takes no learning rate (its constructor declares none)" in outcomes["schedule"].detail


def test_a_config_that_gives_back_the_rate_the_class_fills_itself_is_told_to_leave_it_out(
    workdir: Path,
) -> None:
    """from_config(get_config()) gave the base `learning_rate` twice: a true fault, named."""
    outcome = _run("config_roundtrip", _context(f"{RATELESS}:GivesItsRateBack", workdir))
    assert outcome.status == "fail", outcome
    assert "got multiple values for keyword argument 'learning_rate'" in outcome.detail
    assert "leave it out of the config (`config.pop('learning_rate', None)` in get_config)" in outcome.detail


WRONG_SIGNATURES = """
import keras
import tensorflow as tf
import tf_keras


class LegacyTwoArgumentSparse(tf_keras.optimizers.legacy.Optimizer):
    def __init__(self, learning_rate=0.01, name="LegacyTwoArgumentSparse", **kwargs):
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)

    def _resource_apply_dense(self, grad, var, apply_state=None):
        return var.assign_sub(self._get_hyper("learning_rate", var.dtype) * grad)

    def _resource_apply_sparse(self, grad, var):  # tf.keras passes indices (and apply_state) too
        return var.assign_sub(grad)

    def get_config(self):
        return {**super().get_config(), "learning_rate": self._serialize_hyperparameter("learning_rate")}


class NoRateInUpdate(keras.optimizers.Optimizer):
    def __init__(self, learning_rate=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def update_step(self, gradient, variable):  # Keras 3 passes the learning rate too
        self.assign_sub(variable, 0.01 * gradient)


class CallsItsHelperWrongly(keras.optimizers.Optimizer):
    def __init__(self, learning_rate=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def _scaled(self, gradient, rate):
        return gradient * rate

    def update_step(self, gradient, variable, learning_rate):
        self.assign_sub(variable, self._scaled(gradient, learning_rate, 2.0))  # the class's own call
"""


@pytest.mark.parametrize(
    ("name", "check_id", "method", "expected"),
    [
        (
            "LegacyTwoArgumentSparse",
            "sparse",
            "_resource_apply_sparse",
            "_resource_apply_sparse(self, grad, handle, indices, apply_state)",
        ),
        (
            "NoRateInUpdate",
            "dense_step",
            "update_step",
            "update_step(self, gradient, variable, learning_rate)",
        ),
    ],
)
def test_a_method_the_framework_calls_with_other_arguments_is_named_with_its_signature(
    name: str, check_id: str, method: str, expected: str, tmp_path: Path
) -> None:
    """The class's method never ran, so no line of it was on the way: the sparse check had blamed an
    option of the framework's base, and the line shown was the class statement."""
    path = tmp_path / "wrong_signatures.py"
    path.write_text(WRONG_SIGNATURES)
    outcome = _run(check_id, _context(f"{path}:{name}", tmp_path))
    assert outcome.status == "fail", outcome
    assert outcome.detail.startswith(f"the framework called the class's {method} with other arguments"), (
        outcome
    )
    assert f"Fix: give {method} the signature the framework calls it with: {expected}" in outcome.detail
    line = next(i for i, text in enumerate(WRONG_SIGNATURES.splitlines(), 1) if f"def {method}(" in text)
    assert outcome.where == f"{path}:{line}"


def test_a_method_the_class_itself_calls_wrongly_is_the_line_of_its_call(tmp_path: Path) -> None:
    """Not the framework's call: the fail shows the class's own line, not a signature to adopt."""
    path = tmp_path / "wrong_signatures.py"
    path.write_text(WRONG_SIGNATURES)
    outcome = _run("dense_step", _context(f"{path}:CallsItsHelperWrongly", tmp_path))
    assert outcome.status == "fail", outcome
    assert "the framework called" not in outcome.detail
    line = next(
        i for i, text in enumerate(WRONG_SIGNATURES.splitlines(), 1) if "self._scaled(gradient" in text
    )
    assert outcome.where == f"{path}:{line}"


FOREIGN_METHODS = '''
import keras
import tensorflow as tf
import tf_keras


class PortedAdam(keras.optimizers.Adam):
    """A port from tf.keras that kept its update in the legacy method."""

    def _resource_apply_dense(self, grad, var, apply_state=None):
        var.assign_sub(0.5 * grad)


class CentralizedRMSprop(keras.optimizers.RMSprop):
    """keras-io's gradient centralization, written in Keras 2's get_gradients."""

    def get_gradients(self, loss, params):
        return [g - tf.reduce_mean(g) for g in super().get_gradients(loss, params)]


class LegacyMethodsOnly(keras.optimizers.Optimizer):
    """Keras 3's base, tf.keras's methods: no update of Keras 3's own."""

    def __init__(self, learning_rate=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def _create_slots(self, var_list):
        pass

    def _resource_apply_dense(self, grad, var, apply_state=None):
        var.assign_sub(self.learning_rate * grad)


class KerasThreeUpdateInLegacyAdam(tf_keras.optimizers.legacy.Adam):
    def update_step(self, gradient, variable, learning_rate):
        variable.assign_sub(0.5 * gradient)


class CentralizedLegacyRMSprop(tf_keras.optimizers.legacy.RMSprop):
    def get_gradients(self, loss, params):
        return [g - tf.reduce_mean(g) for g in super().get_gradients(loss, params)]


class SlotsInCreateSlots(keras.optimizers.Optimizer):
    """Its update is Keras 3's, its state made where only tf.keras makes it."""

    def __init__(self, learning_rate=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def _create_slots(self, var_list):
        self.momenta = [self.add_variable_from_reference(v, "momentum") for v in var_list]

    def update_step(self, gradient, variable, learning_rate):
        momentum = self.momenta[self._get_variable_index(variable)]
        self.assign(momentum, 0.9 * momentum + gradient)
        self.assign_sub(variable, keras.ops.cast(learning_rate, variable.dtype) * momentum)


class BothApis(keras.optimizers.Optimizer):
    """update_step for Keras 3; tf.keras's methods kept for a legacy base."""

    def __init__(self, learning_rate=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        self.assign_sub(variable, keras.ops.cast(learning_rate, variable.dtype) * gradient)

    def _create_slots(self, var_list):
        pass

    def _resource_apply_dense(self, grad, var, apply_state=None):
        var.assign_sub(self.learning_rate * grad)


class LazySparseAdam(keras.optimizers.Adam):
    """Sparse gradients to a method of its own, named like tf.keras's, dense ones to Adam."""

    def apply_gradients(self, grads_and_vars):
        pairs = list(grads_and_vars)
        for grad, var in pairs:
            if isinstance(grad, tf.IndexedSlices):
                self._resource_apply_sparse(grad.values, var, grad.indices)
        return super().apply_gradients([(g, v) for g, v in pairs if not isinstance(g, tf.IndexedSlices)])

    def _resource_apply_sparse(self, grad, var, indices, apply_state=None):
        var.scatter_sub(tf.IndexedSlices(0.01 * grad, indices))


class UpdatesInItsApplyGradients(keras.optimizers.Optimizer):
    """Keras 3's apply_gradients is its update; a tf.keras method is left over, never called."""

    def __init__(self, learning_rate=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def apply_gradients(self, grads_and_vars):
        for grad, var in grads_and_vars:
            var.assign_sub(0.01 * grad)
        self._iterations.assign_add(1)

    def _resource_apply_dense(self, grad, var, apply_state=None):
        var.assign_sub(self.learning_rate * grad)


class OwnGetGradients(keras.optimizers.SGD):
    """A method of its own that happens to be called get_gradients, with other arguments."""

    def get_gradients(self):
        return list(self.variables)


class PrintAdadelta(keras.optimizers.Adadelta):
    """A debugging override left in, its print commented out: it hands on what the base returns."""

    def get_gradients(self, loss, params):
        grads = super().get_gradients(loss, params)
        # grads[0] = tf.Print(grads[0], [grads[0]])
        return grads


class CallsItByABuiltName(keras.optimizers.SGD):
    """Calls its legacy-named update by a name it builds, which no reading of its code finds, and
    hands zeros on to SGD's apply_gradients for the step count."""

    def apply_gradients(self, grads_and_vars):
        pairs = list(grads_and_vars)
        update = getattr(self, "_resource_" + "apply_dense")
        for grad, var in pairs:
            update(grad, var)
        return super().apply_gradients([(tf.zeros_like(grad), var) for grad, var in pairs])

    def _resource_apply_dense(self, grad, var, apply_state=None):
        var.assign_sub(0.01 * grad)


class TapeAdam(keras.optimizers.Adam):
    """A convenience of its own for custom loops, named get_gradients but with other arguments."""

    def get_gradients(self, tape, loss):
        return tape.gradient(loss, self.variables)


class ClippedPort(keras.optimizers.Adam):
    """A tf.keras port: its sign update kept in _resource_apply_dense, a clipping apply_gradients that
    hands on to Adam's, so the class trains as Adam."""

    def apply_gradients(self, grads_and_vars):
        return super().apply_gradients([(tf.clip_by_norm(g, 1.0), v) for g, v in grads_and_vars])

    def _resource_apply_dense(self, grad, var, apply_state=None):
        var.assign_sub(0.01 * tf.sign(grad))


class ScaledLegacyGradients(tf_keras.optimizers.legacy.SGD):
    """Scales the loss in Keras 2's get_gradients, which TensorFlow 2's fit never calls."""

    def get_gradients(self, loss, params):
        return super().get_gradients(loss * 2.0, params)
'''


IN_ITS_PLACE = {
    "PortedAdam": (
        "_resource_apply_dense",
        "Keras 3 calls update_step in its place, which the class inherits from Adam (keras): the class "
        "steps as Adam (keras) does",
    ),
    "CentralizedRMSprop": (
        "get_gradients",
        "Keras 3 calls apply_gradients in its place, which the class inherits from BaseOptimizer (keras): "
        "the gradients reach the update as they were taken",
    ),
    "LegacyMethodsOnly": (
        "_resource_apply_dense",
        "Keras 3 calls update_step in its place, which the class does not define and BaseOptimizer (keras) "
        "leaves unimplemented (a step raises NotImplementedError)",
    ),
    "ClippedPort": (
        "_resource_apply_dense",
        "Keras 3 calls update_step in its place, which the class inherits from Adam (keras): the class "
        "steps as Adam (keras) does",
    ),
    "ScaledLegacyGradients": (
        "get_gradients",
        "tf.keras calls _compute_gradients in its place, which the class inherits from OptimizerV2 "
        "(tf_keras): the gradients reach the update as they were taken",
    ),
    "KerasThreeUpdateInLegacyAdam": (
        "update_step",
        "tf.keras calls _resource_apply_dense in its place, which the class inherits from Adam (tf_keras): "
        "the class steps as Adam (tf_keras) does",
    ),
    "CentralizedLegacyRMSprop": (
        "get_gradients",
        "tf.keras calls _compute_gradients in its place, which the class inherits from OptimizerV2 "
        "(tf_keras): the gradients reach the update as they were taken",
    ),
}


def _line_of(source: str, class_name: str, code: str) -> int:
    """The first line at or after `class class_name(` that holds `code`."""
    lines = source.splitlines()
    start = next(i for i, text in enumerate(lines) if text.startswith(f"class {class_name}("))
    return next(i for i, text in enumerate(lines[start:], start + 1) if code in text)


@pytest.mark.parametrize("name", list(IN_ITS_PLACE))
def test_a_method_of_another_optimizer_api_that_never_runs_fails_dense_step_at_its_def(
    name: str, tmp_path: Path
) -> None:
    """A port that kept the old API's method steps with what it inherits (or raises the base's
    NotImplementedError, which had been all the fail said); every other check passed it."""
    method, in_its_place = IN_ITS_PLACE[name]
    path = tmp_path / "foreign_methods.py"
    path.write_text(FOREIGN_METHODS)
    outcome = _run("dense_step", _context(f"{path}:{name}", tmp_path))
    assert outcome.status == "fail", outcome
    assert outcome.detail.startswith(f"{name}.{method} never runs: it is a method "), outcome.detail
    assert in_its_place in outcome.detail, outcome.detail
    assert outcome.where == f"{path}:{_line_of(FOREIGN_METHODS, name, f'def {method}(')}"
    assert "Fix: " in outcome.detail


def test_state_made_where_only_tf_keras_makes_it_is_named_on_the_step_that_fails(tmp_path: Path) -> None:
    path = tmp_path / "foreign_methods.py"
    path.write_text(FOREIGN_METHODS)
    outcome = _run("dense_step", _context(f"{path}:SlotsInCreateSlots", tmp_path))
    assert outcome.status == "fail", outcome
    assert "momenta" in outcome.detail.split("; SlotsInCreateSlots._create_slots never runs")[0], (
        outcome.detail
    )
    assert (
        "SlotsInCreateSlots._create_slots never runs: it is a method of tf.keras's legacy optimizer API "
        "(Keras 2's OptimizerV2), which Keras 3 never calls; Keras 3 calls build in its place"
    ) in outcome.detail
    assert "the state it would make is never made" in outcome.detail
    # The error's own line stays the one shown: the fix goes there or into build.
    assert outcome.where == f"{path}:{_line_of(FOREIGN_METHODS, 'SlotsInCreateSlots', 'self.momenta[')}"


@pytest.mark.parametrize(
    "name",
    [
        "BothApis",
        "LazySparseAdam",
        "CallsItByABuiltName",
        "UpdatesInItsApplyGradients",
        "OwnGetGradients",
        "PrintAdadelta",
        "TapeAdam",
    ],
)
def test_a_method_of_another_api_that_the_class_calls_or_backs_with_its_own_is_no_false_alarm(
    name: str, tmp_path: Path
) -> None:
    """Written for both APIs (update_step there too), called by the class's own code, called by a
    name built at run time (no reading of the code finds it; the steps show it called), updating in
    Keras 3's own apply_gradients, a method of the name with other arguments, or one that only hands
    on what the base's returns."""
    path = tmp_path / "foreign_methods.py"
    path.write_text(FOREIGN_METHODS)
    outcome = _run("dense_step", _context(f"{path}:{name}", tmp_path))
    assert outcome.status == "pass", outcome


SPARSE_PATH_ONLY_EAGER = '''
import tensorflow as tf
import tf_keras


class LazyDecaySGD(tf_keras.optimizers.legacy.Optimizer):
    """SGD whose sparse path branches in Python on a hyperparameter tensor: fine eagerly, an error
    when traced, as it is in fit with an Embedding."""

    def __init__(self, learning_rate=0.01, weight_decay=0.0, name="LazyDecaySGD", **kwargs):
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)
        self._set_hyper("weight_decay", weight_decay)

    def _resource_apply_dense(self, grad, var, apply_state=None):
        return var.assign_sub(self._decayed_lr(var.dtype.base_dtype) * grad)

    def _resource_apply_sparse_duplicate_indices(self, grad, handle, indices, **kwargs):
        if self._get_hyper("weight_decay") != 0.0:
            return super()._resource_apply_sparse_duplicate_indices(grad, handle, indices, **kwargs)
        return self._resource_apply_sparse(grad, handle, indices, **kwargs)

    def _resource_apply_sparse(self, grad, var, indices, apply_state=None):
        return self._resource_scatter_add(var, indices, -self._decayed_lr(var.dtype.base_dtype) * grad)

    def get_config(self):
        return {
            **super().get_config(),
            "learning_rate": self._serialize_hyperparameter("learning_rate"),
            "weight_decay": self._serialize_hyperparameter("weight_decay"),
        }
'''


def test_a_sparse_path_that_works_only_eagerly_fails_graph_mode_at_its_line(tmp_path: Path) -> None:
    """fit runs the sparse path under tf.function too: `sparse` steps it eagerly and graph_mode had
    stepped only dense gradients, so every check passed a class whose Embedding jobs all fail."""
    path = tmp_path / "sparse_path_only_eager.py"
    path.write_text(SPARSE_PATH_ONLY_EAGER)
    ctx = _context(f"{path}:LazyDecaySGD", tmp_path)
    assert _run("sparse", ctx).status == "pass"
    outcome = _run("graph_mode", ctx)
    assert outcome.status == "fail", outcome
    assert "but not on row-sparse ones inside tf.function, where fit runs it" in outcome.detail
    assert outcome.where == f"{path}:{_line_of(SPARSE_PATH_ONLY_EAGER, 'LazyDecaySGD', 'if self._get_hyper')}"


RANDOM_BY_DESIGN = '''
import keras
import tensorflow as tf
import tf_keras
from keras import ops


class SGLD(keras.optimizers.Optimizer):
    """Langevin dynamics (Welling & Teh 2011), its noise drawn with tf.random.normal as published
    SGLD code draws it: random by design."""

    def __init__(self, learning_rate=1e-3, temperature=1e-4, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.temperature = temperature

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        noise = tf.random.normal(tf.shape(variable), dtype=variable.dtype)
        step = -lr * tf.convert_to_tensor(gradient)
        self.assign_add(variable, step + tf.sqrt(2.0 * lr * self.temperature) * noise)

    def get_config(self):
        return {**super().get_config(), "temperature": self.temperature}


class LegacySGLD(tf_keras.optimizers.legacy.Optimizer):
    def __init__(self, learning_rate=1e-3, temperature=1e-4, name="LegacySGLD", **kwargs):
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)
        self.temperature = temperature

    def _resource_apply_dense(self, grad, var, apply_state=None):
        lr = self._decayed_lr(var.dtype.base_dtype)
        noise = tf.random.normal(tf.shape(var), dtype=var.dtype.base_dtype)
        return var.assign_sub(lr * grad - tf.sqrt(2.0 * lr * self.temperature) * noise)

    def _resource_apply_sparse(self, grad, var, indices, apply_state=None):
        dense = tf.convert_to_tensor(tf.IndexedSlices(grad, indices, tf.shape(var, out_type=indices.dtype)))
        return self._resource_apply_dense(dense, var, apply_state)

    def get_config(self):
        return {
            **super().get_config(),
            "learning_rate": self._serialize_hyperparameter("learning_rate"),
            "temperature": self.temperature,
        }


class StatelessSGLD(SGLD):
    """Noise a pure function of (variable, step): deterministic, but XLA's generator is not
    TensorFlow's kernel's, so steps with jit_compile=True draw other numbers."""

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        index = tf.cast(self._get_variable_index(variable), tf.int64)
        seed = tf.stack([index, tf.cast(self.iterations, tf.int64)])
        noise = tf.random.stateless_normal(tf.shape(variable), seed=seed, dtype=variable.dtype)
        step = -lr * tf.convert_to_tensor(gradient)
        self.assign_add(variable, step + tf.sqrt(2.0 * lr * self.temperature) * noise)


class CachedRateSGLD(SGLD):
    """Random by design and a true fault: the rate read once, so no schedule reaches it."""

    def __init__(self, learning_rate=1e-3, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.fixed_rate = float(learning_rate)

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient, variable, self.fixed_rate)


class BranchingSGLD(SGLD):
    """Random by design and a true fault: a Python `if` on a tensor, which fails when traced."""

    def update_step(self, gradient, variable, learning_rate):
        if tf.reduce_sum(tf.abs(gradient)) > 0:
            super().update_step(gradient, variable, learning_rate)
'''


@pytest.fixture(scope="module")
def random_by_design(workdir: Path) -> Path:
    path = workdir / "random_by_design.py"
    path.write_text(RANDOM_BY_DESIGN)
    return path


@pytest.mark.parametrize("name", ["SGLD", "LegacySGLD"])
def test_a_class_that_draws_by_design_is_compared_on_the_same_draws_or_left_inconclusive(
    name: str, random_by_design: Path, workdir: Path
) -> None:
    """SGLD's noise had failed five checks, each blaming something else (a cached rate, the sparse
    path, frozen Python state, a hidden attribute): each compared run is seeded alike, and the
    comparison that cannot draw alike (eager against traced) is an inconclusive skip saying why."""
    ctx = _context(f"{random_by_design}:{name}", workdir)
    for check_id in ("schedule", "sparse", "state_roundtrip", "resume_exact"):
        outcome = _run(check_id, ctx)
        assert outcome.status in ("pass", "warn"), (check_id, outcome)
        assert outcome.status == "pass" or "densifies" in outcome.detail, (check_id, outcome)
    graph = _run("graph_mode", ctx)
    assert graph.status == "skip", graph
    assert "the class draws random numbers" in graph.detail, graph.detail


def test_a_class_whose_draws_xla_makes_otherwise_is_inconclusive_under_xla(
    random_by_design: Path, workdir: Path
) -> None:
    """Stateless draws equal under tf.function, not under XLA, whose generator is its own: not a warn
    that the class's math differs."""
    outcome = _run("graph_mode", _context(f"{random_by_design}:StatelessSGLD", workdir))
    assert outcome.status == "skip", outcome
    assert "inconclusive under XLA: the class draws random numbers" in outcome.detail, outcome.detail
    assert "tf.function match the eager ones" in outcome.detail, outcome.detail


def test_a_class_that_draws_by_design_still_fails_its_true_faults(
    random_by_design: Path, workdir: Path
) -> None:
    cached = _run("schedule", _context(f"{random_by_design}:CachedRateSGLD", workdir))
    assert cached.status == "fail", cached
    assert "never cache" in cached.detail, cached.detail
    branching = _run("graph_mode", _context(f"{random_by_design}:BranchingSGLD", workdir))
    assert branching.status == "fail", branching
    assert "not inside tf.function" in branching.detail, branching.detail
    assert branching.where.endswith(f":{_line_of(RANDOM_BY_DESIGN, 'BranchingSGLD', 'if tf.reduce_sum')}")


RATE_KEPT_ELSEWHERE = '''
import keras


class LookaheadWrapper(keras.optimizers.Optimizer):
    """A wrapper in the shape of Keras's LossScaleOptimizer: its rate is its inner optimizer's, which
    its config holds serialized; no top-level key holds the rate."""

    def __init__(self, inner_optimizer="adam", k=5, learning_rate=None, **kwargs):
        inner = keras.optimizers.get(inner_optimizer)
        if learning_rate is not None:
            inner.learning_rate = learning_rate
        super().__init__(learning_rate=0.0, **kwargs)
        self.inner_optimizer = inner
        self.k = k

    def build(self, var_list):
        if self.built:
            return
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self.inner_optimizer.learning_rate = value

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            self.build(trainable_variables)
        self.inner_optimizer.apply(grads, trainable_variables)
        self._iterations.assign_add(1)

    def get_config(self):
        config = super().get_config()
        del config["learning_rate"]
        return {**config, "inner_optimizer": keras.optimizers.serialize(self.inner_optimizer), "k": self.k}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.optimizers.deserialize(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner_optimizer=inner, **config)


class RateLostWrapper(LookaheadWrapper):
    """A true fault: the inner optimizer saved by its name only, so a reload builds it with the
    default rate."""

    def get_config(self):
        return {**super().get_config(), "inner_optimizer": "adam"}


class TorchStyleSGD(keras.optimizers.Optimizer):
    """A port keeping torch's `lr`: Keras's base config stores it as `learning_rate`, which the
    constructor takes back."""

    def __init__(self, lr=0.01, **kwargs):
        super().__init__(learning_rate=kwargs.pop("learning_rate", lr), **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        self.assign_sub(variable, keras.ops.cast(learning_rate, variable.dtype) * gradient)
'''


@pytest.mark.parametrize("name", ["LookaheadWrapper", "TorchStyleSGD"])
def test_a_rate_a_reload_rebuilds_from_elsewhere_in_the_config_passes_config_roundtrip(
    name: str, tmp_path: Path
) -> None:
    """A wrapper's rate in its serialized inner optimizer, a torch port's `lr` under Keras's
    `learning_rate`: from_config(get_config()) gives the rate back, so a reload loses nothing, though
    no top-level key is named as the argument (it had failed "'learning_rate' is not in get_config()")."""
    path = tmp_path / "rate_kept_elsewhere.py"
    path.write_text(RATE_KEPT_ELSEWHERE)
    outcome = _run("config_roundtrip", _context(f"{path}:{name}", tmp_path))
    assert outcome.status == "pass", outcome.detail


def test_a_wrapper_whose_reload_loses_its_rate_still_fails_config_roundtrip(tmp_path: Path) -> None:
    path = tmp_path / "rate_kept_elsewhere.py"
    path.write_text(RATE_KEPT_ELSEWHERE)
    outcome = _run("config_roundtrip", _context(f"{path}:RateLostWrapper", tmp_path))
    assert outcome.status == "fail", outcome
    assert "'learning_rate'" in outcome.detail and "would silently use its default" in outcome.detail, outcome


RELATIVE_STEP = '''
import keras


class RelativeStep(keras.optimizers.Optimizer):
    """As transformers' Adafactor: no manual rate with relative_step=True, its own step size instead."""

    def __init__(self, learning_rate=None, scale=0.01, relative_step=True, **kwargs):
        if learning_rate is not None and relative_step:
            raise ValueError("Cannot combine manual `lr` and `relative_step=True` options")
        super().__init__(learning_rate=1.0 if learning_rate is None else learning_rate, **kwargs)
        self.manual_lr = learning_rate
        self.scale = scale
        self.relative_step = relative_step

    def update_step(self, gradient, variable, learning_rate):
        step = keras.ops.cast(self.iterations + 1, variable.dtype)
        rate = self.scale / keras.ops.sqrt(step) if self.relative_step else learning_rate
        self.assign_sub(variable, keras.ops.cast(rate, variable.dtype) * gradient)

    def get_config(self):
        config = super().get_config()
        config.update({"scale": self.scale, "relative_step": self.relative_step})
        return {**config, "learning_rate": self.manual_lr}


class ForgetfulRelativeStep(RelativeStep):
    def get_config(self):
        config = super().get_config()
        del config["scale"]
        return config
'''


def test_a_class_that_refuses_a_rate_by_design_is_given_none_in_config_roundtrip(tmp_path: Path) -> None:
    """transformers' Adafactor refuses a manual rate with relative_step=True: config_roundtrip had
    built it with a schedule anyway and failed on the refusal; the rest is still checked."""
    path = tmp_path / "relative_step.py"
    path.write_text(RELATIVE_STEP)
    outcome = _run("config_roundtrip", _context(f"{path}:RelativeStep", tmp_path))
    assert outcome.status == "pass", outcome.detail
    assert "the class refuses a learning rate" in outcome.detail, outcome.detail
    forgetful = _run("config_roundtrip", _context(f"{path}:ForgetfulRelativeStep", tmp_path))
    assert forgetful.status == "fail", forgetful
    assert "'scale'" in forgetful.detail, forgetful.detail


UNFINISHED_CONFIG = '''
import tf_keras


class UnfinishedConfig(tf_keras.optimizers.legacy.Optimizer):
    """As TensorFlow Probability's VariationalSGD: a get_config that returns None."""

    def __init__(self, learning_rate=0.01, name="UnfinishedConfig", **kwargs):
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)

    def get_config(self):
        pass

    def _resource_apply_dense(self, grad, var, apply_state=None):
        return var.assign_sub(self._decayed_lr(var.dtype.base_dtype) * grad)
'''


def test_a_get_config_that_returns_none_fails_config_roundtrip_at_its_line(tmp_path: Path) -> None:
    """It had been an inconclusive "optlab's check failed: TypeError ... in plain_config"."""
    path = tmp_path / "unfinished_config.py"
    path.write_text(UNFINISHED_CONFIG)
    outcome = _run("config_roundtrip", _context(f"{path}:UnfinishedConfig", tmp_path))
    assert outcome.status == "fail", outcome
    assert "get_config() returned None, not a dict" in outcome.detail, outcome.detail
    assert "return a dict of every constructor argument" in outcome.detail, outcome.detail
    assert outcome.where == f"{path}:{_line_of(UNFINISHED_CONFIG, 'UnfinishedConfig', 'def get_config')}"


class ScaledLoss(keras.optimizers.LossScaleOptimizer):
    """Keras's LossScaleOptimizer as the README registers a framework class: its required
    `inner_optimizer` takes an optimizer object, which no hyperparameter can give."""


def test_keras_s_loss_scale_optimizer_is_told_that_it_wraps_one_and_how_to_check_it(workdir: Path) -> None:
    """It had been a required hyperparameter "true or false, a number or a string", and given as
    "adam", a construct failing on a learning_rate the checker passed itself."""
    ctx = _context(f"{__name__}:ScaledLoss", workdir)
    assert "inner_optimizer" not in ctx.target.entry.params
    outcome = _run("construct", ctx)
    assert outcome.status == "skip", outcome.detail
    assert "wraps a base optimizer (its 'inner_optimizer' argument)" in outcome.detail, outcome.detail
    assert "check the optimizer it wraps by itself, or a subclass" in outcome.detail, outcome.detail
    with pytest.raises(
        UsageError, match=r"--params: 'inner_optimizer' takes the optimizer 'ScaledLoss' wraps"
    ):
        validated_params(ctx.target, {"inner_optimizer": "adam"})


LOGGING_SWITCH = '''
import tf_keras


class ChattySGD(tf_keras.optimizers.legacy.Optimizer):
    """As adabelief-tf: a switch that only prints, left out of get_config."""

    def __init__(self, learning_rate=0.01, print_change_log=True, name="ChattySGD", **kwargs):
        super().__init__(name, **kwargs)
        if print_change_log:
            print("Note: defaults changed in 0.2")
        self._set_hyper("learning_rate", learning_rate)

    def _resource_apply_dense(self, grad, var, apply_state=None):
        return var.assign_sub(self._decayed_lr(var.dtype.base_dtype) * grad)

    def get_config(self):
        return {**super().get_config(), "learning_rate": self._serialize_hyperparameter("learning_rate")}


class CountingChattySGD(ChattySGD):
    """adabelief-tf's `total_steps=0` too: an unannotated count the class keeps as an integer hyper."""

    def __init__(self, learning_rate=0.01, total_steps=0, print_change_log=True, name="ChattySGD", **kwargs):
        super().__init__(learning_rate, print_change_log, name, **kwargs)
        self._set_hyper("total_steps", int(total_steps))

    def get_config(self):
        return {**super().get_config(), "total_steps": self._serialize_hyperparameter("total_steps")}
'''


def test_a_switch_left_out_of_get_config_that_changes_no_step_is_a_warn(tmp_path: Path) -> None:
    """Not "a reloaded optimizer would silently use its default" as a fail: no update depends on it.
    One that changes the steps (tests/checks/broken/keras_config_roundtrip.py's nesterov) still fails."""
    path = tmp_path / "logging_switch.py"
    path.write_text(LOGGING_SWITCH)
    outcome = _run("config_roundtrip", _context(f"{path}:ChattySGD", tmp_path))
    assert outcome.status == "warn", outcome
    assert "'print_change_log' is not in get_config()" in outcome.detail, outcome.detail
    assert "no update depends on it" in outcome.detail, outcome.detail
    assert outcome.where == f"{path}:{_line_of(LOGGING_SWITCH, 'ChattySGD', 'def get_config')}"
    # An integer count, built changed as an integer: 0.01 had met the class's int32 tensor, and the
    # comparison's own TypeError was reported as the class's fault.
    counting = _run("config_roundtrip", _context(f"{path}:CountingChattySGD", tmp_path))
    assert counting.status == "warn", counting
    assert "'print_change_log' is not in get_config()" in counting.detail, counting.detail


class ForgetsItsTinyEpsilon(keras.optimizers.Optimizer):
    """AdaBelief's epsilon=1e-16, left out of get_config: half of it changes no bit of a step."""

    def __init__(self, learning_rate: float = 1e-3, epsilon: float = 1e-16, **kwargs: object) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)  # type: ignore[arg-type]
        self.epsilon = epsilon

    def build(self, var_list: list[keras.Variable]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._s = self.add_optimizer_variables(var_list, "s")

    def update_step(self, gradient: object, variable: keras.Variable, learning_rate: object) -> None:
        s = self._s[self._get_variable_index(variable)]
        g = keras.ops.cast(gradient, variable.dtype)
        self.assign(s, 0.999 * s + 0.001 * keras.ops.square(g) + self.epsilon)
        rate = keras.ops.cast(learning_rate, variable.dtype)
        self.assign_sub(variable, rate * g / (keras.ops.sqrt(s) + self.epsilon))

    def get_config(self) -> dict[str, object]:
        return super().get_config()  # epsilon forgotten


class ForgetsItsSmallEpsilon(ForgetsItsTinyEpsilon):
    """An epsilon of 9e-4, left out of get_config: built x1e6 capped at 1e-3, it had changed by x1.1 only."""

    def __init__(self, learning_rate: float = 1e-3, epsilon: float = 9e-4, **kwargs: object) -> None:
        super().__init__(learning_rate=learning_rate, epsilon=epsilon, **kwargs)


@pytest.mark.parametrize("class_name", ["ForgetsItsTinyEpsilon", "ForgetsItsSmallEpsilon"])
def test_a_small_epsilon_left_out_of_get_config_fails_config_roundtrip(
    class_name: str, workdir: Path
) -> None:
    """Built with 1e-16 and half of it, three steps were bitwise alike, so the lost epsilon was a
    warn saying no update depends on it; built with a value the step can see, it is the fail it is
    (a switch that only prints stays a warn: the test above)."""
    outcome = _run("config_roundtrip", _context(f"{__name__}:{class_name}", workdir))
    assert outcome.status == "fail", outcome
    assert "'epsilon' is not in get_config()" in outcome.detail, outcome.detail
    assert "no update depends on it" not in outcome.detail, outcome.detail


@pytest.mark.parametrize(
    ("default", "high"),
    [(1e-16, None), (1e-8, None), (5e-4, None), (9e-4, None), (9.99e-4, None), (9e-4, 1e-3), (1e-16, 1e-10)],
)
def test_a_small_number_is_probed_at_least_twice_or_half_its_default(
    default: float, high: float | None
) -> None:
    """config_roundtrip builds a number other than its default to tell a lost value from a kept one:
    capped at 1e-3, a default of 9e-4 had been built as 1e-3 (x1.1), less than the halving it replaced,
    so a lost value there was likelier read as one no step depends on."""
    from jobs.checks.state_checks import _changed
    from optimizers.hyperparams import Param

    param = Param(name="epsilon", type="float", default=default, low=0.0, high=high)
    value = _changed(param, default)
    assert value is not None and param.in_range(value), value
    assert value >= 2 * default or value <= default / 2, value


class OffByOneAdam(keras.optimizers.Adam):
    """Adam's bias correction at step `iterations`, not `iterations + 1`: 1 - beta**0 is 0, and the
    first update divides by it."""

    def update_step(self, gradient: object, variable: keras.Variable, learning_rate: object) -> None:
        m = self._momentums[self._get_variable_index(variable)]
        v = self._velocities[self._get_variable_index(variable)]
        g = tf.convert_to_tensor(gradient)  # an Embedding's IndexedSlices made dense
        step = keras.ops.cast(self.iterations, variable.dtype)
        self.assign(m, 0.9 * m + 0.1 * g)
        self.assign(v, 0.999 * v + 0.001 * keras.ops.square(g))
        corrected = (m / (1 - keras.ops.power(0.9, step))) / keras.ops.sqrt(
            v / (1 - keras.ops.power(0.999, step))
        )
        self.assign_sub(variable, keras.ops.cast(learning_rate, variable.dtype) * corrected)


@pytest.mark.parametrize(
    ("check_id", "blamed"),
    [
        ("graph_mode", "Python state (a counter"),
        ("mixed_precision", "float16 gradients"),
        ("sparse", "handle tf.IndexedSlices"),
    ],
)
def test_a_non_finite_update_is_named_not_a_cause_of_the_check_s_own(
    check_id: str, blamed: str, workdir: Path
) -> None:
    """NaN against NaN had been blamed on a frozen Python counter (graph_mode), on float16 maths
    (mixed_precision) and on the sparse path (sparse); the update is non-finite in plain float32 eager
    steps on dense gradients (dense_step's fail)."""
    outcome = _run(check_id, _context(f"{__name__}:OffByOneAdam", workdir))
    assert outcome.status == "fail", outcome
    assert "the update itself makes non-finite values" in outcome.detail, outcome.detail
    assert "division by a zero state" in outcome.detail, outcome.detail
    assert blamed not in outcome.detail, outcome.detail
    assert outcome.where.endswith(f"test_keras_checks.py:{_line_of_def('OffByOneAdam')}"), outcome.where


def _line_of_def(class_name: str) -> int:
    source = Path(__file__).read_text().splitlines()
    start = source.index(f"class {class_name}(keras.optimizers.Adam):")
    return next(i for i in range(start, len(source)) if "def update_step" in source[i]) + 1


class BestLossSGD(keras.optimizers.Optimizer):
    """SGD that also keeps the lowest loss a callback reported: +inf, by design, until one does."""

    def __init__(self, learning_rate: float = 0.01, **kwargs: object) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)  # type: ignore[arg-type]

    def build(self, var_list: list[keras.Variable]) -> None:
        if self.built:
            return
        super().build(var_list)
        self.best_loss = self.add_variable(
            (), initializer=keras.initializers.Constant(np.inf), name="best_loss"
        )

    def update_step(self, gradient: object, variable: keras.Variable, learning_rate: object) -> None:
        self.assign_sub(variable, keras.ops.cast(learning_rate, variable.dtype) * gradient)


@pytest.mark.parametrize("check_id", ["graph_mode", "sparse", "mixed_precision", "dense_step"])
def test_state_non_finite_from_its_build_on_both_sides_is_no_non_finite_update(
    check_id: str, workdir: Path
) -> None:
    """+inf against +inf in a state that starts at +inf had failed graph_mode as "the update itself
    makes non-finite values": only what was finite before any step (the weights) can say so. And
    dense_step had failed it as "not finite" after one step, though the steps left it as built."""
    outcome = _run(check_id, _context(f"{__name__}:BestLossSGD", workdir))
    assert outcome.status == "pass", outcome


class NanRatioSGD(keras.optimizers.Optimizer):
    """SGD with a diagnostic slot built as zeros and divided by itself each step: NaN from the first
    step, while the weights stay finite."""

    def __init__(self, learning_rate: float = 0.01, **kwargs: object) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)  # type: ignore[arg-type]

    def build(self, var_list: list[keras.Variable]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._ratios = self.add_optimizer_variables(var_list, "ratio")

    def update_step(self, gradient: object, variable: keras.Variable, learning_rate: object) -> None:
        ratio = self._ratios[self._get_variable_index(variable)]
        self.assign(ratio, ratio / ratio)
        self.assign_sub(variable, keras.ops.cast(learning_rate, variable.dtype) * gradient)


def test_state_made_non_finite_by_the_update_is_named_with_finite_weights(workdir: Path) -> None:
    """A slot finite when built and NaN after the steps, eagerly and traced, is the update's doing
    (state is judged where it was finite before any step), not a frozen Python counter; dense_step
    names it too."""
    dense = _run("dense_step", _context(f"{__name__}:NanRatioSGD", workdir))
    assert dense.status == "fail" and "not finite" in dense.detail and "ratio" in dense.detail, dense
    outcome = _run("graph_mode", _context(f"{__name__}:NanRatioSGD", workdir))
    assert outcome.status == "fail", outcome
    assert "the update itself makes non-finite values" in outcome.detail, outcome.detail
    assert "ratio" in outcome.detail and "variable (4, 3)" not in outcome.detail, outcome.detail
    assert "Python state (a counter" not in outcome.detail, outcome.detail


class HalfMomentumSGD(keras.optimizers.Optimizer):
    """Momentum kept in the policy's compute dtype "to halve its memory": float16 under
    mixed_float16, for float32 variables."""

    SLOT_DTYPE: str | None = None  # None: the policy's compute dtype

    def __init__(self, learning_rate: float = 0.01, **kwargs: object) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)  # type: ignore[arg-type]

    def build(self, var_list: list[keras.Variable]) -> None:
        if self.built:
            return
        super().build(var_list)
        dtype = self.SLOT_DTYPE or keras.mixed_precision.global_policy().compute_dtype
        self._bufs = [self.add_variable(shape=v.shape, dtype=dtype, name="momentum") for v in var_list]

    def update_step(self, gradient: object, variable: keras.Variable, learning_rate: object) -> None:
        buf = self._bufs[self._get_variable_index(variable)]
        g = keras.ops.cast(gradient, variable.dtype)
        self.assign(buf, keras.ops.cast(0.9 * keras.ops.cast(buf, variable.dtype) + g, buf.dtype))
        rate = keras.ops.cast(learning_rate, variable.dtype)
        self.assign_sub(variable, rate * keras.ops.cast(buf, variable.dtype))


class BFloat16MomentumSGD(HalfMomentumSGD):
    """Momentum kept in bfloat16 on purpose, to save memory: float32's range, 8 bits of precision."""

    SLOT_DTYPE = "bfloat16"


@pytest.mark.parametrize(
    ("class_name", "said", "not_said"),
    [
        ("HalfMomentumSGD", ["in float16 (4 variables)", "small contributions vanish"], ["bfloat16"]),
        (
            "BFloat16MomentumSGD",
            ["in bfloat16 (4 variables)", "keeps float32's range", "precision, not range"],
            ["vanish", "flushes"],
        ),
    ],
)
def test_16_bit_state_for_float32_variables_under_mixed_float16_is_a_warn_naming_it(
    class_name: str, said: list[str], not_said: list[str], workdir: Path
) -> None:
    """It had passed; Keras's own optimizers keep slots in the variable's dtype (the GOOD list's
    mixed_precision passes: Adam, legacy SGD, both Lions). State kept in bfloat16 had been told its
    small contributions vanish, as float16's do: bfloat16 keeps float32's range and loses precision."""
    outcome = _run("mixed_precision", _context(f"{__name__}:{class_name}", workdir))
    assert outcome.status == "warn", outcome
    assert "keeps 'momentum' in" in outcome.detail, outcome.detail
    for words in said:
        assert words in outcome.detail, (words, outcome.detail)
    for words in not_said:
        assert words not in outcome.detail, (words, outcome.detail)
    assert "add_variable_from_reference" in outcome.detail, outcome.detail
    assert outcome.where.endswith(f"test_keras_checks.py:{_line_of_method('HalfMomentumSGD', 'build')}")


def _line_of_method(class_name: str, method: str) -> int:
    source = Path(__file__).read_text().splitlines()
    start = next(i for i, text in enumerate(source) if text.startswith(f"class {class_name}("))
    return next(i for i in range(start, len(source)) if f"def {method}(" in source[i]) + 1


TRACED_ONLY_ERROR = '''
import keras
import tensorflow as tf


class RelaxedTraceMomentum(keras.optimizers.Optimizer):
    """A helper whose relaxed trace (reduce_retracing) compares unknown dims: an error only when
    traced, which LossScaleOptimizer's tf.cond reports with Keras's "Arguments received by" block."""

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._bufs = self.add_optimizer_variables(var_list, "buf")

    @tf.function(reduce_retracing=True)
    def _normalise(self, g):
        if g.shape[0] > g.shape[1]:
            return tf.transpose(tf.transpose(g) / (tf.norm(g) + 1e-7))
        return g / (tf.norm(g) + 1e-7)

    def update_step(self, gradient, variable, learning_rate):
        buf = self._bufs[self._get_variable_index(variable)]
        self.assign(buf, 0.9 * buf + tf.convert_to_tensor(gradient))
        update = self._normalise(buf) if len(variable.shape) == 2 else buf
        self.assign_sub(variable, tf.cast(learning_rate, variable.dtype) * update)
'''


def test_an_error_raised_when_traced_is_quoted_by_its_own_line_in_mixed_precision(tmp_path: Path) -> None:
    """Not the last line of Keras's "Arguments received by Cond.call()" block ("• kwargs=<class
    'inspect._empty'>"), which had been quoted as the error."""
    path = tmp_path / "traced_only_error.py"
    path.write_text(TRACED_ONLY_ERROR)
    outcome = _run("mixed_precision", _context(f"{path}:RelaxedTraceMomentum", tmp_path))
    assert outcome.status == "fail", outcome
    assert "raised TypeError: '>' not supported between instances of 'NoneType'" in outcome.detail, outcome
    assert "kwargs=" not in outcome.detail and "\x1b" not in outcome.detail, outcome.detail
