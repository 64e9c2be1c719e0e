"""The rule engine: what a sharding rule is, and how rules are registered, applied
and run.

``factor`` (factor notation: ``"... m k, k n -> ... m n"``), ``rule`` (the
:class:`~spmdkit.engine.rule.Rule` protocol, partial-sum policies, contexts and
results), ``factor_rule`` (rules declared in factor notation: factor assignment,
:class:`~spmdkit.engine.factor_rule.FactorRule`), ``registry`` (the one registry
of rules), ``inference`` (forward, backward and grad inference through the
registry, with the reshards they need), ``local`` (a rule's local computation
under ``shard_map``), ``region`` (composite ops traced as one equation, their
programs at planned layouts). The rule catalogue itself is ``rules/``.
"""
