"""One driver per optimizer style: the only code that knows which framework it runs.

`driver_for(style)` imports the style's framework on demand, so a torch job never loads
TensorFlow and the reverse. Everything else (training loop, checks, results) is
written once over `jobs.frameworks.base.Driver`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jobs.frameworks.base import Driver
from jobs.spec import default_style

if TYPE_CHECKING:
    from jobs.spec import AnySpec

# style -> (module, class); importing the module loads that framework.
DRIVERS: dict[str, tuple[str, str]] = {
    "torch": ("jobs.frameworks.torch_driver", "TorchDriver"),
    "keras": ("jobs.frameworks.keras_driver", "KerasDriver"),
    "tf_legacy": ("jobs.frameworks.keras_driver", "LegacyKerasDriver"),
}


# Styles whose process must start with TF_USE_LEGACY_KERAS=1 (it swaps `tf.keras` for the whole
# process, so it must be known before TensorFlow is imported, i.e. before loading the driver).
LEGACY_KERAS_STYLES = frozenset({"tf_legacy"})


def style_of(spec: AnySpec) -> str:
    """The style a spec runs: the one it names, else its framework's default."""
    return spec.optimizer.style or default_style(spec.framework)


def needs_legacy_keras_process(style: str) -> bool:
    return style in LEGACY_KERAS_STYLES


def driver_for(style: str) -> Driver:
    return driver_class(style)()


def driver_class(style: str) -> type[Driver]:
    """The style's driver class without making one: a Keras driver imports TensorFlow when made,
    which a fresh child wants to do in its own way (jobs/checks/fresh/keras_child.py)."""
    if style not in DRIVERS:
        raise ValueError(f"unknown optimizer style {style!r}; known: {', '.join(DRIVERS)}")
    module, name = DRIVERS[style]
    cls: type[Driver] = getattr(importlib.import_module(module), name)
    return cls
