"""plan.to_html: a page that parses, names every tensor, and draws each layout right."""

import itertools
from html.parser import HTMLParser

import pytest
from jax.sharding import PartitionSpec as P

import spmdkit as sk
from spmdkit.planner import plan
from spmdkit.planner.logical import PlanError
from spmdkit.planner.picture import PHASES, layout_cells, timeline
from spmdkit.planner.provenance import ACTIVATIONS
from spmdkit.verification.compiled import VerifyReport


class _Page(HTMLParser):
    """Collects the text, the tags, and any reference to another resource."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.tags: list[str] = []
        self.external: list[str] = []
        self.open: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag not in ("meta", "br"):
            self.open.append(tag)
        for name, value in attrs:
            if name in ("src", "href") and value:
                self.external.append(value)

    def handle_startendtag(self, tag, attrs):  # <rect .../>: opens nothing
        self.handle_starttag(tag, attrs)
        self.open.pop()

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, (tag, self.open[-3:])
        self.open.pop()

    def handle_data(self, data):
        self.text.append(data)


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    page.close()
    return page


@pytest.fixture(scope="module")
def gpt_fsdp(tiny_infos, amesh):
    """Tiny GPT's fsdp plan, costed by propagation (equations recorded)."""
    return plan(tiny_infos["gpt"], amesh, "fsdp")


def test_page_parses_and_names_every_tensor(gpt_fsdp, tmp_path):
    path = tmp_path / "plan.html"
    text = gpt_fsdp.to_html(str(path))
    assert path.read_text(encoding="utf-8") == text
    page = _parse(text)
    assert not page.external and "script" not in page.tags
    shown = "\n".join(page.text)
    for name in (*gpt_fsdp.params, *gpt_fsdp.state):
        assert name in shown, name
    assert page.tags.count("svg") >= len({*gpt_fsdp.params.values()}) and "fsdp" in shown
    for kind, n in gpt_fsdp.cost.memory.items():
        assert (kind in shown) == bool(n)


def test_timeline_holds_every_parameter_collective(gpt_fsdp):
    segments = timeline(gpt_fsdp)
    lanes = {s.lane for s in segments}
    assert lanes <= {*PHASES, ACTIVATIONS} and {"forward", "backward"} <= lanes
    # each bucket's bytes per kind are on the timeline, no more, no less
    prov = gpt_fsdp.provenance
    drawn: dict[tuple[str, str], int] = {}
    for s in segments:
        drawn[s.owner, s.kind] = drawn.get((s.owner, s.kind), 0) + s.nbytes
    assert drawn == {
        (k, kind): n for k, per in prov.comm_bytes.items() for kind, n in per.items() if n
    }
    assert {s.kind for s in segments if s.owner != ACTIVATIONS} >= {"all_gather"}  # fsdp gathers
    total = sum(s.time_s for s in segments)
    assert total == pytest.approx(sum(prov.comm_time_s.values()))
    for lane in lanes:  # segments follow each other in their lane
        mine = [s for s in segments if s.lane == lane]
        for a, b in itertools.pairwise(mine):
            assert b.start_s == pytest.approx(a.start_s + a.time_s)


def test_analytic_plan_says_it_has_no_equations(tiny_infos, amesh):
    p = plan(tiny_infos["gpt"], amesh, "megatron", estimator="analytic")
    assert timeline(p) == []
    page = _parse(p.to_html())
    assert "analytic estimator" in "".join(page.text)


def test_layout_cells_give_each_device_its_shard(amesh):
    cells = layout_cells(amesh, P("data", ("model",)), 2)  # data=2 down, model=4 across
    assert [(c.row, c.col) for c in cells[:5]] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    assert cells[6].shard == (1, 2) and cells[6].block == 6 and cells[6].blocks == 8
    both = layout_cells(amesh, P(("model", "data")), 1)  # model major, data minor
    assert [c.shard for c in both] == [(0,), (2,), (4,), (6,), (1,), (3,), (5,), (7,)]
    replicated = layout_cells(amesh, P(), 2)
    assert {c.block for c in replicated} == {0} and replicated[0].blocks == 1
    mesh3 = sk.abstract_mesh(pipe=2, data=2, model=2)  # pipe down, data×model across
    assert max(c.col for c in layout_cells(mesh3, P(), 1)) == 3


def test_page_shows_a_verify_report_and_refuses_a_directory(gpt_fsdp, tmp_path):
    report = VerifyReport(
        [("all-gather bytes", 4096, 8192, False)],
        ["all-gather bytes: predicted 4.0 KiB, compiled 8.0 KiB"],
    )
    shown = "".join(_parse(gpt_fsdp.to_html(report=report)).text)
    assert "compiled" in shown and "MISMATCH" in shown and "8.0 KiB" in shown
    with pytest.raises(PlanError, match="to_html"):
        gpt_fsdp.to_html(str(tmp_path))
    with pytest.raises(PlanError, match="existing directory"):
        gpt_fsdp.to_html(str(tmp_path / "no" / "plan.html"))


def test_plot_draws_the_three_figures(gpt_fsdp):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = gpt_fsdp.plot(max_groups=6)
    try:
        layout_axes = [ax for ax in figs.layouts.axes if ax.get_title()]
        assert len(layout_axes) == 6 and "groups not drawn" in figs.layouts._suptitle.get_text()
        lanes = [t.get_text() for t in figs.collectives.axes[0].get_yticklabels()]
        assert "forward" in lanes and ACTIVATIONS in lanes
        bars = figs.collectives.axes[0].patches
        assert len(bars) == len(timeline(gpt_fsdp))
        assert len(figs.memory.axes[0].patches) == sum(
            1 for n in gpt_fsdp.cost.memory.values() if n
        )
    finally:
        for f in (figs.memory, figs.collectives, figs.layouts):
            plt.close(f)


def test_plot_without_matplotlib_says_what_to_install(gpt_fsdp, monkeypatch):
    import sys

    from spmdkit.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # import raises ImportError
    with pytest.raises(MissingDependencyError, match=r"spmdkit\[plot\]") as e:
        gpt_fsdp.plot()
    assert isinstance(e.value, ImportError) and isinstance(e.value, sk.SpmdError)
