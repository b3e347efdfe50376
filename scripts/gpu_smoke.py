"""The GPU smoke test (run by scripts/gpu_smoke.sh; see there). Standard library and torch at the
top; what else a part needs is checked before that part, which is skipped, saying why, without it."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "examples" / "plugins" / "sign_momentum.py"
TARGET = f"{PLUGIN}:SignMomentum"
CHECKS = "construct,dense_step,state_roundtrip,resume_exact,device_placement,mixed_precision"


def say(section: str, message: str) -> None:
    print(f"[{section}] {message}", flush=True)


def missing(*modules: str) -> list[str]:
    return [name for name in modules if importlib.util.find_spec(name) is None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--allow-cpu", action="store_true", help="without a GPU, run every part on the CPU")
    parser.add_argument("--steps", type=int, default=300, help="training steps of each job")
    parser.add_argument("--checks", default=CHECKS, help=f"the check ids to run (default {CHECKS})")
    args = parser.parse_args()
    if missing("torch"):
        say("setup", "FAIL torch is not installed: nothing to smoke-test")
        return 1
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    say("setup", f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    for index in range(count):
        say("setup", f"GPU {index}: {torch.cuda.get_device_name(index)}")
    if count == 0 and not args.allow_cpu:
        say("setup", "FAIL no CUDA device visible (--allow-cpu runs the same parts on the CPU)")
        return 1
    if count == 0:
        say("setup", "no CUDA device: running every part on the CPU, as --allow-cpu asks")
    tensorflow = "not installed (the TensorFlow parts of optlab are not smoke-tested here)"
    say(
        "setup", f"tensorflow: {tensorflow if missing('tensorflow') else 'installed, not used by this smoke'}"
    )
    gpus = visible_gpu_ids(count)
    failures = state_devices(torch, "cuda" if count else "cpu")
    failures += train_on_every_device(gpus, args.steps)
    failures += resume_on_one_device(gpus, args.steps)
    failures += data_parallel_over_two(gpus, args.steps)
    failures += check_on_device(args.checks)
    say("summary", "OK" if failures == 0 else f"FAIL {failures} part(s) failed")
    return 0 if failures == 0 else 1


def visible_gpu_ids(count: int) -> list[str]:
    """The ids this process may hand a job, as the worker does: the ones CUDA_VISIBLE_DEVICES
    already narrowed to (indices or UUIDs), else 0..count-1. Handing out 0, 1, ... under a narrowed
    list would run the jobs on other GPUs than the ones this machine was given."""
    narrowed = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    ids = [gpu.strip() for gpu in narrowed.split(",") if gpu.strip()] if narrowed else []
    return ids[:count] if ids else [str(index) for index in range(count)]


def load_plugin_class() -> Any:
    spec = importlib.util.spec_from_file_location("sign_momentum_smoke", PLUGIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SignMomentum


def state_devices(torch: Any, device: str) -> int:
    """Each optimizer state tensor's device after steps on `device`, and after a checkpoint saved
    to the host and loaded back with `map_location` onto the device, into a fresh optimizer."""
    cls = load_plugin_class()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to(device)
    optimizer = cls(model.parameters(), lr=1e-3)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 8, device=device)).square().mean().backward()
        optimizer.step()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)  # the tensors as they are, on the device
    buffer.seek(0)
    on_host = torch.load(buffer, map_location="cpu", weights_only=True)
    buffer = io.BytesIO()
    torch.save(on_host, buffer)
    buffer.seek(0)
    fresh = cls(model.parameters(), lr=1e-3)
    fresh.load_state_dict(torch.load(buffer, map_location=device, weights_only=True))
    wrong = 0
    names = {id(p): name for name, p in model.named_parameters()}
    for label, opt in (("after 2 steps", optimizer), ("after a reload via the host", fresh)):
        for param, state in opt.state.items():
            for key, value in state.items():
                if torch.is_tensor(value):
                    same = value.device == param.device
                    wrong += not same
                    say(
                        "state",
                        f"{label}: {names[id(param)]}.{key} on {value.device} "
                        f"(its parameter on {param.device}){'' if same else '  <- MISPLACED'}",
                    )
    if wrong:
        say("state", f"FAIL {wrong} state tensor(s) not on their parameter's device")
    return 1 if wrong else 0


SIGN_MOMENTUM = {"name": "sign_momentum", "params": {"lr": 0.001}}
# torch's Adam keeps a `step` tensor per parameter, which it reads with `.item()` when that tensor
# is on the GPU: what a checkpoint read onto the device had left there.
ADAM = {"name": "adam", "params": {"lr": 0.001}}


def job_spec(
    steps: int, workload: str, device: str, optimizer: dict[str, Any] = SIGN_MOMENTUM
) -> dict[str, Any]:
    return {
        "framework": "torch",
        "workload": {"name": workload},
        "optimizer": optimizer,
        "steps": steps,
        "batch_size": 64,
        "checkpoint_every": max(1, steps // 2),
        "eval_every": max(1, steps // 2),
        "experiment": "gpu-smoke",
        "device": device,
    }


@dataclass
class SmokeJob:
    """One `python -m jobs.run` process of the smoke, in a folder of its own."""

    where: str
    folder: Path
    process: subprocess.Popen[bytes]
    log: Any

    def result(self, section: str) -> dict[str, Any] | None:
        """The job's result once it ended, when it succeeded; else None, having said why."""
        self.process.wait()
        self.log.close()
        result_path = self.folder / "work" / "result.json"
        if not result_path.exists():
            tail = (self.folder / "job.log").read_text(errors="replace")[-1500:]
            say(
                section,
                f"FAIL job on {self.where} exited {self.process.returncode} without a result:\n{tail}",
            )
            return None
        result: dict[str, Any] = json.loads(result_path.read_text())
        if result["status"] != "succeeded":
            say(section, f"FAIL job on {self.where}: {result['status']}: {result.get('error')}")
            return None
        return result


def start_job(
    folder: Path, spec: dict[str, Any], gpus: list[str], where: str, *args: str, shared: Path | None = None
) -> SmokeJob:
    """`shared`: the checkpoint folder (OPTLAB_CHECKPOINT_DIR), which keeps the one before the last."""
    folder.mkdir(parents=True)
    (folder / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPTLAB_PLUGIN_DIRS": str(PLUGIN.parent)}
    if shared is not None:
        env["OPTLAB_CHECKPOINT_DIR"] = str(shared)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    log = open(folder / "job.log", "wb")  # closed when the job ends (SmokeJob.result)
    command = [
        sys.executable,
        "-m",
        "jobs.run",
        str(folder / "spec.json"),
        "--workdir",
        str(folder / "work"),
        *args,
    ]
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    return SmokeJob(where, folder, process, log)


def smoke_workload(section: str) -> str | None:
    """digits_mlp (scikit-learn's data), else embedding_mf (generated); None: no job can run here."""
    if lacking := missing("pydantic", "numpy"):
        say(section, f"SKIP the job process needs {', '.join(lacking)} (not installed)")
        return None
    if missing("sklearn"):
        say(section, "scikit-learn is not installed: training embedding_mf (generated data), not digits_mlp")
        return "embedding_mf"
    return "digits_mlp"


def train_on_every_device(gpus: list[str], steps: int) -> int:
    """One job per GPU at once, each seeing only its own (CUDA_VISIBLE_DEVICES), as the worker's
    slots start them: the custom optimizer from the plugin folder, checkpoints verified."""
    workload = smoke_workload("train")
    if workload is None:
        return 0
    work = Path(tempfile.mkdtemp(prefix="optlab-gpu-smoke-"))
    device = "cuda" if gpus else "cpu"
    jobs = [
        start_job(work / f"slot{slot}", job_spec(steps, workload, device), [gpu], f"GPU {gpu}")
        for slot, gpu in enumerate(gpus)
    ] or [start_job(work / "cpu", job_spec(steps, workload, device), [], "CPU")]
    began = time.monotonic()
    failures = 0
    for job in jobs:
        result = job.result("train")
        failures += result is None
        if result is not None:
            step_ms, optimizer_ms = result["step_time_ms_median"], result["optimizer_step_ms_median"]
            share = optimizer_ms / step_ms if step_ms else float("nan")
            say(
                "train",
                f"job on {job.where}: succeeded on {result['device']}, "
                f"{result['samples_per_sec']:.0f} samples/s, optimizer step {optimizer_ms:.3f} ms "
                f"of {step_ms:.3f} ms per step ({share:.0%}), "
                f"{result['checkpoints_verified']} checkpoint round trips verified",
            )
    say("train", f"{len(jobs)} job(s) at once in {time.monotonic() - began:.1f} s")
    return failures


def resume_on_one_device(gpus: list[str], steps: int) -> int:
    """An Adam job, then a fresh process resumed from its first checkpoint: the two must end with
    the same weights (bitwise: the job runs deterministic algorithms). Both optimizer step times are
    printed, to compare by eye: a restored Adam `step` on the GPU had made every resumed step slower."""
    workload = smoke_workload("resume")
    if workload is None:
        return 0
    work = Path(tempfile.mkdtemp(prefix="optlab-gpu-resume-"))
    device, first = ("cuda", gpus[:1]) if gpus else ("cpu", [])
    where = f"GPU {first[0]}" if first else "CPU"
    spec = job_spec(steps, workload, device, ADAM)
    shared = work / "checkpoints"
    straight = start_job(work / "straight", spec, first, where, "--job-id", "smoke", shared=shared)
    straight_result = straight.result("resume")
    if straight_result is None:
        return 1
    resume = ["--resume", straight_result["checkpoints"][0]["path"], "--job-id", "smoke", "--attempt", "2"]
    resumed = start_job(work / "resumed", spec, first, where, *resume, shared=shared).result("resume")
    if resumed is None:
        return 1
    straight_ms, resumed_ms = straight_result["optimizer_step_ms_median"], resumed["optimizer_step_ms_median"]
    same = resumed["params_sha256"] == straight_result["params_sha256"]
    say(
        "resume",
        f"adam on {where}: resumed at step {resumed['resumed_from_step']} of {steps}; optimizer step "
        f"{straight_ms:.3f} ms straight, {resumed_ms:.3f} ms resumed; "
        f"final weights {'bitwise equal' if same else 'DIFFER'}",
    )
    if not same:
        say("resume", "FAIL the resumed job's weights differ from the straight run's")
    return 0 if same else 1


def data_parallel_over_two(gpus: list[str], steps: int) -> int:
    """A DDP job over two GPUs (NCCL), or over two CPU processes (gloo) where there is no GPU."""
    if len(gpus) == 1:
        say("ddp", "SKIP one GPU visible: a data-parallel job needs two")
        return 0
    workload = smoke_workload("ddp")
    if workload is None:
        return 0
    work = Path(tempfile.mkdtemp(prefix="optlab-gpu-ddp-"))
    spec = {
        **job_spec(steps, workload, "cuda" if gpus else "cpu"),
        "distribution": {"strategy": "ddp", "devices": 2},
    }
    where = f"GPUs {','.join(gpus[:2])}" if gpus else "2 CPU processes"
    result = start_job(work / "ddp", spec, gpus[:2], where).result("ddp")
    if result is None:
        return 1
    say(
        "ddp",
        f"job on {where}: succeeded, {result['samples_per_sec']:.0f} samples/s, "
        f"{result['checkpoints_verified']} checkpoint round trips verified",
    )
    return 0


def check_on_device(checks: str) -> int:
    """`optlab check` on the plugin's class: device_placement runs where a GPU is (state on its
    variable's device, also after a `map_location='cpu'` restore), a skip saying so elsewhere."""
    if lacking := missing("pydantic", "numpy"):
        say("check", f"SKIP the checks need {', '.join(lacking)} (not installed)")
        return 0
    # `optlab check` runs `python -m jobs.checks` with these arguments; without the service's
    # packages (pydantic-settings, ...) the smoke calls that directly.
    service = not missing("pydantic_settings", "httpx")
    cli = ["-m", "service.cli", "check"] if service else ["-m", "jobs.checks"]
    report_path = Path(tempfile.mkdtemp(prefix="optlab-gpu-check-")) / "report.json"
    command = [sys.executable, *cli, TARGET, "--params", '{"lr": 0.001}', "--only", checks]
    how = "" if service else " (as python -m jobs.checks)"
    say("check", f"optlab check {TARGET} --only {checks}{how}")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(
        [*command, "--json", str(report_path)], env=env, capture_output=True, text=True
    )
    if not report_path.exists():
        say("check", f"FAIL exited {completed.returncode} without a report:\n{completed.stderr[-1500:]}")
        return 1
    report = json.loads(report_path.read_text())
    for check in report["checks"]:
        say("check", f"{check['id']}: {check['status']}: {check['detail'][:160]}")
    failed = [c["id"] for c in report["checks"] if c["status"] == "fail"]
    if failed:
        say("check", f"FAIL {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
