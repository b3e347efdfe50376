"""What an optimizer needs from the loop, read from the class: on published optimizers
(pytorch-optimizer) and on small classes that show each signal, and stated by the class
where detection cannot see it."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import pytorch_optimizer
import torch

from optimizers.loop_needs import LoopNeeds, detect_loop_needs, unserved
from optimizers.registry import load_registry
from tests.checks.closure_contracts import OwnBackwardSGD

PUBLISHED = [
    ("SAM", LoopNeeds(closure=True, base_optimizer="base_optimizer")),
    ("AdaHessian", LoopNeeds(create_graph=True)),
    ("SophiaH", LoopNeeds(create_graph=True)),
    ("ScheduleFreeAdamW", LoopNeeds(train_eval=True)),
    ("ScheduleFreeSGD", LoopNeeds(train_eval=True)),
    ("Lookahead", LoopNeeds(base_optimizer="optimizer")),
    ("Prodigy", LoopNeeds()),
    ("AdamP", LoopNeeds()),
]


@pytest.mark.parametrize(("name", "needs"), PUBLISHED, ids=[name for name, _ in PUBLISHED])
def test_published_optimizers(name: str, needs: LoopNeeds) -> None:
    assert detect_loop_needs(getattr(pytorch_optimizer, name)) == needs


def test_every_built_in_is_plain() -> None:
    registry = load_registry(plugin_dirs=[])
    assert {key: entry.needs for key, entry in registry.entries.items() if entry.needs != LoopNeeds()} == {}


class ClosureInSignature(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure: Any) -> Any:  # no default: a closure is required
        return closure()


class ClosureRefused(ClosureInSignature):
    def step(self, closure: Any = None) -> Any:
        if closure is None:
            raise RuntimeError("this optimizer needs a closure")
        return closure()


class ClosureAsserted(ClosureInSignature):
    """davda54's SAM, the one most copied: `assert closure is not None, ...`."""

    def step(self, closure: Any = None) -> Any:
        assert closure is not None, "Sharpness Aware Minimization requires closure, but it was not provided"
        return closure()


class HessianOfItsGradients(ClosureInSignature):
    """Differentiates the gradients in step() (a Hutchinson probe), its docstring silent about it."""

    def step(self, closure: Any = None) -> Any:
        params = [p for group in self.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        return torch.autograd.grad(grads, params, grad_outputs=[torch.ones_like(p) for p in params])


class GradientOfTheClosuresLoss(ClosureInSignature):
    """Takes the gradient of a loss (its closure's), not of gradients: no graph asked of backward."""

    def step(self, closure: Any = None) -> Any:
        params = [p for group in self.param_groups for p in group["params"]]
        return torch.autograd.grad(closure(), params)


class LossOfItsClosureRead(ClosureInSignature):
    """Reads the closure's loss (a line search), as torch's convention has it: already backward'ed."""

    def step(self, closure: Any = None) -> Any:
        loss = closure()
        return float(loss)


class BackwardOnTheClosuresLossInAHelper(ClosureInSignature):
    """torchmin's Minimizer: a helper calls the closure it was handed and runs backward on its loss."""

    def _evaluate(self) -> Any:
        f = self._closure()
        f.backward()
        return f

    def step(self, closure: Any) -> Any:
        self._closure = closure
        return self._evaluate()


class BackwardOnAWrappedClosure(ClosureInSignature):
    """SLS (IssamLaradji/sls): the closure wrapped to run under a fixed seed, its loss backward'ed."""

    def step(self, closure: Any) -> Any:
        def closure_deterministic() -> Any:
            return closure()

        loss = closure_deterministic()
        loss.backward()
        return loss


class BackwardOnTheClosureCall(ClosureInSignature):
    def step(self, closure: Any = None) -> Any:
        closure().backward()


class Declared(ClosureInSignature):
    """States what detection cannot see; a state that detection would get wrong is corrected."""

    optlab_needs = {"create_graph": True, "closure": False}


class SecondOrderProperty(ClosureRefused):
    """timm's flag for backward(create_graph=True), as its Adahessian raises it."""

    @property
    def is_second_order(self) -> bool:
        return True


class SecondOrderAttribute(ClosureRefused):
    is_second_order = True


class SecondOrderOfItsBase(ClosureRefused):
    """As timm's Lookahead: the flag reads the instance (its base), so the class alone does not say."""

    @property
    def is_second_order(self) -> bool:
        return bool(getattr(getattr(self, "base", None), "is_second_order", False))


def test_signals_in_the_class() -> None:
    assert detect_loop_needs(ClosureInSignature).closure
    assert detect_loop_needs(ClosureRefused).closure
    assert detect_loop_needs(ClosureAsserted).closure
    assert detect_loop_needs(HessianOfItsGradients).create_graph
    assert not detect_loop_needs(GradientOfTheClosuresLoss).create_graph
    assert detect_loop_needs(Declared) == LoopNeeds(create_graph=True)
    assert not detect_loop_needs(torch.optim.SGD).closure  # closure=None and never refused
    assert detect_loop_needs(SecondOrderProperty).create_graph
    assert detect_loop_needs(SecondOrderAttribute).create_graph
    assert not detect_loop_needs(SecondOrderOfItsBase).create_graph
    assert not detect_loop_needs(LossOfItsClosureRead).backward_in_step
    assert detect_loop_needs(OwnBackwardSGD) == LoopNeeds(closure=True, backward_in_step=True)
    assert detect_loop_needs(BackwardOnTheClosuresLossInAHelper).backward_in_step
    assert detect_loop_needs(BackwardOnAWrappedClosure).backward_in_step
    assert detect_loop_needs(BackwardOnTheClosureCall) == LoopNeeds(closure=True, backward_in_step=True)


class BackwardOnlyInItsDocstring(ClosureInSignature):
    """AGI-Arena's MARS: step() reads its closure's loss, and its docstring shows the usual loop."""

    def step(self, closure: Any = None) -> Any:
        """Usage:
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
        """
        loss = closure() if closure is not None else None
        return loss


class BackwardOnlyInAComment(ClosureInSignature):
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        # loss.backward()  -- the closure has run it already
        return loss


class ClosureRefusalCommentedOut(ClosureInSignature):
    """Code commented out (pytorch-ranger comments out its closure call), here the closure refusal."""

    def step(self, closure: Any = None) -> Any:
        # if closure is None: raise RuntimeError("a closure is required")
        return None


class HessianOnlyInAMessage(ClosureInSignature):
    def step(self, closure: Any = None) -> Any:
        params = [p for group in self.param_groups for p in group["params"]]
        if any(p.grad is not None and p.grad.grad_fn is not None for p in params):
            raise RuntimeError("no torch.autograd.grad(grads, params) here: backward without create_graph")


class HessianInAHelper(ClosureInSignature):
    """The official AdaHessian: step() leaves the Hutchinson probe to a method, two calls deep here;
    the recursive one shows each method is read once."""

    def step(self, closure: Any = None) -> Any:
        return self._precondition()

    def _precondition(self) -> Any:
        params = [p for group in self.param_groups for p in group["params"]]
        return self._hutchinson(params, [p.grad for p in params], repeats=1)

    def _hutchinson(self, params: list[Any], grads: list[Any], repeats: int) -> Any:
        probes = [torch.randint_like(p, 2) * 2 - 1 for p in params]
        trace = torch.autograd.grad(grads, params, grad_outputs=probes)
        return trace if repeats <= 1 else self._hutchinson(params, grads, repeats - 1)


class HessianHelperNeverCalled(HessianInAHelper):
    """A package's base may carry the probe for the few classes that call it; this step() does not."""

    def step(self, closure: Any = None) -> Any:
        return None


class HessianInAHelperOfItsBase(HessianHelperNeverCalled):
    def step(self, closure: Any = None) -> Any:
        params = [p for group in self.param_groups for p in group["params"]]
        return self._hutchinson(params, [p.grad for p in params], repeats=1)


class ClosureRefusedInAHelper(ClosureInSignature):
    def step(self, closure: Any = None) -> Any:
        return self._line_search(closure)

    def _line_search(self, closure: Any) -> Any:
        if closure is None:
            raise RuntimeError("this optimizer needs a closure")
        return closure()


class BackwardUnderAFlushLeftString(ClosureInSignature):
    def step(self, closure: Any = None) -> Any:
        note = """A string whose lines start left of the `def`, where dedenting the method's source
fails: the method is read all the same."""
        loss = closure()
        loss.backward()
        return loss, note


@contextlib.contextmanager
def patch_backward() -> Any:
    """Stands in for heavyball's: it makes every backward in its scope keep its graph."""
    yield


class HessianOfItsOwnClosureCall(ClosureInSignature):
    """heavyball's shape: a helper handed the closure calls it under a patch of its own that forces
    create_graph on that backward, and differentiates the gradients it made, only when built for
    Hessian-vector products; the loop's own backward needs no graph."""

    def step(self, closure: Any = None) -> Any:
        if closure is not None and self.defaults.get("hvp"):
            return self._double_backward_hvp(closure)
        return None

    def _double_backward_hvp(self, closure: Any) -> Any:
        with torch.enable_grad(), patch_backward():
            loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        return loss, torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])


class HessianOfAPlainClosureCallInAHelper(HessianOfItsOwnClosureCall):
    """The helper calls the closure under torch.enable_grad() alone: the gradients it differentiates
    are the ones the loop's closure made, which must keep their graph."""

    def _double_backward_hvp(self, closure: Any) -> Any:
        with torch.enable_grad():
            loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        return loss, torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])


class HessianInStepAfterItsClosure(ClosureInSignature):
    """torchium's AdaHessian: step() itself calls the closure and differentiates the gradients, which
    the closure's backward must leave with their graph."""

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        params = [p for group in self.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        return loss, torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params])


class HessianInStepOfItsBase(HessianInStepAfterItsClosure):
    """A user's tweak of a torchium-style AdaHessian that hands on to its step(): the base's step()
    calls the closure and differentiates the gradients, though reached as a helper."""

    def step(self, closure: Any = None) -> Any:
        return super().step(closure)


class HessianInItsBasesStep(HessianInAHelper):
    """A researcher's tweak over their own Hessian class: step() adjusts, then runs the base's."""

    def step(self, closure: Any = None) -> Any:
        self.param_groups[0]["lr"] *= 1.0
        return super().step(closure)


class HessianThroughTwoArgumentSuper(HessianInAHelper):
    def step(self, closure: Any = None) -> Any:
        return super(HessianThroughTwoArgumentSuper, self).step(closure)  # noqa: UP008 (the form read)


class SuperStepOfAFrameworkBase(torch.optim.SGD):
    """torch's own step() below: nothing of the user's to read there, nor a loop need."""

    def step(self, closure: Any = None) -> Any:
        return super().step(closure)


class HessianSkippedBySuper(HessianHelperNeverCalled):
    """`super().step` is the base's step(), which never calls the probe, not this class's own."""

    def step(self, closure: Any = None) -> Any:
        return super().step(closure)


# What the scans of the class's source find: code only (no docstring, comment or message), and the
# code of the methods step() calls (through the class's MRO, or a base's through `super()`), not of one
# it never calls.
SOURCE_SCANS = [
    (BackwardOnlyInItsDocstring, LoopNeeds()),
    (BackwardOnlyInAComment, LoopNeeds()),
    (ClosureRefusalCommentedOut, LoopNeeds()),
    (HessianOnlyInAMessage, LoopNeeds()),
    (HessianInAHelper, LoopNeeds(create_graph=True)),
    (HessianHelperNeverCalled, LoopNeeds()),
    (HessianInAHelperOfItsBase, LoopNeeds(create_graph=True)),
    (ClosureRefusedInAHelper, LoopNeeds(closure=True)),
    (BackwardUnderAFlushLeftString, LoopNeeds(closure=True, backward_in_step=True)),
    (HessianOfItsOwnClosureCall, LoopNeeds()),
    (HessianOfAPlainClosureCallInAHelper, LoopNeeds(create_graph=True)),
    (HessianInStepAfterItsClosure, LoopNeeds(create_graph=True)),
    (HessianInStepOfItsBase, LoopNeeds(create_graph=True)),
    (HessianInItsBasesStep, LoopNeeds(create_graph=True)),
    (HessianThroughTwoArgumentSuper, LoopNeeds(create_graph=True)),
    (SuperStepOfAFrameworkBase, LoopNeeds()),
    (HessianSkippedBySuper, LoopNeeds()),
]


@pytest.mark.parametrize(("cls", "needs"), SOURCE_SCANS, ids=[cls.__name__ for cls, _ in SOURCE_SCANS])
def test_the_source_scans_read_the_code_step_runs(cls: type, needs: LoopNeeds) -> None:
    assert detect_loop_needs(cls) == needs


@pytest.mark.parametrize(("name", "needs"), PUBLISHED, ids=[name for name, _ in PUBLISHED])
def test_a_thin_plugin_subclass_keeps_the_needs(name: str, needs: LoopNeeds) -> None:
    # How a plugin file exposes a published class: no docstring, no methods of its own.
    thin = type(name, (getattr(pytorch_optimizer, name),), {"optlab_name": name.lower()})
    assert detect_loop_needs(thin) == needs


def test_running_backward_in_step_implies_a_closure_however_it_is_stated() -> None:
    both = LoopNeeds(closure=True, backward_in_step=True)
    assert LoopNeeds(backward_in_step=True) == both
    assert LoopNeeds().with_overrides({"backward_in_step": True}, owner="optimizer.needs") == both
    refused = unserved("mine", LoopNeeds(backward_in_step=True), "tensorflow")
    assert refused is not None and "closure and backward_in_step" in refused


def test_a_wrong_declaration_is_refused_by_name() -> None:
    class Typo(ClosureInSignature):
        optlab_needs = {"create_grpah": True}

    with pytest.raises(ValueError, match="unknown need 'create_grpah'"):
        detect_loop_needs(Typo)

    class NotABool(ClosureInSignature):
        optlab_needs = {"train_eval": "yes"}

    with pytest.raises(ValueError, match="need 'train_eval' must be bool"):
        detect_loop_needs(NotABool)


def test_the_catalogue_publishes_the_needs() -> None:
    described = load_registry(plugin_dirs=[], styles=("torch",)).get("sgd", "torch").describe()
    assert described["needs"] == LoopNeeds().to_json()


def test_a_wrappers_needs_are_its_own_and_its_bases() -> None:
    from optimizers.loop_needs import PLAIN

    lookahead = LoopNeeds(base_optimizer="optimizer")
    ada_hessian, schedule_free = LoopNeeds(create_graph=True), LoopNeeds(train_eval=True)
    assert lookahead.with_base(ada_hessian) == LoopNeeds(create_graph=True, base_optimizer="optimizer")
    assert lookahead.with_base(schedule_free).train_eval
    sam = LoopNeeds(closure=True, base_optimizer="base_optimizer")
    assert sam.with_base(ada_hessian) == LoopNeeds(
        closure=True, create_graph=True, base_optimizer="base_optimizer"
    )
    assert sam.with_base(None) is sam and PLAIN.with_base(PLAIN) == PLAIN


def test_one_rule_says_which_field_a_job_cannot_serve() -> None:
    from optimizers.loop_needs import loop_problem

    lookahead = LoopNeeds(base_optimizer="optimizer")
    assert (
        loop_problem("lookahead", lookahead, ("ada_hessian", LoopNeeds(create_graph=True)), "torch") is None
    )
    field, why = loop_problem("adam", LoopNeeds(), ("sgd", LoopNeeds()), "tensorflow") or ("", "")
    assert field == "base" and "tensorflow jobs build no wrapper" in why
    field, why = loop_problem("lookahead", lookahead, None, "tensorflow") or ("", "")
    assert field == "name" and "wraps a base optimizer" in why and "build no wrapper" in why
    field, why = loop_problem("lookahead", lookahead, None, "torch") or ("", "")
    assert field == "base" and "name it in optimizer.base" in why


class BuiltBaseSAM(torch.optim.Optimizer):
    """sam-pytorch's signature: the parameters, then a built optimizer under a name of its own,
    said by its annotation."""

    def __init__(self, params: Any, optim: torch.optim.Optimizer, rho: float = 0.05) -> None:
        super().__init__(params, {"rho": rho})
        self.optim = optim

    def step(self, closure: Any) -> Any:
        loss = closure()
        self.optim.step()
        return loss


class ClassBaseSAM(BuiltBaseSAM):
    """The same asking for the class (`type[Optimizer]`), which it builds over the parameters."""

    def __init__(self, params: Any, optimizer_class: type[torch.optim.Optimizer], rho: float = 0.05) -> None:
        params = list(params)
        super().__init__(params, optimizer_class(params, lr=0.1), rho)


def test_an_argument_annotated_as_an_optimizer_is_the_base_whatever_its_name() -> None:
    """Detection had looked for three names only: sam-pytorch's `optim` was not a wrapper, so no base
    could be given and the class could be neither checked nor trained."""
    from optimizers.registry import Base, _takes_the_base_class, entry_for_class

    assert detect_loop_needs(BuiltBaseSAM) == LoopNeeds(closure=True, base_optimizer="optim")
    assert detect_loop_needs(ClassBaseSAM).base_optimizer == "optimizer_class"
    assert not _takes_the_base_class(BuiltBaseSAM, "optim")
    assert _takes_the_base_class(ClassBaseSAM, "optimizer_class")
    # An annotation of one form decides; a union of both (pytorch-optimizer's Lookahead) leaves it to
    # the name and place, as before; GSAM's `base_optimizer: Optimizer` takes a built one.
    assert not _takes_the_base_class(pytorch_optimizer.Lookahead, "optimizer")
    assert _takes_the_base_class(pytorch_optimizer.SAM, "base_optimizer")
    assert not _takes_the_base_class(pytorch_optimizer.GSAM, "base_optimizer")

    sgd = load_registry(plugin_dirs=[], styles=("torch",)).get("sgd")
    param = torch.zeros(2, requires_grad=True)
    wrapper = entry_for_class(BuiltBaseSAM, source="test").create(
        {"rho": 0.1}, model_params=iter([param]), base=Base(sgd, {"lr": 0.3})
    )
    assert isinstance(wrapper.optim, sgd.cls) and wrapper.optim.param_groups[0]["lr"] == 0.3
    assert wrapper.param_groups[0]["params"] == [param] == wrapper.optim.param_groups[0]["params"]
