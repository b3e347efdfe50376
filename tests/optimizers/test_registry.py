"""The catalogue: built-ins, entry points and plugin folders feed one registry."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from optimizers import registry as registry_module
from optimizers.hyperparams import Param, check_all, non_negative, unit_interval
from optimizers.registry import (
    BUILTIN_MODULES,
    ENTRY_POINT_GROUP,
    PLUGIN_DIRS_ENV,
    PLUGIN_SOURCE,
    STYLES,
    Entry,
    Registry,
    derive_params,
    entry_for_class,
    load_registry,
    optimizer_classes,
    register,
    snake_case,
    style_of,
)

# The Keras 3 and tf_keras built-ins are written elsewhere and may be missing or in flux: every
# test that is not about styles loads the torch style only (which also keeps TensorFlow out).
TORCH_ONLY = ("torch",)
TORCH_BUILTINS = ["adam", "adamw", "adamw_ref", "ema_momentum", "lion", "sgd"]
ROOT = Path(__file__).resolve().parents[2]


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


def _torch_registry(plugin_dirs: list[str] | None = None) -> Registry:
    return load_registry(plugin_dirs=[] if plugin_dirs is None else plugin_dirs, styles=TORCH_ONLY)


def test_a_job_whose_plugin_failed_to_load_is_told_the_load_error_not_only_unknown(tmp_path: Path) -> None:
    """A plugin caught half rewritten as a job started (a probe: `cp` over it) failed the job with
    "unknown optimizer 'sign_momentum'" alone, while GET /optimizers listed it: its SyntaxError was
    nowhere in the job's error."""
    plugin = _write(tmp_path, "sign_momentum.py", "import torch\nclass SignMomentum(torch.optim.Optimizer:\n")
    registry = _torch_registry([str(tmp_path)])
    with pytest.raises(ValueError) as raised:
        registry.get("sign_momentum")
    said = str(raised.value)
    assert said.startswith("unknown optimizer 'sign_momentum'; known: adam, ")
    assert f"These failed to load, so optimizers they define are not known: {plugin} (" in said
    assert "SyntaxError" in said


def _fake_entry(name: str, style: str, source: str = "test") -> Entry:
    """An entry that needs no framework: enough for the bookkeeping of `Registry`."""
    return Entry(
        name=name,
        framework=registry_module.FRAMEWORK_OF_STYLE[style],
        style=style,
        cls=object,
        params={},
        supports_sparse=False,
        summary="",
        reference="",
        source=source,
    )


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


def test_load_registry_has_the_torch_builtins() -> None:
    registry = _torch_registry()
    assert registry.errors == []
    assert registry.names() == TORCH_BUILTINS
    assert sorted(registry.entries) == [(name, "torch") for name in TORCH_BUILTINS]
    for name in TORCH_BUILTINS:
        entry = registry.get(name)
        assert entry is registry.get(name, "torch") is registry.entries[(name, "torch")]
        assert entry.name == name
        assert entry.framework == "torch"
        assert entry.style == "torch"
        assert entry.lr_arg == "lr"
        assert issubclass(entry.cls, torch.optim.Optimizer)
        assert entry.source == f"builtin:optimizers.torch.{name}"
        assert "lr" in entry.params


def test_builtin_modules_follow_the_file_layout() -> None:
    """One file per optimizer, named after its registry key, for every style."""
    assert set(BUILTIN_MODULES) == set(STYLES)
    for style, modules in BUILTIN_MODULES.items():
        assert all(module.startswith(f"optimizers.{style}.") for module in modules)
    assert "optimizers.tf_legacy.adamw" not in BUILTIN_MODULES["tf_legacy"]  # tf_keras has no legacy AdamW
    assert "optimizers.keras.adamw" in BUILTIN_MODULES["keras"]


def test_builtin_tunables_follow_optlab_tunable() -> None:
    registry = _torch_registry()
    assert list(registry.get("sgd").params) == ["lr", "momentum", "dampening", "weight_decay", "nesterov"]
    assert list(registry.get("adam").params) == ["lr", "betas", "eps", "weight_decay", "amsgrad"]
    # `fused` is an implementation switch, catalogued because these three declare it (registry.py).
    assert list(registry.get("ema_momentum").params) == ["lr", "beta", "weight_decay", "fused"]
    assert list(registry.get("lion").params) == ["lr", "beta_1", "beta_2", "weight_decay", "fused"]
    assert list(registry.get("adamw_ref").params) == [
        "lr",
        "beta_1",
        "beta_2",
        "epsilon",
        "weight_decay",
        "fused",
    ]
    # torch writes `momentum=0`; a declared float keeps a float default.
    assert registry.get("sgd").params["momentum"].default == 0.0
    assert type(registry.get("sgd").params["momentum"].default) is float
    assert registry.get("adamw").params["weight_decay"].default == 0.01
    lion = registry.get("lion").params
    assert [lion[name].default for name in lion] == [1e-4, 0.9, 0.99, 0.0, False]


def test_builtin_sparse_support_is_declared() -> None:
    registry = _torch_registry()
    sparse = {name for name in registry.names() if registry.get(name).supports_sparse}
    assert sparse == {"adamw_ref", "ema_momentum", "lion"}


def test_describe_is_json_serializable() -> None:
    registry = _torch_registry()
    for entry in registry.entries.values():
        described = entry.describe()
        assert json.loads(json.dumps(described)) == described
        assert described["style"] == "torch"
    adam = registry.get("adam").describe()
    assert adam["class"] == "optimizers.torch.adam.Adam"
    assert adam["reference"] == "https://arxiv.org/abs/1412.6980"
    assert {"name": "betas", "default": [0.9, 0.999]}.items() <= adam["params"][1].items()
    lion = registry.get("lion").describe()
    assert (lion["reference"], lion["supports_sparse"]) == ("https://arxiv.org/abs/2302.06675", True)


def test_get_unknown_lists_known() -> None:
    registry = _torch_registry()
    with pytest.raises(ValueError) as caught:
        registry.get("nope")
    assert str(caught.value) == (
        "unknown optimizer 'nope'; known: adam, adamw, adamw_ref, ema_momentum, lion, sgd"
    )


def test_get_a_style_the_name_lacks_says_which_styles_it_has() -> None:
    registry = _torch_registry()
    with pytest.raises(ValueError) as caught:
        registry.get("sgd", "keras")
    assert str(caught.value) == "optimizer 'sgd' has no keras style; it exists in: torch"


# --- styles ---------------------------------------------------------------------------------------------


def test_one_name_may_exist_once_in_each_style() -> None:
    registry = Registry()
    registry.add(_fake_entry("lion", "tf_legacy"))
    registry.add(_fake_entry("lion", "keras"))
    assert registry.get("lion").style == "keras"  # no torch entry: keras comes next
    registry.add(_fake_entry("lion", "torch"))
    registry.add(_fake_entry("sgd", "keras"))
    assert registry.names() == ["lion", "sgd"]
    assert sorted(registry.entries) == [
        ("lion", "keras"),
        ("lion", "tf_legacy"),
        ("lion", "torch"),
        ("sgd", "keras"),
    ]
    assert registry.get("lion").style == "torch"  # without a style: torch, keras, tf_legacy
    assert [registry.get("lion", style).style for style in STYLES] == list(STYLES)
    with pytest.raises(ValueError, match=r"^optimizer 'sgd' has no tf_legacy style; it exists in: keras$"):
        registry.get("sgd", "tf_legacy")


def test_the_same_name_twice_in_one_style_is_refused_naming_both_sources() -> None:
    registry = Registry()
    registry.add(_fake_entry("lion", "keras", source="first.py"))
    with pytest.raises(ValueError) as caught:
        registry.add(_fake_entry("lion", "keras", source="second.py"))
    assert str(caught.value) == (
        "optimizer name 'lion' (keras style) is registered twice: by first.py and by second.py; "
        "set a distinct `optlab_name` on one of them"
    )
    assert registry.get("lion", "keras").source == "first.py"


def test_style_of() -> None:
    class Plain:
        def step(self) -> None:
            pass

    assert style_of(torch.optim.SGD) == "torch"
    assert style_of(_Probe) == "torch"
    assert style_of(Plain) is None
    assert style_of(dict) is None


def test_optimizer_classes_returns_each_defined_class_with_its_style(tmp_path: Path) -> None:
    _write(tmp_path, "sign.py", SIGN_MOMENTUM)
    registry = _torch_registry([str(tmp_path)])
    module = sys.modules[registry.get("sign_momentum").cls.__module__]
    assert [(cls.__name__, style) for cls, style in optimizer_classes(module)] == [("SignMomentum", "torch")]


def test_unknown_style_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(ValueError) as caught:
        load_registry(plugin_dirs=[], styles=("torch", "jax"))
    assert str(caught.value) == "unknown style 'jax'; known: torch, keras, tf_legacy"


def test_torch_style_registers_no_tensorflow_entries() -> None:
    registry = _torch_registry()
    assert {style for _, style in registry.entries} == {"torch"}
    assert {entry.framework for entry in registry.entries.values()} == {"torch"}


def test_torch_style_imports_no_tensorflow() -> None:
    """A torch job process must not pay for (or depend on) TensorFlow."""
    code = (
        "import sys; from optimizers.registry import load_registry; "
        "registry = load_registry(plugin_dirs=[], styles=('torch',)); "
        "assert not registry.errors, registry.errors; "
        "print(sorted(m for m in ('tensorflow', 'keras', 'tf_keras') if m in sys.modules))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert completed.stdout.strip() == "[]"


def test_a_builtin_that_fails_to_import_is_recorded_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    modules = ("optimizers.torch.sgd", "optimizers.torch.no_such_optimizer", "optimizers.torch.adam")
    monkeypatch.setitem(BUILTIN_MODULES, "torch", modules)
    registry = _torch_registry()
    assert registry.names() == ["adam", "sgd"]  # the others still loaded
    [error] = registry.errors
    assert error.source == "builtin:optimizers.torch.no_such_optimizer"
    assert error.error.startswith("ModuleNotFoundError: No module named 'optimizers.torch.no_such_optimizer'")


def test_only_the_requested_styles_builtins_are_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    for style in ("keras", "tf_legacy"):
        monkeypatch.setitem(BUILTIN_MODULES, style, (f"optimizers.{style}.no_such_optimizer",))
    assert _torch_registry().errors == []
    registry = load_registry(plugin_dirs=[], styles=("torch", "keras"))
    assert [error.source for error in registry.errors] == ["builtin:optimizers.keras.no_such_optimizer"]
    assert registry.names() == TORCH_BUILTINS


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
    registry = _torch_registry([str(tmp_path)])
    assert registry.errors == []
    entry = registry.get("sign_momentum")
    assert entry.cls.__name__ == "SignMomentum"
    assert (entry.framework, entry.style, entry.lr_arg) == ("torch", "torch", "lr")
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
    entry = _torch_registry([str(tmp_path)]).get("sign_momentum")
    assert entry.summary != "Base class for all optimizers."


def test_optlab_name_overrides_and_imported_classes_are_not_registered(tmp_path: Path) -> None:
    _write(tmp_path, "named.py", NAMED)
    registry = _torch_registry([str(tmp_path)])
    assert registry.errors == []
    assert registry.get("my_sgd").cls.__name__ == "Anything"
    assert registry.names() == sorted([*TORCH_BUILTINS, "my_sgd"])  # no "anything", no "adagrad"


def test_bad_plugins_are_recorded_and_the_others_still_load(tmp_path: Path) -> None:
    broken = _write(tmp_path, "a_broken.py", BROKEN)
    empty = _write(tmp_path, "b_no_optimizer.py", NO_OPTIMIZER)
    duplicate = _write(tmp_path, "c_duplicate.py", DUPLICATE_OF_BUILTIN)
    _write(tmp_path, "d_named.py", NAMED)
    _write(tmp_path, "e_sign.py", SIGN_MOMENTUM)
    _write(tmp_path, "notes.txt", "not python")
    syntax = _write(tmp_path, "f_syntax.py", "import torch\n\n\nclass Half(torch.optim.SGD)\n    pass\n")

    registry = _torch_registry([str(tmp_path)])

    assert sorted(error.source for error in registry.errors) == sorted(
        [str(broken), str(empty), str(duplicate), str(syntax)]
    )
    # Each with the line of the file it points at (the catalogue had only "SyntaxError: expected ':'").
    assert _errors_for(registry, broken) == ["RuntimeError: plugin exploded on import (at a_broken.py:4)"]
    assert _errors_for(registry, syntax) == ["SyntaxError: expected ':' (at f_syntax.py:4)"]
    [no_optimizer] = _errors_for(registry, empty)
    assert str(empty) in no_optimizer
    assert "defines no optimizer class" in no_optimizer
    # What to do instead, where the file imports one (registering a published optimizer, say).
    assert "it imports SGD, and imported classes are not registered" in no_optimizer
    assert "define a subclass in the file (`class MySGD(SGD): pass`" in no_optimizer
    [twice] = _errors_for(registry, duplicate)
    assert "optimizer name 'sgd' (torch style) is registered twice" in twice
    assert str(duplicate) in twice
    assert "builtin:optimizers.torch.sgd" in twice
    # The good plugins loaded, and the built-in kept its name.
    assert {"my_sgd", "sign_momentum"} <= set(registry.names())
    assert registry.get("sgd").source == "builtin:optimizers.torch.sgd"


UNFINISHED_BASE = """
    import torch


    class MomentumBase(torch.optim.Optimizer):  # the file's shared part: no step of its own
        def __init__(self, params, lr=0.1, beta=0.9):
            super().__init__(params, dict(lr=lr, beta=beta))


    class SignMomentum(MomentumBase):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad.sign(), alpha=-group["lr"])
"""
ONLY_UNFINISHED = """
    import torch


    class NoStep(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1):
            super().__init__(params, dict(lr=lr))


    class NoInit(torch.optim.Optimizer):
        def step(self, closure=None):
            return None
"""


def test_an_unfinished_class_is_a_base_not_an_optimizer_and_a_file_of_only_such_says_what_each_lacks(
    tmp_path: Path,
) -> None:
    _write(tmp_path, "a_base.py", UNFINISHED_BASE)
    only = _write(tmp_path, "b_only.py", ONLY_UNFINISHED)
    registry = _torch_registry([str(tmp_path)])
    assert "sign_momentum" in registry.names() and "momentum_base" not in registry.names()
    [error] = _errors_for(registry, only)
    assert "defines no optimizer class" in error
    assert "NoStep defines no step(), so it updates nothing; define step(self, closure=None)" in error
    assert "NoInit defines no __init__: torch.optim.Optimizer's own takes (params, defaults)" in error


def test_entry_for_class_names_what_an_unfinished_class_lacks() -> None:
    class NoStep(torch.optim.Optimizer):
        def __init__(self, params: Any, lr: float = 0.1) -> None:
            super().__init__(params, {"lr": lr})

    class NoInit(torch.optim.Optimizer):
        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            return None

    NoStep([torch.zeros(1, requires_grad=True)])  # torch wraps `step` on a class's first instance
    with pytest.raises(TypeError, match=r"NoStep defines no step\(\), so it updates nothing"):
        entry_for_class(NoStep, source="test")
    with pytest.raises(TypeError, match=r"NoInit defines no __init__: .* calls super\(\).__init__"):
        entry_for_class(NoInit, source="test")
    keras = pytest.importorskip("keras")

    class NoUpdate(keras.optimizers.Optimizer):  # type: ignore[misc]
        pass

    class ScalesLoss(keras.optimizers.LossScaleOptimizer):  # type: ignore[misc]
        pass  # `apply` of its own, no `update_step`: a wrapper is finished

    with pytest.raises(TypeError, match=r"NoUpdate defines no update_step\(\), .* learning_rate\)"):
        entry_for_class(NoUpdate, source="test")
    assert entry_for_class(ScalesLoss, source="test").style == "keras"


FROZEN_KERAS_COPY = """
from tensorflow.python.keras.optimizer_v2 import optimizer_v2


class Expectigradish(optimizer_v2.OptimizerV2):
    '''Written in 2020 on TensorFlow's internal Keras, as expectigrad's TensorFlow 2 class is.'''

    def _resource_apply_dense(self, grad, var, apply_state=None):
        return var.assign_sub(0.1 * grad)
"""


def test_a_class_on_another_keras_apis_optimizer_base_is_told_which_and_what_to_subclass(
    tmp_path: Path,
) -> None:
    """Not only "expected a subclass of ...": which base it has, and the one its methods fit."""
    tf_keras = pytest.importorskip("tf_keras")

    class OlderApi(tf_keras.optimizers.Optimizer):  # type: ignore[misc]
        """tf.keras.optimizers.Optimizer under TF_USE_LEGACY_KERAS, with TF 2.10's methods (tf_adan)."""

        def _resource_apply_dense(self, grad: Any, var: Any, apply_state: Any = None) -> Any:
            return var.assign_sub(0.1 * grad)

    class NewerApi(tf_keras.optimizers.Optimizer):  # type: ignore[misc]
        def update_step(self, gradient: Any, variable: Any) -> None:
            variable.assign_sub(0.1 * gradient)

    with pytest.raises(TypeError, match=r"OlderApi is not an optimizer: .*; it subclasses tf_keras"):
        entry_for_class(OlderApi, source="test")
    with pytest.raises(TypeError, match=r"older API: subclass tf_keras.optimizers.legacy.Optimizer"):
        entry_for_class(OlderApi, source="test")
    with pytest.raises(TypeError, match=r"does not run: subclass keras.optimizers.Optimizer \(Keras 3's"):
        entry_for_class(NewerApi, source="test")
    path = _write(tmp_path, "frozen.py", FROZEN_KERAS_COPY)
    [error] = _errors_for(load_registry(plugin_dirs=[str(tmp_path)], styles=("tf_legacy",)), path)
    assert "defines no optimizer class" in error
    assert "Expectigradish: it subclasses tensorflow.python.keras's OptimizerV2" in error
    assert "subclass tf_keras.optimizers.legacy.Optimizer" in error


def test_same_name_in_two_plugin_files_registers_neither_and_names_both_in_each(tmp_path: Path) -> None:
    """The file whose name sorted first had kept the name, and the one in use was listed as the error:
    dropping a file in changed what a name trained. Now neither runs, and each file says why."""
    first = _write(tmp_path, "b_first.py", SIGN_MOMENTUM)
    second = _write(tmp_path, "a_second.py", SIGN_MOMENTUM)
    registry = _torch_registry([str(tmp_path)])
    assert "sign_momentum" not in registry.names()
    assert sorted(error.source for error in registry.errors) == sorted([str(first), str(second)])
    for error in registry.errors:
        assert error.error.startswith(
            "optimizer name 'sign_momentum' (torch style) is claimed by 2 plugin classes: "
        )
        assert f"b_first.py:SignMomentum (line 8) in {first}" in error.error
        assert f"a_second.py:SignMomentum (line 8) in {second}" in error.error
        assert "None of them is registered under it" in error.error
        assert "rename all but one (set `optlab_name` on the class, or rename the class)" in error.error
    # A job that reads only the file it was validated against still finds its class there.
    alone = load_registry([str(tmp_path)], TORCH_ONLY, wanted=["sign_momentum"], plugin_files=[str(first)])
    assert alone.get("sign_momentum").source == f"plugin {first}" and alone.errors == []


def test_a_class_aliased_in_its_file_registers_once(tmp_path: Path) -> None:
    """`OldName = SignMomentum` names the same class twice: it had been read as two classes claiming
    one name, and neither registered."""
    path = _write(tmp_path, "aliased.py", SIGN_MOMENTUM)
    path.write_text(path.read_text() + "\n\nOldName = SignMomentum\n")
    registry = _torch_registry([str(tmp_path)])
    assert "sign_momentum" in registry.names() and registry.errors == [], registry.errors


def test_a_plugin_file_registers_each_good_class_and_lists_each_refused_one(tmp_path: Path) -> None:
    """The first refused class had ended the file's loading: its good classes before it registered,
    the ones after it and the refusal itself vanished (the catalogue then dropped the error too)."""
    path = _write(
        tmp_path,
        "mixed.py",
        """
        import torch


        class Lion(torch.optim.SGD):  # the user's own, named like the built-in
            pass


        class HalfBad(torch.optim.SGD):
            optlab_hyperparameters = {"lr": {"hi": 1.0}}


        class HalfFine(torch.optim.SGD):
            pass
        """,
    )
    registry = _torch_registry([str(tmp_path)])
    assert "half_fine" in registry.names() and "half_bad" not in registry.names()
    assert registry.get("lion").source == "builtin:optimizers.torch.lion"
    assert [error.whole_file for error in registry.errors] == [False, False]
    lion, bad = _errors_for(registry, path)
    assert lion.startswith("class mixed.py:Lion (line 5) is not registered: ValueError: optimizer name")
    assert "by builtin:optimizers.torch.lion and by plugin" in lion
    assert "a plugin cannot take a built-in's or an installed package's name, which keeps it" in lion
    assert "set another `optlab_name` on the plugin's class, or rename the class" in lion
    assert bad == (
        "class mixed.py:HalfBad (line 9) is not registered: ValueError: "
        "HalfBad.optlab_hyperparameters['lr']: unknown key 'hi'; "
        "allowed: low, high, low_inclusive, high_inclusive, choices, help"
    )


def test_plugins_are_read_only_when_a_wanted_name_is_not_built_in(tmp_path: Path) -> None:
    """A job names what it will look up: its built-in optimizer is found without importing a plugin
    file (a plugin cannot take a built-in's name anyway), a plugin's only by reading them."""
    marker = tmp_path / "imported"
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    _write(
        plugins,
        "a_sign.py",
        textwrap.dedent(SIGN_MOMENTUM) + f"\n__import__('pathlib').Path({str(marker)!r}).touch()\n",
    )
    duplicate = _write(plugins, "b_duplicate.py", DUPLICATE_OF_BUILTIN)

    builtin = load_registry([str(plugins)], TORCH_ONLY, wanted=["sgd", "adam"])
    assert not marker.exists() and builtin.errors == []
    everything = load_registry([str(plugins)], TORCH_ONLY)
    assert builtin.get("sgd").source == everything.get("sgd").source == "builtin:optimizers.torch.sgd"
    assert [error.source for error in everything.errors] == [str(duplicate)]  # refused: sgd is taken

    marker.unlink()
    plugin = load_registry([str(plugins)], TORCH_ONLY, wanted=["sgd", "sign_momentum"])
    assert marker.exists() and plugin.get("sign_momentum").source == f"plugin {plugins / 'a_sign.py'}"
    # A name nobody registers: every plugin read, and the error lists what exists.
    with pytest.raises(ValueError, match=r"unknown optimizer 'nowhere'; known: .*sign_momentum"):
        load_registry([str(plugins)], TORCH_ONLY, wanted=["nowhere"]).get("nowhere")


def test_a_job_told_where_its_plugin_is_reads_that_file_only(tmp_path: Path) -> None:
    """The worker passes where the catalogue found the job's optimizer: the other plugin files (one
    slow to import, one importing another framework) are not read, unless the file named no longer
    holds the optimizer; then every file is, as without it."""
    marker = tmp_path / "imported"
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    _write(
        plugins,
        "a_other.py",
        textwrap.dedent(NAMED) + f"\n__import__('pathlib').Path({str(marker)!r}).touch()\n",
    )
    sign = _write(plugins, "b_sign.py", SIGN_MOMENTUM)

    told = load_registry([str(plugins)], TORCH_ONLY, wanted=["sign_momentum"], plugin_files=[str(sign)])
    assert not marker.exists() and told.get("sign_momentum").source == f"{PLUGIN_SOURCE}{sign}"
    moved = load_registry(
        [str(plugins)], TORCH_ONLY, wanted=["sign_momentum"], plugin_files=[str(plugins / "gone.py")]
    )
    assert marker.exists() and moved.get("sign_momentum").source == f"{PLUGIN_SOURCE}{sign}"
    marker.unlink()
    elsewhere = load_registry(
        [str(plugins)], TORCH_ONLY, wanted=["sign_momentum"], plugin_files=[str(plugins / "a_other.py")]
    )
    assert marker.exists() and elsewhere.get("sign_momentum").source == f"{PLUGIN_SOURCE}{sign}"


def test_a_plugin_file_named_outside_the_plugin_folders_is_read(tmp_path: Path) -> None:
    """`python -m jobs.run spec.json --plugin-file my_opt.py` by hand: the file had been passed over
    without a word (it was not in OPTLAB_PLUGIN_DIRS) and the job failed as an unknown optimizer."""
    sign = _write(tmp_path, "sign.py", SIGN_MOMENTUM)
    found = load_registry([], TORCH_ONLY, wanted=["sign_momentum"], plugin_files=[str(sign)])
    assert found.get("sign_momentum").source == f"{PLUGIN_SOURCE}{sign}"
    with pytest.raises(ValueError) as unknown:
        load_registry([], TORCH_ONLY, wanted=["sign_momentum"], plugin_files=[str(tmp_path / "gone.py")]).get(
            "sign_momentum"
        )
    assert "gone.py" in str(unknown.value) and "file not found" in str(unknown.value)


def test_plugin_dirs_come_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    _write(tmp_path / "one", "sign.py", SIGN_MOMENTUM)
    _write(tmp_path / "two", "named.py", NAMED)
    monkeypatch.setenv(PLUGIN_DIRS_ENV, os.pathsep.join([str(tmp_path / "one"), str(tmp_path / "two")]))
    registry = load_registry(styles=TORCH_ONLY)
    assert registry.errors == []
    assert {"sign_momentum", "my_sgd"} <= set(registry.names())
    # An explicit list wins over the environment.
    assert "sign_momentum" not in _torch_registry([]).names()


def test_entry_points_register_modules_and_classes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, "optlab_test_ep_module.py", SIGN_MOMENTUM)
    _write(tmp_path, "optlab_test_ep_class.py", NAMED + "\n\n    class Plain:\n        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    points = [
        importlib.metadata.EntryPoint("signs", "optlab_test_ep_module", ENTRY_POINT_GROUP),
        importlib.metadata.EntryPoint("mine", "optlab_test_ep_class:Anything", ENTRY_POINT_GROUP),
        importlib.metadata.EntryPoint("gone", "optlab_test_ep_missing", ENTRY_POINT_GROUP),
        importlib.metadata.EntryPoint("plain", "optlab_test_ep_class:Plain", ENTRY_POINT_GROUP),
    ]

    def entry_points(*, group: str) -> list[importlib.metadata.EntryPoint]:
        return points if group == ENTRY_POINT_GROUP else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    try:
        registry = _torch_registry()
    finally:
        for name in ("optlab_test_ep_module", "optlab_test_ep_class", "optlab_test_ep_missing"):
            sys.modules.pop(name, None)
    assert registry.get("sign_momentum").source == "entry point signs (optlab_test_ep_module)"
    assert registry.get("my_sgd").source == "entry point mine (optlab_test_ep_class:Anything)"
    gone, plain = registry.errors
    assert gone.source == "entry point gone"
    assert "ModuleNotFoundError" in gone.error
    assert plain.source == "entry point plain"
    assert plain.error.startswith(
        "TypeError: optlab_test_ep_class.Plain is not an optimizer: expected a subclass"
    )


# --- a Keras 3 plugin ----------------------------------------------------------------------------------

KERAS_SIGN_DESCENT = '''
    """Sign descent, Keras 3 style: a plugin needs no import of optlab."""
    import keras


    class KerasSignDescent(keras.optimizers.Optimizer):
        def __init__(self, learning_rate: float = 0.01, beta: float = 0.9, **kwargs):
            super().__init__(learning_rate=learning_rate, **kwargs)
            self.beta = beta

        def update_step(self, gradient, variable, learning_rate):
            self.assign_sub(variable, learning_rate * keras.ops.sign(gradient))
'''


@pytest.fixture
def keras_plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding one Keras 3 plugin; the Keras built-ins (written elsewhere) kept out."""
    pytest.importorskip("keras")
    monkeypatch.setitem(BUILTIN_MODULES, "keras", ())
    _write(tmp_path, "keras_sign.py", KERAS_SIGN_DESCENT)
    return tmp_path


def test_a_keras_plugin_is_registered_in_the_keras_style(keras_plugin_dir: Path) -> None:
    registry = load_registry(plugin_dirs=[str(keras_plugin_dir)], styles=("torch", "keras"))
    assert registry.errors == []
    entry = registry.get("keras_sign_descent")
    assert entry is registry.entries[("keras_sign_descent", "keras")]
    assert (entry.style, entry.framework, entry.lr_arg) == ("keras", "tensorflow", "learning_rate")
    assert entry.source == f"plugin {keras_plugin_dir / 'keras_sign.py'}"
    assert style_of(entry.cls) == "keras"
    assert entry.params == {
        "lr": Param("lr", "float", 0.01, low=0.0, low_inclusive=False),
        "beta": Param("beta", "float", 0.9),
    }
    assert entry.describe()["style"] == "keras"
    assert registry.get("sgd").style == "torch"  # the torch built-ins are still there
    optimizer = entry.create({"lr": 0.5, "beta": 0.8})  # no model params in the Keras style
    assert float(optimizer.learning_rate) == 0.5
    assert optimizer.beta == 0.8
    assert float(entry.create({"lr": 0.5}, learning_rate=0.125).learning_rate) == 0.125


def test_a_keras_plugin_is_skipped_without_error_when_keras_is_not_loaded(keras_plugin_dir: Path) -> None:
    registry = _torch_registry([str(keras_plugin_dir)])
    assert registry.errors == []
    assert registry.names() == TORCH_BUILTINS


# --- derive_params --------------------------------------------------------------------------------------


class _Stepping(torch.optim.Optimizer):
    """A step for the classes below, which are about their constructors (a class with no step of
    its own is not an optimizer to register)."""

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


class _Probe(_Stepping):
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
    params, lr_arg = derive_params(_Probe, "torch")
    assert lr_arg == "lr"
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

    params, _ = derive_params(Narrow)
    assert list(params) == ["lr", "steps"]


_USE_DEFAULT = object()


def test_derive_params_leaves_an_argument_whose_default_is_a_sentinel_to_the_class() -> None:
    # heavyball's `palm: bool = use_default`: no value a job could send, and none the catalogue
    # could write as JSON.
    class Sentinels(torch.optim.Optimizer):
        def __init__(
            self,
            params: Any,
            lr: float = 0.1,
            palm: bool = _USE_DEFAULT,  # type: ignore[assignment]
            clip: float = _USE_DEFAULT,  # type: ignore[assignment]
            momentum: float = 0.9,
        ) -> None:
            super().__init__(params, {"lr": lr})

    params, _ = derive_params(Sentinels)
    assert list(params) == ["lr", "momentum"]
    json.dumps([param.to_json() for param in params.values()])


def test_derive_params_takes_torchs_required_marker_for_a_required_argument() -> None:
    from torch.optim.optimizer import required

    class OldStyle(torch.optim.Optimizer):  # torch's SGD before 2.0: `lr=required`
        def __init__(self, params: Any, lr: float = required, momentum: float = 0.0) -> None:  # type: ignore[assignment]
            super().__init__(params, {"lr": lr})

    params, _ = derive_params(OldStyle)
    assert params["lr"] == Param("lr", "float", None, low=0.0, low_inclusive=False, required=True)
    assert list(params) == ["lr", "momentum"]


def test_a_required_argument_without_annotation_is_a_required_value() -> None:
    """Left out of the catalogue, it could be neither sent (unknown hyperparameter) nor left out (the
    job's TypeError); a wrapper's base and the model are their needs', not values."""

    class Unannotated(torch.optim.SGD):
        def __init__(self, params, lr, beta, gamma: float):  # type: ignore[no-untyped-def]
            super().__init__(params, lr=lr * beta * gamma)

    class Wrapping(Unannotated):
        def __init__(self, params, optimizer, lr, beta, gamma: float):  # type: ignore[no-untyped-def]
            super().__init__(params, lr, beta, gamma)

    params, _ = derive_params(Unannotated)
    assert list(params) == ["lr", "beta", "gamma"]
    assert params["beta"] == Param("beta", "any", None, required=True)
    assert list(derive_params(Wrapping)[0]) == ["lr", "beta", "gamma"]
    weight = torch.nn.Parameter(torch.ones(2))
    entry = entry_for_class(Unannotated, source="test")
    with pytest.raises(ValueError, match="requires hyperparameter 'beta'"):
        entry.create({"lr": 0.1, "gamma": 1.0}, model_params=[weight])
    built = entry.create({"lr": 0.1, "beta": 0.5, "gamma": 2.0}, model_params=[weight])
    assert built.param_groups[0]["lr"] == 0.1


def test_derive_params_reads_a_tensor_lr_default() -> None:
    class TensorLr(torch.optim.Optimizer):
        def __init__(self, params: Any, lr: float | torch.Tensor = torch.tensor(0.25)) -> None:  # noqa: B008
            super().__init__(params, {"lr": lr})

    params, lr_arg = derive_params(TensorLr)
    assert params["lr"] == Param("lr", "float", 0.25, low=0.0, low_inclusive=False)
    assert lr_arg == "lr"


class _DictRanges(_Stepping):
    """Ranges declared as a plugin file can, with no import of optlab: plain dicts."""

    optlab_hyperparameters: ClassVar[dict[str, Any]] = {
        "beta": {"low": 0.0, "high": 1.0, "high_inclusive": False, "help": "decay"},
        "weight_decay": {"low": 0},
        "steps": {"low": 1, "high": 10},
        "mode": {"choices": ["fast", "slow"]},
    }

    def __init__(
        self,
        params: Any,
        lr: float = 0.5,
        beta: float = 0.9,
        weight_decay: float = 0,
        steps: int = 3,
        mode="fast",
    ) -> None:
        super().__init__(params, {"lr": lr})


def test_ranges_declared_as_plain_dicts_take_type_and_default_from_the_signature() -> None:
    params, _ = derive_params(_DictRanges)
    assert params == {
        "lr": Param("lr", "float", 0.5, low=0.0, low_inclusive=False),
        "beta": Param("beta", "float", 0.9, low=0.0, high=1.0, high_inclusive=False, help="decay"),
        "weight_decay": Param("weight_decay", "float", 0.0, low=0.0),
        "steps": Param("steps", "int", 3, low=1, high=10),
        "mode": Param("mode", "choice", "fast", choices=("fast", "slow")),
    }
    with pytest.raises(ValueError, match=r"^beta must be a number in \[0, 1\); received 1$"):
        check_all({"beta": 1}, params, owner="probe")


def test_a_plugin_declaring_plain_dict_ranges_loads_and_its_jobs_are_held_to_them(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "shrink.py",
        """
        import torch


        class Shrink(torch.optim.Optimizer):
            optlab_hyperparameters = {"size": {"low": 0.0, "high": 1.0}}

            def __init__(self, params, lr: float = 1e-3, size: float = 0.5):
                super().__init__(params, {"lr": lr, "size": size})

            def step(self, closure=None):
                return None
        """,
    )
    registry = _torch_registry([str(tmp_path)])
    assert registry.errors == []
    assert registry.get("shrink").params["size"] == Param("size", "float", 0.5, low=0.0, high=1.0)
    with pytest.raises(ValueError, match=r"^size must be a number in \[0, 1\]; received 2.0$"):
        registry.build("shrink", [torch.nn.Parameter(torch.zeros(1))], {"size": 2.0})


def test_the_example_plugin_declares_its_ranges_as_plain_dicts() -> None:
    registry = _torch_registry([str(ROOT / "examples" / "plugins")])
    assert registry.errors == []
    params = registry.get("sign_momentum").params
    assert {name: param.allowed() for name, param in params.items()} == {
        "lr": "a number > 0",
        "beta": "a number in [0, 1)",
        "weight_decay": "a number >= 0",
    }


@pytest.mark.parametrize(
    ("declared", "said"),
    [
        (
            {"size": {"lo": 0.0}},
            "Bad.optlab_hyperparameters['size']: unknown key 'lo'; "
            "allowed: low, high, low_inclusive, high_inclusive, choices, help",
        ),
        (
            {"size": {"default": 0.1}},
            "Bad.optlab_hyperparameters['size']: unknown key 'default' (default comes from __init__'s "
            "signature); allowed: low, high, low_inclusive, high_inclusive, choices, help",
        ),
        (
            {"size": {"low": 1.0, "high": 0.0}},
            "Bad.optlab_hyperparameters['size']: no value fits low=1.0, high=0.0; "
            "low must be below high (or equal, with both ends inclusive)",
        ),
        (
            {"size": {"low": 1.0, "high": 1.0, "high_inclusive": False}},
            "Bad.optlab_hyperparameters['size']: no value fits low=1.0, high=1.0, high_inclusive=False; "
            "low must be below high (or equal, with both ends inclusive)",
        ),
        (
            {"size": {"low": "0"}},
            "Bad.optlab_hyperparameters['size']: 'low' must be a number or None (unbounded); received '0'",
        ),
        (
            {"size": {"high_inclusive": 0}},
            "Bad.optlab_hyperparameters['size']: 'high_inclusive' must be True or False; received 0",
        ),
        (
            {"flag": {"low": 0}},
            "Bad.optlab_hyperparameters['flag']: 'low' and 'high' bound numbers; "
            "flag is bool (from __init__'s signature)",
        ),
        (
            {"size": {"choices": ["a"]}},
            "Bad.optlab_hyperparameters['size']: 'choices' lists the values of a string argument; "
            "size is float (from __init__'s signature)",
        ),
        (
            {"size": [0.0, 1.0]},
            "Bad.optlab_hyperparameters['size'] must be a dict with keys among low, high, low_inclusive, "
            "high_inclusive, choices, help (or an optimizers.hyperparams.Param); received list [0.0, 1.0]",
        ),
        (
            {"sise": {"low": 0.0}},
            "Bad.optlab_hyperparameters declares 'sise', which Bad.__init__ does not take; "
            "its arguments: lr, size, flag",
        ),
        (  # a Param object is held to the same rules
            {"size": Param("size", "float", None, low=1.0, high=0.0)},
            "Bad.optlab_hyperparameters['size']: no value fits low=1.0, high=0.0; "
            "low must be below high (or equal, with both ends inclusive)",
        ),
    ],
    ids=[
        "unknown key",
        "default",
        "low above high",
        "empty point",
        "bound not a number",
        "flag not a bool",
        "bound on a bool",
        "choices on a number",
        "not a dict",
        "misspelt name",
        "Param low above high",
    ],
)
def test_a_declaration_that_cannot_apply_is_refused_naming_class_hyperparameter_and_what_is_allowed(
    declared: dict[str, Any], said: str
) -> None:
    class Bad(_Stepping):
        optlab_hyperparameters = declared

        def __init__(self, params: Any, lr: float = 1e-3, size: float = 0.5, flag: bool = False) -> None:
            super().__init__(params, {"lr": lr})

    with pytest.raises(ValueError) as caught:
        derive_params(Bad)
    assert str(caught.value) == said


def test_a_declared_name_that_may_reach_a_base_or_is_a_parent_s_loads() -> None:
    """Only a class's own declarations are held to its own constructor, and only where it takes no
    **kwargs: a child that fixes a parent's argument, and a keyword that reaches the base through
    **kwargs, had made classes that loaded before fail to load."""

    class Parent(_Stepping):
        optlab_hyperparameters = {"beta": {"low": 0.0, "high": 1.0}}

        def __init__(self, params: Any, lr: float = 1e-3, beta: float = 0.9) -> None:
            super().__init__(params, {"lr": lr, "beta": beta})

    class FixesBeta(Parent):
        def __init__(self, params: Any, lr: float = 1e-3) -> None:
            super().__init__(params, lr, beta=0.0)

    class Forwards(_Stepping):
        optlab_hyperparameters = {"momentum": {"low": 0.0, "high": 1.0}}

        def __init__(self, params: Any, lr: float = 1e-3, **kwargs: Any) -> None:
            super().__init__(params, {"lr": lr, **kwargs})

    assert set(derive_params(FixesBeta)[0]) == {"lr"}
    assert "lr" in derive_params(Forwards)[0]


# The first argument takes the parameters whatever its name (torch's `Optimizer(params, defaults)`);
# unannotated, as KellerJordan's `SingleDeviceMuonWithAuxAdam.__init__(self, param_groups)` writes it,
# it had been catalogued as a required hyperparameter that no job could send.
class _ParamGroupsFirst(_Stepping):
    def __init__(self, param_groups):  # type: ignore[no-untyped-def]
        for group in param_groups:
            group.setdefault("lr", 0.02)  # its own defaults, per group
        super().__init__(param_groups, {})


class _ParametersFirst(_Stepping):
    def __init__(self, parameters, lr=0.1, momentum=0.9):  # type: ignore[no-untyped-def]
        super().__init__(parameters, {"lr": lr, "momentum": momentum})


class _ModelParamsFirst(_Stepping):
    def __init__(self, model_params, lr: float = 0.1, beta: float = 0.9) -> None:  # type: ignore[no-untyped-def]
        super().__init__(model_params, {"lr": lr, "beta": beta})


class _ParamsFirst(_Stepping):
    def __init__(self, params, lr: float = 0.1) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr})


@pytest.mark.parametrize(
    ("cls", "catalogued"),
    [
        (_ParamGroupsFirst, []),
        (_ParametersFirst, ["lr", "momentum"]),
        (_ModelParamsFirst, ["lr", "beta"]),
        (_ParamsFirst, ["lr"]),
    ],
)
def test_the_first_argument_takes_the_parameters_whatever_its_name(cls: type, catalogued: list[str]) -> None:
    entry = entry_for_class(cls, source="test")
    assert list(entry.params) == catalogued
    weight, bias = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    built = entry.create({}, model_params=[{"params": [weight]}, {"params": [bias], "lr": 0.5}])
    assert [group["params"] for group in built.param_groups] == [[weight], [bias]]
    assert built.param_groups[1]["lr"] == 0.5


# AGI-Arena's MARS_M and Moonlight take the learning rate first and their parameters by keyword.
HYPERPARAMETER_FIRST = """
    import torch


    class MarsLike(torch.optim.Optimizer):
        def __init__(self, lr=1e-3, wd=0.1, muon_params=None, adamw_params=None):
            super().__init__([*muon_params, *(adamw_params or [])], dict(lr=lr, wd=wd))

        def step(self, closure=None):
            return None


    class MarsOverParams(MarsLike):  # the subclass the refusal asks for
        def __init__(self, params, lr=1e-3, wd=0.1):
            params = list(params)
            super().__init__(
                lr=lr, wd=wd, muon_params=[p for p in params if p.ndim == 2],
                adamw_params=[p for p in params if p.ndim != 2],
            )
"""


def test_a_class_taking_a_hyperparameter_first_is_refused_saying_how_to_take_the_parameters(
    tmp_path: Path,
) -> None:
    """Built as every torch optimizer is, `cls(params, lr=...)`, it had raised "got multiple values for
    argument 'lr'", and `optlab check` had skipped every check and exited 0. Which keyword takes which
    parameters is the class's convention, so a subclass over `params` says it."""
    path = _write(tmp_path, "mars_like.py", HYPERPARAMETER_FIRST)
    registry = _torch_registry([str(tmp_path)])
    assert "mars_over_params" in registry.names() and "mars_like" not in registry.names()
    adapter = registry.get("mars_over_params")
    assert list(adapter.params) == ["lr", "wd"]
    weight, bias = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    assert adapter.create({"lr": 0.01}, model_params=[weight, bias]).param_groups[0]["params"] == [
        weight,
        bias,
    ]
    with pytest.raises(TypeError) as caught:
        entry_for_class(adapter.cls.__mro__[1], source="test")  # MarsLike
    assert str(caught.value) == (
        "MarsLike takes lr=0.001 first, where a torch optimizer takes its parameters, and its parameters "
        "by keyword (muon_params, adamw_params): optlab builds every torch optimizer as "
        "cls(params, **hyperparameters), the parameters first as in torch.optim.Optimizer(params, "
        "defaults), so they would land in 'lr'; define a subclass whose __init__(self, params, lr=0.001, "
        "...) hands them on as the class expects (super().__init__(lr=lr, muon_params=..., "
        "adamw_params=..., ...)), and check or register that"
    )
    path.write_text(textwrap.dedent(HYPERPARAMETER_FIRST.split("    class MarsOverParams")[0]))
    [error] = _errors_for(_torch_registry([str(tmp_path)]), path)
    assert "defines no optimizer class" in error and "MarsLike takes lr=0.001 first" in error


def test_a_keras_class_keeps_a_required_first_argument_as_a_hyperparameter() -> None:
    """Keras builds optimizers without parameters: its first argument is the class's own."""

    class KerasRequiredRate:
        def __init__(self, learning_rate: float, beta: float = 0.9) -> None:
            pass

    params, _ = derive_params(KerasRequiredRate, "keras")
    assert params["lr"].required and list(params) == ["lr", "beta"]


# pytorch-optimizer's AdEMAMix (`t_alpha_beta3: float | None = None`) and Ranger21
# (`num_warm_up_iterations: int | None = None`) spell optional numbers so, torch's LBFGS its
# `line_search_fn: str | None = None`, pytorch-optimizer's SOAP its `data_format: Literal[...]`, Adan its
# three `betas`, Ranger21 its unannotated `num_epochs=None`; a file
# without `from __future__ import annotations` gives the annotations as objects, one with it as
# strings (evaluated one by one: `ParamsT`, imported for type checkers only, stays a string).
OPTIONAL_NUMBERS = """
from typing import TYPE_CHECKING, Literal, Optional, Union

import torch

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT


class OptionalNumbers(torch.optim.Optimizer):
    def __init__(
        self,
        params: "ParamsT",
        lr: float = 0.1,
        beta3: float | None = None,
        warm_up: Optional[int] = None,
        decoupled: Union[bool, None] = None,
        floor: "None | float" = None,
        clip: Optional[float] = 1.0,
        scale: float | torch.Tensor | None = None,
        name: Optional[str] = None,
        line_search_fn: str | None = None,
        data_format: Literal["channels_first", "channels_last"] = "channels_first",
        memory_save_mode: Optional[Literal["one_diag", "all_diag"]] = None,
        reduction="mean",
        dtype: torch.dtype = torch.float32,
        odd_default: Literal["a", "b"] = "c",
        betas: tuple[float, float] | tuple[float, float, float] = (0.9, 0.999, 0.9999),
        num_epochs=None,
        gammas=[0.9, 0.99],  # noqa: B006
        milestones=[10, 20],  # noqa: B006
        empty=[],  # noqa: B006
    ):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        return None
"""


@pytest.mark.parametrize("postponed", [False, True], ids=["objects", "strings"])
def test_derive_params_catalogues_optional_numbers_options_and_tuples(postponed: bool) -> None:
    source = ("from __future__ import annotations\n" if postponed else "") + OPTIONAL_NUMBERS
    namespace: dict[str, Any] = {}
    exec(compile(source, "optional_numbers.py", "exec", dont_inherit=True), namespace)
    params, _ = derive_params(namespace["OptionalNumbers"])
    layouts = ("channels_first", "channels_last")
    assert params == {
        "lr": Param("lr", "float", 0.1, low=0.0, low_inclusive=False),
        "beta3": Param("beta3", "float", None, nullable=True),
        "warm_up": Param("warm_up", "int", None, nullable=True),
        "decoupled": Param("decoupled", "bool", None, nullable=True),
        "floor": Param("floor", "float", None, nullable=True),
        "clip": Param("clip", "float", 1.0, nullable=True),
        "scale": Param(
            "scale", "number", None, nullable=True
        ),  # float | Tensor: a number (JSON has no tensor)
        "line_search_fn": Param("line_search_fn", "str", None, nullable=True),
        "data_format": Param("data_format", "choice", "channels_first", choices=layouts),
        "memory_save_mode": Param(
            "memory_save_mode", "choice", None, nullable=True, choices=("one_diag", "all_diag")
        ),
        "reduction": Param("reduction", "str", "mean"),
        "betas": Param("betas", "float_tuple", (0.9, 0.999, 0.9999)),
        "num_epochs": Param("num_epochs", "any", None, nullable=True),
        "gammas": Param("gammas", "float_list", [0.9, 0.99]),  # a list default: a list
        "milestones": Param("milestones", "int_list", [10, 20]),
    }  # another union of two types besides None, a dtype, a default its Literal does not list, [] stay out
    entry = entry_for_class(namespace["OptionalNumbers"], source="test")
    # Left out, the class's own None; given, a number of the type; anything else refused by name.
    assert entry.kwargs({})["beta3"] is None and entry.kwargs({"beta3": None})["beta3"] is None
    assert entry.kwargs({"beta3": 0.5, "warm_up": 3, "decoupled": True, "clip": None}) == {
        "lr": 0.1, "beta3": 0.5, "warm_up": 3, "decoupled": True, "floor": None, "clip": None, "scale": None,
        "line_search_fn": None, "data_format": "channels_first", "memory_save_mode": None,
        "reduction": "mean", "betas": (0.9, 0.999, 0.9999), "num_epochs": None, "gammas": [0.9, 0.99],
        "milestones": [10, 20],
    }  # fmt: skip
    given = entry.kwargs(
        {"line_search_fn": "strong_wolfe", "data_format": "channels_last", "betas": [0.8, 0.9, 1]}
    )
    assert (given["line_search_fn"], given["data_format"]) == ("strong_wolfe", "channels_last")
    assert given["betas"] == (0.8, 0.9, 1.0)  # a tuple, as the class's default is
    with pytest.raises(ValueError, match=r"betas must be a list of 1 to 64 numbers; received \[\]"):
        entry.kwargs({"betas": []})
    # An unannotated None (Ranger21's `num_epochs`): any scalar, or a list of them, kept as given, for
    # the class to judge.
    for value in (3, 0.5, True, "auto", None, [3, "auto"]):
        assert entry.kwargs({"num_epochs": value})["num_epochs"] == value
    for refused in ([[3]], {"n": 3}, float("nan"), "tab\there"):
        with pytest.raises(ValueError, match=r"num_epochs must be true or false, a number or a string"):
            entry.kwargs({"num_epochs": refused})
    with pytest.raises(ValueError, match=r"warm_up must be an integer, or null; received 2.5"):
        entry.kwargs({"warm_up": 2.5})
    with pytest.raises(ValueError, match=r'beta3 must be a number, or null; received "high"'):
        entry.kwargs({"beta3": "high"})
    with pytest.raises(
        ValueError, match=r'data_format must be "channels_first" or "channels_last"; received "nchw"'
    ):
        entry.kwargs({"data_format": "nchw"})
    with pytest.raises(ValueError, match=r"data_format must be .*; received null"):
        entry.kwargs({"data_format": None})
    for refused in ("x" * 201, "tab\there", "\u202eevil", 3):
        with pytest.raises(ValueError, match=r"reduction must be a string of at most 200 printable ASCII"):
            entry.kwargs({"reduction": refused})


ENUM_OPTIONS = """
import enum
from typing import Optional

import torch


class Decay(enum.Enum):
    L2 = 1
    DECOUPLED = 2


class Kinds(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 0.1,
        decay: Decay = Decay.DECOUPLED,
        maybe: Optional[Decay] = None,
        legacy=Decay.L2,
    ):
        super().__init__(params, {"lr": lr, "decay": decay, "maybe": maybe, "legacy": legacy})

    def step(self, closure=None):
        return None
"""


@pytest.mark.parametrize("postponed", [False, True], ids=["objects", "strings"])
def test_an_enum_argument_is_a_choice_of_its_members_names_built_with_the_member(postponed: bool) -> None:
    # Distributed Shampoo's `weight_decay_type: WeightDecayType = WeightDecayType.DECOUPLED` had been
    # left out of the catalogue: no job could choose its weight decay.
    source = ("from __future__ import annotations\n" if postponed else "") + ENUM_OPTIONS
    namespace: dict[str, Any] = {"__name__": "enum_options"}
    exec(compile(source, "enum_options.py", "exec", dont_inherit=True), namespace)
    decay = namespace["Decay"]
    params, _ = derive_params(namespace["Kinds"])
    names = ("L2", "DECOUPLED")
    assert params == {
        "lr": Param("lr", "float", 0.1, low=0.0, low_inclusive=False),
        "decay": Param("decay", "choice", "DECOUPLED", choices=names),
        "maybe": Param("maybe", "choice", None, nullable=True, choices=names),
        "legacy": Param("legacy", "choice", "L2", choices=names),
    }
    assert json.loads(json.dumps(params["decay"].to_json()))["allowed"] == '"L2" or "DECOUPLED"'
    entry = entry_for_class(namespace["Kinds"], source="test")
    built = entry.create({"decay": "L2", "maybe": "DECOUPLED"}, model_params=[torch.zeros(2)])
    group = built.param_groups[0]
    assert (group["decay"], group["maybe"], group["legacy"]) == (decay.L2, decay.DECOUPLED, decay.L2)
    assert entry.kwargs({})["decay"] is decay.DECOUPLED and entry.kwargs({})["maybe"] is None
    assert entry.kwargs({"decay": "L2"}, partial=True) == {"decay": decay.L2}  # a param group's own
    with pytest.raises(ValueError, match=r'decay must be "L2" or "DECOUPLED"; received "SIDEWAYS"'):
        entry.kwargs({"decay": "SIDEWAYS"})
    with pytest.raises(ValueError, match=r'decay must be "L2" or "DECOUPLED"; received 2'):
        entry.kwargs({"decay": 2})  # the member's value is not its name


# derive_params reads signatures only: plain classes stand in for Keras ones without importing Keras.
class _KerasLike:
    def __init__(
        self,
        learning_rate: float = 0.01,
        beta: float = 0.9,
        name: str = "x",
        clipnorm: Any = None,
        **kwargs: Any,
    ) -> None:
        pass


class _KerasLikeWithoutLr:
    """A Keras optimizer that takes the learning rate through **kwargs, as Keras allows."""

    def __init__(self, beta: float = 0.9, **kwargs: Any) -> None:
        pass


@pytest.mark.parametrize("style", ["keras", "tf_legacy"])
def test_derive_params_catalogues_learning_rate_as_lr(style: str) -> None:
    params, lr_arg = derive_params(_KerasLike, style)
    assert lr_arg == "learning_rate"
    assert params == {
        "lr": Param("lr", "float", 0.01, low=0.0, low_inclusive=False),
        "beta": Param("beta", "float", 0.9),
    }


@pytest.mark.parametrize("style", ["keras", "tf_legacy"])
def test_derive_params_gives_a_keras_class_without_lr_keras_default(style: str) -> None:
    """Where the source does not say where its **kwargs go (here: nowhere it can follow), a rate is
    assumed; test_forwarded_arguments has the classes whose source says they take none."""
    params, lr_arg = derive_params(_KerasLikeWithoutLr, style)
    assert lr_arg == "learning_rate"
    assert list(params) == ["lr", "beta"]
    assert params["lr"] == Param("lr", "float", 1e-3, low=0.0, low_inclusive=False)


def test_derive_params_keeps_a_torch_class_learning_rate_name() -> None:
    class Renamed(_Stepping):
        def __init__(self, params: Any, learning_rate: float = 0.1) -> None:
            super().__init__(params, {"lr": learning_rate})

    params, lr_arg = derive_params(Renamed, "torch")
    assert (list(params), lr_arg) == (["lr"], "learning_rate")
    assert entry_for_class(Renamed, source="test").lr_arg == "learning_rate"


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
    with pytest.raises(
        TypeError, match=r"^builtins\.dict is not an optimizer: expected a subclass of torch\.optim"
    ):
        entry_for_class(dict, source="test")


# --- Registry.build -------------------------------------------------------------------------------------


def test_build_passes_hyperparameters_and_fills_defaults() -> None:
    registry = _torch_registry()
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


def test_create_takes_model_params_and_a_learning_rate_that_replaces_lr() -> None:
    entry = _torch_registry().get("lion")
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = entry.create({"lr": 0.5, "beta_2": 0.9}, model_params=[param], learning_rate=0.25)
    assert isinstance(optimizer, entry.cls)
    assert optimizer.param_groups[0]["params"] == [param]
    group = optimizer.param_groups[0]
    assert (group["lr"], group["beta_1"], group["beta_2"]) == (0.25, 0.9, 0.9)
    # `lr` is still validated, even when `learning_rate` replaces it.
    with pytest.raises(ValueError, match=r"^lr must be a number > 0; received 0$"):
        entry.create({"lr": 0}, model_params=[param], learning_rate=0.25)


def test_build_names_the_style() -> None:
    registry = _torch_registry()
    params = [torch.nn.Parameter(torch.zeros(1))]
    assert isinstance(registry.build("sgd", params, {}, style="torch"), torch.optim.SGD)
    with pytest.raises(ValueError, match=r"^optimizer 'sgd' has no keras style; it exists in: torch$"):
        registry.build("sgd", params, {}, style="keras")


def test_build_rejects_unknown_hyperparameter_listing_accepted() -> None:
    registry = _torch_registry()
    with pytest.raises(ValueError) as caught:
        registry.build("sgd", [torch.nn.Parameter(torch.zeros(1))], {"lr": 0.1, "foreach": True})
    assert str(caught.value) == (
        "optimizer 'sgd' (torch) has no hyperparameter 'foreach'; "
        "accepted: lr, momentum, dampening, weight_decay, nesterov (foreach is one of the framework's own "
        "switches, which a job leaves at the class's default: it is no hyperparameter unless the class "
        "declares it in optlab_hyperparameters)"
    )


def test_build_rejects_invalid_value_naming_it() -> None:
    registry = _torch_registry()
    with pytest.raises(ValueError, match=r"^momentum must be a number in \[0, 1\); received 1.0$"):
        registry.build("sgd", [torch.nn.Parameter(torch.zeros(1))], {"momentum": 1.0})


def test_a_number_or_tensor_argument_is_a_number_and_a_tuple_of_floats_stays_a_pair() -> None:
    """AliG's `max_lr: float | Tensor | None = None` had been left out of the catalogue, so no job
    could set it; torch's `betas: tuple[float, float]` names float too, and stays a pair."""
    import pytorch_optimizer

    max_lr = entry_for_class(pytorch_optimizer.AliG, source="test").params["max_lr"]
    assert (max_lr.type, max_lr.default, max_lr.nullable) == ("number", None, True)
    assert entry_for_class(torch.optim.Adamax, source="test").params["betas"].type == "float_pair"


@pytest.mark.parametrize(
    ("first_line", "summary"),
    [
        ("Lion (https://arxiv.org/abs/2302.06675)", "Lion"),
        ("Lion <https://arxiv.org/abs/2302.06675>.", "Lion"),
        ("Lion: https://arxiv.org/abs/2302.06675", "Lion: https://arxiv.org/abs/2302.06675"),
        ("See https://arxiv.org/abs/2302.06675 for Lion.", "See https://arxiv.org/abs/2302.06675 for Lion."),
    ],
    ids=["in brackets", "in angle brackets", "read on after a colon", "inside the sentence"],
)
def test_the_summary_leaves_out_the_bracketed_reference_url_that_ends_its_line(
    first_line: str, summary: str
) -> None:
    """The catalogue had shown the URL twice: in the summary and as the reference."""

    class Documented(_Stepping):
        def __init__(self, params: Any, lr: float = 1e-3) -> None:
            super().__init__(params, {"lr": lr})

    Documented.__doc__ = f"{first_line}\n\nMore words."
    entry = entry_for_class(Documented, source="test")
    assert (entry.summary, entry.reference) == (summary, "https://arxiv.org/abs/2302.06675")


def test_a_number_typed_as_tensorflow_addons_types_it_is_a_number() -> None:
    """`weight_decay: Union[FloatTensorLike, Callable]` (a tensor, a float or numpy float, or a
    schedule), required in tensorflow-addons' AdamW: it had been left out of the catalogue, so the
    class could be neither built nor given the value."""
    import collections.abc

    import numpy as np

    class DecoupledSGD(_Stepping):
        def __init__(self, params: Any, weight_decay: Any, lr: float = 1e-3) -> None:
            super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    float_tensor_like = torch.Tensor | float | np.float16 | np.float32 | np.float64
    DecoupledSGD.__init__.__annotations__["weight_decay"] = float_tensor_like | collections.abc.Callable
    params, _ = derive_params(DecoupledSGD)
    assert params["weight_decay"].type == "number" and params["weight_decay"].required
