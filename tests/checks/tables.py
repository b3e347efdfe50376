"""The targets the checker is held to: every optimizer that must pass, every broken one that must not.

Shared by the table tests.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.checks.target import Target, resolve_target

ROOT = Path(__file__).resolve().parents[2]
BROKEN_DIR = Path(__file__).resolve().parent / "broken"

# The frameworks' own optimizers the issue names: none of them may fail a check.
FRAMEWORK_BUILTINS = (
    "torch.optim:SGD",
    "torch.optim:Adam",
    "torch.optim:AdamW",
    "torch.optim:RMSprop",
    "torch.optim:Adagrad",
    # torch's other built-ins (Rprop's and LBFGS's true faults are held in their own tests: Rprop
    # reads lr only as its initial step size, LBFGS moves a parameter whose gradient became None).
    "torch.optim:ASGD",
    "torch.optim:Adadelta",
    "torch.optim:Adafactor",
    "torch.optim:Adamax",
    "torch.optim:Muon",  # 2-D parameters only: construct says so, nothing fails
    "torch.optim:NAdam",
    "torch.optim:RAdam",
    "torch.optim:SparseAdam",  # sparse gradients only: judged by `sparse`
    "keras.optimizers:SGD",
    "keras.optimizers:Adam",
    "keras.optimizers:AdamW",
    "keras.optimizers:Lion",
    "keras.optimizers:RMSprop",
    # The other Keras 3 built-ins, for the no-false-alarm table of the real-world optimizers issue.
    "keras.optimizers:Adadelta",
    "keras.optimizers:Adafactor",
    "keras.optimizers:Adagrad",
    "keras.optimizers:Adamax",
    "keras.optimizers:Ftrl",
    "keras.optimizers:Lamb",
    "keras.optimizers:Muon",
    "keras.optimizers:Nadam",
    "keras.optimizers:ScheduleFreeAdamW",
    "tf_keras.optimizers.legacy:SGD",
    "tf_keras.optimizers.legacy:Adam",
    "examples/plugins/sign_momentum.py:SignMomentum",
)


@dataclass(frozen=True)
class Broken:
    """A deliberately broken optimizer and the checks that must catch it (and no others)."""

    path: Path
    class_name: str
    expected_failures: frozenset[str]
    expected_warnings: frozenset[str]

    @property
    def text(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.class_name}"


def broken_corpus() -> list[Broken]:
    """Every file in tests/checks/broken: one optimizer class and its EXPECTED_FAILURES."""
    corpus = []
    for path in sorted(BROKEN_DIR.glob("*.py")):
        source = path.read_text()
        module = _module_constants(path)
        class_names = [
            line.split("class ", 1)[1].split("(", 1)[0].strip()
            for line in source.splitlines()
            if line.startswith("class ")
        ]
        assert len(class_names) == 1, f"{path.name} must define exactly one optimizer class"
        corpus.append(
            Broken(
                path=path,
                class_name=class_names[0],
                expected_failures=frozenset(module["EXPECTED_FAILURES"]),
                expected_warnings=frozenset(module.get("EXPECTED_WARNINGS", ())),
            )
        )
    return corpus


def _module_constants(path: Path) -> dict[str, Any]:
    """EXPECTED_* read from the source text: importing would load the file's framework."""
    namespace: dict[str, Any] = {}
    for line in path.read_text().splitlines():
        if line.startswith("EXPECTED_"):
            exec(line, {"frozenset": frozenset}, namespace)  # our own test data, one constant per line
    assert "EXPECTED_FAILURES" in namespace, f"{path.name} must set EXPECTED_FAILURES"
    return namespace


def target_of(text: str, style: str | None = None) -> Target:
    """Like the CLI, but legacy registered names too in this one process (pytest imports
    tf_keras directly, as the legacy built-ins do)."""
    if style == "tf_legacy" and ":" not in text:
        from optimizers.registry import load_registry

        return Target(text, load_registry(plugin_dirs=[], styles=("tf_legacy",)).get(text, "tf_legacy"))
    return resolve_target(text, style=style)


def spec_exists(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
