"""torch checks that need fresh processes: `resume_exact` and `distributed`.

Both compare against runs that start in a fresh process, because state an optimizer
keeps in a class attribute or a module global survives every in-process round trip
(all instances share it) and only a new process shows that it was never saved.
The children run `run_child` below through `python -m jobs.checks.child`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from jobs.checks.child import (
    ABSOLUTE_FLOOR,
    GLOBAL_BATCH,
    RELATIVE_TOLERANCE,
    RESUME_SPLIT,
    RESUME_STEPS,
    SEED,
    ChildFailed,
    failed_in_child,
    kill,
    ready,
    run_forked,
    spawn,
    wait_all,
)
from jobs.checks.context import CheckContext, overrides_note
from jobs.checks.report import Outcome, failed, passed
from jobs.frameworks.torch_driver import first_difference, rng_state, set_rng_state

DDP_STEPS = 3
WORLD_SIZE = 2
MODULE = "jobs.checks.torch_processes"


# -- the tiny problem both sides of every comparison run ------------------------------------------------


def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(torch.float32)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `step`, a pure function of the step (so a resumed run sees the same data)."""
    generator = torch.Generator().manual_seed(SEED + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=generator, dtype=torch.float32)
    return x, torch.randn(GLOBAL_BATCH, 3, generator=generator, dtype=torch.float32)


def train(model: nn.Module, optimizer: Any, steps: range, rows: slice = slice(None)) -> None:
    for step in steps:
        x, y = batch(step)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()


def build(context: CheckContext, overrides: Mapping[str, Any]) -> tuple[nn.Module, Any]:
    torch.manual_seed(SEED)
    model = tiny_model()
    return model, context.build(model.parameters(), **overrides)


# -- resume_exact --------------------------------------------------------------------------------------


def resume_exact(ctx: CheckContext) -> Outcome:
    overrides = ctx.stateful_overrides()
    checkpoint, final = ctx.workdir / "resume-checkpoint.pt", ctx.workdir / "resume-final.pt"
    go = ctx.workdir / "resume-go"
    task = _task(ctx, "resume", overrides, checkpoint=str(checkpoint), out=str(final), wait_for=str(go))
    child = spawn("resume", task, ctx.workdir)  # started first: its imports overlap the runs here
    try:
        with torch.random.fork_rng(devices=[]):  # leave the global RNG as the other checks had it
            model, optimizer = build(ctx, overrides)
            train(model, optimizer, range(RESUME_STEPS))
            straight = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            model, optimizer = build(ctx, overrides)
            train(model, optimizer, range(RESUME_SPLIT))
            # As a training loop saves: model, optimizer and RNG in one dict (frameworks/torch_driver.py).
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng_state()},
                checkpoint,
            )
        ready(go)
        wait_all([child])
    except ChildFailed as exc:
        return failed_in_child(exc, "the resumed run", where=ctx.where())
    finally:
        kill(child)
    resumed = torch.load(final, weights_only=True)
    difference = first_difference(straight, resumed, "")
    figure = max_abs_difference(straight, resumed)
    rest = RESUME_STEPS - RESUME_SPLIT
    steps = f"{RESUME_STEPS} steps straight vs {RESUME_SPLIT} + save + {rest} in a fresh process"
    if difference is None:
        return passed(
            f"{steps}: parameters and optimizer state bitwise equal{overrides_note(overrides)}", 0.0
        )
    return failed(
        f"{steps} differ: {_readable(difference)}",
        where=ctx.where(),
        fix="keep every piece of state in self.state[p] or param_groups (never in a class attribute, "
        "module global or other Python attribute), so state_dict() saves it",
        figure=figure,
    )


def _resume_in_child(task: Mapping[str, Any], context: CheckContext) -> None:
    model = tiny_model()
    optimizer = context.build(model.parameters(), **task["overrides"])
    saved = torch.load(task["checkpoint"], weights_only=True)  # as a careful user loads
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    set_rng_state(saved["rng"])
    train(model, optimizer, range(RESUME_SPLIT, RESUME_STEPS))
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, task["out"])


# -- distributed ---------------------------------------------------------------------------------------


def distributed(ctx: CheckContext) -> Outcome:
    overrides = ctx.stateful_overrides()
    store = ctx.workdir / "ddp-store"
    store.unlink(missing_ok=True)
    outs = {name: ctx.workdir / f"ddp-{name}.pt" for name in ("rank0", "rank1", "single")}
    task = _task(ctx, "ddp", overrides, store=str(store), outs={k: str(v) for k, v in outs.items()})
    try:
        wait_all([spawn("ddp", task, ctx.workdir)])
    except ChildFailed as exc:
        return failed_in_child(exc, "DDP with two gloo processes", where=ctx.where())
    rank0, rank1, single = (
        torch.load(outs[name], weights_only=True) for name in ("rank0", "rank1", "single")
    )
    return _judge_ddp(ctx, rank0, rank1, single, overrides)


def _judge_ddp(
    ctx: CheckContext,
    rank0: dict[str, Any],
    rank1: dict[str, Any],
    single: dict[str, Any],
    overrides: Mapping[str, Any],
) -> Outcome:
    figure = max_abs_difference(rank0["model"], single["model"])
    apart = first_difference(rank0, rank1, "")
    if apart is not None:
        return failed(
            f"under DDP the two ranks drifted apart after {DDP_STEPS} steps on the same averaged gradients "
            f"({_readable(apart)})",
            where=ctx.where(),
            fix="make the update a deterministic function of the gradient and self.state (no draws from the "
            "per-rank global RNG, no rank-local inputs), so every replica takes the same step",
            figure=max_abs_difference(rank0, rank1),
        )
    missing = _missing_state(rank0["optimizer"]["state"], single["optimizer"]["state"])
    if missing:
        return failed(
            f"under DDP the optimizer state differs in shape from the single-process run: {missing}",
            where=ctx.where(),
            fix="create state lazily per parameter in self.state[p] from the parameter itself",
        )
    far = _beyond_tolerance(rank0, single)
    if far:
        return failed(
            f"DDP ({WORLD_SIZE} gloo ranks, half the batch each) differs from one process on the full batch "
            f"beyond rounding: {far}",
            where=ctx.where(),
            fix="use only the gradient DDP hands over (already averaged); do not all-reduce gradients or "
            "norms again inside the optimizer for replicated parameters",
            figure=figure,
        )
    return passed(
        f"DDP with {WORLD_SIZE} gloo ranks equals one process on the full batch after {DDP_STEPS} steps "
        f"(ranks bitwise equal, max abs difference to single process {figure:.2g}, within rounding)"
        f"{overrides_note(overrides)}",
        figure,
    )


def _missing_state(ddp: Mapping[Any, Any], single: Mapping[Any, Any]) -> str:
    if set(ddp) != set(single):
        return f"state for parameters {sorted(ddp)} instead of {sorted(single)}"
    for index, state in single.items():
        if set(state) != set(ddp[index]):
            return f"parameter {index} has state {sorted(ddp[index])} instead of {sorted(state)}"
        for key, value in state.items():
            other = ddp[index][key]
            if isinstance(value, torch.Tensor) and (
                not isinstance(other, torch.Tensor) or other.shape != value.shape
            ):
                return f"parameter {index} state {key!r} is not a tensor of shape {list(value.shape)}"
    return ""


def _beyond_tolerance(ddp: Mapping[str, Any], single: Mapping[str, Any]) -> str:
    start = single["initial"]
    for name, value in single["model"].items():
        movement = float((value - start[name]).abs().max())
        allowed = RELATIVE_TOLERANCE * movement + ABSOLUTE_FLOOR * (1 + float(value.abs().max()))
        diff = float((ddp["model"][name] - value).abs().max())
        if not diff <= allowed:
            return f"parameter {name}: max abs difference {diff:.3g} (it moved {movement:.3g})"
    for index, state in single["optimizer"]["state"].items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                continue
            other = ddp["optimizer"]["state"][index][key]
            allowed = RELATIVE_TOLERANCE * float(value.abs().max()) + ABSOLUTE_FLOOR
            diff = float((other.double() - value.double()).abs().max())
            if not diff <= allowed:
                return f"optimizer state {key!r} of parameter {index}: max abs difference {diff:.3g}"
    return ""


def _ddp_in_child(task: Mapping[str, Any], context: CheckContext) -> None:
    """Two DDP ranks and the single-process run, each in a forked copy of this fresh process."""
    outs = task["outs"]
    run_forked(
        task,
        context,
        {
            "rank0": lambda: _rank(task, context, 0, outs["rank0"]),
            "rank1": lambda: _rank(task, context, 1, outs["rank1"]),
            "single": lambda: _single(task, context, outs["single"]),
        },
    )


def _rank(task: Mapping[str, Any], context: CheckContext, rank: int, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(
        "gloo",
        init_method=f"file://{task['store']}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    # No destroy_process_group(): with the peer already gone it can block for good in
    # gloo (seen here, about one run in ten); this forked process ends with os._exit.
    model, optimizer = build(context, task["overrides"])
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = DistributedDataParallel(model)
    # Each rank its own random stream from here, as dropout and augmentation need in real training.
    torch.manual_seed(SEED + 1 + rank)
    share = GLOBAL_BATCH // WORLD_SIZE
    train(wrapped, optimizer, range(DDP_STEPS), slice(rank * share, (rank + 1) * share))
    _save_run(out, model, optimizer, initial)


def _single(task: Mapping[str, Any], context: CheckContext, out: str) -> None:
    model, optimizer = build(context, task["overrides"])
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(SEED + 1)  # the stream rank 0 has
    train(model, optimizer, range(DDP_STEPS))
    _save_run(out, model, optimizer, initial)


def _save_run(path: str, model: nn.Module, optimizer: Any, initial: Mapping[str, Any]) -> None:
    # Tensors only: what the optimizer keeps besides them is state_roundtrip's business,
    # and the parent reads this file with weights_only=True.
    state = {
        index: {key: value for key, value in entry.items() if isinstance(value, torch.Tensor)}
        for index, entry in optimizer.state_dict()["state"].items()
    }
    torch.save({"model": model.state_dict(), "optimizer": {"state": state}, "initial": initial}, path)


# -- children -----------------------------------------------------------------------------------------


def _task(ctx: CheckContext, role: str, overrides: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "module": MODULE,
        "role": role,
        "target": ctx.target.text,
        "style": ctx.target.style,
        "params": ctx.params,
        "workdir": str(ctx.workdir),
        "overrides": dict(overrides),
        # Same intra-op threads as here: a different count may sum in a different order.
        "threads": torch.get_num_threads() if role == "resume" else 1,
        **extra,
    }


def prepare_child(task: Mapping[str, Any]) -> None:
    torch.set_num_threads(int(task["threads"]))
    if task["role"] == "ddp":
        # DDP's constructor imports torch._dynamo (seconds): once here, before the fork, not per rank.
        importlib.import_module("torch._dynamo")


def run_child(task: Mapping[str, Any], context: CheckContext) -> None:
    roles = {"resume": _resume_in_child, "ddp": _ddp_in_child}
    roles[task["role"]](task, context)


def _readable(difference: str) -> str:
    """`['optimizer']['state'][0]['exp_avg']: ...` as `optimizer/state/0/exp_avg: ...`."""
    path, _, rest = difference.partition(": ")
    parts = [part.strip("'\"") for part in path.strip("[]").split("][")]
    return f"{'/'.join(parts)}: {rest}"


def max_abs_difference(a: Any, b: Any) -> float:
    """The largest absolute difference between the tensors of two equal-shaped state trees."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return math.inf
        if not (a.is_floating_point() or a.is_complex()):
            return float((a.long() - b.long()).abs().max()) if a.numel() else 0.0
        return float((a.double() - b.double()).abs().nan_to_num(nan=math.inf).max()) if a.numel() else 0.0
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return max((max_abs_difference(a[k], b[k]) for k in a.keys() & b.keys()), default=0.0)
    if isinstance(a, Sequence) and isinstance(b, Sequence) and not isinstance(a, str):
        return max((max_abs_difference(x, y) for x, y in zip(a, b, strict=False)), default=0.0)
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) if math.isfinite(a - b) else (0.0 if a == b else math.inf)
    return 0.0
