"""Property tests: checkpointed gradients equal plain ones on random block graphs.

Graphs are stacks of blocks over a hidden state ``h`` (shape ``(b, d)``), a few
weight matrices and an int32 mask input. Each block applies a random sequence of
well-conditioned ops (bounded nonlinearities, matmuls with weights scaled by
``0.5 / sqrt(d)``, residual adds, the integer mask), may return a second output
that feeds the loss, and may be checkpointed, possibly with a checkpointed
sub-block nested inside. The same graph is differentiated plain and with its
checkpoints for a random ``argnums``; gradients must agree to 1e-6 relative to
each gradient's max-norm, eagerly and compiled (compiled checkpointed against
compiled plain, since fusion may round differently from eager).

The same graphs also run through :func:`nuvec_mlx.checkpoint` as functions of
pytrees: the weights and the input live in an ``nn.Module`` passed to each
block as an argument (a random subset of them frozen), and each block returns
a dict whose leaves include ``None``, ints, strings and tuples besides arrays;
the gradients of the module's trainable arrays must agree the same way.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (default, 300 examples in all: 240 eager, 60 compiled,
derandomized) and ``dev`` (more, random), registered in ``tests/conftest.py``.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

import nuvec_mlx as nv
from tests.helpers import assert_close

# The pytree form draws a quarter of the profile's examples too (it shares the flat form's graphs).
PYTREE_EXAMPLES = max(10, settings().max_examples // 4)

# Each distinct compiled graph is JIT-compiled anew (g++), so the compiled
# property draws a quarter of the profile's examples.
COMPILED_EXAMPLES = max(10, settings().max_examples // 4)

OPS = ["tanh", "sin", "scale", "matmul", "residual", "mask", "square"]


@st.composite
def graphs(draw):
    d = draw(st.integers(2, 4))
    b = draw(st.integers(1, 3))
    n_w = draw(st.integers(1, 3))

    def ops():
        return draw(
            st.lists(
                st.tuples(st.sampled_from(OPS), st.integers(0, n_w - 1)),
                min_size=1,
                max_size=4,
            )
        )

    blocks = []
    for _ in range(draw(st.integers(1, 4))):
        blocks.append(
            {
                "ops": ops(),
                "checkpoint": draw(st.booleans()),
                "inner": ops() if draw(st.booleans()) else None,
                "inner_checkpoint": draw(st.booleans()),
                "aux": draw(st.booleans()),
            }
        )
    # Inputs: 0 = x, 1 = int32 mask, 2.. = weights. argnums: float inputs only.
    floats = [0] + [2 + i for i in range(n_w)]
    argnums = draw(st.permutations(floats).flatmap(lambda p: st.integers(1, len(p)).map(lambda k: p[:k])))
    seed = draw(st.integers(0, 2**16))
    return {"d": d, "b": b, "n_w": n_w, "blocks": blocks, "argnums": list(argnums), "seed": seed}


def apply_ops(ops, h, ws, mask):
    for op, i in ops:
        if op == "tanh":
            h = mx.tanh(h)
        elif op == "sin":
            h = mx.sin(h)
        elif op == "scale":
            h = h * 0.75
        elif op == "matmul":
            h = mx.tanh(h @ ws[i])
        elif op == "residual":
            h = h + mx.tanh(h @ ws[i])
        elif op == "mask":
            h = h * mask.astype(h.dtype)
        elif op == "square":
            h = 0.5 * h * h
    return h


def build_loss(g, use_checkpoints):
    n_w = g["n_w"]

    def make_block(spec):
        inner_fn = None
        if spec["inner"] is not None:

            def inner_fn(xs):
                return [apply_ops(spec["inner"], xs[0], xs[2:], xs[1])]

            if use_checkpoints and spec["inner_checkpoint"]:
                inner_fn = nv.checkpoint_flat(inner_fn)

        def block(xs):
            h, mask, ws = xs[0], xs[1], xs[2:]
            if inner_fn is not None:
                h = inner_fn([h, mask, *ws])[0]
            h = apply_ops(spec["ops"], h, ws, mask)
            out = [h]
            if spec["aux"]:
                out.append(mx.cos(h).sum(axis=0))
            return out

        if use_checkpoints and spec["checkpoint"]:
            return nv.checkpoint_flat(block)
        return block

    blocks = [make_block(s) for s in g["blocks"]]

    def loss(xs):
        h, mask, ws = xs[0], xs[1], xs[2 : 2 + n_w]
        total = mx.array(0.0)
        for blk in blocks:
            out = blk([h, mask, *ws])
            h = out[0]
            for aux in out[1:]:
                total = total + 0.5 * aux.sum()
        return total + (h * h).sum()

    return loss


def inputs(g):
    k = mx.random.split(mx.random.key(g["seed"]), 3 + g["n_w"])
    d, b = g["d"], g["b"]
    x = mx.random.uniform(-1, 1, (b, d), key=k[0])
    mask = mx.random.randint(0, 2, (b, d), key=k[1]).astype(mx.int32)
    ws = [mx.random.normal((d, d), key=k[3 + i]) * (0.5 / d**0.5) for i in range(g["n_w"])]
    return [x, mask, *ws]


def gradients(g, use_checkpoints, compile_step):
    vg = nv.value_and_grad_flat(build_loss(g, use_checkpoints), g["argnums"])

    def step(xs):
        value, grads = vg(xs)
        return [value, *grads]

    if compile_step:
        step = nv.compile_flat(step)
    out = step(inputs(g))
    nv.eval(out)
    return out


@pytest.mark.slow
@given(g=graphs())
def test_checkpointed_gradients_equal_plain_eager(g):
    assert_close(gradients(g, True, False), gradients(g, False, False))


@pytest.mark.slow
@settings(max_examples=COMPILED_EXAMPLES)
@given(g=graphs())
def test_checkpointed_gradients_equal_plain_compiled(g, compiled):
    assert_close(gradients(g, True, True), gradients(g, False, True))


@settings(max_examples=6)
@given(g=graphs())
def test_checkpointed_gradients_equal_plain_compiled_a_few_graphs(g, compiled):
    """The developer loop's sample of the compiled test above (each graph compiles new kernels: slow)."""
    assert_close(gradients(g, True, True), gradients(g, False, True))


class Inputs(nn.Module):
    """A graph's input and weights as a module (``x``, ``w0``, ``w1``, ...); the int mask stays outside."""

    def __init__(self, x, ws, frozen):
        super().__init__()
        self.x = x
        for i, w in enumerate(ws):
            setattr(self, f"w{i}", w)
        self.freeze(keys=[k for k in self if k in frozen], strict=False)

    @property
    def ws(self):
        return [self[f"w{i}"] for i in range(len(self) - 1)]


def pytree_gradients(g, use_checkpoints, frozen):
    x, mask, *ws = inputs(g)
    model = Inputs(x, ws, frozen)

    def block(spec, i):
        def fn(h, mask, weights, *, index):
            if spec["inner"] is not None:

                def inner(h, mask, weights):
                    return {"h": apply_ops(spec["inner"], h, weights.ws, mask), "none": None}

                if use_checkpoints and spec["inner_checkpoint"]:
                    inner = nv.checkpoint(inner)
                h = inner(h, mask, weights)["h"]
            h = apply_ops(spec["ops"], h, weights.ws, mask)
            aux = mx.cos(h).sum(axis=0) if spec["aux"] else None
            return {"h": h, "aux": aux, "meta": (index, "block", None)}

        return nv.checkpoint(fn) if use_checkpoints and spec["checkpoint"] else fn

    blocks = [block(spec, i) for i, spec in enumerate(g["blocks"])]

    def loss(model):
        h, total = model.x, mx.array(0.0)
        for i, blk in enumerate(blocks):
            out = blk(h, mask, model, index=i)
            assert out["meta"] == (i, "block", None)
            h = out["h"]
            if out["aux"] is not None:
                total = total + 0.5 * out["aux"].sum()
        return total + (h * h).sum()

    value, grads = nn.value_and_grad(model, loss)(model)
    out = [value, *(v for _, v in tree_flatten(grads))]
    mx.eval(out)
    return out


@settings(max_examples=PYTREE_EXAMPLES)
@given(g=graphs(), frozen=st.sets(st.sampled_from(["x", "w0", "w1", "w2"]), max_size=2))
def test_checkpointed_pytree_gradients_equal_plain_with_modules_as_arguments_and_non_array_outputs(g, frozen):
    assert_close(pytree_gradients(g, True, frozen), pytree_gradients(g, False, frozen))
