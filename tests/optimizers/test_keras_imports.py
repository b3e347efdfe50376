"""TensorFlow and Keras imported without their optional libraries (optimizers/keras_imports.py), in
fresh processes: a test process has long imported them."""

from __future__ import annotations

import os
import subprocess
import sys

from jobs.processes import legacy_keras_environment
from tests.conftest import ROOT

PROGRAM = """
import sys
from optimizers.keras_imports import OPTIONAL_KERAS_IMPORTS, import_tensorflow
already = [__import__(name) for name in sys.argv[2:]]
import_tensorflow(sys.argv[1])
print("AFTER_IMPORT", sorted(m for m in OPTIONAL_KERAS_IMPORTS if m in sys.modules))
assert all(sys.modules[module.__name__] is module for module in already)
keras = sys.modules[sys.argv[1]]
variable = keras.Variable(1.0) if sys.argv[1] == "keras" else None
# A user's module imports them as usual afterwards.
import pandas, sklearn.datasets, matplotlib.pyplot
print("USER_GOT", pandas.DataFrame({"a": [1]}).shape, sklearn.datasets.load_digits().data.shape)
"""


def run(keras_module: str, *preloaded: str) -> str:
    env = legacy_keras_environment(os.environ, legacy=keras_module == "tf_keras")
    completed = subprocess.run(
        [sys.executable, "-c", PROGRAM, keras_module, *preloaded],
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
    printed = run("keras", "pandas")  # as a tracked job's MLflow client brings pandas
    assert "AFTER_IMPORT ['pandas']" in printed
    assert "USER_GOT (1, 1) (1797, 64)" in printed
