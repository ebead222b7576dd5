"""The benchmark's workloads in MLX: the seed MLP and a small decoder-only transformer.

Each :class:`~nuvec_mlx_bench.workload.Workload` is ``blocks`` residual blocks
written as flat functions (``list[mx.array] -> list[mx.array]``), one
``value_and_grad`` step with respect to the input only (or, with
``weight_grads``, to every weight too), compiled unless the workload says
otherwise. The seed MLP is nuvec-compile 0.6.1's checkpoint memory test
(:data:`~nuvec_mlx_bench.workload.SEED`). :mod:`nuvec_mlx_bench.peers`
builds the same models in PyTorch and JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

import nuvec_mlx as nv
from nuvec_mlx_bench import inputs
from nuvec_mlx_bench.workload import Workload

#: How each block is checkpointed, and how the step is evaluated:
#: ``none`` no checkpoint (mx.eval); ``none-policy`` no checkpoint (nv.eval);
#: ``mx`` :func:`mlx.core.checkpoint`; ``nn`` :func:`mlx.nn.utils.checkpoint`;
#: ``mx-ordered`` mx.checkpoint, with the weight gradients evaluated last block
#: first by hand, as the mflux project does; ``nuvec-nopolicy``
#: :func:`nuvec_mlx.checkpoint_flat` (mx.eval); ``nuvec`` checkpoint_flat (nv.eval).
STRATEGIES = ("none", "none-policy", "mx", "nn", "mx-ordered", "nuvec-nopolicy", "nuvec")


def mlp_block(xs: list[mx.array]) -> list[mx.array]:
    """The seed's block: a wide two-layer MLP with a residual."""
    x, w1, w2 = xs
    h = mx.tanh(x @ w1)
    h = mx.tanh(h * h)
    return [x + mx.tanh(h @ w2)]


def transformer_block(xs: list[mx.array]) -> list[mx.array]:
    """A pre-norm decoder block on ``[B, T, D]``: causal single-head attention, then a 4x MLP."""
    x, wqkv, wo, w1, w2 = xs
    h = mx.fast.layer_norm(x, None, None, 1e-5)
    q, k, v = mx.split((h @ wqkv)[:, None], 3, axis=-1)
    a = mx.fast.scaled_dot_product_attention(q, k, v, scale=x.shape[-1] ** -0.5, mask="causal")
    x = x + a[:, 0] @ wo
    h = mx.fast.layer_norm(x, None, None, 1e-5)
    return [x + nn.gelu(h @ w1) @ w2]


def filled(shape: tuple[int, ...], seed: float) -> mx.array:
    """:func:`nuvec_mlx_bench.inputs.filled` as an MLX array."""
    return mx.array(inputs.filled(shape, seed))


def block_weights(workload: Workload, i: int) -> list[mx.array]:
    """The weights of block ``i`` of ``workload``; every block has its own values."""
    return [mx.array(w) for w in inputs.block_weights(workload, i)]


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
    host_weights, host_x = inputs.host_inputs(workload)
    xs = [mx.array(a) for a in [*host_weights, host_x]]
    mx.eval(xs)
    per = len(host_weights) // workload.blocks
    fn = _wrap(strategy, mlp_block if workload.model == "mlp" else transformer_block)

    def loss(xs: list[mx.array]) -> mx.array:
        h = xs[-1]
        for i in range(workload.blocks):
            h = fn([h, *xs[per * i : per * (i + 1)]])[0]
        return h.sum()

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


def _wrap(strategy: str, block: Callable) -> Callable:
    if strategy.startswith("nuvec"):
        return nv.checkpoint_flat(block)
    if strategy in ("mx", "mx-ordered"):
        ck = mx.checkpoint(lambda *xs: block(list(xs)))
    elif strategy == "nn":
        # The weights come in as arguments, so the module holds no parameters.
        ck = nn.utils.checkpoint(nn.Module(), lambda *xs: block(list(xs)))
    else:
        return block
    return lambda xs: ck(*xs)


def _evaluator(strategy: str, per: int, weight_grads: bool) -> Callable[[list[mx.array]], None]:
    if strategy in ("nuvec", "none-policy"):
        return nv.eval
    if strategy == "mx-ordered" and weight_grads:
        return lambda outputs: ordered_eval(outputs, per)
    return mx.eval


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
