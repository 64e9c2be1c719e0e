"""Test setup: 8 virtual CPU devices, set before JAX starts any backend."""

import functools
import os

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

from tests.sampling import FULL_SWEEP, every_kth  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# -- the default run's budget: its costliest tests run in the slow step ---------------

#: The 60 costliest tests of the default run, measured on a quiet 2-core machine
#: (2026-11-27, jax 0.10.2: 179 s of its 672 s CPU; the run took 5:49 wall with them,
#: over the README command's 5-minute budget). Each still runs, in the slow step
#: (``python -m pytest -m slow``); the cheaper tests of the same modules stay.
MOVED_TO_SLOW = frozenset(
    {
        "tests/cli/test_demo.py::test_console_script_is_installed_and_dispatches",
        "tests/compile/test_annotate.py::test_init_sharded_arrays_live_on_the_users_explicit_mesh",
        "tests/compile/test_enforce.py::test_megatron_with_ops_compiles_the_plans_collectives",
        "tests/compile/test_function.py::test_loss_and_grads_match_single_device[auto-shape2]",
        "tests/compile/test_function.py::test_loss_and_grads_match_single_device[fsdp-shape0]",
        "tests/compile/test_function.py::test_loss_and_grads_match_single_device[megatron-shape1]",
        "tests/compile/test_function.py::test_verify_ok_on_a_2d_mesh[megatron_sp-shape2]",
        "tests/models/test_gpt.py::test_tied_embeddings_are_the_output_projection",
        "tests/models/test_gpt_linen.py::test_bridge_keeps_names_and_matches_linen_apply",
        "tests/models/test_layers.py::test_blockwise_bf16_is_as_accurate_as_plain",
        "tests/models/test_layers.py::test_planner_propagates_blockwise_like_plain_with_less_memory",
        "tests/models/test_llama.py::test_scanned_and_looped_agree_for_the_same_weights",
        "tests/models/test_models.py::test_tiny_loss_and_grad[convnet]",
        "tests/models/test_models.py::test_tiny_loss_and_grad[gpt]",
        "tests/models/test_models.py::test_tiny_loss_and_grad[llama]",
        "tests/models/test_models.py::test_tiny_loss_and_grad[moe]",
        "tests/models/test_moe.py::test_experts_are_one_stacked_param_with_expert_axis",
        "tests/models/test_moe.py::test_scanned_loss_adds_weighted_aux",
        "tests/ops/test_norms.py::test_fused_add_rms_norm_equals_add_then_rms_norm[spec0-default-a]",
        "tests/pipeline/test_execute.py::test_a_layer_that_combines_rows_needs_local_statistics",
        "tests/pipeline/test_execute.py::test_the_switch_returns_one_chunks_gradients_and_reads_the_accumulators[1f1b-1]",
        "tests/pipeline/test_execute.py::test_the_switch_returns_one_chunks_gradients_and_reads_the_accumulators[interleaved-2]",
        "tests/pipeline/test_execute.py::test_tuple_stage_inputs_and_the_last_stages_outputs_in_row_order[1f1b-1-axes1]",
        "tests/planner/pipeline/test_plan.py::test_a_layer_combining_rows_is_refused_when_planned",
        "tests/planner/pipeline/test_plan.py::test_a_pipelined_preset_is_costed_as_a_pipeline",
        "tests/planner/pipeline/test_search.py::test_auto_pipelines_a_layer_combining_rows_only_without_batch_axes",
        "tests/planner/test_search.py::test_auto_searches_recipes_with_layouts_and_names_them",
        "tests/planner/test_search.py::test_auto_with_propagation_beats_every_preset",
        "tests/rules/test_all_rules.py::test_numeric_sweep_1d[log_softmax-sample]",
        "tests/rules/test_all_rules.py::test_numeric_sweep_1d[reduce_mean-sample]",
        "tests/rules/test_all_rules.py::test_numeric_sweep_1d[reduce_min-sample]",
        "tests/rules/test_all_rules.py::test_numeric_sweep_1d[reduce_prod-sample]",
        "tests/rules/test_all_rules.py::test_numeric_sweep_1d[reduce_window_min-sample]",
        "tests/rules/test_all_rules.py::test_numeric_sweep_1d[softmax-sample]",
        "tests/rules/test_all_rules.py::test_numeric_sweep_2d[add_n-sample]",
        "tests/rules/test_all_rules.py::test_numeric_sweep_2d[log_softmax-sample]",
        "tests/rules/test_all_rules.py::test_numeric_sweep_2d[sync_batch_norm-sample]",
        "tests/rules/test_all_rules.py::test_uneven_sweep_1d[log_softmax-sample]",
        "tests/rules/test_all_rules.py::test_uneven_sweep_1d[reduce_prod-sample]",
        "tests/rules/test_all_rules.py::test_uneven_sweep_1d[relu-sample]",
        "tests/rules/test_all_rules.py::test_uneven_sweep_1d[softmax-sample]",
        "tests/rules/test_all_rules.py::test_uneven_sweep_1d[softmax_cross_entropy-sample]",
        "tests/rules/test_all_rules.py::test_uneven_sweep_2d[sync_batch_norm-sample]",
        "tests/rules/test_attention.py::test_ring_uneven_blocks_and_query_heads_over_another_axis",
        "tests/rules/test_norms.py::test_sweep_per_strategy[layer_norm-default]",
        "tests/rules/test_norms.py::test_sweep_per_strategy[layer_norm-sharded_stats]",
        "tests/rules/test_norms.py::test_sweep_per_strategy[rms_norm-sharded_stats]",
        "tests/runtime/test_export.py::test_export_writes_one_tensor_per_parameter_path",
        "tests/runtime/test_train.py::test_batch_stats_are_carried_not_optimized_and_checkpointed",
        "tests/runtime/test_train.py::test_dropout_draws_a_new_mask_every_step_and_resumes_its_stream",
        "tests/runtime/test_train.py::test_params_only_checkpoint_restores_into_a_fresh_optimizer",
        "tests/runtime/test_train.py::test_plan_gives_param_and_optimizer_shardings",
        "tests/runtime/test_train.py::test_resume_is_bit_identical_on_the_same_mesh",
        "tests/runtime/test_train.py::test_the_executable_train_runs_is_the_one_sk_jit_compiles",
        "tests/test_architecture.py::test_no_module_uses_another_modules_private_names",
        "tests/test_benchmarks_ops.py::test_agreement_cross_entropy",
        "tests/test_fp8.py::test_fp8_dot_and_its_gradients_are_the_quantized_matmuls[ls0-rs0-dn0]",
        "tests/test_fp8.py::test_fp8_dot_and_its_gradients_are_the_quantized_matmuls[ls4-rs4-dn4]",
        "tests/test_fuzz.py::test_tensor_spec",
        "tests/zoo/test_zoo.py::test_batch_statistics_are_state_and_train_like_one_device[nnx_cnn]",
    }
)

# -- the quick loop: ``python -m pytest --quick`` (or ``-m quick``) ---------------------

#: Left out of the quick loop, by node id prefix: the default run's costliest tests
#: (fresh processes, whole-model compiles, every op layout, multi-process runs). They
#: stay in the default run; the quick loop keeps the cheaper tests of the same modules.
NOT_QUICK = (
    "tests/cli/test_demo.py",
    "tests/cli/test_app.py::test_python_dash_m_spmdkit_runs_the_cli",
    "tests/cli/test_doctor.py::test_python_dash_m_spmdkit_doctor",
    "tests/compile/test_enforce.py::test_enforced_step_moves_what_was_predicted",
    "tests/compile/test_function.py::test_auto_compiled_collectives_at_most_best_preset",
    "tests/compile/test_function.py::test_loss_and_grads_match_single_device",
    "tests/compile/test_function.py::test_train_step_with_optimizer_state_and_donation",
    "tests/compile/test_function.py::test_verify_ok_on_a_2d_mesh",
    "tests/models/test_gpt_linen.py::test_bridge_keeps_names_and_matches_linen_apply",
    "tests/models/test_llama.py::test_scanned_and_looped_agree_for_the_same_weights",
    "tests/models/test_models.py::test_tiny_loss_and_grad",
    "tests/models/test_moe.py::test_scanned_loss_adds_weighted_aux",
    "tests/ops/test_sdpa.py::test_values_and_grads_equal_the_unsharded_op",
    "tests/ops/test_cross_entropy.py::test_values_and_grads_equal_the_unsharded_op",
    "tests/ops/test_embedding.py::test_values_and_grads_equal_the_unsharded_lookup",
    "tests/ops/test_norms.py::test_values_and_grads_equal_the_unsharded_computation",
    "tests/planner/test_search.py::test_auto_with_propagation_beats_every_preset",
    "tests/rules/test_attention.py::test_ring_uneven_blocks_and_query_heads_over_another_axis",
    "tests/rules/test_norms.py::test_sweep_per_strategy",
    "tests/runtime/test_checkpoint.py::test_sigkill_during_async_save",
    "tests/runtime/test_launch.py::test_a_killed_process_stops_the_others",
    "tests/runtime/test_launch.py::test_two_processes_train_then_one_process_restores",
    "tests/runtime/test_train.py::test_resume_on_another_mesh_matches_within_tolerance",
    "tests/test_benchmarks_ops.py::test_quick_run",
    "tests/test_benchmarks_run_all.py",
)
#: The ops whose rule sweeps (tests/rules/test_all_rules.py) the quick loop runs: one
#: per rule family, the factor-notation rules and hand-written ones.
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


# -- the slow step's sample: ``SPMDKIT_FULL_SWEEP=1`` runs every case (tests/sampling.py)

#: The slow rule sweeps (tests/rules/test_all_rules.py: the ``full`` sizes and the 2 x 3
#: mesh) that CI's slow step runs: those of every eighth op of each rule family, by
#: name, the first included (tests/sampling.py): 17 of the 84 library ops, every family
#: (elementwise 6 of 44, shape 2 of 15, each other family's first); every op's sample
#: sweeps run in the default run.
SWEEP_EVERY = 8


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


def _swept_op(item) -> str | None:
    """The op a rule sweep (tests/rules/test_all_rules.py) checks; None for other tests."""
    if not item.nodeid.startswith("tests/rules/test_all_rules.py"):
        return None
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("op") if callspec is not None else None


def _sample_primitive_sweep(item) -> None:
    """A primitive rule's sweeps: the sample ones into the slow step (those outside
    :func:`primitive_sample` and every full one only with ``SPMDKIT_FULL_SWEEP=1``)."""
    op = _swept_op(item)
    if op is None or op not in primitive_ops():
        return
    if item.get_closest_marker("slow") or op not in primitive_sample():
        item.add_marker(pytest.mark.full)
    item.add_marker(pytest.mark.slow)


def _left_to_full_sweep(item) -> bool:
    op = _swept_op(item)
    if op is None or op in primitive_ops():  # sampled by _sample_primitive_sweep
        return False
    return bool(item.get_closest_marker("slow")) and op not in sweep_ops()


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


def _is_quick(item) -> bool:
    if item.get_closest_marker("slow") or item.nodeid.startswith(NOT_QUICK):
        return False
    if item.nodeid.startswith("tests/rules/test_all_rules.py"):
        callspec = getattr(item, "callspec", None)
        return callspec is not None and callspec.params.get("op") in QUICK_OPS
    return True


@pytest.hookimpl(tryfirst=True)  # before -m reads the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        _sample_primitive_sweep(item)
        if _is_quick(item):
            item.add_marker(pytest.mark.quick)
        if _left_to_full_sweep(item):
            item.add_marker(pytest.mark.full)
        if item.nodeid in MOVED_TO_SLOW:  # after the sampling: it runs in the slow step
            item.add_marker(pytest.mark.slow)
    # the slow step's samples (tests/sampling.py): the rest only on request
    if not FULL_SWEEP and "full" not in (config.getoption("markexpr") or ""):
        left_out = [i for i in items if i.get_closest_marker("full")]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [i for i in items if not i.get_closest_marker("full")]
    if config.getoption("--quick"):
        keep = [i for i in items if i.get_closest_marker("quick")]
        dropped = [i for i in items if not i.get_closest_marker("quick")]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    _group_shared_steps(items)


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
