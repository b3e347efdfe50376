"""scripts/gpu_smoke.sh on this CPU-only machine: without a GPU it refuses unless --allow-cpu, with it
every part runs on the CPU and prints what it prints on a GPU; a part whose packages are missing is
skipped, saying so (a bare GPU machine may have torch alone)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_smoke.sh"


def smoke(*args: str, hide: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    if not hide:
        return subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)
    # As on a machine without these packages: find_spec(name) is None for a None in sys.modules.
    code = (
        "import runpy, sys\n"
        f"for name in {list(hide)!r}: sys.modules[name] = None\n"
        f"sys.argv = ['gpu_smoke.py', *{list(args)!r}]\n"
        "runpy.run_path('scripts/gpu_smoke.py', run_name='__main__')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_without_a_gpu_it_refuses_unless_allowed() -> None:
    completed = smoke(hide=("pydantic",))  # stops before any part: nothing else matters
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert "FAIL no CUDA device visible (--allow-cpu runs the same parts on the CPU)" in completed.stdout


def test_on_the_cpu_every_part_runs_and_reports() -> None:
    completed = smoke("--allow-cpu", "--steps", "4", "--checks", "construct,device_placement")
    out = completed.stdout
    assert completed.returncode == 0, out + completed.stderr
    state_line = r"^\[state\] (after .*): (\S+)\.momentum on (\S+) \(its parameter on (\S+)\)$"
    states = re.findall(state_line, out, re.M)
    assert len(states) == 8 and all(on == param == "cpu" for *_, on, param in states), out  # 4 params x 2
    job = re.search(
        r"^\[train\] job on CPU: succeeded on cpu, (\d+) samples/s, "
        r"optimizer step ([\d.]+) ms of ([\d.]+) ms per step \((\d+)%\), "
        r"(\d+) checkpoint round trips verified$",
        out,
        re.M,
    )
    assert job, out
    assert int(job[1]) > 0 and 0 < float(job[2]) < float(job[3]) and int(job[5]) == 2
    resume = re.search(
        r"^\[resume\] adam on CPU: resumed at step 2 of 4; optimizer step ([\d.]+) ms straight, "
        r"([\d.]+) ms resumed; final weights bitwise equal$",
        out,
        re.M,
    )
    assert resume and float(resume[1]) > 0 and float(resume[2]) > 0, out
    assert re.search(
        r"^\[ddp\] job on 2 CPU processes: succeeded, \d+ samples/s, 2 checkpoint round trips verified$",
        out,
        re.M,
    ), out
    assert re.search(r"^\[check\] construct: pass: ", out, re.M), out
    assert re.search(r"^\[check\] device_placement: skip: needs a CUDA device", out, re.M), out
    assert out.rstrip().endswith("[summary] OK"), out


def test_missing_packages_skip_their_parts_and_say_so() -> None:
    completed = smoke("--allow-cpu", hide=("pydantic", "tensorflow"))
    out = completed.stdout
    assert completed.returncode == 0, out + completed.stderr
    assert "[setup] tensorflow: not installed" in out
    assert "[train] SKIP the job process needs pydantic (not installed)" in out
    assert "[check] SKIP the checks need pydantic (not installed)" in out
    assert len(re.findall(r"^\[state\] ", out, re.M)) == 8, out  # torch alone is enough for that part


def test_jobs_go_to_the_gpus_this_machine_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under CUDA_VISIBLE_DEVICES=4,5 the jobs had been handed GPUs 0 and 1: other people's."""
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts" / "gpu_smoke.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_smoke", module)  # where its dataclass looks itself up
    spec.loader.exec_module(module)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, GPU-8f2e")
    assert module.visible_gpu_ids(2) == ["4", "GPU-8f2e"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert module.visible_gpu_ids(2) == ["0", "1"]
    assert module.visible_gpu_ids(0) == []
