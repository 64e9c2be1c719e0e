"""spmdkit.jaxprs reads every equation kind the same way on every supported jax,
and no other module reads control-flow parameters itself."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from spmdkit import jaxprs

ROOT = Path(__file__).resolve().parents[1]

#: Parameters of scan, while, cond, jit, custom_jvp/vjp, remat and shard_map whose
#: names or forms changed between jax releases, or may.
CONTROL_KEYS = frozenset(
    [
        "num_consts",
        "num_carry",
        "jaxpr",
        "call_jaxpr",
        "fun_jaxpr",
        "branches",
        "cond_jaxpr",
        "body_jaxpr",
        "cond_nconsts",
        "body_nconsts",
        "ft_in",
        "ft_out",
        "length",
        "reverse",
        "unroll",
        "in_specs",
        "out_specs",
        "manual_axes",
        "newly_manual_axes",
    ]
)
_KEYS = "|".join(sorted(CONTROL_KEYS))
_ACCESS = re.compile(
    rf"""\[\s*["']({_KEYS})["']\s*\]|\.get\(\s*["']({_KEYS})["']|\.params\.values\(\)"""
)


def control_param_reads(text: str) -> list[str]:
    """The control-flow parameter reads in a source text (one line each)."""
    return [line.strip() for line in text.splitlines() if _ACCESS.search(line)]


def test_the_checker_finds_direct_reads():
    planted = 'nc = eqn.params["num_consts"]\np = e.params\nk = p.get("num_carry")\n'
    planted += "for v in eqn.params.values():\n    pass\nx = cfg['width']\n"
    planted += "for k in params.values():\n    pass\n"
    assert len(control_param_reads(planted)) == 3


def test_no_module_but_jaxprs_reads_control_flow_params():
    found = []
    for folder in ("spmdkit", "rules", "models"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "jaxprs.py" and path.parent.name == "spmdkit":
                continue
            for line in control_param_reads(path.read_text()):
                found.append(f"{path.relative_to(ROOT)}: {line}")
    assert found == [], "read these through spmdkit.jaxprs:\n" + "\n".join(found)


def _eqn(jaxpr, name):
    return next(e for e, _ in jaxprs.walk_eqns(jaxpr) if e.primitive.name == name)


def test_scan_parts():
    w = jnp.ones(3)

    def f(c, xs):
        return jax.lax.scan(lambda c, x: (c * w[0] + x, jnp.tanh(c)), c, xs)

    closed = jax.make_jaxpr(f)(1.0, jnp.ones(5))
    sc = jaxprs.scan(_eqn(closed, "scan"))
    assert (sc.num_consts, sc.num_carry, sc.num_xs, sc.length) == (1, 1, 1, 5)
    assert sc.first_xs == 2 and not sc.reverse
    assert len(sc.jaxpr.invars) == 3
    back = jax.make_jaxpr(jax.grad(lambda c: f(c, jnp.ones(5))[1].sum()))(1.0)
    scans = [jaxprs.scan(e) for e, _ in jaxprs.walk_eqns(back) if e.primitive.name == "scan"]
    assert any(s.reverse for s in scans) and all(s.length == 5 for s in scans)


def test_while_cond_and_calls():
    w = jnp.ones(3)
    closed = jax.make_jaxpr(
        lambda x: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * w[0]), (0, x))
    )(1.0)
    loop = jaxprs.while_loop(_eqn(closed, "while"))
    assert (loop.cond_nconsts, loop.body_nconsts) == (0, 1)
    assert hasattr(jaxprs.open_jaxpr(loop.body)[0], "eqns")

    closed = jax.make_jaxpr(lambda p, x: jax.lax.cond(p, lambda x: x * w[0], lambda x: x, x))(
        True, 1.0
    )
    assert len(jaxprs.cond_branches(_eqn(closed, "cond"))) == 2

    @jax.custom_vjp
    def double(x):
        return x * 2

    double.defvjp(lambda x: (x * 2, None), lambda _, g: (g * 2,))
    closed = jax.make_jaxpr(lambda x: jax.checkpoint(lambda y: jnp.sin(jax.jit(double)(y)))(x) * w)(
        jnp.ones(3)
    )
    names = [e.primitive.name for e, _ in jaxprs.walk_eqns(closed)]
    called = [e for e, _ in jaxprs.walk_eqns(closed) if jaxprs.call_body(e) is not None]
    assert {"sin", "mul"} <= set(names)
    assert len(called) == 3  # checkpoint, jit, custom_vjp_call
    for eqn in called:
        inner, consts = jaxprs.open_jaxpr(jaxprs.call_body(eqn))
        assert len(inner.invars) == len(eqn.invars)
        assert len(consts) == len(inner.constvars)


def test_walk_counts_scan_trips():
    def f(x):
        def outer(c, _):
            c, _ = jax.lax.scan(lambda c, _: (jnp.sin(c), None), c, None, length=3)
            return c, None

        return jax.lax.scan(outer, x, None, length=4)[0]

    closed = jax.make_jaxpr(f)(1.0)
    assert [t for e, t in jaxprs.walk_eqns(closed) if e.primitive.name == "sin"] == [12]


def test_shard_map_parts():
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    f = jax.shard_map(
        lambda y: y * 2, mesh=mesh, in_specs=jax.P("a"), out_specs=jax.P("a"), axis_names={"a"}
    )
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((4, 8)), jax.P("a"))
        closed = jax.make_jaxpr(f)(x)
    eqn = _eqn(closed, "shard_map")
    assert jaxprs.manual_axes(eqn) == {"a"}
    ins, outs = jaxprs.shard_map_specs(eqn)
    assert ins[-1] == jax.P("a") and outs == (jax.P("a"),)
    assert hasattr(jaxprs.open_jaxpr(jaxprs.shard_map_body(eqn))[0], "eqns")
