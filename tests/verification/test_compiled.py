"""Compiled reports and prediction-vs-compiled verification."""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmdkit.propagation import propagate
from spmdkit.verification.compiled import CompiledReport, VerifyReport, executions, report, verify

S = jax.ShapeDtypeStruct
F32 = "float32"
PARAMS = {"w1": S((64, 128), F32), "w2": S((128, 32), F32)}
X = S((64, 64), F32)


def _loss(p, x):
    return jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"])


def _step(p, x):
    g = jax.grad(_loss)(p, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


def _args(mesh, pspec, xspec):
    auto = Mesh(mesh.devices, mesh.axis_names)
    p = {k: S(v.shape, v.dtype, sharding=NamedSharding(auto, pspec[k])) for k, v in PARAMS.items()}
    return p, S(X.shape, X.dtype, sharding=NamedSharding(auto, xspec))


def test_report_reads_collectives_memory_and_flops(mesh2d):
    rep = report(_step, *_args(mesh2d, {"w1": P(), "w2": P()}, P(("a", "b"))))
    assert isinstance(rep, CompiledReport)
    grads = (64 * 128 + 128 * 32) * 4
    assert rep.bytes_by_kind() == {"all_reduce": grads}
    assert rep.bytes_by_kind(backward=True) == {"all_reduce": grads}
    assert rep.bytes_by_kind(backward=False) == {}
    assert all(c.group_size == 8 for c in rep.collectives)
    assert rep.argument_bytes == grads + 64 * 64 * 4 // 8
    assert rep.peak_bytes == rep.argument_bytes + rep.output_bytes + rep.temp_bytes
    assert rep.flops is not None and rep.flops > 2 * 8 * 64 * 128
    assert "all_reduce" in str(rep)


def test_report_counts_loop_collectives_per_iteration(mesh1d):
    def f(w, h):
        return jax.lax.scan(lambda c, wl: (jnp.tanh(c @ wl), None), h, w)[0]

    auto = Mesh(mesh1d.devices, mesh1d.axis_names)
    w = S((3, 32, 32), F32, sharding=NamedSharding(auto, P(None, "x")))
    h = S((16, 32), F32, sharding=NamedSharding(auto, P(None, "x")))
    rep = report(f, w, h)
    assert [rep.runs(c) for c in rep.collectives] == [3] * len(rep.collectives)
    prop = propagate(
        f, S(w.shape, F32), S(h.shape, F32), in_specs=(P(None, "x"), P(None, "x")), mesh=mesh1d
    )
    assert verify(prop, rep, memory=False, by_kind=False).ok


def test_executions_multiplies_nested_trip_counts():
    text = "\n".join(
        [
            "%inner (p: f32[]) -> f32[] {",
            "  %ar = f32[4]{0} all-reduce(%p), replica_groups={}, to_apply=%add",
            "}",
            "%outer (p: f32[]) -> f32[] {",
            "  %w2 = f32[] while(%p), condition=%c, body=%inner, "
            'backend_config={"known_trip_count":{"n":"5"}}',
            "}",
            "ENTRY %main (p: f32[]) -> f32[] {",
            "  %w1 = f32[] while(%p), condition=%c, body=%outer, "
            'backend_config={"known_trip_count":{"n":"3"}}',
            "  %ag = f32[8]{0} all-gather(%p), replica_groups={}",
            "}",
        ]
    )
    runs = executions(text)
    assert runs["ar"] == 15
    assert runs["ag"] == 1


def test_verify_agrees_with_a_right_prediction(mesh2d):
    specs = ({"w1": P(None, "b"), "w2": P("b", None)}, P("a"))
    prop = propagate(_step, PARAMS, X, in_specs=specs, mesh=mesh2d)
    rep = report(_step, *_args(mesh2d, *specs))
    result = verify(prop, rep)
    assert isinstance(result, VerifyReport)
    assert result.ok, str(result)
    assert "verified: ok" in str(result)


def test_verify_flags_a_wrong_prediction(mesh2d):
    # predicted for replicated data, compiled for data-parallel: the grad all-reduce is missing
    prop = propagate(_step, PARAMS, X, in_specs=(None, None), mesh=mesh2d)
    rep = report(_step, *_args(mesh2d, {"w1": P(), "w2": P()}, P(("a", "b"))))
    result = verify(prop, rep)
    assert not result.ok
    assert any(m.startswith("all_reduce") for m in result.mismatches)
    assert "MISMATCH" in str(result)
    # compiled with the weights sharded too: a third of the predicted peak
    sharded = report(_step, *_args(mesh2d, {"w1": P(None, "b"), "w2": P("b", None)}, P("a")))
    off = verify(prop, sharded, by_kind=False)
    assert any(m.startswith("peak memory") for m in off.mismatches)


def test_verify_peak_memory_is_a_range():
    """Peak memory is predicted from recomputed (low) to materialized (high): a
    compiled peak within tolerance of any point of the range passes."""
    from types import SimpleNamespace

    def prop(low, high):
        return SimpleNamespace(
            comm_bytes_by_kind={},
            memory=SimpleNamespace(peak_bytes=low),
            memory_materialized=SimpleNamespace(peak_bytes=high),
        )

    def compiled(peak):
        return SimpleNamespace(bytes_by_kind=dict, peak_bytes=peak)

    inside = verify(prop(1000, 2000), compiled(1500))
    assert inside.ok and inside.ranges["peak memory"] == (1000, 2000)
    assert dict((r[0], r[1]) for r in inside.rows)["peak memory"] == 1500
    assert " – " in str(inside)  # the range is shown
    assert verify(prop(1000, 2000), compiled(2400)).ok  # within 20% of the high end
    assert verify(prop(1000, 2000), compiled(820)).ok  # within 20% of the low end
    above = verify(prop(1000, 2000), compiled(2600))
    assert not above.ok and "peak memory" in above.mismatches[0]
    assert not verify(prop(1000, 2000), compiled(790)).ok
    # without a materialized estimate the range is one point
    single = SimpleNamespace(comm_bytes_by_kind={}, memory=SimpleNamespace(peak_bytes=1000))
    assert verify(single, compiled(1200)).ok and not verify(single, compiled(1300)).ok
