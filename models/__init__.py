"""Reference flax models with logical axis names and no sharding code.

Every model is described by a :class:`ModelSpec` in :data:`MODELS`: ``"gpt"``
(GPT-2), ``"llama"`` (Llama-3 style, GQA, optional stacked/scanned layers),
``"moe"`` (Mixtral style, top-k routed experts stacked on an ``expert`` axis,
GShard's capacity form), ``"deepseek"`` (DeepSeek-V2/V3 style: MLA attention, dense
first layers, dropless routed + shared experts), ``"qwen3_moe"`` (GQA with qk-norm,
dropless routed experts; also GPT-OSS 120B's and Mixtral 8x7B's dims),
``"convnet"`` (ResNet style, GroupNorm and BatchNorm) and ``"gpt_linen"`` (GPT-2 in
flax linen, wrapped as NNX).

Logical axis names
    Parameters name their dims with :data:`PARAM_AXES` (``vocab``, ``embed``,
    ``mlp``, ``heads``, ``kv_heads``, ``head_dim``, ``q_lora``, ``kv_lora``,
    ``expert``, ``layers``,
    ``norm``, ``pos``, ``conv_window``, ``conv_in``, ``conv_out``, ``classes``);
    batch fields name theirs with :data:`BATCH_AXES` (``batch``, ``seq``,
    ``height``, ``width``, ``channels``), listed per field in
    ``ModelSpec.batch_axes``. The names sit in flax's standard variable metadata
    ``out_sharding`` (``variable.get_metadata()["out_sharding"]``), so
    ``nnx.get_partition_spec(nnx.state(model))`` gives ``PartitionSpec`` s of
    logical names; :func:`param_axes` lists them by path. BatchNorm running
    statistics (``nnx.BatchStat``) carry names too.

Building without a mesh
    Flax 0.12 shards a variable with ``out_sharding`` metadata the moment it is
    created ("eager sharding") and refuses without a mesh. Build with it off;
    this works for real arrays and for abstract ones (no memory, seconds even for
    70B)::

        with nnx.use_eager_sharding(False):
            model = spec.build(spec.configs["tiny"](), nnx.Rngs(0))
            abstract = nnx.eval_shape(lambda: spec.build(cfg, nnx.Rngs(0)))

    :func:`abstract_model` does the second line. The metadata then records
    ``eager_sharding=False``; the names are unchanged.

Example::

    >>> spec = get_model("llama")
    >>> cfg = spec.configs["tiny"]()
    >>> with nnx.use_eager_sharding(False):
    ...     model = spec.build(cfg, nnx.Rngs(0))
    >>> loss = spec.loss(model, spec.batch(cfg, 4, np.random.default_rng(0)))
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from spmdkit.errors import SpmdError

from . import convnet, deepseek, gpt, gpt_linen, llama, moe, qwen3_moe
from .layers import BATCH_AXES, PARAM_AXES, ModelConfigError, count_params
from .routed import count_active_params

__all__ = [
    "ModelSpec",
    "MODELS",
    "get_model",
    "abstract_model",
    "param_axes",
    "count_params",
    "count_active_params",
    "PARAM_AXES",
    "BATCH_AXES",
    "UnknownModelError",
    "ModelConfigError",
]


class UnknownModelError(SpmdError, LookupError):
    """No model (or config) is registered under that name; the message lists the known ones.

    Broken example: ``get_model("lama")``.
    """


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything a planner, CLI or notebook needs to use one reference model.

    Attributes:
      name: the key in :data:`MODELS`.
      configs: config factories by size name; ``"tiny"`` compiles in seconds on
        CPU, the real sizes are only for abstract planning (:func:`abstract_model`).
      build: ``(config, rngs) -> nnx.Module`` (run it with eager sharding off).
      loss: ``(model, batch) -> scalar`` mean loss (MoE adds its auxiliary loss).
      batch: ``(config, global_batch_size, rng) -> dict`` of numpy arrays, or of
        ``jax.ShapeDtypeStruct`` when ``rng`` is None.
      batch_axes: batch field -> logical axis names of its dims.
    """

    name: str
    configs: dict[str, Callable[[], Any]]
    build: Callable[[Any, nnx.Rngs], nnx.Module]
    loss: Callable[[nnx.Module, dict], jax.Array]
    batch: Callable[[Any, int, np.random.Generator | None], dict]
    batch_axes: dict[str, tuple[str | None, ...]]

    def config(self, size: str) -> Any:
        """The config called ``size``; raises :class:`UnknownModelError` naming the sizes."""
        if size not in self.configs:
            raise UnknownModelError(
                op=f"models.{self.name}",
                must="the config be one of " + ", ".join(self.configs),
                given=repr(size),
                fix=_near(size, self.configs) or f"pick a size from {list(self.configs)}",
            )
        return self.configs[size]()


def _nnx_build(cls: type) -> Callable[[Any, nnx.Rngs], nnx.Module]:
    def build(cfg: Any, rngs: nnx.Rngs) -> nnx.Module:
        return cls(cfg, rngs=rngs)

    build.__name__ = f"build_{cls.__name__}"
    return build


MODELS: dict[str, ModelSpec] = {
    "gpt": ModelSpec(
        name="gpt",
        configs=gpt.CONFIGS,
        build=_nnx_build(gpt.GPT),
        loss=gpt.gpt_loss,
        batch=gpt.lm_batch,
        batch_axes=gpt.LM_BATCH_AXES,
    ),
    "llama": ModelSpec(
        name="llama",
        configs=llama.CONFIGS,
        build=_nnx_build(llama.Llama),
        loss=llama.llama_loss,
        batch=gpt.lm_batch,
        batch_axes=gpt.LM_BATCH_AXES,
    ),
    "moe": ModelSpec(
        name="moe",
        configs=moe.CONFIGS,
        build=_nnx_build(moe.MoE),
        loss=moe.moe_loss,
        batch=gpt.lm_batch,
        batch_axes=gpt.LM_BATCH_AXES,
    ),
    "deepseek": ModelSpec(
        name="deepseek",
        configs=deepseek.CONFIGS,
        build=_nnx_build(deepseek.DeepSeek),
        loss=deepseek.deepseek_loss,
        batch=gpt.lm_batch,
        batch_axes=gpt.LM_BATCH_AXES,
    ),
    "qwen3_moe": ModelSpec(
        name="qwen3_moe",
        configs=qwen3_moe.CONFIGS,
        build=_nnx_build(qwen3_moe.Qwen3MoE),
        loss=qwen3_moe.qwen3_moe_loss,
        batch=gpt.lm_batch,
        batch_axes=gpt.LM_BATCH_AXES,
    ),
    "convnet": ModelSpec(
        name="convnet",
        configs=convnet.CONFIGS,
        build=_nnx_build(convnet.ConvNet),
        loss=convnet.convnet_loss,
        batch=convnet.image_batch,
        batch_axes=convnet.IMAGE_AXES,
    ),
    "gpt_linen": ModelSpec(
        name="gpt_linen",
        configs=gpt.CONFIGS,
        build=gpt_linen.build,
        loss=gpt_linen.gpt_linen_loss,
        batch=gpt.lm_batch,
        batch_axes=gpt.LM_BATCH_AXES,
    ),
}
"""The reference models by name."""


def _near(name: str, known) -> str:
    match = difflib.get_close_matches(name, list(known), n=1)
    return f"did you mean {match[0]!r}?" if match else ""


def get_model(name: str) -> ModelSpec:
    """The :class:`ModelSpec` called ``name``.

    Raises:
      UnknownModelError: no such model; the message names the known ones.

    Example::

        >>> get_model("gpt").configs["124m"]().d_model
        768
    """
    if name not in MODELS:
        raise UnknownModelError(
            op="models.get_model",
            must="the model be one of " + ", ".join(MODELS),
            given=repr(name),
            fix=_near(name, MODELS) or f"pick a name from {list(MODELS)}",
        )
    return MODELS[name]


def abstract_model(name: str | ModelSpec, size: str | Any = "tiny", *, seed: int = 0):
    """The model built abstractly (``nnx.eval_shape``, eager sharding off): shapes,
    dtypes and logical names, no memory.

    Args:
      name: a model name or a :class:`ModelSpec`.
      size: a config name of that model, or a config object.
      seed: seed of the (abstract) ``nnx.Rngs``.

    Example::

        >>> count_params(abstract_model("llama", "8b"))
        8030261248
    """
    spec = name if isinstance(name, ModelSpec) else get_model(name)
    cfg = spec.config(size) if isinstance(size, str) else size
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: spec.build(cfg, nnx.Rngs(seed)))


def param_axes(model: nnx.Module) -> dict[tuple[Any, ...], tuple[str | None, ...] | None]:
    """Logical axis names of every variable (params and batch stats) by state path.

    A variable without names maps to ``None``.
    """
    return {
        path: (tuple(v.get_metadata().get("out_sharding") or ()) or None)
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat)))
    }
