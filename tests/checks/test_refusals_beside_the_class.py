"""A class's refusal may be raised by a helper of the user's own, in another file beside it: the probe's
SGD raising "does not support sparse gradients" from its `probe_helpers.py` failed `sparse` as a crash
inside the update, and its 2-D-only and float32-only siblings failed `dense_step` and `mixed_precision`,
where the same `raise` in the class's file is a clear refusal. An installed package's `raise` under the
same folder is still no refusal of the class's."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from jobs.checks import build_checks, rate_checks, torch_only  # noqa: E402
from jobs.checks.context import CheckContext  # noqa: E402
from jobs.checks.runner import validated_params  # noqa: E402
from jobs.checks.target import resolve_target  # noqa: E402
from jobs.checks.tools import CodeHome, RefusalFiles  # noqa: E402

HELPERS = """
def dense_grad(p, name):
    if p.grad.is_sparse:
        raise RuntimeError(f"{name} does not support sparse gradients")
    return p.grad


def matrix_only(p, name):
    if p.dim() != 2:
        raise ValueError(f"{name} only supports 2D parameters, got {p.dim()}D")


def float32_only(p, name):
    if p.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name} supports only float32/float64 parameters, got {p.dtype}")
"""

CLASSES = """
import torch

from {helpers} import dense_grad, float32_only, matrix_only


class HelperSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-2, momentum=0.9, refuse=""):
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {{lr}}")
        super().__init__(params, dict(lr=lr, momentum=momentum))
        self.refuse = refuse

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.refuse == "2d":
                    matrix_only(p, "HelperSGD")
                if self.refuse == "float32":
                    float32_only(p, "HelperSGD")
                g = dense_grad(p, "HelperSGD")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                state["momentum_buffer"].mul_(group["momentum"]).add_(g)
                p.add_(state["momentum_buffer"], alpha=-group["lr"])
"""


@pytest.fixture
def beside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The class's file and its helper module in one folder, importable as the user's are."""
    helpers = f"helpers_{abs(hash(tmp_path))}"  # a module name of its own in every test
    (tmp_path / f"{helpers}.py").write_text("import torch\n" + HELPERS)
    (tmp_path / "helper_sgd.py").write_text(CLASSES.format(helpers=helpers))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "helper_sgd.py"


def context(path: Path, tmp_path: Path, **params: object) -> CheckContext:
    target = resolve_target(f"{path}:HelperSGD", framework="torch")
    return CheckContext(target=target, params=validated_params(target, params), workdir=tmp_path)


def test_a_sparse_refusal_in_the_users_helper_is_a_refusal(beside: Path, tmp_path: Path) -> None:
    outcome = rate_checks.check_sparse(context(beside, tmp_path))
    assert outcome.status == "pass", outcome
    assert "refuses sparse gradients with a clear error" in outcome.detail, outcome.detail


def test_a_shape_refusal_in_the_users_helper_is_inconclusive(beside: Path, tmp_path: Path) -> None:
    outcome = build_checks.check_dense_step(context(beside, tmp_path, refuse="2d"))
    assert outcome.status == "skip", outcome
    assert "only supports 2D parameters" in outcome.detail, outcome.detail


def test_a_dtype_refusal_in_the_users_helper_is_a_documented_limit(beside: Path, tmp_path: Path) -> None:
    outcome = torch_only.check_mixed_precision(context(beside, tmp_path, refuse="float32"))
    assert outcome.status == "pass", outcome
    assert "supports only float32/float64" in outcome.detail, outcome.detail


def test_an_installed_package_under_the_users_folder_is_not_their_code(tmp_path: Path) -> None:
    """A package's folder counts at any depth, but not a virtual environment inside it."""
    files = RefusalFiles(frozenset(), (CodeHome(tmp_path, recursive=True),))
    assert str(tmp_path / "helpers.py") in files
    assert str(tmp_path / "pkg" / "deep" / "helpers.py") in files
    assert str(tmp_path / ".venv" / "lib" / "python3.11" / "site-packages" / "torch" / "x.py") not in files
    assert str(tmp_path.parent / "elsewhere.py") not in files


def test_a_lone_files_home_is_its_folder_not_what_lies_below_it(tmp_path: Path) -> None:
    """A plugin file kept in a home folder beside a pyenv install or an optlab checkout: the review found
    optlab's own torch_driver.py and a stdlib copyreg.py below it read as the user's refusals."""
    files = RefusalFiles(frozenset(), (CodeHome(tmp_path, recursive=False),))
    assert str(tmp_path / "helpers.py") in files
    assert str(tmp_path / "optlab" / "jobs" / "frameworks" / "torch_driver.py") not in files
    assert str(tmp_path / "env" / "lib" / "python3.11" / "copyreg.py") not in files


def test_python_and_optlab_are_never_the_users_code() -> None:
    """Even where the user's folder holds them (a package folder around a virtual environment)."""
    import sys

    import jobs.checks.tools as tools

    home = CodeHome(Path("/"), recursive=True)
    assert not home.holds(Path(tools.__file__).resolve())
    assert not home.holds(Path(sys.base_prefix).resolve() / "lib" / "python3.11" / "copyreg.py")
