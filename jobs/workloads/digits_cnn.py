"""The digits of `digits_mlp` as 8x8x1 images, and a small CNN."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from functools import cache
from typing import Any, ClassVar

from jobs.workloads.base import Dataset, Target, Task, Workload
from jobs.workloads.digits_mlp import load_digits_split
from optimizers.hyperparams import Param

IMAGE_SHAPE = (8, 8, 1)


@cache
def load_digit_images_split() -> Dataset:
    """`digits_mlp`'s split, same rows in the same order, x as (N, 8, 8, 1) float32 (channels-last).

    One layout for every framework: Keras reads it as is, the torch model permutes inside.
    """
    flat = load_digits_split()
    return Dataset(
        x_train=flat.x_train.reshape(-1, *IMAGE_SHAPE),
        y_train=flat.y_train,
        x_val=flat.x_val.reshape(-1, *IMAGE_SHAPE),
        y_val=flat.y_val,
        n_classes=flat.n_classes,
    )


class DigitsCnn(Workload):
    """conv3x3(f, same, relu) -> conv3x3(f, same, relu) -> flatten -> dense 10 logits.

    Glorot-uniform kernels and zero biases in every framework. The torch model takes the
    channels-last batch, permutes to channels-first for its convolutions and back before
    flattening, so both frameworks flatten in (height, width, channel) order and a Keras
    kernel maps onto the torch weight by a transpose alone. Layer names match across
    frameworks (`conv_1`, `conv_2`, `logits`).
    """

    name: ClassVar[str] = "digits_cnn"
    summary: ClassVar[str] = (
        "8x8x1 digit images (1437 train / 360 val), CNN conv3x3(f)-conv3x3(f)-dense10 with ReLU"
    )
    task: ClassVar[Task] = "classification"
    frameworks: ClassVar[tuple[str, ...]] = ("torch", "tensorflow")
    default_target: ClassVar[Target] = Target("val/accuracy", "max", 0.95)
    params: ClassVar[dict[str, Param]] = {
        "filters": Param("filters", "int", 16, low=1, high=256, help="channels of both convolutions"),
    }

    def load_data(self, params: Mapping[str, Any] | None = None) -> Dataset:
        return load_digit_images_split()

    def torch_model(self, params: Mapping[str, Any], dataset: Dataset, *, sparse: bool = False) -> Any:
        from torch import nn

        from jobs.workloads.torch_modules import Permute, glorot_init_

        filters = self.check_params(params)["filters"]
        height, width, channels = dataset.x_train.shape[1:]
        return glorot_init_(
            nn.Sequential(
                OrderedDict(
                    to_channels_first=Permute(0, 3, 1, 2),
                    conv_1=nn.Conv2d(channels, filters, 3, padding="same"),
                    relu_1=nn.ReLU(),
                    conv_2=nn.Conv2d(filters, filters, 3, padding="same"),
                    relu_2=nn.ReLU(),
                    to_channels_last=Permute(0, 2, 3, 1),
                    flatten=nn.Flatten(),
                    logits=nn.Linear(height * width * filters, dataset.n_classes),
                )
            )
        )

    def keras_model(self, params: Mapping[str, Any], dataset: Dataset, *, keras_module: Any) -> Any:
        filters = self.check_params(params)["filters"]
        layers = keras_module.layers
        init = {"kernel_initializer": "glorot_uniform", "bias_initializer": "zeros"}
        conv = {"padding": "same", "activation": "relu", "data_format": "channels_last", **init}
        return keras_module.Sequential(
            [
                keras_module.Input(shape=dataset.x_train.shape[1:], dtype="float32"),
                layers.Conv2D(filters, 3, name="conv_1", **conv),
                layers.Conv2D(filters, 3, name="conv_2", **conv),
                layers.Flatten(data_format="channels_last", name="flatten"),
                layers.Dense(dataset.n_classes, name="logits", **init),
            ],
            name=self.name,
        )
