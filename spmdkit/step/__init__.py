"""The training step: the :class:`~spmdkit.step.recipe.Recipe` a plan carries and
the levers that run it around the user's loss (float8, the fp32 master in the
optimizer state, host offload, named recompute, matmul roles, loss forms).

A stage above ``spmdkit.pipeline`` (whose executor it dispatches a pipelined
plan to) and below the planner, ``sk.jit`` and ``train``, which all run the one
step built here.
"""
