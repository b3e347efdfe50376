"""The checkpoint round-trip: first_difference, and verify_roundtrip against broken optimizers."""

from __future__ import annotations

import inspect
import math
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from jobs.frameworks.base import StateNotRestored
from jobs.frameworks.torch_driver import (
    _SAVES_CHANGING_IN_PLACE,
    _SAVES_KEEPING_VALUES,
    _SAVES_TO_COMPARE,
    CheckpointMismatch,
    TrainObjects,
    first_difference,
    load_checkpoint,
    restore,
    rng_state,
    save_checkpoint,
    saved_state_dict,
    set_rng_state,
    verify_roundtrip,
    zip_damage,
)
from jobs.spec import JobSpec

from .helpers import digits_spec, registry_with

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# -- first_difference --------------------------------------------------------------------------------


def state(weight: list[float], step: Any = 3) -> dict[str, Any]:
    return {"state": {0: {"momentum": torch.tensor(weight), "step": step}}, "param_groups": [{"lr": 0.1}]}


def state_with(**keys: Any) -> dict[str, Any]:
    """`state([1.0])` with more keys in its one parameter's state."""
    with_keys = state([1.0])
    with_keys["state"][0].update(keys)
    return with_keys


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        pytest.param(state([1.0, 2.0]), state([1.0, 2.0]), id="equal tensors"),
        pytest.param(state([math.nan, 2.0]), state([math.nan, 2.0]), id="NaN in a tensor equals NaN"),
        pytest.param(state([1.0], step=math.nan), state([1.0], step=math.nan), id="float NaN equals NaN"),
        pytest.param([1, "a", (2, 3)], [1, "a", (2, 3)], id="nested sequences"),
        pytest.param(torch.tensor([1, 2]), torch.tensor([1, 2]), id="integer tensors"),
        pytest.param(
            state([1.0]),
            state_with(m_quant_type="uf8"),
            id="bookkeeping the loader fills in (Adafactor8Bit's m_quant_type): no state lost",
        ),
    ],
)
def test_equal_states_have_no_difference(saved: Any, loaded: Any) -> None:
    assert first_difference(saved, loaded, "optimizer") is None


@pytest.mark.parametrize(
    ("saved", "loaded", "expected"),
    [
        pytest.param(
            state([1.0, 2.0]),
            state([1.0, 2.5]),
            "optimizer['state'][0]['momentum']: max abs difference 0.5",
            id="tensor values",
        ),
        pytest.param(
            state([1.0, 2.0]),
            state([1.0, math.nan]),
            "optimizer['state'][0]['momentum']: max abs difference inf",
            id="NaN against a number",
        ),
        pytest.param(
            state([1.0]),
            state([1.0, 2.0]),
            "optimizer['state'][0]['momentum']: torch.float32[1] saved, torch.float32[2] after reload",
            id="tensor shape",
        ),
        pytest.param(
            state([1.0], step=3),
            state([1.0], step=4),
            "optimizer['state'][0]['step']: 3 saved, 4 after reload",
            id="python scalar",
        ),
        pytest.param(
            state([1.0]),
            {"state": {0: {"momentum": torch.tensor([1.0])}}, "param_groups": [{"lr": 0.1}]},
            "optimizer['state'][0]: keys differ (missing after reload: ['step'], unexpected: [])",
            id="missing key",
        ),
        pytest.param(
            state([1.0]),
            state_with(extra=[torch.tensor(0.0)]),
            "optimizer['state'][0]: keys differ (missing after reload: [], unexpected: ['extra'])",
            id="a tensor only the reload has",
        ),
        pytest.param(
            {"param_groups": [{"lr": 0.1}]},
            {"param_groups": [{"lr": 0.1}, {"lr": 0.2}]},
            "optimizer['param_groups']: [{'lr': 0.1}] saved, [{'lr': 0.1}, {'lr': 0.2}] after reload",
            id="sequence length",
        ),
        pytest.param(
            state([1.0], step=torch.tensor(3.0)),
            state([1.0], step=3.0),
            "optimizer['state'][0]['step']: Tensor saved, float after reload",
            id="tensor against a float",
        ),
    ],
)
def test_a_difference_names_its_path(saved: Any, loaded: Any, expected: str) -> None:
    assert first_difference(saved, loaded, "optimizer") == expected


@pytest.mark.filterwarnings("ignore:Casting complex values to real")
def test_complex_tensors_report_their_difference() -> None:
    found = first_difference(torch.tensor([1 + 1j]), torch.tensor([1 + 2j]), "m")
    assert found == "m: max abs difference 1"


# -- verify_roundtrip --------------------------------------------------------------------------------


class AttributeMomentum(torch.optim.Optimizer):
    """BROKEN on purpose: momentum lives in a Python dict, which state_dict() never sees."""

    def __init__(self, params: Any, lr: float = 0.05, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})
        self.momenta: dict[torch.Tensor, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    momentum = self.momenta.setdefault(p, torch.zeros_like(p))
                    momentum.mul_(group["beta"]).add_(p.grad)
                    p.add_(momentum, alpha=-group["lr"])


class LazyAttributeMomentum(AttributeMomentum):
    """BROKEN on purpose, as above, but creates its dict on first use."""

    def __init__(self, params: Any, lr: float = 0.05, beta: float = 0.9) -> None:
        torch.optim.Optimizer.__init__(self, params, {"lr": lr, "beta": beta})

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        if not hasattr(self, "momenta"):
            self.momenta = {}
        super().step(closure)


class StateMomentum(torch.optim.Optimizer):
    """Correct: every bit of state lives in self.state[p], so state_dict() carries it."""

    def __init__(self, params: Any, lr: float = 0.05, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                    state["updates"] = torch.tensor(0.0)
                state["updates"] += 1
                state["momentum"].mul_(group["beta"]).add_(p.grad)
                p.add_(state["momentum"], alpha=-group["lr"])


class ForgetfulMomentum(StateMomentum):
    """BROKEN on purpose: load_state_dict drops `updates`."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        kept = {key: {k: v for k, v in s.items() if k != "updates"} for key, s in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": kept})


OptimizerClass = Callable[..., torch.optim.Optimizer]


X = torch.linspace(-1, 1, 32).reshape(8, 4)
Y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])


def build(optimizer_cls: OptimizerClass) -> TrainObjects:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = optimizer_cls(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    return TrainObjects(model, optimizer, scheduler)


def train_step(objects: TrainObjects) -> None:
    objects.optimizer.zero_grad()
    nn.functional.cross_entropy(objects.model(X), Y).backward()
    objects.optimizer.step()


def roundtrip(tmp_path: Path, optimizer_cls: OptimizerClass) -> TrainObjects:
    """Three steps, save, reload into fresh objects, verify with one probe step."""
    original = build(optimizer_cls)
    for _ in range(3):
        train_step(original)
        original.scheduler.step()
    path = tmp_path / "step-3.pt"
    save_checkpoint(path, original, step=3, spec_json="{}")
    reloaded = restore(load_checkpoint(path), build(optimizer_cls))
    expected = {name: tensor.clone() for name, tensor in original.model.state_dict().items()}
    twin = restore(load_checkpoint(path), build(optimizer_cls))
    verify_roundtrip(original, reloaded, twin, train_step)
    assert first_difference(expected, reloaded.model.state_dict(), "model") is None  # not used up
    return reloaded


@pytest.mark.parametrize("optimizer_cls", [StateMomentum, torch.optim.Adam, torch.optim.SGD])
def test_a_correct_optimizer_survives_the_roundtrip(tmp_path: Path, optimizer_cls: OptimizerClass) -> None:
    reloaded = roundtrip(tmp_path, optimizer_cls)  # raises CheckpointMismatch on a loss
    assert reloaded.scheduler.last_epoch == 3, "the reloaded objects carry the saved state"


def test_state_dropped_on_load_is_named(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointMismatch, match=r"optimizer\['state'\]\[0\]: keys differ .*\['updates'\]"
    ) as caught:
        roundtrip(tmp_path, ForgetfulMomentum)
    # By the class's own load_state_dict(), at its line, with the fix for it.
    method = ForgetfulMomentum.load_state_dict
    assert (
        "the saved state_dict holds state[param 0]['updates'], state[param 1]['updates'], and the optimizer "
        "it was loaded into lacks them: the class's own load_state_dict() drops them as it loads "
        f"(at {inspect.getsourcefile(method)}:{inspect.getsourcelines(method)[1]}). Fix: keep every key "
        "super().load_state_dict(state_dict) loads"
    ) in str(caught.value)


@pytest.mark.parametrize("optimizer_cls", [AttributeMomentum, LazyAttributeMomentum])
def test_state_outside_state_dict_is_caught_by_the_probe_step(
    tmp_path: Path, optimizer_cls: OptimizerClass
) -> None:
    with pytest.raises(CheckpointMismatch, match="the next step differs"):
        roundtrip(tmp_path, optimizer_cls)


class SlowWeightsLeftOut(StateMomentum):
    """BROKEN on purpose, as a Lookahead written from its paper's reference code: slow weights in
    self.state[p], read every 5th step only, and a state_dict() that leaves them out. The probe step
    (step 4) does not read them, so it cannot see them lost."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        kept = {i: {k: v for k, v in s.items() if k != "slow"} for i, s in saved["state"].items()}
        return {**saved, "state": kept}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                slow = state.setdefault("slow", p.clone())  # a reload starts them afresh, here
                if int(state["updates"]) % 5 == 0:
                    p.lerp_(slow, 0.5)
                    slow.copy_(p)


class CacheLeftOut(StateMomentum):
    """Correct: a per-step cache it leaves out of state_dict() and writes afresh at every step (or
    builds when it is missing): nothing a resumed job goes on from differs."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        kept = {i: {k: v for k, v in s.items() if k != "last_grad"} for i, s in saved["state"].items()}
        return {**saved, "state": kept}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["last_grad"] = p.grad.clone()


def test_state_left_out_of_state_dict_is_caught_even_where_the_probe_step_does_not_read_it(
    tmp_path: Path,
) -> None:
    with pytest.raises(CheckpointMismatch, match=r"optimizer.state\[param 0\]\['slow'\] is left out of what"):
        roundtrip(tmp_path, SlowWeightsLeftOut)
    roundtrip(tmp_path, CacheLeftOut)  # written afresh by every step: nothing lost


class LiveEditedMomentum(StateMomentum):
    """BROKEN on purpose, as SPAM's "save space" override: it pops the momentum from what
    super().state_dict() returns, which is self.state[p] itself, so every save also wipes the momentum
    training goes on with (and the step starts it afresh). A save and a reload agree (both lack it)."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            entry.pop("momentum", None)
        return saved

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state.setdefault("updates", torch.tensor(0.0))
                state.setdefault("momentum", torch.zeros_like(p))
                state["updates"] += 1
                state["momentum"].mul_(group["beta"]).add_(p.grad)
                p.add_(state["momentum"], alpha=-group["lr"])


class LiveEditedCache(CacheLeftOut):
    """Correct in effect: it pops a per-step cache from the live state as it saves, and every step
    writes the cache afresh: training goes on alike, so the checkpoint verifies."""

    def state_dict(self) -> dict[str, Any]:
        saved = torch.optim.Optimizer.state_dict(self)
        for entry in saved["state"].values():
            entry.pop("last_grad", None)
        return saved


LIVE_EDIT = (
    r"calling state_dict\(\) changed the optimizer's live state \(state\[param 0\]\['momentum'\] removed, "
    r"state\[param 1\]\['momentum'\] removed\).* \(at .*test_torch_driver_checkpoint.py:\d+\)\. Fix: copy "
    r"before editing what super\(\).state_dict\(\) returns"
)


def test_a_state_dict_that_edits_the_live_state_is_put_back_and_its_loss_caught(tmp_path: Path) -> None:
    original = build(LiveEditedMomentum)
    for _ in range(3):
        train_step(original)
    path = tmp_path / "step-3.pt"
    changed = save_checkpoint(path, original, step=3, spec_json="{}")
    assert changed == ["state[param 0]['momentum'] removed", "state[param 1]['momentum'] removed"]
    # Training goes on from the state as it was; the file holds what the class saves.
    assert all("momentum" in entry for entry in original.optimizer.state.values())
    assert "momentum" not in load_checkpoint(path)["optimizer"]["state"][0]
    # So the reload no longer agrees with the objects saved: the loss shows.
    with pytest.raises(CheckpointMismatch, match="the next step differs"):
        roundtrip(tmp_path, LiveEditedMomentum)


def test_a_live_cache_a_save_drops_and_the_step_rebuilds_is_no_loss(tmp_path: Path) -> None:
    roundtrip(tmp_path, LiveEditedCache)  # raises CheckpointMismatch on a loss


class WrappedLiveEditedMomentum(LiveEditedMomentum):
    """LiveEditedMomentum's pop, in a save that wraps what super().state_dict() returns, Lookahead-style:
    the entries under "wrapped" are self.state[p] too."""

    def state_dict(self) -> dict[str, Any]:
        return {"wrapped": (super().state_dict(),), "version": 2}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict["wrapped"][0])


def test_a_wrapped_save_that_edits_the_live_state_keeps_what_it_saves_apart(tmp_path: Path) -> None:
    """Putting the live state back had put the popped momentum back into what is saved too (only a
    top-level "state" was copied), so the file held it and the loss hid."""
    original = build(WrappedLiveEditedMomentum)
    for _ in range(3):
        train_step(original)
    path = tmp_path / "step-3.pt"
    changed = save_checkpoint(path, original, step=3, spec_json="{}")
    assert changed == ["state[param 0]['momentum'] removed", "state[param 1]['momentum'] removed"]
    assert all("momentum" in entry for entry in original.optimizer.state.values())
    assert "momentum" not in load_checkpoint(path)["optimizer"]["wrapped"][0]["state"][0]
    with pytest.raises(CheckpointMismatch, match="the next step differs"):
        roundtrip(tmp_path, WrappedLiveEditedMomentum)


class MovedMomentum(StateMomentum):
    """Moves the momentum to another device in what it saves, written into the live dicts: on a GPU
    job, `s[k] = v.cpu()` moves the state training goes on with to the CPU. ('meta' stands for the
    other device here.)"""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            entry["momentum"] = entry["momentum"].to("meta")
        return saved


class NoOpInPlaceMomentum(StateMomentum):
    """Touches its momentum in place as it saves, changing no value (`add_(0)`): correct."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            entry["momentum"].add_(0)
        return saved


class ZeroedMomentum(StateMomentum):
    """Zeroes the live momentum in place as it saves."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            entry["momentum"].zero_()
        return saved


class ClonedMomentum(StateMomentum):
    """Saves copies of its tensors, written into the live dicts: new objects, the same values."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            entry.update({k: v.clone() for k, v in entry.items()})
        return saved


def test_a_save_that_moves_live_state_to_another_device_is_named_and_put_back() -> None:
    """Values alone had been compared (both copied to the CPU): a move was no change, and the job
    went on with the state where the save had put it."""
    objects = build(MovedMomentum)
    for _ in range(2):
        train_step(objects)
    _, changed = saved_state_dict(objects.optimizer)
    assert changed == [
        "state[param 0]['momentum'] moved from cpu to meta",
        "state[param 1]['momentum'] moved from cpu to meta",
    ]
    assert all(entry["momentum"].device.type == "cpu" for entry in objects.optimizer.state.values())


@pytest.mark.parametrize(
    ("optimizer_cls", "copied_from_now_on"),
    [
        (NoOpInPlaceMomentum, False),
        (ZeroedMomentum, True),
        (ClonedMomentum, False),
        (torch.optim.Adam, False),
    ],
)
def test_a_save_is_copied_first_only_where_it_changed_values_and_compared_where_the_tensors_are(
    monkeypatch: pytest.MonkeyPatch, optimizer_cls: OptimizerClass, copied_from_now_on: bool
) -> None:
    """A version bump that changed no value (add_(0)) had had every later save of the class clone all
    its state, and every comparison copied tensors to the host: x27 a save for 25M parameters."""
    objects = build(optimizer_cls)
    train_step(objects)
    clones = []
    real_clone = torch.Tensor.clone

    def counted_clone(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        clones.append(tensor)
        return real_clone(tensor, *args, **kwargs)

    def no_host_copy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("a state tensor copied to the host to be compared")

    monkeypatch.setattr(torch.Tensor, "cpu", no_host_copy)
    saved_state_dict(objects.optimizer, copy_values=True)  # the checks': compared, and learned from
    monkeypatch.setattr(torch.Tensor, "clone", counted_clone)
    for _ in range(3):  # a job's saves
        train_step(objects)
        saved_state_dict(objects.optimizer)
    assert (type(objects.optimizer) in _SAVES_CHANGING_IN_PLACE) == copied_from_now_on
    if not copied_from_now_on:
        assert clones == [] if optimizer_cls is not ClonedMomentum else len(clones) == 3 * 4
    if optimizer_cls is not torch.optim.Adam:  # the live momentum, as it was (put back where zeroed)
        assert all(entry["momentum"].abs().sum() > 0 for entry in objects.optimizer.state.values())


def test_a_no_op_in_place_save_first_seen_in_a_job_is_compared_once_then_never_copied() -> None:
    class FirstSeenInAJob(NoOpInPlaceMomentum):
        pass

    objects = build(FirstSeenInAJob)
    train_step(objects)
    saved_state_dict(objects.optimizer)  # a bump, nothing copied to compare: compared at the next save
    assert FirstSeenInAJob in _SAVES_TO_COMPARE
    saved_state_dict(objects.optimizer)
    assert FirstSeenInAJob not in _SAVES_TO_COMPARE | _SAVES_CHANGING_IN_PLACE
    assert FirstSeenInAJob in _SAVES_KEEPING_VALUES


# -- the same, inside a real job ---------------------------------------------------------------------


def broken_spec(name: str, checkpoint_every: int) -> JobSpec:
    return digits_spec(
        optimizer={"name": name, "params": {"lr": 0.05}}, steps=12, checkpoint_every=checkpoint_every
    )


# A checkpoint with steps after it is proven by the loop's next step (Checkpointed.confirm); the
# last one, by a twin of its own.
FIRST_CHECKPOINT = pytest.mark.parametrize("first", [5, 12], ids=["mid-run", "at the end only"])


@FIRST_CHECKPOINT
def test_a_job_fails_its_first_checkpoint_when_state_is_dropped(
    make_job: Callable[..., Any], first: int
) -> None:
    job = make_job(broken_spec("forgetful_momentum", first), with_registry=registry_with(ForgetfulMomentum))
    with pytest.raises(CheckpointMismatch, match=r"\['updates'\]"):
        job.run()
    assert [(c.step, c.ok) for c in job.verified] == [(first, False)]


@FIRST_CHECKPOINT
def test_a_job_fails_its_first_checkpoint_when_state_is_outside_state_dict(
    make_job: Callable[..., Any], first: int
) -> None:
    job = make_job(broken_spec("attribute_momentum", first), with_registry=registry_with(AttributeMomentum))
    with pytest.raises(CheckpointMismatch, match="the next step differs"):
        job.run()
    assert [(c.step, c.ok) for c in job.verified] == [(first, False)]


@FIRST_CHECKPOINT
def test_a_job_fails_its_first_checkpoint_when_state_dict_edits_the_live_state(
    make_job: Callable[..., Any], first: int
) -> None:
    job = make_job(
        broken_spec("live_edited_momentum", first), with_registry=registry_with(LiveEditedMomentum)
    )
    with pytest.raises(
        CheckpointMismatch, match=LIVE_EDIT.replace(r"state\[param 1\]\['momentum'\] removed\)", "")
    ):
        job.run()
    assert [(c.step, c.ok) for c in job.verified] == [(first, False)]


def test_a_job_whose_save_drops_a_cache_the_step_rebuilds_trains_on_and_is_told_once(
    make_job: Callable[..., Any],
) -> None:
    job = make_job(broken_spec("live_edited_cache", 4), with_registry=registry_with(LiveEditedCache))
    result = job.run()
    assert all(c.ok for c in result.checkpoints)
    (warning,) = [w for w in result.warnings if "live state" in w]
    assert "state[param 0]['last_grad'] removed" in warning and warning.endswith("told once a job)")


def test_a_job_whose_state_holds_a_type_of_its_own_fails_saying_how_to_allow_it(
    make_job: Callable[..., Any],
) -> None:
    from jobs.run import error_record
    from tests.checks.own_types_in_groups import AllowedEnumDecaySGD, EnumDecaySGD

    # The job had failed with torch's whole weights_only message, which names only the first type.
    job = make_job(broken_spec("enum_decay_sgd", 5), with_registry=registry_with(EnumDecaySGD))
    with pytest.raises(StateNotRestored) as raised:
        job.run()
    assert [(c.step, c.ok) for c in job.verified] == [(5, False)]
    message = error_record(raised.value).message
    assert "a type torch loads only once allowed: tests.checks.own_types_in_groups.DecayKind" in message
    assert "Fix: " in message and "torch.serialization.add_safe_globals([DecayKind])" in message
    # The class that allows its own type where it is defined trains with every checkpoint proven.
    allowed = make_job(
        broken_spec("allowed_enum_decay_sgd", 5), with_registry=registry_with(AllowedEnumDecaySGD)
    )
    result = allowed.run()
    assert result.checkpoints_verified == len(result.checkpoints) == 3


def test_a_job_clears_gradients_with_a_zero_grad_that_takes_no_argument(make_job: Callable[..., Any]) -> None:
    from tests.checks.test_unusual_optimizers import PlainZeroGradSGD

    # The job had failed at its first step: "zero_grad() got an unexpected keyword argument 'set_to_none'".
    spec = digits_spec(optimizer={"name": "plain_zero_grad_sgd", "params": {"lr": 0.05}}, steps=12)
    result = make_job(spec, with_registry=registry_with(PlainZeroGradSGD)).run()
    sgd = make_job(digits_spec(optimizer={"name": "sgd", "params": {"lr": 0.05}}, steps=12)).run()
    assert result.checkpoints_verified == len(result.checkpoints) == 2
    assert result.params_sha256 == sgd.params_sha256  # torch's SGD, its gradients cleared alike


@pytest.mark.parametrize(
    "optimizer",
    [
        pytest.param({"name": "adam", "params": {"lr": 0.01}}, id="adam"),
        pytest.param({"name": "ema_momentum", "params": {"lr": 0.05}}, id="ema_momentum"),
    ],
)
def test_a_checkpoint_left_to_the_next_step_is_proven_by_that_step_and_no_other(
    make_job: Callable[..., Any], optimizer: dict[str, Any]
) -> None:
    spec = digits_spec(optimizer=optimizer, schedule={"name": "cosine", "params": {"warmup_steps": 2}})
    job = make_job(spec)
    session = job.session
    objects = session.build()
    for step in range(3):
        session.train_step(objects, session.batch(step), step)
    checkpointed = session.checkpoint(objects, 3, job.checkpoint_dir, next_step_follows=True)
    assert checkpointed.confirm is not None
    # Nothing of the proof touched the objects training continues from: they are what was saved.
    saved = torch.load(checkpointed.path, weights_only=True)
    for name, part in checkpointed.objects.parts().items():
        assert first_difference(saved[name], part.state_dict(), name) is None
    # The loop's step 3 from them (its schedule step included) is the uninterrupted one...
    session.train_step(checkpointed.objects, session.batch(3), 3)
    checkpointed.confirm(checkpointed.objects)
    # ...and any other step is not: the comparison can fail.
    session.train_step(checkpointed.objects, session.batch(4), 4)
    with pytest.raises(CheckpointMismatch, match="the next step differs"):
        checkpointed.confirm(checkpointed.objects)


class LockedCounter(StateMomentum):
    """Counts its steps in an attribute and holds a lock: it cannot be deep-copied, and the
    count never reaches state_dict(). The probe must still see the difference."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        self.lock = threading.Lock()
        self.t = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.t += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / self.t)
        return None


def test_state_in_an_uncopyable_optimizer_is_still_caught(tmp_path: Path) -> None:
    with pytest.raises(CheckpointMismatch, match="next step differs"):
        roundtrip(tmp_path, LockedCounter)


class CorruptingMomentum(StateMomentum):
    """BROKEN on purpose: state_dict() hands out momentum off by one, same keys, shapes and dtypes."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        state = {k: {**s, "momentum": s["momentum"] + 1} for k, s in saved["state"].items()}
        return {**saved, "state": state}


def test_a_state_dict_with_wrong_values_is_caught(tmp_path: Path) -> None:
    with pytest.raises(CheckpointMismatch, match=r"\['momentum'\]: max abs difference 1"):
        roundtrip(tmp_path, CorruptingMomentum)


def test_training_continues_from_objects_the_probe_did_not_touch(make_job: Callable[..., Any]) -> None:
    # The twin that takes the probe step must own its tensors: a restored optimizer keeps the loaded
    # ones, so a twin sharing them would step the objects training continues from.
    job = make_job(digits_spec(optimizer={"name": "adam", "params": {"lr": 0.01}}))
    session = job.session
    objects = session.build()
    for step in range(3):
        session.train_step(objects, session.batch(step), step)
    checkpointed = session.checkpoint(objects, 3, job.checkpoint_dir)
    saved = torch.load(checkpointed.path, weights_only=True)
    for name, part in checkpointed.objects.parts().items():
        assert first_difference(saved[name], part.state_dict(), name) is None


def test_a_checkpoint_that_cannot_be_written_is_named_by_its_path(
    make_job: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's own words name no file (an immutable folder: "open file failed with strerror:
    Operation not permitted")."""

    def refused(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        Path(f).write_bytes(b"torn")  # a part written first, then the failure
        raise RuntimeError("[enforce fail at inline_container.cc:747] . open file failed with strerror: nope")

    job = make_job(digits_spec(steps=2, checkpoint_every=2, eval_every=2))
    monkeypatch.setattr(torch, "save", refused)
    with pytest.raises(OSError, match=r"could not write the checkpoint .*step-00000002\.pt: \[enforce fail"):
        job.run()
    assert not list(job.checkpoint_dir.glob(".*.tmp"))  # no torn file left behind


def test_a_checkpoint_write_that_met_a_full_disk_says_so(
    make_job: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's words for a full disk name neither the disk nor ENOSPC ("unexpected pos 56384 vs 56272",
    as a probe saw on a full tmpfs)."""
    import shutil

    def full(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 56384 vs 56272")

    job = make_job(digits_spec(steps=2, checkpoint_every=2, eval_every=2))
    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096)
    )  # type: ignore[attr-defined]
    with pytest.raises(OSError, match=r"unexpected pos .* has 4,096 bytes free: the disk is full, or nearly"):
        job.run()


def test_a_damaged_checkpoint_is_told_before_a_resume_loads_it(make_job: Callable[..., Any]) -> None:
    """torch.load reads a checkpoint with a flipped byte in a tensor without a word (the job would go
    on from weights it never had), and says only "failed reading zip archive" of one cut short."""
    spec = digits_spec(optimizer={"name": "sgd", "params": {"lr": 0.05}}, steps=4)
    job = make_job(spec)
    session = job.session
    objects = session.build()
    session.train_step(objects, session.batch(0), 0)
    path = session.checkpoint(objects, 1, job.checkpoint_dir, next_step_follows=False).path
    whole = path.read_bytes()
    assert zip_damage(path) is None
    flipped = bytearray(whole)
    flipped[len(whole) // 2] ^= 0xFF  # inside the parameters' bytes
    path.write_bytes(bytes(flipped))
    torch.load(path, weights_only=True)  # what a resume did: no error, other weights
    damage = zip_damage(path) or ""
    assert re.fullmatch(r"the bytes of \S+/data/\d+ in step-00000001\.pt differ from .* \(CRC-32\)", damage)
    path.write_bytes(whole[:100])
    assert (zip_damage(path) or "").startswith(
        "step-00000001.pt is not a whole checkpoint file (BadZipFile: "
    )


def test_a_checkpoint_is_read_onto_the_host_whatever_the_jobs_device(
    make_job: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU, a checkpoint read onto the device left each restored Adam `step` there (torch's
    load_state_dict keeps `step` where it was loaded), and every later step read it with `.item()`."""
    places: list[Any] = []
    load = torch.load

    def recording(*args: Any, **kwargs: Any) -> Any:
        places.append(kwargs.get("map_location"))
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording)
    spec = digits_spec(optimizer={"name": "adam", "params": {"lr": 0.01}}, steps=4, device="cpu")
    job = make_job(spec)
    objects = job.session.build()
    path = job.session.checkpoint(objects, 0, job.checkpoint_dir).path
    job.session.resume(path)
    assert places == ["cpu", "cpu"]  # not the job's device (a torch.device, here the CPU's)


class OneStreamPerDevice:
    """torch.cuda's random streams as a job on GPU 1 of two sees them (no GPU needed)."""

    def __init__(self) -> None:
        self.streams = {0: torch.tensor([0], dtype=torch.uint8), 1: torch.tensor([1], dtype=torch.uint8)}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "current_device", lambda: 1)
        monkeypatch.setattr(cuda, "get_rng_state", lambda device="cuda": self.streams[1].clone())
        monkeypatch.setattr(cuda, "get_rng_state_all", lambda: [s.clone() for s in self.streams.values()])

        def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
            self.streams[1] = state.clone()  # "cuda": the current device

        def set_rng_state_all(states: list[torch.Tensor]) -> None:
            self.streams = dict(enumerate(s.clone() for s in states))

        monkeypatch.setattr(cuda, "set_rng_state", set_rng_state)
        monkeypatch.setattr(cuda, "set_rng_state_all", set_rng_state_all)


def test_a_checkpoint_holds_and_restores_the_random_stream_of_its_own_gpu_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DDP rank 1 resumes from the checkpoint rank 0 wrote: with every GPU's streams restored by
    index, its own GPU's stream went back to rank 0's copy of it, which rank 0 never drew from."""
    written_by_rank_0 = OneStreamPerDevice()
    written_by_rank_0.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    written_by_rank_0.streams[0] = torch.tensor([7], dtype=torch.uint8)  # rank 0 drew on GPU 0
    monkeypatch.setattr(
        torch.cuda, "get_rng_state", lambda device="cuda": written_by_rank_0.streams[0].clone()
    )
    saved = rng_state()
    assert torch.equal(saved["cuda"], torch.tensor([7], dtype=torch.uint8))

    rank_1 = OneStreamPerDevice()
    rank_1.install(monkeypatch)
    set_rng_state(saved)
    assert rank_1.streams[1].tolist() == [7]  # its own GPU's stream, where rank 0's stood
    assert rank_1.streams[0].tolist() == [0]  # another GPU's, untouched
    set_rng_state(
        {**saved, "cuda": [torch.tensor([5], dtype=torch.uint8), torch.tensor([6], dtype=torch.uint8)]}
    )
    assert rank_1.streams[1].tolist() == [6]  # a checkpoint written before: its entry for this GPU


def test_a_gpu_jobs_peak_memory_is_in_its_result(
    make_job: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an out-of-memory error on the GPU is measured against; nothing on the CPU."""
    job = make_job(digits_spec(steps=2, checkpoint_every=2, eval_every=2))
    outcome = job.run()
    assert outcome.gpu_memory_peak_mb is None
    asked: list[Any] = []
    monkeypatch.setattr(
        torch.cuda, "max_memory_allocated", lambda device: asked.append(device) or 3.5 * 2**20
    )
    job.session.torch_device = torch.device("cuda", 0)  # as a job on a GPU has it
    assert job.session.details(None) == {"gpu_memory_peak_mb": 3.5}
    assert asked == [torch.device("cuda", 0)]


class MadeCurrent(Exception):
    """Where the test stops the session: torch.cuda.set_device was called."""


@pytest.mark.parametrize(("device", "index"), [(torch.device("cuda", 1), 1), (torch.device("cuda"), 0)])
def test_a_job_on_one_gpu_makes_it_the_current_device(
    device: torch.device, index: int, make_job: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.cuda's random stream calls act on the current device: a job run by hand on cuda:1 had
    saved (and a probe step put back) cuda:0's stream while it drew from cuda:1's. Only DDP ranks had
    set their device. A bare "cuda" (`auto`, `cuda`) is GPU 0: torch's set_device refuses it."""
    from jobs.frameworks import torch_driver

    real = torch.cuda.set_device

    def made_current(chosen: Any) -> None:
        with pytest.raises(ValueError, match=r"Expected a torch\.device with a specified index"):
            real(torch.device("cuda"))  # a bare "cuda": no index, refused
        raise MadeCurrent(repr(chosen))

    monkeypatch.setattr(torch_driver, "rank_device", lambda requested, rank: device)
    monkeypatch.setattr(torch.cuda, "set_device", made_current)
    with pytest.raises(MadeCurrent, match=rf"^{index}$"):
        make_job(digits_spec(steps=2, checkpoint_every=2, eval_every=2))
