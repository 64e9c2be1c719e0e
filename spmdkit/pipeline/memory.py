"""How much a pipelined step holds per device: the executor's buffers, by schedule.

The executor (:mod:`spmdkit.pipeline.execute`) runs one program on every device
of the pipe axis, so every device allocates the same buffers, sized for the
busiest device. They are made of four pieces, per device
(:class:`StageSizes`): ``R``, one chunk's residual set for one micro-batch
(what its ``jax.vjp`` keeps, less the weights and shared constants);
``H``, the head and loss's residuals for one micro-batch; ``C``, one
micro-batch's stage input (what a permute sends); ``W``, one chunk's stacked
weights as its stage computes with them (in the compute dtype, gathered over the
batch axes). :func:`stage_buffers` counts them from the tick tables
(:mod:`spmdkit.pipeline.tables`):

- ``"fthenb"``, ``"1f1b"``, ``"interleaved"`` (explicit ticks):

  - ``stash``: ``n_stash · R``: the residual slots of the micro-batches in
    flight on the busiest device (F-then-B: ``v·m``; 1F1B: ``p``); a slot is
    released (free for the next forward) by the backward that consumes it, and
    there is no trash slot (ticks that stash nothing write out of bounds,
    dropped);
  - ``inboxes``: ``(n_inbox_f + 1 + n_inbox_b + 1) · C`` (with their trash slots);
  - ``tick``: the slot a backward reads (``R``), the backward's working set
    beyond it (:attr:`StageSizes.working`: its layers' cotangents, the chunk's
    weights as it slices them, the operands it transposes; ``plan.verify``
    sizes it by propagating one chunk's forward and backward) and the
    ``lax.switch``'s residual result (``R``: a forward's fresh set until it is
    written to its slot). What a backward branch returns there decides how
    the three add up (read off XLA:CPU's compiled peaks):

    - a zero-filled set, where the stages keep an automatic mesh axis: XLA
      copies hoisted zeros into the result at the branch's start, so it is
      held through the working set: ``2·R + working``. Tiny GPT (pipe 2, 4
      micro-batches, megatron 1F1B) holds the slot read, the zeros and
      somewhat less than an ``R`` of cotangents and weight-gradient stacks; a
      4-layer Llama (pipe 2 × context 2 × model 2, megatron 1F1B) the slot
      read, about an ``R`` of zero copies and the backward's scan;
    - the slot it read (:attr:`StageSizes.read_slot`, every axis manual): XLA
      re-slices the slot into the result at the branch's end, after the
      working set is gone: ``R + max(working, R)``. The pipelined DeepSeek
      stage keeping its experts (pipe 2 × data 4, no recompute) peaks inside
      its backward with the slot read, the working set and one small piece of
      the result; dp interleaved (v 2) on tiny GPT peaks before the result is
      made.
  - ``grads``: ``W``, a backward's chunk gradients: the tick's ``lax.switch``
    result, added to the accumulators after it. (Added inside the
    branch, the accumulators were the switch's result instead, and XLA copied
    them, ``v`` chunks in float32: a conditional's result buffer is not its
    operand's.)

- ``"gpipe"`` (autodiff of the forward tick scan): every forward tick ``t``
  (``T`` of them, bubbles included) keeps its chunk's residuals, the head's
  (the tick's ``cond`` keeps both branches'), the chunk's weights it sliced
  (the ``cond``'s operand), and the forward inbox it read:
  ``stash = T · (R + H + W)``, ``inboxes = (T + 1) · (n_inbox_f + 1) · C``;
  ``tick``: ``R`` and the backward's working set (:attr:`StageSizes.working`;
  FSDP + TP stages on tiny Llama, pipe 2: predicted/compiled 0.785 without it,
  0.872 with it, jax 0.10.2).

:func:`peak_bytes` sums them (plus what the caller knows about the rest:
parameters, gradients, the embedding's activations); :func:`saved_bytes` is
the difference between two schedules of one model and mesh. The planner
(:mod:`spmdkit.planner.pipeline.cost`) prices a pipelined stage with the same
:func:`stage_buffers`, and ``plan.verify`` adds to its propagated prediction
the buffers propagation does not see or lays out otherwise
(:func:`residual_outputs`).
"""

from __future__ import annotations

from dataclasses import dataclass

from spmdkit.pipeline.schedule import Pipeline, build_schedule
from spmdkit.pipeline.tables import build_tables, forward_ticks
from spmdkit.state import cached

__all__ = [
    "StageSizes",
    "buffer_slots",
    "held_residual_sets",
    "peak_bytes",
    "residual_outputs",
    "saved_bytes",
    "stage_buffers",
]


@dataclass(frozen=True)
class StageSizes:
    """The pieces a device's pipeline buffers are made of (bytes on one device).

    Attributes:
      residual: ``R``, one chunk's residual set for one micro-batch.
      head: ``H``, the head and loss's residuals for one micro-batch.
      carry: ``C``, one micro-batch's stage input (what one permute sends).
      weights: ``W``, one chunk's stacked weights as its stage computes with
        them (compute dtype, gathered over the batch axes).
      working: a backward's working set beyond the residual set it reads: the
        cotangents its layers make, the chunk's weights as it slices them, the
        operands it transposes (0: not sized, the planner's count).
      read_slot: a backward's stash effect is the slot it read, not a
        zero-filled set (every mesh axis manual in the stages:
        :func:`~spmdkit.pipeline.ticks.explicit_tick_loop`).
    """

    residual: float
    head: float = 0.0
    carry: float = 0.0
    weights: float = 0.0
    working: float = 0.0
    read_slot: bool = False


def held_residual_sets(pipe: Pipeline) -> int:
    """Residual sets every device allocates for held micro-batches: GPipe's forward
    ticks, else the stash's slots (the busiest device's in-flight micro-batches).

    Example::
        >>> held_residual_sets(Pipeline(stages=4, microbatches=8, schedule="gpipe"))
        11
        >>> held_residual_sets(Pipeline(stages=4, microbatches=8, schedule="1f1b"))
        4
    """
    return _slots(pipe)[0]


def stage_buffers(pipe: Pipeline, sizes: StageSizes) -> dict[str, float]:
    """A device's pipeline buffers, by kind (``stash``, ``inboxes``, ``tick``,
    ``grads``; module docstring).

    Args:
      pipe: the pipeline.
      sizes: ``R``, ``H``, ``C``, ``W`` on one device.

    Example::
        >>> stage_buffers(Pipeline(stages=2, microbatches=4, schedule="1f1b"),
        ...               StageSizes(residual=10.0, head=1.0, carry=2.0))
        {'stash': 20.0, 'inboxes': 8.0, 'tick': 20.0, 'grads': 0.0}
    """
    r, h, c, w = sizes.residual, sizes.head, sizes.carry, sizes.weights
    held, inbox = _slots(pipe)
    if pipe.schedule == "gpipe":
        return {
            "stash": held * (r + h + w),
            "inboxes": (held + 1) * inbox * c,
            "tick": r + sizes.working,
        }
    return {
        "stash": held * r,
        "inboxes": inbox * c,
        # the slot read, then the working set and the switch's result: a zero-filled
        # set copied in at the branch's start, or the slot re-read at its end
        "tick": r + (max(sizes.working, r) if sizes.read_slot else r + sizes.working),
        "grads": w,
    }


def buffer_slots(pipe: Pipeline) -> tuple[int, int, int] | None:
    """``(stash, forward inbox, backward inbox)`` slots (the inboxes' trash slots
    not counted) of the schedules the planner searches, in closed form; None for
    the others (GPipe, circular F-then-B).

    - 1F1B (``m ≥ p``): ``p`` stash slots (device 0's warm-up and its first
      forward), one slot per inbox: each value is consumed the tick after it
      arrives.
    - Interleaved 1F1B (``m`` a multiple of ``p``): with one group of ``p``
      micro-batches every forward runs before the first backward, ``v·p`` slots;
      with more, device 0's warm-up ``2(p − 1) + (v − 1)·p`` and one more,
      ``(v + 1)·p − 1``; two forward inbox slots (one for ``p = 2, m = 2``) and
      ``⌊p/2⌋ + 1`` backward ones.
    - F-then-B without virtual stages: every micro-batch's set is held until its
      backward (``m``), one forward inbox slot, and the last device's backward
      inbox holds every loss cotangent (``m``).

    They equal :func:`~spmdkit.pipeline.tables.build_tables`' counts
    (``tests/pipeline/test_memory.py`` compares them for ``p ≤ 12``; checked to
    ``p = 32`` when written), which replay the tick table: a second for the
    hundreds of micro-batches over tens of stages the planner costs.

    Example:
        >>> buffer_slots(Pipeline(stages=4, microbatches=8, schedule="interleaved", virtual=2))
        (11, 2, 3)
    """
    p, v, m = pipe.stages, pipe.virtual, pipe.microbatches
    if pipe.schedule == "1f1b":
        return p, 1, 1
    if pipe.schedule == "interleaved":
        stash = v * p if m == p else (v + 1) * p - 1
        return stash, 1 if p == 2 and m == p else 2, p // 2 + 1
    if pipe.schedule == "fthenb" and v == 1:
        return m, 1, m
    return None


@cached(maxsize=512, why="a schedule's buffer slot counts in closed form.")
def _slots(pipe: Pipeline) -> tuple[int, int]:
    """``(held residual sets, inbox slots)`` every device allocates (GPipe: its
    forward ticks and forward inbox; else the stash's slots and both inboxes'
    slots, their trash slots included)."""
    known = buffer_slots(pipe)
    if known is not None:
        return known[0], known[1] + 1 + known[2] + 1
    sched = build_schedule(pipe)
    if pipe.schedule == "gpipe":
        t = forward_ticks(sched)
        return t, build_tables(sched, ticks=t).n_inbox_f + 1
    tables = build_tables(sched)
    return tables.n_stash, tables.n_inbox_f + 1 + tables.n_inbox_b + 1


def residual_outputs(pipe: Pipeline) -> frozenset[str]:
    """The kinds of :func:`stage_buffers` that are outputs of the pipeline's
    forward ``shard_map`` (GPipe's held residuals and inboxes: the
    differentiated scan's residuals); the others live inside it. A propagation
    of the step sees only the former, laid out as their ``out_specs`` say (over
    the pipe axis only: the other axes' share of the batch is XLA's choice)."""
    if pipe.schedule == "gpipe":
        return frozenset({"stash", "inboxes"})
    return frozenset()


def peak_bytes(pipe: Pipeline, sizes: StageSizes, rest_bytes: float = 0.0) -> float:
    """Predicted per-device peak: :func:`stage_buffers` plus ``rest_bytes``
    (parameters, gradients, optimizer state, the embedding's activations: the
    same for every schedule)."""
    return sum(stage_buffers(pipe, sizes).values()) + float(rest_bytes)


def saved_bytes(pipe: Pipeline, than: Pipeline, sizes: StageSizes) -> float:
    """How much less ``pipe`` holds at its peak than ``than`` (e.g. 1F1B than GPipe);
    negative when it holds more.

    Example::
        >>> gp = Pipeline(stages=4, microbatches=8, schedule="gpipe")
        >>> saved_bytes(Pipeline(stages=4, microbatches=8, schedule="1f1b"), gp, StageSizes(1.0))
        6.0
    """
    return peak_bytes(than, sizes) - peak_bytes(pipe, sizes)
