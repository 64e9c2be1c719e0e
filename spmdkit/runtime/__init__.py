"""Runtime: the training loop, sharded data, checkpoints and multi-process launch.

Stage 6 of the pipeline (trace → propagate → plan → enforce/compile → verify →
**run**). Modules load orbax, optax and process machinery, so this package
imports nothing eagerly: use ``spmdkit.runtime.train``, ``.data``,
``.checkpoint`` and ``.launch``.
"""
