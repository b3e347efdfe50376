"""`fused=True` of ema_momentum, adamw_ref and lion: torch's fused kernels, the same math as the
reference kernels, refused where they cannot serve, offered to jobs through the catalogue.

Not bitwise the reference: ema_momentum and lion decay and step in one pass of torch's SGD kernel
(`p - lr * (s + wd * p)` where the reference takes `p * (1 - lr * wd) - lr * s`), their averages
being the multi-tensor kernel's, bitwise; ema_momentum without decay is one pass of that kernel
with momentum, which averages as `beta * m + (1 - beta) * g` where the reference lerps; adamw_ref's
reference is bitwise torch's unfused AdamW, and torch's fused AdamW rounds differently from that.
So the fused kernels are held to the reference within
16 ulps of each tensor's scale after 20 steps (measured: 2-4 ulps, at most 1e-6 in float32 for
values of order 1) -- a wrong formula is off by orders of magnitude more -- and adamw_ref's fused
kernel to torch's own `AdamW(fused=True)` bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from optimizers.registry import load_registry
from optimizers.torch import adamw_ref as adamw_module
from optimizers.torch import ema_momentum as ema_module
from optimizers.torch import lion as lion_module
from optimizers.torch.adamw_ref import AdamWRef
from optimizers.torch.ema_momentum import EmaMomentum
from optimizers.torch.lion import Lion

REGISTRY = load_registry(plugin_dirs=[], styles=("torch",))
# Model-like tensors: matrices, biases, a 0-d scalar, one over the CPU foreach threshold's mean.
SHAPES = [(16, 8), (16,), (8,), (), (300, 40)]
HYPER: dict[str, dict[str, Any]] = {
    "ema_momentum": {"lr": 0.05, "beta": 0.9, "weight_decay": 0.1},
    "adamw_ref": {"lr": 0.01, "beta_1": 0.9, "beta_2": 0.99, "weight_decay": 0.1},
    "lion": {"lr": 0.01, "beta_1": 0.9, "beta_2": 0.99, "weight_decay": 0.1},
}
FUSED_NAMES = sorted(HYPER)


def _train(name: str, dtype: torch.dtype, steps: int = 20, **switches: Any) -> list[torch.Tensor]:
    """Parameters then state tensors after `steps` steps on the same random gradients."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype)) for shape in SHAPES]
    optimizer = REGISTRY.get(name, "torch").cls(params, **{**HYPER[name], **switches})
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator, dtype=dtype)
        optimizer.step()
    state = [value for param in params for _, value in sorted(optimizer.state[param].items())]
    return [param.detach() for param in params] + [v for v in state if isinstance(v, torch.Tensor)]


def _assert_within_ulps(got: list[torch.Tensor], expected: list[torch.Tensor], ulps: int = 16) -> None:
    assert len(got) == len(expected)
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        scale = max(float(b.abs().max()), 1.0)
        tolerance = ulps * torch.finfo(b.dtype).eps * scale
        torch.testing.assert_close(a, b, rtol=0, atol=tolerance, msg=lambda m, i=index: f"tensor {i}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", FUSED_NAMES)
def test_the_fused_kernel_equals_the_reference_within_rounding(name: str, dtype: torch.dtype) -> None:
    reference = _train(name, dtype, foreach=False)
    assert all(torch.equal(a, b) for a, b in zip(_train(name, dtype, foreach=True), reference, strict=True))
    _assert_within_ulps(_train(name, dtype, fused=True), reference)


def test_ema_momentum_at_beta_zero_under_fused_equals_the_reference_within_rounding() -> None:
    """Dense gradients at beta = 0 take the two passes: m = g, as the reference keeps it."""
    reference = _train("ema_momentum", torch.float32, foreach=False, beta=0.0)
    _assert_within_ulps(_train("ema_momentum", torch.float32, fused=True, beta=0.0), reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("name", "switches"),
    [("ema_momentum", {}), ("ema_momentum", {"weight_decay": 0.0}), ("lion", {})],
    ids=["ema_momentum", "ema_momentum-no-decay", "lion"],
)
def test_half_precision_on_a_cpu_under_fused_is_updated_whole(
    name: str, switches: dict[str, Any], dtype: torch.dtype
) -> None:
    """torch 2.13's fused SGD kernel leaves all but the last few elements of a half-precision CPU
    tensor as they were (pytorch/pytorch#191763): such tensors take the multi-tensor kernel."""
    fused = _train(name, dtype, fused=True, **switches)
    assert all(
        torch.equal(a, b) for a, b in zip(fused, _train(name, dtype, foreach=True, **switches), strict=True)
    )
    big = SHAPES.index((300, 40))
    start = _train(name, dtype, steps=0, **switches)
    assert (fused[big] != start[big]).float().mean() > 0.9  # that parameter moved nearly everywhere


def test_ema_momentum_without_decay_is_one_pass_equal_to_the_reference_within_rounding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reference = _train("ema_momentum", torch.float32, foreach=False, weight_decay=0.0)
    _assert_within_ulps(_train("ema_momentum", torch.float32, fused=True, weight_decay=0.0), reference)
    lerps: list[int] = []
    monkeypatch.setattr(torch, "_foreach_lerp_", lambda *a, **k: lerps.append(1))
    _train("ema_momentum", torch.float32, fused=True, weight_decay=0.0)
    assert lerps == []  # the average is the kernel's own: one pass


def test_adamw_refs_fused_kernel_is_bitwise_torchs_fused_adamw() -> None:
    generator = torch.Generator().manual_seed(1)
    ours = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    hyper = HYPER["adamw_ref"]
    mine = AdamWRef(ours, fused=True, **hyper)
    torchs = torch.optim.AdamW(
        theirs,
        lr=hyper["lr"],
        betas=(hyper["beta_1"], hyper["beta_2"]),
        eps=1e-8,
        weight_decay=hyper["weight_decay"],
        fused=True,
    )
    for _ in range(10):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        mine.step()
        torchs.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(mine.state[a]["exp_avg"], torchs.state[b]["exp_avg"])
        assert torch.equal(mine.state[a]["exp_avg_sq"], torchs.state[b]["exp_avg_sq"])
        assert mine.state[a]["step"] == int(torchs.state[b]["step"])


def _kernels_called(
    module: Any, names: dict[str, str], monkeypatch: pytest.MonkeyPatch, optimizer: torch.optim.Optimizer
) -> list[str]:
    called: list[str] = []
    for attribute, label in names.items():
        monkeypatch.setattr(module, attribute, lambda *a, _label=label, **k: called.append(_label))
    optimizer.step()
    return called


EMA_KERNELS = {
    "_fused_ema_momentum": "fused",
    "_multi_tensor_ema_momentum": "multi",
    "_single_tensor_ema_momentum": "single",
}


@pytest.mark.parametrize(
    ("switches", "kernel"),
    [
        ({"fused": True}, "fused"),
        ({"fused": True, "foreach": False}, "fused"),
        ({"fused": True, "beta": 0.0}, "fused"),  # m = g, as the reference keeps it
        ({"fused": False}, "multi"),
    ],
)
def test_ema_momentum_fused_flag_picks_the_kernel(
    switches: dict[str, Any], kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = EmaMomentum([param], **switches)
    assert _kernels_called(ema_module, EMA_KERNELS, monkeypatch, optimizer) == [kernel]


ADAMW_KERNELS = {"_fused_adamw_ref": "fused", "_multi_tensor_adamw_ref": "multi"}
LION_KERNELS = {"_fused_lion": "fused", "_multi_tensor_lion": "multi", "_single_tensor_lion": "single"}


@pytest.mark.parametrize(
    ("module", "kernels", "cls"),
    [(adamw_module, ADAMW_KERNELS, AdamWRef), (lion_module, LION_KERNELS, Lion)],
)
@pytest.mark.parametrize(("fused", "kernel"), [(True, "fused"), (False, "multi")])
def test_the_fused_flag_picks_the_kernel(
    module: Any,
    kernels: dict[str, str],
    cls: type[torch.optim.Optimizer],
    fused: bool,
    kernel: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    assert _kernels_called(module, kernels, monkeypatch, cls([param], fused=fused)) == [kernel]


@pytest.mark.parametrize("name", ["ema_momentum", "lion"])
def test_the_averages_under_fused_are_the_multi_tensor_kernels_bitwise(name: str) -> None:
    """Only the parameters' last pass is torch's kernel (the gradients here do not depend on the
    parameters, so the averages of both runs see the same gradients)."""
    reference, fused = _train(name, torch.float32, foreach=True), _train(name, torch.float32, fused=True)
    assert len(reference) == len(fused) == 2 * len(SHAPES)
    for a, b in zip(reference[len(SHAPES) :], fused[len(SHAPES) :], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", FUSED_NAMES)
def test_sparse_steps_under_fused_match_the_reference_bitwise(name: str) -> None:
    """Sparse gradients (here with ema_momentum's beta = 0 too) take the per-tensor kernel under
    fused=True, computed exactly as without it."""
    hyper = {**HYPER[name], **({"beta": 0.0} if name == "ema_momentum" else {})}
    results = []
    for fused in (False, True):
        embedding = torch.nn.Embedding(6, 3, sparse=True, dtype=torch.float64)
        torch.nn.init.constant_(embedding.weight, 0.5)
        optimizer = REGISTRY.get(name, "torch").cls(embedding.parameters(), **hyper, fused=fused)
        for rows in ([1, 3, 1], [0], [5, 3]):
            optimizer.zero_grad()
            embedding(torch.tensor(rows)).pow(2).sum().backward()
            optimizer.step()
        results.append(embedding.weight.detach().clone())
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("name", FUSED_NAMES)
def test_fused_state_saves_reloads_and_continues_exactly(name: str) -> None:
    """The fused kernel keeps the state the others keep (same keys, shapes, dtypes), and a
    checkpoint taken under it resumes bitwise."""
    cls = REGISTRY.get(name, "torch").cls
    generator = torch.Generator().manual_seed(2)
    grads = [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in range(6)]
    start = [torch.randn(shape, generator=generator) for shape in SHAPES]

    def run(steps: range, optimizer: torch.optim.Optimizer | None = None, **switches: Any) -> Any:
        params = (
            optimizer.param_groups[0]["params"]
            if optimizer
            else [torch.nn.Parameter(t.clone()) for t in start]
        )
        optimizer = optimizer or cls(params, **HYPER[name], **switches)
        for step in steps:
            for param, grad in zip(params, grads[step], strict=True):
                param.grad = grad.clone()
            optimizer.step()
        return optimizer

    straight = run(range(6), fused=True)
    first = run(range(3), fused=True)
    resumed = cls(
        [torch.nn.Parameter(p.detach().clone()) for p in first.param_groups[0]["params"]], **HYPER[name]
    )
    resumed.load_state_dict(first.state_dict())
    assert resumed.param_groups[0]["fused"] is True  # the group's switches come back as saved
    run(range(3, 6), resumed)
    for a, b in zip(resumed.param_groups[0]["params"], straight.param_groups[0]["params"], strict=True):
        assert torch.equal(a, b)

    def layout(optimizer: torch.optim.Optimizer) -> list[Any]:
        return [
            (key, getattr(value, "shape", type(value)), getattr(value, "dtype", None))
            for param in optimizer.param_groups[0]["params"]
            for key, value in sorted(optimizer.state[param].items())
        ]

    assert layout(straight) == layout(run(range(6), fused=False))


@pytest.mark.parametrize(
    ("switches", "params", "message"),
    [
        (
            {"fused": True, "foreach": True},
            [torch.nn.Parameter(torch.ones(2))],
            "fused=True and foreach=True cannot be set together",
        ),
        (
            {"fused": True},
            [torch.nn.Parameter(torch.ones(2, device="meta"))],
            "fused=True needs parameters on a device with fused kernels (",
        ),
        (
            {"fused": True},
            [torch.nn.Parameter(torch.ones(2, dtype=torch.int64), requires_grad=False)],
            "fused=True takes floating-point parameters; received torch.int64",
        ),
        ({"fused": 1}, [torch.nn.Parameter(torch.ones(2))], "fused must be true or false; received 1"),
    ],
)
@pytest.mark.parametrize("name", FUSED_NAMES)
def test_fused_is_refused_where_it_cannot_serve(
    name: str, switches: dict[str, Any], params: list[torch.nn.Parameter], message: str
) -> None:
    with pytest.raises(ValueError) as caught:
        REGISTRY.get(name, "torch").cls(params, **switches)
    assert message in str(caught.value)


def test_fused_is_catalogued_for_the_optimizers_with_a_fused_kernel_only() -> None:
    for name in FUSED_NAMES:
        param = REGISTRY.get(name, "torch").params["fused"]
        assert (param.type, param.default, param.required) == ("bool", False, False)
    # torch's own SGD is offered without it: a job asking for one is told so, by name.
    with pytest.raises(ValueError, match="optimizer 'sgd' \\(torch\\) has no hyperparameter 'fused'"):
        REGISTRY.get("sgd", "torch").kwargs({"lr": 0.1, "fused": True})


@pytest.mark.parametrize(
    ("module", "kernels", "cls"),
    [
        (ema_module, EMA_KERNELS, EmaMomentum),
        (adamw_module, ADAMW_KERNELS, AdamWRef),
        (lion_module, LION_KERNELS, Lion),
    ],
)
def test_under_torch_compile_fused_takes_the_multi_tensor_kernel(
    module: Any, kernels: dict[str, str], cls: type[torch.optim.Optimizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamo cannot trace torch's fused kernels (no fake kernel on CPU), and inductor fuses the
    multi-tensor ops itself: `torch.compile(optimizer.step)` works with fused=True (graph_mode)."""
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = cls([param], fused=True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _kernels_called(module, kernels, monkeypatch, optimizer) == ["multi"]


@pytest.mark.parametrize("name", FUSED_NAMES)
def test_a_group_of_mixed_dtypes_is_fused_per_dtype(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One fused call takes one device and dtype (a GPU requires it): a group mixing float32 and
    float64 parameters takes one call each, and equals the reference as a single dtype does."""

    def run(fused: bool) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(3)
        params = [
            torch.nn.Parameter(torch.randn(5, generator=generator, dtype=dtype))
            for dtype in (torch.float32, torch.float64, torch.float32)
        ]
        optimizer = REGISTRY.get(name, "torch").cls(params, **HYPER[name], fused=fused)
        for _ in range(5):
            for param in params:
                param.grad = torch.randn(5, generator=generator, dtype=param.dtype)
            optimizer.step()
        return [param.detach() for param in params]

    _assert_within_ulps(run(fused=True), run(fused=False))
    calls: list[list[torch.dtype]] = []
    fused_op = torch._fused_adamw_ if name == "adamw_ref" else torch._fused_sgd_
    monkeypatch.setattr(
        torch, fused_op.__name__, lambda params, *a, **k: calls.append([p.dtype for p in params])
    )
    run(fused=True)
    assert calls[:2] == [[torch.float32, torch.float32], [torch.float64]]
