"""propagation.regions: a composite op's region laid out whole by its rule, its
strategies priced (reshards plus the op's own collectives) and the cheapest chosen."""

import jax
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.propagation import propagate
from spmdkit.region import region_call

MESH = sk.abstract_mesh(a=2, b=4)
X = jax.ShapeDtypeStruct((8, 16), "float32")
W = jax.ShapeDtypeStruct((16,), "float32")


def _norm_grad(**attrs):
    def loss(x, w):
        return (region_call("rms_norm", (x, w), attrs) ** 2).sum()

    return jax.grad(loss, argnums=(0, 1))


def test_a_sharded_normalized_dim_picks_sharded_stats():
    prop = propagate(_norm_grad(), X, W, in_specs=(P("a", "b"), P()), mesh=MESH)
    assert prop.region_strategies() == {
        "rms_norm": {"sharded_stats": 1},
        "rms_norm:grad": {"sharded_stats": 1},
    }
    # forward: one row-statistic all-reduce (4 local rows); the grad region: the
    # recomputed forward's, the backward's, and the scale grad's sum over the rows
    kinds = [(c.kind, c.axes, c.payload_bytes) for c in prop.collectives()]
    assert sorted(kinds) == sorted(
        [("all_reduce", ("b",), 16)] * 3 + [("all_reduce", ("a",), 4 * 4)]
    )
    assert "ops (strategy): rms_norm sharded_stats, rms_norm:grad sharded_stats" in str(prop)


def test_batch_sharded_rows_keep_the_reference_strategy():
    prop = propagate(_norm_grad(), X, W, in_specs=(P("a"), P()), mesh=MESH)
    assert prop.region_strategies()["rms_norm"] == {"default": 1}
    # only the scale grad's sum over the batch axis moves: 16 floats
    assert [(c.kind, c.payload_bytes) for c in prop.collectives()] == [("all_reduce", 64)]


def test_a_fixed_strategy_is_kept_and_priced():
    for fixed in ({"strategy": "default"}, {}):
        kw = {"strategies": {"rms_norm": "default"}} if not fixed else {}
        prop = propagate(_norm_grad(**fixed), X, W, in_specs=(P("a", "b"), P()), mesh=MESH, **kw)
        assert prop.region_strategies()["rms_norm"] == {"default": 1}
        # the normalized dim is gathered: the activations move, 4 rows × 16 floats
        assert prop.comm_bytes_by_kind["all_gather"] >= 4 * 16 * 4


def test_a_partial_operand_is_resolved_before_the_region():
    def f(x, w):
        return region_call("rms_norm", (x @ w.T, w[0, :8]), {})

    w = jax.ShapeDtypeStruct((8, 16), "float32")
    prop = propagate(f, X, w, in_specs=(P(None, "b"), P(None, "b")), mesh=MESH)
    (rec,) = [r for r in prop.records if r.primitive == "spmdkit_op"]
    assert not any(s.partial for s in rec.inputs) and not rec.outputs[0].partial
    assert [c.kind for c in rec.collectives()] == ["all_reduce"]  # the product, once
