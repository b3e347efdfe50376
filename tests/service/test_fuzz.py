"""A bounded schemathesis run against the real API (uvicorn, `optlab api`) over a real job store:
every operation, every check schemathesis has, its stateful phase (links between operations)
included, seeded so that a failure reproduces. Zero failures is the bar."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from service import store
from service.db import make_engine, migrate, session_factory
from tests.conftest import ROOT, free_port

TOKEN = "fuzz-token-0123456789abcdef"
CONFIG = Path(__file__).parent / "fuzz" / "schemathesis.toml"
SECONDS = 60
SEED = 20261201


@pytest.mark.timeout(240)
def test_the_fuzzer_finds_nothing(tmp_path: Path, catalogue_data: dict[str, Any]) -> None:
    database = f"sqlite:///{tmp_path / 'optlab.db'}"
    engine = make_engine(database)
    migrate(engine)
    with session_factory(engine)() as session:
        store.publish_catalogue(session=session, worker_id="fuzz", catalogue=catalogue_data)
    engine.dispose()
    port = free_port()
    env = {
        **os.environ,
        "OPTLAB_DATA_DIR": str(tmp_path),
        "OPTLAB_DATABASE_URL": database,
        "OPTLAB_TRUSTED_HOSTS": "127.0.0.1",
        "OPTLAB_API_HOST": "127.0.0.1",
        "OPTLAB_API_PORT": str(port),
        "OPTLAB_API_TOKENS": f"fuzz:{TOKEN},peek:{TOKEN[::-1]}:read",
        # Small enough that the run reaches the per-token cap and sees its 429s.
        "OPTLAB_MAX_QUEUED_PER_TOKEN": "200",
    }
    api = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "api"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "api.log", "wb"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(url, api)
        run = subprocess.run(
            [
                str(Path(sys.executable).parent / "schemathesis"),
                "--config-file", str(CONFIG),
                "run", f"{url}/openapi.json",
                "--header", f"Authorization: Bearer {TOKEN}",
                "--checks", "all",
                "--phases", "examples,coverage,fuzzing,stateful",
                "--max-time", str(SECONDS),
                "--seed", str(SEED),
                "--workers", "1",
                "--no-color",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=SECONDS + 120,
            check=False,
        )  # fmt: skip
    finally:
        api.terminate()
        api.wait(timeout=10)
    log = (tmp_path / "api.log").read_text(errors="replace")
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-3000:]
    assert "Traceback" not in log, log[-5000:]
    assert "✅ Stateful" in run.stdout, run.stdout[-3000:]  # the linked sequences ran, and passed
    print(run.stdout[-1500:])  # the summary, shown with -s


def _wait_for(url: str, process: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the API exited with {process.returncode} before answering")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the API at {url} did not answer within {timeout_s:.0f}s")
