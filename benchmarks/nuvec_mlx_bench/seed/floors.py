"""The analytic floor of a checkpointed step: the bytes it cannot go below, from its shapes.

The floor counts what a checkpointed backward pass must hold at once, by
MLX's own vjps (MLX 0.32, float32), above the memory active before the step
(the step's input and the weights, already resident):

- the stored block inputs: block ``i``'s input ``x_i`` (``i >= 1``) stays until
  block ``i``'s backward has finished, so the first block the backward pass
  reaches (the last) finds ``blocks - 1`` of them;
- the weight gradients of the blocks already done (with ``weight_grads``):
  they are the step's outputs and stay;
- one block's backward live set at its worst moment (:func:`mlp_moments`,
  :func:`transformer_moments`), including the weight gradients it has written
  by then, and its cotangent (a block input's size) where that is still alive;
  the loss's cotangent, which reaches the last block, is a broadcast scalar.

Each block is recomputed once, from its stored input, when its cotangent
arrives. Every array is freed when nothing later reads it; element-wise
chains are fused and written in place where their input is read no more (as
``mx.compile`` does); a matmul writes a fresh buffer; views (splits,
transposes, broadcasts) cost nothing but keep their whole buffer alive.
Arrays that do not grow with the batch (the causal mask, layer-norm
statistics, the scalar loss) are left out; so are copies a kernel may make of
a strided input. Where backends differ, the floor takes the smaller. The
forward pass holds less at every block: a checkpointed block keeps nothing.
"""

from __future__ import annotations

import dataclasses

from .workload import ITEMSIZE, Workload


@dataclasses.dataclass(frozen=True)
class Moment:
    """A moment of one block's backward pass and the bytes alive then.

    Attributes:
        what: the array being written, and what is alive beside it.
        nbytes: the block's own arrays alive then (its weight gradients so far included).
        holds_cotangent: whether the block's cotangent is still alive then.
    """

    what: str
    nbytes: int
    holds_cotangent: bool


def mlp_moments(w: Workload) -> list[Moment]:
    """The worst moments of one :func:`nuvec_mlx_bench.testing.mlp_block` backward.

    The block is ``a = x @ w1; h1 = tanh(a); u = h1 * h1; h2 = tanh(u);
    z = h2 @ w2; out = x + tanh(z)``. MLX's tanh vjp reads its input
    (``1 / cosh(a)**2``) and the product's reads ``h1``, so ``a``, ``h1`` and
    ``u`` (``[B, 4D]`` each) stay from the recomputation to the end of the
    block's backward. Beside them: the recomputed ``h2`` ``[B, 4D]`` while
    ``z = h2 @ w2`` ``[B, D]`` is written, and later ``dh2 = dz @ w2.T``
    ``[B, 4D]`` while ``dz`` ``[B, D]`` is read: 17 block inputs either way.
    With weight gradients ``h2`` stays for ``dw2 = h2.T @ dz`` (``[4D, D]``),
    written first, after which ``h2`` goes before ``dh2`` arrives.

    Example:
        >>> [m.nbytes for m in mlp_moments(Workload("mlp", batch=4096, dim=256, blocks=8))]
        [71303168, 71303168]
    """
    x = w.block_input_bytes()
    dw2 = ITEMSIZE * 4 * w.dim * w.dim if w.weight_grads else 0
    return [
        Moment("z = h2 @ w2 beside a, h1, u, h2", 16 * x + x, True),
        Moment("dh2 = dz @ w2.T beside a, h1, u, dz" + (", dw2" if w.weight_grads else ""), 16 * x + x + dw2, True),
    ]


def transformer_moments(w: Workload) -> list[Moment]:
    """The worst moments of one :func:`nuvec_mlx_bench.testing.transformer_block` backward.

    For float32, MLX's ``scaled_dot_product_attention`` runs its unfused
    fallback on every backend (cuDNN's kernel takes half precision only, and
    Metal runs the fallback for training), whose vjp materialises the scores:
    ``S`` = ``[B, T, T]`` (one head). From the recomputation, through the MLP
    part's backward, stay: ``qkv`` ``[B, T, 3D]`` (``k`` and ``v`` are views
    of it, read by the attention's backward), ``q * scale`` ``[B, T, D]``
    (read by ``dk``), the softmax output ``p`` (``S``; its vjp reads it, and
    ``dv`` does), the second layer norm's input (its vjp reads it) and
    ``f = h2 @ w1`` ``[B, T, 4D]`` (gelu's vjp reads it). Then
    ``dg1 = g @ w2.T`` ``[B, T, 4D]`` arrives: ``13 X + S``. In the attention's
    backward ``dp = da @ v.T`` (``S``) is written beside ``p``, ``qkv``,
    ``q * scale``, ``dx2``, ``da`` and ``dv``: ``7 X + 2 S``, the cotangent
    already added into ``dx2``. With weight gradients also stay ``h`` (for
    ``dwqkv``), the attention output (``dwo``), ``h2`` (``dw1``) and
    ``gelu(f)`` ``[B, T, 4D]`` (``dw2``, written before ``dg1``): ``16 X + S``
    and ``8 X + 2 S``, with the weight gradients written by then.

    Example:
        >>> w = Workload("transformer", batch=8, dim=1024, blocks=8, seq=2048)
        >>> [m.nbytes >> 20 for m in transformer_moments(w)]
        [960, 704]
    """
    x = w.block_input_bytes()
    s = ITEMSIZE * w.batch * w.seq * w.seq
    d2 = ITEMSIZE * w.dim * w.dim
    if not w.weight_grads:
        return [
            Moment("dg1 = g @ w2.T beside qkv, q*scale, p, x2, f", 13 * x + s, True),
            Moment("dp = da @ v.T beside qkv, q*scale, p, dx2, da, dv", 7 * x + 2 * s, False),
        ]
    return [
        Moment("dg1 = g @ w2.T beside qkv, q*scale, p, h, a, x2, h2, f, dw2", 16 * x + s + 4 * d2, True),
        Moment("dp = da @ v.T beside qkv, q*scale, h, p, dx2, da, dv, dw2, dw1, dwo", 8 * x + 2 * s + 9 * d2, False),
    ]


#: Each model's moments.
MOMENTS = {"mlp": mlp_moments, "transformer": transformer_moments}
#: Each model's weights per block, in units of D**2 elements.
WEIGHT_ELEMENTS = {"mlp": 8, "transformer": 12}


def floor(w: Workload) -> int:
    """The bytes a checkpointed step of ``w`` cannot go below, above the memory active before it.

    The maximum, over the block ``i`` being back-propagated and its moments
    ``m``, of ``i * X`` (stored inputs ``x_1 .. x_i``) + ``(blocks - 1 - i) * G``
    (finished blocks' weight gradients, with ``weight_grads``) + ``m.nbytes``
    + ``X`` where ``m`` holds the cotangent of a block other than the last;
    ``X`` is a block input's bytes, ``G`` a block's weights' bytes.

    Example:
        >>> floor(Workload("mlp", batch=4096, dim=256, blocks=8)) >> 20  # (blocks + 16) block inputs
        96
    """
    x = w.block_input_bytes()
    g = ITEMSIZE * WEIGHT_ELEMENTS[w.model] * w.dim * w.dim if w.weight_grads else 0
    last = w.blocks - 1
    return max(
        i * x + (last - i) * g + m.nbytes + (x if m.holds_cotangent and i < last else 0)
        for i in range(w.blocks)
        for m in MOMENTS[w.model](w)
    )
