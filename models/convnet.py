"""Small ResNet-style image classifier (Flax NNX) mixing GroupNorm and BatchNorm.

Images are NHWC (logical axes ``batch``, ``height``, ``width``, ``channels``).
Kernels are ``(conv_window, conv_window, conv_in, conv_out)``; norm scales, biases
and BatchNorm statistics are on ``norm``; the head is ``(embed, classes)``.

Each stage of residual blocks uses the norm its config names (``"group"``:
:class:`spmdkit.nn.GroupNorm`, ``"batch"``: :class:`spmdkit.nn.BatchNorm`, whose
statistics are the global batch's). BatchNorm keeps running statistics as
``nnx.BatchStat`` variables (not parameters): ``model.train()`` normalizes with
the batch's statistics and updates the running ones (a fresh model is in train
mode); ``model.eval()`` normalizes with the running statistics.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmdkit import nn as sknn

from . import layers as lyr

__all__ = ["ConvNetConfig", "ConvNet", "CONFIGS", "convnet_loss", "image_batch", "IMAGE_AXES"]


@dataclasses.dataclass(frozen=True)
class ConvNetConfig:
    """Sizes of the convnet.

    Attributes:
      image_size: height and width of the input images; channels: input channels.
      stem: channels of the stem convolution.
      widths: channels of each stage (every stage after the first halves the resolution).
      blocks: residual blocks per stage.
      norms: ``"group"`` or ``"batch"`` per stage (the stem uses GroupNorm).
      groups: GroupNorm groups (divides every width).
      classes: output classes.
      momentum: BatchNorm running-statistics momentum; eps: norm epsilon.
      dtype: compute dtype; param_dtype: parameter dtype.
    """

    image_size: int = 16
    channels: int = 3
    stem: int = 16
    widths: tuple[int, ...] = (16, 32)
    blocks: tuple[int, ...] = (1, 1)
    norms: tuple[str, ...] = ("group", "batch")
    groups: int = 4
    classes: int = 10
    momentum: float = 0.9
    eps: float = 1e-5
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        _check(self)


class Conv(nnx.Module):
    """Bias-free ``same``-padded 2-D convolution, NHWC / HWIO."""

    def __init__(self, cin, cout, *, window=3, stride=1, param_dtype=jnp.float32, rngs):
        self.stride = stride
        self.kernel = lyr.param(
            rngs,
            lyr.fan_in_init(window * window * cin),
            (window, window, cin, cout),
            ("conv_window", "conv_window", "conv_in", "conv_out"),
            param_dtype,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.lax.conv_general_dilated(
            x,
            self.kernel[...].astype(x.dtype),
            window_strides=(self.stride, self.stride),
            padding="SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )


def _check(cfg: ConvNetConfig) -> None:
    if not len(cfg.widths) == len(cfg.blocks) == len(cfg.norms):
        raise lyr.ModelConfigError(
            op="ConvNet",
            must="widths, blocks and norms have one entry per stage",
            given=f"{len(cfg.widths)}, {len(cfg.blocks)} and {len(cfg.norms)} entries",
            fix="give the three tuples the same length",
        )
    for kind in cfg.norms:
        if kind not in ("group", "batch"):
            raise lyr.ModelConfigError(
                op="ConvNet",
                must="each entry of ConvNetConfig.norms be 'group' or 'batch'",
                given=repr(kind),
                fix="use norms=('group', 'batch', ...)",
            )


def _norm(kind: str, dim: int, cfg: ConvNetConfig) -> nnx.Module:
    """``spmdkit.nn.GroupNorm`` or ``spmdkit.nn.BatchNorm`` (synchronized: statistics of
    the global batch, running statistics as ``nnx.BatchStat``), params on ``norm``."""
    common = {
        "epsilon": cfg.eps,
        "dtype": cfg.dtype,
        "param_dtype": cfg.param_dtype,
        "rngs": lyr.norm_rngs(),
    }
    if kind == "group":
        return sknn.GroupNorm(dim, num_groups=cfg.groups, **common)
    return sknn.BatchNorm(dim, momentum=cfg.momentum, use_running_average=False, **common)


class ResBlock(nnx.Module):
    """``relu(norm(conv(relu(norm(conv(x))))) + shortcut(x))``; 1x1 projection shortcut
    when the stride or width changes."""

    def __init__(self, cin, cout, *, stride, norm, cfg: ConvNetConfig, rngs: nnx.Rngs):
        pd = cfg.param_dtype
        self.conv1 = Conv(cin, cout, stride=stride, param_dtype=pd, rngs=rngs)
        self.norm1 = _norm(norm, cout, cfg)
        self.conv2 = Conv(cout, cout, param_dtype=pd, rngs=rngs)
        self.norm2 = _norm(norm, cout, cfg)
        self.shortcut = (
            Conv(cin, cout, window=1, stride=stride, param_dtype=pd, rngs=rngs)
            if stride != 1 or cin != cout
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.norm1(self.conv1(x)))
        h = self.norm2(self.conv2(h))
        skip = self.shortcut(x) if self.shortcut is not None else x
        return jax.nn.relu(h + skip)


class ConvNet(nnx.Module):
    """ResNet-style classifier; ``model(images [N, H, W, C]) -> logits [N, classes]``.

    Example::

        >>> with nnx.use_eager_sharding(False):
        ...     model = ConvNet(ConvNetConfig(), rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((2, 16, 16, 3))).shape
        (2, 10)
    """

    def __init__(self, cfg: ConvNetConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = cfg.param_dtype
        self.stem = Conv(cfg.channels, cfg.stem, param_dtype=pd, rngs=rngs)
        self.stem_norm = _norm("group", cfg.stem, cfg)
        blocks = []
        cin = cfg.stem
        for i, (width, n, norm) in enumerate(zip(cfg.widths, cfg.blocks, cfg.norms, strict=True)):
            for j in range(n):
                stride = 2 if i > 0 and j == 0 else 1
                blocks.append(ResBlock(cin, width, stride=stride, norm=norm, cfg=cfg, rngs=rngs))
                cin = width
        self.blocks = nnx.List(blocks)
        self.head = lyr.param(
            rngs, lyr.fan_in_init(cin), (cin, cfg.classes), ("embed", "classes"), pd
        )
        self.head_bias = lyr.param(
            rngs, jax.nn.initializers.zeros, (cfg.classes,), ("classes",), pd
        )

    def __call__(self, images: jax.Array) -> jax.Array:
        x = images.astype(self.cfg.dtype)
        x = jax.nn.relu(self.stem_norm(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        x = jnp.mean(x, axis=(1, 2))
        return x @ self.head[...].astype(x.dtype) + self.head_bias[...]


IMAGE_AXES: dict[str, tuple[str | None, ...]] = {
    "images": ("batch", "height", "width", "channels"),
    "labels": ("batch",),
}
"""Logical axis names of the image-classification batch fields."""


def image_batch(cfg: ConvNetConfig, batch_size: int, rng: np.random.Generator | None) -> dict:
    """Random ``images`` (float32 NHWC) and integer ``labels``.

    Args:
      cfg: the model config (image size, channels, classes).
      batch_size: global batch size.
      rng: numpy generator; ``None`` gives ``jax.ShapeDtypeStruct`` s.
    """
    shape = (batch_size, cfg.image_size, cfg.image_size, cfg.channels)
    if rng is None:
        return {
            "images": jax.ShapeDtypeStruct(shape, jnp.float32),
            "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        }
    return {
        "images": rng.standard_normal(shape, dtype=np.float32),
        "labels": rng.integers(0, cfg.classes, size=(batch_size,), dtype=np.int32),
    }


def convnet_loss(model: nnx.Module, batch: dict) -> jax.Array:
    """Mean softmax cross-entropy of the class logits (updates BatchNorm stats in train mode)."""
    return sknn.cross_entropy(model(batch["images"]), batch["labels"])


CONFIGS: dict[str, Any] = {
    "tiny": ConvNetConfig,
    "small": lambda: ConvNetConfig(
        image_size=32,
        stem=32,
        widths=(32, 64, 128),
        blocks=(2, 2, 2),
        norms=("group", "batch", "batch"),
        groups=8,
    ),
    "resnet18ish": lambda: ConvNetConfig(
        image_size=224,
        stem=64,
        widths=(64, 128, 256, 512),
        blocks=(2, 2, 2, 2),
        norms=("batch", "group", "batch", "group"),
        groups=32,
        classes=1000,
    ),
}
"""ConvNet sizes: ``tiny`` compiles in seconds on CPU; ``resnet18ish`` has ResNet-18's
widths and depth on 224x224 images with 1000 classes (3x3 stem, no max-pool)."""
