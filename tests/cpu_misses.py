"""Known misses of the CPU memory prediction on jaxlib 0.11 and later.

One is left: the pipelined DeepSeek stage keeping its experts without recompute,
whose peak ``plan.verify`` predicts at 4.22 MB against 3.49 MB compiled on jaxlib
0.12 and 3.55 MB on 0.10.2, where it holds by a point of the 20% tolerance: the
prediction is high on both, by a cause not yet read off the program. (The bf16
misses of those jaxlibs, whose XLA:CPU runs most 16-bit dots natively, are
modelled, ``spmdkit.propagation.workspaces.CpuBackend``; the scanned Llama's with
micro-batches came from a scan body's resharded copies all held at once,
``spmdkit.propagation.records.LoopCopies``.) :func:`newer_cpu_miss` marks such a
case as a strict expected failure on those jaxlibs, so a fix shows up (the case
passes and the mark must go) while jaxlib 0.10.2, CI's slow step, still checks it.
"""

from __future__ import annotations

import pytest

from spmdkit.versions import cpu_float8_held_as

#: XLA:CPU runs 16-bit float dots natively (jaxlib 0.11 and later).
NATIVE_16BIT_DOTS = cpu_float8_held_as() == "float16"


def newer_cpu_miss(request: pytest.FixtureRequest, what: str) -> None:
    """Mark the running test a strict expected failure on jaxlib 0.11+ for ``what``
    (the row that misses and by how much there)."""
    if NATIVE_16BIT_DOTS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"jaxlib 0.11+ XLA:CPU: {what}"))
