"""TensorFlow and Keras imported without the optional libraries Keras loads just in case
(optimizers/optional_imports.py), in fresh processes: a test process has long imported them."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.processes import legacy_keras_environment
from optimizers import optional_imports
from tests.conftest import ROOT

# argv: the Keras to import ("keras" or "tf_keras"), then modules imported before it.
PROGRAM = """
import sys
from optimizers.optional_imports import KERAS_OPTIONAL_IMPORTS, import_tensorflow
already = [__import__(name) for name in sys.argv[2:]]
import_tensorflow(sys.argv[1])
print("AFTER_IMPORT", sorted(m for m in KERAS_OPTIONAL_IMPORTS if m in sys.modules))
assert all(sys.modules[module.__name__] is module for module in already)
if sys.argv[1] == "keras":
    sys.modules["keras"].Variable(1.0)
# A user's module imports them as usual afterwards.
import pandas, sklearn.datasets, matplotlib.pyplot
print("USER_GOT", pandas.DataFrame({"a": [1]}).shape, sklearn.datasets.load_digits().data.shape)
"""


def run(framework: str, *preloaded: str) -> str:
    env = legacy_keras_environment(os.environ, legacy=framework == "tf_keras")
    completed = subprocess.run(
        [sys.executable, "-c", PROGRAM, framework, *preloaded],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout


def test_legacy_keras_imports_none_of_them_and_a_user_gets_each_afterwards() -> None:
    printed = run("tf_keras")
    assert "AFTER_IMPORT []" in printed
    assert "USER_GOT (1, 1) (1797, 64)" in printed


def test_keras_leaves_a_library_imported_before_as_it_is() -> None:
    printed = run("keras", "pandas")
    assert "AFTER_IMPORT ['pandas']" in printed
    assert "USER_GOT (1, 1) (1797, 64)" in printed


def test_a_name_is_hidden_only_within_and_only_when_not_imported_yet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "optlab_probe.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(optional_imports, "KERAS_OPTIONAL_IMPORTS", ("optlab_probe",))
    with optional_imports.keras_imports_hidden("optlab_first_import"):
        with pytest.raises(ImportError):
            importlib.import_module("optlab_probe")
    assert importlib.import_module("optlab_probe").VALUE == 1  # afterwards, as usual
    with optional_imports.hidden_while_importing(["optlab_probe"]):  # imported: left as it is
        assert importlib.import_module("optlab_probe").VALUE == 1
    monkeypatch.delitem(sys.modules, "optlab_probe")
    with optional_imports.keras_imports_hidden("json"):  # that Keras is imported already: no window
        assert importlib.import_module("optlab_probe").VALUE == 1
