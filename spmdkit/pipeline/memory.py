"""How much a pipelined step holds: residual sets per schedule, as the executor runs them.

The executor (:mod:`spmdkit.pipeline.execute`) keeps, per device, whole
*residual sets*: what one forward of one chunk keeps for its backward, for one
micro-batch (:func:`~spmdkit.pipeline.execute.chunk_residuals`; ``R`` bytes).
How many it holds at its peak is the schedule's business:

- ``"gpipe"``: the forward ticks run as one differentiated scan, which keeps a
  residual set for every forward tick, bubbles included: ``v·m + p − 1``, and
  with each the head and loss's residuals (``H`` bytes: the tick's ``cond``
  keeps both branches' residuals, on every device).
- ``"fthenb"``, ``"1f1b"``, ``"interleaved"``: the stash holds the micro-batches
  in flight (the schedule's ``peak_in_flight``, on the device holding most:
  ``v·m`` for fthenb, ``p`` for 1F1B), plus one slot that ticks stashing
  nothing write to.

:func:`peak_bytes` is ``held × R (+ ticks × H for GPipe) + rest``; the
difference between two schedules of one model and mesh (:func:`saved_bytes`)
leaves the rest out, which is what the tests compare with the compiled peaks.
"""

from __future__ import annotations

from spmdkit.pipeline.schedule import Pipeline, build_schedule
from spmdkit.pipeline.tables import build_tables, forward_ticks

__all__ = ["held_residual_sets", "peak_bytes", "saved_bytes"]


def held_residual_sets(pipe: Pipeline) -> int:
    """Residual sets the busiest device holds at its peak (module docstring).

    Example:
        >>> held_residual_sets(Pipeline(stages=4, microbatches=8, schedule="gpipe"))
        11
        >>> held_residual_sets(Pipeline(stages=4, microbatches=8, schedule="1f1b"))
        5
    """
    sched = build_schedule(pipe)
    if pipe.schedule == "gpipe":
        return forward_ticks(sched)
    return build_tables(sched).n_stash + 1


def peak_bytes(
    pipe: Pipeline, residual_bytes: float, head_bytes: float = 0.0, rest_bytes: float = 0.0
) -> float:
    """Predicted per-device peak (module docstring).

    Args:
      pipe: the pipeline.
      residual_bytes: one residual set on one device (``R``: the chunk residuals'
        bytes divided by the batch's shards on the other axes).
      head_bytes: the head and loss's residuals for one micro-batch on one device
        (``H``; GPipe keeps one per forward tick).
      rest_bytes: everything else (parameters, gradients, optimizer state,
        the embedding's activations), the same for every schedule.
    """
    held = held_residual_sets(pipe)
    head = held * float(head_bytes) if pipe.schedule == "gpipe" else 0.0
    return held * float(residual_bytes) + head + float(rest_bytes)


def saved_bytes(
    pipe: Pipeline, than: Pipeline, residual_bytes: float, head_bytes: float = 0.0
) -> float:
    """How much less ``pipe`` holds at its peak than ``than`` (e.g. 1F1B than GPipe).

    Example:
        >>> gp = Pipeline(stages=4, microbatches=8, schedule="gpipe")
        >>> saved_bytes(Pipeline(stages=4, microbatches=8, schedule="1f1b"), gp, 1.0)
        6.0
    """
    return peak_bytes(than, residual_bytes, head_bytes) - peak_bytes(
        pipe, residual_bytes, head_bytes
    )
