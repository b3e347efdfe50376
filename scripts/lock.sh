#!/usr/bin/env bash
# `make lock`: write constraints.txt, the exact version of every package a fresh machine, CI and
# the image install (the Makefile and the Dockerfile both install with `-c constraints.txt`).
#
# 1. A fresh venv installs the project with its test extra, exactly as `make test` does on a new
#    machine; `pip freeze` of it (the project itself excluded) is the lock's base. torch is written
#    without a local label (`torch==2.13.0`, not `+cpu`): the pin then matches the CPU build a dev
#    machine may have on disk and the CUDA build the image gets from the index, same version.
# 2. The image also installs the `gpu` extra and torch's CUDA build, whose extra packages (the
#    NVIDIA libraries, triton) a CPU machine never installs: they are resolved for Linux against the
#    package index alone (no local wheels), held to step 1's versions, and added.
#
# Usage: scripts/lock.sh [OUTPUT] (default constraints.txt); PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
output=${1:-constraints.txt}
python=${PYTHON:-python3.11}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$python" -m venv "$work/venv"
pip="$work/venv/bin/python -m pip"
$pip install --quiet --upgrade pip setuptools wheel
echo "lock: installing the project and its test extra in a fresh venv (a few minutes)..." >&2
$pip install --quiet -e '.[test]'
$pip freeze --exclude-editable | sed -E 's/^(torch|torchvision|torchaudio)==([^+]+)\+.*/\1==\2/' \
    | grep -v -E '^(optlab|-e )' | LC_ALL=C sort -f >"$work/base.txt"

echo "lock: resolving the image's CUDA packages against the index..." >&2
env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
    $pip install --quiet --dry-run --ignore-installed --report "$work/gpu.json" \
    -c "$work/base.txt" '.[gpu]'
"$work/venv/bin/python" - "$work/base.txt" "$work/gpu.json" >"$work/gpu.txt" <<'EOF'
import json
import re
import sys

def key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()

base = {key(line.split("==")[0]) for line in open(sys.argv[1]) if "==" in line}
for item in json.load(open(sys.argv[2]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if key(name) not in base and key(name) != "optlab":
        print(f"{name}=={version}")
EOF

{
    echo "# The lock: every package's exact version. Written by \`make lock\` (scripts/lock.sh); do not"
    echo "# edit by hand. Used by the Makefile and the Dockerfile: pip install -c constraints.txt ..."
    echo "# torch has no local label on purpose: ==2.13.0 matches the CPU and the CUDA build alike."
    cat "$work/base.txt"
    echo "# Not in the freeze: the image's CUDA packages (torch's CUDA build, tensorflow[and-cuda]) and the"
    echo "# build tools pip freeze leaves out:"
    LC_ALL=C sort -f "$work/gpu.txt"
} >"$output"
echo "lock: wrote $output ($(grep -c '==' "$output") packages)" >&2
