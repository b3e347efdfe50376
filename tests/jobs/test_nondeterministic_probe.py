"""A probe step that runs an op with no deterministic implementation (on CUDA, under the job's
`use_deterministic_algorithms(True, warn_only=True)`) cannot be compared bitwise: such a job is
told the comparison was inconclusive, not that state_dict() lost state, unless the difference is
far beyond what the op's rounding explains.

No GPU here: the optimizers below stand in for one, issuing torch's own warning (category and
words, as ATen's alertNotDeterministic issues it) and adding noise that differs between two runs of
the same step, as a reduction summed in a varying order does."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from jobs.frameworks.torch_driver import CheckpointMismatch, nondeterministic_ops
from jobs.spec import JobSpec

from .helpers import digits_spec, registry_with

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:cumsum_cuda_kernel does not have a deterministic"),
]

OP = "cumsum_cuda_kernel"  # the name ATen gives floating-point cumsum on CUDA as it warns
TORCH_WARNING = (
    f"{OP} does not have a deterministic implementation, but you set "
    "'torch.use_deterministic_algorithms(True, warn_only=True)'. You can file an issue at "
    "https://github.com/pytorch/pytorch/issues to help us prioritize adding deterministic support "
    "for this operation."
)


def test_torch_s_own_warning_names_the_op() -> None:
    """The words the stand-ins below copy are torch's: a real alert (put_ without accumulate warns
    on CPU too) is read, and still reaches the caller's filters."""
    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)  # as make_deterministic sets it
    try:
        with pytest.warns(UserWarning, match="put_ does not have a deterministic implementation"):
            with nondeterministic_ops() as ran:
                torch.zeros(3).put_(torch.tensor([1]), torch.tensor([1.0]))
                torch.zeros(3).put_(torch.tensor([2]), torch.tensor([1.0]))  # each op named once
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    assert ran == ["put_"]


# Each step's noise has the other sign of the step before: the step from the saved objects and the
# one from the reloaded objects, taken one after the other, always differ (a clock's parity could
# agree twice and let the test pass without the fix).
_steps = itertools.count()


def nondeterministic_scale() -> float:
    """What a step's nondeterministic CUDA kernel (say, summing a gradient) could multiply its
    result by, about 1e-6 off either way; torch warns as it runs."""
    warnings.warn(TORCH_WARNING, UserWarning, stacklevel=2)
    return 1 + (-1) ** next(_steps) * 2**-20


class NoisyMomentum(torch.optim.Optimizer):
    """Correct: all its state is in self.state[p]; only its gradient is nondeterministic."""

    def __init__(self, params: Any, lr: float = 0.05, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        noise = nondeterministic_scale()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    momentum = self.state[p].setdefault("momentum", torch.zeros_like(p))
                    momentum.mul_(group["beta"]).add_(p.grad, alpha=noise)
                    p.add_(momentum, alpha=-group["lr"])


class NoisyAttributeMomentum(torch.optim.Optimizer):
    """BROKEN on purpose, and nondeterministic too: its momentum lives in a plain dict, which
    state_dict() never sees, so a reload starts it from zero."""

    def __init__(self, params: Any, lr: float = 0.05, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})
        self.momenta: dict[torch.Tensor, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        noise = nondeterministic_scale()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    momentum = self.momenta.setdefault(p, torch.zeros_like(p))
                    momentum.mul_(group["beta"]).add_(p.grad, alpha=noise)
                    p.add_(momentum, alpha=-group["lr"])


def spec(name: str, checkpoint_every: int) -> JobSpec:
    return digits_spec(
        optimizer={"name": name, "params": {"lr": 0.05}}, steps=12, checkpoint_every=checkpoint_every
    )


# Mid-run, the reloaded objects' probe step is the loop's next step; at the end, a twin's.
FIRST_CHECKPOINT = pytest.mark.parametrize("first", [5, 12], ids=["mid-run", "at the end only"])


@FIRST_CHECKPOINT
def test_a_nondeterministic_step_makes_the_probe_inconclusive_not_a_failure(
    make_job: Callable[..., Any], first: int
) -> None:
    result = make_job(spec("noisy_momentum", first), with_registry=registry_with(NoisyMomentum)).run()
    assert [c.ok for c in result.checkpoints] == [True] * len(result.checkpoints)
    inconclusive = [w for w in result.warnings if "inconclusive" in w]
    assert len(inconclusive) == 1  # once a job, not at every checkpoint: its cause is the same each time
    assert inconclusive[0].endswith("later checkpoints whose probe step is inconclusive too are not listed)")
    assert inconclusive[0].startswith(
        f"step {first}: the checkpoint's probe step was inconclusive: it ran {OP}"
    )
    assert "(no deterministic implementation on this device)" in inconclusive[0]
    assert "differ by up to " in inconclusive[0] and "max abs difference" in inconclusive[0]


@FIRST_CHECKPOINT
def test_lost_state_still_fails_when_the_step_is_nondeterministic(
    make_job: Callable[..., Any], first: int
) -> None:
    job = make_job(
        spec("noisy_attribute_momentum", first), with_registry=registry_with(NoisyAttributeMomentum)
    )
    with pytest.raises(CheckpointMismatch, match="the next step differs") as raised:
        job.run()
    # Blamed on the lost state, and the nondeterministic op named and ruled out by the size.
    assert f"the step ran {OP}" in str(raised.value)
    assert "far more than such an op's rounding" in str(raised.value)
    assert [(c.step, c.ok) for c in job.verified] == [(first, False)]


def test_a_warning_of_the_probe_reaches_the_log_once_not_at_every_checkpoint() -> None:
    """Each checkpoint's probe runs the same ops: their warnings had been printed at every one."""

    def probe() -> None:
        warnings.warn("a warning the probe step raises", UserWarning, stacklevel=1)

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        for _ in range(3):  # three checkpoints
            with nondeterministic_ops():
                probe()
    assert [str(w.message) for w in shown] == ["a warning the probe step raises"]
