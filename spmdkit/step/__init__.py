"""The training step: the :class:`~spmdkit.step.recipe.Recipe` a plan carries, and
the levers that run it around the user's loss, each a pass applied in one
declared order.

A stage above ``spmdkit.pipeline`` (whose executor the pipeline pass hands a
pipelined plan to) and below the planner, ``sk.jit`` and ``train``, which all run
the one step built here (``sk.value_and_grad``, ``sk.train_step``:
:mod:`spmdkit.step.grad`).

- :mod:`~spmdkit.step.recipe`: the ``Recipe`` value and the names its fields take.
- :mod:`~spmdkit.step.passes`: the one interface: a :class:`~spmdkit.step.passes.Pass`
  is a function ``Step -> Step``; :class:`~spmdkit.step.passes.Step` holds the
  loss as the passes before rewrote it, the gradient and update once made, the
  recipe, the plan (typed: :class:`~spmdkit.step.passes.StepPlan`) and the loss's form.
- :mod:`~spmdkit.step.grad`: :data:`~spmdkit.step.grad.ORDER`, the passes in the
  order they apply (each ordering constraint commented there), and the entry
  points; its own passes are the gradient by the loss's form and the
  micro-batch accumulator.
- the levers, one module each: :mod:`~spmdkit.step.context` (a context-parallel
  plan's token order), :mod:`~spmdkit.step.fp8` (float8 weight matmuls),
  :mod:`~spmdkit.step.remat_scan` (each layer recomputed under a policy; the
  matmul roles of :mod:`~spmdkit.step.matmul_roles` tag what named policies keep),
  :mod:`~spmdkit.step.cast` (the compute dtype), :mod:`~spmdkit.step.pipelined`
  (a plan's pipeline), :mod:`~spmdkit.step.master` (the fp32 master in the
  optimizer state), :mod:`~spmdkit.step.offload` (the optimizer state in host
  memory).
- :mod:`~spmdkit.step.loss`: ``Loss``, the form of the user's loss every pass
  reads (state, aux, a key last).

Adding a lever is one module with one function ``Step -> Step`` (returning the
step itself when its recipe field is off) and one ``Pass`` line in
:data:`~spmdkit.step.grad.ORDER`, placed where its comment says why; a field on
the ``Recipe`` if the lever is chosen per plan.
"""
