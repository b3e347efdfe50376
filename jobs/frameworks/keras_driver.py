"""The TensorFlow drivers: Keras 3 (`keras`) and legacy tf.keras (`tf_keras`) optimizers.

One TensorFlow driver with a subclass per style for the few things the two Keras APIs do
differently (module, state creation, taking and applying gradients, schedule class,
whole-model format). The training step is one `tf.function` (optionally XLA): the gradients, their
global norm and the update in one graph, the loss and the norm left as tensors for the loop
to read in bulk. Checkpoints prove the optimizer survives a save the Keras way:

1. the whole model saved (`.keras`; legacy: h5) and loaded WITHOUT custom objects must
   bring back the same optimizer class, config, iterations and variables (at a process's
   first checkpoint and at the job's last: `KerasSession._whole_model_due` says why that is
   enough);
2. at every checkpoint, `tf.train.Checkpoint(model, optimizer)` written and read into
   objects as a fresh build holds them (optimizer variables created first, so nothing is
   restored lazily out of sight) must compare equal: this is the round-trip of record, and
   training continues from those objects. The first time they are freshly built; after
   that the objects training left at the previous checkpoint are reset to a fresh build's
   values and reused, so the job builds, and traces its step, twice in all;
3. the saved objects and the restored ones then take the same step and must agree bitwise: it
   catches state no checkpoint sees (both copies lack it equally, so 1. and 2. cannot).

Both comparisons include the tf.Variables the optimizer tracks outside optimizer.variables
(`tracked_outside_by_path`): tf.train.Checkpoint saves them, a whole-model save does not.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
import os
import re
import shutil
import sys
import time
import traceback
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from jobs.batches import BatchOrder
from jobs.errors import free_space_note
from jobs.frameworks.base import (
    Advice,
    Capabilities,
    Checkpointed,
    CheckpointMismatch,
    ConfigNotSerialized,
    Driver,
    Evaluation,
    Gradient,
    SparseRows,
    StateDifference,
    StateNotRestored,
    StateNotSaved,
    StepRecord,
    TimeSpent,
    TrainingSession,
    WarningSink,
    known_fix,
    other_spec,
    python_warnings_to,
)
from jobs.frameworks.foreign import ForeignMethod
from jobs.spec import JobSpec
from jobs.workloads import Workload
from optimizers.hyperparams import check_all
from optimizers.loop_needs import PLAIN, LoopNeeds
from optimizers.optional_imports import KERAS_MODULE_OF_STYLE, import_tensorflow
from optimizers.registry import Base, Entry, update_methods
from optimizers.schedules import build_schedule

# In a Keras checkpoint folder: the step, data position and spec a resumed job reads.
RESUME_STATE = "resume.json"
# Where the framework's own optimizer classes live (they take sparse gradients as they come).
FRAMEWORK_MODULES = ("keras.", "tf_keras.", "tensorflow.")
# TensorFlow's random ops that draw from a stream seeded per op (the global seed and a counter),
# whose position lives in the op's kernel: no checkpoint holds it.
OP_SEEDED_RANDOM_OPS = frozenset(
    {
        "RandomStandardNormal",
        "RandomUniform",
        "RandomUniformInt",
        "TruncatedNormal",
        "ParameterizedTruncatedNormal",
        "RandomShuffle",
        "Multinomial",
        "RandomGamma",
        "RandomPoisson",
        "RandomPoissonV2",
    }
)


class GraphModeError(RuntimeError):
    """The optimizer's update works eagerly but not inside tf.function (or not under XLA)."""


# What a job and `optlab check` say of an update that XLA cannot compile (one wording for both).
XLA_ONLY_FAILURE = "works under tf.function but not with jit_compile=True (XLA)"
XLA_FIX = "avoid ops XLA cannot compile in the update (tf.py_function, tf.print, string ops)"
# XLA's words for an op it has no kernel for ("No registered 'EagerPyFunc' OpKernel for XLA_CPU_JIT
# devices"), in an error that then quotes the whole graph's name and where every op was made.
_XLA_UNCOMPILED_OP = re.compile(r"No registered '(\w+)' OpKernel for XLA_\w+ devices")


def xla_cannot_compile(error: BaseException) -> str | None:
    """'XLA cannot compile EagerPyFunc' where `error` is XLA refusing ops, else None."""
    ops = sorted(set(_XLA_UNCOMPILED_OP.findall(str(error))))
    return f"XLA cannot compile {', '.join(ops)}" if ops else None


@dataclass
class KerasObjects:
    model: Any
    optimizer: Any
    # The training step, compiled as one graph: gradients, their global norm and the update;
    # returns the loss and the norm as tensors (read back in bulk through `to_floats`).
    step: Callable[..., Any]
    # The same work as two pieces, traced only when used: the gradients (loss, gradients, norm)
    # compiled alone, and the update eagerly and compiled; they explain a failing first step.
    gradients: Callable[..., Any]
    apply: _Compiled
    # Under a MirroredStrategy: one compiled step over the replicas (loss, gradient norm), else None.
    replicated_step: Callable[..., Any] | None = None
    # This model's and optimizer's tf.train.Checkpoint, made at its first write or read and kept
    # (a new one walks the object graph again: twice the cost of a write).
    saver: Any = None


# Keras 3's base-class options that act on each replica's own gradient under a MirroredStrategy:
# its apply() clips the gradients, or adds them to an accumulator, before `_backend_update_step`
# sums them over the replicas. What each does there, for the warn that names it.
_CLIPS_EACH = "Keras's apply() clips each replica's own gradient before the replicas' gradients are summed"
PER_REPLICA_OPTIONS = {
    "clipnorm": _CLIPS_EACH,
    "clipvalue": _CLIPS_EACH,
    "global_clipnorm": _CLIPS_EACH,
    "gradient_accumulation_steps": "Keras's apply() adds each replica's own gradient, unsummed, to that "
    "replica's copy of the accumulators, so the copies part",
}

# Methods of the optimizer APIs before Keras 3 that Keras 3 never calls (none is in its code): a
# class ported from tf.keras that kept one steps with what it inherits in its place. A class that
# defines any of Keras 3's own update methods (its `apply` too) is written for Keras 3 already.
_LEGACY_API = "a method of tf.keras's legacy optimizer API (Keras 2's OptimizerV2), which Keras 3 never calls"
_TF1_API = (
    "a method of TensorFlow 1's optimizer API (tf.compat.v1.train.Optimizer), which Keras 3 never calls"
)
_KERAS3_UPDATE = (
    "write the update as update_step(self, gradient, variable, learning_rate), with its state made in "
    "build(self, var_list) by self.add_variable_from_reference; or subclass "
    "tf_keras.optimizers.legacy.Optimizer and check it with --style tf_legacy"
)
_KERAS3_GRADIENTS = (
    "change the gradients in an override of apply_gradients(self, grads_and_vars) before passing them "
    "on to super().apply_gradients"
)
_GRADIENTS_UNCHANGED = "the gradients reach the update as they were taken"
_NO_STATE = "the state it would make is never made"
_NOTHING_PREPARED = "what it would prepare for the update is never prepared"
# (The registry counts `_resource_apply_dense` as finishing a Keras class too, so that a tf.keras
# port is catalogued and told here what never runs: it is no method of Keras 3's own.)
_KERAS3_UPDATES = (
    *(m for m in update_methods("keras") if m != "_resource_apply_dense"),
    "_backend_apply_gradients",  # the TensorFlow backend's own steps on the way to update_step
    "_distributed_tf_update_step",
)
# As Keras 2 called get_gradients and get_updates: a method of the name that takes other arguments
# (an accumulator's own `get_gradients()`, a custom loop's `get_gradients(tape, loss)`) is the class's own.
_KERAS2_ARGUMENTS = ("loss", "params")
_KERAS3_APPLIES = ("apply_gradients", "apply", "_backend_apply_gradients", "stateless_apply")
_KERAS3_FOREIGN = {
    "_resource_apply_dense": ForeignMethod(_LEGACY_API, _KERAS3_UPDATES, _KERAS3_UPDATE),
    "_resource_apply_sparse": ForeignMethod(_LEGACY_API, _KERAS3_UPDATES, _KERAS3_UPDATE),
    "_resource_apply_sparse_duplicate_indices": ForeignMethod(_LEGACY_API, _KERAS3_UPDATES, _KERAS3_UPDATE),
    "_apply_dense": ForeignMethod(_TF1_API, _KERAS3_UPDATES, _KERAS3_UPDATE),
    "_apply_sparse": ForeignMethod(_TF1_API, _KERAS3_UPDATES, _KERAS3_UPDATE),
    # Only as Keras 2 called them, (loss, params): a method of the name that takes other arguments
    # (an accumulator's own `get_gradients()`) is the class's own.
    "get_gradients": ForeignMethod(
        _LEGACY_API,
        _KERAS3_APPLIES,
        _KERAS3_GRADIENTS,
        lost=_GRADIENTS_UNCHANGED,
        called_with=_KERAS2_ARGUMENTS,
        changes_gradients=True,
    ),
    "get_updates": ForeignMethod(_LEGACY_API, _KERAS3_UPDATES, _KERAS3_UPDATE, called_with=_KERAS2_ARGUMENTS),
    "_create_slots": ForeignMethod(_LEGACY_API, ("build",), _KERAS3_UPDATE, own_work=False, lost=_NO_STATE),
    "_prepare_local": ForeignMethod(
        _LEGACY_API, ("build", *_KERAS3_UPDATES), _KERAS3_UPDATE, own_work=False, lost=_NOTHING_PREPARED
    ),
}
# The same for a legacy tf.keras class: Keras 3's methods, TensorFlow 1's, and the two that tf.keras
# calls only from get_updates, in TensorFlow 1's graph-mode training (tf_keras's training_v1).
_KERAS3_API = "a method of Keras 3's optimizer API, which tf.keras's legacy optimizers never call"
_OLD_TF1_API = (
    "a method of TensorFlow 1's optimizer API (tf.compat.v1.train.Optimizer), which tf.keras's legacy "
    "optimizers never call"
)
_GRAPH_MODE_ONLY = (
    "a method tf.keras calls only from get_updates, in TensorFlow 1's graph-mode training, never in "
    "TensorFlow 2's fit or minimize"
)
_LEGACY_UPDATE = (
    "write the update as _resource_apply_dense(self, grad, var, apply_state=None) (and "
    "_resource_apply_sparse for sparse gradients), with its slots made in _create_slots; or subclass "
    "keras.optimizers.Optimizer (Keras 3)"
)
_LEGACY_GRADIENTS = (
    "change the gradients in an override of _compute_gradients(self, loss, var_list, grad_loss=None, "
    "tape=None), which TensorFlow 2's minimize calls, or of apply_gradients"
)
_LEGACY_UPDATES = update_methods("tf_legacy")
_LEGACY_FOREIGN = {
    "update_step": ForeignMethod(_KERAS3_API, _LEGACY_UPDATES, _LEGACY_UPDATE),
    "_apply_dense": ForeignMethod(_OLD_TF1_API, _LEGACY_UPDATES, _LEGACY_UPDATE),
    "_apply_sparse": ForeignMethod(
        _OLD_TF1_API, ("_resource_apply_sparse", *_LEGACY_UPDATES), _LEGACY_UPDATE
    ),
    "get_gradients": ForeignMethod(
        _GRAPH_MODE_ONLY,
        ("_compute_gradients", "_get_gradients", "apply_gradients", "_distributed_apply"),
        _LEGACY_GRADIENTS,
        lost=_GRADIENTS_UNCHANGED,
        called_with=_KERAS2_ARGUMENTS,
        changes_gradients=True,
    ),
    "get_updates": ForeignMethod(
        _GRAPH_MODE_ONLY,
        ("_compute_gradients", *_LEGACY_UPDATES),
        _LEGACY_UPDATE,
        called_with=_KERAS2_ARGUMENTS,
    ),
    "build": ForeignMethod(_KERAS3_API, ("_create_slots",), _LEGACY_UPDATE, own_work=False, lost=_NO_STATE),
}


class KerasDriver(Driver):
    """Keras 3 optimizers (`keras.optimizers.Optimizer`) on the TensorFlow backend."""

    style: ClassVar[str] = "keras"
    framework: ClassVar[str] = "tensorflow"
    api_name: ClassVar[str] = "Keras 3"
    foreign_methods: ClassVar[Mapping[str, ForeignMethod]] = _KERAS3_FOREIGN
    capabilities: ClassVar[Capabilities] = Capabilities(
        whole_model_save=True, schedule_objects=True, resume=True, built_apart_from_variables=True
    )
    model_suffix: ClassVar[str] = ".keras"
    # The whole-model formats `save_load_model` proves, and what registers a class by name.
    whole_model_formats: ClassVar[tuple[str, ...]] = (".keras",)
    serializable_decorator: ClassVar[str] = "keras.saving.register_keras_serializable"
    loss_scale_name: ClassVar[str] = "keras.mixed_precision.LossScaleOptimizer"
    per_replica_option_effects: ClassVar[Mapping[str, str]] = PER_REPLICA_OPTIONS
    gradient_clipping: ClassVar[tuple[str, float] | None] = ("clipnorm", 1e-3)
    rate_set_by_hand: ClassVar[str] = (
        "`optimizer.learning_rate = rate`, as the LearningRateScheduler and ReduceLROnPlateau callbacks "
        "set it"
    )
    # What a job's checkpoint failure says to do about state kept outside optimizer.variables.
    state_fix: ClassVar[str] = (
        "create every state variable in build with self.add_variable / self.add_variable_from_reference, "
        "so it is among optimizer.variables, which every save and reload carries"
    )

    def __init__(self) -> None:
        keras_module = KERAS_MODULE_OF_STYLE[self.style]  # keras, or tf_keras for the legacy style
        import_tensorflow(keras_module)  # once, without Keras's optional imports
        self.tf = sys.modules["tensorflow"]
        self.km = sys.modules[keras_module]

    def schedule_class(self) -> Any:
        from optimizers.keras.schedules import OptlabSchedule

        return OptlabSchedule

    def create_state(self, optimizer: Any, variables: Sequence[Any]) -> None:
        """Make every optimizer variable now, eagerly, before any step is compiled."""
        optimizer.build(list(variables))

    def apply(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        """One update, called the way the style's own training loop calls it: Keras 3's `fit` calls
        `apply_gradients(zip(grads, variables))`, so a class that overrides it (gradient
        centralization, as TF ports write it) is stepped through its override; the base class's
        passes the pairs on to `apply`."""
        optimizer.apply_gradients(list(zip(grads, variables, strict=True)))

    def gradients(self, optimizer: Any, tape: Any, loss: Any, variables: Sequence[Any]) -> Any:
        """The gradients of `loss`, taken the way the style's own training loop takes them: Keras
        3's `fit` asks the tape itself, whatever the optimizer."""
        return tape.gradient(loss, variables)

    def unserved_override(self, cls: type) -> str | None:
        """A method the class overrides that the style's `fit` calls and a job cannot: None here
        (Keras 3's `fit` calls only `apply_gradients`, which a job calls too)."""
        return None

    def reloads_no_state(self, saved: Any, reloaded: Any) -> bool:
        """Whether a whole-model format gave the optimizer back with no state at all, as it does
        for every optimizer of the style (then it is the format's loss, not the optimizer's)."""
        return False

    def session(
        self, spec: JobSpec, entry: Entry, workload: Workload, workdir: Path, base: Base | None = None
    ) -> KerasSession:
        if base is not None:
            raise ValueError(
                f"optimizer.base: wrapper optimizers run in torch jobs only; received {base.entry.name!r}"
            )
        unserved = self.unserved_override(entry.cls)
        if unserved:
            raise ValueError(f"optimizer.name: optimizer {entry.name!r}: {unserved}")
        return KerasSession(self, spec, entry, workload)

    def checkpoint_damage(self, path: Path) -> str | None:
        """A checkpoint folder: its step and spec (`resume.json`, written last, so a folder cut short
        has none), and every tensor of its tf.train.Checkpoint read once, which checks each against
        the CRC-32C it was written with."""
        try:
            json.loads((path / RESUME_STATE).read_text())
        except (OSError, ValueError) as exc:
            return f"its {RESUME_STATE} cannot be read, so it is not a finished checkpoint ({exc})"
        try:
            reader = self.tf.train.load_checkpoint(str(path / "ckpt"))
            for name in reader.get_variable_to_shape_map():
                reader.get_tensor(name)
        except (self.tf.errors.OpError, IndexError, ValueError, OSError) as exc:
            said = str(exc).strip().splitlines()
            return f"its tensors do not read back as written ({said[0] if said else type(exc).__name__})"
        return None

    # -- what the conformance checks drive ---------------------------------------------------------------
    # The steps run eagerly unless a check is about compilation, so a graph-only fault fails
    # only `graph_mode`.

    advice: ClassVar[Advice] = Advice(
        update_method="update_step",
        in_place_update="update the variable in place (self.assign / assign_sub); `variable = variable - "
        "lr * g` only rebinds a local name, and every variable with a gradient must be updated",
        skip_none_grad="skip pairs whose gradient is None before using them (as the base class's apply "
        "does), e.g. in an overridden apply",
        finite_state="look for a division by a zero state (add epsilon) or a log/sqrt of a negative value",
        untrainable_state="create state with add_variable / add_optimizer_variables, or pass trainable=False",
        fast_update="keep host round-trips (tf.print, py_function, .numpy()) out of the update, clip by one "
        "global norm, and move per-step work that does not depend on the variable out of the per-variable "
        "loop",
        fewer_passes="fuse the update's element-wise math into fewer ops, or compile it with XLA "
        "(jit_compile=True), and drop passes the method does not need",
        sign_of_update="subtract lr * direction from the variable (self.assign_sub)",
        deprecated_call="tf.cast(x, tf.float32) instead of tf.to_float(x)",
        sparse_update="handle tf.IndexedSlices (gather the touched rows, apply the same math, scatter them "
        "back), or make the gradient dense first (gradient = tf.convert_to_tensor(gradient): correct, though "
        "every step then costs the whole table; keras.ops.convert_to_tensor, with sparse=False too, and "
        "ops.cast keep it sparse), or raise a clear error saying sparse gradients are not supported",
        read_lr_each_step="use the learning_rate argument update_step receives every step; never cache "
        "float(self.learning_rate) in __init__ or build",
        keep_hyperparameters="store each constructor argument as given and return it from get_config "
        "(config.update({...})); from_config must accept exactly that",
        state_on_device="create slots with add_variable_from_reference / add_optimizer_variables, which "
        "place them next to their variable",
        state_on_device_after_restore="create slots with add_variable_from_reference / "
        "add_optimizer_variables in build, so a restore fills variables that already sit next to theirs",
        state_in_checkpoint="keep all state in optimizer variables (self.add_variable / "
        "add_optimizer_variables), created in build",
    )

    # A small MLP: the compiled update has no per-call Python overhead to drown, and a
    # full-matrix preconditioner (n x n per variable, as Shampoo-like updates build) must fit.
    cost_shapes: ClassVar[tuple[tuple[int, ...], ...]] = ((16, 16), (16,), (16, 8), (8,), (8, 1), (1,))

    def random_state(self) -> bytes:
        """Where TensorFlow's eager op-seed stream and Keras 3's global SeedGenerator stand: an eager
        `tf.random.normal` takes its op seed from the first, an unseeded `keras.random.*` draws from
        the second (b"" parts where there is none yet)."""
        context = _tf_context()
        stream = getattr(context, "_rng", None)
        parts = [
            repr(getattr(context, "_seed", None)).encode(),
            repr(stream.getstate()).encode() if stream else b"",
        ]
        draws = _keras_global_draws(self.style)
        if draws is not None and draws[0] is not None:
            parts.append(np.array(draws[0].state.numpy()).tobytes())
        return b"|".join(parts)

    @contextmanager
    def isolated(self, seed: int = 0) -> Iterator[None]:
        """TensorFlow's global seed set to `seed` (which restarts the op seeds eager random ops take,
        and clears the kernels that hold their streams) and, in Keras 3, a fresh global SeedGenerator
        from it, as `keras.utils.set_random_seed` does; the caller's seed given back afterwards. A
        class that draws by design (SGLD's `tf.random.normal` noise) then draws the same numbers in
        two eager runs that make the same random ops in the same order."""
        context = _tf_context()
        seed_before = getattr(context, "_seed", None)
        stream = getattr(context, "_rng", None)
        stream_before = stream.getstate() if stream is not None and seed_before is not None else None
        keras_before = _keras_global_draws(self.style)
        self.tf.random.set_seed(seed)
        if keras_before is not None:
            _set_keras_global_draws(None, seed)
        try:
            yield
        finally:
            self.tf.random.set_seed(seed_before)
            if stream_before is not None:
                context._rng.setstate(stream_before)
            if keras_before is not None:
                _set_keras_global_draws(*keras_before)

    def variables(self, arrays: Sequence[np.ndarray]) -> list[Any]:
        return [self.km.Variable(np.array(a, dtype=np.float32)) for a in arrays]

    def load_values(self, variables: Sequence[Any], arrays: Sequence[np.ndarray]) -> None:
        for variable, array in zip(variables, arrays, strict=True):
            variable.assign(array)

    def optimizer_over(self, create: Callable[[Any], Any], variables: Sequence[Any]) -> Any:
        optimizer = create(None)
        self.create_state(optimizer, variables)
        return optimizer

    def construct(self, cls: type, kwargs: Mapping[str, Any]) -> Any:
        return cls(**kwargs)

    def step(
        self, optimizer: Any, variables: Sequence[Any], grads: Sequence[Gradient], needs: LoopNeeds = PLAIN
    ) -> None:
        # Keras optimizers take no closure and no graph: `needs` changes nothing here. A check's step
        # is one update: `applies_per_update` calls with its gradient.
        tensors = self.gradient_tensors(grads)
        with warnings.catch_warnings():
            if any(g is None for g in grads):  # "gradients do not exist for variables": expected here
                warnings.simplefilter("ignore")
            for _ in range(applies_per_update(optimizer)):
                self.apply(optimizer, tensors, variables)

    def gradient_tensors(self, grads: Sequence[Gradient]) -> list[Any]:
        """The checks' gradients as TensorFlow gives them to an optimizer: a row-sparse one as the
        tf.IndexedSlices an Embedding's gradient is."""
        return [self._gradient(g) for g in grads]

    def _gradient(self, grad: Gradient) -> Any:
        tf = self.tf
        if grad is None:
            return None
        if isinstance(grad, SparseRows):
            return tf.IndexedSlices(
                tf.constant(np.array(grad.values, dtype=np.float32)),
                tf.constant(grad.rows, dtype=tf.int64),
                tf.constant(grad.shape),
            )
        return tf.constant(np.array(grad, dtype=np.float32))

    def values(self, variables: Sequence[Any]) -> list[np.ndarray]:
        return [np.array(v.numpy()) for v in variables]

    def optimizer_state_bytes(self, optimizer: Any) -> int:
        return optimizer_state_bytes(optimizer)

    def state(self, optimizer: Any) -> list[tuple[str, np.ndarray]]:
        return _optimizer_variables(optimizer)

    def state_of(self, optimizer: Any, variables: Sequence[Any], index: int) -> list[np.ndarray]:
        """Slots are matched to their variable by shape: the checks give every variable its own.

        The moving averages `use_ema` keeps are not the class's state: Keras updates every trainable
        variable's average each step, by design, and an unmoving variable's by float rounding."""
        shape = tuple(variables[index].shape)
        averages = {_name(v) for v in getattr(optimizer, "_model_variables_moving_average", None) or ()}
        return [
            value for name, value in self.state(optimizer) if value.shape == shape and name not in averages
        ]

    def trainable_state(self, optimizer: Any, variables: Sequence[Any]) -> tuple[int, list[str], list[str]]:
        state = [*optimizer_variables_of(optimizer), *tracked_outside(self.tf, optimizer, variables)]
        weights = {id(backing(v)) for v in variables}
        offending: list[str] = []
        as_builtins_do: list[str] = []
        for v in state:
            if id(backing(v)) in weights:
                offending.append(f"{_name(v)!r} is one of the trained variables")
            elif bool(getattr(v, "trainable", False)):
                # Keras's own Nadam keeps its scalar `u_product` as a trainable keras.Variable.
                scalar = len(tuple(v.shape)) == 0
                (as_builtins_do if scalar else offending).append(f"{_name(v)!r} is trainable")
        return len(state), offending, as_builtins_do

    def scheduled(
        self, create: Callable[[Any, Any], Any], variables: Sequence[Any], rates: Sequence[float], lr_arg: str
    ) -> tuple[Any, Callable[[int], None]]:
        optimizer = create(None, self._piecewise(rates, calls=1))
        calls = applies_per_update(optimizer)
        if calls > 1:  # Keras asks the schedule at every apply(): a step's rate is the last call's
            optimizer = create(None, self._piecewise(rates, calls))
        self.create_state(optimizer, variables)
        return optimizer, lambda step: None  # the optimizer asks its schedule each step

    def _piecewise(self, rates: Sequence[float], calls: int) -> Any:
        """A schedule of `rates`, one per update of `calls` apply() calls."""
        boundaries = [calls * (number + 1) - 1 for number in range(len(rates) - 1)]
        return self.schedules.PiecewiseConstantDecay(boundaries, list(rates))

    def hand_fed_schedule(
        self, create: Callable[[Any, Any], Any], variables: Sequence[Any], rates: Sequence[float], lr_arg: str
    ) -> tuple[Any, Callable[[int], None]]:
        """A LearningRateSchedule whose rate is set by hand before each step: the rate of a step as
        the class reads its schedule, whatever step number it asks the schedule for."""
        tf = self.tf
        rate = tf.Variable(float(rates[0]), dtype=tf.float32, trainable=False)

        class HandFed(self.schedules.LearningRateSchedule):  # type: ignore[name-defined]
            def __call__(self, step: Any) -> Any:
                return tf.identity(rate)

            def get_config(self) -> dict[str, Any]:
                return {}

        optimizer = create(None, HandFed())
        self.create_state(optimizer, variables)
        return optimizer, lambda step: rate.assign(float(rates[step]))

    def set_learning_rate(self, optimizer: Any, rate: float, lr_arg: str) -> None:
        optimizer.learning_rate = rate

    @property
    def schedule_name(self) -> str:
        return "a LearningRateSchedule"

    @property
    def config_name(self) -> str:
        return "get_config()"

    def config(self, optimizer: Any) -> list[dict[str, Any]]:
        config: Any = None
        try:
            config = optimizer.get_config()
            json.dumps(config, default=_numpy_scalar)
        except Exception as exc:
            key = _unserializable_key(config)
            raise ConfigNotSerialized(
                "get_config() is not JSON-serializable"
                + (f" (its {key!r} holds a {type(config[key]).__name__})" if key else "")
                + f": {type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                fix=self.advice_value_in_config.format(key=key) if key else CONFIG_FIX,
                method="get_config" if key else "__init__",
            ) from exc
        # TensorFlow Probability's VariationalSGD has `def get_config(self): pass`.
        if not isinstance(config, Mapping):
            raise ConfigNotSerialized(
                f"{type(optimizer).__name__}.get_config() returned {config!r}, not a dict: no saved model "
                "can hold the optimizer's hyperparameters, and load_model cannot rebuild it",
                fix="return a dict of every constructor argument (config = super().get_config(); "
                "config.update({...}); return config)",
                method="get_config",
            )
        return [plain_config(optimizer)]

    @property
    def config_roundtrip_name(self) -> str:
        return "from_config()"

    def config_roundtrip(self, optimizer: Any, fresh: Callable[[], Any]) -> list[dict[str, Any]]:
        config = optimizer.get_config()
        cls = type(optimizer)
        try:
            rebuilt = cls.from_config(dict(config))
        except Exception as exc:
            raise ConfigNotSerialized(
                f"{cls.__name__}.from_config(get_config()) raised {type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:300]}",
                fix=config_fix(
                    exc, "get_config must return exactly the constructor's arguments (plus the base class's)"
                ),
            ) from exc
        try:
            self.current_rate(rebuilt)
        except Exception as exc:
            raise ConfigNotSerialized(
                f"{cls.__name__}.from_config(get_config()) built an optimizer whose learning rate cannot be "
                f"read ({type(exc).__name__}: {_head_and_tail(str(exc))}): a load_model of a model compiled "
                "with it fails the same way",
                fix="from_config must turn a serialized schedule (a dict in the config) back into one, as "
                "the base class's from_config does, before calling the constructor",
            ) from exc
        lost = self._schedule_lost(optimizer, rebuilt, config)
        if lost is not None:
            raise lost
        return [plain_config(rebuilt)]

    def _schedule_lost(
        self, optimizer: Any, rebuilt: Any, config: Mapping[str, Any]
    ) -> ConfigNotSerialized | None:
        """Where the optimizer steps with a LearningRateSchedule and the one `from_config` rebuilds
        does not: every reload (load_model, a job's first and last checkpoints) then trains at a
        constant rate, though the config survives the round trip (it holds the same number twice)."""
        if self.rate_is_a_schedule(optimizer) is not True or self.rate_is_a_schedule(rebuilt) is not False:
            return None  # no schedule to lose, or kept where this cannot read it (a wrapper's inner)
        stored = config.get("learning_rate")
        if isinstance(stored, Mapping):  # the schedule was serialized: from_config dropped it
            return ConfigNotSerialized(
                f"{type(optimizer).__name__}.from_config() rebuilds an optimizer with a constant rate from a "
                "config that holds the serialized schedule: a reloaded optimizer never follows its schedule",
                fix="pass the config's learning_rate through keras.optimizers.schedules.deserialize in "
                "from_config, as the base class's from_config does, or leave from_config to the base class",
                method="from_config",
            )
        shown = f" ({stored!r})" if isinstance(stored, int | float) else ""
        return ConfigNotSerialized(
            f"get_config() stores the schedule's current value{shown} instead of the schedule, so an "
            "optimizer from_config() rebuilds (every load_model, a job's reload) trains at a constant rate",
            fix=self.advice_schedule_in_config,
            method="get_config",
        )

    # The fix for a config key that holds a variable or tensor ({key}: its name).
    advice_value_in_config: ClassVar[str] = (
        'store the argument as given in config["{key}"], a plain Python value (a float), not a variable '
        "or tensor made from it"
    )
    advice_schedule_in_config: ClassVar[str] = (
        "store the serialized schedule: keras.optimizers.schedules.serialize(self._learning_rate), what "
        "super().get_config() already does (or self._serialize_hyperparameter(self._learning_rate))"
    )

    def rate_is_a_schedule(self, optimizer: Any) -> bool | None:
        """Whether the optimizer keeps its rate as a LearningRateSchedule (Keras 3's `_learning_rate`);
        None where it keeps none there (a wrapper keeps its inner optimizer's)."""
        rate = getattr(optimizer, "_learning_rate", None)
        return None if rate is None else isinstance(rate, self.schedules.LearningRateSchedule)

    def reload_holds(self, optimizer: Any, name: str, value: Any, *, is_rate: bool) -> bool:
        """Rebuilt as `load_model` rebuilds it (the config through JSON, then `from_config`), the
        optimizer holds `value` for `name`: under that key in its own config, as its attribute of
        that name, or, for the rate, as the rate it steps with. A wrapper keeps its rate in its
        serialized inner optimizer (Keras's LossScaleOptimizer, the Model Garden's Lookahead), a
        torch-style port takes `lr` and hands Keras's `learning_rate` back to its base: both reload
        it, though no top-level key of theirs holds it."""
        try:
            config = json.loads(json.dumps(optimizer.get_config(), default=_numpy_scalar))
            rebuilt = type(optimizer).from_config(config)
        except Exception:  # the round trip's own failure is judged where config_roundtrip makes it
            return False
        readings = [plain_config(rebuilt).get(name), _held_value(rebuilt, name)]
        if is_rate:
            with suppress(Exception):  # a rate that cannot be read is not the value given
                readings += [_held_value(rebuilt, "learning_rate"), float(self.current_rate(rebuilt))]
        return any(reading is not None and self._same_given(reading, value) for reading in readings)

    def _same_given(self, held: Any, given: Any) -> bool:
        """`held` is what `given` built: the same value, or the optimizer a name given for one
        (`inner_optimizer="adam"`) builds. A held optimizer may be kept serialized, as Keras's
        LossScaleOptimizer keeps its inner one: it is the optimizer a reload deserializes it to."""
        if same_config_value(held, given):
            return True
        held = self._as_optimizer(held)
        if not isinstance(given, str) or held is None:
            return False
        try:
            return type(held) is type(self.km.optimizers.get(given))
        except Exception:  # not a name Keras knows
            return False

    def _as_optimizer(self, value: Any) -> Any:
        """`value` as an optimizer: itself where it is one, deserialized where it is an optimizer
        serialized (`{"class_name": ..., "config": ...}`), else None."""
        if hasattr(value, "get_config"):
            return value
        if not (isinstance(value, dict) and {"class_name", "config"} <= value.keys()):
            return None
        try:
            return self.km.optimizers.deserialize(value)
        except Exception:  # not an optimizer Keras can rebuild
            return None

    def current_rate(self, optimizer: Any) -> Any:
        """The rate the optimizer would step with now, read as its update reads it."""
        return optimizer.learning_rate

    def framework_step_count(self, optimizer: Any, updates: int) -> tuple[int, int] | None:
        return int(np.asarray(optimizer.iterations)), updates * applies_per_update(optimizer)

    def learning_rate_schedule(self, lr: float) -> Any:
        return self.schedules.ExponentialDecay(lr, decay_steps=10, decay_rate=0.5)

    @property
    def sparse_gradient_name(self) -> str:
        return "tf.IndexedSlices, what an Embedding produces"

    def refusal_files(self, cls: type) -> set[str]:
        # Only the class's own file: TensorFlow raises from deep inside its ops, never deliberately.
        try:
            return {inspect.getsourcefile(cls) or ""} - {""}
        except TypeError:
            return set()

    def accelerator(self) -> AbstractContextManager[Any] | None:
        if not self.tf.config.list_physical_devices("GPU"):
            return None
        device: AbstractContextManager[Any] = self.tf.device("/GPU:0")
        return device

    @property
    def no_accelerator(self) -> str:
        return "no GPU visible to TensorFlow: optimizer state placement needs one to mean anything"

    def misplaced_state(self, optimizer: Any, variables: Sequence[Any]) -> list[str]:
        """Slots are matched to variables by shape (the checks give every variable its own)."""
        device_of_shape = {tuple(v.shape): variable_device(v) for v in variables}
        misplaced = []
        for slot in optimizer_variables_of(optimizer):
            home = device_of_shape.get(tuple(slot.shape))
            if home is not None and variable_device(slot) != home:
                misplaced.append(f"{_name(slot)} on {variable_device(slot)}, variable on {home}")
        return misplaced

    @property
    def state_format(self) -> str:
        return "tf.train.Checkpoint"

    def save_state(self, optimizer: Any, variables: Sequence[Any], folder: Path) -> Any:
        checkpoint = self.tf.train.Checkpoint(optimizer=optimizer, variables=list(variables))
        try:
            return checkpoint.write(str(folder / "ckpt"))
        except ValueError as exc:  # TensorFlow refusing the object graph: said as a job says it
            said = unsavable_said(self.tf, optimizer, variables, exc)
            raise StateNotSaved(said, fix=self.state_fix) from None

    def restore_state(self, optimizer: Any, variables: Sequence[Any], saved: Any) -> None:
        status = self.tf.train.Checkpoint(optimizer=optimizer, variables=list(variables)).read(saved)
        try:
            status.assert_consumed()
        except AssertionError as exc:
            raise StateNotRestored(
                "tf.train.Checkpoint: saved optimizer values found no variable in a freshly built optimizer "
                f"({str(exc).splitlines()[0][:200]})",
                fix=self.advice.state_in_checkpoint + ", so a fresh optimizer has it before restoring",
            ) from None

    def state_difference(self, saved: Any, restored: Any) -> StateDifference | None:
        before, after = self.state(saved), self.state(restored)
        if len(before) != len(after):
            return StateDifference(f"{len(before)} optimizer variables saved, {len(after)} restored")
        for (name, value), (_, back) in zip(before, after, strict=True):
            if value.shape != back.shape or not np.array_equal(value, back, equal_nan=True):
                return StateDifference(f"optimizer variable {name!r} differs after restoring")
        counted, recounted = iterations(step_counter(saved)), iterations(step_counter(restored))
        if counted != recounted:
            return StateDifference(f"iterations came back as {recounted}, not {counted}")
        return None

    @contextmanager
    def recording_warnings(self, sink: WarningSink) -> Iterator[None]:
        """Python warnings, and TensorFlow's own deprecations (logged once per process through
        the `tensorflow` logger, so its once-only memory is emptied for the duration)."""

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                # TensorFlow starts with "From <its own caller>:<line>:", never the user's line.
                sink(re.sub(r"^From \S+:\d+: ", "", " ".join(record.getMessage().split())), None, None, None)

        from tensorflow.python.util import deprecation

        printed = getattr(deprecation, "_PRINTED_WARNING", None)
        handler = Handler()
        logger = logging.getLogger("tensorflow")
        with python_warnings_to(sink):
            logger.addHandler(handler)
            if isinstance(printed, dict):
                deprecation._PRINTED_WARNING = {}
            try:
                yield
            finally:
                logger.removeHandler(handler)
                if isinstance(printed, dict):
                    deprecation._PRINTED_WARNING = printed

    def reference_sgd(self, variables: Sequence[Any]) -> Any:
        return self.optimizer_over(lambda _: self.plain_reference_sgd(), variables)

    def reference_adamw(self, variables: Sequence[Any]) -> Any:
        return self.optimizer_over(lambda _: self.plain_reference_adamw(), variables)

    def plain_reference_adamw(self) -> Any:
        return self.km.optimizers.AdamW(learning_rate=1e-3)

    @property
    def reference_adamw_name(self) -> str:
        return "AdamW"

    def timed_update(
        self, optimizer: Any, variables: Sequence[Any], grads: Sequence[np.ndarray]
    ) -> Callable[[], Any]:
        tensors = [self._gradient(g) for g in grads]
        update = self.tf.function(lambda gs: self.apply(optimizer, gs, variables))
        graph = update.get_concrete_function(tensors).graph.as_graph_def()
        for _ in range(3):  # warm-up: tracing and first-call costs are not the step's
            update(tensors)
        return _TimedUpdate(lambda: update(tensors), graph)

    def where_time_goes(self, slow: Callable[[], Any], reference: Callable[[], Any]) -> TimeSpent:
        assert isinstance(slow, _TimedUpdate) and isinstance(reference, _TimedUpdate)
        return TimeSpent(_graph_difference(slow.graph, reference.graph))

    @property
    def timed_update_name(self) -> str:
        return "the update under tf.function"

    @property
    def schedules(self) -> Any:
        return self.km.optimizers.schedules

    def plain_reference_sgd(self) -> Any:
        """SGD(momentum=0.9) with no state yet (a model's compile builds it)."""
        return self.km.optimizers.SGD(learning_rate=0.01, momentum=0.9)

    def tiny_model(self, seed: int, hidden: int = 0) -> Any:
        layers = self.km.layers
        body = [layers.Dense(hidden, activation="tanh"), layers.Dense(1)] if hidden else [layers.Dense(3)]
        model = self.km.Sequential([self.km.Input((4,)), *body])
        rng = np.random.RandomState(seed)
        model.set_weights([rng.normal(0.0, 0.5, w.shape).astype(np.float32) for w in model.get_weights()])
        return model

    def loss_scale_optimizer(self, inner: Any, initial_scale: float) -> Any:
        return self.km.optimizers.LossScaleOptimizer(inner, initial_scale=initial_scale)

    def scaled_loss(self, optimizer: Any, loss: Any) -> Any:
        return optimizer.scale_loss(loss)

    def unscaled_gradients(self, optimizer: Any, grads: Any) -> Any:
        return grads  # Keras 3's LossScaleOptimizer.apply unscales them itself

    def loss_scale(self, optimizer: Any) -> float:
        return float(optimizer.dynamic_scale)

    @property
    def reference_sgd_name(self) -> str:
        return "SGD(momentum=0.9)"

    # -- fresh-process checks --
    fresh_module: ClassVar[str] = "jobs.checks.fresh.keras_child"  # both Keras styles


class LegacyKerasDriver(KerasDriver):
    """Legacy tf.keras optimizers (`tf_keras.optimizers.legacy.Optimizer`, Keras 2's OptimizerV2),
    driven through `tf_keras` directly, so both Keras styles can share one process."""

    style: ClassVar[str] = "tf_legacy"
    api_name: ClassVar[str] = "tf.keras"
    foreign_methods: ClassVar[Mapping[str, ForeignMethod]] = _LEGACY_FOREIGN
    # h5 keeps a legacy optimizer's iterations and slots; SavedModel and .keras reload them
    # as zero (the formats' documented behaviour, not the optimizer's).
    model_suffix: ClassVar[str] = ".h5"
    whole_model_formats: ClassVar[tuple[str, ...]] = (".h5", ".keras")
    serializable_decorator: ClassVar[str] = "tf_keras.utils.register_keras_serializable"
    loss_scale_name: ClassVar[str] = "tf_keras.mixed_precision.LossScaleOptimizer"
    # tf.keras's legacy optimizers sum the replicas' gradients before they clip.
    per_replica_option_effects: ClassVar[Mapping[str, str]] = {}
    state_fix: ClassVar[str] = (
        "create every state variable with self.add_slot in _create_slots (or self.add_weight), so it is "
        "among optimizer.variables(), which every save and reload carries"
    )

    def schedule_class(self) -> Any:
        from optimizers.tf_legacy.schedules import OptlabLegacySchedule

        return OptlabLegacySchedule

    def create_state(self, optimizer: Any, variables: Sequence[Any]) -> None:
        optimizer._create_all_weights(list(variables))  # the legacy API's only way to make slots now

    advice_value_in_config: ClassVar[str] = (
        'store the serialized value, not the hyperparameter\'s variable: config["{key}"] = '
        'self._serialize_hyperparameter("{key}"), as the base class stores the learning rate'
    )
    advice_schedule_in_config: ClassVar[str] = (
        "store the serialized schedule: config['learning_rate'] = "
        "self._serialize_hyperparameter('learning_rate'), what the base class's get_config does"
    )

    def rate_is_a_schedule(self, optimizer: Any) -> bool | None:
        hyper = getattr(optimizer, "_hyper", {})
        if "learning_rate" not in hyper:
            return None
        return isinstance(hyper["learning_rate"], self.schedules.LearningRateSchedule)

    def current_rate(self, optimizer: Any) -> Any:
        # `learning_rate` hands back whatever is stored, a schedule's config dict too; the update
        # reads it through `_decayed_lr`, which converts it. A class with no rate has nothing to read.
        if "learning_rate" not in getattr(optimizer, "_hyper", {}):
            return None
        return optimizer._decayed_lr(self.tf.float32)

    def apply(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        optimizer.apply_gradients(list(zip(grads, variables, strict=True)))

    def gradients(self, optimizer: Any, tape: Any, loss: Any, variables: Sequence[Any]) -> Any:
        """tf.keras's `fit` calls `minimize`, which takes the gradients with the optimizer's own
        `_compute_gradients` before `apply_gradients`: a class that overrides it, or the hooks it
        calls, has them taken that way (gradient centralization is written there); any other from
        the tape alone, as that method would take them."""
        if not overrides_any(
            cls=type(optimizer), base=self.km.optimizers.legacy.Optimizer, names=GRADIENT_HOOKS
        ):
            return tape.gradient(loss, variables)
        return [grad for grad, _ in optimizer._compute_gradients(loss, list(variables), tape=tape)]

    def unserved_override(self, cls: type) -> str | None:
        """`minimize` overridden: `fit` calls it, but a job takes the gradients and applies them in
        steps of its own (to read their norm, and to tell a graph-only fault of the update)."""
        if not overrides_any(cls=cls, base=self.km.optimizers.legacy.Optimizer, names=("minimize",)):
            return None
        return (
            f"{cls.__qualname__} overrides minimize(), which tf.keras's fit calls but a job does not: a job "
            "takes the gradients with _compute_gradients and applies them with apply_gradients, the two "
            "halves of the base class's minimize. Move the work into those (gradient changes into "
            "_compute_gradients, update changes into apply_gradients or _resource_apply_dense) and drop "
            "the minimize override"
        )

    advice: ClassVar[Advice] = replace(
        KerasDriver.advice,
        update_method="_resource_apply_dense",
        sparse_update_method="_resource_apply_sparse",
        in_place_update="update the variable in place (var.assign / assign_sub, or the training ops); "
        "`var = var - lr * g` only rebinds a local name, and every variable with a gradient must be updated",
        untrainable_state="create state with add_slot / add_weight, or pass trainable=False",
        sparse_update="implement _resource_apply_sparse (it gets only the touched rows' values and their "
        "indices), or raise a clear error saying sparse gradients are not supported",
        read_lr_each_step="read the rate every step (self._decayed_lr(var_dtype) or apply_state['lr_t']); "
        "never cache float(self.learning_rate) in __init__ or _create_slots",
        state_on_device="create slots with add_slot, which places them next to their variable",
        state_on_device_after_restore="create slots with add_slot in _create_slots, so a restore fills "
        "variables that already sit next to theirs",
        state_in_checkpoint="keep all state in slots (self.add_slot in _create_slots) or add_weight",
        sign_of_update="subtract lr * direction from the variable (var.assign_sub)",
    )

    def variables(self, arrays: Sequence[np.ndarray]) -> list[Any]:
        return [self.tf.Variable(np.array(a, dtype=np.float32)) for a in arrays]

    def plain_reference_sgd(self) -> Any:
        return self.km.optimizers.legacy.SGD(learning_rate=0.01, momentum=0.9)

    def plain_reference_adamw(self) -> Any:
        # tf_keras has no legacy AdamW; legacy Adam keeps the same two slots per variable.
        return self.km.optimizers.legacy.Adam(learning_rate=1e-3)

    @property
    def reference_adamw_name(self) -> str:
        return "legacy Adam"

    def loss_scale_optimizer(self, inner: Any, initial_scale: float) -> Any:
        return self.km.mixed_precision.LossScaleOptimizer(inner, initial_scale=initial_scale)

    def scaled_loss(self, optimizer: Any, loss: Any) -> Any:
        return optimizer.get_scaled_loss(loss)

    def unscaled_gradients(self, optimizer: Any, grads: Any) -> Any:
        return optimizer.get_unscaled_gradients(grads)

    def loss_scale(self, optimizer: Any) -> float:
        return float(optimizer.loss_scale)

    def reloads_no_state(self, saved: Any, reloaded: Any) -> bool:
        """A whole-model format that gave the optimizer back without any state (legacy optimizers
        from .keras or SavedModel, built-ins too): the format's loss, not the optimizer's."""
        return iterations(reloaded.iterations) == 0 < iterations(saved.iterations)


@contextmanager
def moving_average_weights(model: Any, optimizer: Any) -> Iterator[None]:
    """The model's weights replaced by the moving average a Keras 3 optimizer keeps with `use_ema`,
    then given back bitwise: the weights such an optimizer is judged by, as Keras's SwapEMAWeights
    callback evaluates and `fit` leaves the model at its end. Without `use_ema`, nothing changes."""
    uses_ema = getattr(optimizer, "use_ema", False) is True  # tf.keras's legacy optimizers keep none
    averages = getattr(optimizer, "_model_variables_moving_average", None) if uses_ema else None
    if not averages:
        yield
        return
    variables = model.trainable_variables
    trained = [np.array(v.numpy()) for v in variables]
    for variable, average in zip(variables, averages, strict=True):
        variable.assign(average)
    try:
        yield
    finally:
        for variable, value in zip(variables, trained, strict=True):
            variable.assign(value)


# The legacy OptimizerV2 methods `minimize` runs to take the gradients, before `apply_gradients`.
GRADIENT_HOOKS = ("_compute_gradients", "_get_gradients", "_transform_loss")


def overrides_any(*, cls: type, base: type, names: Sequence[str]) -> bool:
    """Whether `cls` defines any of the methods `names` other than `base`'s own."""
    return any(getattr(cls, name, None) is not getattr(base, name, None) for name in names)


def step_counter(optimizer: Any) -> Any:
    """The variable counting the optimizer's updates, one per job step: Keras 3's `_iterations`
    (its `iterations` is that count floor-divided by `gradient_accumulation_steps`, a tensor
    nothing can assign, when a class accumulates), tf.keras's `iterations`."""
    counter = getattr(optimizer, "_iterations", None)
    return optimizer.iterations if counter is None else counter


def applies_per_update(optimizer: Any) -> int:
    """How many apply() calls make one update: Keras's `gradient_accumulation_steps`, set by a class,
    adds the gradients of that many calls and updates with their mean on the last (its schedule,
    though, is asked at every call, as `fit` makes one call a batch); 1 without it."""
    return int(getattr(optimizer, "gradient_accumulation_steps", None) or 1)


def loss_scale_factor(optimizer: Any) -> float | None:
    """Keras 3's `loss_scale_factor`, where the optimizer has one: `fit` multiplies the loss by it
    before taking the gradients (`scale_loss`), and `apply` divides them back, so a loop that skips
    the first half trains with gradients that many times too small. tf.keras's legacy optimizers
    have none (their loss scaling is LossScaleOptimizer's, which jobs do not build)."""
    factor = getattr(optimizer, "loss_scale_factor", None)
    return float(factor) if isinstance(factor, int | float) and factor else None


class KerasSession(TrainingSession):
    def __init__(self, driver: KerasDriver, spec: JobSpec, entry: Entry, workload: Workload) -> None:
        self.driver = driver
        self.tf = tf = driver.tf
        self.km = driver.km
        self.spec = spec
        self.entry = entry
        self.workload = workload
        self.dataset = workload.load_data(spec.workload.params)
        self.regression = workload.task_of(self.dataset) == "regression"
        self.device = self._choose_device(spec.device)
        self.strategy = self._mirrored(spec)  # before anything starts TensorFlow's runtime
        self.lr_multiplier = build_schedule(spec.schedule.name, spec.schedule.params, total_steps=spec.steps)
        # None: the class takes no rate (it fixes its own: A2Grad, COCOB), so no schedule is built for it
        # (a spec gives such a class the constant one: anything else is refused at submission).
        declared = entry.params.get("lr")
        self.base_lr = None if declared is None else float(spec.optimizer.params.get("lr", declared.default))
        self.km.utils.set_random_seed(spec.seed)
        tf.config.experimental.enable_op_determinism()
        self.order = BatchOrder(len(self.dataset.x_train), batch_size=spec.batch_size, seed=spec.seed)
        with tf.device(self.device):
            self.x_train, self.y_train = tf.constant(self.dataset.x_train), tf.constant(self.dataset.y_train)
            self.x_val, self.y_val = tf.constant(self.dataset.x_val), tf.constant(self.dataset.y_val)
        # The objects training left at the last checkpoint: the next one's target, reset first to
        # the values a fresh build holds (`as_built`), so building (and tracing) happens once a job.
        self.spare: KerasObjects | None = None
        self.as_built: list[np.ndarray] | None = None
        self.whole_model_proven = False
        if self.strategy is not None:  # the data on the first device, the result naming them all
            self.device = f"{','.join(self.replica_devices)} (mirrored)"

    def scope(self) -> AbstractContextManager[Any]:
        if self.strategy is not None:
            return self.strategy.scope()  # everything built in it is mirrored
        return self.tf.device(self.device)

    def _mirrored(self, spec: JobSpec) -> Any:
        """A MirroredStrategy over the job's devices (GPUs, else that many logical CPUs), or None."""
        distribution = spec.distribution
        if distribution is None or distribution.strategy != "mirrored":
            return None
        tf, count = self.tf, distribution.devices
        if self.device.startswith("/GPU"):
            first = int(self.device.rpartition(":")[2])
            gpus = len(tf.config.list_physical_devices("GPU"))
            if first + count > gpus:
                raise ValueError(
                    f"distribution.devices: {count} GPUs from {self.device} requested; {gpus} here"
                )
            devices = [f"/GPU:{first + i}" for i in range(count)]
        else:
            if spec.jit_compile and count > 1:
                # XLA places the replicas' step on the first logical CPU and then refuses the others'
                # variables ("Trying to access resource .../replica_1/... located in device CPU:1").
                raise ValueError(
                    f"jit_compile: XLA cannot compile a step mirrored over {count} logical CPUs (TensorFlow "
                    "refuses one replica's variables on another's device); set jit_compile to false, or "
                    "run the job on GPUs (device cuda)"
                )
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
            devices = [f"/CPU:{i}" for i in range(count)]
        self.replica_devices = devices
        return tf.distribute.MirroredStrategy(devices)

    # -- objects ---------------------------------------------------------------------------------------

    def build(self) -> KerasObjects:
        """A fresh model and optimizer as the spec describes them, optimizer variables created."""
        model = self.workload.keras_model(self.spec.workload.params, self.dataset, keras_module=self.km)
        rate = (
            None
            if self.base_lr is None
            else self.driver.schedule_class()(
                self.base_lr, self.spec.schedule.name, self.spec.schedule.params, self.spec.steps
            )
        )
        try:  # a class that checks its rate as a number (`float(learning_rate) <= 0`) fails here
            optimizer = self.entry.create(self.spec.optimizer.params, learning_rate=rate)
            self.driver.create_state(optimizer, model.trainable_variables)
        except Exception as error:
            self._explain_schedule_read(error)
            raise
        model.compile(optimizer=optimizer)  # so a whole-model save carries the optimizer
        replicated = self._replicated_step(model, optimizer) if self.strategy is not None else None
        return KerasObjects(model, optimizer, *self._step_functions(model, optimizer), replicated)

    def _step_functions(
        self, model: Any, optimizer: Any
    ) -> tuple[Callable[..., Any], Callable[..., Any], _Compiled]:
        """The fused training step, and its two halves (tf.function traces each only when called)."""
        tf = self.tf
        variables = model.trainable_variables
        loss_of = self._loss
        driver = self.driver
        scale = loss_scale_factor(optimizer)

        def gradients(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_of(model(x, training=True), y)
                scaled = loss if scale is None else loss * scale  # on the tape, so it has gradients
            grads = driver.gradients(optimizer, tape, scaled, variables)
            norm = tf.linalg.global_norm(grads)
            return loss, grads, norm if scale is None else norm / scale

        as_given = self._gradients_as_given

        def apply(grads: Any) -> None:
            driver.apply(optimizer, as_given(grads), variables)

        def step(x: Any, y: Any) -> tuple[Any, Any]:
            # One graph, so the gradients never cross back through Python to reach the update.
            loss, grads, norm = gradients(x, y)
            apply(grads)
            return loss, norm

        jit = self.spec.jit_compile
        return (
            tf.function(step, jit_compile=jit),
            tf.function(gradients, jit_compile=jit),
            _Compiled(apply, tf.function(apply, jit_compile=jit)),
        )

    def _replicated_step(self, model: Any, optimizer: Any) -> Callable[..., Any]:
        """One step on every replica, compiled: each takes its share of the batch, the optimizer sums
        the replicas' gradients (so each loss is its share's mean over the replica count: the sum
        is the batch's mean), and the norm is that of the summed gradient, as one device sees it."""
        tf, strategy, driver = self.tf, self.strategy, self.driver
        variables = model.trainable_variables
        replicas = strategy.num_replicas_in_sync
        scale = loss_scale_factor(optimizer)

        def replica_step(x: Any, y: Any) -> tuple[Any, Any]:
            with tf.GradientTape() as tape:
                loss = self._loss(model(x, training=True), y) / replicas
                scaled = loss if scale is None else loss * scale
            grads = driver.gradients(optimizer, tape, scaled, variables)
            summed = tf.distribute.get_replica_context().all_reduce("sum", grads)
            driver.apply(optimizer, self._gradients_as_given(grads), variables)
            norm = tf.linalg.global_norm(summed)
            return loss, norm if scale is None else norm / scale

        # XLA compiles each replica's step, as Keras's own fit does: compiled whole, the cross-replica
        # step read one replica's variables from another's device, which XLA refuses.
        compiled = tf.function(replica_step, jit_compile=True) if self.spec.jit_compile else replica_step

        def step(xs: Any, ys: Any) -> tuple[Any, Any]:
            losses, norms = strategy.run(compiled, args=(xs, ys))
            norm = strategy.experimental_local_results(norms)[0]
            return strategy.reduce("sum", losses, axis=None), norm

        return tf.function(step)

    def _gradients_as_given(self, grads: Sequence[Any]) -> list[Any]:
        """What the optimizer is given: an embedding's gradient is a tf.IndexedSlices (its rows and
        their indices), which the framework's own classes take, and so does a class declaring
        `optlab_supports_sparse`; any other gets it dense, as a torch job gives every class (a class
        written for dense gradients failed at the first step: `float * IndexedSlices`)."""
        if self.entry.supports_sparse or self.entry.cls.__module__.startswith(FRAMEWORK_MODULES):
            return list(grads)
        tf = self.tf
        return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]

    def _loss(self, output: Any, y: Any) -> Any:
        tf = self.tf
        if self.workload.task == "objective":
            return tf.reduce_mean(output)  # a test function of the parameters: the output is the loss
        if self.regression:
            return tf.reduce_mean(tf.square(tf.reshape(output, [-1]) - y))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=output))

    # -- training --------------------------------------------------------------------------------------

    def batch(self, step: int) -> tuple[Any, Any]:
        rows = self.tf.constant(self.order.rows(step))
        x, y = self.tf.gather(self.x_train, rows), self.tf.gather(self.y_train, rows)
        if self.strategy is None:
            return x, y
        share = self.spec.batch_size // self.strategy.num_replicas_in_sync

        def part(data: Any) -> Any:
            return self.strategy.experimental_distribute_values_from_function(
                lambda context: data[context.replica_id_in_sync_group * share :][:share]
            )

        return part(x), part(y)

    def train_step(self, objects: KerasObjects, batch: Any, step: int) -> StepRecord:
        """One compiled step; the loss and the gradient norm stay tensors (see `to_floats`).

        The gradients and the update are one graph, so the update's own time cannot be told
        apart: `optimizer_ms` is the whole compiled step's (as under a MirroredStrategy).
        """
        lr = None if self.base_lr is None else self.base_lr * self.lr_multiplier(step)
        compiled = objects.step if objects.replicated_step is None else objects.replicated_step
        started = time.perf_counter()
        try:
            loss, grad_norm = compiled(*batch)
        except Exception as graph_error:
            if step == 0:
                self._explain_schedule_read(graph_error)
            if step == 0 and objects.replicated_step is None:
                self._explain_graph_failure(graph_error, batch)  # where a graph-only fault shows
            raise
        optimizer_ms = (time.perf_counter() - started) * 1000
        return StepRecord(loss=loss, grad_norm=grad_norm, lr=lr, optimizer_ms=optimizer_ms)

    def to_floats(self, values: Sequence[Any]) -> list[float]:
        """Every tensor among `values` read in one transfer per dtype (one stack, one `.numpy()`),
        the rest (host floats) by `float()`."""
        tf = self.tf
        floats = [math.nan] * len(values)
        by_dtype: dict[Any, list[int]] = {}
        for index, value in enumerate(values):
            if tf.is_tensor(value):
                by_dtype.setdefault(value.dtype, []).append(index)
            else:
                floats[index] = float(value)
        for indices in by_dtype.values():
            read = tf.stack([values[index] for index in indices]).numpy()
            for index, value in zip(indices, read.tolist(), strict=True):
                floats[index] = float(value)
        return floats

    def _explain_schedule_read(self, error: Exception) -> None:
        """A class that reads its rate as a number (`_get_hyper("learning_rate")` used as a tensor)
        fails on the schedule object a job always gives it, even for the constant schedule, in words
        that name only that object ("Expected float32, but got <...OptlabLegacySchedule...>")."""
        schedule = self.driver.schedule_class().__name__
        if schedule not in str(error):
            return
        raise TypeError(
            f"optimizer {self.entry.name!r} ({self.entry.style}) reads its learning rate as a number"
            f"{self._user_frame(error)}, but a job always gives it a LearningRateSchedule ({schedule}, "
            f"which follows spec.schedule, the constant one too): {self.driver.advice.read_lr_each_step}. "
            f"TensorFlow said: {type(error).__name__}: {_head_and_tail(' '.join(str(error).split()))}"
        ) from error

    def _explain_graph_failure(self, graph_error: Exception, batch: Any) -> None:
        """Retry the first update eagerly on fresh objects: if that works, the optimizer is
        not graph-compatible, and the error says so and where; else the original error stands
        (also when the gradients alone fail compiled: then it is not the update's fault)."""
        fresh = self.build()
        try:
            _, grads, _ = fresh.gradients(*batch)
            fresh.apply.eager(grads)
        except Exception:
            return
        where = self._user_frame(graph_error)
        if self.spec.jit_compile and self._runs_without_xla(fresh, grads):
            said = (
                xla_cannot_compile(graph_error)
                or f"{type(graph_error).__name__}: {_head_and_tail(str(graph_error))}"
            )
            raise GraphModeError(
                f"the update step of optimizer {self.entry.name!r} ({self.entry.style}) {XLA_ONLY_FAILURE}"
                f"{where}: {said}. {XLA_FIX[0].upper()}{XLA_FIX[1:]}, or set the job's jit_compile to false"
            ) from graph_error
        known = known_fix(graph_error)
        fix = (
            known[0].upper() + known[1:]
            if known
            else "Use tensor ops (tf.where, tf.cond) instead of Python if/while on tensor values, and no "
            ".numpy() or float(tensor) inside update_step"
        )
        raise GraphModeError(
            f"the update step of optimizer {self.entry.name!r} ({self.entry.style}) works eagerly but not "
            f"inside tf.function{where}: {type(graph_error).__name__}: {graph_error}. {fix}"
        ) from graph_error

    def _runs_without_xla(self, objects: KerasObjects, grads: Any) -> bool:
        """Whether the update runs under a plain tf.function: then it is XLA that fails it."""
        try:
            self.tf.function(objects.apply.eager, jit_compile=False)(grads)
        except Exception:
            return False
        return True

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
        with moving_average_weights(objects.model, objects.optimizer):
            output = objects.model(self.x_val, training=False)
        return Evaluation(
            loss=float(self._loss(output, self.y_val)), outputs=np.asarray(output), labels=self.dataset.y_val
        )

    def params_sha256(self, objects: KerasObjects) -> str:
        return weights_sha256(objects.model)

    def parameter_values(self, objects: KerasObjects) -> list[np.ndarray]:
        return [np.asarray(v.numpy()) for v in objects.model.trainable_variables]

    def details(self, objects: KerasObjects) -> dict[str, Any]:
        found = {"style": self.entry.style, "variable_placement": self._placement(objects)}
        if self.strategy is None and self.device.startswith("/GPU:"):  # mirrored: one figure per GPU
            peak = self.tf.config.experimental.get_memory_info(self.device.removeprefix("/"))["peak"]
            found["gpu_memory_peak_mb"] = round(peak / 2**20, 1)
        return found

    def state_bytes(self, objects: KerasObjects) -> tuple[int, int]:
        params = sum(variable_bytes(v) for v in objects.model.trainable_variables)
        return optimizer_state_bytes(objects.optimizer), params

    def adapted_values(self, objects: KerasObjects) -> list[dict[str, float]]:
        """0-d numeric optimizer variables (a `d` estimate), by their short name; Keras has no groups."""
        optimizer = objects.optimizer
        # The step counter, and the rate when a float made it a variable: the loop logs the rate.
        counters = {id(backing(step_counter(optimizer)))}
        rate = getattr(optimizer, "learning_rate", None)  # a legacy class without the hyper has none
        if rate is not None:
            counters.add(id(backing(rate)))
        values = {}
        for variable in optimizer_variables_of(optimizer):
            inner = backing(variable)
            if len(inner.shape) == 0 and not inner.dtype.is_bool and id(inner) not in counters:
                values[_short_name(variable)] = float(inner.numpy())
        return [values]

    # -- checkpoints -----------------------------------------------------------------------------------

    def checkpoint_path(self, folder: Path, step: int) -> Path:
        return folder / f"step-{step:08d}"

    def checkpoint(
        self, objects: KerasObjects, step: int, folder: Path, *, next_step_follows: bool = False
    ) -> Checkpointed:
        """The tf.train.Checkpoint of record, verified into the spare objects; the whole model too
        at this process's first checkpoint and at the job's last (see `_whole_model_due`); then the
        probe step (see `_probe_step`): with `next_step_follows`, the restored objects' probe step
        is the loop's own next step, compared by `Checkpointed.confirm`; after the last step both
        take one here, and the restored objects are read back to the checkpoint."""
        path = self.checkpoint_path(folder, step)
        created = not path.exists()
        path.mkdir(exist_ok=True)
        try:
            return self._checkpoint_into(path, objects, step, next_step_follows)
        except OSError:  # a full disk: the model file written before the refused write kept it full
            if created:
                remove_path(path)
            raise

    def _checkpoint_into(
        self, path: Path, objects: KerasObjects, step: int, next_step_follows: bool
    ) -> Checkpointed:
        warnings: list[str] = []
        if self._whole_model_due(step):
            warnings = self._whole_model_roundtrip(objects, path / f"model{self.driver.model_suffix}")
            self.whole_model_proven = True
        reloaded, written = self._checkpoint_of_record(objects, path / "ckpt")
        self.spare = objects  # verified: the next checkpoint's target (the probe steps it first)
        checkpointed = Checkpointed(reloaded, path, warnings)
        draws = self._unseeded_draws()  # where the loop's next step starts drawing from
        if next_step_follows:

            def confirm(stepped: KerasObjects) -> None:
                batch = self.batch(step)
                with self._drawing_from(draws):  # the numbers the loop's step from `reloaded` drew
                    self.train_step(objects, batch, step)
                self.tell_once(checkpointed, step, self._compare_after_step(objects, stepped, step, batch))

            checkpointed.confirm = confirm
        else:
            self.tell_once(checkpointed, step, self._probe_step(objects, reloaded, written, step, draws))
        # Written last, so a folder without it is a checkpoint that never finished. Batches are a
        # pure function of (seed, step) and the schedule reads `iterations`: the step is the position.
        state = {"step": step, "data_position": step, "spec": self.spec.model_dump_json()}
        self._write_resume_state(path / RESUME_STATE, json.dumps(state))
        return checkpointed

    def _write_resume_state(self, target: Path, text: str) -> None:
        """`resume.json`, whole or not at all: a temp file renamed (a truncated one would name a
        finished checkpoint that cannot be read)."""
        partial = target.with_name(f".{target.name}.partial")

        def write() -> None:
            partial.write_text(text)
            os.replace(partial, target)

        self._written(target, write, lambda: [partial])

    def _written(
        self, target: Path, write: Callable[[], Any], leftovers: Callable[[], Iterable[Path]]
    ) -> Any:
        """What `write()` returns. Where the file system refuses it (an OSError, or TensorFlow's
        OpError: a full disk is its ResourceExhaustedError, naming only SaveV2 and a temp file), the
        files it left (`leftovers`) are removed, so they do not keep a full disk full, and an
        OSError names `target` and says where the disk is full, as a torch checkpoint's does."""
        try:
            return write()
        except (OSError, self.tf.errors.OpError) as exc:
            for leftover in leftovers():
                remove_path(leftover)
            said = _head_and_tail(f"{type(exc).__name__}: {exc}")
            raise OSError(
                f"could not write the checkpoint {target}: {said}{free_space_note(target.parent)}"
            ) from exc

    def resume(self, path: Path) -> tuple[KerasObjects, int]:
        """Fresh objects with the tf.train.Checkpoint of record read into them, and its step."""
        state = json.loads((path / RESUME_STATE).read_text())
        saved_spec = JobSpec.model_validate_json(state["spec"])
        if saved_spec != self.spec:
            raise ValueError(other_spec(path, saved_spec, self.spec))
        fresh = self.build()
        self._saver(fresh).read(str(path / "ckpt")).assert_consumed()
        step = int(state["step"])
        restored = iterations(step_counter(fresh.optimizer))
        if restored != step:
            raise ValueError(
                f"checkpoint {path}: the optimizer restored {restored} updates, not its step {step}"
            )
        return fresh, step

    def _whole_model_due(self, step: int) -> bool:
        """Whether this checkpoint saves and reloads the whole model (`.keras`; legacy: h5).

        Once a process, at its first checkpoint, and at the job's last, not at every one: what the
        round trip proves is fixed once the first step has run. The class is registered by name
        or not; get_config() returns the constructor's arguments (the config is also compared
        with the restored twin's at every checkpoint of record); the format saves every
        optimizer variable and loads each back by position, whatever its value, and their number
        cannot change after the compiled step's first trace (tf.function creates variables only
        then). What a later round trip could add: a variable the format loses that still holds
        its freshly built value at the first checkpoint; the last one sees it once it has moved.
        The last checkpoint is also the model a user takes away, proven as it is.
        """
        return not self.whole_model_proven or step >= self.spec.steps

    def _save_whole_model(self, objects: KerasObjects, path: Path) -> None:
        """`model.save` into a temp file renamed to `path` (its suffix kept: Keras reads the format
        from it), so no truncated model is left behind; a config the format cannot hold is told by
        its key (tf.keras's h5 names only the value: "Unable to serialize 0.9 to JSON")."""
        partial = path.with_name(f"partial-{path.name}")

        def write() -> None:
            objects.model.save(partial)
            os.replace(partial, path)

        try:
            self._written(path, write, lambda: [partial])
        except OSError:
            raise
        except Exception as exc:
            remove_path(partial)
            unsaved = config_not_json(objects.optimizer)
            if unsaved is None:
                raise
            raise CheckpointMismatch(f"{path.name}: {unsaved}; {CONFIG_FIX}") from exc

    def _whole_model_roundtrip(self, objects: KerasObjects, path: Path) -> list[str]:
        self._save_whole_model(objects, path)
        expected = type(objects.optimizer)
        register = (
            f"register the class with @{self.driver.serializable_decorator}(package=...) so a saved model "
            "reloads it by name"
        )
        try:
            loaded = self.km.models.load_model(path)  # no custom_objects: registered classes by name
        except Exception as exc:
            message = " ".join(str(exc).split())
            if names_an_unknown_class(message):
                raise CheckpointMismatch(
                    f"{path.name}: load_model could not find the optimizer class {expected.__name__} by name "
                    f"({message.split('. ')[0][:200]}); {register}"
                ) from None
            unsaved = config_not_json(objects.optimizer)  # Keras 3 saves a tensor, then cannot load it
            if unsaved is not None:
                raise CheckpointMismatch(f"{path.name}: {unsaved}; {CONFIG_FIX}") from exc
            raise CheckpointMismatch(
                f"{path.name}: load_model of the saved model raised {type(exc).__name__}: "
                f"{_head_and_tail(message)}; "
                f"{expected.__name__}.from_config(get_config()) must rebuild the optimizer (a schedule comes "
                "back serialized, as a dict, for from_config to turn into one)"
            ) from exc
        optimizer = loaded.optimizer
        if type(optimizer) is not expected:
            raise CheckpointMismatch(
                f"{path.name}: the optimizer came back as {type(optimizer).__name__}, not "
                f"{expected.__name__}; {register}"
            )
        self._check_config_has_hyperparameters(objects.optimizer, optimizer, path.name)
        if self.driver.reloads_no_state(objects.optimizer, optimizer):
            # The tf.train.Checkpoint round-trip stays the one of record: warn, do not fail.
            return [
                f"{path.name}: the whole-model format reloaded the optimizer without its state "
                f"(iterations 0, not {iterations(objects.optimizer.iterations)}); resume from the "
                "tf.train.Checkpoint instead"
            ]
        compare_optimizers(objects.optimizer, optimizer, path.name)
        self._compare_tracked_outside(
            objects.model,
            loaded,
            f"{path.name}: the whole-model format saves only the optimizer's variables, so",
        )
        return []

    def _check_config_has_hyperparameters(self, trained: Any, optimizer: Any, where: str) -> None:
        """Every hyperparameter this job set must come back from the saved config (`optimizer`, the
        reloaded one) as the job set it, or, for a falsy value the class replaced by its default
        (`epsilon or backend.epsilon()` makes 0 1e-7, as tf.keras's own Adam does), as the `trained`
        optimizer holds it: the class's choice, not a fault of the save. A get_config() that returns a
        stored default while the class holds the value it was given, or a class that ignores a value
        it was given, still fails.

        Comparing the saved and the reloaded config cannot see one missing from both, yet
        the reloaded optimizer would silently run with its default. One the job left at its default
        runs with that default after a reload too: nothing is lost in this job (`optlab check`'s
        config_roundtrip names such a class's incomplete get_config()).
        """
        config, reported = plain_config(optimizer), plain_config(trained)
        checked = check_all(
            self.spec.optimizer.params, self.entry.params, owner=f"optimizer {self.entry.name!r}"
        )
        given = {name: value for name, value in checked.items() if name in self.spec.optimizer.params}
        for name, value in given.items():
            if name == "lr":
                continue  # carried by the learning-rate schedule, compared with the config
            if name not in config:
                raise CheckpointMismatch(
                    f"{where}: hyperparameter {name!r} is missing from "
                    f"{type(optimizer).__name__}.get_config(); a reloaded optimizer would silently use "
                    "its default. Return every constructor argument"
                )
            back = config[name]
            if same_config_value(back, value):
                continue
            # A falsy input the class replaced by its default (`epsilon or backend.epsilon()`), held,
            # reported and got back alike; any other input must come back as given (a class that
            # ignores it trains with another value than the job asked for).
            held = _held_value(trained, name)
            replaced = not value and held is not None
            if replaced and same_config_value(back, held) and same_config_value(reported.get(name), held):
                continue
            gives = (
                f" (the trained optimizer's get_config() gives {reported[name]!r})"
                if name in reported and not same_config_value(reported[name], value)
                else ""
            )
            raise CheckpointMismatch(
                f"{where}: hyperparameter {name!r} was {value!r}{gives} but came back as {back!r}"
            )

    def _checkpoint_of_record(self, objects: KerasObjects, prefix: Path) -> tuple[KerasObjects, str]:
        """The restored objects training continues from, and the checkpoint's path as written."""
        try:
            written = self._written(
                prefix,
                lambda: self._saver(objects).write(str(prefix)),
                # What a failed write leaves: the prefix's index and data files, SaveV2's temp folder.
                lambda: sorted(prefix.parent.glob(f"{prefix.name}*")),
            )
        except ValueError as exc:  # TensorFlow refusing the object graph, e.g. a dict with an int key
            raise self._unsavable(objects.model, exc) from None
        target = self._as_if_fresh(objects)
        status = self._saver(target).read(written)
        try:
            status.assert_consumed()
        except AssertionError as exc:
            raise CheckpointMismatch(
                f"tf.train.Checkpoint: some saved values found no variable in freshly built objects: {exc}"
            ) from None
        for index, (saved, loaded) in enumerate(
            zip(objects.model.get_weights(), target.model.get_weights(), strict=True)
        ):
            if not np.array_equal(saved, loaded):
                raise CheckpointMismatch(f"tf.train.Checkpoint: model weight {index} differs after restore")
        compare_optimizers(objects.optimizer, target.optimizer, "tf.train.Checkpoint")
        self._compare_tracked_outside(
            objects.model, target.model, "tf.train.Checkpoint: the restore did not write"
        )
        return target, written

    def _compare_tracked_outside(self, saved: Any, loaded: Any, cause: str) -> None:
        """The tf.Variables the optimizer tracks outside optimizer.variables (`tracked_outside`),
        matched by their place in the checkpoint's object graph, must come back equal: the
        comparison of optimizer.variables cannot see them. `saved`, `loaded`: compiled models."""
        before = self._tracked_outside(saved)
        after = dict(self._tracked_outside(loaded))
        lost: list[str] = []
        largest = 0.0
        for path, variable in before:
            value = np.asarray(variable.numpy())
            back = after.get(path)
            restored = None if back is None else np.asarray(back.numpy())
            if restored is None or restored.shape != value.shape:
                lost.append(path)
                largest = math.inf
            elif not np.array_equal(value, restored, equal_nan=True):
                lost.append(path)
                largest = max(largest, float(np.max(np.abs(value.astype(np.float64) - restored))))
        if lost:
            raise CheckpointMismatch(
                f"{cause} {len(lost)} tf.Variable(s) the optimizer tracks outside optimizer.variables "
                f"(optimizer/{', optimizer/'.join(lost[:4])}{', ...' if len(lost) > 4 else ''}): they came "
                f"back different (max abs difference {largest:.3g}); {self.driver.state_fix}"
            )

    def _tracked_outside(self, model: Any) -> list[tuple[str, Any]]:
        """`tracked_outside_by_path` of a compiled model's optimizer."""
        try:
            return tracked_outside_by_path(self.tf, model.optimizer, model.trainable_variables)
        except ValueError as exc:  # as tf.train.Checkpoint refuses to save it
            raise self._unsavable(model, exc) from None

    def _unsavable(self, model: Any, refusal: ValueError) -> CheckpointMismatch:
        """tf.train.Checkpoint refusing the optimizer's object graph, said without the object's values."""
        said = unsavable_said(self.tf, model.optimizer, model.trainable_variables, refusal)
        return CheckpointMismatch(f"{said}; {self.driver.state_fix}")

    def _probe_step(
        self, saved: KerasObjects, restored: KerasObjects, written: str, step: int, draws: Any
    ) -> str | None:
        """After the last step: the saved and the restored objects take the same step, drawing the
        same numbers (`draws`), which must agree, and the restored ones are read back to the
        checkpoint (training ends with them).

        The step is taken where the schedule's rate is highest (`step_counter` set there in both), so
        the rate of a schedule that ends at 0 cannot hide a difference."""
        probe = max(range(self.spec.steps), key=self.lr_multiplier)
        batch = self.batch(probe)
        for objects in (saved, restored):
            step_counter(objects.optimizer).assign(probe)
            with self._drawing_from(draws):
                self.train_step(objects, batch, probe)
        untold = self._compare_after_step(saved, restored, step, batch)
        self._saver(restored).read(written).assert_consumed()
        return untold

    def _unseeded_draws(self) -> tuple[Any, Any] | None:
        """Keras 3's global SeedGenerator and where it stands: what `keras.random.*` without a seed
        draws from, a variable no checkpoint holds. None where there is none (it is made at the first
        unseeded draw; legacy tf.keras draws from TensorFlow's op-seeded streams instead)."""
        if self.entry.style != "keras":
            return None
        try:  # Keras's own module, not its public API: a Keras without it draws as before
            from keras.src.backend.common import global_state
            from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR
        except ImportError:
            return None
        generator = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
        return None if generator is None else (generator, np.array(generator.state.numpy()))

    @contextmanager
    def _drawing_from(self, draws: tuple[Any, Any] | None) -> Iterator[None]:
        """A probe step drawing the numbers the loop's step drew (`draws`, taken where it started),
        the stream put back after it: the probe leaves training's draws as they were, as torch's
        take_probe_step does with its random state."""
        if draws is None:
            yield
            return
        generator, start = draws
        now = np.array(generator.state.numpy())
        generator.state.assign(start)
        try:
            yield
        finally:
            generator.state.assign(now)

    def _compare_after_step(
        self, saved: KerasObjects, restored: KerasObjects, step: int, batch: Any
    ) -> str | None:
        """The saved objects and the restored ones after the same step (on `batch`): bitwise equal
        weights and optimizer variables, or the optimizer keeps state tf.train.Checkpoint neither
        saves nor restores (both copies lack it equally, so comparing what it saved cannot see it).

        Unless the step draws from TensorFlow's op-seeded random streams, whose position no
        checkpoint holds: then no two runs of it agree, lost state or not, and what is returned says
        the comparison proves nothing (as `optlab check` calls such draws by design a warning)."""
        pairs = [
            *(
                (f"model weight {index}", before, after)
                for index, (before, after) in enumerate(
                    zip(saved.model.get_weights(), restored.model.get_weights(), strict=True)
                )
            ),
            *(
                (f"optimizer variable {name!r}", before, after)
                for (name, before), (_, after) in zip(
                    _optimizer_variables(saved.optimizer),
                    _optimizer_variables(restored.optimizer),
                    strict=True,
                )
            ),
        ]
        for what, before, after in pairs:
            if before.shape == after.shape and np.array_equal(before, after, equal_nan=True):
                continue
            diff = (
                float(np.max(np.abs(before.astype(np.float64) - after)))
                if before.shape == after.shape
                else math.inf
            )
            draws = self._unsaved_random_ops(restored, batch)
            if draws:
                return (
                    f"the step after the checkpoint could not be compared: it draws random "
                    f"numbers ({', '.join(draws)}) from TensorFlow's op-seeded streams, whose position no "
                    f"checkpoint holds, so the saved and the restored objects' steps differ ({what}, max abs "
                    f"difference {diff:.3g}) as any two runs of it do; the saved and restored variables "
                    "compared equal, and a resumed job will not repeat the uninterrupted one's draws"
                )
            holders = attributes_holding_variables(saved.optimizer, saved.model.trainable_variables)
            named = f": {', '.join(holders)} hold tf.Variables outside optimizer.variables" if holders else ""
            raise CheckpointMismatch(
                f"tf.train.Checkpoint: the step after the checkpoint at step {step} differs between the "
                f"saved objects and the restored ones ({what}, max abs difference {diff:.3g}): the optimizer "
                "keeps state the checkpoint neither saves nor restores, so every reload resets it (in "
                f"attributes a checkpoint does not track{named}); {self.driver.state_fix}"
            )
        return None

    def _unsaved_random_ops(self, objects: KerasObjects, batch: Any) -> list[str]:
        """The random ops of the compiled step (functions it calls included) that draw from an
        op-seeded stream (tf.random.normal and the like); not the stateless ones a seed variable
        drives (keras.random with a SeedGenerator), whose seed a checkpoint holds."""
        compiled: Any = objects.step if objects.replicated_step is None else objects.replicated_step
        graph = compiled.get_concrete_function(*batch).graph  # the trace the step runs: no retrace
        ops = {op.type for op in graph.get_operations()}
        for function in graph.as_graph_def().library.function:
            ops.update(node.op for node in function.node_def)
        return sorted(ops & OP_SEEDED_RANDOM_OPS)

    def _as_if_fresh(self, saved: KerasObjects) -> KerasObjects:
        """Objects to restore into, holding what freshly built ones hold: the first time a fresh
        build (its values kept), then the spare with every variable reset to those values (never
        the saved objects themselves: comparing them with themselves would prove nothing).

        A reset spare is a fresh build in all that the comparison reads (every model and
        optimizer variable, and those tracked outside them), its compiled step already traced;
        its variable structure is a fresh build's too, since tf.function creates variables only at
        the first trace and the first checkpoint's fresh target would have failed on one made there.
        """
        spare, self.spare = self.spare, None
        if spare is not None and spare is not saved and self.as_built is not None:
            variables = self._resettable(spare)
            if len(variables) == len(self.as_built):
                for variable, value in zip(variables, self.as_built, strict=True):
                    variable.assign(value)
                return spare
        fresh = self.build()
        self.as_built = [np.array(v.numpy()) for v in self._resettable(fresh)]
        return fresh

    def _resettable(self, objects: KerasObjects) -> list[Any]:
        """What a reset spare takes a fresh build's values for: every model and optimizer variable,
        and those the optimizer tracks outside optimizer.variables (so one the restore does not
        write shows as in fresh objects)."""
        return [*every_variable(objects), *(variable for _, variable in self._tracked_outside(objects.model))]

    def _saver(self, objects: KerasObjects) -> Any:
        if objects.saver is None:
            objects.saver = self.tf.train.Checkpoint(model=objects.model, optimizer=objects.optimizer)
        return objects.saver

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


def _tf_context() -> Any:
    """TensorFlow's eager context: it holds the global seed and the stream eager op seeds come from
    (no public API reads where that stream stands)."""
    from tensorflow.python.eager import context

    return context.context()


def _keras_global_draws(style: str) -> tuple[Any, Any] | None:
    """Keras 3's global SeedGenerator (None until an unseeded `keras.random.*` draw makes one) and the
    seed `keras.utils.set_random_seed` recorded; None for legacy tf.keras, which has neither."""
    if style != "keras":
        return None
    try:  # Keras's own modules, not its public API: a Keras without them is left alone
        from keras.src.backend.common import global_state
        from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR
        from keras.src.utils.rng_utils import GLOBAL_RANDOM_SEED
    except ImportError:
        return None
    return (
        global_state.get_global_attribute(GLOBAL_SEED_GENERATOR),
        global_state.get_global_attribute(GLOBAL_RANDOM_SEED),
    )


def _set_keras_global_draws(generator: Any, seed: Any) -> None:
    """Keras 3's global SeedGenerator and recorded seed set (a None generator is made afresh from the
    seed at the next unseeded draw, as after `keras.utils.set_random_seed`)."""
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR
    from keras.src.utils.rng_utils import GLOBAL_RANDOM_SEED

    global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, generator)
    global_state.set_global_attribute(GLOBAL_RANDOM_SEED, seed)


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


class _TimedUpdate:
    """A compiled update ready to time, and the graph it runs (to say where its time goes)."""

    def __init__(self, run: Callable[[], Any], graph: Any) -> None:
        self.run = run
        self.graph = graph

    def __call__(self) -> Any:
        return self.run()


LINALG_OPS = ("SelfAdjointEig", "Svd", "Qr", "Cholesky", "Matrix", "BatchMatMul", "MatMul", "Einsum", "Lu")
HOST_SYNC_OPS = {"PrintV2", "Print", "PyFunc", "PyFuncStateless", "EagerPyFunc"}


def _graph_ops(graph_def: Any) -> list[tuple[str, str]]:
    nodes = [(n.op, n.name) for n in graph_def.node]
    for function in graph_def.library.function:
        nodes.extend((n.op, n.name) for n in function.node_def)
    return nodes


def _graph_difference(user_graph: Any, reference_graph: Any) -> str:
    user_ops, reference_ops = _graph_ops(user_graph), _graph_ops(reference_graph)
    syncs = sorted({op for op, _ in user_ops if op in HOST_SYNC_OPS})
    if syncs:
        count = sum(op in HOST_SYNC_OPS for op, _ in user_ops)
        return (
            f"the traced update has {count} host round-trip ops ({', '.join(syncs)}: tf.print / py_function)"
        )
    norms = {
        name.rsplit("/", 1)[0] for _, name in user_ops if "clip_by_norm" in name or "norm" in name.lower()
    }
    if len(norms) > 1:
        return (
            f"the traced update computes {len(norms)} separate norms (per-variable clipping or normalisation)"
        )
    known = {op for op, _ in reference_ops} | {"Const", "Identity", "NoOp", "ReadVariableOp"}
    extra = Counter(op for op, _ in user_ops if op not in known)
    # Linear algebra first: a few of those cost more than all the elementwise ops together.
    ranked = sorted(extra.items(), key=lambda item: (not item[0].startswith(LINALG_OPS), -item[1]))
    listed = ", ".join(f"{op} x{count}" for op, count in ranked[:4])
    return f"the traced update has {len(user_ops)} ops against SGD's {len(reference_ops)}" + (
        f"; ops SGD does not need: {listed}" if listed else ""
    )


# What a class whose get_config() a saved model cannot hold is told to do.
CONFIG_FIX = (
    "return plain Python values from get_config (floats, not tensors or variables; a schedule through "
    "its serialize())"
)


_GIVEN_TWICE = re.compile(r"got multiple values for keyword argument '(\w+)'")


def config_fix(error: BaseException, otherwise: str) -> str:
    """What to do about a config the class cannot be rebuilt from: where the rebuild gave the base an
    argument twice, the class fills it itself (`super().__init__(learning_rate=1.0, **kwargs)`) while
    its config returns the base's too; else `otherwise`."""
    link: BaseException | None = error
    seen: list[BaseException] = []
    while link is not None and link not in seen:  # a chain may loop back on itself
        seen.append(link)
        given_twice = _GIVEN_TWICE.search(str(link))
        if given_twice:
            name = given_twice.group(1)
            return (
                f"the constructor passes {name!r} to its base itself, and get_config() returns it too (the "
                f"base's config has it): leave it out of the config (`config.pop({name!r}, None)` in "
                "get_config)"
            )
        link = link.__cause__ or link.__context__
    return otherwise


def config_not_json(optimizer: Any) -> str | None:
    """The first key of the optimizer's get_config() whose value JSON cannot hold (a tensor, a
    variable), said with its class; None where every value is plain (or get_config itself fails)."""
    cls = type(optimizer).__name__
    try:
        config = optimizer.get_config()
    except Exception:
        return None
    for key, value in config.items():
        try:
            json.dumps(value, default=_numpy_scalar)
        except (TypeError, ValueError):
            held = type(value).__name__
            return (
                f"{cls}.get_config() returns {key!r} of type {held}, which a saved model's config cannot hold"
            )
    return None


def remove_path(path: Path) -> None:
    """A file or folder gone, if it is there (a folder that refused the file may refuse this too)."""
    with suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _unserializable_key(config: Any) -> str | None:
    """The first key of `config` whose value JSON cannot write (a variable, a tensor), or None."""
    if not isinstance(config, Mapping):
        return None
    for key, value in config.items():
        try:
            json.dumps(value, default=_numpy_scalar)
        except Exception:
            return str(key)
    return None


def _numpy_scalar(value: Any) -> Any:
    """What Keras's own JSON encoders accept beyond json's: NumPy scalars."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def tracked_outside(tf: Any, optimizer: Any, trained: Sequence[Any]) -> list[Any]:
    """tf.Variables reachable from the optimizer as a checkpoint sees it, but neither in
    optimizer.variables nor among the variables it trains. A legacy optimizer's scalars are left out:
    it keeps its hyperparameters (`_hyper`) as scalar variables outside `variables()`, rebuilt from
    its config; Keras 3 keeps none, so a scalar there is state (a step counter of the class's own)."""
    return [variable for _, variable in tracked_outside_by_path(tf, optimizer, trained)]


def tracked_outside_by_path(tf: Any, optimizer: Any, trained: Sequence[Any]) -> list[tuple[str, Any]]:
    """`tracked_outside`, each with its place in the checkpoint's object graph below the optimizer
    (`_bufs/0`): the same in a twin built alike, so a saved and a restored optimizer's match.
    Raises ValueError where tf.train.Checkpoint would refuse the graph (a dict with an int key)."""
    known = {id(backing(v)) for v in [*optimizer_variables_of(optimizer), *trained]}
    legacy = hasattr(optimizer, "_hyper")
    view = tf.train.TrackableView(optimizer)
    seen = {id(optimizer)}
    queue: deque[tuple[str, Any]] = deque([("", optimizer)])
    found = []
    while queue:  # breadth first, as a checkpoint walks it: each object at its shortest path
        path, parent = queue.popleft()
        for name, item in view.children(parent).items():
            if id(item) in seen:
                continue
            seen.add(id(item))
            place = f"{path}/{name}" if path else name
            queue.append((place, item))
            inner = backing(item)
            if not isinstance(inner, tf.Variable) or id(inner) in known or (legacy and len(inner.shape) == 0):
                continue
            known.add(id(inner))
            found.append((place, item))
    return found


def unsavable_said(tf: Any, optimizer: Any, trained: Sequence[Any], refusal: ValueError) -> str:
    """tf.train.Checkpoint refusing the optimizer's object graph, said without the objects' values and
    naming the attributes behind it."""
    words = " ".join(str(refusal).split())
    said = _head_and_tail(words)
    tensors = attributes_holding_tensors(tf, optimizer)
    if "non-string key" in words:  # TensorFlow's words quote the whole dict, its values printed
        said = "a dict an attribute holds maps a non-string key to a tf.Variable, which it cannot save"
    elif "truth value of an array" in words and tensors:  # it compares a container's items as it walks
        said = (
            f'{", ".join(tensors)} hold(s) tensors in a list, tuple or dict, which it cannot walk ("the '
            "truth value of an array ... is ambiguous\"): keep a step's values in local variables"
        )
    holders = attributes_holding_variables(optimizer, trained)
    where = f" ({', '.join(holders)} hold tf.Variables outside optimizer.variables)" if holders else ""
    return f"tf.train.Checkpoint cannot save the optimizer: {said}{where}"


def attributes_holding_tensors(tf: Any, optimizer: Any) -> list[str]:
    """The optimizer's attributes holding plain tensors (not tf.Variables) in a list, tuple or dict."""

    def is_tensor(value: Any) -> bool:
        return isinstance(value, tf.Tensor) and not hasattr(type(value), "assign")

    def holds(value: Any) -> bool:
        items = value.values() if isinstance(value, Mapping) else value
        return isinstance(value, Mapping | list | tuple) and any(is_tensor(item) for item in items)

    return sorted(f"`{name}`" for name, value in vars(optimizer).items() if holds(value))


def attributes_holding_variables(optimizer: Any, trained: Sequence[Any]) -> list[str]:
    """The optimizer's attributes holding a tf.Variable (directly, or in a dict, list, tuple or plain
    object) that is neither among optimizer.variables nor trained: where hidden state may be."""
    known = {id(backing(v)) for v in [*optimizer_variables_of(optimizer), *trained]}
    legacy = hasattr(optimizer, "_hyper")  # its scalar hyperparameters: see tracked_outside

    def holds(value: Any, depth: int) -> bool:
        inner = backing(value)
        if hasattr(type(inner), "handle") and hasattr(type(inner), "assign"):  # a tf.Variable's kinds
            return id(inner) not in known and not (legacy and len(inner.shape) == 0)
        if depth == 0 or isinstance(value, str | bytes | np.ndarray):
            return False
        if isinstance(value, Mapping):
            return any(holds(item, depth - 1) for item in value.values())
        if isinstance(value, list | tuple | set):
            return any(holds(item, depth - 1) for item in value)
        members = getattr(value, "__dict__", None)
        return type(value).__module__ == "types" and isinstance(members, dict) and holds(members, depth - 1)

    return sorted(f"`{name}`" for name, value in vars(optimizer).items() if holds(value, 3))


def backing(variable: Any) -> Any:
    """The tf.Variable behind a Keras 3 variable (itself for a tf.Variable)."""
    value = getattr(variable, "_value", None)
    # On the class: a mirrored variable's `handle` raises outside a replica context.
    return value if value is not None and hasattr(type(value), "handle") else variable


def iterations(counter: Any) -> int:
    """An optimizer's step counter as an int (a mirrored legacy one takes no int())."""
    return int(np.asarray(counter.numpy() if hasattr(counter, "numpy") else counter))


def every_variable(objects: KerasObjects) -> list[Any]:
    """The model's variables (weights, and Keras 3's seed states) and the optimizer's, in order."""
    return [*objects.model.variables, *optimizer_variables_of(objects.optimizer)]


def optimizer_variables_of(optimizer: Any) -> list[Any]:
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)  # legacy: a method


def _optimizer_variables(optimizer: Any) -> list[tuple[str, np.ndarray]]:
    """Every optimizer variable, named, copied (a view would change with the next step)."""
    return [(_name(v), np.array(np.asarray(v.numpy()))) for v in optimizer_variables_of(optimizer)]


def _name(variable: Any) -> str:
    return str(getattr(variable, "path", None) or variable.name)


def _short_name(variable: Any) -> str:
    """`d` for Keras 3's `adam/d` and tf.keras's `Adam/d:0`: the name the optimizer gave it."""
    return str(variable.name).rsplit("/", 1)[-1].split(":", 1)[0]


def variable_bytes(variable: Any) -> int:
    inner = backing(variable)
    return int(np.prod(tuple(inner.shape))) * int(inner.dtype.size)


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


def _held_value(optimizer: Any, name: str) -> Any:
    """The plain value the optimizer holds as attribute `name` (tf.keras's legacy hyperparameters read
    through it too), else None."""
    try:
        value = getattr(optimizer, name)
        return value.numpy().item() if hasattr(value, "numpy") else value
    except Exception:  # no such attribute, or not a number a tensor can give
        return None


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


def names_an_unknown_class(message: str) -> bool:
    """A load_model error saying the class is not registered by name (Keras 3's words, then tf_keras's)."""
    return "Could not locate class" in message or "Unknown optimizer" in message


def _head_and_tail(message: str, limit: int = 240) -> str:
    """`message` on one line, its middle left out when long: an error that quotes a whole config
    names what went wrong at its end ("... with an unsupported type (<class 'dict'>) to a Tensor")."""
    text = " ".join(message.split())
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    return f"{text[:half]} ... {text[-half:]}"


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes the optimizer's state holds, each tensor in its own dtype."""
    return sum(variable_bytes(v) for v in optimizer_variables_of(optimizer))
