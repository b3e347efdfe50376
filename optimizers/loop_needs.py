"""What an optimizer needs from the training loop beyond `loss.backward()` then `step()`.

Real optimizers break that assumption in a few known ways: sharpness-aware ones (SAM)
re-evaluate the loss through `step(closure)`; Hessian-based ones (AdaHessian, Sophia-H)
need the backward pass to keep its graph for Hessian-vector products; schedule-free ones
must be switched with `optimizer.train()` / `optimizer.eval()` around evaluation and
saving; wrappers (Lookahead, SAM) take a base optimizer; a few (torchmin's Minimizer, SLS)
run backward themselves on the loss their closure returns; K-FAC-style ones (SINGD) are built
over the model, not its parameters. Declared once here, in the
catalogue entry, and read by both the trainer and the checks, so neither blames the
optimizer for what the loop assumed.

Pure Python: the API reads these from the published catalogue.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

# A class states what detection cannot see (or corrects it) with, e.g.,
# `optlab_needs = {"create_graph": True}`.
NEEDS_ATTRIBUTE = "optlab_needs"
# Constructor arguments that take the optimizer a wrapper wraps (`inner_optimizer`: Keras's
# LossScaleOptimizer, whose required optimizer object no hyperparameter can give).
BASE_ARGUMENTS = ("base_optimizer", "optimizer", "base", "inner_optimizer")
# A first constructor argument that asks for the model (K-FAC-style optimizers such as SINGD hook its
# layers; LOMO fuses its update into backward) or its named parameters (adam-mini), not parameters.
NAMED_PARAMETERS_ARGUMENTS = ("named_parameters", "named_params")
MODEL_ARGUMENTS = ("model", "module", *NAMED_PARAMETERS_ARGUMENTS)
# Needs that name a constructor argument; the rest are true or false.
_ARGUMENT_NEEDS = ("base_optimizer", "model_argument")
# An annotation naming an optimizer (the class, or an instance of it), whatever the argument's name.
OPTIMIZER_ANNOTATION = re.compile(r"\bOptimizer\b")
# The same asking for the class, not a built one: `Type[Optimizer]`, `type[torch.optim.Optimizer]`.
CLASS_ANNOTATION = re.compile(r"\b[Tt]ype\[[\w.]*\bOptimizer\]")
# A step() that refuses to run without its closure, which is then optional in the signature only:
# `if closure is None: raise ...` (pytorch-optimizer), `assert closure is not None, ...` (the SAM
# most copied, davda54's), `if not closure: raise ...`.
_CLOSURE_REFUSED = re.compile(
    r"if\s+(?:closure\s+is\s+None|not\s+closure)\s*:\s*\n?\s*raise\b|assert\s+closure\s+is\s+not\s+None\b"
)
# A step that differentiates its gradients (a Hessian-vector product: AdaHessian's
# `torch.autograd.grad(grads, params, grad_outputs=z)`), which needs backward(create_graph=True);
# `torch.autograd.grad(loss, ...)` of a closure's loss does not.
_DIFFERENTIATES_GRADIENTS = re.compile(r"autograd\.grad\(\s*\[?\s*[\w.]*grad")
# A name bound to what a closure returns (`loss = closure()`, `f = self._closure()`, SLS's
# `loss = closure_deterministic()`, a wrapper of it), whose differentiation by the class itself shows
# in the same function (`_DIFFERENTIATES_CLOSURE_LOSS`).
_CLOSURE_LOSS = re.compile(r"\b(\w+)\s*=\s*(?:\w+\.)*\w*closure\w*\(\s*\)")
_DIFFERENTIATES_CLOSURE_LOSS = r"\b{name}\s*\.\s*backward\(|autograd\.grad\(\s*[\[(]?\s*{name}\b"
_CLOSURE_CALL_DIFFERENTIATED = re.compile(r"\w*closure\w*\(\s*\)\s*\.\s*backward\(")
# The top-level packages of the frameworks' own classes, whose source says nothing of the user's.
FRAMEWORK_PACKAGES = ("torch", "keras", "tf_keras", "tensorflow", "builtins")
# How many calls deep the scans of what a step runs follow the class's own methods from step():
# AdaHessian's `step -> get_trace` is one; the bound keeps a package's web of helpers out.
_HELPER_DEPTH = 3


def user_classes(cls: type) -> list[type]:
    """The classes of `cls`'s MRO outside the frameworks: the user's code, or their package's."""
    return [k for k in cls.__mro__ if (k.__module__ or "").split(".")[0] not in FRAMEWORK_PACKAGES]


@dataclass(frozen=True)
class LoopNeeds:
    """What the loop must do for this optimizer; all False/None is the plain case."""

    closure: bool = False  # step(closure) is required; the closure recomputes loss and gradients
    create_graph: bool = False  # backward(create_graph=True), for Hessian-vector products
    train_eval: bool = False  # optimizer.train() before training steps, .eval() before evaluating/saving
    base_optimizer: str | None = None  # the constructor argument that takes the wrapped optimizer
    # step(closure) runs backward itself on the loss the closure returns (torchmin's Minimizer): the
    # loop's closure returns the loss with its graph and calls no backward. Implies `closure`.
    backward_in_step: bool = False
    # The constructor's first argument takes the model or its named parameters (`MODEL_ARGUMENTS`):
    # the loop builds the optimizer over its model, as `SINGD(model, lr=...)` asks.
    model_argument: str | None = None

    def __post_init__(self) -> None:
        if self.backward_in_step and not self.closure:  # stated alone, in a spec or on the class
            object.__setattr__(self, "closure", True)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def with_overrides(self, overrides: Mapping[str, Any], *, owner: str) -> LoopNeeds:
        """These needs with `overrides` applied; ValueError names an unknown or mistyped key."""
        known = {f.name: f for f in fields(self)}
        for key, value in overrides.items():
            if key not in known:
                raise ValueError(f"{owner}: unknown need {key!r}; known: {', '.join(known)}")
            expected = str if key in _ARGUMENT_NEEDS else bool
            if not (isinstance(value, expected) or (key in _ARGUMENT_NEEDS and value is None)):
                raise ValueError(f"{owner}: need {key!r} must be {expected.__name__}; received {value!r}")
        return replace(self, **dict(overrides))

    def with_base(self, base: LoopNeeds | None) -> LoopNeeds:
        """What the loop must do for this wrapper over a base with `base` needs: the union.

        The loop steps the wrapper, whose step runs the base's: Lookahead over AdaHessian needs the
        loop's backward to keep its graph, and over a base that needs a closure it hands the closure
        on (`self.optimizer.step(closure)`); a base's train/eval modes are switched through the
        wrapper (or on the base, when the wrapper has none). The wrapped argument is the wrapper's.
        """
        if base is None:
            return self
        return replace(
            self,
            closure=self.closure or base.closure,
            create_graph=self.create_graph or base.create_graph,
            train_eval=self.train_eval or base.train_eval,
            backward_in_step=self.backward_in_step or base.backward_in_step,
        )


# The plain case: `backward()` then `step()`.
PLAIN = LoopNeeds()


def detect_loop_needs(cls: type) -> LoopNeeds:
    """What can be read from the class itself, then what it declares in `optlab_needs`."""
    detected = LoopNeeds(
        closure=_closure_required(cls),
        create_graph=_asks_for_create_graph(cls),
        train_eval=_has_train_eval(cls),
        base_optimizer=_base_argument(cls),
        backward_in_step=_runs_backward_on_the_closure_loss(cls),
        model_argument=_model_argument(cls),
    )
    declared = getattr(cls, NEEDS_ATTRIBUTE, None) or {}
    return detected.with_overrides(declared, owner=f"{cls.__qualname__}.{NEEDS_ATTRIBUTE}")


def first_argument(cls: type) -> str | None:
    """The name of the constructor's first argument; None where it takes none or its signature
    cannot be read. What it names says what the class is built over: parameters, a built base
    optimizer, a model."""
    try:
        return next(iter(inspect.signature(cls).parameters), None)
    except (TypeError, ValueError):
        return None


def _model_argument(cls: type) -> str | None:
    first = first_argument(cls)
    return first if first in MODEL_ARGUMENTS else None


def _closure_required(cls: type) -> bool:
    step = inspect.unwrap(getattr(cls, "step", None))  # type: ignore[arg-type]
    if step is None:
        return False
    try:
        closure = inspect.signature(step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    if closure is None:
        return False
    if closure.default is inspect.Parameter.empty:
        return True
    return any(_CLOSURE_REFUSED.search(code) for code in _code_step_runs(cls))


def _asks_for_create_graph(cls: type) -> bool:
    """The class's docstring, or a base class's, tells its users to call backward(create_graph=True),
    or the class raises timm's `is_second_order` flag, from which timm's training loop does so.

    Bases too: a plugin's thin subclass (`class AdaHessian(pytorch_optimizer.AdaHessian)`) has no
    docstring of its own, and Python does not inherit `__doc__`.
    """
    return (
        _second_order_flag(cls)
        or any("create_graph=True" in (klass.__doc__ or "") for klass in cls.__mro__)
        or _differentiates_its_gradients(cls)
    )


def _differentiates_its_gradients(cls: type) -> bool:
    """The class's step(), or a method of the class it calls, takes the gradient of the gradients
    (`_DIFFERENTIATES_GRADIENTS`): published Hessian-based classes whose docstring says nothing of
    create_graph (torchium's AdaHessian in step(), the official one in its `get_trace()` helper).
    Only what step() calls: a package's base class may carry such a helper for the few of its
    classes that call it (pytorch-optimizer's Hutchinson estimate).

    Not a helper handed the closure that runs it under a graph arrangement of its own and
    differentiates what that call made (heavyball's `_double_backward_hvp(closure)` calls it under
    `patch_backward()`, which forces create_graph on that backward, and runs only when built for
    Hessian-vector products): the loop's backward needs no graph for it. A helper that calls its
    closure plainly (or under `torch.enable_grad()` alone) differentiates gradients the loop's
    closure made, which must keep their graph."""
    return any(
        _DIFFERENTIATES_GRADIENTS.search(code)
        and (function.__name__ == "step" or not _graphs_its_own_closure_call(function, code))
        for function in _step_and_its_helpers(cls)
        if (code := _code(function)) is not None
    )


# Context managers that switch grad recording or precision, and so arrange no graph of their own.
_GRAD_SWITCHES = frozenset({"enable_grad", "no_grad", "set_grad_enabled", "inference_mode", "autocast"})


def _graphs_its_own_closure_call(function: Callable[..., Any], code: str) -> bool:
    """`function` takes a closure as an argument (a name with "closure" in it) and calls it where it
    arranges the backward's graph itself: `create_graph=True` in its own code, or the call inside a
    `with` other than a grad switch (heavyball's `with torch.enable_grad(), patch_backward():`)."""
    try:
        names = [name for name in inspect.signature(function).parameters if "closure" in name]
    except (TypeError, ValueError):
        return False
    if not names or not any(re.search(rf"\b{re.escape(name)}\s*\(", code) for name in names):
        return False
    if re.search(r"create_graph\s*=\s*True", code):
        return True
    tree = _parsed(function)
    if tree is None:
        return False
    for node in ast.walk(tree):
        if not isinstance(node, ast.With | ast.AsyncWith):
            continue
        arranged = any(_called_name(item.context_expr) not in _GRAD_SWITCHES for item in node.items)
        calls = (
            call
            for statement in node.body
            for call in ast.walk(statement)
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in names
        )
        if arranged and any(True for _ in calls):
            return True
    return False


def _called_name(expression: ast.expr) -> str:
    """The name a `with` item calls (`patch_backward` of `patch_backward()`, `enable_grad` of
    `torch.enable_grad()`), '' for anything else."""
    if not isinstance(expression, ast.Call):
        return ""
    func = expression.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _runs_backward_on_the_closure_loss(cls: type) -> bool:
    """A function of the class (or of a base outside the frameworks) binds what a closure returns and
    differentiates it (`f = self._closure(); f.backward()`, torchmin's Minimizer), or calls
    `closure().backward()`: under torch's convention the closure has run backward already, and its
    loss has no graph left to differentiate.

    Every function, not only those step() calls: torchmin's Minimizer hands itself to its
    `minimize()`, which calls the method that runs backward."""
    for klass in user_classes(cls):
        for member in vars(klass).values():
            function = _function_of(member)
            code = _code(function) if function is not None else None
            if code is None:
                continue
            if _CLOSURE_CALL_DIFFERENTIATED.search(code) or any(
                re.search(_DIFFERENTIATES_CLOSURE_LOSS.format(name=re.escape(name)), code)
                for name in set(_CLOSURE_LOSS.findall(code))
            ):
                return True
    return False


def _function_of(member: Any) -> Callable[..., Any] | None:
    """The plain function a class attribute runs (a static or class method's, a decorated one's
    original), else None."""
    function = inspect.unwrap(member.__func__ if isinstance(member, staticmethod | classmethod) else member)
    return function if inspect.isfunction(function) else None


def _user_method(cls: type, name: str) -> Callable[..., Any] | None:
    """The function `cls.<name>` runs, where the user's code (or their package's) defines it; None
    for the frameworks' own (`torch.optim.Optimizer`'s), whose source says nothing of the user's."""
    function = _function_of(inspect.getattr_static(cls, name, None))
    if function is None or (function.__module__ or "").split(".")[0] in FRAMEWORK_PACKAGES:
        return None
    return function


def _code_step_runs(cls: type) -> list[str]:
    """The code of the class's step() and of the class's methods it calls (`_step_and_its_helpers`),
    as the scans read it."""
    return [code for code in map(_code, _step_and_its_helpers(cls)) if code is not None]


def _step_and_its_helpers(cls: type) -> list[Callable[..., Any]]:
    """The class's step() and the methods of the class it calls (`self.name(...)`, or a base's through
    `super().name(...)`), theirs in turn to `_HELPER_DEPTH` calls deep, each once: what a step runs,
    which step() may leave to a helper (the official AdaHessian's `get_trace()`) or to the step of
    the user's own base class (`super().step(closure)` after a tweak). A method that step() never
    calls is not its step's."""
    step = _user_method(cls, "step")
    found = [] if step is None else [step]
    level = list(found)
    for _ in range(_HELPER_DEPTH):
        called = (
            _called_method(cls, function, call) for function in level for call in _methods_called(function)
        )
        level = [helper for helper in dict.fromkeys(called) if helper is not None and helper not in found]
        found += level
    return found


def _called_method(cls: type, caller: Callable[..., Any], call: _MethodCall) -> Callable[..., Any] | None:
    """The user's function a call in `caller` runs on an instance of `cls`: `self.name` as `cls`
    resolves it; `super().name` as the classes after the one that defines `caller` do (`super(Base,
    self).name` after `Base`)."""
    if call.through is None:
        return _user_method(cls, call.name)
    mro = cls.__mro__
    after = next(
        (
            index
            for index, klass in enumerate(mro)
            if (klass.__name__ == call.through if call.through else _defines(klass, caller))
        ),
        None,
    )
    if after is None:
        return None
    for klass in mro[after + 1 :]:
        if call.name in vars(klass):
            return _user_method(klass, call.name)
    return None


def _defines(klass: type, function: Callable[..., Any]) -> bool:
    return any(_function_of(member) is function for member in vars(klass).values())


def _parsed(function: Callable[..., Any]) -> ast.Module | None:
    """A fresh syntax tree of `function`'s source (the caller may change it); None where there is
    none here (compiled, or made in a REPL). A method's source is indented: an `if` takes it as is,
    where dedenting would fail on a docstring whose lines start further left than its `def`."""
    try:
        source = inspect.getsource(function)
        return ast.parse(f"if True:\n{source}" if source[:1].isspace() else source)
    except (OSError, TypeError, SyntaxError):
        return None


@functools.cache  # a function is read by several scans, and by every class that inherits it
def _code(function: Callable[..., Any]) -> str | None:
    """`function`'s code as the scans read it (`_without_strings`); None where it has no source."""
    tree = _parsed(function)
    return None if tree is None else _without_strings(tree)


def _without_strings(tree: ast.Module) -> str:
    """The code again without its comments (a syntax tree has none) and with every string literal
    empty: the usage example in MARS's step() docstring (`loss.backward()` after `loss = closure()`
    in its code) is no code of the class, nor is a line commented out."""
    return ast.unparse(_EmptyStrings().visit(tree))


class _EmptyStrings(ast.NodeTransformer):
    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        return ast.Constant(type(node.value)()) if isinstance(node.value, str | bytes) else node

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.Constant:  # an f-string
        return ast.Constant("")


@dataclass(frozen=True)
class _MethodCall:
    """A call of a method on the instance: `self.name(...)` (`through` None), `super().name(...)`
    (`through` ""), `super(Base, self).name(...)` (`through` "Base")."""

    name: str
    through: str | None = None


@functools.cache
def _methods_called(function: Callable[..., Any]) -> list[_MethodCall]:
    """The methods `function` calls on its first argument (`self.get_trace(...)`), itself or through
    `super()`."""
    tree = _parsed(function)
    definition = (
        next((node for node in ast.walk(tree) if isinstance(node, _DEFINITIONS)), None) if tree else None
    )
    if definition is None or not (arguments := [*definition.args.posonlyargs, *definition.args.args]):
        return []
    this = arguments[0].arg
    calls = (node.func for node in ast.walk(definition) if isinstance(node, ast.Call))
    return [
        call
        for method in calls
        if isinstance(method, ast.Attribute) and (call := _method_call(method, this)) is not None
    ]


def _method_call(method: ast.Attribute, this: str) -> _MethodCall | None:
    """What `<receiver>.name` calls, where the receiver is the instance (`this`) or `super(...)`."""
    receiver = method.value
    if isinstance(receiver, ast.Name) and receiver.id == this:
        return _MethodCall(method.attr)
    if not (
        isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name) and receiver.func.id == "super"
    ):
        return None
    if not receiver.args:
        return _MethodCall(method.attr, through="")
    base = receiver.args[0]
    return _MethodCall(method.attr, through=base.id) if isinstance(base, ast.Name) else None


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _second_order_flag(cls: type) -> bool:
    """`is_second_order` is True on the class: an attribute, or a property that returns True without
    reading the instance (timm's Adahessian). A property that reads the instance (timm's Lookahead
    asks its base) is left to the base's own needs."""
    flag = inspect.getattr_static(cls, "is_second_order", False)
    if isinstance(flag, property):
        try:
            flag = flag.fget(None) if flag.fget is not None else False
        except Exception:
            return False
    return flag is True


def _has_train_eval(cls: type) -> bool:
    """Both modes defined by the optimizer itself: the frameworks' base classes have neither."""
    return callable(getattr(cls, "train", None)) and callable(getattr(cls, "eval", None))


def _base_argument(cls: type) -> str | None:
    """The required argument that takes the optimizer a wrapper wraps: by its name, else by an
    annotation naming an optimizer (sam-pytorch's `SAM(params, optim: Optimizer, rho)`)."""
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return None
    required = {name: p for name, p in parameters.items() if p.default is inspect.Parameter.empty}
    for name in BASE_ARGUMENTS:
        if name in required:
            return name
    return next(
        (name for name, p in required.items() if OPTIMIZER_ANNOTATION.search(annotation_text(p))), None
    )


def annotation_text(parameter: inspect.Parameter) -> str:
    """A parameter's annotation as written (`Optimizer`, `Type[Optimizer]`), '' where it has none."""
    annotation = parameter.annotation
    if annotation is inspect.Parameter.empty:
        return ""
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


# What a Keras training step cannot do: `apply_gradients` takes no closure, its GradientTape
# gives no second-order backward to the optimizer, no Keras job builds a wrapper, and none calls an
# optimizer's own train() and eval() (a schedule-free class's): accepted, they had been ignored.
_UNSERVED = {
    "tensorflow": (
        "closure",
        "create_graph",
        "backward_in_step",
        "base_optimizer",
        "model_argument",
        "train_eval",
    )
}


def needs_unserved_by(framework: str) -> tuple[str, ...]:
    """The needs a `framework` job's loop cannot serve (none for torch)."""
    return _UNSERVED.get(framework, ())


def unserved(name: str, needs: LoopNeeds, framework: str) -> str | None:
    """Why a `framework` job cannot train optimizer `name`, else None (torch serves every need)."""
    missing = [need for need in needs_unserved_by(framework) if getattr(needs, need)]
    if not missing:
        return None
    if needs.base_optimizer is not None and "base_optimizer" in missing:
        # Not "name a base" (base_problem's advice): no base makes a wrapper trainable here.
        said = (
            f"optimizer {name!r} wraps a base optimizer (its {needs.base_optimizer!r} argument), and "
            f"{framework} jobs and checks build no wrapper around a base optimizer (wrappers run in torch "
            "jobs)"
        )
        if framework != "tensorflow":
            return said
        return (
            f"{said}; to check it, check the optimizer it wraps by itself, or a subclass whose constructor "
            "builds that optimizer from its own hyperparameters (def __init__(self, learning_rate=1e-3, "
            "**kwargs): super().__init__(keras.optimizers.Adam(learning_rate), **kwargs)), which checks and "
            "jobs can build"
        )
    return (
        f"optimizer {name!r} needs {' and '.join(missing)}, which {framework} training steps cannot "
        "provide; run it in a torch job"
    )


def base_unserved(framework: str) -> str | None:
    """Why a `framework` job cannot take an `optimizer.base` at all, else None."""
    if "base_optimizer" not in _UNSERVED.get(framework, ()):
        return None
    return (
        f"{framework} jobs build no wrapper around a base optimizer (wrappers run in torch jobs); "
        "leave optimizer.base out"
    )


def loop_problem(
    name: str, needs: LoopNeeds, base: tuple[str, LoopNeeds] | None, framework: str
) -> tuple[str, str] | None:
    """The field at fault (`base` or `name`, under `optimizer`) and why, when a `framework` job cannot
    serve optimizer `name` with `needs` over `base` (its name and needs); else None.

    The one rule for the API (from the catalogue) and the job (from the registry), in this order:
    a base the framework cannot wrap, needs its loop cannot serve (the wrapper's and its base's
    together), then `base_problem`.
    """
    refused = base_unserved(framework) if base is not None else None
    if refused:
        return "base", refused
    refused = unserved(name, needs.with_base(base[1] if base is not None else None), framework)
    if refused:
        return "name", refused
    problem = base_problem(name, needs, base)
    return ("base", problem) if problem else None


def base_problem(name: str, needs: LoopNeeds, base: tuple[str, LoopNeeds] | None) -> str | None:
    """Why optimizer `name` cannot be built over `base` (its name and needs) or without one, else None.

    The one rule for the API (from the catalogue) and the job (from the registry): a wrapper
    needs a base, only a wrapper takes one, and the base is a plain optimizer.
    """
    if needs.base_optimizer is None:
        return (
            None if base is None else f"optimizer {name!r} wraps no base optimizer; leave optimizer.base out"
        )
    if base is None:
        return (
            f"optimizer {name!r} wraps a base optimizer (its {needs.base_optimizer!r} argument): "
            'name it in optimizer.base, e.g. {"name": "adamw", "params": {"lr": 0.001}}'
        )
    base_name, base_needs = base
    if base_needs.base_optimizer is not None:
        return f"optimizer.base {base_name!r} is itself a wrapper; name a plain optimizer as the base"
    if base_needs.model_argument is not None:
        return (
            f"optimizer.base {base_name!r} is built over the model (its {base_needs.model_argument!r} "
            "argument), and a wrapper builds its base over the parameters; train it without a wrapper"
        )
    return None


def recipe_problem(name: str, needs: LoopNeeds) -> str | None:
    """Why optimizer `name` cannot take a param-group recipe, else None: a class built over the model
    makes its own groups of it (the job hands it the model, not groups)."""
    if needs.model_argument is None:
        return None
    return (
        f"optimizer {name!r} is built over the model (its {needs.model_argument!r} argument) and makes "
        "its own groups of it; leave optimizer.param_groups out"
    )
