"""The registry: lookup, near matches, duplicate registration, user rules."""

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk


def test_builtin_families_registered():
    ops = sk.registered_ops()
    for op in ("add", "matmul", "dot_general", "einsum", "reduce_sum", "softmax", "where"):
        assert op in ops
    assert list(ops) == sorted(ops)


def test_unknown_op_names_near_matches():
    with pytest.raises(sk.NoRuleError, match="did you mean 'matmul'") as info:
        sk.get_rule("matmull")
    assert isinstance(info.value, LookupError)


def test_registering_twice_is_an_error():
    rule = sk.FactorRule(
        "t_scale", "... d, d -> ... d", impl=jnp.multiply, partial="MULTIPLICATIVE"
    )
    sk.register_rule(rule)
    try:
        with pytest.raises(sk.RegistrationError, match="registered once"):
            sk.register_rule(rule)
        with pytest.raises(sk.RegistrationError):
            sk.register_rule(sk.FactorRule("matmul", "m, m -> m", impl=jnp.add))
    finally:
        sk.unregister_rule("t_scale")
    assert "t_scale" not in sk.registered_ops()


def test_non_rule_is_refused():
    with pytest.raises(sk.RegistrationError):
        sk.register_rule(object())


def test_unknown_partial_policy_is_refused():
    with pytest.raises(sk.RegistrationError, match="partial is one of"):
        sk.FactorRule("t_bad", "a -> a", impl=jnp.negative, partial="LINEARISH")


def test_user_rule_infers_and_clears_cache():
    mesh = sk.abstract_mesh(x=4)
    x = sk.TensorSpec((8, 16), P("x", None))
    sk.register_rule(sk.FactorRule("t_rowscale", "r d, d -> r d", impl=jnp.multiply))
    try:
        res = sk.infer_forward("t_rowscale", x, sk.TensorSpec((16,)), mesh=mesh)
        assert str(res.outputs[0]) == "[8@x,16]"
    finally:
        sk.unregister_rule("t_rowscale")
    with pytest.raises(sk.NoRuleError):
        sk.infer_forward("t_rowscale", x, sk.TensorSpec((16,)), mesh=mesh)


def test_a_registry_change_hides_answers_cached_before_it():
    from spmdkit.engine.registry import generation

    mesh = sk.abstract_mesh(x=4)
    x = sk.TensorSpec((8, 16), P("x", None))
    before = generation()
    sk.register_rule(sk.FactorRule("t_swap", "r d -> r d", impl=jnp.negative))
    try:
        assert str(sk.infer_forward("t_swap", x, mesh=mesh).outputs[0]) == "[8@x,16]"
    finally:
        sk.unregister_rule("t_swap")
    assert generation() == before + 2
    sk.register_rule(sk.FactorRule("t_swap", "r d -> r d", impl=jnp.negative, need_replication="r"))
    try:
        assert str(sk.infer_forward("t_swap", x, mesh=mesh).outputs[0]) == "[8,16]"
    finally:
        sk.unregister_rule("t_swap")


def test_primitive_converters_are_held_by_the_registry_once():
    from spmdkit.engine.registry import generation, primitive_converter

    def conv(eqn):
        return ("tanh", {})

    before = generation()
    sk.register_primitive("t_prim", conv)
    try:
        assert primitive_converter("t_prim") is conv
        with pytest.raises(sk.RegistrationError, match="once"):
            sk.register_primitive("t_prim", conv)
        with pytest.raises(sk.RegistrationError, match="callable"):
            sk.register_primitive("t_other", "tanh")
    finally:
        assert sk.unregister_primitive("t_prim") is conv
    assert primitive_converter("t_prim") is None
    assert generation() == before + 2  # cached answers keyed on it see the change
    with pytest.raises(sk.NoRuleError):
        sk.unregister_primitive("t_prim")


def test_a_primitive_body_is_registered_with_the_registry():
    """``register_primitive(name, body=fn)``: the row check and the layer scan's FLOP
    count look inside a primitive that holds no body, through the registry alone."""
    import jax
    import jax.numpy as jnp
    from jax.extend.core import Primitive

    from spmdkit.pipeline.layer_scan import body_flops
    from spmdkit.pipeline.rows import mixed_rows

    prim = Primitive("t_opaque_matmul")
    prim.def_abstract_eval(lambda x, w: jax.core.ShapedArray((x.shape[0], w.shape[1]), x.dtype))

    def compute(x, w):
        return x @ w

    def body(eqn):
        args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
        return jax.make_jaxpr(compute)(*args)

    x, w = jnp.ones((8, 4)), jnp.ones((4, 16))
    closed = jax.make_jaxpr(lambda x, w: jnp.tanh(prim.bind(x, w)))(x, w)
    assert body_flops(closed) == 0  # opaque: nothing known inside
    assert mixed_rows(closed, [0, None])  # conservative: may combine rows
    sk.register_primitive("t_opaque_matmul", body=body)
    try:
        with pytest.raises(sk.RegistrationError, match="once"):
            sk.register_primitive("t_opaque_matmul", lambda eqn: ("tanh", {}))
        assert body_flops(closed) == 2 * 8 * 4 * 16
        assert not mixed_rows(closed, [0, None])  # a matmul keeps the rows apart
    finally:
        assert sk.unregister_primitive("t_opaque_matmul") is None
    assert body_flops(closed) == 0
    with pytest.raises(sk.RegistrationError, match="callable"):
        sk.register_primitive("t_nothing")
