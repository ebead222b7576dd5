"""Checkpoint policies: which values of a block's forward pass the checkpoint keeps.

A checkpoint keeps its block's inputs and recomputes everything else in the
backward pass. A *policy* keeps some forward values as well, and the
recomputation reuses them instead of computing them again: less recompute
work, more memory held between the forward and the backward pass. As in
JAX's ``jax.checkpoint_policies``, a policy is a plain function of a
:class:`Saveable` returning whether to keep it; gradients are exact whatever
it returns. This module only re-exports (:mod:`nuvec_mlx._policies` defines
them, and says what each kind of value is).

Example:
    >>> nv.checkpoint_layers(model, policy=nv.policies.save_matmuls)
    >>> keep = lambda v: nv.policies.save_names("attn_out")(v) or v.name.endswith("up_proj")
    >>> nv.checkpoint_layers(model, policy=keep)
"""

from ._policies import NAMED, Policy, save_everything, save_matmuls, save_names, save_nothing
from ._saving import Saveable

__all__ = ["NAMED", "Policy", "Saveable", "save_everything", "save_matmuls", "save_names", "save_nothing"]
