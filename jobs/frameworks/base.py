"""What every framework driver provides, written without importing any framework.

A driver knows how one optimizer style (torch, Keras 3, legacy tf.keras) builds a model
and an optimizer, takes a step, reads and compares state, saves and restores a
checkpoint and places work on a device. Everything above the drivers (the training
loop, the conformance checks, the job result) is written once over this interface, so
a rule such as "the reloaded state must be bitwise equal" reads in one place and a
user gets the same verdict in every framework.
"""

from __future__ import annotations

import inspect
import json
import re
import traceback
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

from jobs.frameworks.foreign import ForeignMethod
from optimizers.loop_needs import PLAIN, LoopNeeds

if TYPE_CHECKING:
    import numpy as np

    from jobs.spec import JobSpec
    from jobs.workloads import Workload
    from optimizers.registry import Base, Entry


# What an error means where its message alone says why, and the fix for it (table: message -> fix);
# the checks and the jobs' own errors give the same advice.
_KNOWN_ERRORS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        # Keras 3's apply() knows only the variables the base class's build() recorded.
        re.compile(r"can only be called for the variables it was originally built with"),
        "call super().build(var_list) at the start of the class's build(): Keras's base build() records "
        "the variables the optimizer updates (and sets self.built), and a build() that skips it leaves none "
        "known to apply()",
    ),
    (
        re.compile(r"a leaf Variable that requires grad is being used in an in-place operation"),
        "the update runs with autograd recording: decorate step() with @torch.no_grad() (as torch's own "
        "optimizers do), or wrap the in-place update in `with torch.no_grad():`",
    ),
    (
        # tf.keras's legacy optimizer groups what `_resource_apply_dense`/`_sparse` return into the
        # step (tf.group, in a graph only): a method that returns None works eagerly and fails here,
        # in words that name neither it nor the fix (google/automl's Lion).
        re.compile(r"'inputs' should be zero or more \(nested\) Tensors\. Received 'None'"),
        "return the update op from _resource_apply_dense and _resource_apply_sparse (the result of "
        "var.assign(...), or tf.group(...) of every assignment): tf.keras's legacy optimizer groups what "
        "they return into the step's graph, and None cannot be grouped (the eager step groups nothing, "
        "so it works)",
    ),
)


def other_spec(path: Path, saved: Any, current: Any) -> str:
    """Why a checkpoint written by another job spec is refused, naming the fields that differ (a DDP
    job's checkpoint resumed by a one-device run had been told "a different job spec" alone)."""
    written, wanted = saved.model_dump(mode="json"), current.model_dump(mode="json")
    differ = [
        f"{name} ({json.dumps(written.get(name))[:80]} there, {json.dumps(wanted.get(name))[:80]} here)"
        for name in sorted(written.keys() | wanted.keys())
        if written.get(name) != wanted.get(name)
    ]
    return (
        f"checkpoint {path} was written by a different job spec ({'; '.join(differ)}); refusing to resume: "
        "a checkpoint resumes the job that wrote it"
    )


# Errors known by their type, whose message does not say the cause: torch.compile's
# FailOnRecompileLimitHit says only "Hard failure due to fullgraph=True".
_KNOWN_ERROR_TYPES: Mapping[str, str] = {
    "FailOnRecompileLimitHit": (
        "a torch.compile'd function of the class was compiled again for each new value of a Python number "
        "it is given (a step count, a bias correction such as 1 - beta1 ** step: compiled code is "
        "specialised on them), until torch's recompile limit (torch._dynamo.config.recompile_limit, 8), "
        "where fullgraph=True makes it raise: a job fails the same way after a few steps. Pass the numbers "
        "that change every step as tensors (torch.tensor(value), as torch's own optimizers keep `step`), "
        "or compile with dynamic=True"
    ),
}


def known_fix(error: BaseException) -> str | None:
    """The fix for `error` where its type or message names a known cause, else None."""
    by_type = _KNOWN_ERROR_TYPES.get(type(error).__name__)
    if by_type is not None:
        return by_type
    message = str(error)
    return next((fix for pattern, fix in _KNOWN_ERRORS if pattern.search(message)), None)


def source_files(cls: type) -> set[str]:
    """The files that define `cls` and its bases."""
    found = set()
    for klass in cls.__mro__:
        try:
            found.add(inspect.getsourcefile(klass) or "")
        except TypeError:  # a built-in class (object)
            continue
    return found - {""}


def raising_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The frame `error` was raised in: the deepest of its traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    return frames[-1] if frames else None


@dataclass(frozen=True)
class PerReplicaOption:
    """A framework option set on an optimizer that acts on each replica's own gradient under data
    parallelism (Keras's clipnorm): `effect` says what it does there."""

    name: str
    value: Any
    effect: str


def equal_only_to_itself(value: Any) -> bool:
    """An instance of a class without an __eq__ of its own: == says only whether it is the same object."""
    return (
        type(value).__eq__ is object.__eq__
        and hasattr(value, "__dict__")
        and not inspect.isroutine(value)
        and not inspect.ismodule(value)
        and not isinstance(value, type)
    )


def changed_by_save_said(changed: Sequence[str]) -> str:
    """What an optimizer's state_dict() call changed of its live state (Driver.state_changed_by_save),
    said as a cause: the checks and a job's checkpoint say it alike."""
    more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
    return (
        f"calling state_dict() changed the optimizer's live state ({', '.join(changed[:4])}{more}): "
        "what super().state_dict() returns under 'state' is self.state[p] itself, not a copy, so every "
        "save also changes the state training goes on with"
    )


def changed_by_save_explains(changed: Sequence[str], left: Sequence[str]) -> bool:
    """Whether what a state_dict() call changed of the live state (`state[param 0]['m'] removed`) is
    the cause of a loss, as far as the save shows: there is a change, and it accounts for every key
    the save leaves out (one left out of copies besides, the live state intact, is a cause of its own,
    told as such: the change is then only said beside it)."""
    return bool(changed) and all(any(c.startswith(f"{key} ") for c in changed) for key in left)


CHANGED_BY_SAVE_FIX = (
    "copy before editing what super().state_dict() returns: build new dicts ({k: v for k, v in "
    "s.items() if k != key}) or start from copy.deepcopy(super().state_dict()); never pop, replace or "
    "change its entries in place"
)


class CheckpointMismatch(Exception):
    """The reloaded objects differ from the ones that were saved."""


class AdvisedError(Exception):
    """An error that knows its remedy: `fix` says what to change (a job's error and a check's detail
    carry it after the message)."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


class ConfigNotSerialized(AdvisedError):
    """The optimizer's hyperparameters cannot be written or read back; `method` is the class's method
    at fault (the constructor, unless said)."""

    def __init__(self, message: str, fix: str, method: str = "__init__") -> None:
        super().__init__(message, fix)
        self.method = method


class StateNotRestored(AdvisedError):
    """Saved optimizer state could not be loaded back."""


class StateNotSaved(AdvisedError):
    """The framework cannot save the optimizer's state (TensorFlow refusing its object graph)."""


class NeedNotServed(AdvisedError):
    """A loop need the spec states that the class's step shows it does not have."""


class ScheduleUnreachable(AdvisedError):
    """The class keeps its rate where the style's schedules cannot set it (a torch param group's
    rate under another key than `lr`)."""


@dataclass(frozen=True)
class Capabilities:
    """What applies to a style, the way torch's `OptimizerInfo` flags what an optimizer supports.

    Checks and the loop read these instead of asking which framework they are in.
    """

    # `step(closure)`: the optimizer can re-evaluate the loss itself (torch only).
    closure: bool = False
    # Hyperparameters live per param group and groups can be added (torch only).
    param_groups: bool = False
    # A whole model (weights plus compiled optimizer) can be saved and loaded by name.
    whole_model_save: bool = False
    # A resumed job continues from a checkpoint file of this style.
    resume: bool = False
    # The learning rate may be a schedule object the optimizer serializes (Keras's
    # LearningRateSchedule); torch schedules live outside the optimizer.
    schedule_objects: bool = False
    # The framework's own optimizers sum a row-sparse gradient's repeated rows first (torch
    # coalesces), so a custom one that does not is wrong; Keras 3's own Adam and RMSprop
    # square each repeat separately, so there it is only worth a warning.
    sums_repeated_rows: bool = False
    # The framework's own optimizers refuse a learning rate below 0, so a class that accepts
    # one is at fault (torch). Keras and tf_keras accept it by design: probing it would be a
    # false alarm there.
    refuses_negative_lr: bool = False
    # A reload rebuilds the optimizer from its constructor call, then loads the saved state
    # (torch's load_state_dict): a setting the constructor keeps as an attribute, or stores
    # transformed, is not lost, so only what the round trip itself changes is a fault. Keras
    # rebuilds from get_config() alone, so there every argument must be in it, as given.
    rebuilt_from_constructor: bool = False
    # The optimizer is built apart from its variables (Keras: `build(variables)` comes later), so
    # its base class's constructor gets only what the class itself passes it.
    built_apart_from_variables: bool = False


@dataclass(frozen=True)
class StateDifference:
    """Where two optimizers' saved state differs, and the fix where the driver's usual advice (keep
    all state where the save sees it) does not fit the difference."""

    detail: str
    fix: str | None = None
    method: str | None = None  # the class's method at fault, where the difference shows one


@dataclass(frozen=True)
class SparseRows:
    """A row-sparse gradient as an Embedding produces it (repeated rows are summed)."""

    rows: list[int]
    values: np.ndarray
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TimeSpent:
    """Where a slow update's time goes: a phrase for the detail, and whether most of it is matrix
    math (products, decompositions, solves), which a preconditioned method (Shampoo, Muon, Kron)
    pays by design, unlike host syncs or per-element loops; or passes over whole tensors (most of
    the step inside element-wise ops, few host syncs), which a method with more per-element math
    than the yardstick pays by design too (factored moments, BCOS's extra powers)."""

    phrase: str
    in_matrix_math: bool = False
    in_tensor_ops: bool = False


# What the checks feed a step: dense, row-sparse, or None for a frozen variable.
Gradient: TypeAlias = "np.ndarray | SparseRows | None"
# Called by a driver for every warning (or logged deprecation) it captures: message,
# category (None for a log record), file and line where the framework says it was raised.
WarningSink: TypeAlias = "Callable[[str, type[Warning] | None, str | None, int | None], None]"


@dataclass(frozen=True)
class Advice:
    """The sentences of a fix that must name the framework's own API."""

    update_method: str  # where the user's update lives (`step`, `update_step`)
    in_place_update: str
    skip_none_grad: str
    finite_state: str
    untrainable_state: str
    fast_update: str
    fewer_passes: str  # how to pay less for an update whose time is in passes over whole tensors
    sign_of_update: str
    deprecated_call: str  # an example of replacing a deprecated call
    state_in_checkpoint: str  # where state must live for the style's checkpoint to save it
    sparse_update: str  # how to update only a sparse gradient's rows, or refuse it clearly
    read_lr_each_step: str  # where the update must read the scheduled learning rate
    keep_hyperparameters: str  # where every hyperparameter must be kept to be serialized
    state_on_device: str  # how to create state next to its variable
    state_on_device_after_restore: str  # how restored state lands next to its variable
    sparse_update_method: str | None = None  # where a sparse gradient's update lives, if not update_method


@dataclass(frozen=True)
class StepRecord:
    """What one training step measured, *not* read back to the host yet.

    `loss`, `grad_norm` and `optimizer_ms` may be device scalars (a 0-d tensor, a timing read
    from device events: anything `float()` accepts): reading one every step would make the host
    wait for the device every step. The loop keeps them and converts many at once through
    `TrainingSession.to_floats` at its flush cadence (and before every evaluation, checkpoint
    and the end), which is also where it finds the first non-finite loss.
    """

    loss: Any
    grad_norm: Any
    lr: float | None  # None: the class takes no learning rate (AliG)
    optimizer_ms: Any
    # The whole step's time where the host's clock around `train_step` is not it (a CUDA step
    # returns before the device has run it): a deferred device timing like `optimizer_ms`.
    # None: the loop's host clock is the step's time (the CPU, and a driver that waits itself).
    step_ms: Any = None


@dataclass(frozen=True)
class Evaluation:
    """The validation loss, and the model's outputs and the labels of the validation rows (numpy)."""

    loss: float
    outputs: np.ndarray
    labels: np.ndarray


@dataclass
class Checkpointed:
    """A verified checkpoint: where it lies, the objects training continues from, what to know.

    `confirm`, when set, is the last part of the verification, left for after the next step: it
    takes the objects once training has taken that step from them, and raises CheckpointMismatch
    if the step differs from the one the uninterrupted objects took (see the torch driver)."""

    objects: Any
    path: Path
    warnings: list[str] = field(default_factory=list)
    confirm: Callable[[Any], None] | None = None


class TrainingSession(ABC):
    """One job's model, data and optimizer in one framework, driven by `jobs.training.loop`.

    The loop owns cadence, timing, metrics, evaluation and checkpoint bookkeeping; a
    session only does what differs between frameworks.
    """

    device: str
    # A checkpoint's probe step that could not be compared was told (`tell_once`).
    told_inconclusive: bool = False

    def scope(self) -> AbstractContextManager[Any]:
        """Where the loop's work runs (TensorFlow: a device scope); nothing by default."""
        return nullcontext()

    def publication_settled(self, step: int) -> None:
        """The loop waited for the last checkpoint's publication before taking step's: a DDP job's
        other ranks wait for rank 0 here (jobs.distributed.rank_0_waited); nothing by default."""
        return None

    def tell_once(self, checkpointed: Checkpointed, step: int, inconclusive: str | None) -> None:
        """A probe step told inconclusive once a job, not at every checkpoint: its cause is the
        class's (a nondeterministic op, random draws), the same each time, and a long job's result
        had held one such line per checkpoint."""
        if inconclusive and not self.told_inconclusive:
            self.told_inconclusive = True
            checkpointed.warnings.append(
                f"step {step}: {inconclusive} (told once a job: later checkpoints whose probe step is "
                "inconclusive too are not listed)"
            )

    @abstractmethod
    def build(self) -> Any:
        """Fresh model and optimizer exactly as the spec describes them."""

    @abstractmethod
    def batch(self, step: int) -> Any:
        """The training batch of `step`, on the training device."""

    @abstractmethod
    def train_step(self, objects: Any, batch: Any, step: int) -> StepRecord:
        """Forward, backward and one optimizer update; the loss is read back to the host."""

    def to_floats(self, values: Sequence[Any]) -> list[float]:
        """Host floats of many step values (StepRecord fields) at once; a driver overrides this to
        read its device scalars in one transfer (one synchronisation) instead of one per value."""
        return [float(value) for value in values]

    @abstractmethod
    def evaluate(self, objects: Any) -> Evaluation:
        """Loss and outputs on the validation split, in evaluation mode."""

    @abstractmethod
    def checkpoint_path(self, folder: Path, step: int) -> Path:
        """Where the checkpoint of `step` lies under `folder` (a file or a folder, by style)."""

    @abstractmethod
    def checkpoint(
        self, objects: Any, step: int, folder: Path, *, next_step_follows: bool = False
    ) -> Checkpointed:
        """Save under `folder`, reload into fresh objects, prove nothing was lost.

        Raises CheckpointMismatch naming what differs; training continues from the
        returned objects, so a serialization bug shows in the result. `next_step_follows`: the
        loop trains step `step` from the returned objects next, so the driver may leave a part
        of the proof to that step (`Checkpointed.confirm`) instead of taking one of its own.
        """

    def resume(self, path: Path) -> tuple[Any, int]:
        """Objects restored from a checkpoint this style wrote, and the step it was taken at
        (only for drivers whose `capabilities.resume` is set)."""
        raise NotImplementedError

    @abstractmethod
    def params_sha256(self, objects: Any) -> str:
        """SHA-256 over the model's parameters, so two runs can be compared exactly."""

    def details(self, objects: Any) -> dict[str, Any]:
        """Style-specific facts for the result (e.g. where optimizer variables sit)."""
        return {}

    def parameter_values(self, objects: Any) -> list[np.ndarray]:
        """The model's trainable parameters as numpy arrays, in model order (for a workload's
        `step_metrics`, e.g. a 2-D trajectory)."""
        raise NotImplementedError(f"{type(self).__name__} cannot read the model's parameters")

    @abstractmethod
    def state_bytes(self, objects: Any) -> tuple[int, int]:
        """Bytes held by the optimizer's state, and by the model's trainable parameters: what an
        optimizer costs in memory next to the model it trains."""

    @abstractmethod
    def adapted_values(self, objects: Any) -> list[dict[str, float]]:
        """Per param group (one for a style without groups), the numeric scalars an optimizer may
        change itself (Prodigy's `d`), by key; the loop logs those that do change. Not the step
        counter or the learning rate, which the loop already logs as `train/lr`."""


class Driver(ABC):
    """One optimizer style: the single place that knows its framework."""

    style: ClassVar[str]
    framework: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    # The module with this style's side of `resume_exact` and `distributed` (a `FreshRuns`,
    # jobs/checks/fresh/plan.py), named, so a fresh child can find it before importing anything.
    fresh_module: ClassVar[str]

    advice: ClassVar[Advice]
    # The variables `step_cost` times an update on: large enough that the update's own work, not
    # the framework's per-call overhead, is what is measured.
    cost_shapes: ClassVar[tuple[tuple[int, ...], ...]]
    # How a user sets the rate by hand between steps, for a detail.
    rate_set_by_hand: ClassVar[str] = "the rate set between steps"
    # The framework's own optimizer options that act on each replica's own gradient before the
    # replicas' gradients are summed, with what each does there (Keras 3's clipping, accumulation).
    per_replica_option_effects: ClassVar[Mapping[str, str]] = {}
    # The constructor argument by which the framework's base class clips each variable's gradient to a
    # norm in its own apply method, and a norm that clips the checks' gradients (Keras: clipnorm).
    gradient_clipping: ClassVar[tuple[str, float] | None] = None
    # The style's framework in words ("Keras 3"), and the methods of other optimizer APIs it never calls.
    api_name: ClassVar[str] = ""
    foreign_methods: ClassVar[Mapping[str, ForeignMethod]] = {}

    @abstractmethod
    def session(
        self, spec: JobSpec, entry: Entry, workload: Workload, workdir: Path, base: Base | None = None
    ) -> TrainingSession:
        """The training session of one job; `base` is what a wrapper optimizer wraps."""

    def checkpoint_damage(self, path: Path) -> str | None:
        """What is wrong with the bytes of a checkpoint this style wrote, by the checksums it was
        written with; None when it reads back whole (only for styles whose `capabilities.resume`
        is set). Checked before a resume, so a damaged file is passed over for an earlier one."""
        raise NotImplementedError

    # -- what the conformance checks drive ---------------------------------------------------------------
    # Numpy arrays are the common currency: a check makes variables from arrays, feeds numpy
    # gradients and reads values and state back as numpy, so its verdict reads the same for
    # every framework.

    def random_state(self) -> bytes:
        """The framework's global RNG state, to see whether a step drew from it (b"": not read)."""
        return b""

    def isolated(self, seed: int = 0) -> AbstractContextManager[Any]:
        """The framework's RNG seeded with `seed`, and the caller's given back afterwards."""
        return nullcontext()

    @abstractmethod
    def variables(self, arrays: Sequence[np.ndarray]) -> list[Any]:
        """Trainable float32 variables holding `arrays`."""

    @abstractmethod
    def load_values(self, variables: Sequence[Any], arrays: Sequence[np.ndarray]) -> None:
        """Set `variables` to `arrays` in place, as a resumed job loads its weights into a model."""

    @abstractmethod
    def optimizer_over(self, create: Callable[[Any], Any], variables: Sequence[Any]) -> Any:
        """`create(model_params)` (the catalogue's build) over `variables`, state created as the
        style's own training loop creates it."""

    @abstractmethod
    def construct(self, cls: type, kwargs: Mapping[str, Any]) -> Any:
        """The class called directly with `kwargs` (its own argument names), as a user calls it."""

    @abstractmethod
    def step(
        self, optimizer: Any, variables: Sequence[Any], grads: Sequence[Gradient], needs: LoopNeeds = PLAIN
    ) -> None:
        """One update from numpy gradients, called the way the style's training loop calls it.

        `needs` (the entry's) says how: a style with closures passes one when the optimizer needs
        it, and gradients with a graph for Hessian-vector products; one that serves `train_eval`
        switches the optimizer to training first (back from `to_evaluation`).
        """

    def to_training(self, optimizer: Any, needs: LoopNeeds = PLAIN) -> None:
        """Switch to the variables training steps from, as the style's loop does before every step
        (a schedule-free class's `optimizer.train()`; some start in eval mode and refuse to step
        before it). A no-op where nothing is switched (the default: a loop that serves no
        `train_eval`)."""
        return None

    def to_evaluation(self, optimizer: Any, needs: LoopNeeds = PLAIN) -> str | None:
        """Switch to the variables the user evaluates, as the style's loop does before evaluating and
        saving (a schedule-free class's `optimizer.eval()`); `step` switches back to training. What
        was called, for the detail, or None where nothing is switched (the default: a loop that
        serves no `train_eval`)."""
        return None

    @abstractmethod
    def values(self, variables: Sequence[Any]) -> list[np.ndarray]:
        """The variables' current values, copied."""

    @abstractmethod
    def optimizer_state_bytes(self, optimizer: Any) -> int:
        """Bytes held by the optimizer's state, each tensor in its own dtype (bfloat16 moments at 2
        bytes an element: their numpy copies are float32)."""

    @abstractmethod
    def state(self, optimizer: Any) -> list[tuple[str, np.ndarray]]:
        """Every numeric piece of optimizer state, named, copied as numpy."""

    @abstractmethod
    def state_of(self, optimizer: Any, variables: Sequence[Any], index: int) -> list[np.ndarray]:
        """The state the optimizer keeps for `variables[index]` (their shapes are distinct)."""

    @abstractmethod
    def trainable_state(self, optimizer: Any, variables: Sequence[Any]) -> tuple[int, list[str], list[str]]:
        """How many state tensors there are, which are trainable or are (alias) a variable, and
        which are trainable only as the framework's own optimizers keep some (worth a warning)."""

    def state_writes(self, optimizer: Any) -> dict[str, tuple[Any, int]]:
        """Each state array's object and a count of the writes to it, by the name `state()` gives it,
        where the framework keeps such a count (torch's version counter), so that state a step set
        and the later steps never wrote can be told from state the steps keep writing. Empty (not
        known) by default."""
        return {}

    def state_left_out_of_save(self, optimizer: Any) -> list[str]:
        """State the optimizer holds that its own save leaves out (torch: keys of self.state[p]
        missing from an overridden state_dict()'s entry for p). An empty list by default."""
        return []

    def state_keyed_off_variables(self, optimizer: Any) -> list[str]:
        """Keys of the optimizer's per-variable state that a reload cannot give back to a variable
        (torch: `self.state` keyed by `id(p)` or an index), described; a save maps state to variables
        by their place, so a reloaded optimizer finds none of it. An empty list by default."""
        return []

    def base_init_skipped(self, error: BaseException) -> tuple[str, str] | None:
        """What to say and the fix where `error` shows the class never ran its framework base's
        constructor (torch: an attribute torch.optim.Optimizer.__init__ sets, missing); else None."""
        return None

    def state_changed_by_save(self, optimizer: Any) -> list[str]:
        """What the optimizer's own save removed or changed of the state it goes on training with,
        each named with how (torch: an overridden state_dict() that edits the dicts super().state_dict()
        returns, which are self.state[p] itself), put back as it was. An empty list by default: a style
        whose save hands back no live object of the optimizer's state changes none."""
        return []

    def config_left_out_of_save(self, optimizer: Any) -> list[tuple[int, str]]:
        """(group index, key) of each hyperparameter the optimizer holds that its own save leaves out
        (torch: a param-group key missing from an overridden state_dict()'s groups). An empty list by
        default."""
        return []

    def save_overrides(self, optimizer: Any) -> list[str]:
        """The class's own methods that replace the framework's save or restore of its configuration
        (torch: state_dict, load_state_dict, __setstate__): where a value lost in the round trip is
        dropped. None by default."""
        return []

    def state_sharing_gradients(self, optimizer: Any, variables: Sequence[Any]) -> list[str]:
        """The state entries that are a variable's gradient itself (its memory, not a copy), after a
        step. None by default: only torch hands the optimizer a gradient tensor it can keep."""
        return []

    def state_sharing_variables(self, optimizer: Any, variables: Sequence[Any]) -> list[str]:
        """The state entries that share storage with one of `variables` (torch: a kept `p.detach()`,
        or saved weights put back with `p.data = saved`). None by default: only torch's state can
        alias a parameter."""
        return []

    def state_shared_between(self, optimizer: Any, variables: Sequence[Any]) -> list[str]:
        """The keys of the first variable's state whose tensor (of more than one element, and of the
        variable's own shape) is a state tensor of the second's too, and of no further variable of
        another shape (a group-level one, shared by design). None by default: only torch's state holds
        tensors a class can hand to two parameters."""
        return []

    def gradients_kept_by_zero_grad(
        self, optimizer: Any, variables: Sequence[Any], needs: LoopNeeds = PLAIN
    ) -> list[str]:
        """The calls of the class's own gradient-clearing method (torch: a `zero_grad` override) that
        leave gradients of `variables` nonzero after a step (as a loop calls it), as written
        (`zero_grad(set_to_none=False)`). None by default: only torch's loops ask the optimizer to
        clear gradients."""
        return []

    def unshare_state(self, optimizer: Any, variables: Sequence[Any]) -> int:
        """Give every state tensor that shares storage with one of `variables` a copy of its own, in
        place; how many there were. None by default: only torch's state can alias a parameter."""
        return 0

    @abstractmethod
    def scheduled(
        self, create: Callable[[Any, Any], Any], variables: Sequence[Any], rates: Sequence[float], lr_arg: str
    ) -> tuple[Any, Callable[[int], None]]:
        """`create(model_params, learning_rate)` over `variables` with the rate scheduled as the style
        schedules it (torch: the group's lr set before each step; Keras: a LearningRateSchedule),
        and what to call before step i."""

    def hand_fed_schedule(
        self, create: Callable[[Any, Any], Any], variables: Sequence[Any], rates: Sequence[float], lr_arg: str
    ) -> tuple[Any, Callable[[int], None]]:
        """As `scheduled`, but through a schedule object whose rate is set by hand before each step;
        only for styles with schedule objects (`capabilities.schedule_objects`: Keras), since in torch
        a schedule is the rate set by hand. A class may keep rates of its own that `set_learning_rate`
        does not reach but a schedule does (the Model Garden's SGDTorch builds its bias and other
        rates from the one given)."""
        raise NotImplementedError(f"{self.style} has no schedule objects")

    @abstractmethod
    def set_learning_rate(self, optimizer: Any, rate: float, lr_arg: str) -> None:
        """Set a plain rate by hand, between steps."""

    @property
    @abstractmethod
    def schedule_name(self) -> str:
        """The style's schedule, for the detail (`a LearningRateSchedule`)."""

    @property
    @abstractmethod
    def config_name(self) -> str:
        """Where the style keeps hyperparameters, for the detail (`param_groups`, `get_config()`)."""

    @abstractmethod
    def config(self, optimizer: Any) -> list[dict[str, Any]]:
        """The hyperparameters as the style serializes them, by argument name: one dict per param
        group (torch) or the one config; ConfigNotSerialized when they cannot be serialized."""

    @abstractmethod
    def config_roundtrip(self, optimizer: Any, fresh: Callable[[], Any]) -> list[dict[str, Any]]:
        """`config` after the style's round trip (torch: state_dict into `fresh()`, built with other
        values; Keras: JSON and from_config); ConfigNotSerialized when the round trip fails."""

    @property
    @abstractmethod
    def config_roundtrip_name(self) -> str:
        """The round trip `config_roundtrip` takes, for the detail."""

    def reload_holds(self, optimizer: Any, name: str, value: Any, *, is_rate: bool) -> bool:
        """Whether an optimizer the style's reload rebuilds from `optimizer`'s config holds `value` for
        hyperparameter `name` where the config has no such key, or another value under it (only for
        styles whose reload rebuilds from the config: Keras)."""
        return False

    def framework_step_count(self, optimizer: Any, updates: int) -> tuple[int, int] | None:
        """The step count the framework itself keeps on `optimizer` and what it should read after
        `updates` updates, or None where the framework keeps none (torch: a class's own counters are
        its state). Keras: `iterations`, incremented once per apply()."""
        return None

    def learning_rate_schedule(self, lr: float) -> Any:
        """A schedule object starting at `lr` (only where `capabilities.schedule_objects`)."""
        raise NotImplementedError(f"{self.style} optimizers take no schedule objects")

    @property
    @abstractmethod
    def sparse_gradient_name(self) -> str:
        """What a row-sparse gradient is in the framework (`nn.Embedding(sparse=True)`)."""

    def densifying(self, shape: tuple[int, ...], files: set[str]) -> AbstractContextManager[list[str]]:
        """While inside, `file:line` in `files` of each call that turns a sparse tensor of `shape`
        into a dense one (torch's `to_dense()`): a step that does so costs the whole table however few
        rows its gradient touches. Nothing where the framework has no such call to watch."""
        return nullcontext([])

    @abstractmethod
    def refusal_files(self, cls: type) -> set[str]:
        """Files whose `raise` is a deliberate refusal: the class's own and the framework's optimizers'."""

    def per_replica_options(self, optimizer: Any) -> list[PerReplicaOption]:
        """The framework's own options set on `optimizer` that act on each replica's own gradient
        before the replicas' gradients are summed (`per_replica_option_effects`)."""
        return [
            PerReplicaOption(name, getattr(optimizer, name), effect)
            for name, effect in self.per_replica_option_effects.items()
            if getattr(optimizer, name, None) not in (None, 0)
        ]

    def drop_options(self, optimizer: Any, names: Sequence[str]) -> None:
        """Turn off `per_replica_options` on a built optimizer before its state is created."""
        for name in names:
            setattr(optimizer, name, None)  # Keras reads them at each apply(), and in build()

    def unmet_need(self, error: BaseException) -> str | None:
        """What `error` says the class needs that this process lacks, or None: the framework's
        distributed runtime set up (a class written for data-parallel training only, as Keller
        Jordan's Muon), an accelerator this machine does not have (a step that calls the CUDA
        runtime). A noun phrase: "the class steps only with {need}". None by default."""
        return None

    @abstractmethod
    def accelerator(self) -> AbstractContextManager[Any] | None:
        """A scope that puts new variables (and the optimizer) on an accelerator, or None without one."""

    @property
    @abstractmethod
    def no_accelerator(self) -> str:
        """Why there is no accelerator here, for a skip."""

    @abstractmethod
    def misplaced_state(self, optimizer: Any, variables: Sequence[Any]) -> list[str]:
        """State that sits on another device than its variable, one phrase each."""

    @property
    @abstractmethod
    def state_format(self) -> str:
        """How `save_state` saves, for the detail (`torch.save -> torch.load(weights_only=True)`)."""

    @abstractmethod
    def save_state(self, optimizer: Any, variables: Sequence[Any], folder: Path) -> Any:
        """Save the optimizer's state as a job's checkpoint does; returns what `restore_state` reads."""

    @abstractmethod
    def restore_state(self, optimizer: Any, variables: Sequence[Any], saved: Any) -> None:
        """Load saved state into a never-stepped optimizer (onto the host first, as a job resumed on
        another machine loads it); StateNotRestored when that fails."""

    @abstractmethod
    def state_difference(self, saved: Any, restored: Any) -> StateDifference | None:
        """Where two optimizers' saved state differs (config and step count included), or None."""

    @abstractmethod
    def recording_warnings(self, sink: WarningSink) -> AbstractContextManager[Any]:
        """Pass every warning the framework raises while inside to `sink`, once-only ones too."""

    @abstractmethod
    def reference_adamw(self, variables: Sequence[Any]) -> Any:
        """The framework's AdamW (two state tensors per variable) over `variables`, state created:
        the yardstick for an optimizer that keeps two or more, so an Adam-like update is compared
        with Adam's cost, not SGD's."""

    @property
    @abstractmethod
    def reference_adamw_name(self) -> str:
        """That yardstick by name (`torch.optim.AdamW`)."""

    @abstractmethod
    def reference_sgd(self, variables: Sequence[Any]) -> Any:
        """The framework's SGD(momentum=0.9) over `variables`, state created: the yardstick."""

    @abstractmethod
    def timed_update(
        self, optimizer: Any, variables: Sequence[Any], grads: Sequence[np.ndarray]
    ) -> Callable[[], Any]:
        """One update with fixed gradients, as a job runs it (Keras: compiled), warmed up."""

    def timing(self) -> AbstractContextManager[Any]:
        """Where timings are taken (torch: one intra-op thread); nothing by default."""
        return nullcontext()

    @abstractmethod
    def where_time_goes(self, slow: Callable[[], Any], reference: Callable[[], Any]) -> TimeSpent:
        """What makes `slow` slower than `reference` (profiler ops, host syncs)."""

    @property
    @abstractmethod
    def timed_update_name(self) -> str:
        """How the update is timed, for the detail (`step()`, `the update under tf.function`)."""

    @property
    @abstractmethod
    def reference_sgd_name(self) -> str:
        """The yardstick by name (`torch.optim.SGD(momentum=0.9)`)."""


@contextmanager
def python_warnings_to(sink: WarningSink) -> Iterator[None]:
    """Every Python warning raised inside goes to `sink` as it is raised (so the caller can
    still see the stack that raised it), none shown, the filters restored afterwards."""

    def show(message: Any, category: type[Warning], filename: str, lineno: int, *_: Any, **__: Any) -> None:
        sink(str(message), category, filename, lineno)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        yield
