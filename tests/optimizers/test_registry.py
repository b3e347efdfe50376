"""The catalogue: built-ins, entry points and plugin folders feed one registry."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from optimizers.hyperparams import Param, non_negative, unit_interval
from optimizers.registry import (
    ENTRY_POINT_GROUP,
    PLUGIN_DIRS_ENV,
    Entry,
    Registry,
    derive_params,
    entry_for_class,
    load_registry,
    register,
    snake_case,
)


@pytest.fixture(autouse=True)
def _forget_plugin_modules() -> Iterator[None]:
    """Plugin files are imported under `optlab_plugin_<stem>`; don't leak them between tests."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("optlab_plugin_"):
            del sys.modules[name]


def _write(directory: Path, filename: str, source: str) -> Path:
    path = directory / filename
    path.write_text(textwrap.dedent(source))
    return path


def _errors_for(registry: Registry, path: Path) -> list[str]:
    return [error.error for error in registry.errors if error.source == str(path)]


# --- snake_case -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("class_name", "expected"),
    [
        ("SignMomentum", "sign_momentum"),  # documented
        ("EMAMomentum", "ema_momentum"),  # documented
        ("Lion", "lion"),
        ("SGD", "sgd"),
        ("EmaMomentum", "ema_momentum"),
        ("AdamWRef", "adam_w_ref"),
        ("HTTPServer", "http_server"),
        ("Adam8bit", "adam8bit"),
        ("Lion2Sign", "lion2_sign"),
    ],
)
def test_snake_case(class_name: str, expected: str) -> None:
    assert snake_case(class_name) == expected


# --- built-ins ------------------------------------------------------------------------------------------


def test_load_registry_has_the_builtins() -> None:
    registry = load_registry(plugin_dirs=[])
    assert registry.errors == []
    for name in ("ema_momentum", "sgd", "adam", "adamw"):
        entry = registry.get(name)
        assert entry.name == name
        assert entry.framework == "torch"
        assert entry.style == "torch"
        assert issubclass(entry.cls, torch.optim.Optimizer)
        assert entry.source.startswith("builtin:optimizers.torch.")
        assert "lr" in entry.params


def test_builtin_tunables_follow_optlab_tunable() -> None:
    registry = load_registry(plugin_dirs=[])
    assert list(registry.get("sgd").params) == ["lr", "momentum", "dampening", "weight_decay", "nesterov"]
    assert list(registry.get("adam").params) == ["lr", "betas", "eps", "weight_decay", "amsgrad"]
    assert list(registry.get("ema_momentum").params) == ["lr", "beta", "weight_decay"]
    # torch writes `momentum=0`; a declared float keeps a float default.
    assert registry.get("sgd").params["momentum"].default == 0.0
    assert type(registry.get("sgd").params["momentum"].default) is float
    assert registry.get("adamw").params["weight_decay"].default == 0.01


def test_describe_is_json_serializable() -> None:
    registry = load_registry(plugin_dirs=[])
    for entry in registry.entries.values():
        described = entry.describe()
        assert json.loads(json.dumps(described)) == described
    adam = registry.get("adam").describe()
    assert adam["class"] == "optimizers.torch.adam.Adam"
    assert adam["reference"] == "https://arxiv.org/abs/1412.6980"
    assert {"name": "betas", "default": [0.9, 0.999]}.items() <= adam["params"][1].items()


def test_get_unknown_lists_known() -> None:
    registry = load_registry(plugin_dirs=[])
    with pytest.raises(ValueError, match=r"^unknown optimizer 'lion'; known: adam, adamw, ema_momentum, sgd"):
        registry.get("lion")


# --- plugin folders -------------------------------------------------------------------------------------

SIGN_MOMENTUM = '''
    """Sign of an EMA of gradients. See https://example.org/sign-momentum for the paper."""
    from __future__ import annotations

    import torch


    class SignMomentum(torch.optim.Optimizer):
        def __init__(self, params, lr: float = 0.01, beta: float = 0.9, steps: int = 3, flag: bool = True):
            super().__init__(params, {"lr": lr, "beta": beta})

        def step(self, closure=None):
            return None
'''

NAMED = """
    import torch
    from torch.optim import Adagrad  # imported, not defined here: not registered


    class Anything(torch.optim.SGD):
        optlab_name = "my_sgd"
"""

BROKEN = """
    import torch

    raise RuntimeError("plugin exploded on import")
"""

NO_OPTIMIZER = """
    from torch.optim import SGD  # an optimizer imported is not one defined


    def helper():
        return 1
"""

DUPLICATE_OF_BUILTIN = """
    import torch


    class MySgd(torch.optim.SGD):
        optlab_name = "sgd"
"""


def test_plugin_file_defining_an_optimizer_is_registered_under_snake_case(tmp_path: Path) -> None:
    path = _write(tmp_path, "sign.py", SIGN_MOMENTUM)
    registry = load_registry(plugin_dirs=[str(tmp_path)])
    assert registry.errors == []
    entry = registry.get("sign_momentum")
    assert entry.cls.__name__ == "SignMomentum"
    assert entry.framework == "torch"
    assert entry.source == f"plugin {path}"
    # Postponed annotations (strings) still give the types.
    assert {name: param.type for name, param in entry.params.items()} == {
        "lr": "float",
        "beta": "float",
        "steps": "int",
        "flag": "bool",
    }
    optimizer = registry.build("sign_momentum", [torch.nn.Parameter(torch.zeros(1))], {"lr": 0.5})
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_plugin_class_without_docstring_gets_no_borrowed_summary(tmp_path: Path) -> None:
    _write(tmp_path, "sign.py", SIGN_MOMENTUM)
    entry = load_registry(plugin_dirs=[str(tmp_path)]).get("sign_momentum")
    assert entry.summary != "Base class for all optimizers."


def test_optlab_name_overrides_and_imported_classes_are_not_registered(tmp_path: Path) -> None:
    _write(tmp_path, "named.py", NAMED)
    registry = load_registry(plugin_dirs=[str(tmp_path)])
    assert registry.errors == []
    assert registry.get("my_sgd").cls.__name__ == "Anything"
    assert "anything" not in registry.entries
    assert "adagrad" not in registry.entries
    assert sorted(registry.entries) == ["adam", "adamw", "ema_momentum", "my_sgd", "sgd"]


def test_bad_plugins_are_recorded_and_the_others_still_load(tmp_path: Path) -> None:
    broken = _write(tmp_path, "a_broken.py", BROKEN)
    empty = _write(tmp_path, "b_no_optimizer.py", NO_OPTIMIZER)
    duplicate = _write(tmp_path, "c_duplicate.py", DUPLICATE_OF_BUILTIN)
    _write(tmp_path, "d_named.py", NAMED)
    _write(tmp_path, "e_sign.py", SIGN_MOMENTUM)
    _write(tmp_path, "notes.txt", "not python")

    registry = load_registry(plugin_dirs=[str(tmp_path)])

    assert sorted(error.source for error in registry.errors) == sorted(
        [str(broken), str(empty), str(duplicate)]
    )
    assert _errors_for(registry, broken) == ["RuntimeError: plugin exploded on import"]
    [no_optimizer] = _errors_for(registry, empty)
    assert str(empty) in no_optimizer
    assert "defines no optimizer class" in no_optimizer
    [twice] = _errors_for(registry, duplicate)
    assert "'sgd' is registered twice" in twice
    assert str(duplicate) in twice
    assert "builtin:optimizers.torch.sgd" in twice
    # The good plugins loaded, and the built-in kept its name.
    assert {"my_sgd", "sign_momentum"} <= set(registry.entries)
    assert registry.get("sgd").source == "builtin:optimizers.torch.sgd"


def test_same_name_in_two_plugin_files_keeps_the_first(tmp_path: Path) -> None:
    first = _write(tmp_path, "a_first.py", SIGN_MOMENTUM)
    second = _write(tmp_path, "b_second.py", SIGN_MOMENTUM)
    registry = load_registry(plugin_dirs=[str(tmp_path)])
    assert registry.get("sign_momentum").source == f"plugin {first}"
    [error] = registry.errors
    assert error.source == str(second)
    assert "'sign_momentum' is registered twice" in error.error


def test_plugin_dirs_come_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    _write(tmp_path / "one", "sign.py", SIGN_MOMENTUM)
    _write(tmp_path / "two", "named.py", NAMED)
    monkeypatch.setenv(PLUGIN_DIRS_ENV, os.pathsep.join([str(tmp_path / "one"), str(tmp_path / "two")]))
    registry = load_registry()
    assert registry.errors == []
    assert {"sign_momentum", "my_sgd"} <= set(registry.entries)
    # An explicit list wins over the environment.
    assert "sign_momentum" not in load_registry(plugin_dirs=[]).entries


def test_entry_points_register_modules_and_classes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, "optlab_test_ep_module.py", SIGN_MOMENTUM)
    _write(tmp_path, "optlab_test_ep_class.py", NAMED)
    monkeypatch.syspath_prepend(str(tmp_path))
    points = [
        importlib.metadata.EntryPoint("signs", "optlab_test_ep_module", ENTRY_POINT_GROUP),
        importlib.metadata.EntryPoint("mine", "optlab_test_ep_class:Anything", ENTRY_POINT_GROUP),
        importlib.metadata.EntryPoint("gone", "optlab_test_ep_missing", ENTRY_POINT_GROUP),
    ]

    def entry_points(*, group: str) -> list[importlib.metadata.EntryPoint]:
        return points if group == ENTRY_POINT_GROUP else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    try:
        registry = load_registry(plugin_dirs=[])
    finally:
        for name in ("optlab_test_ep_module", "optlab_test_ep_class", "optlab_test_ep_missing"):
            sys.modules.pop(name, None)
    assert registry.get("sign_momentum").source == "entry point signs (optlab_test_ep_module)"
    assert registry.get("my_sgd").source == "entry point mine (optlab_test_ep_class:Anything)"
    [error] = registry.errors
    assert error.source == "entry point gone"
    assert "ModuleNotFoundError" in error.error


# --- derive_params --------------------------------------------------------------------------------------


class _Probe(torch.optim.Optimizer):
    """A probe optimizer. Paper: https://example.org/probe."""

    optlab_hyperparameters: ClassVar[dict[str, Param]] = {
        "beta": unit_interval("beta", "decay"),
        "weight_decay": non_negative("weight_decay"),
    }

    def __init__(
        self,
        params: Any,
        lr: float = 0.5,
        beta: float = 0.9,
        weight_decay: float = 0,
        steps: int = 3,
        nesterov: bool = False,
        betas: tuple[float, float] = (0.9, 0.99),
        scale=2,  # unannotated on purpose: any number, kept as given
        name: str = "x",
        hook: Any = None,
        required: float = 1.0,
        *args: Any,
        foreach: bool | None = None,
        maximize: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, {"lr": lr})


def test_derive_params_types_and_defaults_from_signature_ranges_from_declarations() -> None:
    params = derive_params(_Probe)
    assert params == {
        "lr": Param("lr", "float", 0.5, low=0.0, low_inclusive=False),
        "beta": Param("beta", "float", 0.9, low=0.0, high=1.0, high_inclusive=False, help="decay"),
        "weight_decay": Param("weight_decay", "float", 0.0, low=0.0),
        "steps": Param("steps", "int", 3),
        "nesterov": Param("nesterov", "bool", False),
        "betas": Param("betas", "float_pair", (0.9, 0.99)),
        "scale": Param("scale", "number", 2),
        "required": Param("required", "float", 1.0),
    }
    assert type(params["weight_decay"].default) is float


def test_derive_params_respects_optlab_tunable() -> None:
    class Narrow(_Probe):
        optlab_tunable = ("lr", "steps")

    assert list(derive_params(Narrow)) == ["lr", "steps"]


def test_derive_params_reads_a_tensor_lr_default() -> None:
    class TensorLr(torch.optim.Optimizer):
        def __init__(self, params: Any, lr: float | torch.Tensor = torch.tensor(0.25)) -> None:  # noqa: B008
            super().__init__(params, {"lr": lr})

    assert derive_params(TensorLr)["lr"] == Param("lr", "float", 0.25, low=0.0, low_inclusive=False)


def test_entry_for_class_reads_docstring_and_register_annotations() -> None:
    plain = entry_for_class(_Probe, source="test")
    assert plain.name == "_probe"
    assert plain.summary == "A probe optimizer. Paper: https://example.org/probe."
    assert plain.reference == "https://example.org/probe."
    assert plain.supports_sparse is False

    @register(name="probe2", summary="Short.", reference="https://example.org/2", supports_sparse=True)
    class Annotated(_Probe):
        pass

    entry = entry_for_class(Annotated, source="test")
    assert (entry.name, entry.summary, entry.reference, entry.supports_sparse) == (
        "probe2",
        "Short.",
        "https://example.org/2",
        True,
    )
    assert register(Annotated) is Annotated


def test_entry_for_class_rejects_a_non_optimizer() -> None:
    with pytest.raises(TypeError, match=r"expected a subclass of torch\.optim\.Optimizer"):
        entry_for_class(dict, source="test")


# --- Registry.build -------------------------------------------------------------------------------------


def test_build_passes_hyperparameters_and_fills_defaults() -> None:
    registry = load_registry(plugin_dirs=[])
    optimizer = registry.build("ema_momentum", [torch.nn.Parameter(torch.zeros(2))], {"lr": 0.5, "beta": 0.8})
    group = optimizer.param_groups[0]
    assert (group["lr"], group["beta"], group["weight_decay"]) == (0.5, 0.8, 0.0)


def test_build_maps_lr_to_the_class_argument() -> None:
    class Renamed(torch.optim.Optimizer):
        def __init__(self, params: Any, learning_rate: float = 0.1) -> None:
            super().__init__(params, {"lr": learning_rate})

    registry = Registry()
    registry.add(
        Entry(
            name="renamed",
            framework="torch",
            style="torch",
            cls=Renamed,
            params={"lr": Param("lr", "float", 0.1, low=0.0, low_inclusive=False)},
            supports_sparse=False,
            summary="",
            reference="",
            source="test",
            lr_arg="learning_rate",
        )
    )
    optimizer = registry.build("renamed", [torch.nn.Parameter(torch.zeros(1))], {"lr": 0.3})
    assert optimizer.param_groups[0]["lr"] == 0.3


def test_build_rejects_unknown_hyperparameter_listing_accepted() -> None:
    registry = load_registry(plugin_dirs=[])
    with pytest.raises(ValueError) as caught:
        registry.build("sgd", [torch.nn.Parameter(torch.zeros(1))], {"lr": 0.1, "foreach": True})
    assert str(caught.value) == (
        "optimizer 'sgd' has no hyperparameter 'foreach'; "
        "accepted: lr, momentum, dampening, weight_decay, nesterov"
    )


def test_build_rejects_invalid_value_naming_it() -> None:
    registry = load_registry(plugin_dirs=[])
    with pytest.raises(ValueError, match=r"^momentum must be a number in \[0, 1\); received 1.0$"):
        registry.build("sgd", [torch.nn.Parameter(torch.zeros(1))], {"momentum": 1.0})
