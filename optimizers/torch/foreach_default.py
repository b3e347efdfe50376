"""Which kernel a built-in torch optimizer takes when its `foreach` is None: measured, not guessed.

`benchmarks/optimizer_step.py` (CPU, one thread; figures in benchmarks/README.md): over 115
tensors of 4.6k elements on average the multi-tensor (`torch._foreach_*`) kernels took 0.71-0.74
of the per-tensor loop's time, since each op is dispatched once per list instead of once per
tensor; over 115 tensors of 73k elements on average they took 1.02-1.22 of it, since the loop
keeps each tensor in cache through all of its ops while a list op streams every tensor through
memory once per op. On CUDA the multi-tensor kernels launch one kernel for many tensors and
always win (torch makes the same choice).
"""

from __future__ import annotations

from torch import Tensor

# Mean elements per tensor up to which the multi-tensor kernels win on a CPU (measured: they
# win at 4.6k, lose at 73k; 32k is 128 KiB of float32, a fraction of a core's L2 cache).
CPU_FOREACH_MAX_MEAN_NUMEL = 32 * 1024


def default_foreach(params: list[Tensor]) -> bool:
    """The faster kernel for these tensors: multi-tensor on CUDA, and on CPU for small tensors."""
    if all(p.is_cuda for p in params):
        return True
    if any(p.is_cuda for p in params):
        return False  # tensors on several devices: one list op cannot take them
    return sum(p.numel() for p in params) <= CPU_FOREACH_MAX_MEAN_NUMEL * len(params)
