"""Benchmark: one optimizer step of each built-in custom torch optimizer against torch's own.

Over 115 tensors of model-like shapes (a small transformer, 0.55M parameters: embedding, per layer q/k/v/out
projections, two MLP matrices, biases and norms), the same gradients every step, each
variant is timed over `--steps` calls, and the variants are interleaved round after round
(A B C A B C ...) so a burst of load on the machine hits all of them alike; the figure is
the median over rounds, in ms per step. Compared, per custom optimizer:

- `ema_momentum` vs `torch.optim.SGD(momentum=beta, dampening=beta)` (the same EMA math);
- `adamw_ref` vs `torch.optim.AdamW` (the same math, torch's epsilon placement);
- `lion` vs `pytorch_optimizer.Lion` where installed (the same math) and SGD momentum
  (one state tensor per parameter, the cheapest built-in of comparable state);

each custom one with `foreach` False, True and its default (None), and `fused=True` (adamw_ref:
torch's fused AdamW kernel; ema_momentum and lion: the decay and the update in one pass of torch's
fused SGD kernel); each built-in with `foreach` False, True and `fused=True`; plus a naive
per-parameter loop of the same math
(out-of-place arithmetic, as a first attempt is written). `ratio` is the custom optimizer's
time at its default over the best time of its built-in (target: at most 1.2), `fused_ratio` the
same for its `fused=True`.

`--compile kernel` adds each custom optimizer with its functional multi-tensor kernel compiled by
`torch.compile` (inductor), `--compile step` with its whole `step()` compiled: the first call's
compile time (`compile_s`), the step after the learning rate changes as a schedule changes it
(`recompile_s`, and `recompile2_s` for a second change: the rate is a Python float, which Dynamo
guards on), and the steps a compile takes to pay for itself at one rate (`break_even_steps`).
Off by default: on a 2-core CPU each compile takes a minute or more.

Run: `python benchmarks/optimizer_step.py [--steps 20] [--rounds 9] [--shapes model|small]
[--compile kernel|step]`.
Asserts nothing. Prints one `BENCH optimizer_step ...` line per custom optimizer.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_line

from optimizers.torch import adamw_ref as adamw_ref_module
from optimizers.torch import ema_momentum as ema_momentum_module
from optimizers.torch import lion as lion_module
from optimizers.torch.adamw_ref import AdamWRef
from optimizers.torch.ema_momentum import EmaMomentum
from optimizers.torch.lion import Lion

LR, BETA, WEIGHT_DECAY = 1e-3, 0.9, 1e-2
NO_DECAY = "weight_decay=0"  # a pair of variants compared with each other only


def model_shapes(name: str) -> list[tuple[int, ...]]:
    """115 tensors as a small transformer has them (`model`: 0.53M parameters; `large`: 8.4M),
    or digits_mlp's four (`small`)."""
    if name == "small":
        return [(64, 64), (64,), (10, 64), (10,)]
    width, layers, vocab = (256, 8, 8192) if name == "large" else (64, 8, 2048)
    shapes: list[tuple[int, ...]] = [(vocab, width)]
    for _ in range(layers):
        shapes += [(width, width)] * 4 + [(width,)] * 4  # q, k, v, out and their biases
        shapes += [(4 * width, width), (4 * width,), (width, 4 * width), (width,)]  # MLP
        shapes += [(width,), (width,)]  # layer norm weight and bias
    return [*shapes, (width,), (width,)]  # final norm


class NaiveEma(torch.optim.Optimizer):
    """EMA momentum as a first attempt writes it: out-of-place arithmetic, one parameter at a time."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__(params, {"lr": LR})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for p in self.param_groups[0]["params"]:
            state = self.state[p]
            m = state.get("m", torch.zeros_like(p))
            m = BETA * m + (1 - BETA) * p.grad
            state["m"] = m
            p.copy_(p * (1 - LR * WEIGHT_DECAY) - LR * m)


class NaiveAdamW(torch.optim.Optimizer):
    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__(params, {"lr": LR})
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        self.t += 1
        for p in self.param_groups[0]["params"]:
            state = self.state[p]
            m = state.get("m", torch.zeros_like(p))
            v = state.get("v", torch.zeros_like(p))
            m = 0.9 * m + 0.1 * p.grad
            v = 0.999 * v + 0.001 * p.grad * p.grad
            state["m"], state["v"] = m, v
            denominator = v.sqrt() / math.sqrt(1 - 0.999**self.t) + 1e-8
            p.copy_(p * (1 - LR * WEIGHT_DECAY) - LR / (1 - 0.9**self.t) * m / denominator)


class NaiveLion(torch.optim.Optimizer):
    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__(params, {"lr": LR})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for p in self.param_groups[0]["params"]:
            state = self.state[p]
            m = state.get("m", torch.zeros_like(p))
            direction = torch.sign(0.9 * m + 0.1 * p.grad)
            p.copy_(p * (1 - LR * WEIGHT_DECAY) - LR * direction)
            state["m"] = 0.99 * m + 0.01 * p.grad


class Stepper(Protocol):
    def step(self) -> Any: ...


Factory = Callable[[list[torch.Tensor]], Stepper]


# Each custom optimizer's functional multi-tensor kernel, for `--compile kernel`.
KERNELS: dict[str, tuple[ModuleType, str]] = {
    "ema_momentum": (ema_momentum_module, "_multi_tensor_ema_momentum"),
    "adamw_ref": (adamw_ref_module, "_multi_tensor_adamw_ref"),
    "lion": (lion_module, "_multi_tensor_lion"),
}


class CompiledStep:
    """A custom optimizer with `torch.compile`: of its whole `step` (`kernel` None), or of its
    functional multi-tensor kernel, swapped in for the duration of each step."""

    def __init__(self, optimizer: torch.optim.Optimizer, kernel: tuple[ModuleType, str] | None) -> None:
        self.optimizer = optimizer
        self.kernel = kernel
        if kernel is None:
            self.compiled = torch.compile(optimizer.step)
        else:
            module, name = kernel
            self.compiled = torch.compile(getattr(module, name))

    def step(self) -> None:
        if self.kernel is None:
            self.compiled()
            return
        module, name = self.kernel
        eager = getattr(module, name)
        setattr(module, name, self.compiled)
        try:
            self.optimizer.step()
        finally:
            setattr(module, name, eager)


def variants(compile_what: str | None = None) -> dict[str, dict[str, Factory]]:
    """Per custom optimizer: its variants (`custom ...`, `naive`) and its built-ins (`builtin ...`)."""

    def sgd(**kw: object) -> Factory:
        return lambda p: torch.optim.SGD(
            p, lr=LR, momentum=BETA, dampening=BETA, weight_decay=WEIGHT_DECAY, **kw
        )

    def adamw(**kw: object) -> Factory:
        return lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=WEIGHT_DECAY, **kw)

    builtins_sgd = {
        "builtin SGD foreach=False": sgd(foreach=False),
        "builtin SGD foreach=True": sgd(foreach=True),
        "builtin SGD fused": sgd(fused=True),
    }
    table: dict[str, dict[str, Factory]] = {
        "ema_momentum": {
            "custom foreach=False": lambda p: EmaMomentum(
                p, lr=LR, beta=BETA, weight_decay=WEIGHT_DECAY, foreach=False
            ),
            "custom foreach=True": lambda p: EmaMomentum(
                p, lr=LR, beta=BETA, weight_decay=WEIGHT_DECAY, foreach=True
            ),
            "custom default": lambda p: EmaMomentum(p, lr=LR, beta=BETA, weight_decay=WEIGHT_DECAY),
            "custom fused=True": lambda p: EmaMomentum(
                p, lr=LR, beta=BETA, weight_decay=WEIGHT_DECAY, fused=True
            ),
            "naive": NaiveEma,
            **builtins_sgd,
            # ema_momentum's default: no decay. Then it is SGD's math exactly (decoupled decay is
            # one more pass over the parameters, which SGD's coupled decay does not need).
            f"custom fused=True {NO_DECAY}": lambda p: EmaMomentum(p, lr=LR, beta=BETA, fused=True),
            f"builtin SGD fused {NO_DECAY}": lambda p: torch.optim.SGD(
                p, lr=LR, momentum=BETA, dampening=BETA, fused=True
            ),
        },
        "adamw_ref": {
            "custom foreach=False": lambda p: AdamWRef(p, lr=LR, weight_decay=WEIGHT_DECAY, foreach=False),
            "custom foreach=True": lambda p: AdamWRef(p, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True),
            "custom default": lambda p: AdamWRef(p, lr=LR, weight_decay=WEIGHT_DECAY),
            "custom fused=True": lambda p: AdamWRef(p, lr=LR, weight_decay=WEIGHT_DECAY, fused=True),
            "naive": NaiveAdamW,
            "builtin AdamW foreach=False": adamw(foreach=False),
            "builtin AdamW foreach=True": adamw(foreach=True),
            "builtin AdamW fused": adamw(fused=True),
        },
        "lion": {
            "custom foreach=False": lambda p: Lion(p, lr=LR, weight_decay=WEIGHT_DECAY, foreach=False),
            "custom foreach=True": lambda p: Lion(p, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True),
            "custom default": lambda p: Lion(p, lr=LR, weight_decay=WEIGHT_DECAY),
            "custom fused=True": lambda p: Lion(p, lr=LR, weight_decay=WEIGHT_DECAY, fused=True),
            "naive": NaiveLion,
            **builtins_sgd,
        },
    }
    try:
        from pytorch_optimizer import Lion as PeerLion

        table["lion"]["builtin pytorch_optimizer.Lion"] = lambda p: PeerLion(
            p, lr=LR, weight_decay=WEIGHT_DECAY
        )
    except ImportError:
        print("pytorch_optimizer is not installed: lion is compared with SGD momentum only")
    if compile_what == "step":
        for factories in table.values():
            factories["custom compiled"] = _compiled(factories["custom default"], None)
    elif compile_what == "kernel":
        for name, factories in table.items():
            factories["custom compiled"] = _compiled(factories["custom foreach=True"], KERNELS[name])
    return table


def _compiled(factory: Factory, kernel: tuple[ModuleType, str] | None) -> Factory:
    return lambda params: CompiledStep(factory(params), kernel)  # type: ignore[arg-type]


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def time_steps(optimizer: Stepper, steps: int, clock: Callable[[], float]) -> float:
    started = clock()
    for _ in range(steps):
        optimizer.step()
    return (clock() - started) * 1000 / steps


def measure(
    shapes: list[tuple[int, ...]],
    factories: dict[str, Factory],
    steps: int,
    rounds: int,
    clock: Callable[[], float],
) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms per step of each variant, and the compiled ones' compile and recompile seconds."""
    generator = torch.Generator().manual_seed(0)
    optimizers = {}
    compiling: dict[str, float] = {}
    for label, factory in factories.items():
        params = [torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.02) for shape in shapes]
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizers[label] = factory(params)
        started = time.perf_counter()
        optimizers[label].step()  # state built (and a compiled step compiled) outside the timing
        if isinstance(optimizers[label], CompiledStep):
            compiling["compile_s"] = time.perf_counter() - started
            compiling["recompile_s"] = _recompile_seconds(optimizers[label], 1.01)
            compiling["recompile2_s"] = _recompile_seconds(optimizers[label], 1.02)
    times: dict[str, list[float]] = {label: [] for label in factories}
    labels = list(factories)
    for index in range(rounds):
        shift = index % len(labels)
        for label in labels[shift:] + labels[:shift]:  # each round starts with another variant
            times[label].append(time_steps(optimizers[label], steps, clock))
    return {label: statistics.median(values) for label, values in times.items()}, compiling


def _recompile_seconds(compiled: CompiledStep, factor: float) -> float:
    """One step after the learning rate changed, as a schedule changes it every step (wall s)."""
    for group in compiled.optimizer.param_groups:
        group["lr"] *= factor
    started = time.perf_counter()
    compiled.step()
    seconds = time.perf_counter() - started
    for group in compiled.optimizer.param_groups:
        group["lr"] /= factor
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="steps per timed call")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds; the median is reported")
    parser.add_argument("--shapes", choices=("model", "large", "small"), default="model")
    parser.add_argument("--only", help="comma-separated custom optimizer names")
    parser.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="cpu",
        help="cpu: the timing thread's CPU time (robust on a shared, loaded machine; with --threads 1 "
        "it is all the work); wall: elapsed time",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--compile",
        choices=("kernel", "step"),
        help="also torch.compile each custom optimizer's multi-tensor kernel, or its whole step() "
        "(a minute or more a compile here)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = model_shapes(args.shapes)
    numel = sum(math.prod(shape) for shape in shapes)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {len(shapes)} tensors, "
        f"{numel / 1e6:.2f}M parameters (float32), clock {args.clock}; {machine_line()}"
    )
    chosen = args.only.split(",") if args.only else None
    for name, factories in variants(args.compile).items():
        if chosen and name not in chosen:
            continue
        medians, compiling = measure(shapes, factories, args.steps, args.rounds, CLOCKS[args.clock])
        builtin = {
            label: ms
            for label, ms in medians.items()
            if label.startswith("builtin") and NO_DECAY not in label
        }
        best_label = min(builtin, key=builtin.__getitem__)
        print(f"\n{name}: ms per step (median of {args.rounds} interleaved rounds of {args.steps} steps)")
        for label, ms in medians.items():
            print(f"  {label:<34} {ms:8.3f} ms  {ms / builtin[best_label]:5.2f}x best built-in")
        fields = {
            "default": medians["custom default"],
            "foreach_off": medians["custom foreach=False"],
            "foreach_on": medians["custom foreach=True"],
            "naive": medians["naive"],
            "best_builtin": builtin[best_label],
        }
        extra = ""
        if "custom fused=True" in medians:
            fields["fused"] = medians["custom fused=True"]
            extra += f" fused_ratio={medians['custom fused=True'] / builtin[best_label]:.2f}"
        if f"custom fused=True {NO_DECAY}" in medians:
            no_decay = medians[f"custom fused=True {NO_DECAY}"] / medians[f"builtin SGD fused {NO_DECAY}"]
            fields["fused_no_decay"] = medians[f"custom fused=True {NO_DECAY}"]
            extra += f" fused_no_decay_ratio={no_decay:.2f}"
        if "custom compiled" in medians:
            fields["compiled"] = medians["custom compiled"]
            saved_ms = medians["custom default"] - medians["custom compiled"]
            break_even = compiling["compile_s"] * 1000 / saved_ms if saved_ms > 0 else math.inf
            extra += " " + " ".join(f"{key}={value:.1f}" for key, value in compiling.items())
            extra += f" break_even_steps={break_even:.0f}"
            print(
                f"  compiled {args.compile}: compile {compiling['compile_s']:.1f} s, a new lr recompiles in "
                f"{compiling['recompile_s']:.1f} s, another in {compiling['recompile2_s']:.1f} s; pays "
                f"for itself after {break_even:.0f} steps at one lr"
            )
        text = " ".join(f"{key}_ms={value:.3f}" for key, value in fields.items())
        ratio = medians["custom default"] / builtin[best_label]
        best_name = best_label.removeprefix("builtin ").replace(" ", "_")
        print(
            f"BENCH optimizer_step optimizer={name} shapes={args.shapes} clock={args.clock} {text} "
            f"best={best_name} ratio={ratio:.2f}{extra}",
            flush=True,
        )


if __name__ == "__main__":
    main()
