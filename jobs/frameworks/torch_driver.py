"""The torch driver: builds, steps, checkpoints and compares `torch.optim.Optimizer` training.

The checkpoint round-trip: save, reload into fresh objects, prove nothing was lost. One
file per checkpoint (a dict with `model`, `optimizer`, `scheduler`, `rng`, `step`,
`data_position`, `spec`), loaded back with `weights_only=True` as a user would.
Comparing state dicts alone would miss state an optimizer keeps outside
`self.state` / `param_groups` (both copies would lack it equally), so the check of
record also takes one identical probe step with the original and the reloaded
objects and requires bitwise-equal results.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import inspect
import math
import os
import pickle
import random
import re
import struct
import sys
import time
import traceback
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from jobs.batches import BatchOrder
from jobs.distributed import Rank, current_rank, rank_0_waited
from jobs.errors import free_space_note
from jobs.frameworks.base import (
    CHANGED_BY_SAVE_FIX,
    Advice,
    Capabilities,
    Checkpointed,
    CheckpointMismatch,
    Driver,
    Evaluation,
    Gradient,
    NeedNotServed,
    ScheduleUnreachable,
    SparseRows,
    StateDifference,
    StateNotRestored,
    StepRecord,
    TimeSpent,
    TrainingSession,
    WarningSink,
    changed_by_save_said,
    equal_only_to_itself,
    other_spec,
    python_warnings_to,
    raising_frame,
    source_files,
)
from jobs.frameworks.torch_compile import compile_clock, compiled
from jobs.spec import JobSpec
from jobs.workloads import Workload
from optimizers.loop_needs import FRAMEWORK_PACKAGES, PLAIN, LoopNeeds, recipe_problem, user_classes
from optimizers.registry import Base, Entry
from optimizers.schedules import build_schedule

__all__ = ["CheckpointMismatch", "TorchDriver", "TrainObjects", "first_difference"]


@dataclass
class TrainObjects:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    # None for a class that takes no learning rate (AliG, A2Grad compute their step): nothing to scale.
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    # What forward passes go through when not the model itself: a DDP job's DistributedDataParallel
    # wrapper, a `compile` job's compiled module (the checkpoint holds the plain model, so its keys
    # are those of a one-device, uncompiled job).
    replicated: nn.Module | None = None

    @property
    def forward(self) -> nn.Module:
        return self.replicated if self.replicated is not None else self.model

    @cached_property
    def parameters(self) -> list[nn.Parameter]:
        """The model's parameters, listed once per built objects: every step reads their gradients
        (the norm) without walking the modules again."""
        return list(self.model.parameters())

    def parts(self) -> dict[str, Any]:
        """What a checkpoint holds of these, by name."""
        named: dict[str, Any] = {"model": self.model, "optimizer": self.optimizer}
        if self.scheduler is not None:
            named["scheduler"] = self.scheduler
        return named


def rng_state() -> dict[str, Any]:
    """Every random stream a step may draw from: torch's (and CUDA's), numpy's global one and Python's
    `random` (Kron and PSGD draw from numpy's in their steps, PCGrad shuffles with `random`). Plain
    tensors, ints and floats, so a `weights_only` load reads them."""
    _, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    version, python_state, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {
            "version": version,
            "state": torch.tensor(python_state, dtype=torch.int64),
            "gauss": gauss_next,
        },
    }
    # Only when this job already uses CUDA: asking earlier would create a context on every GPU. The
    # current device's stream only: a DDP rank draws on its own GPU, and every rank restores its
    # stream from the checkpoint rank 0 wrote (all ranks seed alike and draw alike). Every visible
    # GPU's streams, restored by index, had set rank r's to rank 0's copy of it, never advanced.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:  # checkpoints written before it was saved hold torch's stream only
        saved = state["numpy"]
        keys = saved["keys"].cpu().numpy().astype(np.uint32)
        np.random.set_state(
            ("MT19937", keys, saved["position"], saved["has_gauss"], saved["cached_gaussian"])
        )
    if "python" in state:
        saved = state["python"]
        random.setstate((saved["version"], tuple(int(x) for x in saved["state"].tolist()), saved["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if isinstance(saved, list):  # written before: every visible GPU's stream, by index
            saved = saved[min(torch.cuda.current_device(), len(saved) - 1)]
        torch.cuda.set_rng_state(saved.cpu())  # the current device's


# What torch.optim.Optimizer.__init__ sets, which its state_dict() and step hooks read: a class that
# never runs it (torch_optimizer's Lookahead) fails on the first of them, in words that name only it.
OPTIMIZER_INIT_ATTRIBUTES = frozenset(
    {
        "_optimizer_step_pre_hooks",
        "_optimizer_step_post_hooks",
        "_optimizer_state_dict_pre_hooks",
        "_optimizer_state_dict_post_hooks",
        "_optimizer_load_state_dict_pre_hooks",
        "_optimizer_load_state_dict_post_hooks",
    }
)


# torch's own methods read these too; a class that never ran Optimizer.__init__ lacks them all.
NEVER_RAN_INIT_ATTRIBUTES = OPTIMIZER_INIT_ATTRIBUTES | {"defaults", "_zero_grad_profile_name"}
NEVER_RAN_INIT_SAID = (
    "the class never ran torch.optim.Optimizer.__init__, which sets self.defaults and the hook dicts "
    "(_optimizer_step_pre_hooks and five more) that torch's step hooks, zero_grad(), state_dict(), "
    "load_state_dict() and add_param_group() read"
)
NEVER_RAN_INIT_FIX = (
    "call super().__init__(params, defaults) in __init__; a wrapper that takes over its base's groups: "
    "super().__init__(optimizer.param_groups, optimizer.defaults) (where its own add_param_group does not "
    "hand those groups to its base again), or keep torch's hook dicts with "
    "torch.optim.Optimizer.__setstate__(self, {'defaults': optimizer.defaults, 'state': defaultdict(dict), "
    "'param_groups': optimizer.param_groups})"
)


def never_ran_optimizer_init(error: BaseException) -> bool:
    """Whether `error` is a torch optimizer's missing attribute that torch.optim.Optimizer.__init__
    sets, on an instance that lacks its hook dicts: the class never ran it (lonePatient's Lookahead,
    a wrapper that takes its base's param_groups and state). A class that ran it has them all."""
    if not isinstance(error, AttributeError) or error.name not in NEVER_RAN_INIT_ATTRIBUTES:
        return False
    instance = getattr(error, "obj", None)
    return isinstance(instance, torch.optim.Optimizer) and not all(
        hasattr(instance, name) for name in OPTIMIZER_INIT_ATTRIBUTES
    )


def _saved_and_changed(part: Any) -> tuple[Any, list[str]]:
    """`part.state_dict()`, and what the call removed or changed of an optimizer's live state (anything
    with param_groups), put back (saved_state_dict); a model or scheduler changes nothing."""
    if isinstance(getattr(part, "param_groups", None), list):
        return saved_state_dict(part)
    return part.state_dict(), []


def state_dict_of(name: str, part: Any) -> tuple[Any, list[str]]:
    """_saved_and_changed, for a checkpoint: an optimizer that never ran torch.optim.Optimizer.__init__
    is told so."""
    try:
        return _saved_and_changed(part)
    except AttributeError as exc:
        if exc.name not in OPTIMIZER_INIT_ATTRIBUTES:
            raise
        raise StateNotRestored(
            f"{name}: {type(part).__name__}.state_dict() failed ({exc}): the class never ran "
            "torch.optim.Optimizer.__init__, which sets what torch's state_dict() reads",
            fix="call super().__init__(params, defaults) in __init__ (a wrapper: with its base's param "
            "groups), or define state_dict() and load_state_dict() of its own that torch's do not back",
        ) from exc


def _state_dict(part: Any) -> Any:
    """What `part.state_dict()` saves, an optimizer's live state left as it was (saved_state_dict)."""
    return _saved_and_changed(part)[0]


# -- a state_dict() that changes the live state ------------------------------------------------------------
#
# torch's state_dict() returns the optimizer's own per-parameter dicts under "state" (only the keys are
# renumbered), so an override that edits what super().state_dict() returns (`s.pop('exp_avg_sq')`)
# edits the state training goes on with: every save then wipes it. A save and a reload of such a class
# agree with each other (both lack it), so the driver keeps the live state as it was before the call,
# puts back what the call took, and hands on what the call said it saves.
#
# Cost: torch's own state_dict() is never watched. An override's call costs a dict of references per
# entry; tensor values are compared (torch.equal, on their device) only where a tensor's identity or
# version counter moved, and copied first only in the checks or for a class once seen changing values
# in place (a version bump that changed no value, `add_(0)`, is learned as harmless, once).


@dataclass
class _LiveEntry:
    """One entry of `optimizer.state` as it was before a state_dict() call: the dict itself, its
    values (the objects, not copies), each tensor's version counter and, where asked, its values."""

    key: Any
    entry: MutableMapping[Any, Any]
    values: dict[Any, Any]
    versions: dict[Any, int]
    copies: dict[Any, torch.Tensor]


def _live_entries(optimizer: Any, *, copy_values: bool) -> list[_LiveEntry]:
    state = getattr(optimizer, "state", None)
    if not isinstance(state, Mapping):
        return []
    found = []
    for key, entry in list(state.items()):
        if not isinstance(entry, MutableMapping):
            continue  # a number kept beside the entries (SPAM's state["total_step"]): saved by value
        tensors = {k: v for k, v in entry.items() if isinstance(v, torch.Tensor)}
        found.append(
            _LiveEntry(
                key,
                entry,
                dict(entry),
                {k: _version_of(v) for k, v in tensors.items()},
                {k: v.detach().clone() for k, v in tensors.items()} if copy_values else {},
            )
        )
    return found


def _version_of(tensor: torch.Tensor) -> int:
    """How many times the tensor was changed in place (-1 for one that does not count: an inference
    tensor)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return -1


def _bumped(live: _LiveEntry, key: Any) -> bool:
    return _version_of(live.values[key]) != live.versions[key]


def _same_tensor_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, layout, dtype, device and values (NaN equal to NaN), compared where the tensors
    are: no copy to the host."""
    if (a.shape, a.dtype, a.layout, a.device) != (b.shape, b.dtype, b.layout, b.device):
        return False
    a, b = (a.detach(), b.detach())
    if a.is_sparse:
        a, b = a.to_dense(), b.to_dense()
    if a.is_meta:
        return True  # no values to compare
    return bool(torch.equal(a, b)) or _equal_or_both_nan(a, b)


def _values_moved(copied: torch.Tensor, tensor: torch.Tensor) -> bool:
    return not _same_tensor_values(copied, tensor)


def _tensor_replaced(before: torch.Tensor, now: torch.Tensor) -> str | None:
    """How a tensor a state_dict() call put in place of another differs from it, or None."""
    if before.device != now.device:
        return f"moved from {before.device} to {now.device}"
    if before.dtype != now.dtype:
        return f"cast from {before.dtype} to {now.dtype}"
    if not _same_tensor_values(before, now):
        return "replaced by other values"
    return None


def _as_number(value: Any) -> float | complex | None:
    """A Python number, or a one-element tensor's value; None for anything else."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().item() if value.numel() == 1 and not value.is_meta else None
    return value if isinstance(value, (int, float, complex)) and not isinstance(value, bool) else None


def _kind_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor"
    return f"a Python {type(value).__name__}"


def _replaced(before: Any, now: Any) -> tuple[str, bool] | None:
    """How a value a state_dict() call put in place of another differs: (said, whether only its kind
    changed, the value kept: tensor(3.) into 3.0), or None where it holds the same. State created by
    the call where there was None is an addition, not a change; what cannot be compared counts as the
    same (nothing to blame)."""
    if before is None:
        return None
    if isinstance(before, torch.Tensor) and isinstance(now, torch.Tensor):
        if before.requires_grad != now.requires_grad and _tensor_replaced(before, now) is None:
            return f"now {'' if now.requires_grad else 'no longer '}requiring grad, the value kept", True
        said = _tensor_replaced(before, now)
        return None if said is None else (said, False)
    if isinstance(before, torch.Tensor) or isinstance(now, torch.Tensor):
        a, b = _as_number(before), _as_number(now)
        if a is not None and b is not None and (a == b or _both_nan(a, b)):
            return f"turned from {_kind_of(before)} into {_kind_of(now)} of the same value ({b!r})", True
        return "replaced by other values", False
    try:
        if _both_nan(before, now) or bool(before == now):
            if type(before) is type(now):
                return None
            return f"turned from {_kind_of(before)} into {_kind_of(now)} of the same value ({now!r})", True
    except Exception:
        return None
    return "replaced by other values", False


@dataclass
class _Changes:
    """What a state_dict() call changed of the live state: `said`, each a change that matters; `kinds`,
    values the call swapped for another kind of the same value (reported only where the next step
    sees it: _kind_changes_that_matter); `in_place`, whether a tensor's values were changed in place."""

    said: list[str]
    kinds: list[tuple[str, Any, Any, Any]]  # (said, state key, entry key, the value the call left)
    in_place: bool


def _live_changes(optimizer: Any, entries: Sequence[_LiveEntry]) -> _Changes:
    """What a state_dict() call removed or changed of `entries` (`state[param 0]['exp_avg_sq']
    removed`); keys it added are not counted (a class may fill in bookkeeping as it saves)."""
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    state = optimizer.state
    found = _Changes([], [], in_place=False)
    for live in entries:
        tensor_key = isinstance(live.key, torch.Tensor)
        where = f"state[param {index.get(id(live.key), '?')}]" if tensor_key else f"state[{live.key!r}]"
        now = state.get(live.key) if isinstance(state, Mapping) else None
        if not isinstance(now, Mapping):
            found.said += [f"{where}[{key!r}] removed" for key in live.values]
            continue
        for key, before in live.values.items():
            if key not in now:
                found.said.append(f"{where}[{key!r}] removed")
            elif now[key] is not before:
                how = _replaced(before, now[key])
                if how is not None:
                    if how[1]:
                        found.kinds.append((f"{where}[{key!r}] {how[0]}", live.key, key, now[key]))
                    else:
                        found.said.append(f"{where}[{key!r}] {how[0]}")
            elif key in live.copies and _bumped(live, key) and _values_moved(live.copies[key], before):
                found.said.append(f"{where}[{key!r}] changed in place")
                found.in_place = True
    return found


def _put_back(optimizer: Any, entries: Sequence[_LiveEntry]) -> None:
    """The live state as `entries` had it: each entry dict in its place, holding its values again
    (not a None the call filled in: an addition), and tensors changed in place given their values back
    where they were copied."""
    state = optimizer.state
    with torch.no_grad():
        for live in entries:
            if state.get(live.key) is not live.entry:
                state[live.key] = live.entry
            for key, before in live.values.items():
                if live.entry.get(key) is not before and not (before is None and key in live.entry):
                    live.entry[key] = before
            for key, values in live.copies.items():
                if _bumped(live, key):
                    live.values[key].copy_(values)


def _apart_from(saved: Any, entries: Sequence[_LiveEntry]) -> Any:
    """`saved` with every live entry dict it holds, at any depth (under "state", or wrapped:
    {"wrapped": super().state_dict()}, a Lookahead's nested dicts, lists and tuples), replaced by a
    copy, and each tensor the call changed in place by a copy of what it holds now, so that putting
    the live state back does not change what the call saved. Containers holding neither are kept."""
    live = {id(e.entry) for e in entries}
    changed = {id(e.values[key]) for e in entries for key in e.copies if _bumped(e, key)}
    seen: dict[int, Any] = {}

    def apart(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.clone() if id(value) in changed else value
        if id(value) in seen:
            return seen[id(value)]
        seen[id(value)] = value  # a cycle meets the container as it is
        if isinstance(value, Mapping):
            items = {k: apart(v) for k, v in value.items()}
            if id(value) in live or any(items[k] is not v for k, v in value.items()):
                copied = copy.copy(value) if isinstance(value, dict) else dict(value)
                copied.update(items)
                seen[id(value)] = copied
        elif isinstance(value, (list, tuple)):
            members = [apart(v) for v in value]
            if any(a is not b for a, b in zip(members, value, strict=True)):
                if isinstance(value, list):
                    seen[id(value)] = members
                elif hasattr(value, "_fields"):
                    seen[id(value)] = type(value)(*members)
                else:
                    seen[id(value)] = tuple(members)
        return seen[id(value)]

    return apart(saved)


def _optimizer_copy(optimizer: Any, kinds: Sequence[tuple[str, Any, Any, Any]] = ()) -> Any:
    """A deep copy of `optimizer` with its parameters' gradients (deepcopy leaves them out), holding
    each value `kinds` names as the call left it (set after the copy: a class's __setstate__, Adam's,
    turns a float step back into a tensor); None where it cannot be copied."""
    memo: dict[int, Any] = {}
    try:
        copied = copy.deepcopy(optimizer, memo)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if isinstance(p, torch.Tensor) and p.grad is not None and id(p) in memo:
                    memo[id(p)].grad = p.grad.detach().clone()
        for _, state_key, key, value in kinds:
            copied.state[memo.get(id(state_key), state_key)][key] = copy.deepcopy(value)
    except Exception:
        return None
    return copied


def _next_step_sees(changed: Any, kept: Any) -> str | None:
    """How the next step of `changed` (the state as the call left it) differs from that of `kept`
    (as it was), on the gradients the parameters hold; None where they agree or `kept` cannot step
    here (a step that needs a closure: nothing shown, nothing to blame)."""
    steps: list[BaseException | None] = []
    for optimizer in (kept, changed):
        with torch.random.fork_rng():  # the same draws in both, the process's own left as they were
            torch.manual_seed(0)
            try:
                optimizer.step()
                steps.append(None)
            except Exception as exc:
                steps.append(exc)
    if steps[0] is not None:
        return None
    if steps[1] is not None:
        return f"the next step then raises {type(steps[1]).__name__}: {steps[1]}"
    pairs = zip(
        (p for g in kept.param_groups for p in g["params"]),
        (p for g in changed.param_groups for p in g["params"]),
        strict=False,
    )
    if any(not _same_tensor_values(a, b) for a, b in pairs):
        return "the next step then gives other parameters"
    return None


def saved_state_dict(optimizer: Any, *, copy_values: bool = False) -> tuple[Any, list[str]]:
    """`optimizer.state_dict()`, and what the call removed or changed of the live state (see above),
    which is put back: the optimizer goes on as it was, what is returned is what the class saves.
    A tensor changed in place is seen and put back only where its values were copied first: with
    `copy_values` (the checks), and for a class whose save was once seen changing a tensor's values in
    place (a job's state is not copied at every save). A value swapped for another kind of the same
    value (tensor(3.) into 3.0) is put back, and said only with `copy_values` and where the next step
    sees it (torch's Adam raises on a float step)."""
    cls = type(optimizer)
    if getattr(cls, "state_dict", None) is torch.optim.Optimizer.state_dict:
        return optimizer.state_dict(), []  # torch's own changes nothing
    copying = copy_values or cls in _SAVES_CHANGING_IN_PLACE or cls in _SAVES_TO_COMPARE
    entries = _live_entries(optimizer, copy_values=copying)
    saved = optimizer.state_dict()
    found = _live_changes(optimizer, entries)
    if any(_bumped(e, k) for e in entries for k in e.versions):
        _learn_in_place(cls, compared=copying, changed=found.in_place)
    if not (found.said or found.kinds):
        return saved, []
    saved = _apart_from(saved, entries)
    _put_back(optimizer, entries)
    said = found.said
    if found.kinds and copy_values:  # only where the next step sees it
        as_left, kept = _optimizer_copy(optimizer, found.kinds), _optimizer_copy(optimizer)
        sees = _next_step_sees(as_left, kept) if as_left is not None and kept is not None else None
        if sees:
            said = said + [f"{kind[0]}: {sees}" for kind in found.kinds]
    return saved, said


def _learn_in_place(cls: type, *, compared: bool, changed: bool) -> None:
    """What a class's save that bumped a state tensor's version counter tells of its next saves: one
    that changed values is copied from now on; one not compared is compared at its next save; one that
    changed none (`add_(0)`, a copy_ of the same values) is not copied again for it."""
    if changed:
        _SAVES_CHANGING_IN_PLACE.add(cls)
    elif compared:
        _SAVES_TO_COMPARE.discard(cls)
        _SAVES_KEEPING_VALUES.add(cls)
    elif cls not in _SAVES_KEEPING_VALUES:
        _SAVES_TO_COMPARE.add(cls)


# Classes whose state_dict() was seen changing a state tensor's values in place: copied first.
_SAVES_CHANGING_IN_PLACE: set[type] = set()
# Classes whose state_dict() bumped a version counter, not yet compared: copied at their next save.
_SAVES_TO_COMPARE: set[type] = set()
# Classes whose state_dict() bumped a version counter and changed no value: not copied for it.
_SAVES_KEEPING_VALUES: set[type] = set()


def live_state_note(optimizer: Any, changed: Sequence[str]) -> str:
    """What a job says of a state_dict() call that changed the optimizer's live state: the change, the
    override's line and the fix."""
    where = _method_line(type(optimizer), "state_dict")
    return f"{changed_by_save_said(changed)} (at {where}). Fix: {CHANGED_BY_SAVE_FIX}"


@contextmanager
def blaming(note: str | None) -> Iterator[None]:
    """A checkpoint that does not verify, told what the save call changed of the live state (`note`)."""
    try:
        yield
    except CheckpointMismatch as exc:
        if note is None:
            raise
        raise CheckpointMismatch(f"{exc}; {note}") from exc


def save_checkpoint(path: Path, objects: TrainObjects, *, step: int, spec_json: str) -> list[str]:
    """Write atomically, so a crash mid-save never leaves a torn checkpoint behind. Returns what the
    optimizer's state_dict() call removed or changed of its live state, which was put back
    (saved_state_dict): the file holds what the class saves, training goes on from what it held."""
    parts = {name: state_dict_of(name, part) for name, part in objects.parts().items()}
    payload = {
        **{name: saved for name, (saved, _) in parts.items()},
        "rng": rng_state(),
        "step": step,
        # Batches are a pure function of (seed, step), so the step is the data position.
        "data_position": step,
        "spec": spec_json,
    }
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:  # torch's own words name no file ("open file failed")
        with suppress(OSError):  # a folder that refused the file may refuse this too
            tmp.unlink(missing_ok=True)
        raise OSError(f"could not write the checkpoint {path}: {exc}{free_space_note(path.parent)}") from exc
    return [change for _, changed in parts.values() for change in changed]


def clear_gradients(optimizer: Any) -> None:
    """`zero_grad(set_to_none=True)`, as torch's own loops clear gradients; a class whose zero_grad()
    takes no argument (fairscale's AdaScale proxies it so) is called as a user's loop calls it."""
    cls = type(optimizer)
    takes = _ZERO_GRAD_TAKES_SET_TO_NONE.get(cls)
    if takes is None:  # read once per class: this runs every step
        takes = _ZERO_GRAD_TAKES_SET_TO_NONE[cls] = _takes_set_to_none(optimizer.zero_grad)
    if takes:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.zero_grad()


_ZERO_GRAD_TAKES_SET_TO_NONE: dict[type, bool] = {}


def _takes_set_to_none(zero_grad: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(zero_grad).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): torch's own argument, then
        return True
    return any(p.name == "set_to_none" or p.kind is p.VAR_KEYWORD for p in parameters)


def zip_damage(path: Path) -> str | None:
    """What is wrong with a torch checkpoint file, a zip whose every record carries the CRC-32 of its
    bytes; None when each reads back as written. torch.load checks none of them: a flipped byte in a
    tensor loads without a word (and a file cut short fails as "failed reading zip archive")."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every record and compares its CRC-32
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, struct.error) as exc:
        return f"{path.name} is not a whole checkpoint file ({type(exc).__name__}: {exc})"
    if bad is not None:
        return f"the bytes of {bad} in {path.name} differ from the ones it was written with (CRC-32)"
    return None


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Onto the host, whatever the job's device: load_state_dict moves each state tensor to its
    parameter's device but keeps `step` where the file was loaded, and Adam's family reads a `step`
    on the GPU with `.item()` per parameter per step (a host sync each). Loaded onto the GPU, every
    step after the first checkpoint ran slower than the ones before it, and the loaded copies (and
    the twin's) took GPU memory."""
    loaded: dict[str, Any] = load_as_a_user_loads(path, "cpu")
    return loaded


def load_as_a_user_loads(path: Path, map_location: Any = "cpu") -> Any:
    """`torch.load(weights_only=True)`, torch's default since 2.6. A refusal names every type in the
    file that torch loads only once allowed, and the two ways out: plain values, or allowing them."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = _refused_globals(path)
        if not refused:
            raise StateNotRestored(
                f"torch.load(weights_only=True) refuses the saved state: {_unpickling_reason(exc)}",
                fix=PLAIN_STATE_FIX,
            ) from exc
        own = [name.rpartition(".")[2] for name in refused if _of_a_package_of_its_own(name)]
        allow = (
            "; or, for types that must stay (an enum or a config class of your own), allow them once where "
            f"the class is defined: torch.serialization.add_safe_globals([{', '.join(own)}])"
        )
        raise StateNotRestored(
            "torch.load(weights_only=True) refuses the saved state: it holds "
            f"{'a type' if len(refused) == 1 else f'{len(refused)} types'} torch loads only once allowed: "
            f"{', '.join(refused)}",
            fix=PLAIN_STATE_FIX + (allow if own else ""),
        ) from exc


PLAIN_STATE_FIX = (
    "keep only tensors, numbers, strings, None and lists/tuples/dicts of them in self.state and "
    "param_groups (no custom classes, deques, numpy objects or functions)"
)


def _of_a_package_of_its_own(name: str) -> bool:
    """A type from neither Python's library nor numpy and the frameworks (a deque or an ndarray is
    better kept as a tensor or a list than allowed): the optimizer package's own, or another's."""
    package = name.split(".")[0]
    return package not in sys.stdlib_module_names and package not in (*FRAMEWORK_PACKAGES, "numpy")


def _refused_globals(path: Path) -> list[str]:
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # not a zip checkpoint, or unreadable: the unpickler's own words then
        return []


def restore(checkpoint: Mapping[str, Any], fresh: TrainObjects) -> TrainObjects:
    """Load a checkpoint into freshly built objects (optimizer before scheduler)."""
    for name, part in fresh.parts().items():  # in order: the optimizer before the scheduler
        part.load_state_dict(checkpoint[name])
    set_rng_state(checkpoint["rng"])
    return fresh


# Why a state tensor kept in a dtype of its own comes back in another (ProdigyPlusScheduleFree keeps
# its `p0` in bfloat16 beside float32 parameters), and what to do about it.
SETSTATE_SAID = (
    "nothing was loaded, and the class overrides __setstate__, through which load_state_dict() sets "
    "the state and param groups"
)
SETSTATE_FIX = "call super().__setstate__(state) in __setstate__ (then fill in what older saves lack)"


LOAD_DROPS_FIX = {
    "load_state_dict": "keep every key super().load_state_dict(state_dict) loads into self.state[p]: change "
    "a value after it in place or replace it (a cast: state[key] = state[key].to(dtype)), never pop or "
    "delete it (a key older saves lack: fill it in, as torch's own optimizers do)",
    "__setstate__": "call super().__setstate__(state) and keep every key of self.state[p] it sets: fill in "
    "what older saves lack, never pop or delete a saved key",
}


def _own_load_overrides(cls: type) -> list[str]:
    """The class's own load methods (its package's, not torch's), load_state_dict first."""
    own = user_classes(cls)
    return [name for name in ("load_state_dict", "__setstate__") if any(name in vars(k) for k in own)]


def dropped_by_load(saved: Any, restored: Any) -> StateDifference | None:
    """Keys of a parameter's entry that the `saved` state_dict holds and the live state of the optimizer
    it was loaded into lacks, where the class overrides load_state_dict() or __setstate__ (through which
    torch's load sets the state): torch's own load keeps every key, so the override dropped them, and
    is the method at fault. None otherwise."""
    overrides = _own_load_overrides(type(restored))
    state = saved.get("state") if isinstance(saved, Mapping) else None
    if not overrides or not isinstance(state, Mapping):
        return None
    params = [p for group in restored.param_groups for p in group["params"]]
    keys = []
    for index, entry in state.items():
        if not isinstance(index, int) or not isinstance(entry, Mapping) or not 0 <= index < len(params):
            continue
        live = _state_entry(restored, params[index])
        if isinstance(live, Mapping) and live:  # an entry loaded, short of keys the save holds
            keys += [f"state[param {index}][{key!r}]" for key in entry if key not in live]
    if not keys:
        return None
    methods, them = _dropping(saved, restored, overrides), "it" if len(keys) == 1 else "them"
    return StateDifference(
        f"the saved state_dict holds {', '.join(keys[:4])}, and the optimizer it was loaded into lacks "
        f"{them}: the class's own {' or '.join(f'{m}()' for m in methods)} drops {them} as it loads",
        fix="; ".join(LOAD_DROPS_FIX[m] for m in methods),
        method=methods[0],
    )


def _dropping(saved: Any, restored: Any, overrides: list[str]) -> list[str]:
    """Which of the class's own load methods drops a saved key: where it defines both, torch's
    load_state_dict() is run on a copy, through the class's __setstate__ alone: a key lost there is
    __setstate__'s, else load_state_dict()'s; both where that cannot be run."""
    if len(overrides) < 2:
        return overrides
    try:
        probe = copy.deepcopy(restored)
        torch.optim.Optimizer.load_state_dict(probe, saved)
        params = [p for group in probe.param_groups for p in group["params"]]
        kept = all(
            key in (_state_entry(probe, params[index]) or {})
            for index, entry in saved["state"].items()
            if isinstance(index, int) and isinstance(entry, Mapping) and 0 <= index < len(params)
            for key in entry
        )
    except Exception:
        return overrides
    return ["load_state_dict"] if kept else ["__setstate__"]


def _setstate_loads_nothing(saved: Any, restored: Any) -> bool:
    """A restored optimizer with no state at all where the saved one has some, whose class overrides
    __setstate__: an override that never calls super().__setstate__ drops everything loaded."""
    own = getattr(type(restored), "__setstate__", None) is not torch.optim.Optimizer.__setstate__
    return own and not restored.state and bool(saved.state)


LOAD_CASTS_STATE = (
    "torch's load_state_dict casts each state tensor (but `step`) of a floating-point parameter to that "
    "parameter's dtype, integer ones too"
)
KEEP_STATE_DTYPE_FIX = (
    "cast such state back to its own dtype after loading (Optimizer.register_load_state_dict_post_hook, "
    "or load_state_dict overridden), or keep it in its parameter's dtype"
)


def first_difference(saved: Any, loaded: Any, where: str, _seen: frozenset[int] = frozenset()) -> str | None:
    """Describe the first place two state trees differ, or None when bitwise equal."""
    if isinstance(saved, torch.Tensor) or isinstance(loaded, torch.Tensor):
        return _tensor_difference(saved, loaded, where)
    if type(saved) is type(loaded) and equal_only_to_itself(saved):
        # An object of the class's own in its state (SINGD's `DenseMatrix` Kronecker factors), which
        # == compares by identity: a reload rebuilds it, so what it holds is compared.
        if id(saved) in _seen:  # objects that hold each other: compared once
            return None
        return first_difference(vars(saved), vars(loaded), f"{where}.__dict__", _seen | {id(saved)})
    if isinstance(saved, Mapping) and isinstance(loaded, Mapping):
        # A loader may fill in bookkeeping the saved state lacked (Adafactor8Bit's `m_quant_type`
        # string, set to its default): a key holding no tensor that only the reload has is no state
        # lost, and the step after the reload, which the callers compare too, shows whether it acts.
        extra = sorted(_key_name(k) for k in set(loaded) - set(saved) if _holds_a_tensor(loaded[k]))
        missing = sorted(map(_key_name, set(saved) - set(loaded)))
        if missing or extra:
            return f"{where}: keys differ (missing after reload: {missing}, unexpected: {extra})"
        for key in saved:
            found = first_difference(saved[key], loaded[key], f"{where}[{key!r}]", _seen)
            if found:
                return found
        return None
    if isinstance(saved, Sequence) and not isinstance(saved, str):
        if not isinstance(loaded, Sequence) or len(saved) != len(loaded):
            return f"{where}: {saved!r} saved, {loaded!r} after reload"
        for index, (a, b) in enumerate(zip(saved, loaded, strict=True)):
            found = first_difference(a, b, f"{where}[{index}]", _seen)
            if found:
                return found
        return None
    if saved != loaded and not _both_nan(saved, loaded):
        return f"{where}: {saved!r} saved, {loaded!r} after reload"
    return None


def _key_name(key: Any) -> str:
    """A key as a difference names it: a tensor key (Mechanic keys a dict of its state by the
    parameters themselves, which a reload copies) by its kind and shape, not its values."""
    if isinstance(key, torch.Tensor):
        return f"<{type(key).__name__} of shape {tuple(key.shape)}>"
    return str(key)


def _holds_a_tensor(value: Any) -> bool:
    return next(_tensors_in("", value), None) is not None


def _storages(variables: Sequence[Any]) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in variables}


def _same_memory(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors the same values: views of one flat buffer at different offsets are not."""
    return (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))


def _in_storages(tensor: torch.Tensor, storages: set[int]) -> bool:
    """Whether a non-empty tensor shares its storage with one of the parameters `storages` names."""
    return bool(tensor.numel()) and tensor.untyped_storage().data_ptr() in storages


def verify_roundtrip(
    original: TrainObjects,
    reloaded: TrainObjects,
    twin: TrainObjects,
    probe: Callable[[TrainObjects], None],
    before: Mapping[str, Any] | None = None,
) -> str | None:
    """Raise CheckpointMismatch unless `reloaded` equals `original` in every way that matters.

    `twin` is a second, independent reload of the same checkpoint. The probe step is
    taken by `original` and by `twin` (both are used up by it: continue from
    `reloaded`), so no object has to be copied: copying would go through
    `Optimizer.__getstate__` and drop exactly the attributes the probe is meant to see.

    Returns a warning where the probe step ran an op with no deterministic implementation and the
    two steps differ only by as much as such an op explains (verify_next_step; `before`: the saved
    model state, which sizes that difference).
    """
    verify_state(original, reloaded)
    ran: list[str] = []
    for objects in (original, twin):
        ran += [op for op in take_probe_step(objects, probe) if op not in ran]
    return verify_next_step(original, twin, ran=ran, before=before)


def verify_state(original: TrainObjects, reloaded: TrainObjects) -> None:
    """Every part's state_dict() reloads bitwise."""
    for name, part in original.parts().items():
        saved, loaded = _state_dict(part), reloaded.parts()[name]
        found = first_difference(saved, _state_dict(loaded), name)
        if not found:
            continue
        dropped = dropped_by_load(saved, loaded) if name == "optimizer" else None
        if dropped is not None:  # the class's own load method, named with its line and fix
            found += (
                f": {dropped.detail} (at {_method_line(type(loaded), dropped.method)}). Fix: {dropped.fix}"
            )
        raise CheckpointMismatch(f"checkpoint round-trip lost state: {found}")


def _method_line(cls: type, method: str | None) -> str:
    """`file:line` of `cls`'s `method`, or the class's name where it cannot be read."""
    with suppress(OSError, TypeError):
        function = inspect.unwrap(getattr(cls, method or "__init__"))
        return f"{inspect.getsourcefile(function)}:{inspect.getsourcelines(function)[1]}"
    return f"{cls.__qualname__}.{method}"


def holds_a_rate(group: Mapping[str, Any]) -> bool:
    """A param group with a rate a schedule can scale: an `lr` that is not None (A2Grad and
    Adafactor's relative step keep `lr: None`, which LambdaLR multiplies and fails on)."""
    return group.get("lr") is not None


def schedule_unreachable(optimizer: Any, lr_arg: str) -> ScheduleUnreachable | None:
    """Why no LRScheduler can set this optimizer's rate: a param group without `lr`, the key every
    torch scheduler (and so every job's schedule) sets, and which LambdaLR refuses to start without."""
    groups = [i for i, group in enumerate(optimizer.param_groups) if not holds_a_rate(group)]
    if not groups:
        return None
    group = optimizer.param_groups[groups[0]]
    if "lr" in group:  # None: the class computes its own step size (A2Grad, Adafactor's relative step)
        return ScheduleUnreachable(
            f"param_groups[{groups[0]}] holds 'lr': None: the class computes its own step size, so no "
            "schedule has a rate to scale",
            fix="use the constant schedule, or give the class a rate (optimizer.params.lr) if it takes one",
        )
    held = f"its rate as {lr_arg!r}" if lr_arg in group else "no rate at all"
    return ScheduleUnreachable(
        f"param_groups[{groups[0]}] holds {held} and no 'lr', the key every torch LR scheduler sets "
        f"(LambdaLR, CosineAnnealingLR, optlab's schedules): no schedule can reach this class "
        f"(group keys: {', '.join(sorted(k for k in group if k != 'params'))})",
        fix="keep the rate in each param group as 'lr' (torch's convention, whatever the constructor "
        "argument is called) and read group['lr'] at every step",
    )


def restore_a_zero_rate(optimizer: Any) -> None:
    """Each group's initial rate where its schedule has brought the rate to 0 (cosine does, after
    the last step): a rate no training step takes, which the probe after the last checkpoint would
    otherwise step at. A zero-rate step proves less, and a line search divides by the zero-length
    interval it brackets (torch's LBFGS with `line_search_fn="strong_wolfe"`: ZeroDivisionError)."""
    for group in optimizer.param_groups:
        rate, initial = group.get("lr"), group.get("initial_lr")  # LambdaLR keeps `initial_lr`
        if rate is None or initial is None or float(rate) != 0.0:
            continue
        if isinstance(rate, torch.Tensor):  # torchao's tensor rate: in place, as an LRScheduler sets it
            rate.fill_(float(initial))
        else:
            group["lr"] = initial


def take_probe_step(objects: TrainObjects, probe: Callable[[TrainObjects], None]) -> list[str]:
    """One `probe` step from the random state as it is, which is then put back: the step training
    takes next draws the same numbers. Returns the ops it ran that torch says have no deterministic
    implementation (make_deterministic's warn_only lets them run, nondeterministically, on CUDA)."""
    rng = rng_state()
    with nondeterministic_ops() as ran:
        probe(objects)
    set_rng_state(rng)
    return ran


# torch's own words (ATen's Context::alertNotDeterministic, torch._prims_common.alert_not_deterministic)
# when `use_deterministic_algorithms(True, warn_only=True)` lets an op without a deterministic
# kernel run: "<op> does not have a deterministic implementation, but you set ...", a UserWarning.
NONDETERMINISTIC_OP = re.compile(r"^(?P<op>\S.*?) does not have a deterministic implementation")


@contextmanager
def nondeterministic_ops() -> Iterator[list[str]]:
    """The ops torch warns, inside, have no deterministic implementation (each named once). Every
    warning is recorded, then issued again as it came, the first time only (so the caller's filters
    see each, and a job's log does not repeat it at every checkpoint)."""
    ran: list[str] = []
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # a warning already shown once must still be counted
            yield ran
    finally:  # a probe that raises still passes its warnings on
        for warning in caught:
            named = NONDETERMINISTIC_OP.match(str(warning.message))
            if named and issubclass(warning.category, UserWarning) and named["op"] not in ran:
                ran.append(named["op"])
            # Not a registry for warn_explicit: every catch_warnings exit resets registries.
            seen = (str(warning.message), warning.category, warning.filename, warning.lineno)
            if seen not in _REISSUED:
                _REISSUED.add(seen)
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


_REISSUED: set[tuple[str, type[Warning], str, int]] = set()


# How far apart two steps that ran a nondeterministic op may be, as a fraction of the step itself
# (each parameter's change over the step; an optimizer state tensor's own size): beyond this, the
# difference is state the reload lost, not the op. Such an op (an atomic-add reduction on CUDA) sums
# in a varying order: float32 steps then differ by about sqrt(n)*2^-24 of their size (1e-5 for a
# million terms), bfloat16 ones by up to about 1e-2, and an Adam-like update that divides by
# near-zero second moments can flip the sign of a few entries (2*sqrt(fraction flipped)). A lost
# momentum buffer (or any state the step reads) changes the step by a large part of itself: 0.9 of
# it for momentum 0.9 after a few steps, about half after one. 0.1 stays above the noise with room
# and below lost state, so a lost buffer still fails while a nondeterministic op runs; in between,
# the comparison is called inconclusive and says how large the difference was, never passed silently.
NONDETERMINISM_BOUND = 0.1


def verify_next_step(
    uninterrupted: TrainObjects,
    reloaded: TrainObjects,
    *,
    ran: Sequence[str] = (),
    before: Mapping[str, Any] | None = None,
) -> str | None:
    """After the same step from the saved state and from the reloaded one, the two agree: what
    state_dict() does not hold (an attribute the step reads) shows here.

    Bitwise, unless the step `ran` ops with no deterministic implementation (take_probe_step): then
    a difference up to NONDETERMINISM_BOUND of the step (the model's change from `before`, its saved
    state; optimizer state tensors against their own size) proves nothing either way, and what is
    returned says so, instead of blaming state_dict() for the device's nondeterminism."""
    differences = []
    for name, saved, loaded, start in (
        ("model", uninterrupted.model.state_dict(), reloaded.model.state_dict(), before),
        ("optimizer", _state_dict(uninterrupted.optimizer), _state_dict(reloaded.optimizer), None),
    ):
        found = first_difference(saved, loaded, name)
        if found:
            differences.append((name, saved, loaded, start, found))
    if not differences:
        lost = None if ran else left_out_state_difference(uninterrupted.optimizer, reloaded.optimizer)
        if lost:
            raise CheckpointMismatch(lost)
        return None
    found = differences[0][-1]
    blame = (
        "after reloading the checkpoint, the next step differs from the uninterrupted one: "
        f"{found}. The optimizer keeps state that state_dict() does not save "
        "(keep per-parameter state in self.state[p] and hyperparameters in param_groups)"
    )
    if not ran:  # a deterministic step: any bit that differs is state the reload lost
        raise CheckpointMismatch(blame)
    ops = ", ".join(ran)
    sized = [
        _relative_difference(saved, loaded, start, name) for name, saved, loaded, start, _ in differences
    ]
    if any(size is None for size in sized):  # keys, dtypes or plain values: no op explains those
        raise CheckpointMismatch(
            f"{blame}; the step ran {ops} (no deterministic implementation), which "
            "changes values, not what the state holds"
        )
    where, size = max((s for s in sized if s is not None), key=lambda s: s[1])
    if size > NONDETERMINISM_BOUND:
        raise CheckpointMismatch(
            f"{blame}; the step ran {ops} (no deterministic implementation on this device), but the "
            f"two steps differ at {where} by {size:.3g} of the step, far more than such an op's "
            f"rounding ({NONDETERMINISM_BOUND:g} at most)"
        )
    return (
        f"the checkpoint's probe step was inconclusive: it ran {ops} (no deterministic implementation "
        f"on this device), and the steps from the saved and from the reloaded objects differ by up "
        f"to {size:.3g} of the step (at {where}; first: {found}), within such an op's rounding; "
        "state_dict() itself reloaded bitwise"
    )


def _saved_by_an_override(optimizer: Any, part: str) -> Any:
    """`part` of what an overridden state_dict() saves; None where torch's own saves (every key: only
    an override can leave one out) or the save fails (reported where it is made)."""
    if getattr(type(optimizer), "state_dict", None) is torch.optim.Optimizer.state_dict:
        return None
    try:
        return saved_state_dict(optimizer)[0].get(part)
    except Exception:
        return None


def keys_left_out_of_save(optimizer: Any) -> list[tuple[int, Any]]:
    """(parameter index, key) of each `optimizer.state[p]` entry that an overridden state_dict() leaves
    out of the entry it saves for p. torch's own state_dict() saves every key: only an override can
    leave one out, and it is judged only where the override saves the parameter's entry at all (a
    wrapper may save its own state elsewhere, under keys of its own)."""
    saved = _saved_by_an_override(optimizer, "state")
    if not isinstance(saved, Mapping):
        return []
    left, states = [], _states_by_identity(optimizer)
    for index, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        live, kept = states.get(id(param)), saved.get(index)
        if isinstance(live, Mapping) and isinstance(kept, Mapping) and kept:
            left += [(index, key) for key in live if key not in kept]
    return left


def group_keys_left_out_of_save(optimizer: Any) -> list[tuple[int, str]]:
    """(group index, key) of each param-group key that an overridden state_dict() leaves out of the
    groups it saves (heavyball's drops every `_` key, its per-step caches). torch's own state_dict()
    saves every key: only an override can leave one out."""
    saved = _saved_by_an_override(optimizer, "param_groups")
    if not isinstance(saved, Sequence) or len(saved) != len(optimizer.param_groups):
        return []
    return [
        (index, key)
        for index, (live, kept) in enumerate(zip(optimizer.param_groups, saved, strict=True))
        if isinstance(kept, Mapping)
        for key in live
        if key != "params" and key not in kept
    ]


def left_out_state_difference(uninterrupted: Any, reloaded: Any) -> str | None:
    """Where, after the same step from the saved and from the reloaded objects, state that the class's
    state_dict() leaves out still differs (keys_left_out_of_save), or None.

    The probe step's own comparison misses such state where the step does not read it: a Lookahead
    written as its paper's reference code keeps its slow weights in self.state but saves only its
    inner optimizer, and reads them every k steps; a resumed job pulled its weights back toward the fresh
    model's (0.28 accuracy against 0.84 without checkpoints) while every checkpoint read ok. An entry
    the reload does not have at all is not judged (a cache the class rebuilds when it needs it)."""
    params = [p for group in uninterrupted.param_groups for p in group["params"]]
    reloaded_params = [p for group in reloaded.param_groups for p in group["params"]]
    states, reloaded_states = _states_by_identity(uninterrupted), _states_by_identity(reloaded)
    for index, key in keys_left_out_of_save(uninterrupted):
        kept = reloaded_states.get(id(reloaded_params[index])) if index < len(reloaded_params) else None
        if not isinstance(kept, Mapping) or key not in kept:
            continue
        where = f"optimizer.state[param {index}][{_key_name(key)!r}]"
        found = first_difference(states[id(params[index])][key], kept[key], where)
        if found:
            return (
                f"checkpoint round-trip lost state: {where} is left out of what the optimizer's "
                f"state_dict() saves, and after the next step from the saved and from the reloaded "
                f"objects it still differs ({found}): a resumed job goes on from other state than it "
                "saved. Return every key of self.state[p] from state_dict() (torch's own does) and take it "
                "back in load_state_dict()"
            )
    return None


def _relative_difference(
    saved: Any, loaded: Any, before: Mapping[str, Any] | None, where: str
) -> tuple[str, float] | None:
    """The largest difference between two state trees that differ only in tensor values, as a
    fraction of the step (see NONDETERMINISM_BOUND), and where; None if they differ otherwise."""
    a, b = dict(_leaves(saved, where)), dict(_leaves(loaded, where))
    if a.keys() != b.keys():
        return None
    starts = dict(_leaves(before, where)) if before is not None else {}
    largest = (where, 0.0)
    for key, x in a.items():
        y = b[key]
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            if first_difference(x, y, key) is not None:
                return None
            continue
        if x.shape != y.shape or x.dtype != y.dtype or not (x.is_floating_point() or x.is_complex()):
            if first_difference(x, y, key) is not None:  # integers count, they do not round
                return None
            continue
        if _equal_or_both_nan(x.detach(), y.detach()):
            continue
        # On the tensors' own device, one tensor at a time, at least in float32: only a few norms are
        # needed, and host copies of a whole model in float64 had cost a large one gigabytes.
        wide = torch.promote_types(x.dtype, torch.float32)
        xw, yw = x.detach().to(wide), y.detach().to(wide)
        start = starts.get(key)
        if isinstance(start, torch.Tensor) and start.shape == x.shape:  # a parameter: its step
            sw = start.detach().to(device=x.device, dtype=wide)
            # Or one rounding of the values themselves, where the step is smaller than that (a
            # low-precision parameter that barely moves): a last bit rounded the other way is no loss.
            rounding = torch.finfo(x.dtype).eps * max(_norm2(xw), _norm2(yw))
            scale = max(_norm2(xw - sw), _norm2(yw - sw), rounding)
        else:  # an optimizer state tensor: its own size
            scale = max(_norm2(xw), _norm2(yw))
        gap = _norm2(xw - yw)  # NaN where only one holds NaN: inf, beyond any rounding
        size = gap / scale if scale and math.isfinite(gap) else math.inf
        if size > largest[1]:
            largest = (key, size)
    return largest


def _norm2(tensor: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(tensor).nan_to_num(nan=math.inf).item())


def _leaves(tree: Any, where: str) -> Iterator[tuple[str, Any]]:
    """Each value in nested dicts, lists and tuples, by the path first_difference names it with."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _leaves(value, f"{where}[{key!r}]")
    elif isinstance(tree, list | tuple):
        for index, value in enumerate(tree):
            yield from _leaves(value, f"{where}[{index}]")
    else:
        yield where, tree


def _recast_effect(saved: torch.Tensor, loaded: torch.Tensor) -> str:
    """What a state tensor recast to its parameter's dtype does after a resume: floating-point state
    in another precision makes the steps round otherwise; integer state keeps its values (a count
    within float's exact range), only its type changes."""
    if not saved.is_floating_point() and loaded.is_floating_point():
        exact = round(2 / torch.finfo(loaded.dtype).eps)  # every whole number up to 2**(mantissa + 1)
        return (
            f"integer state comes back as {loaded.dtype}, exact for whole numbers up to {exact:,} only, "
            "and code that indexes with it or checks its type meets a float"
        )
    return (
        "state kept in another dtype comes back in its parameter's, and the steps after a resume round "
        "otherwise than uninterrupted ones"
    )


def _tensor_difference(saved: Any, loaded: Any, where: str) -> str | None:
    if not (isinstance(saved, torch.Tensor) and isinstance(loaded, torch.Tensor)):
        return f"{where}: {type(saved).__name__} saved, {type(loaded).__name__} after reload"
    if saved.shape != loaded.shape or saved.dtype != loaded.dtype:
        # A floating-point tensor of the same shape is torch's cast, whether or not the values survive
        # it (float64 state comes back rounded to float32; a count, exactly).
        recast = saved.shape == loaded.shape and loaded.is_floating_point() and not saved.is_complex()
        return (
            f"{where}: {saved.dtype}{list(saved.shape)} saved, "
            f"{loaded.dtype}{list(loaded.shape)} after reload"
            + (
                f", {_cast_values(saved, loaded)} ({LOAD_CASTS_STATE}: {_recast_effect(saved, loaded)})"
                if recast
                else ""
            )
        )
    if saved.is_sparse or loaded.is_sparse:
        saved, loaded = saved.to_dense(), loaded.to_dense()
    # Equal tensors, the common case, in one call that copies nothing; only a mismatch (or NaN,
    # which torch.equal never calls equal) pays for the NaN-aware comparison below.
    if saved.device == loaded.device and torch.equal(saved, loaded):
        return None
    a, b = saved.detach().cpu(), loaded.detach().cpu()
    if _equal_or_both_nan(a, b):
        return None
    if a.is_complex():
        diff = (a.to(torch.complex128) - b.to(torch.complex128)).abs().nan_to_num(nan=math.inf).max().item()
    elif a.is_floating_point():
        diff = (a.double() - b.double()).abs().nan_to_num(nan=math.inf).max().item()
    else:
        diff = (a.long() - b.long()).abs().max().item()
    return f"{where}: max abs difference {diff:.3g}"


def _cast_values(saved: torch.Tensor, loaded: torch.Tensor) -> str:
    """What a cast did to a state tensor's values (an integer count comes back as a float, exact;
    float64 state, rounded), NaN equal to NaN."""
    a, b = saved.detach().cpu().double(), loaded.detach().cpu().double()
    if _equal_or_both_nan(a, b):
        return "the same values"
    difference = (a - b).abs().nan_to_num(nan=math.inf).max().item()
    return f"its values rounded by up to {difference:.3g}"


def _equal_or_both_nan(a: Any, b: Any) -> bool:
    """Element-wise equal, NaN counting as equal to NaN (which torch.equal never does)."""
    inexact = a.is_floating_point() or a.is_complex()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b)) if inexact else a == b
    return bool(same.all())


def _both_nan(a: Any, b: Any) -> bool:
    return isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)


# -- the driver -----------------------------------------------------------------------------------------


CHECK_SEED = 0
DDP_TIMEOUT_S = 120  # a rank waiting this long for the others in a collective fails the job


class TorchDriver(Driver):
    style: ClassVar[str] = "torch"
    framework: ClassVar[str] = "torch"
    capabilities: ClassVar[Capabilities] = Capabilities(
        closure=True,
        param_groups=True,
        resume=True,
        refuses_negative_lr=True,
        sums_repeated_rows=True,
        rebuilt_from_constructor=True,
    )
    fresh_module: ClassVar[str] = "jobs.checks.fresh.torch_child"
    # Where `variables()` makes the checks' tensors while `accelerator()` is entered; None: the default.
    accelerator_device: torch.device | None = None
    advice: ClassVar[Advice] = Advice(
        update_method="step",
        in_place_update="update every parameter that has a gradient, in place (p.add_(update, alpha=-lr)), "
        "never by rebinding a name (p = p - lr * g) or skipping some parameters",
        skip_none_grad="skip parameters without a gradient in step(): `if p.grad is None: continue`",
        finite_state="guard divisions and square roots with an epsilon; start state finite (zeros, not "
        "empty)",
        untrainable_state="decorate step() with @torch.no_grad() and create state as plain tensors "
        "(torch.zeros_like(p), p.detach().clone()), never views of p or nn.Parameters",
        fast_update="update whole tensors (or torch._foreach_* lists) with no .item()/.tolist()/"
        "float(tensor) host syncs and no Python loops over rows or elements",
        fewer_passes="fuse the passes (torch._foreach_* over all parameters at once, or torch.compile of "
        "the update) and drop those the method does not need",
        sign_of_update="the update must move against the gradient (p.add_(update, alpha=-lr))",
        deprecated_call="p.add_(grad, alpha=-lr) instead of p.add_(-lr, grad)",
        sparse_update="check p.grad.is_sparse in step() and either update only the touched rows "
        "(grad.coalesce() sums repeated rows; its indices() are the rows) or raise RuntimeError('... does "
        "not support sparse gradients')",
        read_lr_each_step="read the learning rate from the group (group['lr']) inside step() at every step; "
        "never cache it (self.lr, a copy in state or in the group) in __init__ or on the first step",
        keep_hyperparameters="keep each group's hyperparameters in param_groups and let load_state_dict() "
        "restore them as saved",
        state_on_device="create state with torch.zeros_like(p) (or device=p.device), never a bare "
        "torch.zeros(shape)",
        state_on_device_after_restore="let Optimizer.load_state_dict cast state (do not override it), or "
        "move state to p.device in step()",
        state_in_checkpoint="keep per-parameter state in self.state[p] and hyperparameters in param_groups, "
        "nowhere else",
    )

    # Four 256-wide layers: an eager step pays Python overhead per tensor, so element-wise work
    # must dominate a correct step for the ratio to SGD to mean anything.
    cost_shapes: ClassVar[tuple[tuple[int, ...], ...]] = ((256, 256), (256,)) * 4

    def session(
        self, spec: JobSpec, entry: Entry, workload: Workload, workdir: Path, base: Base | None = None
    ) -> TorchSession:
        return TorchSession(spec, entry, workload, base)

    def checkpoint_damage(self, path: Path) -> str | None:
        return zip_damage(path)

    # -- what the conformance checks drive ---------------------------------------------------------------

    def random_state(self) -> bytes:
        return bytes(torch.get_rng_state().numpy().tobytes())

    @contextmanager
    def isolated(self, seed: int = CHECK_SEED) -> Iterator[None]:
        # Each check compiles afresh, as a training process would: the checks feed a class more shapes
        # and dtypes than one training run does, and one that compiles its math (Dion's
        # `torch.compile(fullgraph=True)`) would hit dynamo's recompile limit in a later check.
        dynamo = sys.modules.get("torch._dynamo")  # not imported just for this: it takes seconds
        if dynamo is not None:
            dynamo.reset()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield

    def variables(self, arrays: Sequence[np.ndarray]) -> list[nn.Parameter]:
        # On the accelerator inside `accelerator()` (which sets no default device), else on the default
        # device: the CPU, as in a job.
        device = self.accelerator_device or torch.get_default_device()
        return [nn.Parameter(torch.tensor(np.array(a, dtype=np.float32), device=device)) for a in arrays]

    def load_values(self, variables: Sequence[Any], arrays: Sequence[np.ndarray]) -> None:
        with torch.no_grad():
            for param, array in zip(variables, arrays, strict=True):
                param.copy_(torch.as_tensor(array, dtype=param.dtype, device=param.device))

    def optimizer_over(self, create: Callable[[Any], Any], variables: Sequence[Any]) -> Any:
        return create(list(variables))  # torch creates state lazily, in the first step

    def construct(self, cls: type, kwargs: Mapping[str, Any]) -> Any:
        return cls(self.variables([np.zeros((2, 2), np.float32)]), **kwargs)

    def step(
        self, optimizer: Any, variables: Sequence[Any], grads: Sequence[Gradient], needs: LoopNeeds = PLAIN
    ) -> None:
        self.to_training(optimizer, needs)
        tensors = [
            None if g is None else _torch_gradient(g).to(p.device)
            for p, g in zip(variables, grads, strict=True)
        ]
        if not (needs.closure or needs.create_graph):
            for param, grad in zip(variables, tensors, strict=True):
                param.grad = grad
            optimizer.step()
            return
        # A closure or Hessian-vector products need a loss, not just gradients: a quadratic whose
        # gradient at the current point is exactly the given one keeps every numeric expectation.
        closure = _quadratic_closure(variables, tensors, needs)
        closure()  # the gradients a training loop's backward() leaves before step() (backward_in_step: none)
        if needs.closure:
            optimizer.step(closure)
        else:
            optimizer.step()

    def to_training(self, optimizer: Any, needs: LoopNeeds = PLAIN) -> None:
        if needs.train_eval:
            mode_switch(optimizer).train()  # as a job's training step: a no-op when already training

    def to_evaluation(self, optimizer: Any, needs: LoopNeeds = PLAIN) -> str | None:
        if not needs.train_eval:
            return None
        mode_switch(optimizer).eval()  # as a job's evaluation and checkpoint (TorchSession._eval_mode)
        return "optimizer.eval()"

    def values(self, variables: Sequence[Any]) -> list[np.ndarray]:
        return [p.detach().cpu().float().numpy().copy() for p in variables]

    def optimizer_state_bytes(self, optimizer: Any) -> int:
        return optimizer_state_bytes(optimizer)

    def state(self, optimizer: Any) -> list[tuple[str, np.ndarray]]:
        return [(name, _numpy(t)) for name, t in state_tensors(optimizer)]

    def state_writes(self, optimizer: Any) -> dict[str, tuple[Any, int]]:
        # `_version` counts in-place writes; the tensor itself is kept (not its id, which a new
        # tensor may reuse), so a replaced entry is another object.
        writes = {}
        for name, tensor in state_tensors(optimizer):
            try:
                writes[name] = (tensor, tensor._version)
            except RuntimeError:  # an inference tensor (a step under inference_mode) counts no writes
                continue
        return writes

    def state_of(self, optimizer: Any, variables: Sequence[Any], index: int) -> list[np.ndarray]:
        """A tensor that other parameters' state holds too is the group's, not this parameter's:
        Distributed Shampoo keeps one step counter per group and puts that very tensor under every
        parameter, so it counts on while a parameter without a gradient is left alone."""
        param = variables[index]
        state = _state_entry(optimizer, param) or {}
        held_elsewhere = {
            _same_memory(tensor)
            for other, others_state in optimizer.state.items()
            if other is not param and isinstance(others_state, Mapping)
            for value in others_state.values()
            for _, tensor in _tensors_in("", value)
        }
        found = []
        for key in sorted(state, key=str) if isinstance(state, Mapping) else ():
            value = state[key]
            if isinstance(value, int | float) and not isinstance(value, bool):
                found.append(np.array(value))
            found.extend(
                _numpy(tensor)
                for _, tensor in _tensors_in(str(key), value)
                if _same_memory(tensor) not in held_elsewhere
            )
        return found

    def trainable_state(self, optimizer: Any, variables: Sequence[Any]) -> tuple[int, list[str], list[str]]:
        storages = _storages(variables)
        tensors = list(state_tensors(optimizer))
        offending = []
        for name, tensor in tensors:
            if isinstance(tensor, nn.Parameter):
                offending.append(f"{name} is an nn.Parameter")
            elif tensor.requires_grad:
                offending.append(f"{name} requires grad")
            elif _in_storages(tensor, storages):
                offending.append(f"{name} shares storage with a model parameter")
        return len(tensors), offending, []

    def state_left_out_of_save(self, optimizer: Any) -> list[str]:
        return [f"state[param {index}][{key!r}]" for index, key in keys_left_out_of_save(optimizer)]

    def state_keyed_off_variables(self, optimizer: Any) -> list[str]:
        # Integer keys only (`id(p)`, an index): torch's save keeps any other key as it is, and a
        # string key ("meta") comes back under its name, where the class finds it.
        return [f"int {key!r}" for key in optimizer.state if isinstance(key, int)]

    def base_init_skipped(self, error: BaseException) -> tuple[str, str] | None:
        if not never_ran_optimizer_init(error):
            return None
        return NEVER_RAN_INIT_SAID, NEVER_RAN_INIT_FIX

    def state_changed_by_save(self, optimizer: Any) -> list[str]:
        try:
            return saved_state_dict(optimizer, copy_values=True)[1]
        except Exception:  # a state_dict() that cannot run: the save itself reports it
            return []

    def config_left_out_of_save(self, optimizer: Any) -> list[tuple[int, str]]:
        return group_keys_left_out_of_save(optimizer)

    def save_overrides(self, optimizer: Any) -> list[str]:
        # The user's own (their package's): torch's SGD, Adam and AdamW define __setstate__ themselves,
        # which a subclass of them did not write and cannot be told to change.
        own = user_classes(type(optimizer))
        return [
            name
            for name in ("state_dict", "load_state_dict", "__setstate__")
            if any(name in vars(klass) for klass in own)
        ]

    def state_sharing_gradients(self, optimizer: Any, variables: Sequence[Any]) -> list[str]:
        grads = [p.grad for p in variables if p.grad is not None and p.grad.layout is torch.strided]
        storages = _storages(grads)
        return [name for name, tensor in state_tensors(optimizer) if _in_storages(tensor, storages)]

    def state_sharing_variables(self, optimizer: Any, variables: Sequence[Any]) -> list[str]:
        storages = _storages(variables)
        return [name for name, tensor in state_tensors(optimizer) if _in_storages(tensor, storages)]

    def state_shared_between(self, optimizer: Any, variables: Sequence[Any]) -> list[str]:
        entries = [_state_entry(optimizer, p) or {} for p in variables]
        if not all(isinstance(entry, Mapping) for entry in entries):
            return []

        def held(entry: Mapping[Any, Any]) -> set[tuple[Any, ...]]:
            return {_same_memory(tensor) for value in entry.values() for _, tensor in _tensors_in("", value)}

        # The very tensor (not two views of one flat buffer, which some classes keep on purpose), of the
        # parameter's own shape (a buffer kept per shape), and held by no parameter of another shape: a
        # group-level tensor every parameter holds (statistics of the whole group) is shared by design.
        shape = tuple(variables[0].shape)
        others = zip(variables[2:], entries[2:], strict=True)
        theirs = held(entries[1]).difference(*(held(entry) for p, entry in others if tuple(p.shape) != shape))
        return [
            str(key)
            for key, value in entries[0].items()
            if any(
                t.numel() > 1 and tuple(t.shape) == shape and _same_memory(t) in theirs
                for _, t in _tensors_in("", value)
            )
        ]

    def gradients_kept_by_zero_grad(
        self, optimizer: Any, variables: Sequence[Any], needs: LoopNeeds = PLAIN
    ) -> list[str]:
        if not any("zero_grad" in vars(klass) for klass in user_classes(type(optimizer))):
            return []  # torch's own clears
        calls = {"zero_grad(set_to_none=True)": True, "zero_grad(set_to_none=False)": False}
        if not _takes_set_to_none(optimizer.zero_grad):
            calls = {"zero_grad()": True}
        kept = []
        for call, set_to_none in calls.items():
            # As a loop asks it: after a step over gradients of ones, never on an optimizer that has not
            # stepped (a class may free the gradients it used in step(), or clear only the parameters it
            # holds state for; either leaves none behind in a loop).
            ones = [np.ones(tuple(p.shape), dtype=np.float32) for p in variables]
            self.step(optimizer, variables, ones, needs)
            if len(calls) > 1:
                optimizer.zero_grad(set_to_none=set_to_none)
            else:
                optimizer.zero_grad()
            if any(p.grad is not None and bool(p.grad.ne(0).any()) for p in variables):
                kept.append(call)
        for param in variables:
            param.grad = None
        return kept

    def unshare_state(self, optimizer: Any, variables: Sequence[Any]) -> int:
        storages = _storages(variables)
        copied = 0
        for state in optimizer.state.values():
            if not isinstance(state, MutableMapping):
                continue
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and _in_storages(value, storages):
                    state[key] = value.detach().clone()
                    copied += 1
        return copied

    def scheduled(
        self, create: Callable[[Any, Any], Any], variables: Sequence[Any], rates: Sequence[float], lr_arg: str
    ) -> tuple[Any, Callable[[int], None]]:
        optimizer = create(list(variables), None)
        unreachable = schedule_unreachable(optimizer, lr_arg)
        if unreachable is not None:
            raise unreachable

        def before_step(step: int) -> None:
            self.set_learning_rate(optimizer, rates[step], lr_arg)

        return optimizer, before_step

    def set_learning_rate(self, optimizer: Any, rate: float, lr_arg: str) -> None:
        for group in optimizer.param_groups:  # what an LRScheduler does: a tensor rate (torchao's) in place
            # `lr`, as every LRScheduler writes it, whatever the constructor calls it (a port from
            # Keras takes `learning_rate` and stores `lr`); the argument's name where the group has no
            # `lr`, or none at all in a class that never reads it (A2Grad).
            key = "lr" if "lr" in group else lr_arg
            current = group.get(key)
            if isinstance(current, torch.Tensor):
                current.fill_(rate)
            else:
                group[key] = rate

    @property
    def schedule_name(self) -> str:
        return "a schedule setting each param group's lr before each step (as an LRScheduler does)"

    @property
    def config_name(self) -> str:
        return "param_groups"

    def config(self, optimizer: Any) -> list[dict[str, Any]]:
        # A dunder key is Python's, not a hyperparameter: heavyball builds its defaults from locals(),
        # so its groups hold `__class__`, which its own state_dict() writes as None.
        return [
            {
                k: v
                for k, v in group.items()
                if k != "params" and not (k.startswith("__") and k.endswith("__"))
            }
            for group in optimizer.param_groups
        ]

    @property
    def config_roundtrip_name(self) -> str:
        return "state_dict() -> load_state_dict()"

    def config_roundtrip(self, optimizer: Any, fresh: Callable[[], Any]) -> list[dict[str, Any]]:
        reloaded = fresh()
        reloaded.load_state_dict(_state_dict(optimizer))
        return self.config(reloaded)

    @property
    def sparse_gradient_name(self) -> str:
        return "nn.Embedding(sparse=True)"

    @contextmanager
    def densifying(self, shape: tuple[int, ...], files: set[str]) -> Iterator[list[str]]:
        lines: list[str] = []
        watch = _Densifying(tuple(shape), files)
        try:
            with watch:
                yield lines
        finally:
            lines.extend(line for line in watch.lines if line not in watch.flattened)

    def refusal_files(self, cls: type) -> set[str]:
        return source_files(cls) | set(_files_under(Path(torch.optim.__file__).parent))

    def unmet_need(self, error: BaseException) -> str | None:
        frame = raising_frame(error)
        raised_under = Path(frame.filename).parents if frame is not None else ()
        if _DISTRIBUTED_FILES in raised_under and "process group" in str(error).lower():
            return (
                "a distributed process group (it is written for data-parallel training, and the checks run "
                "it in one process)"
            )
        if _CUDA_FILES in raised_under and not torch.cuda.is_available():
            # torch.cuda's own refusal ("Torch not compiled with CUDA enabled", "Found no NVIDIA
            # driver"): a step that synchronises with the GPU or puts state there (GaLore's AdamW8bit).
            return "a CUDA device (torch.cuda.is_available() is False here)"
        if _names_an_accelerator(error, frame) and not torch.cuda.is_available():
            # The class's own refusal of this machine, in its words (torchao's CPUOffloadOptimizer:
            # `assert self.device in ["cuda", "xpu"], "CPU Offload currently only supports CUDA & XPU"`).
            return "a GPU, which its own error names (torch.cuda.is_available() is False here)"
        devices = _devices_torch_requires(error)
        if devices is not None:
            # capturable=True: torch's kernels keep the step count on the device for CUDA graphs, and
            # assert the parameters are on one that supports it, which the CPU is not.
            return f"tensors on {' or '.join(devices)} (torch's kernels refuse the CPU the checks run on)"
        return None

    def accelerator(self, device: str = "cuda") -> AbstractContextManager[Any] | None:
        """A scope in which `variables()` are made on `device` (CUDA; a test stands 'meta' in for it),
        and nothing else: no default device. A torch job moves its model with `model.to(device)` and
        never sets one, so the optimizer it builds and steps makes a bare `torch.zeros(p.shape)` on the
        CPU; under `with torch.device("cuda")` that state would land on the GPU, and device_placement
        would pass the very fault it is there to catch."""
        if device == "cuda" and not torch.cuda.is_available():
            return None

        @contextmanager
        def variables_on_device() -> Iterator[None]:
            previous, self.accelerator_device = self.accelerator_device, torch.device(device)
            try:
                yield
            finally:
                self.accelerator_device = previous

        return variables_on_device()

    @property
    def no_accelerator(self) -> str:
        return "needs a CUDA device; torch.cuda.is_available() is False here"

    def misplaced_state(self, optimizer: Any, variables: Sequence[Any]) -> list[str]:
        """Per-parameter state on another device than its parameter, held in lists and dicts too (SOAP's
        per-dimension `Q`, a history of gradients): a bare torch.zeros there lands on the CPU alike."""
        found = []
        for param, state in optimizer.state.items():
            if not isinstance(param, torch.Tensor) or not isinstance(state, Mapping):
                continue  # state kept under another key than a parameter has no device to match
            for key, value in state.items():
                for name, tensor in _tensors_in(repr(key), value):
                    # torch keeps scalar step counters on the CPU on purpose (capturable=False).
                    if tensor.device != param.device and tensor.dim() > 0:
                        found.append(f"{name} on {tensor.device}, parameter on {param.device}")
        return found

    @property
    def state_format(self) -> str:
        return "state_dict -> torch.save -> torch.load(weights_only=True)"

    def save_state(self, optimizer: Any, variables: Sequence[Any], folder: Path) -> Any:
        path = folder / "optimizer_state.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(_state_dict(optimizer), path)
        return path

    def restore_state(self, optimizer: Any, variables: Sequence[Any], saved: Any) -> None:
        optimizer.load_state_dict(load_as_a_user_loads(saved))

    def state_difference(self, saved: Any, restored: Any) -> StateDifference | None:
        saved_state = _state_dict(saved)
        found = first_difference(saved_state, _state_dict(restored), "state_dict")
        if found is None:
            return None
        if _setstate_loads_nothing(saved, restored):
            return StateDifference(f"{found}; {SETSTATE_SAID}", fix=SETSTATE_FIX, method="__setstate__")
        dropped = dropped_by_load(saved_state, restored)
        if dropped is not None:
            return StateDifference(f"{found}: {dropped.detail}", fix=dropped.fix, method=dropped.method)
        return StateDifference(found, fix=KEEP_STATE_DTYPE_FIX if LOAD_CASTS_STATE in found else None)

    @contextmanager
    def recording_warnings(self, sink: WarningSink) -> Iterator[None]:
        """TORCH_WARN_ONCE fires once per process unless warn-always is on: on for the duration."""
        warn_always = torch.is_warn_always_enabled()
        torch.set_warn_always(True)
        try:
            with python_warnings_to(sink):
                yield
        finally:
            torch.set_warn_always(warn_always)

    def reference_sgd(self, variables: Sequence[Any]) -> Any:
        return torch.optim.SGD(list(variables), lr=1e-3, momentum=0.9)

    def reference_adamw(self, variables: Sequence[Any]) -> Any:
        return torch.optim.AdamW(list(variables), lr=1e-3)

    @property
    def reference_adamw_name(self) -> str:
        return "torch.optim.AdamW"

    def timed_update(
        self, optimizer: Any, variables: Sequence[Any], grads: Sequence[np.ndarray]
    ) -> Callable[[], Any]:
        for param, grad in zip(variables, grads, strict=True):
            param.grad = _torch_gradient(grad).to(param.device)

        def update() -> None:
            with torch.no_grad():
                optimizer.step()

        for _ in range(5):  # warm-up: state creation, allocator
            update()
        return update

    @contextmanager
    def timing(self) -> Iterator[None]:
        """One intra-op thread: on a shared CPU, a second thread waiting for a busy core adds
        milliseconds to a step at random, whichever optimizer it is."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def where_time_goes(self, slow: Callable[[], Any], reference: Callable[[], Any]) -> TimeSpent:
        events, wall_us, syncs = _aten_events(slow)
        if not events:
            return TimeSpent("no aten ops recorded")
        events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
        top = ", ".join(f"{e.key} x{e.count // PROFILED_CALLS}" for e in events[:4])
        many_syncs = syncs > 8
        sync_note = f"{syncs} host syncs (aten::item / _local_scalar_dense) per step; " if many_syncs else ""
        # Most of the step inside ops (not Python around them: a loop of small products per row is
        # slow code), and most of the ops' time in matrix math, or else in passes over whole tensors.
        op_time = sum(e.self_cpu_time_total for e in events)
        matrix_time = sum(e.self_cpu_time_total for e in events if _is_matrix_math(e.key))
        in_ops = not many_syncs and op_time > 0.5 * wall_us
        if in_ops and matrix_time > 0.5 * op_time:
            return TimeSpent(f"most time in {top}", in_matrix_math=True)
        calls = sum(e.count for e in events) // PROFILED_CALLS
        if in_ops or syncs == 0:
            reference_calls = sum(e.count for e in _aten_events(reference)[0]) // PROFILED_CALLS
            counted = f"{calls} op calls a step against the yardstick's {reference_calls}"
        if in_ops:
            return TimeSpent(f"most time in {top}; {counted}", in_tensor_ops=True)
        if syncs == 0:  # no host sync, and the ops themselves short: each op's fixed cost on small tensors
            return TimeSpent(
                f"no host syncs, and most of the step outside the ops' own work: per-op overhead on small "
                f"tensors, {counted} (most time in {top})",
                in_tensor_ops=True,
            )
        return TimeSpent(f"{sync_note}most time in {top}")

    @property
    def timed_update_name(self) -> str:
        return "step()"

    @property
    def reference_sgd_name(self) -> str:
        return "torch.optim.SGD(momentum=0.9)"


# Calls of an update profiled together: one call's split of its time between ops moves with what else
# the machine did meanwhile (a step in matrix math had once read as passes over tensors); their sum holds.
PROFILED_CALLS = 3


def _aten_events(update: Callable[[], Any]) -> tuple[list[Any], float, int]:
    """The aten ops of PROFILED_CALLS profiled calls of `update` (`count`: all of theirs, so per call
    divided by PROFILED_CALLS), their wall time in microseconds, and the host syncs a call of the
    class's own code makes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        started = time.perf_counter()
        for _ in range(PROFILED_CALLS):
            update()
        wall_us = (time.perf_counter() - started) * 1e6
    own_syncs = sum(1 for event in profiler.events() if _own_host_sync(event)) // PROFILED_CALLS
    return [e for e in profiler.key_averages() if e.key.startswith("aten::")], wall_us, own_syncs


_HOST_SYNCS = frozenset({"aten::item", "aten::_local_scalar_dense"})


def _own_host_sync(event: Any) -> bool:
    """A host sync the class's code asked for: counted once (aten::item calls _local_scalar_dense), and
    not one a linear-algebra op makes itself (on the CPU each torch.linalg.eigh, inv, cholesky, svd
    reads its LAPACK info with aten::item to raise on failure: the decomposition's, not the class's)."""
    if event.name not in _HOST_SYNCS:
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in _HOST_SYNCS or _is_linear_algebra(parent.name):
            return False
        parent = parent.cpu_parent
    return True


# Matrix products, decompositions and solves: what a preconditioner (Shampoo, Muon's Newton-Schulz
# iteration, Kron's triangular solves) spends its time on by design. Norms are not among them.
_MATRIX_PRODUCTS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "mv", "addmv"})
_DECOMPOSITIONS = frozenset(
    {"svd", "qr", "cholesky", "cholesky_solve", "cholesky_inverse", "triangular_solve"}
)


def _is_linear_algebra(op: str) -> bool:
    """An aten linear-algebra op, its error check (aten::_linalg_check_errors) among them."""
    return op.startswith("aten::") and ("linalg" in op or _is_matrix_math(op))


def _is_matrix_math(op: str) -> bool:
    name = op.removeprefix("aten::").removesuffix("_")  # in place too: addmm_, baddbmm_
    if name.startswith(("linalg_", "_linalg_")):
        return "norm" not in name
    return name in _MATRIX_PRODUCTS or name in _DECOMPOSITIONS


# Where torch.distributed raises "Default process group has not been initialized".
_DISTRIBUTED_FILES = Path(torch.__file__).parent / "distributed"
# Where torch.cuda refuses a call on a machine without CUDA ("Torch not compiled with CUDA enabled").
_CUDA_FILES = Path(torch.__file__).parent / "cuda"
# Where torch's optimizers assert the devices an option needs ("If capturable=True, params and
# state_steps must be on supported devices: ['cuda', 'xpu', ...]").
_OPTIM_FILES = Path(torch.__file__).parent / "optim"
_SUPPORTED_DEVICES = re.compile(r"must be on supported devices: \[([^\]]*)\]")


# An accelerator named in an error's message, and words of a need ("only supports CUDA", "requires a
# GPU"): a message that only mentions a device (a shape or dtype error naming one) says no need.
_ACCELERATOR_WORDS = re.compile(r"\b(?:cuda|gpus?|xpu|nvidia)\b", re.IGNORECASE)
_NEED_WORDS = re.compile(
    r"\b(?:only|supports?|supported|requires?|required|needs?|available)\b", re.IGNORECASE
)


def _names_an_accelerator(error: BaseException, frame: Any) -> bool:
    """The error was raised in the class's code (not torch's, whose messages list devices they
    support, CPU among them) and its message names an accelerator: on a machine without one, that is
    the class saying what it needs."""
    torch_files = Path(torch.__file__).parent
    raised_in_torch = frame is not None and torch_files in Path(frame.filename).parents
    said = str(error)
    return not raised_in_torch and bool(_ACCELERATOR_WORDS.search(said) and _NEED_WORDS.search(said))


def _devices_torch_requires(error: BaseException) -> list[str] | None:
    """The devices a torch optimizer's own assertion requires, where the CPU is not one of them."""
    frame = raising_frame(error)
    found = _SUPPORTED_DEVICES.search(str(error))
    if frame is None or found is None or _OPTIM_FILES not in Path(frame.filename).parents:
        return None
    devices = re.findall(r"'([^']+)'", found.group(1))
    return devices if devices and "cpu" not in devices else None


def state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """(`state[param i][key]`, tensor) for every tensor the optimizer keeps in `self.state`, or, where
    that holds none, in what its state_dict() saves: a wrapper may keep its base's state out of its own
    (timm's Lookahead: `self.state` stays empty, state_dict() is the base's)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    own = [
        found
        for param, state in optimizer.state.items()
        if isinstance(state, Mapping)
        for key, value in state.items()
        for found in _tensors_in(f"state[param {index.get(id(param), '?')}][{key!r}]", value)
    ]
    yield from own or _saved_state_tensors(optimizer)


def _tensors_in(name: str, value: Any, depth: int = 3) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one state value: itself, or those of the lists, tuples and dicts it holds (a
    history of gradients, SOAP's per-dimension `Q` and `GG`), each named by its place."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif depth and isinstance(value, Mapping):
        for key, item in value.items():
            yield from _tensors_in(f"{name}[{key!r}]", item, depth - 1)
    elif depth and isinstance(value, list | tuple | collections.deque):
        for number, item in enumerate(value):
            yield from _tensors_in(f"{name}[{number}]", item, depth - 1)


def _saved_state_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    try:
        saved = _state_dict(optimizer).get("state", {})
    except Exception:  # a state_dict() that cannot run here is the round-trip checks' to report
        return []
    return [
        found
        for number, state in saved.items()
        if isinstance(state, Mapping)
        for key, value in state.items()
        for found in _tensors_in(f"state[param {number}][{key!r}]", value)
    ]


def _files_under(folder: Path) -> list[str]:
    return [str(path) for path in folder.rglob("*.py")]


def _unpickling_reason(error: Exception) -> str:
    """The line of torch's long weights_only message that names the refused type."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    found = re.search(r"Unsupported global: [^\n]*?(?=\. |\n|$)", plain)
    return found.group(0) if found else f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    value = tensor.detach().cpu()
    if type(value) not in (torch.Tensor, nn.Parameter) and callable(getattr(value, "dequantize", None)):
        # A quantized state tensor subclass (torchao's 8-bit, 4-bit and FP8 optimizers keep their
        # moments so for tensors of 4,096 elements or more), which refuses .numpy(): its values.
        value = value.dequantize()
    if value.is_sparse:
        value = value.to_dense()
    if value.dtype == torch.bfloat16:
        value = value.float()
    return value.numpy().copy()


def _quadratic_closure(
    variables: Sequence[Any], grads: Sequence[torch.Tensor | None], needs: LoopNeeds
) -> Callable[..., torch.Tensor]:
    """A closure over L(v) = 0.5 * sum ||v - v0 + g||^2, v0 the variables now.

    Its gradient at v0 is exactly g, its Hessian the identity (so Hessian-vector products are
    well defined), and it is never negative with minimum 0 (AliG divides by the loss). A sparse
    gradient cannot come out of the dense terms: `_sparse_quadratic` makes it, with the same rows
    (repeats kept) and values that follow the variable as the dense one does, so a class that
    evaluates the closure several times per step (LBFGS) meets the same problem either way.
    """
    given = [(p, g) for p, g in zip(variables, grads, strict=True) if g is not None]
    dense = [(p, g, p.detach().clone()) for p, g in given if not g.is_sparse]
    sparse = [(p, g, p.detach().clone()) for p, g in given if g.is_sparse]

    def closure(backward: bool = True) -> torch.Tensor:
        if backward:  # `closure(backward=False)` asks for the loss alone and leaves the gradients be
            for param in variables:
                param.grad = None  # as zero_grad(set_to_none=True) before a backward: no stale gradient
        sparse_loss = sum(
            (_sparse_quadratic(p, g, p0, needs, backward=backward) for p, g, p0 in sparse), torch.zeros(())
        )
        with torch.enable_grad():  # step(closure) may run it under torch.no_grad()
            terms = [0.5 * ((p - p0 + g.to(p.dtype)) ** 2).sum() for p, g, p0 in dense]
            loss = (
                closure_result(torch.stack(terms).sum(), needs, backward=backward)
                if terms
                else torch.zeros(())
            )
        return loss + sparse_loss

    return closure


def _sparse_quadratic(
    param: torch.Tensor,
    grad: torch.Tensor,
    start: torch.Tensor,
    needs: LoopNeeds = PLAIN,
    *,
    backward: bool = True,
) -> torch.Tensor:
    """Sets `param.grad` to the sparse gradient of 0.5 * ||v - v0 + g||^2 over g's rows, each
    repeat carrying its share of the drift, and returns that loss term. With `create_graph` the
    gradient has a graph, as `nn.Embedding(sparse=True)` gives under `backward(create_graph=True)`,
    so a Hessian-vector product can go through it; where the loss goes back with its graph
    (`closure_result`) the term carries the graph that gives that gradient, and sets nothing."""
    indices, values = grad._indices(), grad._values()
    rows = indices[0]
    repeats = torch.bincount(rows, minlength=param.shape[0])[rows].unsqueeze(1).to(values.dtype)
    touched = torch.unique(rows)
    summed = grad.coalesce().to_dense()[touched]
    value = 0.5 * ((param.detach()[touched] - start[touched] + summed) ** 2).sum()
    with_graph = needs.backward_in_step or not backward
    if needs.create_graph or with_graph:
        with torch.enable_grad():
            looked = nn.functional.embedding(rows, param, sparse=True)
            # Its gradient in each looked-up row: values + (v - v0) / repeats, as below.
            term = (values * looked).sum() + ((looked - start[rows]) ** 2 / (2 * repeats)).sum()
            if with_graph:
                return value + (term - term.detach())  # the term's value, the surrogate's gradient
            term.backward(create_graph=True)
    else:
        drift = param.detach()[rows] - start[rows]
        param.grad = torch.sparse_coo_tensor(indices, values + drift / repeats, grad.shape)
    return value


class _Densifying(TorchFunctionMode):
    """Records `file:line` (the innermost frame in `files`) of each `to_dense()` (`Tensor.to_dense`,
    `torch.Tensor.to_dense`, after `coalesce()` too) of a sparse tensor of `shape`; changes nothing.
    A line whose dense result is then flattened to one vector (`.view(-1)`) is kept apart: a method
    over all parameters as one vector (LBFGS, torchmin's BFGS) works on the whole table by design."""

    def __init__(self, shape: tuple[int, ...], files: set[str]) -> None:
        super().__init__()
        self.shape, self.files = shape, files
        self.lines: list[str] = []
        self.flattened: set[str] = set()
        self.made: dict[int, tuple[torch.Tensor, str]] = {}  # the tensor held: its id stays its own

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is None:
            return result
        if name == "to_dense" and source.layout != torch.strided and tuple(source.shape) == self.shape:
            caller = _calling_frame()
            if caller is not None and caller.filename in self.files:
                line = f"{caller.filename}:{caller.lineno}"
                self.lines.append(line)
                self.made[id(result)] = (result, line)
        elif name in ("view", "reshape", "flatten") and id(source) in self.made:
            if isinstance(result, torch.Tensor) and result.dim() == 1:
                self.flattened.add(self.made[id(source)][1])
        return result


def _calling_frame() -> traceback.FrameSummary | None:
    """The frame that called the torch function a mode is handling: the innermost outside the mode and
    torch's package (a closure of optlab's that densifies for its loss is optlab's line, not the
    class's that called the closure)."""
    torch_files = Path(torch.__file__).parent
    for frame in reversed(traceback.extract_stack()[:-1]):  # less this function's own frame
        if frame.name != "__torch_function__" and torch_files not in Path(frame.filename).parents:
            return frame
    return None


def _torch_gradient(grad: np.ndarray | SparseRows) -> torch.Tensor:
    if isinstance(grad, SparseRows):
        indices = torch.tensor([grad.rows], dtype=torch.int64)
        values = torch.from_numpy(np.array(grad.values, dtype=np.float32))
        return torch.sparse_coo_tensor(indices, values, grad.shape)
    return torch.from_numpy(np.array(grad, dtype=np.float32))


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {requested!r} requested, but CUDA is not available here")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device {requested!r} requested, but only {torch.cuda.device_count()} CUDA devices exist"
            )
    return device


def make_deterministic(seed: int) -> None:
    # Must be set before CUDA initialises for deterministic cuBLAS.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: a user's optimizer may use an op with no deterministic CUDA kernel;
    # that should cost bitwise reproducibility on GPU (with a warning), not the job. The
    # checkpoint's probe step reads that warning: its two steps then cannot agree bitwise, and
    # a small difference is told as inconclusive, not as lost state (verify_next_step).
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(seed)
    np.random.seed(seed)  # a step may draw from these too (rng_state saves them)
    random.seed(seed)


def params_sha256(model: nn.Module) -> str:
    """SHA-256 over every parameter's name, dtype, shape and raw bytes, in module order."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        tensor = param.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class Batches:
    """Batch `step` as tensors on the training device (rows chosen by `BatchOrder`, so every framework
    trains on the same rows); a DDP rank takes its equal share of them (`share` = (rank, ranks)).

    The epoch's permutation goes to the device once, as a (batches, rows) table of this rank's rows;
    a batch is then one row of it and two `index_select`s: no numpy, no host-to-device copy per step.
    """

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, *, batch_size: int, seed: int, share: tuple[int, int] = (0, 1)
    ) -> None:
        self.x, self.y = x, y
        self.order = BatchOrder(len(x), batch_size=batch_size, seed=seed)
        rank, ranks = share
        size = batch_size // ranks
        self.rows = slice(rank * size, (rank + 1) * size)
        self._epoch = -1
        self._table = torch.empty((0, size), dtype=torch.int64, device=x.device)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = divmod(step, self.order.per_epoch)
        if epoch != self._epoch:
            self._table = self._epoch_table(epoch)
            self._epoch = epoch
        rows = self._table[index]
        return self.x.index_select(0, rows), self.y.index_select(0, rows)

    def _epoch_table(self, epoch: int) -> torch.Tensor:
        """Row `i` holds this rank's rows of the epoch's batch `i`, as `BatchOrder.rows` gives them."""
        order = self.order
        used = torch.from_numpy(order.permutation(epoch)[: order.per_epoch * order.batch_size])
        return used.view(order.per_epoch, order.batch_size)[:, self.rows].contiguous().to(self.x.device)


def join_ranks(rank: Rank, device: torch.device) -> None:
    """Join the job's DDP process group: gloo on CPU, NCCL on GPUs; ranks meet through a file store."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"  # NCCL on the current device (the session's)
    dist.init_process_group(
        backend,
        init_method=f"file://{rank.store}",
        rank=rank.rank,
        world_size=rank.world,
        timeout=timedelta(seconds=DDP_TIMEOUT_S),
    )


def rank_device(requested: str, rank: Rank | None) -> torch.device:
    """The device of this process: a DDP rank takes the GPU `rank` places after the requested one."""
    device = resolve_device(requested)
    if rank is None or device.type != "cuda":
        return device
    return resolve_device(f"cuda:{(device.index or 0) + rank.rank}")


def closure_result(loss: torch.Tensor, needs: LoopNeeds, *, backward: bool = True) -> torch.Tensor:
    """How a loop's closure ends for a class stepped with `needs`: backward (keeping its graph for
    Hessian-vector products), then the loss's value; or the loss with its graph, for a class whose
    step runs backward on the closure's loss itself (`backward_in_step`: torchmin's Minimizer) and
    where the class asks for the loss alone (`closure(backward=False)`, a convention of line-search
    and trust-region optimizers, which may differentiate it themselves)."""
    if needs.backward_in_step or not backward:
        return loss
    loss.backward(create_graph=needs.create_graph)
    return loss.detach()


def closure_loss_over_ranks(loss: torch.Tensor) -> torch.Tensor:
    """A DDP rank's closure loss as the ranks' mean, as the loss of the whole batch; where it keeps
    its graph (`backward_in_step`), still the rank's own gradient, which DDP averages in backward."""
    mean = mean_over_ranks(loss)
    return loss - loss.detach() + mean if loss.requires_grad else mean


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of `value` over the DDP ranks (each holds its share's mean: this is the batch's)."""
    import torch.distributed as dist

    total = value.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


class TorchSession(TrainingSession):
    """A job's model, optimizer and LambdaLR scheduler; the checkpoint is one torch.save dict."""

    # A state_dict() call that changed the optimizer's live state was told (`_tell_live_change`).
    told_live_change: bool = False

    def __init__(self, spec: JobSpec, entry: Entry, workload: Workload, base: Base | None = None) -> None:
        self.spec = spec
        self.entry = entry
        # A wrapper's loop serves its base's needs too (Lookahead over AdaHessian: create_graph).
        self.needs = entry.needs.with_base(base.entry.needs if base is not None else None)
        self.base = base
        self.workload = workload
        # A DDP job's rank (set by jobs.distributed for every rank, rank 0 included), else None.
        self.rank = current_rank() if spec.distribution is not None else None
        self.torch_device = rank_device(spec.device, self.rank)
        self.device = str(self.torch_device)
        if self.torch_device.type == "cuda":
            # The job's GPU is the current one: torch.cuda's random stream (rng_state, which a
            # checkpoint holds and a probe step puts back) and NCCL act on it. A job run by hand
            # on cuda:1 had saved and put back cuda:0's stream while drawing from cuda:1's. An index
            # always: set_device refuses a bare "cuda" (`auto`'s and `cuda`'s), which means GPU 0.
            torch.cuda.set_device(self.torch_device.index or 0)
        if self.rank is not None:
            join_ranks(self.rank, self.torch_device)
            self.device += f" (ddp rank {self.rank.rank} of {self.rank.world})"
        self.dataset = workload.load_data(spec.workload.params)
        self.regression = workload.task_of(self.dataset) == "regression"
        self.loss_fn: nn.Module = nn.MSELoss() if self.regression else nn.CrossEntropyLoss()
        # Sparse embedding gradients only for optimizers that declare they take them.
        self.sparse = entry.supports_sparse
        make_deterministic(spec.seed)
        x_train, y_train = self._tensors(self.dataset.x_train, self.dataset.y_train)
        self.x_val, self.y_val = self._tensors(self.dataset.x_val, self.dataset.y_val)
        share = (self.rank.rank, self.rank.world) if self.rank is not None else (0, 1)
        self.batches = Batches(x_train, y_train, batch_size=spec.batch_size, seed=spec.seed, share=share)
        self.compile_mark = compile_clock().mark() if spec.compile else None
        self._clock = DeviceClock(self.torch_device)
        # A stated backward_in_step is proven by this attempt's first step (then False).
        self._backward_in_step_unproven = self.needs.backward_in_step

    def publication_settled(self, step: int) -> None:
        if self.rank is not None:
            rank_0_waited(self.rank, step)

    def _tensors(self, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(x).to(self.torch_device), torch.from_numpy(y).to(self.torch_device)

    def build(self) -> TrainObjects:
        model = self.workload.torch_model(self.spec.workload.params, self.dataset, sparse=self.sparse)
        model = model.to(self.torch_device)
        optimizer = self.entry.create(
            self.spec.optimizer.params, model_params=self._model_params(model), base=self.base, model=model
        )
        schedule = build_schedule(
            self.spec.schedule.name, self.spec.schedule.params, total_steps=self.spec.steps
        )
        replicated = self._replicated(model)
        if self.spec.compile:
            replicated = compiled(replicated or model)
        if not all(holds_a_rate(group) for group in optimizer.param_groups):
            unreachable = schedule_unreachable(optimizer, self.entry.lr_arg)
            if self.spec.schedule.name != "constant" and unreachable is not None:
                # The API refuses it where the class's source shows it; never a schedule dropped silently.
                raise ScheduleUnreachable(
                    f"schedule {self.spec.schedule.name!r}: {unreachable}", unreachable.fix
                )
            return TrainObjects(model, optimizer, None, replicated)  # no rate to scale: constant
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=schedule)
        return TrainObjects(model, optimizer, scheduler, replicated)

    def _replicated(self, model: nn.Module) -> nn.Module | None:
        """DDP's wrapper (it averages gradients over the ranks in backward), or None on one device."""
        if self.rank is None:
            return None
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.torch_device.index] if self.torch_device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def _model_params(self, model: nn.Module) -> Any:
        """The model's parameters, or the param groups the spec's recipe makes of them.

        A wrapper's groups carry its base's hyperparameters: the base steps them.
        """
        rules = self.spec.optimizer.group_rules()
        if not rules:
            return model.parameters()
        refused = recipe_problem(self.entry.name, self.entry.needs)
        if refused:
            raise ValueError(refused)
        holder = self.base.entry if self.base is not None else self.entry
        return holder.param_groups(rules, model.named_parameters())

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches(step)

    def train_step(self, objects: TrainObjects, batch: Any, step: int) -> StepRecord:
        """One step that never waits for the device: loss and gradient norm stay 0-d device tensors,
        the timings CUDA events (on the CPU the host clock), all read later by `to_floats`."""
        rate = objects.optimizer.param_groups[0].get("lr")
        lr = None if rate is None else float(rate)
        self._train_mode(objects)
        step_started = self._clock.start()
        # The step's loss is the first forward's, at the weights the step starts from; SAM wants
        # these first gradients before step(closure), as its docstring shows.
        loss = self._forward_backward(objects, batch).detach()  # no graph kept alive past the step
        grad_norm = gradient_norm(objects.parameters)
        optimizer_started = self._clock.start()
        self._optimizer_step(objects, batch)  # with a closure, its forward/backward is the optimizer's cost
        optimizer_ms = self._clock.elapsed_ms(optimizer_started)
        if objects.scheduler is not None:
            objects.scheduler.step()
        if self.rank is not None:
            loss = mean_over_ranks(loss)  # the whole batch's loss, as one device reports it
        step_ms = self._clock.elapsed_ms(step_started) if self._clock.deferred else None
        return StepRecord(loss=loss, grad_norm=grad_norm, lr=lr, optimizer_ms=optimizer_ms, step_ms=step_ms)

    def to_floats(self, values: Sequence[Any]) -> list[float]:
        """Every tensor among `values` read in one `torch.stack(...).tolist()` per device (one
        transfer, one wait for the device), then the rest (CUDA event timings, floats) by `float()`:
        their events are done by then."""
        floats = [0.0] * len(values)
        by_device: dict[torch.device, list[int]] = {}
        for index, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                by_device.setdefault(value.device, []).append(index)
        with torch.no_grad():
            for indices in by_device.values():
                read = torch.stack([values[index] for index in indices]).tolist()
                for index, number in zip(indices, read, strict=True):
                    floats[index] = float(number)
        for index, value in enumerate(values):
            if not isinstance(value, torch.Tensor):
                floats[index] = float(value)
        return floats

    def _forward_backward(
        self, objects: TrainObjects, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        loss = self._forward(objects, batch)
        # Hessian-vector products (AdaHessian, Sophia-H) differentiate the gradients again.
        loss.backward(create_graph=self.needs.create_graph)
        return loss

    def _forward(
        self, objects: TrainObjects, batch: tuple[torch.Tensor, torch.Tensor], *, zero_grad: bool = True
    ) -> torch.Tensor:
        x, y = batch
        if zero_grad:
            clear_gradients(objects.optimizer)
        return self._loss(objects.forward(x), y)

    def _optimizer_step(self, objects: TrainObjects, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        """step(), or step(closure) where the closure recomputes loss and gradients on the same batch."""
        if self.needs.closure:

            def closure(backward: bool = True) -> Any:  # the loss tensor, though torch's stubs say float
                with torch.enable_grad():  # step(closure) may run it under no_grad (AliG does)
                    loss = self._forward(objects, batch, zero_grad=backward)
                    loss = closure_result(loss, self.needs, backward=backward)
                # Under DDP every rank's optimizer sees the whole batch's loss, as it sees the averaged
                # gradient: a class that steps by the loss (LBFGS's line search, AliG's step size)
                # then takes the same step on every rank instead of drifting apart.
                return loss if self.rank is None else closure_loss_over_ranks(loss)

            if self._backward_in_step_unproven:
                self._step_running_backward(objects, closure)
            else:
                objects.optimizer.step(closure)
        else:
            objects.optimizer.step()
        if self.needs.create_graph:
            # Gradients built with create_graph hold the whole backward graph: free it now, or
            # every step's graph stays alive until the next zero_grad.
            clear_gradients(objects.optimizer)

    def _step_running_backward(self, objects: TrainObjects, closure: Callable[..., Any]) -> None:
        """The first step of a class stated to run backward itself (`backward_in_step`): its closure
        returns the loss with its graph and clears the gradients first, so a class that does not
        (Adam) finds none and moves nothing; the job would train nothing and succeed. Stepped here
        with the weights kept aside, so that no moved weight and no gradient tell it."""
        self._backward_in_step_unproven = False
        before = [p.detach().clone() for p in objects.parameters]
        objects.optimizer.step(closure)
        if all(p.grad is None for p in objects.parameters) and all(
            torch.equal(p, start) for p, start in zip(objects.parameters, before, strict=True)
        ):
            raise NeedNotServed(
                "optimizer.needs.backward_in_step: the class's step(closure) ran no backward on the loss "
                "its closure returned (after the first step no parameter has a gradient and none moved), "
                "so the job would train nothing",
                fix="drop backward_in_step from optimizer.needs; it is for a class whose step calls "
                "loss.backward() on its closure's loss itself (torchmin's Minimizer)",
            )

    def _train_mode(self, objects: TrainObjects) -> None:
        # Schedule-free optimizers step from other weights than they evaluate; both calls
        # do nothing when already in that mode, so each step and evaluation just asks for its own.
        if self.needs.train_eval:
            mode_switch(objects.optimizer).train()

    def _eval_mode(self, objects: TrainObjects) -> None:
        if self.needs.train_eval:
            mode_switch(objects.optimizer).eval()

    def _loss(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.workload.task == "objective":
            return output.mean()  # a test function of the parameters: the output is the loss
        if self.regression:
            output = output.reshape(-1)
        else:  # (N, C) logits as they are; a language model's (N, T, C) against (N, T) as N*T rows
            output, y = output.flatten(0, -2), y.flatten()
        loss: torch.Tensor = self.loss_fn(output, y)
        return loss

    @torch.no_grad()
    def evaluate(self, objects: TrainObjects) -> Evaluation:
        # Left in eval mode: the checkpoint that may follow saves these weights, and the next
        # training step switches back.
        self._eval_mode(objects)
        objects.model.eval()
        output = objects.model(self.x_val)
        objects.model.train()
        loss = float(self._loss(output, self.y_val).item())
        return Evaluation(loss=loss, outputs=output.detach().cpu().numpy(), labels=self.dataset.y_val)

    def checkpoint(
        self, objects: TrainObjects, step: int, folder: Path, *, next_step_follows: bool = False
    ) -> Checkpointed:
        """Saved, read back once as a user reads it, restored into fresh objects and compared; then
        the probe: the same step from the saved objects and from reloaded ones must agree.

        With `next_step_follows`, the reloaded objects that training continues from take that step
        themselves, as the loop's next step (`Checkpointed.confirm` compares them afterwards): one
        step, build and copy fewer than a twin of their own, which is how the probe runs otherwise
        (at the end, where the reloaded objects must stay as they were saved)."""
        path = self.checkpoint_path(folder, step)
        self._eval_mode(objects)  # what is saved are the weights the user evaluates
        changed = save_checkpoint(path, objects, step=step, spec_json=self.spec.model_dump_json())
        note = live_state_note(objects.optimizer, changed) if changed else None
        checkpoint = load_checkpoint(path)  # the file, read back once as a user reads it
        probe_batch = self.batch(min(step, self.spec.steps - 1))

        def probe(candidate: TrainObjects) -> None:
            # A training step, as the job takes it (in train mode, with its closure).
            self._train_mode(candidate)
            self._forward_backward(candidate, probe_batch)
            self._optimizer_step(candidate, probe_batch)

        if next_step_follows:
            reloaded = restore(checkpoint, self.build())
            with blaming(note):
                verify_state(objects, reloaded)

            def as_the_loop_steps(candidate: TrainObjects) -> None:
                probe(candidate)
                if candidate.scheduler is not None:  # train_step's schedule step, as the loop's step
                    candidate.scheduler.step()

            ran = take_probe_step(objects, as_the_loop_steps)  # `objects` is used up by it
            # The loop's step from `reloaded` is the same code: an op without a deterministic
            # implementation warns here. Only then is the saved model kept, to size a difference.
            before = checkpoint["model"] if ran else None
            checkpointed = Checkpointed(reloaded, path)
            self._tell_live_change(checkpointed, step, note)

            def confirm(stepped: TrainObjects) -> None:
                with blaming(note):
                    inconclusive = verify_next_step(objects, stepped, ran=ran, before=before)
                self.tell_once(checkpointed, step, inconclusive)

            checkpointed.confirm = confirm
            return checkpointed
        # The twin needs tensors of its own (a restored optimizer keeps the loaded tensors themselves,
        # and the probe steps it in place). A deep copy is a second load without the file and the
        # weights-only unpickler (4-9x cheaper here); it keeps which saved tensors share storage.
        twin_checkpoint = copy.deepcopy(checkpoint)
        reloaded = restore(checkpoint, self.build())
        twin = restore(twin_checkpoint, self.build())  # used up by the probe

        def probe_at_a_training_rate(candidate: TrainObjects) -> None:
            restore_a_zero_rate(candidate.optimizer)
            probe(candidate)

        # The saved model, which nothing steps (load_state_dict copies it into `reloaded`): what the
        # probe's step changed, should a nondeterministic op make the two steps differ.
        checkpointed = Checkpointed(reloaded, path)
        with blaming(note):
            inconclusive = verify_roundtrip(
                objects, reloaded, twin, probe_at_a_training_rate, checkpoint["model"]
            )
        self.tell_once(checkpointed, step, inconclusive)
        self._tell_live_change(checkpointed, step, note)
        return checkpointed

    def _tell_live_change(self, checkpointed: Checkpointed, step: int, note: str | None) -> None:
        """A save that changed the live state, where the checkpoint verified all the same: once a job."""
        if note and not self.told_live_change:
            self.told_live_change = True
            checkpointed.warnings.append(
                f"step {step}: {note} (the job trains on from the state as it was before the call, which "
                "optlab put back; told once a job)"
            )

    def checkpoint_path(self, folder: Path, step: int) -> Path:
        return folder / f"step-{step:08d}.pt"

    def resume(self, path: Path) -> tuple[TrainObjects, int]:
        checkpoint = load_checkpoint(path)  # its bytes checked before (zip_damage)
        saved_spec = JobSpec.model_validate_json(checkpoint["spec"])
        if saved_spec != self.spec:
            raise ValueError(other_spec(path, saved_spec, self.spec))
        if checkpoint["data_position"] != checkpoint["step"]:
            raise ValueError(f"checkpoint {path}: data position {checkpoint['data_position']} != step")
        return restore(checkpoint, self.build()), int(checkpoint["step"])

    def params_sha256(self, objects: TrainObjects) -> str:
        return params_sha256(objects.model)

    def details(self, objects: TrainObjects) -> dict[str, Any]:
        found: dict[str, Any] = {} if self.compile_mark is None else compile_clock().since(self.compile_mark)
        if self.torch_device.type == "cuda":  # rank 0's GPU in a DDP job
            found["gpu_memory_peak_mb"] = round(torch.cuda.max_memory_allocated(self.torch_device) / 2**20, 1)
        return found

    def parameter_values(self, objects: TrainObjects) -> list[np.ndarray]:
        return [p.detach().cpu().numpy() for p in objects.model.parameters()]

    def state_bytes(self, objects: TrainObjects) -> tuple[int, int]:
        params = sum(tensor_bytes(p) for p in objects.model.parameters() if p.requires_grad)
        return optimizer_state_bytes(objects.optimizer), params

    def adapted_values(self, objects: TrainObjects) -> list[dict[str, float]]:
        return [
            {
                key: float(value)
                for key, value in group.items()
                if key not in SCHEDULED_GROUP_KEYS
                and isinstance(value, int | float)
                and not isinstance(value, bool)
            }
            for group in objects.optimizer.param_groups
        ]


def mode_switch(optimizer: Any) -> Any:
    """What `train()` / `eval()` go to: the optimizer, or the base a wrapper without them holds
    (Lookahead over a schedule-free optimizer); ValueError when neither has both."""
    for candidate in (optimizer, *vars(optimizer).values()):
        if not isinstance(candidate, torch.optim.Optimizer):
            continue
        if callable(getattr(candidate, "train", None)) and callable(getattr(candidate, "eval", None)):
            return candidate
    raise ValueError(
        f"optimizer {type(optimizer).__name__} needs train_eval, but neither it nor an optimizer it wraps "
        "defines train() and eval(); state needs.train_eval false if it has no such modes"
    )


# What LambdaLR writes into each param group: the loop logs the rate as `train/lr`.
SCHEDULED_GROUP_KEYS = frozenset({"lr", "initial_lr"})


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Memory a tensor holds; a sparse one's indices and values (it has no dense storage)."""
    if tensor.is_sparse:
        return tensor_bytes(tensor._indices()) + tensor_bytes(tensor._values())
    return tensor.numel() * tensor.element_size()


@torch.no_grad()  # create_graph gradients carry a graph: the norm must not extend it
def gradient_norm(parameters: Sequence[torch.Tensor]) -> torch.Tensor | float:
    """The 2-norm of all the gradients together, as a 0-d tensor on their device (not read back);
    0.0 when no parameter has one. Dense gradients in one `torch._foreach_norm`; where any is sparse,
    one norm per gradient in model order, a sparse one's repeated rows summed first (coalesce)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    if any(grad.is_sparse for grad in grads):
        norms = [_norm(grad) for grad in grads]
    else:
        norms = list(torch._foreach_norm(grads))
    # What Tensor.norm() computes here, without its Python wrapper (tens of microseconds a step).
    return torch.linalg.vector_norm(torch.stack(norms))


def _norm(grad: torch.Tensor) -> torch.Tensor:
    # A sparse gradient's repeated rows must be summed before taking the norm.
    return grad.coalesce().values().norm() if grad.is_sparse else grad.norm()


@dataclass(frozen=True)
class EventTiming:
    """Milliseconds between two CUDA events, read only when `float()` asks (at the loop's flush,
    after `to_floats` has waited for the device, so the events are done)."""

    start: Any  # torch.cuda.Event
    end: Any

    def __float__(self) -> float:
        self.end.synchronize()
        return float(self.start.elapsed_time(self.end))


class DeviceClock:
    """Times work on the training device without waiting for it: CUDA events on the device's current
    stream (read later, `EventTiming`); on the CPU, where work is done when the call returns, the
    host clock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.deferred = device.type == "cuda"

    def start(self) -> Any:
        if not self.deferred:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed_ms(self, started: Any) -> Any:
        """Milliseconds since `started` (a float now, or an `EventTiming` to read later)."""
        if not self.deferred:
            return (time.perf_counter() - started) * 1000
        return EventTiming(started, self.start())


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes the optimizer's state holds, each tensor in its own dtype."""
    return sum(tensor_bytes(tensor) for _, tensor in state_tensors(optimizer))


def _state_entry(optimizer: Any, param: Any) -> Any:
    """`optimizer.state[param]`, found by identity (None where there is none): a class keying its state
    by `id(p)` or by index puts ints beside the tensors, and a lookup that compares an int with a
    tensor raises ("Boolean value of Tensor with more than one value is ambiguous")."""
    return _states_by_identity(optimizer).get(id(param))


def _states_by_identity(optimizer: Any) -> dict[int, Any]:
    """Each parameter's `optimizer.state` entry by the parameter's id, once for a pass over them all
    (a job's checkpoint check looks up every parameter's)."""
    return {id(key): entry for key, entry in optimizer.state.items() if isinstance(key, torch.Tensor)}
