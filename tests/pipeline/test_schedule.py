"""Tick tables of the pipeline schedules: dependencies, bubbles, held micro-batches, errors."""

from __future__ import annotations

import pytest

from spmdkit.pipeline import SCHEDULES, Pipeline, PipelineError, balanced_layout, build_schedule

CONFIGS = [
    Pipeline(stages=4, microbatches=8, schedule="gpipe"),
    Pipeline(stages=4, microbatches=8, schedule="fthenb"),
    Pipeline(stages=4, microbatches=8, schedule="1f1b"),
    Pipeline(stages=4, microbatches=6, schedule="1f1b"),
    Pipeline(stages=2, microbatches=4, schedule="interleaved", virtual=2),
    Pipeline(stages=4, microbatches=8, schedule="interleaved", virtual=2),
    Pipeline(stages=4, microbatches=4, schedule="interleaved", virtual=3),
    Pipeline(stages=2, microbatches=3, schedule="fthenb", virtual=2),
    Pipeline(stages=1, microbatches=2, schedule="1f1b"),
]


@pytest.mark.parametrize("pipe", CONFIGS, ids=lambda p: p.short().replace(" ", "-"))
def test_every_action_once_after_its_input(pipe: Pipeline) -> None:
    s = build_schedule(pipe)
    when = {}
    for t, row in enumerate(s.ticks):
        for d, a in enumerate(row):
            if a is not None:
                assert pipe.chunk_device(a.chunk) == d
                key = (a.kind, a.microbatch, a.chunk)
                assert key not in when
                when[key] = t
    last = pipe.chunks - 1
    assert len(when) == 2 * pipe.microbatches * pipe.chunks
    for (kind, i, c), t in when.items():
        if kind == "F" and c > 0:
            assert when[("F", i, c - 1)] < t
        if kind == "B":
            assert when[("F", i, c)] < t
            if c < last:
                assert when[("B", i, c + 1)] < t


@pytest.mark.parametrize("pipe", CONFIGS, ids=lambda p: p.short().replace(" ", "-"))
def test_bubble_matches_the_closed_form(pipe: Pipeline) -> None:
    assert build_schedule(pipe).bubble_fraction == pytest.approx(pipe.bubble_fraction)


def test_held_micro_batches_per_schedule() -> None:
    def peak(**kw):
        return build_schedule(Pipeline(**kw)).peak_in_flight

    assert peak(stages=4, microbatches=8, schedule="gpipe") == (8, 8, 8, 8)
    assert peak(stages=4, microbatches=8, schedule="1f1b") == (4, 3, 2, 1)
    # Megatron's interleaved warm-up: (p - d - 1) * 2 + (v - 1) * p forwards, then one more
    assert peak(stages=4, microbatches=8, schedule="interleaved", virtual=2) == (11, 9, 7, 5)


def test_sends_and_text_table() -> None:
    s = build_schedule(Pipeline(stages=2, microbatches=2, schedule="1f1b"))
    assert s.sends == (2, 2)  # d0 sends 2 forwards; d1 sends 2 cotangents back
    assert s.table().splitlines()[0].startswith("d0: F0.0 F1.0")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(stages=4, microbatches=2, schedule="1f1b"), "at least as many micro-batches"),
        (dict(stages=2, microbatches=4, schedule="1f1b", virtual=2), "interleaved"),
        (dict(stages=2, microbatches=4, schedule="interleaved"), "virtual >= 2"),
        (dict(stages=2, microbatches=3, schedule="interleaved", virtual=2), "groups"),
        (dict(stages=0, microbatches=3), "positive"),
        (dict(stages=2, microbatches=2, schedule="zb"), "one of"),
    ],
)
def test_bad_configurations_are_typed(kw: dict, match: str) -> None:
    with pytest.raises(PipelineError, match=match) as e:
        Pipeline(**kw)
    assert e.value.fix


def test_layers_must_divide_into_chunks_and_json_round_trip() -> None:
    pipe = Pipeline(stages=2, microbatches=4, schedule="interleaved", virtual=2)
    assert pipe.check_layers(8) == 2
    with pytest.raises(PipelineError, match="divisible by 4"):
        pipe.check_layers(6)
    assert Pipeline.from_json(pipe.to_json()) == pipe
    assert set(SCHEDULES) == {"gpipe", "fthenb", "1f1b", "interleaved"}


def test_a_layout_gives_chunks_their_layers() -> None:
    layout = (0, 2, 3, 1)
    pipe = Pipeline(stages=2, microbatches=4, schedule="interleaved", virtual=2, layout=layout)
    assert pipe.uneven and pipe.chunk_layers(6) == (0, 2, 3, 1)
    assert pipe.device_layers(6) == (3, 3)  # chunks 0, 2 on device 0; 1, 3 on device 1
    assert pipe.check_layers(6) == 3  # the largest chunk's: what each chunk is padded to
    with pytest.raises(PipelineError, match="summing to 6"):
        pipe.check_layers(7)
    assert Pipeline.from_json(pipe.to_json()) == pipe
    assert pipe.short() == "pp2x2 interleaved m4 layout 0-2-3-1"
    even = Pipeline(stages=2, microbatches=4, layout=(2, 2))
    assert not even.uneven and even.check_layers(4) == 2
    assert "layout" not in Pipeline(stages=2, microbatches=4).to_json()


@pytest.mark.parametrize("layers", [1, 5, 9, 58, 61])
@pytest.mark.parametrize("stages,virtual", [(1, 1), (2, 1), (3, 2), (4, 4), (8, 4)])
def test_a_balanced_layout_gives_chunks_and_devices_floor_or_ceil(
    layers: int, stages: int, virtual: int
) -> None:
    chunks = stages * virtual
    layout = balanced_layout(layers, stages, virtual)
    assert len(layout) == chunks and sum(layout) == layers
    assert set(layout) <= {layers // chunks, -(-layers // chunks)}
    devices = Pipeline(stages, stages, "fthenb", virtual=virtual, layout=layout).device_layers(
        layers
    )
    assert set(devices) <= {layers // stages, -(-layers // stages)}


def _fewest_busiest(layers: int, ends: tuple[float, ...]) -> float:
    """The least work the busiest of len(ends) devices can run (brute force)."""
    if len(ends) == 1:
        return layers + ends[0]
    return min(max(n + ends[0], _fewest_busiest(layers - n, ends[1:])) for n in range(layers + 1))


@pytest.mark.parametrize("ends", [(0.0, 0.0), (2.0, 0.5), (1.0, 3.0), (7.0, 0.0)])
@pytest.mark.parametrize("layers", [4, 7, 12])
def test_a_balanced_layout_keeps_the_busiest_device_least_busy(
    ends: tuple[float, float], layers: int
) -> None:
    """The end devices' work (in layers) counted: the busiest device runs the
    least it can, and the first and last chunks take their share of it."""
    layout = balanced_layout(layers, 3, 2, ends)
    devices = Pipeline(3, 3, "interleaved", virtual=2, layout=layout).device_layers(layers)
    work = (devices[0] + ends[0], devices[1], devices[2] + ends[1])
    assert sum(layout) == layers
    assert max(work) == _fewest_busiest(layers, (ends[0], 0.0, ends[1]))
    if ends[0] >= 1:  # the first chunk is lighter than the first device's other
        assert layout[0] <= layout[3]


@pytest.mark.parametrize("args", [(0, 2, 1), (4, 0, 1), (4, 2, 0), (4, 2, 1, (-1.0, 0.0))])
def test_a_bad_balanced_layout_is_typed(args: tuple) -> None:
    with pytest.raises(PipelineError, match="balanced_layout") as e:
        balanced_layout(*args)
    assert e.value.fix


@pytest.mark.parametrize("layout", [(1, 2, 3), (1, -1), (0, 0), [1, 1]])
def test_a_bad_layout_is_typed(layout: object) -> None:
    with pytest.raises(PipelineError, match="layout is a tuple") as e:
        Pipeline(stages=2, microbatches=2, layout=layout)
    assert e.value.fix
