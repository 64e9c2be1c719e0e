"""introspect: describe a model (NNX, linen, or a params pytree) abstractly.

``describe`` reads a model's parameters, logical axis names and loss without
allocating anything. Nothing in this package imports the planner: the planner
reads models through it. Placing a model's parameters with a plan's shardings
(``init_sharded``, ``shard``) is :mod:`spmdkit.compile.annotate`'s job.
"""

from spmdkit.introspect.model import (
    ModelError,
    ModelInfo,
    ParamInfo,
    describe,
    path_str,
    variable_names,
    variable_value,
)

__all__ = [
    "ModelError",
    "ModelInfo",
    "ParamInfo",
    "describe",
    "path_str",
    "variable_names",
    "variable_value",
]
