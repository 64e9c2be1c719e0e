"""Pipeline parallelism: stacked layers split into stages over a ``pipe`` mesh axis.

:mod:`spmdkit.pipeline.schedule` holds the configuration (:class:`Pipeline`)
and the schedules as tick tables (:func:`build_schedule`).
"""

from spmdkit.pipeline.schedule import (
    SCHEDULES,
    Action,
    Pipeline,
    PipelineError,
    Schedule,
    balanced_layout,
    build_schedule,
    device_orders,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "Pipeline",
    "PipelineError",
    "Schedule",
    "balanced_layout",
    "build_schedule",
    "device_orders",
]
