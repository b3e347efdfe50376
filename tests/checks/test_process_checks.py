"""The fresh-process checks, `resume_exact` and `distributed`, in all three styles.

Each context starts a Python process that imports torch (~3 s) or TensorFlow (~6 s), so
the targets are few: one correct optimizer per style, the broken ones written for these
checks, and the failure paths (an error, a hang) that must come back readable. The checks
are the same functions for every style.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from jobs.checks.context import CheckContext
from jobs.checks.fresh import distributed, resume_exact, spawner
from jobs.checks.report import Outcome
from jobs.checks.runner import validated_params
from jobs.checks.target import resolve_target
from jobs.checks.tools import draws_randomly, state_shared_by_instances

REPO = Path(__file__).resolve().parents[2]
BROKEN = Path(__file__).parent / "broken"
CheckFunction = Callable[[CheckContext], Outcome]


def context(text: str, style: str, workdir: Path) -> CheckContext:
    target = resolve_target(text, style=style)
    return CheckContext(target=target, params=validated_params(target, {}), workdir=workdir)


CHECKS: dict[str, CheckFunction] = {"resume_exact": resume_exact, "distributed": distributed}


@pytest.mark.parametrize(
    ("text", "style"),
    [
        ("torch.optim:Adam", "torch"),
        ("keras.optimizers:Adam", "keras"),
        ("tf_keras.optimizers.legacy:SGD", "tf_legacy"),
    ],
)
def test_correct_optimizers_pass_both(text: str, style: str, tmp_path: Path) -> None:
    ctx = context(text, style, tmp_path)
    outcomes = {check_id: check(ctx) for check_id, check in CHECKS.items()}
    for check_id, outcome in outcomes.items():
        assert outcome.status == "pass", f"{check_id}: {outcome.detail}"
        assert outcome.figure is not None and outcome.figure < 1e-5
    assert outcomes["resume_exact"].figure == 0.0 and "bitwise equal" in outcomes["resume_exact"].detail


def test_momentum_is_turned_on_where_the_defaults_keep_no_state(tmp_path: Path) -> None:
    outcome = resume_exact(context("torch.optim:SGD", "torch", tmp_path))
    assert outcome.status == "pass"
    assert "momentum=0.9" in outcome.detail


def test_a_relative_plugin_path_resolves_in_the_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    outcome = resume_exact(context("examples/plugins/sign_momentum.py:SignMomentum", "torch", tmp_path))
    assert outcome.status == "pass", outcome.detail


def test_every_run_is_fresh_though_the_child_is_kept(tmp_path: Path) -> None:
    # The gentle first step is remembered in a module global: had the second resumed run
    # shared a process with the first, it would take no gentle step and wrongly pass.
    text = f"{BROKEN / 'torch_resume_exact.py'}:GentleStartSGD"
    children = []
    for attempt in ("first", "second"):
        ctx = context(text, "torch", tmp_path / attempt)
        ctx.workdir.mkdir()
        outcome = resume_exact(ctx)
        assert outcome.status == "fail", f"{attempt}: {outcome.detail}"
        children.append(spawner.child_for(ctx).process.pid)
    assert children[0] == children[1]  # one framework import served both


def test_a_kept_child_runs_with_the_environment_of_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "before").mkdir()
    assert resume_exact(context("torch.optim:SGD", "torch", tmp_path / "before")).status == "pass"
    # Set after the child started: the fresh run must still find the plugin by its name.
    monkeypatch.setenv("OPTLAB_PLUGIN_DIRS", str(REPO / "examples" / "plugins"))
    (tmp_path / "after").mkdir()
    outcome = resume_exact(context("sign_momentum", "torch", tmp_path / "after"))
    assert outcome.status == "pass", outcome.detail


@pytest.mark.parametrize(
    ("file_name", "class_name", "style", "check_id", "names"),
    [
        ("torch_resume_exact.py", "GentleStartSGD", "torch", "resume_exact", "fresh process differ"),
        ("keras_resume_exact.py", "GentleStartSGD", "keras", "resume_exact", "fresh process differ"),
        ("legacy_resume_exact.py", "GentleStartSGD", "tf_legacy", "resume_exact", "fresh process differ"),
        ("torch_distributed.py", "WorkerSumSGD", "torch", "distributed", "beyond rounding"),
        ("keras_distributed.py", "NormalizedSGD", "keras", "distributed", "beyond rounding"),
        ("legacy_distributed.py", "NormalizedSGD", "tf_legacy", "distributed", "beyond rounding"),
    ],
)
def test_broken_optimizers_fail_with_the_problem_named(
    file_name: str, class_name: str, style: str, check_id: str, names: str, tmp_path: Path
) -> None:
    path = BROKEN / file_name
    outcome = CHECKS[check_id](context(f"{path}:{class_name}", style, tmp_path))
    assert outcome.status == "fail"
    assert names in outcome.detail and "Fix:" in outcome.detail
    assert outcome.where.startswith(f"{path}:")
    assert outcome.figure is not None and outcome.figure > 1e-4


def test_a_resumed_run_that_fails_on_a_key_its_save_left_out_is_told_which(tmp_path: Path) -> None:
    path = BROKEN / "torch_state_dict_drops_a_key.py"
    outcome = resume_exact(context(f"{path}:ListedStateSGD", "torch", tmp_path))
    assert outcome.status == "fail"
    assert "KeyError: 'momentum_buffer'" in outcome.detail
    assert "state_dict() leaves out state[param 0]['momentum_buffer']" in outcome.detail
    assert "Fix: save every key of self.state[p] in state_dict()" in outcome.detail


def test_per_parameter_state_in_a_param_group_is_named_briefly_with_its_cause(tmp_path: Path) -> None:
    """grokadamw's GrokAdamW: the message had printed every Parameter's repr as a key (2,612 chars)."""
    outcome = resume_exact(context("tests.checks.group_state:GroupStateSGD", "torch", tmp_path))
    assert outcome.status == "fail"
    assert "optimizer/param_groups/0/state/<Parameter 4 of shape (8, 6)>" in outcome.detail, outcome.detail
    assert "Parameter containing" not in outcome.detail and len(outcome.detail) < 1000, outcome.detail
    assert (
        "param_groups[0]['state'] holds per-parameter state keyed by the parameters themselves"
        in outcome.detail
    )
    assert "Fix: keep per-parameter state in self.state[p]" in outcome.detail


def test_a_private_group_value_a_save_drops_and_a_step_does_without_fails_resume_exact(
    tmp_path: Path,
) -> None:
    """config_roundtrip lets it go as a cache (heavyball drops every `_` key on purpose); the resumed
    run, which steps on without it, still shows the fault."""
    outcome = resume_exact(context("tests.checks.group_state:PrivateDefaultSGD", "torch", tmp_path))
    assert outcome.status == "fail", outcome.detail
    assert "fresh process differ" in outcome.detail


MISBEHAVING_UNDER_DDP = """
import time

import torch
import torch.distributed as dist


class RaisesUnderDdp(torch.optim.SGD):
    def step(self, closure=None):
        if dist.is_initialized():
            raise ValueError("this optimizer cannot run on several ranks")
        return super().step(closure)


class HangsUnderDdp(torch.optim.SGD):
    def step(self, closure=None):
        if dist.is_initialized():
            time.sleep(3600)
        return super().step(closure)
"""


@pytest.fixture
def misbehaving(tmp_path: Path) -> Path:
    path = tmp_path / "misbehaving.py"
    path.write_text(textwrap.dedent(MISBEHAVING_UNDER_DDP))
    return path


def test_an_error_in_a_child_reads_as_one_line_with_the_users_line(misbehaving: Path, tmp_path: Path) -> None:
    outcome = distributed(context(f"{misbehaving}:RaisesUnderDdp", "torch", tmp_path))
    assert outcome.status == "fail"
    assert "ValueError: this optimizer cannot run on several ranks" in outcome.detail
    raise_line = (
        misbehaving.read_text()
        .splitlines()
        .index('            raise ValueError("this optimizer cannot run on several ranks")')
        + 1
    )
    assert outcome.where == f"{misbehaving}:{raise_line}"
    assert "Traceback" not in outcome.detail


def test_a_hung_child_is_stopped_and_reported(
    misbehaving: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spawner, "CHILD_TIMEOUT_S", 12.0)
    outcome = distributed(context(f"{misbehaving}:HangsUnderDdp", "torch", tmp_path))
    assert outcome.status == "fail"
    assert "did not finish within 12 s" in outcome.detail


BACKTRACKING = """
import torch


class BacktrackingSGD(torch.optim.Optimizer):
    '''Gradient descent with an Armijo backtracking line search on the closure's loss.'''

    def __init__(self, params, lr=5.0, shrink=0.5):
        super().__init__(params, dict(lr=lr, shrink=shrink))

    @torch.no_grad()
    def step(self, closure):
        with torch.enable_grad():
            loss = float(closure())
        group = self.param_groups[0]
        params = [p for p in group["params"] if p.grad is not None]
        start = [p.clone() for p in params]
        grads = [p.grad.clone() for p in params]
        slope = sum(float((g * g).sum()) for g in grads)
        rate = group["lr"]
        for _ in range(30):
            for p, p0, g in zip(params, start, grads):
                p.copy_(p0 - rate * g)
            with torch.enable_grad():
                trial = float(closure())
            if trial <= loss - 1e-4 * rate * slope:
                break
            rate *= group["shrink"]
        return loss
"""


def test_a_line_search_whose_ranks_fall_out_of_step_is_judged_with_the_loss_over_ranks(
    tmp_path: Path,
) -> None:
    # Each rank backtracks on its own half-batch loss, so the ranks run different numbers of
    # closures, and so of DDP's all-reduces: the plain DDP run fails (gloo: connection closed by
    # peer). With the ranks' mean loss, as a job's closure returns, they agree with one process.
    path = tmp_path / "backtracking.py"
    path.write_text(BACKTRACKING)
    (tmp_path / "check").mkdir()
    outcome = distributed(context(f"{path}:BacktrackingSGD", "torch", tmp_path / "check"))
    assert outcome.status == "warn", outcome.detail
    assert "the run failed" in outcome.detail and "the class steps by the loss" in outcome.detail


KERAS_OPTIONS = """
import keras


class ClipnormSGD(keras.optimizers.SGD):
    '''SGD with Keras's own per-variable gradient clipping, set by the class.'''

    def __init__(self, learning_rate=0.05, **kwargs):
        kwargs.setdefault("clipnorm", 0.5)
        super().__init__(learning_rate=learning_rate, **kwargs)


class AccumulatingSGD(keras.optimizers.SGD):
    '''SGD that accumulates two batches' gradients through Keras's own option.'''

    def __init__(self, learning_rate=0.05, **kwargs):
        kwargs.setdefault("gradient_accumulation_steps", 2)
        super().__init__(learning_rate=learning_rate, **kwargs)
"""


@pytest.mark.parametrize(
    ("class_name", "option", "seen"),
    [
        ("ClipnormSGD", "clipnorm=0.5", "beyond rounding"),
        ("AccumulatingSGD", "gradient_accumulation_steps=2", ""),
    ],
)
def test_keras_options_that_act_per_replica_are_named_as_the_cause_not_the_update(
    class_name: str, option: str, seen: str, tmp_path: Path
) -> None:
    """Keras's apply() clips and accumulates each replica's own gradient before the replicas' are
    summed: the built-in SGD with these options parts from one device too. With them off, the class
    agrees, so the check warns naming the option rather than failing the update."""
    path = tmp_path / "keras_options.py"
    path.write_text(textwrap.dedent(KERAS_OPTIONS))
    outcome = distributed(context(f"{path}:{class_name}", "keras", tmp_path))
    assert outcome.status == "warn", outcome.detail
    assert f"the class sets {option}" in outcome.detail and seen in outcome.detail
    assert "with it off, MirroredStrategy with 2 replicas equals one device" in outcome.detail


def test_a_failure_names_the_array_its_figure_is_from() -> None:
    """The first difference may be a step counter's; the figure is the largest, and says where."""
    from jobs.checks.fresh.results import Run, first_difference, largest_difference

    straight = Run({"optimizer/step": np.array([6.0]), "model/w": np.zeros(3)}, {"model/w": "parameter w"})
    resumed = Run({"optimizer/step": np.array([4.0]), "model/w": np.full(3, 3.5)}, {"model/w": "parameter w"})
    assert first_difference(straight, resumed) == "optimizer/step: max abs difference 2"
    assert largest_difference(straight, resumed) == ("parameter w", 3.5)
    assert largest_difference(straight, straight) == ("", 0.0)


PYTHON_COUNTER = '''
import tensorflow as tf
import tf_keras


class CountingAdam(tf_keras.optimizers.legacy.Optimizer):
    """Adam whose bias correction counts steps in a Python int, not in `iterations`."""

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, name="CountingAdam", **kwargs):
        super().__init__(name, **kwargs)
        self._set_hyper("learning_rate", learning_rate)
        self._set_hyper("beta_1", beta_1)
        self._set_hyper("beta_2", beta_2)
        self._t = 0

    def _create_slots(self, var_list):
        for var in var_list:
            self.add_slot(var, "m")
            self.add_slot(var, "v")

    def _prepare(self, var_list):
        self._t += 1
        return super()._prepare(var_list)

    def _resource_apply_dense(self, grad, var, apply_state=None):
        dtype = var.dtype.base_dtype
        b1, b2 = self._get_hyper("beta_1", dtype), self._get_hyper("beta_2", dtype)
        t = tf.cast(self._t, dtype)
        m = self.get_slot(var, "m").assign(b1 * self.get_slot(var, "m") + (1 - b1) * grad)
        v = self.get_slot(var, "v").assign(b2 * self.get_slot(var, "v") + (1 - b2) * tf.square(grad))
        step = self._decayed_lr(dtype) * tf.sqrt(1 - tf.pow(b2, t)) / (1 - tf.pow(b1, t))
        return var.assign_sub(step * m / (tf.sqrt(v) + 1e-7)).op

    def get_config(self):
        config = super().get_config()
        for name in ("learning_rate", "beta_1", "beta_2"):
            config[name] = self._serialize_hyperparameter(name)
        return config
'''


def test_a_distributed_failure_names_the_python_counter_every_replica_changes(tmp_path: Path) -> None:
    """The fix had been about gradient statistics; the cause was `self._t += 1` in the update."""
    path = tmp_path / "counting.py"
    path.write_text(PYTHON_COUNTER)
    outcome = distributed(context(f"{path}:CountingAdam", "tf_legacy", tmp_path))
    assert outcome.status == "fail", outcome
    assert "the class keeps self._t, a Python number its step changes" in outcome.detail
    assert "`iterations`" in outcome.detail and "self.add_weight in tf.keras" in outcome.detail


def test_state_shared_by_instances_is_a_fault_not_random_draws(tmp_path: Path) -> None:
    """Runs of such a class differ as a random one's do: `distributed` had warned that it "draws
    random numbers in its steps (by design)", which it never does."""
    for folder in ("torch", "random", "keras"):
        (tmp_path / folder).mkdir()
    shared = context("tests.checks.shared_state:SharedCounterSGD", "torch", tmp_path / "torch")
    assert state_shared_by_instances(shared) == ["shared_state.py.STEPS"]
    assert not draws_randomly(shared)
    randomly = context("tests.checks.global_random_draws:GlobalRandomSGD", "torch", tmp_path / "random")
    assert draws_randomly(randomly) and state_shared_by_instances(randomly) == []
    keras_class = f"{REPO / 'tests' / 'checks' / 'keras_shared_state.py'}:SharedStepMomentum"
    outcome = distributed(context(keras_class, "keras", tmp_path / "keras"))
    assert outcome.status == "fail", outcome.detail
    assert "the class keeps keras_shared_state.py._SHARED['t'] outside its instances" in outcome.detail


OWN_MERGE = """
import keras


class OwnBackendStep(keras.optimizers.Optimizer):
    '''Plain SGD whose `_backend_update_step` steps the variables itself (NoteDance's Lamb does):
    Keras's TensorFlow optimizer merges the replicas' update there, so each replica steps alone.'''

    def __init__(self, learning_rate=0.05, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        for gradient, variable in zip(grads, trainable_variables):
            self.update_step(gradient, variable, learning_rate)

    def update_step(self, gradient, variable, learning_rate):
        self.assign_sub(variable, learning_rate * gradient)
"""


def test_replicas_apart_under_a_class_that_overrides_keras_s_merge_are_told_which_method(
    tmp_path: Path,
) -> None:
    """The fix had said to update only through update_step's variable, which the class does."""
    path = tmp_path / "own_merge.py"
    path.write_text(OWN_MERGE)
    outcome = distributed(context(f"{path}:OwnBackendStep", "keras", tmp_path))
    assert outcome.status == "fail", outcome
    assert (
        "the class overrides _backend_update_step, where Keras merges the replicas' update" in outcome.detail
    )
    line = next(i for i, text in enumerate(OWN_MERGE.splitlines(), 1) if "def _backend_update_step" in text)
    assert outcome.where == f"{path}:{line}"


RAISES_UNDER_A_STRATEGY = """
import keras
from keras import ops


class IntOfIterations(keras.optimizers.Optimizer):
    '''A warm-up chosen by a Python if on int(self.iterations): a MirroredVariable under a strategy.'''

    def __init__(self, learning_rate=0.05, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        scale = 0.5 if int(self.iterations) < 2 else 1.0
        self.assign_sub(variable, ops.cast(learning_rate, variable.dtype) * scale * gradient)


class LazySlot(keras.optimizers.Optimizer):
    '''Momentum whose buffers are made in the first update.'''

    def __init__(self, learning_rate=0.05, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self._bufs = {}

    def update_step(self, gradient, variable, learning_rate):
        key = id(variable)
        if key not in self._bufs:
            self._bufs[key] = self.add_variable_from_reference(variable, "buf")
        buf = self._bufs[key]
        self.assign(buf, 0.9 * buf + gradient)
        self.assign_sub(variable, ops.cast(learning_rate, variable.dtype) * buf)
"""


@pytest.mark.parametrize(
    ("class_name", "says", "fix"),
    [
        ("IntOfIterations", "not 'MirroredVariable'", "read no Python number from a variable in the update"),
        ("LazySlot", "colocate_vars_with", "create every variable in build()"),
    ],
)
def test_a_distributed_run_that_raises_gets_the_fix_for_its_error(
    class_name: str, says: str, fix: str, tmp_path: Path
) -> None:
    """One sentence about variables made lazily had been the fix for every error, int(self.iterations)
    of a MirroredVariable's too."""
    path = tmp_path / "raises_under_a_strategy.py"
    path.write_text(RAISES_UNDER_A_STRATEGY)
    outcome = distributed(context(f"{path}:{class_name}", "keras", tmp_path))
    assert outcome.status == "fail", outcome
    assert says in outcome.detail, outcome.detail
    assert f"Fix: {fix}" in outcome.detail, outcome.detail
    other = {"IntOfIterations": "never lazily", "LazySlot": "read no Python number"}[class_name]
    assert other not in outcome.detail, outcome.detail


OFF_BY_ONE = """
import keras


class OffByOneAdam(keras.optimizers.Adam):
    '''Adam's bias correction at step `iterations`, not `iterations + 1`: the first update divides by 0.'''

    def update_step(self, gradient, variable, learning_rate):
        m = self._momentums[self._get_variable_index(variable)]
        v = self._velocities[self._get_variable_index(variable)]
        step = keras.ops.cast(self.iterations, variable.dtype)
        self.assign(m, 0.9 * m + 0.1 * gradient)
        self.assign(v, 0.999 * v + 0.001 * keras.ops.square(gradient))
        first, second = 1 - keras.ops.power(0.9, step), 1 - keras.ops.power(0.999, step)
        corrected = (m / first) / keras.ops.sqrt(v / second)
        self.assign_sub(variable, keras.ops.cast(learning_rate, variable.dtype) * corrected)
"""


def test_replicas_and_one_device_both_non_finite_are_told_the_update_is(tmp_path: Path) -> None:
    """inf against inf had been "differs from one device ... beyond rounding", told to compute
    gradient statistics after aggregation."""
    path = tmp_path / "off_by_one.py"
    path.write_text(OFF_BY_ONE)
    outcome = distributed(context(f"{path}:OffByOneAdam", "keras", tmp_path))
    assert outcome.status == "fail", outcome
    assert "the update itself makes non-finite values, on one device too" in outcome.detail, outcome.detail
    assert "beyond rounding" not in outcome.detail and "aggregation" not in outcome.detail, outcome.detail
    line = next(i for i, text in enumerate(OFF_BY_ONE.splitlines(), 1) if "def update_step" in text)
    assert outcome.where == f"{path}:{line}"


BEST_LOSS = """
import math

import keras


class BestLossSGD(keras.optimizers.Optimizer):
    '''SGD that also keeps the lowest loss a callback reported: +inf, by design, until one does.'''

    def __init__(self, learning_rate=0.01, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        at_inf = keras.initializers.Constant(math.inf)
        self.best_loss = self.add_variable((), initializer=at_inf, name="best_loss")

    def update_step(self, gradient, variable, learning_rate):
        self.assign_sub(variable, keras.ops.cast(learning_rate, variable.dtype) * gradient)
"""


def test_state_at_inf_from_its_build_on_replicas_and_one_device_passes(tmp_path: Path) -> None:
    """+inf against +inf in a state built at +inf had failed as "the update itself makes non-finite
    values": only the weights, finite before any step, can say so (the test above: they do)."""
    path = tmp_path / "best_loss.py"
    path.write_text(BEST_LOSS)
    outcome = distributed(context(f"{path}:BestLossSGD", "keras", tmp_path))
    assert outcome.status == "pass", outcome
    assert "max abs difference to one device inf" not in outcome.detail, outcome.detail
