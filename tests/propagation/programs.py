"""Small programs and helpers the propagation tests share."""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk

S = jax.ShapeDtypeStruct
F32 = "float32"


def mlp_loss(p, x, y):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    o = h @ p["w2"]
    return jnp.mean((o - y) ** 2)


def sgd_step(p, x, y):
    g = jax.grad(mlp_loss)(p, x, y)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


def mlp_forward(p, x):
    return jax.nn.relu(x @ p["w1"]) @ p["w2"]


PARAMS = {"w1": S((64, 128), F32), "b1": S((128,), F32), "w2": S((128, 32), F32)}
X = S((64, 64), F32)
Y = S((64, 32), F32)


def as_auto(mesh):
    """The mesh with Auto axes (what ``jit`` compiles for)."""
    return Mesh(mesh.devices, mesh.axis_names)


def sharded(tree, specs, mesh):
    """ShapeDtypeStructs with NamedShardings on an Auto mesh (what jit compiles for)."""
    return jax.tree.map(
        lambda a, s: S(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        tree,
        specs,
        is_leaf=lambda s: isinstance(s, P),
    )


def all_reduce_bytes(fn, args, specs, mesh):
    """All-reduce payload bytes of ``fn`` compiled with ``specs`` on ``mesh``."""
    cols = sk.compiled_collectives(fn, *sharded(args, specs, as_auto(mesh)))
    return sk.summarize(cols).get("all_reduce", {}).get("payload_bytes", 0)


def compiled_report(fn, args):
    """The compiled-HLO report of ``fn`` on (sharded) abstract ``args``."""
    from spmdkit.verification.compiled import report

    return report(fn, *args)
