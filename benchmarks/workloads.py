"""The benchmark's workloads: the seed MLP and a small decoder-only transformer.

Each workload is ``blocks`` residual blocks written as flat functions
(``list[mx.array] -> list[mx.array]``), one ``value_and_grad`` step with
respect to the input only (or, with ``weight_grads``, to every weight too),
compiled by default. The seed MLP is nuvec-compile 0.6.1's checkpoint memory
test: blocks ``[B, D] -> [B, 4D] -> [B, D]`` in float32, B=4096, D=256, 8
blocks. ``benchmarks/peers.py`` builds the same models in PyTorch and JAX.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

import nuvec_mlx as nv
from nuvec_mlx_bench import shapes

#: How each block is checkpointed, and how the step is evaluated:
#: ``none`` no checkpoint (mx.eval); ``none-policy`` no checkpoint (nv.eval);
#: ``mx`` :func:`mlx.core.checkpoint`; ``nn`` :func:`mlx.nn.utils.checkpoint`;
#: ``mx-ordered`` mx.checkpoint, with the weight gradients evaluated last block
#: first by hand, as the mflux project does; ``nuvec-nopolicy``
#: :func:`nuvec_mlx.checkpoint_flat` (mx.eval); ``nuvec`` checkpoint_flat (nv.eval).
STRATEGIES = ("none", "none-policy", "mx", "nn", "mx-ordered", "nuvec-nopolicy", "nuvec")
MODELS = ("mlp", "transformer")


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
    """Deterministic, well-scaled values (the seed's ``sin(arange * seed) * 0.05``)."""
    return (mx.sin(mx.arange(math.prod(shape), dtype=mx.float32) * seed) * 0.05).reshape(shape)


def block_weights(model: str, dim: int, i: int) -> list[mx.array]:
    """The weights of block ``i``; every block has its own values."""
    return [filled(shape, seed) for shape, seed in shapes.block_weights(model, dim, i)]


@dataclasses.dataclass
class Scenario:
    """The evaluated inputs (weights first, the input last) and the step of one workload.

    The step's outputs are the gradients, in input order, followed by the loss;
    ``evaluate`` is how the strategy evaluates them.
    """

    inputs: list[mx.array]
    step: Callable[[list[mx.array]], list[mx.array]]
    evaluate: Callable[[list[mx.array]], None]
    blocks: int


def build(
    strategy: str = "none",
    batch: int = 4096,
    dim: int = 256,
    blocks: int = 8,
    weight_grads: bool = False,
    compiled: bool = True,
    model: str = "mlp",
    seq: int = 1,
) -> Scenario:
    """Build one workload's step.

    Args:
        strategy: one of :data:`STRATEGIES`.
        batch, dim, blocks: the shapes; the seed uses 4096, 256 and 8.
        weight_grads: also differentiate every weight.
        compiled: compile the step with :func:`nuvec_mlx.compile_flat`.
        model: ``"mlp"`` (:func:`mlp_block`) or ``"transformer"``
            (:func:`transformer_block`, whose input is ``[batch, seq, dim]``).
        seq: the transformer's sequence length (the MLP ignores it).

    Example:
        >>> sc = build("nuvec", batch=256, dim=64)
        >>> sc.evaluate(sc.step(sc.inputs))
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    weights = [w for i in range(blocks) for w in block_weights(model, dim, i)]
    per = len(weights) // blocks
    inputs = weights + [filled((batch, dim) if model == "mlp" else (batch, seq, dim), shapes.INPUT_SEED)]
    mx.eval(inputs)
    fn = _wrap(strategy, mlp_block if model == "mlp" else transformer_block)

    def loss(xs: list[mx.array]) -> mx.array:
        h = xs[-1]
        for i in range(blocks):
            h = fn([h, *xs[per * i : per * (i + 1)]])[0]
        return h.sum()

    argnums = list(range(len(inputs))) if weight_grads else [len(weights)]
    vg = nv.value_and_grad_flat(loss, argnums)

    def step(xs: list[mx.array]) -> list[mx.array]:
        value, grads = vg(xs)
        return grads + [value]

    return Scenario(
        inputs,
        nv.compile_flat(step) if compiled else step,
        _evaluator(strategy, per, weight_grads),
        blocks,
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


def peak(scenario: Scenario, evaluate: Callable | None = None) -> int:
    """Peak bytes of one step above the memory active before it (cache cleared first).

    ``evaluate`` replaces the strategy's own evaluation, for example to set a budget.
    """
    with nv.memory.measure(clear_cache=True) as m:
        outputs = scenario.step(scenario.inputs)
        (evaluate or scenario.evaluate)(outputs)
        del outputs
    return m.peak
