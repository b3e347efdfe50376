"""No false alarm over the reference implementations of schedule-free (facebookresearch/schedulefree),
D-Adaptation (facebookresearch/dadaptation) and Prodigy (konstmish/prodigy): every optimizer class
each package defines, through every check, with its own defaults, as `optlab check module:Class`
runs it. A `fail` is allowed only where it is a true fault of the class, named below with its
evidence; every other class must get none.

They differ from their pytorch-optimizer ports in ways the checker once misjudged: schedule-free's
classes start in eval mode and refuse to step before `optimizer.train()`; D-Adaptation and Prodigy
refuse a param group with an lr of its own (a RuntimeError from step(), by design); Prodigy's
`slice_p` is an int stride that halving to 0.5 breaks.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import torch

from jobs.checks.runner import run_checks
from tests.checks.tables import target_of

PACKAGES = ("schedulefree", "dadaptation", "prodigyopt")

# `lr=-0.001` is accepted: the AdamW and RAdam variants validate no argument (adamw_schedulefree.py
# __init__ goes straight to the defaults; the SGD variants check `lr < 0.0`).
_ACCEPTS_NEGATIVE_LR = frozenset({"construct"})
# A row-sparse gradient crashes inside a torch op instead of being refused with a clear error:
# `addcmul_` on SparseCPU (schedule-free), `reshape is not implemented for sparse tensors`
# (dadapt_adam.py:184, dadapt_sgd.py:149, prodigy.py:193), a sparse division (dadapt_adan.py).
_SPARSE_CRASH = frozenset({"sparse"})
# step() takes betas (and Prodigy d_coef) from `self.param_groups[0]` for every group
# (dadapt_adam.py:117-120, prodigy.py:114-124): a second group's own values are ignored.
_FIRST_GROUPS_VALUES = frozenset({"param_groups"})

TRUE_FAULTS: dict[str, frozenset[str]] = {
    "AdamWScheduleFree": _ACCEPTS_NEGATIVE_LR | _SPARSE_CRASH,
    "AdamWScheduleFreeClosure": _ACCEPTS_NEGATIVE_LR | _SPARSE_CRASH,
    "AdamWScheduleFreePaper": _ACCEPTS_NEGATIVE_LR | _SPARSE_CRASH,
    "AdamWScheduleFreeReference": _ACCEPTS_NEGATIVE_LR | _SPARSE_CRASH,
    "RAdamScheduleFree": _ACCEPTS_NEGATIVE_LR | _SPARSE_CRASH,
    "RAdamScheduleFreeClosure": _ACCEPTS_NEGATIVE_LR | _SPARSE_CRASH,
    "DAdaptAdam": _FIRST_GROUPS_VALUES | _SPARSE_CRASH,
    "DAdaptAdan": _SPARSE_CRASH,
    "DAdaptSGD": _SPARSE_CRASH,
    "Prodigy": _FIRST_GROUPS_VALUES | _SPARSE_CRASH,
}


def _classes() -> list[tuple[str, str]]:
    found: dict[str, str] = {}
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, torch.optim.Optimizer) and cls.__module__.startswith(package):
                found[name] = f"{cls.__module__}:{cls.__qualname__}"
    return sorted(found.items())


CLASSES = _classes()


def test_the_table_names_only_classes_of_the_packages() -> None:
    assert len(CLASSES) >= 15  # 9 schedule-free, 5 D-Adaptation, Prodigy
    assert set(TRUE_FAULTS) <= {name for name, _ in CLASSES}


@pytest.mark.parametrize(("name", "text"), CLASSES, ids=[name for name, _ in CLASSES])
def test_no_false_alarm(name: str, text: str, tmp_path: Path) -> None:
    report = run_checks(target_of(text), {}, workdir=tmp_path)
    failed = {r.id: r.detail for r in report.checks if r.status == "fail"}
    assert set(failed) == TRUE_FAULTS.get(name, frozenset()), failed
    # Every check steps a schedule-free class in training mode, as a job does.
    refused = [(r.id, r.status) for r in report.checks if "not in train mode" in r.detail]
    assert not refused, refused
    if "ScheduleFree" in name:
        statuses = {r.id: (r.status, r.detail) for r in report.checks}
        for check in ("param_groups", "closure", "mixed_precision", "resume_exact"):
            assert statuses[check][0] == "pass", (check, statuses[check])


@pytest.mark.parametrize(
    ("name", "status"),
    [
        ("DAdaptLion", "pass"),  # every other value its groups hold reaches their update
        ("Prodigy", "fail"),  # betas and d_coef from the first group (see TRUE_FAULTS)
        ("DAdaptSGD", "skip"),  # nothing but the lr to vary (momentum and weight decay are 0)
    ],
)
def test_a_class_that_refuses_a_group_lr_is_judged_on_its_other_values(
    name: str, status: str, tmp_path: Path
) -> None:
    (text,) = [text for found, text in CLASSES if found == name]
    (result,) = run_checks(target_of(text), {}, only=["param_groups"], workdir=tmp_path).checks
    assert result.status == status, result.detail
    if status == "skip":
        assert "refuses param groups with a clear error (RuntimeError: Setting different lr" in result.detail
    else:
        assert "lr left alike: the class refuses a group lr of its own" in result.detail, result.detail
        assert "betas=(0.45" in result.detail, result.detail
