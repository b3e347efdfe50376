#!/usr/bin/env bash
# GPU smoke test, for a machine with NVIDIA GPUs (a few minutes). It needs torch with CUDA; the
# rest of the job side travels with this repository (jobs/, optimizers/: pure Python), and a part
# whose packages are missing (pydantic for the job process, scikit-learn for the digits data,
# TensorFlow) is skipped or replaced, saying so. It:
#   - prints the device of each optimizer state tensor of a custom optimizer (the plugin
#     examples/plugins/sign_momentum.py) after steps on the GPU and after a reload via the host;
#   - trains a torch job with it on every GPU at once (one job per GPU, CUDA_VISIBLE_DEVICES, as
#     the worker's slots do), printing samples/s and the optimizer step's share of the step;
#   - resumes an Adam job from its first checkpoint in a fresh process on one GPU: the weights must
#     end bitwise equal to a straight run's, and it prints both optimizer step times;
#   - trains a DDP job over two GPUs (NCCL) where there are two;
#   - runs `optlab check` on the class, device_placement and mixed_precision included.
# Exit status 0 when every part that ran passed. --allow-cpu runs it all on the CPU (the tests do).
# Usage: scripts/gpu_smoke.sh [--allow-cpu] [--steps N]; PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then
    python=.venv/bin/python
fi
exec "$python" scripts/gpu_smoke.py "$@"
