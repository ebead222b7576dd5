"""``nuvec-mlx-bench-plan``: the planner against a sweep of budgets and the fixed checkpointing rules it replaces.

:mod:`.command` runs it; :mod:`.rules` sets a model's blocks up as a plan or a
fixed rule says and measures its step.
"""
