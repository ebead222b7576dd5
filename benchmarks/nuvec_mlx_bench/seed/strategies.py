"""The seed workloads in MLX, checkpointed and evaluated as each strategy says.

Each :class:`~.workload.Workload` is ``blocks`` residual blocks
(:data:`nuvec_mlx_bench.testing.BLOCK_FUNCTIONS`: flat functions, ``list[mx.array] ->
list[mx.array]``), one ``value_and_grad`` step with respect to the input only
(or, with ``weight_grads``, to every weight too), compiled unless the workload
says otherwise (:func:`build`); or the same blocks as ``mlx.nn`` modules in a
model's ``layers`` (:func:`module`), for the planner. The weights and input are
the workload's host values (:func:`~.workload.host_inputs`), which the peers
take too. The seed MLP is nuvec-compile 0.6.1's checkpoint memory test
(:data:`~.workload.SEED`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

import nuvec_mlx as nv

from .. import testing
from .workload import Workload, host_inputs

#: How each block is checkpointed, and how the step is evaluated:
#: ``none`` no checkpoint (mx.eval); ``none-policy`` no checkpoint (nv.eval);
#: ``mx`` :func:`mlx.core.checkpoint`; ``nn`` :func:`mlx.nn.utils.checkpoint`;
#: ``mx-ordered`` mx.checkpoint, with the weight gradients evaluated last block
#: first by hand, as the mflux project does; ``nuvec-nopolicy``
#: :func:`nuvec_mlx.checkpoint_flat` (mx.eval, unstaged on purpose: :func:`unstaged_eval`); ``nuvec``
#: checkpoint_flat (nv.eval).
STRATEGIES = ("none", "none-policy", "mx", "nn", "mx-ordered", "nuvec-nopolicy", "nuvec")


@dataclasses.dataclass
class Scenario:
    """The evaluated inputs (weights first, the input last) and the step of one workload.

    The step's outputs are the gradients, in input order, followed by the loss;
    ``evaluate`` is how the strategy evaluates them.
    """

    inputs: list[mx.array]
    step: Callable[[list[mx.array]], list[mx.array]]
    evaluate: Callable[[list[mx.array]], None]


def build(strategy: str, workload: Workload) -> Scenario:
    """Build one workload's step, checkpointed and evaluated as ``strategy`` says.

    Args:
        strategy: one of :data:`STRATEGIES`.
        workload: the model, its shape and which gradients to take.

    Raises:
        ValueError: ``strategy`` is not one of :data:`STRATEGIES`.

    Example:
        >>> sc = build("nuvec", Workload("mlp", batch=256, dim=64, blocks=8))
        >>> sc.evaluate(sc.step(sc.inputs))
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    host_weights, host_x = host_inputs(workload)
    xs = [mx.array(a) for a in [*host_weights, host_x]]
    mx.eval(xs)
    per = len(host_weights) // workload.blocks
    loss = testing.flat_loss(workload.model, workload.blocks, _wrapper(strategy))
    argnums = list(range(len(xs))) if workload.weight_grads else [len(xs) - 1]
    vg = nv.value_and_grad_flat(loss, argnums)

    def step(xs: list[mx.array]) -> list[mx.array]:
        value, grads = vg(xs)
        return grads + [value]

    return Scenario(
        xs,
        nv.compile_flat(step) if workload.compiled else step,
        _evaluator(strategy, per, workload.weight_grads),
    )


def module(workload: Workload) -> tuple[testing.Blocks, mx.array]:
    """The workload's blocks as a :class:`nuvec_mlx_bench.testing.Blocks` model and its input, evaluated.

    The loss is :func:`nuvec_mlx_bench.testing.blocks_loss`; a step of it
    differentiates every weight (``weight_grads`` is the step's affair).

    Example:
        >>> model, x = module(Workload("transformer", batch=2, dim=64, blocks=4, seq=128))
    """
    host_weights, host_x = host_inputs(workload)
    per = len(host_weights) // workload.blocks
    weights = [[mx.array(w) for w in host_weights[per * i : per * (i + 1)]] for i in range(workload.blocks)]
    model, x = testing.Blocks(workload.model, weights), mx.array(host_x)
    mx.eval(model.parameters(), x)
    return model, x


def _wrapper(strategy: str) -> Callable[[Callable], Callable] | None:
    """How ``strategy`` wraps a flat block (``None``: not at all)."""
    if strategy.startswith("nuvec"):
        return nv.checkpoint_flat
    if strategy in ("mx", "mx-ordered"):
        return lambda block: _spread(mx.checkpoint(lambda *xs: block(list(xs))))
    if strategy == "nn":  # the weights come in as arguments, so the module holds no parameters
        return lambda block: _spread(nn.utils.checkpoint(nn.Module(), lambda *xs: block(list(xs))))
    return None


def _spread(checkpointed: Callable) -> Callable[[list[mx.array]], list[mx.array]]:
    """A function of arrays as a function of their list."""
    return lambda xs: checkpointed(*xs)


def _evaluator(strategy: str, per: int, weight_grads: bool) -> Callable[[list[mx.array]], None]:
    if strategy in ("nuvec", "none-policy"):
        return nv.eval
    if strategy == "nuvec-nopolicy":
        return unstaged_eval
    if strategy == "mx-ordered" and weight_grads:
        return lambda outputs: ordered_eval(outputs, per)
    return mx.eval


def unstaged_eval(outputs: list[mx.array]) -> None:
    """Evaluate a step of nuvec's checkpoints unstaged, on purpose: ``nuvec-nopolicy``, the checkpoint
    without :func:`nuvec_mlx.eval`'s stages.

    The whole step is one :func:`mlx.core.eval`, as MLX's evaluator orders it. Its stages, computed by
    that evaluation, are then taken by :func:`nuvec_mlx.eval`, which finds nothing left to evaluate:
    a step whose stages no ``nv.eval`` takes is what :class:`nuvec_mlx.NotStagedWarning` warns of, and
    here it is the design, not a mistake.
    """
    mx.eval(outputs)
    nv.eval(outputs)


def ordered_eval(outputs: list[mx.array], per: int) -> None:
    """Evaluate the weight gradients last block first, one :func:`mlx.core.eval` per block.

    This is how mflux bounds its backward pass by hand. ``outputs`` are a
    step's outputs with weight gradients: ``per`` gradients for each block,
    the input's gradient, then the loss.
    """
    weight_grads = outputs[:-2]
    for i in reversed(range(0, len(weight_grads), per)):
        mx.eval(weight_grads[i : i + per])
    mx.eval(outputs)
