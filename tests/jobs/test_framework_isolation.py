"""A TensorFlow job or check never imports torch, and a torch one never imports TensorFlow.

Each job (a training job, or a check job running the in-process checks) runs as the worker
runs it (`python -m jobs.run SPEC --workdir DIR`, no tracking), in a
child process that lists, once the job is done, which framework modules it loaded. The plugin
folder holds a torch plugin and a Keras one: a job of a built-in optimizer reads neither
(`load_registry(wanted=...)`), and a job of one reads its own file only (`--plugin-file`), so neither
brings the other framework in.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jobs.processes import legacy_keras_environment
from optimizers.registry import PLUGIN_DIRS_ENV
from tests.conftest import ROOT

FRAMEWORKS = ("torch", "tensorflow", "keras", "tf_keras")
# What Keras imports just in case when installed, and no job uses (optimizers/optional_imports.py).
KERAS_OPTIONAL = ("sklearn", "pandas", "matplotlib")
# Which top-level modules a job of each style must never load (these jobs are untracked: a tracked
# job's MLflow client brings pandas), and what each must load: its own framework.
OWN = {"torch": {"torch"}, "keras": {"tensorflow", "keras"}, "tf_legacy": {"tensorflow", "tf_keras"}}
FORBIDDEN = {
    "torch": {"tensorflow", "keras", "tf_keras"},
    "keras": {"torch", *KERAS_OPTIONAL},
    "tf_legacy": {"torch", *KERAS_OPTIONAL},
}

# What `python -m jobs.run` runs (its `__main__` then ends the process at once: exit_without_teardown).
WRAPPER = f"""
import sys
from jobs import run
code = run.main(sys.argv[1:])
print("LOADED", sorted(m for m in sys.modules if m.split(".")[0] in {(*FRAMEWORKS, *KERAS_OPTIONAL)!r}))
sys.exit(code)
"""


# Plugins of both frameworks, as a deployment's plugin folder may hold them.
PLUGINS = {
    "torch_plugin.py": """
import torch


class TorchPluginSGD(torch.optim.SGD):
    pass
""",
    "keras_plugin.py": """
import keras


@keras.saving.register_keras_serializable(package="isolation")
class KerasPluginSGD(keras.optimizers.SGD):
    pass
""",
}


def tiny_spec(style: str) -> dict[str, Any]:
    optimizer: dict[str, Any] = {"name": "sgd", "params": {"lr": 0.1}}
    if style != "torch":
        optimizer["style"] = style
    return {
        "framework": "torch" if style == "torch" else "tensorflow",
        "workload": {"name": "digits_mlp"},
        "optimizer": optimizer,
        "steps": 2,
        "batch_size": 16,
        "checkpoint_every": 2,
        "eval_every": 2,
        "device": "cpu",
    }


def check_spec(style: str) -> dict[str, Any]:
    """The in-process checks only: the fresh-process ones run in children of their own."""
    train = tiny_spec(style)
    checks = ["construct", "dense_step", "sparse", "state_roundtrip", "step_cost", "deprecations"]
    return {
        "kind": "check",
        "framework": train["framework"],
        "optimizer": train["optimizer"],
        "checks": checks,
    }


def run_job(
    tmp_path: Path, style: str, spec: dict[str, Any], *arguments: str
) -> tuple[dict[str, Any], set[str]]:
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    workdir = tmp_path / "work"
    # Legacy Keras from the start: jobs.run would otherwise re-exec itself, and the wrapper with it.
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    for name, source in PLUGINS.items():
        (plugins / name).write_text(source)
    env = {**legacy_keras_environment(os.environ, legacy=style == "tf_legacy"), PLUGIN_DIRS_ENV: str(plugins)}
    completed = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(spec_path), "--workdir", str(workdir), *arguments],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    lines = [line for line in completed.stdout.splitlines() if line.startswith("LOADED ")]
    assert lines, f"the job printed no module list; exit {completed.returncode}:\n{completed.stderr[-3000:]}"
    loaded = {name.split(".")[0] for name in ast.literal_eval(lines[-1].removeprefix("LOADED "))}
    return json.loads((workdir / "result.json").read_text()), loaded


@pytest.mark.parametrize("style", ["torch", "keras", "tf_legacy"])
def test_a_job_loads_only_its_own_framework(tmp_path: Path, style: str) -> None:
    result, loaded = run_job(tmp_path, style, tiny_spec(style))
    assert result["status"] == "succeeded", result.get("error")
    assert not loaded & FORBIDDEN[style], f"a {style} job loaded {sorted(loaded & FORBIDDEN[style])}"
    assert ("torch" in loaded) == (style == "torch")
    assert OWN[style] <= loaded, f"a {style} job did not load {sorted(OWN[style] - loaded)}"


@pytest.mark.parametrize("style", ["torch", "keras", "tf_legacy"])
def test_a_check_job_loads_only_its_own_framework(tmp_path: Path, style: str) -> None:
    result, loaded = run_job(tmp_path, style, check_spec(style))
    assert result["status"] == "succeeded", result.get("error")
    assert result["report"]["summary"]["fail"] == 0, result["report"]
    assert not loaded & FORBIDDEN[style], f"a {style} check loaded {sorted(loaded & FORBIDDEN[style])}"
    assert ("torch" in loaded) == (style == "torch")


@pytest.mark.parametrize(("style", "plugin"), [("torch", "torch_plugin"), ("keras", "keras_plugin")])
def test_a_plugin_job_told_its_file_loads_only_its_own_framework(
    tmp_path: Path, style: str, plugin: str
) -> None:
    """A job of a plugin optimizer reads the file the worker names (`--plugin-file`, from the
    catalogue), not the other framework's plugin beside it."""
    spec = tiny_spec(style)
    spec["optimizer"]["name"] = f"{plugin}_sgd"
    result, loaded = run_job(
        tmp_path, style, spec, "--plugin-file", str(tmp_path / "plugins" / f"{plugin}.py")
    )
    assert result["status"] == "succeeded", result.get("error")
    assert not loaded & FORBIDDEN[style], f"a {style} plugin job loaded {sorted(loaded & FORBIDDEN[style])}"
