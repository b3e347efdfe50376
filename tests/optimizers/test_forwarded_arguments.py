"""A constructor's **kwargs handed on untouched to the next class's constructor bring that one's
arguments into the catalogue (a subclass of AdamW adding one argument takes AdamW's `lr`); anything
less certain keeps to the class's own signature. One table of shapes, then what a job and a check
make of such a class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import pytest
import tf_keras
import torch

from jobs.checks import rate_checks
from jobs.checks.context import CheckContext
from jobs.checks.runner import validated_params
from jobs.checks.target import resolve_target
from optimizers.registry import derive_params, entry_for_class


class CentralizedAdamW(torch.optim.AdamW):
    """Adds one argument; AdamW's come through **kwargs."""

    def __init__(self, params: Any, centralize: bool = True, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.centralize = centralize


class NamedParentSGD(torch.optim.SGD):
    """The parent named, not super(); `lr` filled by the call itself."""

    def __init__(self, params: Any, scale: float = 2.0, **kwargs: Any) -> None:
        torch.optim.SGD.__init__(self, params, 0.01 * scale, **kwargs)


class FixedRateSGD(torch.optim.SGD):
    """`lr` filled by keyword in the call: not a hyperparameter of this class."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, lr=0.05, **kwargs)


class DefaultMomentumSGD(torch.optim.SGD):
    """Changes a default SGD's signature states: the catalogue cannot know the class's, so it keeps
    to the class's own arguments."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        kwargs.setdefault("momentum", 0.9)
        super().__init__(params, **kwargs)


class OwnBase(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.1, beta: float = 0.5, **kwargs: Any) -> None:
        super().__init__(params, {"lr": lr, "beta": beta, **kwargs})


class TwoLevels(OwnBase):
    """Through a base of the user's own, which hands nothing on to torch's (its dict is no **kwargs)."""

    def __init__(self, params: Any, gamma: float = 1.0, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.gamma = gamma


class BareOptimizer(torch.optim.Optimizer):
    """Straight to the framework's base class, whose arguments are not hyperparameters."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)


class GradientCentralizedAdam(keras.optimizers.Adam):
    """Keras: Adam's arguments through **kwargs, its framework options still left out."""

    def __init__(self, centralize: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.centralize = centralize


class KerasFromScratch(keras.optimizers.Optimizer):
    """Keras 3's base requires a rate: one handed on through **kwargs is the class's `lr`."""

    def __init__(self, beta: float = 0.9, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.beta = beta


class KerasFixedRate(keras.optimizers.Optimizer):
    """Fills the base's rate itself (A2Grad, AliG): a caller's would be given twice."""

    def __init__(self, beta: float = 0.9, name: str = "fixed", **kwargs: Any) -> None:
        super().__init__(learning_rate=1.0, name=name, **kwargs)
        self.beta = beta


class KerasFixedRateByPosition(keras.optimizers.Optimizer):
    """The same, the rate passed first by position (Keras 3's first argument)."""

    def __init__(self, beta: float = 0.9, **kwargs: Any) -> None:
        super().__init__(1.0, **kwargs)
        self.beta = beta


class KerasNoKeywords(keras.optimizers.Optimizer):
    """Takes no keyword it does not name: no rate can reach its base."""

    def __init__(self, beta: float = 0.9) -> None:
        super().__init__(learning_rate=0.5, name="no_keywords")
        self.beta = beta


class LegacyFixedStep(tf_keras.optimizers.legacy.Optimizer):
    """tf.keras's legacy base takes no learning rate (COCOB names none)."""

    def __init__(self, alpha: float = 100.0, name: str = "LegacyFixedStep", **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self._set_hyper("alpha", alpha)


DEFAULT_SCHEDULE = keras.optimizers.schedules.CosineDecay(1e-3, 100)


class KerasScheduledByDefault(keras.optimizers.Optimizer):
    """Names its rate, whose default is a schedule (no plain number): still its rate."""

    def __init__(self, learning_rate: Any = DEFAULT_SCHEDULE) -> None:
        super().__init__(learning_rate=learning_rate)


class KerasParentWithoutKeywords(keras.optimizers.Optimizer):
    def __init__(self, beta: float = 0.9) -> None:
        super().__init__(learning_rate=0.1)
        self.beta = beta


class KerasThroughAParentWithoutKeywords(KerasParentWithoutKeywords):
    """Its keywords stop at a parent that takes none: a rate given to it would be refused there."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)


class LegacyAdamTouchingItsKeywords(tf_keras.optimizers.legacy.Adam):
    """Changes its kwargs on the way to legacy Adam, so they cannot be followed: Adam's rate is assumed."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("epsilon", 1e-8)
        super().__init__(**kwargs)


@pytest.mark.parametrize(
    ("cls", "style", "expected"),
    [
        (CentralizedAdamW, "torch", ["centralize", "lr", "betas", "eps", "weight_decay", "amsgrad"]),
        (NamedParentSGD, "torch", ["scale", "momentum", "dampening", "weight_decay", "nesterov"]),
        (FixedRateSGD, "torch", ["momentum", "dampening", "weight_decay", "nesterov"]),
        (DefaultMomentumSGD, "torch", []),
        (TwoLevels, "torch", ["gamma", "lr", "beta"]),
        (BareOptimizer, "torch", []),
        (
            GradientCentralizedAdam,
            "keras",
            ["centralize", "lr", "beta_1", "beta_2", "epsilon", "amsgrad", "weight_decay"],
        ),
        (KerasFromScratch, "keras", ["lr", "beta"]),
        (KerasFixedRate, "keras", ["beta"]),
        (KerasFixedRateByPosition, "keras", ["beta"]),
        (KerasNoKeywords, "keras", ["beta"]),
        (LegacyFixedStep, "tf_legacy", ["alpha"]),
        (KerasScheduledByDefault, "keras", ["lr"]),
        (KerasThroughAParentWithoutKeywords, "keras", ["beta"]),
        (LegacyAdamTouchingItsKeywords, "tf_legacy", ["lr"]),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_arguments_handed_on_untouched_are_the_class_s(cls: type, style: str, expected: list[str]) -> None:
    params, _ = derive_params(cls, style)
    assert list(params) == expected


def test_a_class_without_source_keeps_to_its_own_signature() -> None:
    namespace: dict[str, Any] = {"torch": torch}
    exec(  # a class with no file to read, as one made at run time
        "class Made(torch.optim.AdamW):\n"
        "    def __init__(self, params, centralize=True, **kwargs):\n"
        "        super().__init__(params, **kwargs)\n",
        namespace,
    )
    params, _ = derive_params(namespace["Made"], "torch")
    assert list(params) == ["centralize"]


def test_a_job_sets_the_rate_the_parent_takes() -> None:
    entry = entry_for_class(CentralizedAdamW, source="tests")
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = entry.create({"lr": 0.05, "weight_decay": 0.0}, model_params=[weight])
    assert optimizer.param_groups[0]["lr"] == 0.05 and optimizer.param_groups[0]["weight_decay"] == 0.0


def test_the_schedule_check_judges_the_rate_the_parent_takes(tmp_path: Path) -> None:
    """Before: skipped as "the class takes no learning rate"."""
    target = resolve_target(f"{__name__}:CentralizedAdamW", framework="torch")
    ctx = CheckContext(target=target, params=validated_params(target, {}), workdir=tmp_path)
    outcome = rate_checks.check_schedule(ctx)
    assert outcome.status == "pass", outcome.detail
