"""`optlab serve` and `optlab demo` as a user runs them: start, work, stop with nothing left behind."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.conftest import ROOT, free_port


def processes_mentioning(marker: str) -> list[int]:
    """Live processes whose command line or environment names `marker` (our data dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().split()[2] == "Z":
                continue
            blob = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in blob:
            found.append(int(entry.name))
    return found


def cmdline(pid: int) -> bytes:
    """The command line of a live process; empty once it is gone (or a zombie)."""
    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return b""
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def descendants(root: int) -> list[int]:
    """Every live process below `root` (children, their children, ...), found through /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
        except OSError:
            continue
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def wait_for(condition: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def wait_gone(marker: str, timeout_s: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_mentioning(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_serve_comes_up_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    data = tmp_path / "serve-data"
    api_port = free_port()
    command = [sys.executable, "-m", "service.cli", "serve", "--port", str(api_port)]
    command += ["--mlflow-port", str(free_port()), "--data-dir", str(data)]
    serve = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert serve.stdout is not None
    output = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = serve.stdout.readline()
        output.append(line)
        if "Ctrl-C stops everything" in line or not line:
            break
    banner = "".join(output)
    assert f"http://127.0.0.1:{api_port}/docs" in banner and "MLflow UI" in banner, banner
    assert "access    open: no OPTLAB_API_TOKENS" in banner, banner
    assert len(processes_mentioning(str(data))) >= 3  # MLflow, API, worker (and their children)
    # The worker's warm job process names neither the data dir nor a job: found as a descendant.
    warm = wait_for(lambda: [p for p in descendants(serve.pid) if b"jobs.warm" in cmdline(p)], 120)
    assert warm, "the worker started no warm job process"

    # A part killed from outside (for memory, say) is started again, and says so.
    for part, health in (("worker", None), ("api", f"http://127.0.0.1:{api_port}/healthz")):
        [killed] = parts_named(serve.pid, part)
        os.kill(killed, signal.SIGKILL)
        said = read_until(
            serve, f"{part} was killed by signal SIGKILL; started it again (restart 1 of at most 5"
        )
        assert f"Last lines of {data / 'logs' / part}.log" in said, said
        again = wait_for(functools.partial(parts_named, serve.pid, part), 30)
        assert again and again != [killed]
        if health:
            assert wait_for(functools.partial(_answers, health), 60), (
                f"the {part} started again does not answer"
            )
    # The worker started again has a warm job process of its own; the killed one's went with it.
    rewarmed = wait_for(lambda: [p for p in descendants(serve.pid) if b"jobs.warm" in cmdline(p)], 120)
    assert rewarmed and set(rewarmed).isdisjoint(warm), (rewarmed, warm)
    assert wait_for(lambda: not any(cmdline(p) for p in warm), 30), (
        "the killed worker's warm process lived on"
    )

    serve.send_signal(signal.SIGINT)
    assert serve.wait(timeout=90) == 0
    assert wait_gone(str(data)) == [], "processes outlived `optlab serve`"
    assert wait_for(lambda: not any(cmdline(p) for p in rewarmed), 30), "a warm job process outlived it"


def parts_named(serve_pid: int, part: str) -> list[int]:
    """The processes of one part `optlab serve` started itself (`api`, `worker`)."""
    return [
        child
        for child in descendants(serve_pid)
        if _parent(child) == serve_pid and f"service.cli\0{part}".encode() in cmdline(child)
    ]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def read_until(serve: subprocess.Popen[str], wanted: str, timeout_s: float = 60) -> str:
    """`optlab serve`'s output up to the line holding `wanted`, and the lines of the log tail after it."""
    assert serve.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = serve.stdout.readline()
        if not line:
            break
        lines.append(line)
        if wanted in line:
            return line
    raise AssertionError(f"`optlab serve` never said {wanted!r}; it said:\n{''.join(lines)}")


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_refuses_a_port_in_use(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        completed = subprocess.run(
            [sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--data-dir", str(tmp_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert completed.returncode == 1
    assert f"127.0.0.1:{port} is already in use" in completed.stderr and "--port" in completed.stderr


def test_serve_refuses_a_data_folder_it_cannot_write_in_one_line(tmp_path: Path) -> None:
    """It had printed a PermissionError's traceback. (A folder under a file: root writes anywhere.)"""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    completed = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--data-dir", str(blocker / "data")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 1 and "Traceback" not in completed.stderr, completed.stderr
    assert f"cannot write to the data folder {blocker / 'data'}" in completed.stderr
    assert "give a writable --data-dir (or OPTLAB_DATA_DIR)" in completed.stderr


def test_demo_trains_compares_and_cleans_up(tmp_path: Path) -> None:
    specs = tmp_path / "specs"
    specs.mkdir()
    demo_spec = json.loads((ROOT / "examples/demo/1-ema_momentum.json").read_text())
    demo_spec.update(steps=40, checkpoint_every=20, eval_every=20)
    (specs / "one.json").write_text(json.dumps(demo_spec))
    data = tmp_path / "demo-data"
    command = [sys.executable, "-m", "service.cli", "demo", "--specs", str(specs), "--data-dir", str(data)]
    command += ["--port", str(free_port()), "--mlflow-port", str(free_port())]
    completed = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "COLUMNS": "160"},
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "val accuracy" in completed.stdout and "2/2" in completed.stdout  # both checkpoints verified
    assert "Compare the runs in the MLflow UI: http://127.0.0.1:" in completed.stdout
    assert "To open that link, run `make serve`" in " ".join(completed.stdout.split())
    assert wait_gone(str(data)) == []
