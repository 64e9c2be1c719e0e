"""spmdkit.planner.expert_passes: a moe_experts call's rows through device memory
(permute, sort by local expert, their inverses, the gated activation) are priced
in the step's compute, at the HBM bandwidth, charged once per call."""

from unittest import mock

import pytest

import spmdkit as sk
from spmdkit.planner import expert_passes, experts
from spmdkit.planner.trace import trace_step
from tests.planner.test_experts import D_MODEL, B, E, K, S, decoder_info

F = 16  # MoEDecoder's expert width


@pytest.fixture(scope="module")
def info():
    return decoder_info()


def test_call_bytes_counts_the_passes_by_hand():
    # 4 tokens, 8 routed rows, D = 3, F = 5, 2 bytes: token rows 4 passes, routed
    # rows 5 (+ 8 sorting), activation 8 passes of F-wide rows
    glu = 8 * 8 * 5
    assert expert_passes.call_bytes(4, 8, 3, 5, 2, sort=False) == ((4 * 4 + 5 * 8) * 3 + glu) * 2
    assert expert_passes.call_bytes(4, 8, 3, 5, 2, sort=True) == ((4 * 4 + 13 * 8) * 3 + glu) * 2
    # a recompute that reruns the call moves the forward's passes (2, 2, 4, 3) again
    rerun = expert_passes.call_bytes(4, 8, 3, 5, 2, sort=True, rerun=True)
    assert rerun == ((6 * 4 + 19 * 8) * 3 + 11 * 8 * 5) * 2
    unsorted = expert_passes.call_bytes(4, 8, 3, 5, 2, sort=False, rerun=True)
    assert unsorted == ((6 * 4 + 7 * 8) * 3 + 11 * 8 * 5) * 2


@pytest.mark.parametrize(
    ("shape", "n_ep", "sort"),
    # EP 4: two experts a device, the rows received are sorted by local expert;
    # EP 8: one expert a device, the permute's order is the expert's already
    [({"data": 2, "expert": 4}, 4, True), ({"data": 8}, 8, False)],
)
def test_the_step_pays_the_calls_passes_at_hbm_bandwidth(info, shape, n_ep, sort):
    mesh = sk.abstract_mesh(**shape)
    topo = sk.Topology.h100()
    priced = sk.plan(info, mesh, "ep", estimator="analytic", topology=topo)
    with mock.patch.object(expert_passes, "passes_s", return_value=0.0):
        without = sk.plan(info, mesh, "ep", estimator="analytic", topology=topo)
    assert priced.params["moe/w_down"] == without.params["moe/w_down"]
    t_local = B * S / 8
    call = trace_step(info, None).moe_calls[E]
    routed = t_local * K * experts.load_imbalance(call, n_ep, t_local)
    nbytes = expert_passes.call_bytes(t_local, routed, D_MODEL, F, 4, sort=sort)
    added = priced.cost.compute_time_s - without.cost.compute_time_s
    assert added == pytest.approx(nbytes / topo.hbm_bandwidth, rel=1e-9)
    assert added > 0


def test_a_context_pricing_flops_only_adds_no_passes(info):
    """Only the down projection carries the call, and a context that prices FLOPs
    only (``peak_flops``) leaves memory-bound work out, as the fusions' is."""
    from spmdkit.planner import analytic

    trace = trace_step(info, None)
    groups = {g.key: g for g in analytic.param_groups(info, trace)}
    assert experts.is_down_projection(groups["moe/w_down"])
    assert not experts.is_down_projection(groups["moe/w_gate"])
    ctx = mock.Mock(peak_flops=1e15, trace=trace)
    assert expert_passes.passes_s(ctx, groups["moe/w_down"], None, ()) == 0.0
