"""No false alarm over the whole published pytorch-optimizer catalogue.

Every class `pytorch_optimizer.get_supported_optimizers()` lists goes through every check with its
own defaults, as `optlab check module:Class` runs it. A `fail` is allowed only where it is a true
fault of the class, named below with its evidence; every other class must get none. Classes that
cannot be built from defaults alone must say what they need instead of failing. The figures
before and after the false-alarm work are in benchmarks/pytorch_optimizer_survey.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.checks.runner import run_checks
from jobs.checks.target import UsageError
from tests.checks.tables import target_of

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")

# The true faults: class -> the checks it fails, each with its evidence.
TRUE_FAULTS: dict[str, frozenset[str]] = {
    # `self.base_lrs` is built once in __init__ (adabound.py:72) and indexed by group number in
    # step(): a group added by add_param_group has no entry -> IndexError.
    "AdaBound": frozenset({"param_groups"}),
    # One step on bfloat16 parameters makes every parameter non-finite; the same step in float32
    # stays finite (reproduced outside the checker with nn.Linear(4, 3)).
    "Adai": frozenset({"mixed_precision"}),
    # The 500-step warm-up rate is computed from `self.lr`, the constructor's value
    # (apollo.py:166), not group['lr']: a group's own lr, and a schedule, are ignored meanwhile.
    "ApolloDQN": frozenset({"param_groups", "schedule"}),
    # step() reads lr and betas from `self.param_groups[0]` for every group (dadapt.py, the
    # `group = self.param_groups[0]` before the loop): a second group's own lr is ignored.
    "DAdaptAdam": frozenset({"param_groups"}),
    "DAdaptAdan": frozenset({"param_groups"}),
    "DAdaptLion": frozenset({"param_groups"}),
    # The same in Prodigy (prodigy.py:190-196: `group = self.param_groups[0]`, then its betas and
    # d_lr for every group): a second group's betas are ignored. Seen once param_groups stepped on
    # two different batches (Adam's step with one gradient twice does not depend on its betas).
    "Prodigy": frozenset({"param_groups"}),
    # `normalize_lr` divides only the constructor's lr by 1 + grokfast_lamb (grokfast.py:162); a
    # group's own lr is used as given, so the same lr steps (1 + lamb) times larger in a group.
    "GrokFastAdamW": frozenset({"param_groups"}),
    # state_dict() holds Python objects that torch.load(weights_only=True), torch's default since
    # 2.6, refuses: collections.deque (AdaShift), GaLoreProjector (Conda), PreConditioner
    # (ScalableShampoo), LMONorm (SCION, SCIONLight); a resumed job cannot read its checkpoint.
    "AdaShift": frozenset({"state_roundtrip", "resume_exact"}),
    "Conda": frozenset({"state_roundtrip", "resume_exact"}),
    "ScalableShampoo": frozenset({"state_roundtrip", "resume_exact"}),
    "SCION": frozenset({"state_roundtrip", "resume_exact"}),
    "SCIONLight": frozenset({"state_roundtrip", "resume_exact"}),
    # Accepts any parameters and crashes inside torch.matmul ("mat1 and mat2 shapes cannot be
    # multiplied") on anything but LoRA pairs, instead of refusing them with a clear error.
    "LoRARite": frozenset({"dense_step"}),
    # torch's own LBFGS keeps its curvature history over all parameters, so a parameter whose
    # gradient became None (frozen after a step) still moves: reproduced outside the checker with
    # two parameters, the second left out of the loss after one step, moved by 1.6e-5.
    "LBFGS": frozenset({"none_grads"}),
}
# Warnings that name their cause, checked in their words. AliG's step size uses the closure's loss,
# which in a plain DDP loop is each rank's own half-batch loss (DDP averages gradients, not losses):
# the replicas take different steps, and agree once the closure returns the ranks' mean, as optlab's
# jobs do (it was a fail before the check tried that).
NAMED_WARNINGS: dict[str, dict[str, str]] = {"AliG": {"distributed": "the class steps by the loss"}}
# Faults that show on some CPUs and not on others: the same float32 steps, rounded along another
# vector path (the BLAS kernel the CPU's instruction set selects), either blow up or do not. Such a
# check may fail or pass; no other check may fail.
FRAGILE_FAULTS: dict[str, frozenset[str]] = {
    # On a 1-D parameter (a bias) the preconditioner's matrix root is taken of a nearly singular
    # matrix: on one CI machine it turned non-finite by step 9 (the next linalg.svd raised), on
    # another the loss fell to 0.997 of its start in 20 steps.
    "Shampoo": frozenset({"descends"}),
}

# Classes that cannot be built from their defaults alone: what the report must say instead.
NEEDS_INPUT: dict[str, str] = {
    # Params must be group dicts with `use_muon` (a param-group recipe: `--param-groups`).
    "Muon": "Tensor.__contains__",
    "AdaMuon": "Tensor.__contains__",
    "AdaGO": "Tensor.__contains__",
    "MuonClip": "Tensor.__contains__",
    "NorMuon": "Tensor.__contains__",
    "DistributedMuon": "Tensor.__contains__",
    # The constructor takes the model (or its named_parameters()), not parameters: a job hands it that.
    "LOMO": "is built over the model (its 'model' argument)",
    "AdaLOMO": "is built over the model (its 'model' argument)",
    "AdamMini": "is built over the model (its 'model' argument)",
    # A wrapper: its base optimizer must be named.
    "Magma": "wraps a base optimizer",
    # An optional dependency of pytorch-optimizer that is not installed.
    "DeMo": "einops",
}
# Required arguments without a default: a usage error naming the argument.
REQUIRED: dict[str, str] = {"BSAM": "num_data", "Ranger21": "num_iterations"}


def _catalogue() -> list[tuple[str, str]]:
    from pytorch_optimizer.optimizer import OPTIMIZERS

    classes = [
        OPTIMIZERS[e] if isinstance(e, str) else e for e in pytorch_optimizer.get_supported_optimizers()
    ]
    return [(cls.__name__, f"{cls.__module__}:{cls.__name__}") for cls in classes]


CATALOGUE = _catalogue()


def test_the_table_names_only_classes_of_the_catalogue() -> None:
    names = {name for name, _ in CATALOGUE}
    assert set(TRUE_FAULTS) | set(FRAGILE_FAULTS) | set(NEEDS_INPUT) | set(REQUIRED) <= names


@pytest.mark.parametrize(("name", "text"), CATALOGUE, ids=[name for name, _ in CATALOGUE])
def test_no_false_alarm(name: str, text: str, tmp_path: Path) -> None:
    if name in REQUIRED:
        with pytest.raises(UsageError, match=REQUIRED[name]):
            run_checks(target_of(text), {}, workdir=tmp_path)
        return
    report = run_checks(target_of(text), {}, workdir=tmp_path)
    failed = {r.id: r.detail for r in report.checks if r.status == "fail"}
    if name in NEEDS_INPUT:
        (construct,) = [r for r in report.checks if r.id == "construct"]
        assert construct.status == "skip" and NEEDS_INPUT[name] in construct.detail, construct
        assert all(r.status == "skip" for r in report.checks), failed
        return
    always, maybe = TRUE_FAULTS.get(name, frozenset()), FRAGILE_FAULTS.get(name, frozenset())
    assert always <= set(failed) <= always | maybe, failed
    warned = {r.id: r.detail for r in report.checks if r.status == "warn"}
    for check_id, words in NAMED_WARNINGS.get(name, {}).items():
        assert words in warned.get(check_id, ""), (check_id, warned)
