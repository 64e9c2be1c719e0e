"""Known misses of the CPU memory prediction on jaxlib 0.11 and later.

From jaxlib 0.11 XLA:CPU runs 16-bit float dots natively (YNNPACK: bf16 operands and
result) where the left operand contracts its last dim or is copied into that form,
and in float32 where it reads a transposed left operand in place (a 2-D left operand
contracting its first dim, a batched one contracting a middle dim). ``held_on_cpu``
holds every bf16 temporary at float32 size, as jaxlib 0.10's XLA:CPU does, so some
bf16 steps' peaks are predicted high there; the float8 half of the change is
modelled (``spmdkit.versions.cpu_float8_held_as``). Two fp32 steps' compiled peaks
also dropped there, below the prediction's tolerance (the small scanned Llama under
megatron_sp with micro-batches, the pipelined DeepSeek stage keeping its experts),
by causes not yet read off their programs. :func:`newer_cpu_miss` marks such a case
as a strict expected failure on those jaxlibs, so a fix shows up (the case passes
and the mark must go) while jaxlib 0.10.2, CI's slow step, still checks it.
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
