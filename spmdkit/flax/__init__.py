"""flax: describe an NNX or linen model abstractly; create its parameters sharded.

``describe`` reads a model's parameters, logical axis names and loss without
allocating anything (it never imports the planner); ``annotate`` places
parameters with a plan's shardings.
"""

from spmdkit.flax.describe import (
    ModelError,
    ModelInfo,
    ParamInfo,
    describe,
    init_sharded,
    path_str,
    shard,
)

__all__ = ["ModelError", "ModelInfo", "ParamInfo", "describe", "init_sharded", "path_str", "shard"]
