"""The planner: which blocks to checkpoint, and how, so that a step fits a memory budget.

A product built on the public step (:class:`nuvec_mlx.TrainingStep`): it runs the
user's step a few times, reads memory after every stage, and answers before the
run whether it fits. :func:`plan` (and :class:`Planner`, for several budgets)
chooses a policy per block, :func:`largest_fit` the largest batch or sequence,
:func:`saved_activations` lists what each block keeps. This package only
re-exports; ``nuvec_mlx`` re-exports it in turn.
"""

from ._record import Block, Plan
from .fit import Fit, largest_fit
from .plan import Planner, plan
from .saved import SavedActivations, saved_activations

__all__ = ["Block", "Fit", "Plan", "Planner", "SavedActivations", "largest_fit", "plan", "saved_activations"]
