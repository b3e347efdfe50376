"""torch's side of the fresh-process checks: the tiny problem, the runs, DDP over two gloo ranks.

Reached through `TorchDriver.fresh_module`. `run_and_save` runs in the checking process,
the rest in a process forked from the fresh child (`child.py`). Results are written as
named numpy arrays (`results.py`), so the verdicts are not written here.
"""

from __future__ import annotations

import functools
import importlib
import random
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from jobs.checks.context import CheckContext
from jobs.checks.fresh.child import run_forked
from jobs.checks.fresh.plan import (
    DISTRIBUTED_STEPS,
    GLOBAL_BATCH,
    INITIAL,
    REPLICA_RUNS,
    REPLICAS,
    RESUME_SPLIT,
    RESUME_STEPS,
    SEED,
    SINGLE,
    Wording,
)
from jobs.checks.fresh.results import MODEL, OPTIMIZER, Arrays, Run, save_run
from jobs.frameworks.base import StateDifference
from jobs.frameworks.torch_driver import (
    KEEP_STATE_DTYPE_FIX,
    LOAD_CASTS_STATE,
    TorchDriver,
    clear_gradients,
    closure_loss_over_ranks,
    closure_result,
    dropped_by_load,
    first_difference,
    load_as_a_user_loads,
    rng_state,
    set_rng_state,
)
from optimizers.loop_needs import PLAIN, LoopNeeds

WORDING = Wording(
    checkpoint="save",
    state_home="every piece of state in self.state[p] or param_groups",
    saver="state_dict()",
    resume_child_fix="",
    setup=f"DDP with {REPLICAS} gloo ranks",
    replica="rank",
    single="one process",
    reference="one process fed the ranks' averaged gradient",
    distributed_child_fix="",
    evaluation="optimizer.eval()",
    apart_fix="make the update a deterministic function of the gradient and self.state (no draws from the "
    "per-rank global RNG, no rank-local inputs), so every replica takes the same step",
    layout_fix="create state lazily per parameter in self.state[p] from the parameter itself",
    beyond_fix="use only the gradient DDP hands over (already averaged); do not all-reduce gradients or "
    "norms again inside the optimizer for replicated parameters",
)


# -- the tiny problem both sides of every comparison run ------------------------------------------------


def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(torch.float32)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `step`, a pure function of the step (so a resumed run sees the same data)."""
    generator = torch.Generator().manual_seed(SEED + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=generator, dtype=torch.float32)
    return x, torch.randn(GLOBAL_BATCH, 3, generator=generator, dtype=torch.float32)


def train(
    model: nn.Module,
    optimizer: Any,
    steps: range,
    rows: slice = slice(None),
    needs: LoopNeeds = PLAIN,
    *,
    averaged: bool = False,
    loss_over_ranks: bool = False,
) -> None:
    """Steps the way the entry says the class is stepped: a closure, a graph for Hessian products,
    in training mode (schedule-free classes). `averaged`: the gradient is the replicas' average, as
    DDP hands it over, computed here. `loss_over_ranks` (a DDP rank): the closure returns the mean of
    the ranks' losses, as a job's does, instead of the rank's own, as a plain DDP loop's does."""
    for step in steps:
        if needs.train_eval:
            optimizer.train()  # a no-op when already training
        x, y = batch(step)
        gradients = _loss_and_averaged_grads if averaged else _loss_and_grads
        closure = functools.partial(gradients, model, optimizer, x[rows], y[rows], needs)
        if loss_over_ranks:
            closure = _returning_mean_over_ranks(closure)
        closure()
        if needs.closure:
            optimizer.step(closure)
        else:
            optimizer.step()


def _returning_mean_over_ranks(closure: Any) -> Any:
    def over_ranks(backward: bool = True) -> torch.Tensor:
        return closure_loss_over_ranks(closure(backward=backward))

    return over_ranks


def to_evaluation(optimizer: Any, needs: LoopNeeds) -> None:
    """Switch to the weights the user evaluates (schedule-free: `eval()`), as a job does before
    evaluating and saving: both runs of `resume_exact` are saved and compared there, and the
    straight run switches at the step where the other saves (a switch back and forth rounds)."""
    if needs.train_eval:
        optimizer.eval()


def _loss_and_grads(
    model: nn.Module,
    optimizer: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    needs: LoopNeeds,
    backward: bool = True,
) -> torch.Tensor:
    if backward:  # `closure(backward=False)` asks for the loss alone and leaves the gradients be
        clear_gradients(optimizer)
    with torch.enable_grad():  # step(closure) may run it under torch.no_grad()
        return closure_result(nn.functional.mse_loss(model(x), y), needs, backward=backward)


def _loss_and_averaged_grads(
    model: nn.Module,
    optimizer: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    needs: LoopNeeds,
    backward: bool = True,
) -> torch.Tensor:
    """Each replica's share's gradient, averaged as DDP averages them (each divided by the number
    of replicas, then summed in rank order): one process fed exactly what every rank is fed, so
    only the optimizer can make the ranks differ from it. A class that runs backward itself, or
    asks for the loss alone, gets the mean of the shares' losses, whose gradient is that average."""
    share = len(x) // REPLICAS
    shares_rows = [slice(rank * share, (rank + 1) * share) for rank in range(REPLICAS)]
    if needs.backward_in_step or not backward:
        if backward:
            clear_gradients(optimizer)
        with torch.enable_grad():
            return torch.stack([nn.functional.mse_loss(model(x[r]), y[r]) for r in shares_rows]).mean()
    losses, shares = [], []
    for rows in shares_rows:
        losses.append(_loss_and_grads(model, optimizer, x[rows], y[rows], needs))
        shares.append([None if p.grad is None else p.grad.detach().clone() for p in model.parameters()])
    for param, *parts in zip(model.parameters(), *shares, strict=True):
        if all(part is not None for part in parts):  # as in every replica: the same model and loss
            param.grad = functools.reduce(
                lambda total, part: total + part / REPLICAS, parts[1:], parts[0] / REPLICAS
            )
    return torch.stack(losses).mean()


def build(ctx: CheckContext, overrides: Mapping[str, Any]) -> tuple[nn.Module, Any]:
    torch.manual_seed(SEED)
    np.random.seed(SEED)  # a step may draw from numpy's or Python's global stream (Kron, PCGrad)
    random.seed(SEED)
    model = tiny_model()
    return model, ctx.build(model.parameters(), **overrides)


def snapshot(model: nn.Module, optimizer: Any, *, tensors_only: bool = False) -> Arrays:
    """Model and optimizer state dicts as named arrays (`optimizer/state/0/exp_avg`).

    `tensors_only`: the optimizer's tensors alone; what it keeps besides them (param_groups,
    Python numbers) must survive a save, but is not what distribution changes.
    """
    arrays = _flatten(model.state_dict(), MODEL)
    state = optimizer.state_dict()
    if tensors_only:
        # Any layout: per-parameter dicts under "state" as torch's, but also tensors or numbers kept
        # beside them (MADGRAD's state['k'], SPAM's state['total_step']) or a state_dict of the
        # class's own (a wrapper's): optlab's assumption about it must not fail the user's class.
        state = _tensors_in({key: value for key, value in state.items() if key != "param_groups"})
    return {**arrays, **_flatten(state, OPTIMIZER)}


def _tensors_in(value: Any) -> Any:
    """`value` with only its tensors kept, nested mappings and sequences followed."""
    if isinstance(value, Mapping):
        kept = {key: _tensors_in(item) for key, item in value.items()}
        return {key: item for key, item in kept.items() if item is not None}
    if isinstance(value, list | tuple):
        kept_items = [item for item in (_tensors_in(item) for item in value) if item is not None]
        return kept_items or None
    return value if isinstance(value, torch.Tensor) else None


def _flatten(value: Any, key: str) -> Arrays:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        tensor = tensor.to_dense() if tensor.is_sparse else tensor
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.float()  # exact: numpy has no bfloat16
        return {key: tensor.numpy().copy()}
    if isinstance(value, Mapping):
        return {
            k: v
            for position, (name, item) in enumerate(value.items())
            for k, v in _flatten(item, f"{key}/{_part(name, position)}").items()
        }
    if isinstance(value, list | tuple):
        return {k: v for index, item in enumerate(value) for k, v in _flatten(item, f"{key}/{index}").items()}
    if isinstance(value, bool | int | float | complex):
        return {key: np.asarray(value)}
    return {key: np.asarray(repr(value))}  # None, strings: compared as text


# -- the checking process -------------------------------------------------------------------------------


def settings() -> dict[str, Any]:
    # Same intra-op threads as here in the resumed run: a different count may sum in another order.
    return {"threads": torch.get_num_threads()}


def run_and_save(ctx: CheckContext, overrides: Mapping[str, Any], checkpoint: Path) -> Run:
    with torch.random.fork_rng(devices=[]):  # leave the global RNG as the other checks had it
        model, optimizer = build(ctx, overrides)
        train(model, optimizer, range(RESUME_SPLIT), needs=ctx.needs)
        to_evaluation(optimizer, ctx.needs)  # where the other run saves
        train(model, optimizer, range(RESUME_SPLIT, RESUME_STEPS), needs=ctx.needs)
        to_evaluation(optimizer, ctx.needs)
        straight = Run(snapshot(model, optimizer))
        model, optimizer = build(ctx, overrides)
        train(model, optimizer, range(RESUME_SPLIT), needs=ctx.needs)
        # As a training loop saves: in evaluation mode, model, optimizer and RNG in one dict
        # (frameworks/torch_driver.py).
        to_evaluation(optimizer, ctx.needs)
        payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng_state()}
        torch.save(payload, checkpoint)
    return straight


def load_difference(
    ctx: CheckContext, overrides: Mapping[str, Any], checkpoint: Path
) -> StateDifference | None:
    """A state tensor `load_state_dict` cast to its parameter's dtype (ProdigyPlusScheduleFree's
    bfloat16 `p0`): the next steps then round otherwise than the uninterrupted ones. Or per-parameter
    state kept in a param group keyed by the parameters (grokadamw's group['state'][p]): loaded as
    saved, it is keyed by the saved run's parameters, and the resumed run's find none of it."""
    try:
        with torch.random.fork_rng(devices=[]):
            model = tiny_model()
            optimizer = ctx.build(model.parameters(), **overrides)
            saved = load_as_a_user_loads(checkpoint)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
    except Exception:  # the resumed run got this far in its process: no cause to add here
        return None
    keyed = _keyed_by_other_parameters(optimizer)
    if keyed is not None:
        return StateDifference(
            f"param_groups{keyed} holds per-parameter state keyed by the parameters themselves, which "
            "load_state_dict() restores as saved: keyed by the saved run's parameters, none of which is a "
            "parameter of the resumed run",
            fix=TorchDriver.advice.state_in_checkpoint,
        )
    found = first_difference(saved["optimizer"], optimizer.state_dict(), "state_dict")
    if found is None:
        return None
    dropped = dropped_by_load(saved["optimizer"], optimizer)  # by the class's own load method
    if dropped is not None:
        return dropped
    if LOAD_CASTS_STATE not in found:
        return None
    return StateDifference(found, fix=KEEP_STATE_DTYPE_FIX)


def _keyed_by_other_parameters(optimizer: Any) -> str | None:
    """`[index][key]` of the first param-group value that is a mapping keyed by tensors none of which
    is one of the optimizer's parameters, or None."""
    own = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for index, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key == "params" or not isinstance(value, Mapping) or not value:
                continue
            keys = list(value)
            if all(isinstance(k, torch.Tensor) and id(k) not in own for k in keys):
                return f"[{index}][{key!r}]"
    return None


def _part(name: Any, position: int) -> str:
    """A mapping's key as part of an array's name: a tensor key (a dict keyed by the parameters
    themselves) by its position, kind and shape, not by a repr that prints every element."""
    if isinstance(name, torch.Tensor):
        return f"<{type(name).__name__} {position} of shape {tuple(name.shape)}>"
    return str(name)


# -- the fresh child and its forks ---------------------------------------------------------------------


def import_framework(style: str) -> None:
    """torch came with this module. DDP's constructor imports torch._dynamo (seconds): once here
    for every fork. Neither starts a thread pool, so both survive a fork."""
    importlib.import_module("torch._dynamo")


def prepare_run(request: Mapping[str, Any]) -> None:
    # DDP's ranks share the machine: one thread each; the resumed run as the checking process.
    torch.set_num_threads(int(request["settings"]["threads"]) if request["role"] == "resume" else 1)


def resume(request: Mapping[str, Any], ctx: CheckContext) -> None:
    model = tiny_model()
    optimizer = ctx.build(model.parameters(), **request["overrides"])
    saved = load_as_a_user_loads(request["checkpoint"])
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    set_rng_state(saved["rng"])
    train(model, optimizer, range(RESUME_SPLIT, RESUME_STEPS), needs=ctx.needs)
    to_evaluation(optimizer, ctx.needs)
    save_run(request["out"], snapshot(model, optimizer))


def distributed(request: Mapping[str, Any], ctx: CheckContext) -> None:
    """The DDP ranks and the single-process run, each in a forked copy of this fresh process."""
    outs = request["outs"]
    store = Path(outs[SINGLE]).with_name("ddp-store")  # where the ranks find each other
    store.unlink(missing_ok=True)
    runs = {
        name: functools.partial(_rank, request, ctx, rank, store) for rank, name in enumerate(REPLICA_RUNS)
    }
    run_forked(request, ctx, {**runs, SINGLE: functools.partial(_single, request, ctx, outs)})


def _rank(request: Mapping[str, Any], ctx: CheckContext, rank: int, store: Path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=REPLICAS, timeout=timedelta(seconds=60)
    )
    # No destroy_process_group(): with the peer already gone it can block for good in
    # gloo (seen here, about one run in ten); this forked process ends with os._exit.
    model, optimizer = build(ctx, request["overrides"])
    wrapped = DistributedDataParallel(model)
    # Each rank its own random stream from here, as dropout and augmentation need in real training.
    torch.manual_seed(SEED + 1 + rank)
    share = GLOBAL_BATCH // REPLICAS
    rows = slice(rank * share, (rank + 1) * share)
    over_ranks = bool(request.get("loss_over_ranks"))
    train(wrapped, optimizer, range(DISTRIBUTED_STEPS), rows, ctx.needs, loss_over_ranks=over_ranks)
    save_run(request["outs"][REPLICA_RUNS[rank]], snapshot(model, optimizer, tensors_only=True))


def _single(request: Mapping[str, Any], ctx: CheckContext, outs: Mapping[str, str]) -> None:
    model, optimizer = build(ctx, request["overrides"])
    save_run(outs[INITIAL], _flatten(model.state_dict(), MODEL))
    torch.manual_seed(SEED + 1)  # the stream rank 0 has
    train(model, optimizer, range(DISTRIBUTED_STEPS), needs=ctx.needs, averaged=True)
    save_run(outs[SINGLE], snapshot(model, optimizer, tensors_only=True))
