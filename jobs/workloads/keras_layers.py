"""The two Keras layers the workloads need beyond Keras' own, for Keras 3 and legacy tf.keras alike.

Written with TensorFlow ops (both Keras styles run on TensorFlow) and registered as
serializable under the package `optlab`, so a whole-model file (`.keras`, h5) loads back
without custom objects, as the Keras driver's checkpoint demands. Defined per Keras module on
first use: `layers_for(keras)` and `layers_for(tf_keras)` are separate classes in separate
registries, and importing this module loads no framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from jobs.workloads.surfaces import quadratic_hessian, quadratic_start


@dataclass(frozen=True)
class KerasLayers:
    PositionEmbedding: Any
    SurfacePoint: Any


@cache
def layers_for(keras_module: Any) -> KerasLayers:
    import numpy as np
    import tensorflow as tf

    register = keras_module.utils.register_keras_serializable(package="optlab")
    base = keras_module.layers.Layer

    class PositionEmbedding(base):  # type: ignore[misc, valid-type]
        """x + a learned (context, width) table, N(0, init_std^2) as torch_modules.PositionEmbedding."""

        def __init__(self, context: int, width: int, init_std: float, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.context, self.width, self.init_std = context, width, init_std

        def build(self, input_shape: Any) -> None:
            init = keras_module.initializers.RandomNormal(mean=0.0, stddev=self.init_std)
            self.embeddings = self.add_weight(
                name="embeddings", shape=(self.context, self.width), initializer=init, trainable=True
            )
            super().build(input_shape)

        def call(self, inputs: Any) -> Any:
            return inputs + self.embeddings

        def get_config(self) -> dict[str, Any]:
            return {
                **super().get_config(),
                "context": self.context,
                "width": self.width,
                "init_std": self.init_std,
            }

    class SurfacePoint(base):  # type: ignore[misc, valid-type]
        """A test function's parameter vector `point` (starting where `jobs.workloads.surfaces`
        says); its output is f(point) for each input row, as torch_modules.SurfacePoint."""

        def __init__(
            self,
            function: str,
            dim: int = 2,
            condition: float = 1.0,
            start: list[float] | None = None,
            **kwargs: Any,
        ) -> None:
            super().__init__(**kwargs)
            self.function, self.dim, self.condition = function, dim, condition
            self.start = list(start) if start is not None else list(quadratic_start(dim))
            hessian = quadratic_hessian(dim, condition) if function == "quadratic" else None
            self.hessian = None if hessian is None else tf.constant(hessian, dtype=tf.float32)

        def build(self, input_shape: Any) -> None:
            self.point = self.add_weight(
                name="point", shape=(len(self.start),), initializer="zeros", trainable=True
            )
            self.point.assign(np.asarray(self.start, dtype=np.float32))
            super().build(input_shape)

        def value(self) -> Any:
            w = tf.convert_to_tensor(self.point)
            if self.hessian is None:
                x, y = w[0], w[1]
                return (1.0 - x) ** 2 + 100.0 * (y - x**2) ** 2
            return 0.5 * tf.tensordot(w, tf.linalg.matvec(self.hessian, w), axes=1)

        def call(self, inputs: Any) -> Any:
            return tf.broadcast_to(self.value(), tf.shape(inputs)[:1])

        def get_config(self) -> dict[str, Any]:
            return {
                **super().get_config(),
                "function": self.function,
                "dim": self.dim,
                "condition": self.condition,
                "start": self.start,
            }

    return KerasLayers(PositionEmbedding=register(PositionEmbedding), SurfacePoint=register(SurfacePoint))
