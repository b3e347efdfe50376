"""TensorFlow and Keras imported without the optional libraries Keras loads just in case.

When they are installed, importing Keras 3 (and TensorFlow, which imports it) also imports
scikit-learn (for the `keras.wrappers` SKLearn estimators), pandas (so that `fit` accepts
DataFrames) and matplotlib.pyplot (for its plotting utilities); tf_keras imports pandas. Here
that is 1.7 of the 4.6 s of CPU and 150 of the 700 MiB that a Keras job, check or catalogue
process spends importing its framework, measured with `benchmarks/startup.py`. No optimizer,
workload or check of ours uses those features, and scikit-learn is installed only for its
bundled datasets, which `jobs/workloads/digits_mlp.py` reads without importing it.

So while TensorFlow and Keras are first imported, those libraries look absent (Keras then leaves
those features out, as it does where they are not installed) and afterwards import as usual: a
user's module that imports pandas gets it. A library already imported (the job's MLflow client
brings pandas) is left as it is.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager

OPTIONAL_KERAS_IMPORTS = ("sklearn", "pandas", "matplotlib")


@contextmanager
def optional_keras_imports_hidden() -> Iterator[None]:
    """Within: `import sklearn` (pandas, matplotlib) raises ImportError unless already imported."""
    hidden = [name for name in OPTIONAL_KERAS_IMPORTS if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # makes `import name` fail
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def import_tensorflow(keras_module: str) -> None:
    """TensorFlow and `keras_module` ("keras" or "tf_keras"), without Keras's optional imports."""
    with optional_keras_imports_hidden():
        importlib.import_module("tensorflow")
        importlib.import_module(keras_module)
