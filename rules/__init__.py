"""The built-in rule library, one module per op family.

Each module exposes ``RULES``; the registry registers them on first use.
"""

#: Rule family modules, in registration order.
FAMILIES = (
    "elementwise",
    "matmul",
    "reduction",
    "softmax",
    "norms",
    "cross_entropy",
    "embedding",
    "index_put",
    "shape",
    "attention",
    "moe",
    "pooling",
    "ragged",
)
