"""TensorFlow and Keras imported without the optional libraries Keras loads just in case.

When they are installed, importing Keras 3 (and TensorFlow, which imports it) also imports
scikit-learn (for the `keras.wrappers` SKLearn estimators), pandas (so that `fit` accepts
DataFrames) and matplotlib.pyplot (for its plotting utilities); tf_keras imports pandas. Here
that is 1.7 of the 4.6 s of CPU and 150 of the 700 MiB that a Keras job, check or catalogue
process spends importing TensorFlow and Keras. No optimizer, workload or check of ours uses those
features, and scikit-learn is installed only for its bundled datasets, which
`jobs/workloads/digits_mlp.py` reads without importing it.

So while TensorFlow and Keras are first imported, those libraries look absent (Keras then leaves
those features out, as it does where they are not installed, and guards every such import), and
afterwards they import as usual: a user's module that imports pandas gets it. A library already
imported (a tracked job's MLflow client brings pandas) is left as it is.

Not done for MLflow's client, which imports pandas too: parts of MLflow record a failed pandas
import for good (`mlflow.models` loses its signatures, and `mlflow.pyfunc`, `mlflow.keras` no
longer import), and a plugin may use them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager

KERAS_OPTIONAL_IMPORTS = ("sklearn", "pandas", "matplotlib")
KERAS_MODULE_OF_STYLE = {"keras": "keras", "tf_legacy": "tf_keras"}


@contextmanager
def hidden_while_importing(names: Iterable[str]) -> Iterator[None]:
    """Within: `import name` raises ImportError for each of `names` not imported already."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # makes `import name` fail
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def keras_imports_hidden(keras_module: str | None) -> AbstractContextManager[None]:
    """Keras's optional imports hidden while `keras_module` ("keras" or "tf_keras") is imported
    for the first time in this process; nothing hidden once it is (no window in which a user's
    thread could find pandas missing), nor for None (a torch style)."""
    first_time = keras_module is not None and keras_module not in sys.modules
    return hidden_while_importing(KERAS_OPTIONAL_IMPORTS if first_time else ())


def import_tensorflow(keras_module: str) -> None:
    """TensorFlow and `keras_module` ("keras" or "tf_keras"), without Keras's optional imports."""
    with keras_imports_hidden(keras_module):
        importlib.import_module("tensorflow")
        importlib.import_module(keras_module)
