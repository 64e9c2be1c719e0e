"""Every registered rule through the same checks (adding a rule adds its tests).

* numeric sweep, forward and grad, on the 1-D (x=4) and 2-D (a=2, b=4) meshes,
  even shapes and uneven ones (padded blocks);
* jit check: compiled HLO collectives equal the predicted ones.

Each check runs twice over: a sample (``[<op>-sample]``) and the full sample in the
slow step (``[<op>-full]``, ``python -m pytest -m slow``). The default run has every
sample sweep of the quick ops and two of the five of every other op, rotated over the
ops (:func:`in_default_run`; the slow step runs the rest). In the slow step CI
runs the full sweeps (and the 2 x 3 mesh's) of every twelfth op of each family
(tests/conftest.py, ``SWEEP_EVERY``; ``SPMDKIT_FULL_SWEEP=1`` runs every op's). The
rules of jax primitives the library has no op for (each family's ``PRIMITIVE_RULES``:
``cumsum``, ``floor``, ``scatter-add``…) are sampled further: the sample sweeps of
every sixteenth of each family run in the slow step, the rest only under
``SPMDKIT_FULL_SWEEP=1`` (``PRIMITIVE_EVERY``). The sweeps
spend their time compiling: the unsharded reference per example (shared by an op's
sweeps, which run one after another) and one program per example and sweep whose
size grows with the sample.
"""

import dataclasses
import math

import numpy as np
import pytest
from jax import lax

import spmdkit as sk
from spmdkit.rules.index_put import scatter_example
from spmdkit.rules.moe import experts_example
from spmdkit.rules.pooling import window_map
from spmdkit.testing import check_jit, check_rule

OPS = sk.registered_ops()

#: The ops whose sweeps the quick loop (``python -m pytest --quick``) runs: one per rule
#: family, the factor-notation rules and hand-written ones. The others' are ``heavy``.
QUICK_OPS = frozenset(
    [
        "add",
        "matmul",
        "reduce_sum",
        "softmax",
        "layer_norm",
        "embedding",
        "index_put",
        "reshape",
        "ragged_dot_general",
    ]
)

#: The default run's costliest sample sweeps, by test and op: they run in the slow
#: step, which also runs the op's full sweep; the op's other sample sweeps stay.
SLOW_SAMPLES = {
    "test_numeric_sweep_1d": frozenset(
        {
            "log_softmax",
            "moe_experts",
            "ragged_dot_general",
            "reduce_mean",
            "reduce_min",
            "reduce_prod",
            "reduce_window_min",
            "softmax",
        }
    ),
    "test_numeric_sweep_2d": frozenset(
        {"add_n", "log_softmax", "moe_experts", "ragged_dot_general", "sync_batch_norm"}
    ),
    "test_uneven_sweep_1d": frozenset(
        {"log_softmax", "moe_experts", "reduce_prod", "relu", "softmax", "softmax_cross_entropy"}
    ),
    "test_uneven_sweep_2d": frozenset({"sync_batch_norm"}),
}


#: The op sweeps, in the order :func:`in_default_run` rotates them over the ops.
SWEEPS = (
    "test_numeric_sweep_1d",
    "test_numeric_sweep_2d",
    "test_uneven_sweep_1d",
    "test_uneven_sweep_2d",
    "test_jit_collectives_match_prediction",
)
#: Of the :data:`SWEEPS`, the sample sweeps of an op outside :data:`QUICK_OPS` that the
#: default run keeps; its others run in the slow step.
DEFAULT_SWEEPS = 2


def in_default_run(op: str, test: str) -> bool:
    """Whether ``test``'s sample sweep of ``op`` runs in the default run: all of a
    :data:`QUICK_OPS` op's, none in :data:`SLOW_SAMPLES`, and of every other op
    :data:`DEFAULT_SWEEPS` of its other :data:`SWEEPS`, rotated by the op's place in
    the registry (the next op keeps the next ones), so each sweep runs for about
    ``DEFAULT_SWEEPS / len(SWEEPS)`` of the ops and every op keeps a numeric check
    or its compiled collectives in the default run. The README's test command holds
    its 5-minute budget on 2 cores so; the slow step runs the rest."""
    if op in SLOW_SAMPLES.get(test, frozenset()):
        return False
    if op in QUICK_OPS or test not in SWEEPS:
        return True
    left = [t for t in SWEEPS if op not in SLOW_SAMPLES.get(t, frozenset())]
    first = OPS.index(op) % len(left)
    return test in (left + left)[first : first + DEFAULT_SWEEPS]


def pytest_generate_tests(metafunc):
    """``op``: every registered op, a module-scoped parameter, so pytest runs each op's
    checks one after another (on one xdist worker, mostly), reusing its compiled
    reference; marked ``heavy`` outside :data:`QUICK_OPS` and ``slow`` where the test's
    sample sweep of it is not :func:`in_default_run`."""
    if "op" not in metafunc.fixturenames:
        return
    test = metafunc.function.__name__
    params = []
    for op in OPS:
        marks = [] if op in QUICK_OPS else [pytest.mark.heavy]
        if not in_default_run(op, test):
            marks.append(pytest.mark.slow)
        params.append(pytest.param(op, marks=marks))
    metafunc.parametrize("op", params, scope="module")


def test_the_tier_data_names_tests_and_ops_that_exist():
    """:data:`SLOW_SAMPLES` and :data:`QUICK_OPS` name this module's tests and registered
    ops: a renamed test or op would otherwise change tier silently."""
    tests = {name for name in globals() if name.startswith("test_")}
    assert set(SLOW_SAMPLES) <= tests, set(SLOW_SAMPLES) - tests
    assert set(SWEEPS) <= tests, set(SWEEPS) - tests
    # every op keeps a sweep in the default run
    assert all(any(in_default_run(op, t) for t in SWEEPS) for op in OPS)
    named = QUICK_OPS.union(*SLOW_SAMPLES.values())
    assert named <= set(OPS), named - set(OPS)


def _sizes(sample, full):
    """The sweep's sample sizes: ``sample`` in the default run, ``full`` under ``slow``
    (a ``full_sweep``: tests/conftest.py runs a sample of them in CI)."""
    return pytest.mark.parametrize(
        "size",
        [
            pytest.param(sample, id="sample"),
            pytest.param(full, id="full", marks=[pytest.mark.slow, pytest.mark.full_sweep]),
        ],
    )


def _even_examples(op):
    """The rule's examples on even shapes (uneven ones have their own sweeps below);
    None (the rule's own list) when it has no even example."""
    even = [e for e in sk.get_rule(op).examples if not e.uneven]
    return even or None


@_sizes((8, 3), (24, 8))
def test_numeric_sweep_1d(op, size, mesh1d):
    cases, grad_cases = size
    report = check_rule(
        op,
        mesh=mesh1d,
        examples=_even_examples(op),
        max_cases=cases,
        max_grad_cases=grad_cases,
        missing=False,
    )
    assert report.ok, str(report)
    assert not report.replicated, str(report)
    assert report.forward_cases > 0


@_sizes((8, 3), (20, 8))
def test_numeric_sweep_2d(op, size, mesh2d):
    cases, grad_cases = size
    report = check_rule(
        op,
        mesh=mesh2d,
        examples=_even_examples(op),
        max_cases=cases,
        max_grad_cases=grad_cases,
        missing=False,
        seed=1,
    )
    assert report.ok, str(report)


@_sizes(2, 3)
def test_jit_collectives_match_prediction(op, size, mesh2d):
    report = check_jit(op, mesh=mesh2d, max_cases=size)
    assert report.ok, str(report)


def _uneven_examples(rule):
    """The rule's uneven examples; for a factor rule without any, its examples
    with every dim of 8 made 6 (which 4 does not divide)."""
    own = [e for e in rule.examples if e.uneven]
    if own or not isinstance(rule, sk.FactorRule):
        return own
    return [
        dataclasses.replace(
            e, uneven=True, shapes=tuple(tuple(6 if n == 8 else n for n in s) for s in e.shapes)
        )
        for e in rule.examples
        if e.values is None
    ]


@_sizes((3, 2), (6, 3))
def test_uneven_sweep_1d(op, size, mesh1d):
    examples = _uneven_examples(sk.get_rule(op))
    if not examples:
        pytest.skip(f"{op} has no uneven example (its shapes must divide)")
    cases, grad_cases = size
    report = check_rule(
        op,
        mesh=mesh1d,
        examples=examples,
        max_cases=cases,
        max_grad_cases=grad_cases,
        missing=False,
        seed=2,
    )
    assert report.ok, str(report)


@_sizes((2, 1), (4, 2))
def test_uneven_sweep_2d(op, size, mesh2d):
    examples = _uneven_examples(sk.get_rule(op))
    if not examples:
        pytest.skip(f"{op} has no uneven example (its shapes must divide)")
    cases, grad_cases = size
    report = check_rule(
        op,
        mesh=mesh2d,
        examples=examples,
        max_cases=cases,
        max_grad_cases=grad_cases,
        missing=False,
        seed=3,
    )
    assert report.ok, str(report)


#: Dims of the 2 × 3 sweep: the examples' 8s become 32 and their 4s become 64, which the
#: mesh axis of 3 does not divide (the held-out PaddlePaddle cases' sizes).
_SCALE = {8: 32, 4: 64, 6: 32}


_F, _I = "float32", "int32"


def _distinct(shape):
    """Values without ties (a max/min pool's pick does not depend on the layout)."""

    def values(rng):
        return [(rng.permutation(math.prod(shape)).reshape(shape) / 10.0).astype(np.float32)]

    return values


def _scatter(shape, attrs):
    pooled = window_map((shape,), **attrs).out_shapes[0]

    def values(rng):
        return [rng.standard_normal(pooled).astype(np.float32), *_distinct(shape)(rng)]

    ex = sk.Example((pooled, shape), attrs={**attrs, "select_prim": lax.ge_p})
    return dataclasses.replace(ex, differentiable=(True, False), values=values)


def _labels(rows, classes, *, soft=False):
    def values(rng):
        logits = rng.standard_normal((*rows, classes)).astype(np.float32) * 2
        if soft:
            return [logits, rng.dirichlet(np.ones(classes), size=rows).astype(np.float32)]
        labels = rng.integers(0, classes, size=rows).astype(np.int32)
        labels.reshape(-1)[1] = 3  # one ignored row
        return [logits, labels]

    return values


def _lookup(table, ids):
    def values(rng):
        return [
            rng.standard_normal(table).astype(np.float32),
            rng.integers(0, table[0], size=ids).astype(np.int32),
        ]

    return values


def _writes(shape, m):
    def values(rng):
        idx = rng.choice(shape[0], size=m, replace=False).astype(np.int32)
        x = rng.standard_normal(shape).astype(np.float32)
        return [x, idx, rng.standard_normal((m, *shape[1:])).astype(np.float32)]

    return values


def _pool(window, strides, padding):
    n = len(window)
    return {
        "window_dimensions": window,
        "window_strides": strides,
        "padding": padding,
        "base_dilation": (1,) * n,
        "window_dilation": (1,) * n,
    }


_POOL2D = _pool((1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (1, 1), (0, 0)))
_POOL1D = _pool((3, 1), (1, 1), ((1, 1), (0, 0)))
_ROWS = {
    "dimension_numbers": lax.GatherDimensionNumbers(
        offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,)
    ),
    "slice_sizes": (1, 32),
    "mode": lax.GatherScatterMode.CLIP,
}
_ROWS_DN = lax.ScatterDimensionNumbers(
    update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
)
_BATCHED_DN = lax.ScatterDimensionNumbers(
    update_window_dims=(),
    inserted_window_dims=(1,),
    scatter_dims_to_operand_dims=(1,),
    operand_batching_dims=(0,),
    scatter_indices_batching_dims=(0,),
)
_IDX = {"dtypes": (_F, _I, _I), "differentiable": (True, False, False)}
_IDX_LOOKUP = {"dtypes": (_F, _I), "differentiable": (True, False)}
_WRITE = {"dtypes": (_F, _I, _F), "differentiable": (True, False, True)}


def _ex(shapes, attrs=None, **kw):
    return sk.Example(shapes, attrs=attrs or {}, uneven=True, **kw)


#: The 2 × 3 sweep's examples of the hand-written rules (their attributes name sizes,
#: so they cannot be scaled like factor notation): dims of 32 and 64 wherever the op
#: allows, uneven over the axis of 3, besides the rules' own odd-sized examples.
_AT_32_64 = {
    "attention": [
        _ex(((2, 32, 4, 8), (2, 32, 2, 8), (2, 32, 2, 8)), {"causal": True}),
        _ex(((2, 64, 4, 8), (2, 64, 1, 8), (2, 64, 1, 8)), {"strategy": "gather_kv"}),
        # no ring example: the sweep compiles its cases side by side, and ring cases
        # over different axes in one program can stall XLA CPU's collective-permute
        # rendezvous (at --xla_backend_optimization_level=0); tests/rules/test_attention.py
        # runs ring cases one at a time, uneven blocks included
    ],
    "broadcast_in_dim": [_ex(((32, 1),), {"shape": (2, 32, 64), "broadcast_dimensions": (1, 2)})],
    "concatenate": [_ex(((32, 64), (32, 32)), {"dimension": 1})],
    "stack": [_ex(((32, 64), (32, 64)), {"axis": 1})],
    "unstack": [_ex(((32, 2, 64),), {"axis": 1})],
    "dynamic_slice": [_ex(((32, 64), (), ()), {"slice_sizes": (32, 16)}, **_IDX)],
    "dynamic_update_slice": [
        _ex(
            ((32, 64), (32, 16), (), ()),
            dtypes=(_F, _F, _I, _I),
            differentiable=(True, True, False, False),
        )
    ],
    "embedding": [
        _ex(((64, 32), (32,)), **_IDX_LOOKUP, values=_lookup((64, 32), (32,))),
        _ex(((64, 32), (2, 32)), **_IDX_LOOKUP, values=_lookup((64, 32), (2, 32))),
    ],
    "expand_dims": [_ex(((32, 64),), {"dimensions": (0, 2)})],
    "gather": [_ex(((64, 32), (32, 1)), _ROWS, dtypes=(_F, _I), differentiable=(True, False))],
    "index_put": [
        _ex(
            ((64, 32), (8,), (8, 32)),
            {"accumulate": False},
            **_WRITE,
            values=_writes((64, 32), 8),
        ),
        _ex(
            ((64, 32), (8,), (8, 32)),
            {"accumulate": True, "strategy": "local_update"},
            **_WRITE,
            values=_writes((64, 32), 8),
        ),
    ],
    # 6 experts divide both axes; tokens of 64 and 32 are uneven over the axis of 3
    "moe_experts": [
        experts_example(64, 32, 2, 6, 64, uneven=True),
        experts_example(
            32, 64, 2, 6, 32, attrs={"strategy": "local", "capacity_factor": 1.25}, uneven=True
        ),
    ],
    "pad": [_ex(((32, 64), ()), {"padding_config": ((0, 0, 0), (1, 2, 1))}, rtol=1e-4)],
    "reduce_window_max": [
        _ex(((2, 6, 6, 64),), _POOL2D, values=_distinct((2, 6, 6, 64))),
        _ex(((32, 64),), _POOL1D, values=_distinct((32, 64))),
    ],
    "reduce_window_min": [_ex(((32, 64),), _POOL1D, values=_distinct((32, 64)))],
    "reduce_window_sum": [_ex(((2, 6, 6, 64),), _POOL2D), _ex(((32, 64),), _POOL1D)],
    "reshape": [
        _ex(((32, 2),), {"new_sizes": (64,), "dimensions": None}),
        _ex(((32, 64),), {"new_sizes": (32, 2, 32), "dimensions": None}),
        _ex(((64, 32),), {"new_sizes": (2048,), "dimensions": None}),
    ],
    "scatter": [scatter_example(((64, 32), (32, 1), (32, 32)), _ROWS_DN, unique=True, uneven=True)],
    "scatter-add": [
        scatter_example(((64, 32), (32, 1), (32, 32)), _ROWS_DN, unique=False, uneven=True),
        scatter_example(((32, 64), (32, 16, 1), (32, 16)), _BATCHED_DN, unique=False, uneven=True),
    ],
    "select_and_scatter_add": [dataclasses.replace(_scatter((2, 6, 6, 64), _POOL2D), uneven=True)],
    "slice": [
        _ex(((32, 64),), {"start_indices": (0, 1), "limit_indices": (32, 63), "strides": (1, 2)})
    ],
    "softmax_cross_entropy": [
        _ex(
            ((32, 64), (32,)),
            {"reduction": "mean", "ignore_index": 3, "label_smoothing": 0.1},
            **_IDX_LOOKUP,
            values=_labels((32,), 64),
        ),
        _ex(
            ((32, 64), (32, 64)),
            {"reduction": "sum", "label_smoothing": 0.2, "strategy": "vocab_parallel"},
            values=_labels((32,), 64, soft=True),
        ),
    ],
    "split": [_ex(((32, 64),), {"sizes": (16, 48), "axis": 1})],
    "squeeze": [_ex(((32, 1, 64),), {"dimensions": (1,)})],
    "take_along_axis": [
        _ex(((32, 64), (32, 16)), {"axis": 1}, dtypes=(_F, _I), differentiable=(True, False))
    ],
    "transpose": [_ex(((32, 64, 2),), {"permutation": (2, 0, 1)})],
}


def _scaled_examples(rule):
    """The rule's examples with dims of 32 and 64, uneven over the axis of 3; a rule
    whose examples are tied to their shapes (values, shape attributes) keeps its own
    and adds its entry of :data:`_AT_32_64`."""
    if not isinstance(rule, sk.FactorRule):
        own = [dataclasses.replace(e, uneven=True) for e in rule.examples]
        return own + _AT_32_64.get(rule.name, [])
    return [
        dataclasses.replace(
            e, uneven=True, shapes=tuple(tuple(_SCALE.get(n, n) for n in s) for s in e.shapes)
        )
        if e.values is None
        else dataclasses.replace(e, uneven=True)
        for e in rule.examples
    ]


@pytest.fixture(scope="module")
def mesh2x3():
    """Axes ``a`` (2) and ``c`` (3): six of the eight devices, an axis that divides
    neither 32 nor 64."""
    return sk.make_mesh(a=2, c=3)


@pytest.mark.slow
@pytest.mark.full_sweep
def test_numeric_sweep_2x3(op, mesh2x3):
    """Every rule on an axis of 3 with dims of 32 and 64: numerically right, and no
    uneven dim replicated unless the rule declares it must divide
    (``report.replicated``, see :func:`spmdkit.testing.undeclared_replications`)."""
    rule = sk.get_rule(op)
    assert isinstance(rule, sk.FactorRule) or op in _AT_32_64, f"add {op} to _AT_32_64"
    report = check_rule(
        op,
        mesh=mesh2x3,
        examples=_scaled_examples(sk.get_rule(op)),
        max_cases=10,
        max_grad_cases=4,
        missing=False,
        seed=5,
    )
    assert report.ok, str(report)
    assert not report.replicated, str(report)
    assert report.forward_cases > 0
