"""An optimizer's update that spends each block's gradients as soon as they are done.

Inside a compiled step, :func:`nuvec_mlx.eval` evaluates the backward pass one
checkpointed block at a time (:mod:`nuvec_mlx._marks`). ``optimizer.update``
then runs after the last of those stages, when every gradient is alive at
once: in full fine-tuning that is a floor of one more copy of the weights,
whatever the batch. :func:`update` makes the update of each block's
parameters a stage of its own, right after that block's backward stage, so
each block's gradients are freed before the next block's are made (what a
single ``mx.eval`` of an unstaged step does by itself). A block whose
parameters are small beside its backward stage (LoRA's adapters) has its
update computed in the stage after instead, which saves a wait on the device
(:data:`nuvec_mlx._marks.FOLD`).
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from . import _marks, _validate


def update(optimizer: optim.Optimizer, model: nn.Module, gradients: Any) -> None:
    """``optimizer.update(model, gradients)``, each checkpointed block's update a stage after its backward.

    Use it in place of ``optimizer.update`` inside a step compiled with
    :func:`nuvec_mlx.compile` whose gradients come from
    :func:`nuvec_mlx.value_and_grad`, and evaluated with :func:`nuvec_mlx.eval`.
    Values are those of ``optimizer.update``; parameters no checkpoint took are
    updated with the outputs, as before. An update under 1/8 of its block's
    backward stage in bytes (LoRA's adapters) is computed in the next stage,
    not a stage of its own. Outside a compiled step it is
    ``optimizer.update``. Gradients averaged across processes in buckets
    (``nn.average_gradients`` on several ranks) tie the blocks of a bucket
    together: a block's update stage then computes every gradient in its bucket.

    Args:
        optimizer: an ``mlx.optimizers`` optimizer.
        model: the model whose trainable parameters ``gradients`` mirror.
        gradients: the gradients, as ``nn.value_and_grad`` returns them.

    Example:
        >>> @nv.compile(inputs=state, outputs=state)
        ... def step(x, y):
        ...     loss, grads = nv.value_and_grad(model, loss_fn)(model, x, y)
        ...     nv.update(optimizer, model, grads)
        ...     return loss
    """
    _validate.check_optimizer(optimizer, "optimizer")
    _validate.check_module(model, "model")
    optimizer.update(model, gradients)
    last = _marks.last_backward()
    stage_of = {path: last[id(m)] for path, m in model.named_modules() if id(m) in last}
    if not stage_of:
        return
    groups: dict[int, list[str]] = {}
    params = dict(tree_flatten(model.trainable_parameters()))
    for name in params:
        # The last stage of a checkpointed module that holds it: the parameter's gradient is done there.
        found = [i for path, i in stage_of.items() if not path or name.startswith(path + ".")]
        if found:
            groups.setdefault(max(found), []).append(name)
    staged = _marks.update_stages({i: [params[n] for n in names] for i, names in groups.items()})
    model.update(tree_unflatten([(n, a) for i, names in groups.items() for n, a in zip(names, staged[i])]))
