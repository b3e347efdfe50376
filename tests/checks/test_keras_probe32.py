"""Faults and false alarms a probe of the Keras 3 and legacy tf.keras checks found (/tmp/probeB), each
as a small class here with the check that now judges it rightly, the correct pattern beside a fault
where one could be taken for the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keras
import pytest
from keras import ops

from jobs.checks.context import CheckContext
from jobs.checks.report import Outcome
from jobs.checks.runner import checks_for_style
from tests.checks.tables import target_of


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("keras-probe32")


def _run(
    check_id: str, name: str, workdir: Path, style: str | None = None, params: dict[str, Any] | None = None
) -> Outcome:
    ctx = CheckContext(target=target_of(f"{__name__}:{name}", style), params=params or {}, workdir=workdir)
    return checks_for_style(ctx.target.style)[check_id](ctx)


class SerializedInnerLookahead(keras.optimizers.Optimizer):
    """Lookahead over an inner optimizer kept serialized in its config, as Keras's LossScaleOptimizer
    keeps its own: a name or that dict given, the optimizer deserialized from it held. Correct."""

    def __init__(
        self,
        optimizer: Any = "adam",
        learning_rate: float = 1e-3,
        k: int = 5,
        alpha: float = 0.5,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)
        if isinstance(optimizer, dict):
            optimizer = keras.optimizers.deserialize(optimizer)
        self._inner = keras.optimizers.get(optimizer)
        self.k, self.alpha = k, alpha

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._inner.build(var_list)
        for inner in self._inner.variables:
            self._track_variable(inner)
        self._slow = [self.add_variable_from_reference(v, "slow", initializer=v) for v in var_list]

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        slow = self._slow[self._get_variable_index(variable)]
        self._inner.iterations.assign(self.iterations)
        self._inner.update_step(gradient, variable, learning_rate)
        sync = ops.equal((self.iterations + 1) % self.k, 0)
        new_slow = slow + self.alpha * (variable - slow)
        self.assign(slow, ops.where(sync, new_slow, slow))
        self.assign(variable, ops.where(sync, new_slow, variable))

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update(optimizer=keras.optimizers.serialize(self._inner), k=self.k, alpha=self.alpha)
        return config


class DefaultInnerLookahead(SerializedInnerLookahead):
    """The inner optimizer serialized as the default one, whichever was given: a reload steps with
    Adam where SGD was asked for."""

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["optimizer"] = keras.optimizers.serialize(keras.optimizers.Adam())
        return config


@pytest.mark.parametrize("inner", ["adam", "sgd"])
def test_an_inner_optimizer_kept_serialized_passes_config_roundtrip(workdir: Path, inner: str) -> None:
    outcome = _run("config_roundtrip", "SerializedInnerLookahead", workdir, params={"optimizer": inner})
    assert outcome.status == "pass", outcome.detail


def test_an_inner_optimizer_serialized_as_another_fails_config_roundtrip(workdir: Path) -> None:
    outcome = _run("config_roundtrip", "DefaultInnerLookahead", workdir, params={"optimizer": "sgd"})
    assert outcome.status == "fail", outcome.detail
    assert "get_config()['optimizer']" in outcome.detail and "expected 'sgd'" in outcome.detail
