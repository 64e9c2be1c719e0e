"""Planning pipelines: the pipe axis's meshes and configurations, their cost, and
a pipelined plan.

``search`` (the meshes with a pipe axis a mesh offers, the pipeline
configurations worth costing), ``cost`` (a pipelined step's time and per-stage
memory: which parameters live on which stage, the bubble, the sends), ``plan``
(a strategy planned on the mesh without the pipe axis, its stacked parameters'
``layers`` dim put on the pipe axis). The executor that runs a pipelined plan is
:mod:`spmdkit.pipeline`.
"""
