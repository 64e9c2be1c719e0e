"""Rule-enforcing ops: plain JAX functions whose partitioning is the registered rule.

Each op reshards its inputs to the specs its rule requires, runs the local
computation with exactly the rule's collectives (``shard_map``; see
:mod:`spmdkit.ops.base`) and returns outputs that carry the rule's output specs;
``jax.grad`` through it yields the grad rule's specs. One module per family:
``norms``, ``cross_entropy``, ``embedding``, ``indexing`` (``index_put``),
``experts`` (``moe_experts``) and ``sdpa`` (scaled dot-product ``attention``);
no module shares a name with a function exported here.
"""

from spmdkit.ops.cross_entropy import softmax_cross_entropy
from spmdkit.ops.embedding import embedding_lookup
from spmdkit.ops.experts import moe_experts
from spmdkit.ops.indexing import index_put
from spmdkit.ops.norms import (
    batch_norm,
    fused_add_rms_norm,
    group_norm,
    instance_norm,
    layer_norm,
    rms_norm,
    sync_batch_norm,
)
from spmdkit.ops.sdpa import attention

__all__ = [
    "attention",
    "batch_norm",
    "embedding_lookup",
    "fused_add_rms_norm",
    "group_norm",
    "index_put",
    "instance_norm",
    "layer_norm",
    "moe_experts",
    "rms_norm",
    "softmax_cross_entropy",
    "sync_batch_norm",
]
