"""The planner: which blocks to checkpoint, and how, so that a step fits a memory budget.

Built on the public step (:class:`nuvec_mlx.TrainingStep`) and its memory
readings (:func:`nuvec_mlx.memory.timeline`): it runs the user's step a few
times, reads memory after every stage, and answers before the run whether it
fits. Beside the public API it shares the package's internal helpers: argument
checks (``_validate``), trees (``_pytree``), snapshots of arrays (``_state``),
the unit of its figures (``_units``), the policies' names and costs
(``_policies``), and, for :func:`saved_activations` alone, the checkpoint's
own rules of what a block saves (``_saving``, ``_calls``). :func:`plan` (and :class:`Planner`, for several budgets)
chooses a policy per block, :func:`largest_fit` the largest batch or sequence,
:func:`saved_activations` lists what each block keeps. This package only
re-exports; ``nuvec_mlx`` re-exports it in turn.
"""

from ._record import Block, MadeFor, Plan
from .fit import Fit, largest_fit
from .plan import Planner, plan
from .saved import SavedActivations, saved_activations

__all__ = ["Block", "Fit", "MadeFor", "Plan", "Planner", "SavedActivations", "largest_fit", "plan", "saved_activations"]
