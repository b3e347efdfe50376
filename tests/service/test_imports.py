"""The service's imports from jobs/: only the light, framework-free modules (read from the source).

`jobs.spec` (specs and the catalogue), `jobs.result` (status, progress, result) and
`jobs.processes` (process groups; standard library only, so the worker and the supervisor
use the one copy the job side uses), plus `jobs.checks.report` for the CLI's check table.
The runtime test that no framework gets imported is test_api's; this one catches a new
`from jobs.x import ...` before it pulls a framework in on some other path.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

ALLOWED_FROM_SERVICE = {
    "jobs.spec",
    "jobs.result",
    "jobs.processes",
    "jobs.checks.report",
    "jobs.data_roots",  # where workloads may read data files: the API checks specs against it
    "jobs.workloads.surfaces",  # the 2-D test functions a study report draws trajectories over
    "jobs.tracking",  # MLflow only: the worker finds experiments and creates a study's parent run
    "jobs.checkpoint_files",  # checkpoint names: the worker clears what an ended attempt left
}
# What the modules the service may import are allowed to import in turn.
LIGHT = {
    "jobs.result": {"pydantic"},
    "jobs.processes": set(),
    "jobs.data_roots": set(),
    "jobs.workloads.surfaces": {"numpy"},
    "jobs.tracking": {"mlflow", "requests"},  # requests: MLflow's own HTTP client, whose errors it reads
    "jobs.metric_delivery": set(),  # jobs.tracking's delivery process
    "jobs.checkpoint_files": set(),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module `path` imports (absolute names) with its line; `from jobs import x` is `jobs.x`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "jobs" and node.level == 0:
            found += [(node.lineno, f"jobs.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def is_jobs(name: str) -> bool:
    return name == "jobs" or name.startswith("jobs.")


SERVICE_FILES = sorted((ROOT / "service").rglob("*.py"))


@pytest.mark.parametrize("path", SERVICE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_service_imports_only_the_light_parts_of_jobs(path: Path) -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for line, name in imported_modules(path)
        if is_jobs(name) and name not in ALLOWED_FROM_SERVICE
    ]
    assert not wrong, f"the service may import only {sorted(ALLOWED_FROM_SERVICE)} from jobs/; found: {wrong}"


def test_the_walk_sees_every_service_module() -> None:
    assert len(SERVICE_FILES) > 10 and ROOT / "service" / "worker.py" in SERVICE_FILES
    names = {name for path in SERVICE_FILES for _, name in imported_modules(path)}
    assert {"jobs.spec", "jobs.result", "jobs.processes"} <= names


@pytest.mark.parametrize("module", sorted(LIGHT))
def test_the_modules_the_service_may_import_are_stdlib_and_pydantic_only(module: str) -> None:
    path = ROOT / (module.replace(".", "/") + ".py")
    allowed = LIGHT[module]
    wrong = [
        f"{module}:{line} imports {name}"
        for line, name in imported_modules(path)
        if name.split(".")[0] not in sys.stdlib_module_names
        and name.split(".")[0] not in allowed
        and name not in LIGHT  # another light module, checked in its turn
        and name != "__future__"
    ]
    assert not wrong, wrong
