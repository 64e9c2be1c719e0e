"""Test setup: 8 virtual CPU devices, set before JAX starts any backend."""

import functools
import os
from pathlib import Path

# The suite compiles thousands of small programs: LLVM's -O0 halves XLA:CPU's
# codegen time and leaves HLO passes (fusion, buffer assignment, collectives),
# and so every memory and HLO figure the tests compare, unchanged.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402 (after the flags above)
import pytest  # noqa: E402

from tests.sampling import FULL_SWEEP, every_kth, in_half  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# -- the tiers: markers on the tests themselves ----------------------------------------
# ``slow``: the slow step only (``python -m pytest -m slow``); the default run's costliest
# tests are marked so, to hold the README command's 5-minute budget on 2 cores.
# ``heavy``: the default run, but left out of the quick loop (``python -m pytest
# --quick``, or ``-m quick``): fresh processes, whole-model compiles, every op layout,
# multi-process runs, and the rule sweeps of ops outside tests/rules/test_all_rules.py's
# ``QUICK_OPS``. A mark rides on its test, so a renamed test keeps its tier.


# -- the slow step's sample: ``SPMDKIT_FULL_SWEEP=1`` runs every case (tests/sampling.py)

#: The slow rule sweeps (tests/rules/test_all_rules.py: the ``full`` sizes and the 2 x 3
#: mesh) that CI's slow step runs: those of every twelfth op of each rule family, by
#: name, the first included (tests/sampling.py): 17 of the 86 library ops, every family
#: (elementwise 4 of 44, shape 2 of 15, each other family's first); the default run has
#: some of every op's sample sweeps (test_all_rules.py's ``in_default_run``), the slow
#: step the others.
SWEEP_EVERY = 12


@functools.cache
def sweep_ops() -> frozenset[str]:
    """The ops whose slow rule sweeps CI runs (:data:`SWEEP_EVERY`)."""
    import spmdkit as sk

    library = [op for op in sk.registered_ops() if op not in primitive_ops()]
    return every_kth(library, lambda op: sk.get_rule(op).family, SWEEP_EVERY)


#: The rules of jax primitives the library has no op of its own for (each rule family's
#: ``PRIMITIVE_RULES``: ``cumsum``, ``floor``, ``top_k``, ``conv_general_dilated``…) are
#: many and alike, so their sweeps are sampled further: the sample sweeps of every
#: sixteenth of each family (by name, the first included) run in CI's slow step, the
#: rest of their sweeps only with ``SPMDKIT_FULL_SWEEP=1``. The default run checks
#: their policies' corner cases in tests/rules/test_reduction.py and friends.
PRIMITIVE_EVERY = 16


@functools.cache
def primitive_ops() -> frozenset[str]:
    """The ops of every family's ``PRIMITIVE_RULES``."""
    import importlib

    from spmdkit.rules import FAMILIES

    return frozenset(
        rule.name
        for family in FAMILIES
        for rule in getattr(
            importlib.import_module(f"spmdkit.rules.{family}"), "PRIMITIVE_RULES", ()
        )
    )


@functools.cache
def primitive_sample() -> frozenset[str]:
    """The primitive rules whose sample sweeps CI's slow step runs (:data:`PRIMITIVE_EVERY`)."""
    import spmdkit as sk

    return every_kth(primitive_ops(), lambda op: sk.get_rule(op).family, PRIMITIVE_EVERY)


#: The module of the rule sweeps, parametrized per registered op.
_RULE_SWEEPS = Path(__file__).parent / "rules" / "test_all_rules.py"


def _swept_op(item) -> str | None:
    """The op a rule sweep (:data:`_RULE_SWEEPS`) checks; None for other tests."""
    if item.path != _RULE_SWEEPS:
        return None
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("op") if callspec is not None else None


# The sweeps' samples are computed here, from the registry, rather than written on the
# tests: which ops a family's every k-th is, and which are jax primitives' rules, changes
# with every rule added, and the rule sweeps are parametrized per registered op.


def _sample_primitive_sweep(item) -> None:
    """A primitive rule's sweeps: the sample ones into the slow step (those outside
    :func:`primitive_sample` and every full one only with ``SPMDKIT_FULL_SWEEP=1``)."""
    op = _swept_op(item)
    if op is None or op not in primitive_ops():
        return
    if item.get_closest_marker("full_sweep") or op not in primitive_sample():
        item.add_marker(pytest.mark.full)
    item.add_marker(pytest.mark.slow)


def _left_to_full_sweep(item) -> bool:
    op = _swept_op(item)
    if op is None or op in primitive_ops():  # sampled by _sample_primitive_sweep
        return False
    if item.get_closest_marker("full_sweep"):
        return op not in sweep_ops()
    # a sample sweep moved to the slow step (test_all_rules.SLOW_SAMPLES) of an op whose
    # full sweep of the same test runs there too: the full one checks more cases of the
    # same examples on the same mesh, so the step runs only it
    return bool(item.get_closest_marker("slow")) and op in sweep_ops()


def pytest_configure(config):
    # the suite plans hundreds of plans with notes on purpose (idle axes of small
    # meshes, auto's recipes): their PlanNoteWarnings would fill the summary. A test
    # about them records them (pytest.warns, catch_warnings), which this does not hide.
    config.addinivalue_line("filterwarnings", "ignore::spmdkit.planner.notes.PlanNoteWarning")


def pytest_addoption(parser):
    parser.addoption(
        "--quick",
        action="store_true",
        default=False,
        help="run only the tests marked quick: a representative subset for an edit-test "
        "loop (about a minute); the default run is the full check",
    )
    parser.addoption(
        "--slow-half",
        choices=("0", "1"),
        default=None,
        help="run only this half of the slow tests (tests/sampling.py's in_half; .ci/run "
        "picks it by the commit's hash); the tests not marked slow all run",
    )


def pytest_report_header(config):
    half = config.getoption("--slow-half")
    return [f"slow tests: half {half} of 2 (--slow-half)"] if half is not None else []


@pytest.hookimpl(tryfirst=True)  # before -m reads the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        _sample_primitive_sweep(item)
        if not item.get_closest_marker("slow") and not item.get_closest_marker("heavy"):
            item.add_marker(pytest.mark.quick)
        if _left_to_full_sweep(item):
            item.add_marker(pytest.mark.full)
    # the slow step's samples (tests/sampling.py): the rest only on request
    if not FULL_SWEEP and "full" not in (config.getoption("markexpr") or ""):
        left_out = [i for i in items if i.get_closest_marker("full")]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [i for i in items if not i.get_closest_marker("full")]
    _keep_slow_half(config, items)
    if config.getoption("--quick"):
        keep = [i for i in items if i.get_closest_marker("quick")]
        dropped = [i for i in items if not i.get_closest_marker("quick")]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    _group_shared_steps(items)


def _keep_slow_half(config, items) -> None:
    """``--slow-half=H``: deselect the slow tests outside half ``H``, a group sharing one
    compiled step (``xdist_group``) kept whole."""
    half = config.getoption("--slow-half")
    if half is None:
        return

    def kept(item) -> bool:
        if not item.get_closest_marker("slow"):
            return True
        group = item.get_closest_marker("xdist_group")
        return in_half(group.args[0] if group else item.nodeid, int(half))

    dropped = [i for i in items if not kept(i)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [i for i in items if kept(i)]


def _group_shared_steps(items) -> None:
    """Tests that read one compiled step (an ``xdist_group`` mark: tests/pipeline/steps.py)
    next to each other, at the first one's place. xdist's default scheduling sends runs
    of consecutive tests to one worker, so such a group mostly compiles its step once
    (``--dist loadgroup`` would place them exactly, but xdist 3.8 sets a node id
    attribute pytest 9 no longer reads: every test is then its own group)."""
    groups: dict = {}
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        groups.setdefault(mark.args[0] if mark else item.nodeid, []).append(item)
    items[:] = [item for group in groups.values() for item in group]


@pytest.fixture(scope="session")
def mesh1d():
    """A 1-D mesh of 4 devices, axis ``x`` (Explicit axes)."""
    import spmdkit as sk

    return sk.make_mesh(x=4)


@pytest.fixture(scope="session")
def mesh2d():
    """A 2-D mesh of 2×4 devices, axes ``a`` and ``b`` (Explicit axes)."""
    import spmdkit as sk

    return sk.make_mesh(a=2, b=4)


# -- CPU time per test: ``SPMDKIT_CPU_DURATIONS=path`` ------------------------------------
#: When set, each test's CPU seconds (setup + call: the process's, whose threads run
#: XLA's compiles, plus those of the child processes it waited for, a demo or a
#: notebook kernel) go to ``path`` as JSON, one file per xdist worker (``path.gw0``…).
#: Wall time on a shared machine is noise; this is not.
_CPU_DURATIONS = os.environ.get("SPMDKIT_CPU_DURATIONS", "")
_cpu_seconds: dict[str, float] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _cpu_timed(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _cpu_timed(item)


def _cpu_timed(item):
    if not _CPU_DURATIONS:
        yield
        return
    start = _cpu_now()
    yield
    _cpu_seconds[item.nodeid] = _cpu_seconds.get(item.nodeid, 0.0) + _cpu_now() - start


def _cpu_now() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def pytest_sessionfinish(session):
    if not _CPU_DURATIONS or not _cpu_seconds:
        return
    import json

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    path = f"{_CPU_DURATIONS}.{worker}" if worker else _CPU_DURATIONS
    with open(path, "w") as f:
        json.dump(dict(sorted(_cpu_seconds.items(), key=lambda kv: -kv[1])), f, indent=1)
