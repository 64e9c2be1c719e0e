"""A fuzzed public API: random inputs to the public entry points either succeed
(and are then checked: shapes against the unsharded op, values against the
source) or fail with a typed :class:`spmdkit.SpmdError` saying op / must / given
/ fix. A raw jax, numpy, orbax or python error is a failure.

Each check runs twice: a short run in the default suite and a long one under
``-m slow``; together CI runs well over 1,000 cases (``FUZZ_EXAMPLES``). The seed
is random per run, printed with any failure, and fixed with
``SPMDKIT_FUZZ_SEED=<seed>``. Inputs that once raised a raw error are kept as
explicit regression tests at the end.
"""

import functools
import itertools
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, seed, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.errors import SpmdError
from spmdkit.mesh import abstract_mesh
from spmdkit.planner import LogicalRules
from spmdkit.runtime.checkpoint import Manager
from spmdkit.runtime.data import ShardedLoader

SEED = int(os.environ.get("SPMDKIT_FUZZ_SEED") or random.randrange(2**32))
_COMMON = {
    "deadline": None,
    "database": None,
    "print_blob": True,
    "suppress_health_check": list(HealthCheck),
}
MESH = abstract_mesh(a=2, b=4)
AXES = (None, None, "a", "b", ("a", "b"), ("b", "a"), "zz")
OPS = sorted(sk.registered_ops())

#: (default-suite cases, slow cases) per check; their sum is what one CI run tries.
FUZZ_EXAMPLES = {
    "tensor_spec": (60, 300),
    "inference": (80, 400),
    "plan_reshard": (50, 200),
    "logical_rules": (40, 150),
    "loader": (30, 120),
    "restore": (8, 40),
    "reshard": (3, 25),
    "plan": (0, 6),
}


def _typed(fn):
    """``fn()``'s value, or the SpmdError it raised after checking its four parts."""
    try:
        return fn(), None
    except SpmdError as e:
        for part in ("op", "must", "given", "fix"):
            assert isinstance(getattr(e, part), str) and getattr(e, part), (part, e)
        return None, e


def _tests(name, check):
    """The default-suite and slow tests of one check, with the seed in every report."""
    fast_n, slow_n = FUZZ_EXAMPLES[name]

    def body(data):
        note(f"fuzz seed {SEED} (rerun with SPMDKIT_FUZZ_SEED={SEED})")
        check(data)

    def make(n):
        test = given(st.data())(body)
        return seed(SEED)(settings(max_examples=n, **_COMMON)(test))

    fast = make(fast_n) if fast_n else pytest.mark.skip(reason="slow only")(make(1))
    return fast, pytest.mark.slow(make(slow_n))


# -- value types ------------------------------------------------------------------


def _dims(draw, n):
    return [draw(st.sampled_from(AXES)) for _ in range(n)]


def _spec_args(data, n):
    dims = _dims(data.draw, n)
    partial = data.draw(
        st.dictionaries(
            st.sampled_from(["a", "b", "zz"]),
            st.sampled_from(["sum", "avg", "max", "min", "prod"]),
            max_size=1,
        )
        if data.draw(st.integers(0, 4)) == 0
        else st.just({})
    )
    return P(*dims), partial


def _spec(data, shape):
    pspec, partial = _spec_args(data, len(shape))
    return sk.TensorSpec(tuple(shape), pspec, partial=partial)


def check_tensor_spec(data):
    shape = tuple(data.draw(st.lists(st.integers(-1, 12), max_size=4)))
    pspec, partial = _spec_args(data, len(shape))
    spec, _ = _typed(lambda: sk.TensorSpec(shape, pspec, partial=partial))
    if spec is not None:
        assert spec.shape == shape
        _typed(lambda: spec.validate(MESH, op="fuzz"))
        _typed(spec.to_partition_spec)
        again = sk.TensorSpec(shape, pspec, partial=partial)
        assert again == spec and hash(again) == hash(spec) and str(again) == str(spec)


# -- rule inference -----------------------------------------------------------------


def _perturbed_case(data, rule):
    ex = data.draw(st.sampled_from(rule.examples))
    shapes = [list(s) for s in ex.shapes]
    if shapes and data.draw(st.integers(0, 3)) == 0:
        i = data.draw(st.integers(0, len(shapes) - 1))
        if shapes[i] and data.draw(st.booleans()):
            shapes[i][data.draw(st.integers(0, len(shapes[i]) - 1))] = data.draw(st.integers(0, 9))
        else:
            shapes[i] = shapes[i][:-1] if shapes[i] else [3]
    attrs = dict(ex.attrs)
    if attrs and data.draw(st.integers(0, 4)) == 0:
        key = data.draw(st.sampled_from(sorted(attrs)))
        attrs[key] = data.draw(st.sampled_from([-1, 0, 99, None, "bogus", (0, 5)]))
    if data.draw(st.integers(0, 6)) == 0:
        attrs["strategy"] = data.draw(st.sampled_from(["bogus", *rule.strategies]))
    dtypes = ex.dtypes or ("float32",) * len(ex.shapes)
    return shapes, attrs, dtypes


def _reference_shapes(rule, shapes, dtypes, attrs):
    kw = {k: v for k, v in attrs.items() if k != "strategy"}
    try:
        out = jax.eval_shape(
            lambda *xs: rule.impl(*xs, **kw),
            *[
                jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d))
                for s, d in zip(shapes, dtypes, strict=False)
            ],
        )
    except Exception:  # the unsharded op rejects it too: nothing to compare
        return None
    return [tuple(o.shape) for o in jax.tree.leaves(out)]


def check_inference(data):
    op = data.draw(st.sampled_from(OPS))
    rule = sk.get_rule(op)
    if not rule.examples:
        return
    shapes, attrs, dtypes = _perturbed_case(data, rule)
    specs, err = _typed(
        lambda: [
            _spec(data, s).replace(dtype=jnp.dtype(d)) for s, d in zip(shapes, dtypes, strict=False)
        ]
    )
    if err is not None:
        return
    which = data.draw(st.sampled_from(["forward", "backward", "grad"]))
    want = _reference_shapes(rule, shapes, dtypes, attrs)
    if which == "forward":
        res, _ = _typed(lambda: sk.infer_forward(op, *specs, mesh=MESH, **attrs))
    else:
        outs, err = _typed(
            lambda: [_spec(data, s) for s in (want or [tuple(shapes[0])] if shapes else [()])]
        )
        if err is not None:
            return
        if which == "backward":
            res, _ = _typed(lambda: sk.infer_backward(op, *specs, outputs=outs, mesh=MESH, **attrs))
        else:
            res, _ = _typed(lambda: sk.infer_grad(op, *specs, out_grads=outs, mesh=MESH, **attrs))
    if res is not None and want is not None and which == "forward":
        assert [o.shape for o in res.outputs] == want, (op, shapes, attrs)


# -- resharding ---------------------------------------------------------------------


def check_plan_reshard(data):
    shape = data.draw(st.lists(st.integers(0, 16), min_size=0, max_size=3))
    src, e1 = _typed(lambda: _spec(data, shape))
    dst, e2 = _typed(lambda: _spec(data, shape))
    if e1 or e2:
        return
    plan, _ = _typed(lambda: sk.plan_reshard(src, dst, MESH))
    if plan is not None:
        assert plan.specs[0] == src and plan.specs[-1].dims == dst.dims


def check_reshard(data):
    mesh = sk.make_mesh(a=2, b=4)
    shape = data.draw(st.lists(st.sampled_from([0, 1, 2, 4, 8]), min_size=1, max_size=2))
    value = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    src = P(*_dims(data.draw, len(shape)))
    dst = P(*_dims(data.draw, len(shape)))
    x, err = _typed(lambda: sk.reshard(jax.device_put(value, NamedSharding(mesh, P())), src))
    if err is not None:
        return
    y, _ = _typed(lambda: sk.reshard(x, dst))
    if y is not None:
        assert y.shape == value.shape
        np.testing.assert_array_equal(np.asarray(y), value)


# -- planning -----------------------------------------------------------------------

LOGICAL = ["batch", "embed", "mlp", "heads", "kv", "vocab", "length", "bogus"]


def _table(data):
    entries = st.tuples(
        st.sampled_from(LOGICAL), st.sampled_from([None, "a", "b", ("a", "b"), "zz", 3])
    )
    return data.draw(st.lists(entries, max_size=6))


def check_logical_rules(data):
    table = _table(data)
    rules, err = _typed(lambda: LogicalRules.coerce(table))
    if err is not None:
        return
    names = tuple(data.draw(st.lists(st.sampled_from([*LOGICAL, None]), max_size=3)))
    shape = tuple(data.draw(st.integers(1, 16)) for _ in names)
    spec, _ = _typed(lambda: rules.resolve(names, shape, MESH))
    if spec is not None:
        assert len(spec) <= len(shape)


def check_plan(data):
    table = _table(data)
    spec = sk.models.get_model("gpt")
    _typed(lambda: sk.plan(spec, MESH, table, config="tiny", batch_size=8))


# -- data and checkpoints -----------------------------------------------------------


@functools.cache
def _batch_sharding():
    return NamedSharding(sk.make_mesh(a=2, b=4), P("a"))


_FIELD = st.one_of(
    st.integers(0, 6).map(lambda n: np.arange(n, dtype=np.float32)),
    st.integers(0, 6).map(lambda n: np.ones((n, 3), np.int32)),
    st.integers(0, 6).map(lambda n: [f"s{i}" for i in range(n)]),
    st.integers(0, 6).map(lambda n: np.array(["x"] * n)),
    st.sampled_from([None, 3, "text", b"raw", 2.5]),
    st.integers(0, 4).map(lambda n: {"inner": np.zeros(n, np.float32)}),
)


def check_loader(data):
    source = data.draw(st.dictionaries(st.sampled_from(["x", "y", "ids", "m"]), _FIELD, max_size=3))
    kw = {
        "batch_size": data.draw(st.sampled_from([None, 0, 1, 2, 4, -1, 2.5])),
        "last_batch": data.draw(st.sampled_from(["drop", "pad", "keep", "bogus"])),
    }
    if data.draw(st.booleans()):
        kw["bucket_sizes"] = data.draw(st.sampled_from([(2, 4), (), None, (0,)]))
        kw["bucket_dims"] = data.draw(st.sampled_from([{"x": 0}, {"y": (0, 1)}, None, {"x": -1}]))
    generic = data.draw(st.booleans())
    src = (lambda: iter([source, source])) if generic else source
    loader, _ = _typed(lambda: ShardedLoader(src, _batch_sharding(), **kw))
    if loader is None:
        return
    batches, _ = _typed(lambda: list(itertools.islice(loader, 2)))
    for b in batches or []:
        for arr in jax.tree.leaves(b):
            if isinstance(arr, jax.Array):
                assert arr.shape[0] >= 0 and np.asarray(arr).shape == arr.shape


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz_ckpt")
    mesh = sk.make_mesh(a=2, b=4)
    state = {
        "params": {
            "w": jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("a", "b"))),
            "z": jnp.zeros((0, 4)),
        },
        "step": jnp.int32(3),
    }
    with Manager(d, async_=False) as mgr:
        mgr.save(1, state)
    return d, state, mesh


def _restore_target(data, state, mesh):
    def leaf(x):
        shape = tuple(x.shape)
        if data.draw(st.integers(0, 5)) == 0:
            shape = (*shape, 2) if data.draw(st.booleans()) else shape[:-1]
        dtype = data.draw(st.sampled_from([x.dtype, x.dtype, jnp.bfloat16, jnp.int8]))
        axes = data.draw(st.permutations(["a", "b", *[None] * len(shape)]))
        dims = axes[: len(shape)]
        sharding = data.draw(
            st.sampled_from([NamedSharding(mesh, P(*dims)), NamedSharding(mesh, P()), None])
        )
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    target = jax.tree.map(leaf, state)
    if data.draw(st.booleans()):
        target["params"].pop(data.draw(st.sampled_from(sorted(target["params"]))))
    if data.draw(st.integers(0, 3)) == 0:
        target["extra"] = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=NamedSharding(mesh, P()))
    return target


def _check_restore(data, saved_checkpoint):
    d, state, mesh = saved_checkpoint
    target = _restore_target(data, state, mesh)
    kw = {"partial": data.draw(st.booleans()), "allow_cast": data.draw(st.booleans())}
    if data.draw(st.integers(0, 3)) == 0:
        kw["items"] = data.draw(st.sampled_from([("params",), ("nope",), "params"]))
    step = data.draw(st.sampled_from([None, 1, 7]))
    out, _ = _typed(lambda: Manager(d).restore(step, target=target, **kw))
    if out is not None:
        got = sk.checkpoint.tree_paths(out.state)
        for path, x in sk.checkpoint.tree_paths(state).items():
            if path in got and got[path].dtype == x.dtype:
                np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(x))


# -- the tests ----------------------------------------------------------------------

test_tensor_spec, test_tensor_spec_slow = _tests("tensor_spec", check_tensor_spec)
# its default-size run is among the suite's costliest: it runs in the slow step too
test_tensor_spec = pytest.mark.slow(test_tensor_spec)
test_inference, test_inference_slow = _tests("inference", check_inference)
test_plan_reshard, test_plan_reshard_slow = _tests("plan_reshard", check_plan_reshard)
test_reshard, test_reshard_slow = _tests("reshard", check_reshard)
test_logical_rules, test_logical_rules_slow = _tests("logical_rules", check_logical_rules)
test_plan, test_plan_slow = _tests("plan", check_plan)
test_loader, test_loader_slow = _tests("loader", check_loader)


def _restore_tests():
    fast_n, slow_n = FUZZ_EXAMPLES["restore"]

    def make(n):
        @seed(SEED)
        @settings(max_examples=n, **_COMMON)
        @given(data=st.data())
        def test(saved_checkpoint, data):
            note(f"fuzz seed {SEED} (rerun with SPMDKIT_FUZZ_SEED={SEED})")
            _check_restore(data, saved_checkpoint)

        return test

    return make(fast_n), pytest.mark.slow(make(slow_n))


test_restore, test_restore_slow = _restore_tests()


def test_ci_runs_at_least_a_thousand_cases():
    assert sum(fast + slow for fast, slow in FUZZ_EXAMPLES.values()) >= 1000


# -- regressions: inputs that once raised a raw error -------------------------------


def test_regression_cast_to_a_non_dtype_is_typed():
    x = sk.TensorSpec((8, 8), P(None, "b"), partial={"a": "sum"}, dtype=jnp.float32)
    with pytest.raises(sk.ShardingConflictError, match="Cannot interpret"):
        sk.infer_forward("convert_element_type", x, mesh=MESH, new_dtype=-1)


def test_regression_a_rule_table_entry_with_a_number_is_typed():
    with pytest.raises(sk.PlanError, match="mesh axes"):
        LogicalRules.coerce([("batch", 3)])
    with pytest.raises(sk.PlanError, match="pair"):
        LogicalRules.coerce([("batch",)])


def test_regression_loader_sources_and_scalars_are_typed_or_work():
    with pytest.raises(SpmdError, match="sequence of examples"):
        ShardedLoader({"x": 3}, _batch_sharding(), batch_size=2)
    # a per-batch scalar array: with one batch sharding it is refused (a scalar has
    # no batch dim), with its own it works (micro-batches are the step's, not the
    # loader's: sk.value_and_grad splits the rows)
    batches = lambda: iter([{"x": np.ones((4, 2)), "t": np.array(2, np.float32)}])  # noqa: E731
    with pytest.raises(SpmdError, match="rank"):
        list(ShardedLoader(batches, _batch_sharding()))
    mesh = _batch_sharding().mesh
    sh = {"x": _batch_sharding(), "t": NamedSharding(mesh, P())}
    (b,) = list(ShardedLoader(batches, sh))
    assert b["x"].shape == (4, 2) and float(np.asarray(b["t"])) == 2.0
