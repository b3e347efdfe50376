"""`compile` (torch.compile of a torch job's model): a torch-only spec flag, a job whose checkpoints
hold the plain model's keys and resume exactly, and the compile cost in the result.

Compiling digits_mlp's MLP takes seconds (inductor generates and builds C++), so one test compiles
and checks everything a compiled job must do; Dynamo reuses its graphs for every later build of
the same model in the process (the checkpoint's reloaded objects, the resumed job).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from .helpers import digits_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MakeJob = Callable[..., Any]


def test_compile_is_off_unless_asked() -> None:
    assert digits_spec().compile is False
    assert digits_spec(compile=True).compile is True


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            {"framework": "tensorflow", "optimizer": {"name": "adam", "style": "keras"}, "compile": True},
            "compile (torch.compile) is for torch jobs; a tensorflow job compiles its step with jit_compile",
        ),
        ({"compile": "yes"}, "Input should be a valid boolean"),
        ({"jit_compile": True}, "jit_compile (XLA) is for tensorflow jobs; a torch job compiles its model"),
        ({"compile": 1}, "Input should be a valid boolean"),  # strict: no 1 for true
    ],
)
def test_a_compile_flag_that_cannot_apply_is_refused_at_the_field(
    overrides: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValidationError) as raised:
        digits_spec(**overrides)
    (error,) = raised.value.errors()
    assert error["loc"] == (next(key for key in overrides if "compile" in key),)
    assert says in error["msg"]


def _model_state(path: Any) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(path, weights_only=True)["model"]
    return state


def test_a_compiled_job_checkpoints_the_plain_model_resumes_exactly_and_reports_its_cost(
    make_job: MakeJob,
) -> None:
    spec = digits_spec(compile=True, checkpoint_every=10, steps=30)
    compiled_job = make_job(spec)
    compiled = compiled_job.run()
    assert compiled.checkpoints_verified == 3 and compiled.warnings == []
    # The first compiled job in this process paid for compiling (the forward and the backward).
    assert compiled.compile_seconds is not None and compiled.compile_seconds > 0
    assert compiled.compiles is not None and compiled.compiles >= 1

    plain_job = make_job(digits_spec(checkpoint_every=10, steps=30))
    plain = plain_job.run()
    assert plain.compile_seconds is None and plain.compiles is None
    compiled_state = _model_state(compiled_job.last_checkpoint)
    plain_state = _model_state(plain_job.last_checkpoint)
    assert list(compiled_state) == list(plain_state)  # no `_orig_mod.` prefix
    # Not bitwise: inductor fuses the ops and sums in its own order (the bias gradients, the loss),
    # so the weights differ from eager in the last bits. The same math: close after 30 steps.
    for key, value in plain_state.items():
        torch.testing.assert_close(compiled_state[key], value, rtol=1e-4, atol=1e-5)

    # Checkpoints of a compiled job resume exactly: the same weights as the straight run.
    first_leg = make_job(spec)
    first_leg.run(stop_after=20)
    resumed = make_job(spec).run(resume_from=first_leg.last_checkpoint)
    assert resumed.resumed_from_step == 20
    assert resumed.params_sha256 == compiled.params_sha256
    assert resumed.compiles == 0  # Dynamo's graphs from the first job served this one
