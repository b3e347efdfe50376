"""One driver per optimizer style: the only code that knows which framework it runs.

`driver_for(style)` imports the style's framework on demand, so a torch job never loads
TensorFlow and the reverse. Everything else (training loop, checks, results) is
written once over `jobs.frameworks.base.Driver`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jobs.frameworks.base import Driver

if TYPE_CHECKING:
    from jobs.spec import AnySpec

# style -> (module, class); importing the module loads that framework.
DRIVERS: dict[str, tuple[str, str]] = {
    "torch": ("jobs.frameworks.torch_driver", "TorchDriver"),
    "keras": ("jobs.frameworks.keras_driver", "KerasDriver"),
    "tf_legacy": ("jobs.frameworks.keras_driver", "LegacyKerasDriver"),
}

# The style a spec means when it names only its framework (Keras 3 before legacy).
DEFAULT_STYLE = {"torch": "torch", "tensorflow": "keras"}


def style_of(spec: AnySpec) -> str:
    return spec.optimizer.style or DEFAULT_STYLE[spec.framework]


def driver_for(style: str) -> Driver:
    if style not in DRIVERS:
        raise ValueError(f"unknown optimizer style {style!r}; known: {', '.join(DRIVERS)}")
    module, name = DRIVERS[style]
    driver: Driver = getattr(importlib.import_module(module), name)()
    return driver


# -- fresh-process checks --


def driver_class(style: str) -> type[Driver]:
    """The style's driver class without making one: a Keras driver imports TensorFlow when made,
    which a fresh child wants to do in its own way (jobs/checks/fresh/keras_child.py)."""
    if style not in DRIVERS:
        raise ValueError(f"unknown optimizer style {style!r}; known: {', '.join(DRIVERS)}")
    module, name = DRIVERS[style]
    cls: type[Driver] = getattr(importlib.import_module(module), name)
    return cls
