"""The seed scenario: nuvec-compile 0.6.1's checkpoint memory test, in Python.

Eight residual MLP blocks ``[B, D] -> [B, 4D] -> [B, D]`` in float32, one
compiled ``value_and_grad`` step with respect to the input only (or, with
``weight_grads``, to all weights too), evaluated by one evaluation call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import mlx.core as mx

import nuvec_mlx as nv


def block(xs: list[mx.array]) -> list[mx.array]:
    """One block: a wide two-layer MLP with a residual."""
    x, w1, w2 = xs
    h = mx.tanh(x @ w1)
    h = mx.tanh(h * h)
    return [x + mx.tanh(h @ w2)]


def filled(shape: tuple[int, ...], seed: float) -> mx.array:
    """Deterministic, well-scaled values (the seed's ``sin(arange * seed) * 0.05``)."""
    n = 1
    for s in shape:
        n *= s
    return (mx.sin(mx.arange(n, dtype=mx.float32) * seed) * 0.05).reshape(shape)


@dataclasses.dataclass
class Scenario:
    """Inputs and the compiled step of one seed configuration."""

    inputs: list[mx.array]
    step: nv.CompiledFlat


def build(
    strategy: str = "none",
    batch: int = 4096,
    dim: int = 256,
    blocks: int = 8,
    weight_grads: bool = False,
    compiled: bool = True,
) -> Scenario:
    """Build the seed step.

    Args:
        strategy: ``"none"``, ``"nuvec"`` (:func:`nuvec_mlx.checkpoint_flat`)
            or ``"mx"`` (:func:`mlx.core.checkpoint`).
        batch, dim, blocks: the shapes; the seed uses 4096, 256 and 8.
        weight_grads: also differentiate every weight (``2 * blocks`` more outputs).
        compiled: compile the step with :func:`nuvec_mlx.compile_flat`.

    Returns:
        The evaluated inputs (weights first, the input last) and the step,
        whose outputs are the gradients followed by the loss.
    """
    wrap = _strategies()[strategy]
    weights = []
    for i in range(blocks):
        weights += [filled((dim, 4 * dim), 0.11 + i), filled((4 * dim, dim), 0.23 + i)]
    inputs = weights + [filled((batch, dim), 0.37)]
    mx.eval(inputs)
    fns = [wrap(block) for _ in range(blocks)]

    def loss(xs: list[mx.array]) -> mx.array:
        h = xs[-1]
        for i, f in enumerate(fns):
            h = f([h, xs[2 * i], xs[2 * i + 1]])[0]
        return h.sum()

    argnums = list(range(2 * blocks + 1)) if weight_grads else [2 * blocks]
    vg = nv.value_and_grad_flat(loss, argnums)

    def step(xs: list[mx.array]) -> list[mx.array]:
        value, grads = vg(xs)
        return grads + [value]

    if compiled:
        return Scenario(inputs, nv.compile_flat(step))
    return Scenario(inputs, step)


def _mx_checkpoint(fn: Callable) -> Callable:
    ck = mx.checkpoint(lambda *xs: fn(list(xs)))
    return lambda xs: ck(*xs)


def _strategies() -> dict[str, Callable]:
    return {"none": lambda f: f, "nuvec": nv.checkpoint_flat, "mx": _mx_checkpoint}


def peak(scenario: Scenario, evaluate: Callable = nv.eval) -> int:
    """Peak bytes of one step above the memory active before it (cache cleared first)."""
    with nv.memory.measure(clear_cache=True) as m:
        outputs = scenario.step(scenario.inputs)
        evaluate(outputs)
        del outputs
    return m.peak
