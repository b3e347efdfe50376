"""Steps that refuse vectors with an assert, in a module pytest does not rewrite (it gives a test
module's bare asserts a message of its own)."""

from __future__ import annotations

from typing import Any

import torch


class MatricesOnlySGD(torch.optim.SGD):
    """Refuses vectors with an assert that says so, as Microsoft's Dion, Muon and NorMuon do."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                assert param.ndim == 2, "MatricesOnlySGD only supports matrix parameters."
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"])
        return None


class SilentlyAssertingSGD(torch.optim.SGD):
    """The same refusal as a bare assert, which names nothing: still a fault."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                assert param.ndim == 2
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"])
        return None
