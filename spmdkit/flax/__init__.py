"""flax: describe an NNX or linen model abstractly; create its parameters sharded.

``describe`` reads a model's parameters, logical axis names and loss without
allocating anything (it never imports the planner); ``annotate`` places
parameters with a plan's shardings (``init_sharded``, ``shard``).
"""

from spmdkit.flax.describe import (
    ModelError,
    ModelInfo,
    ParamInfo,
    describe,
    path_str,
    variable_names,
    variable_value,
)

# After ``describe``: ``annotate`` imports the planner, which imports ``describe``.
from spmdkit.flax.annotate import init_sharded, shard  # isort: skip

__all__ = [
    "ModelError",
    "ModelInfo",
    "ParamInfo",
    "describe",
    "init_sharded",
    "path_str",
    "shard",
    "variable_names",
    "variable_value",
]
