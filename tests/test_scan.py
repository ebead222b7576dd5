"""nv.scan: a recurrence in checkpointed chunks, the values and gradients of the token-by-token loop, its memory
linear in the sequence, each chunk a stage."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten

import nuvec_mlx as nv
from nuvec_mlx.scan import scan
from tests.helpers import assert_close, rise

B, T, D = 2, 37, 8


def data(seed: int = 0):
    mx.random.seed(seed)
    h0, xs = mx.random.normal((B, D)), mx.random.normal((B, T, D))
    w = mx.random.normal((D, D)) * 0.3
    mx.eval(h0, xs, w)
    return h0, xs, w


def rnn(h, inputs):
    """A small recurrence, token by token: ``h = tanh(h w + x_t)``; the outputs are the states."""
    w, x = inputs
    ys = []
    for t in range(x.shape[1]):
        h = mx.tanh(h @ w + x[:, t])
        ys.append(h)
    return h, mx.stack(ys, axis=1)


def plain_loss(h0, xs, w):
    h, ys = rnn(h0, (w, xs))
    return (ys**2).sum() + (3 * h).sum()


def scan_loss(h0, xs, w, chunk=8):
    h, ys = scan(rnn, h0, (w, xs), chunk=chunk, axis=(None, 1))
    return (ys**2).sum() + (3 * h).sum()


@pytest.mark.parametrize("chunk", [8, 7, T, 1000])
def test_values_and_gradients_are_the_token_by_token_loop_s(chunk):
    h0, xs, w = data()
    plain = mx.value_and_grad(plain_loss, argnums=(0, 1, 2))(h0, xs, w)
    chunked = mx.value_and_grad(lambda *a: scan_loss(*a, chunk=chunk), argnums=(0, 1, 2))(h0, xs, w)
    assert_close(chunked[0], plain[0], 1e-6)
    # The initial state's, each token's (concatenated per chunk) and the weight's (summed over the chunks).
    assert_close(list(chunked[1]), list(plain[1]), 1e-5)
    h, ys = scan(rnn, h0, (w, xs), chunk=chunk, axis=(None, 1))
    assert_close([h, ys], list(rnn(h0, (w, xs))), 1e-6)


def test_pytrees_in_and_out_and_a_module_fn_reaches():
    """A state of two arrays in a dict, xs a dict, outputs a tuple; a module reached by closure: its trainable
    parameters differentiated (summed over chunks), its frozen ones not."""
    h0, xs, _ = data()
    cell = nn.Linear(D, D)
    cell.freeze(keys=["bias"])
    mx.eval(cell.parameters())

    def step(state, inputs):
        h, c = state["h"], state["c"]
        hs, cs = [], []
        for t in range(inputs["x"].shape[1]):
            c = 0.5 * c + inputs["x"][:, t]
            h = mx.tanh(cell(h) + c)
            hs.append(h)
            cs.append(c)
        return {"h": h, "c": c}, (mx.stack(hs, axis=1), mx.stack(cs, axis=1))

    def loss(model, h0, xs, chunk):
        init = {"h": h0, "c": mx.zeros_like(h0)}
        run = step if chunk is None else lambda s, i: scan(step, s, i, chunk=chunk)
        state, (hs, cs) = run(init, {"x": xs})
        return (hs**2).sum() + cs.sum() + state["h"].sum()

    plain = nn.value_and_grad(cell, lambda m, h, x: loss(m, h, x, None))(cell, h0, xs)
    chunked = nn.value_and_grad(cell, lambda m, h, x: loss(m, h, x, 8))(cell, h0, xs)
    assert_close(chunked[0], plain[0], 1e-6)
    assert list(chunked[1]) == ["weight"]  # the frozen bias is a constant
    assert_close(chunked[1]["weight"], plain[1]["weight"], 1e-5)


def test_forward_mode_batching_and_per_example_gradients_go_through_the_scan():
    h0, xs, w = data()
    tangents = [mx.random.normal(h0.shape), mx.random.normal(xs.shape), mx.random.normal(w.shape)]
    assert_close(mx.jvp(scan_loss, [h0, xs, w], tangents)[1][0], mx.jvp(plain_loss, [h0, xs, w], tangents)[1][0], 1e-5)
    hs, xss = h0[:, None], xs[:, None]  # a batch of two examples of batch 1
    assert_close(
        mx.vmap(scan_loss, in_axes=(0, 0, None))(hs, xss, w), mx.vmap(plain_loss, in_axes=(0, 0, None))(hs, xss, w)
    )
    per_example = mx.vmap(mx.grad(scan_loss, argnums=2), in_axes=(0, 0, None))(hs, xss, w)
    assert_close(per_example, mx.vmap(mx.grad(plain_loss, argnums=2), in_axes=(0, 0, None))(hs, xss, w), 1e-5)
    # An unbatched initial state: carried batched from the first chunk on.
    assert_close(
        mx.vmap(scan_loss, in_axes=(None, 0, None))(h0, xss, w),
        mx.vmap(plain_loss, in_axes=(None, 0, None))(h0, xss, w),
    )


def test_a_second_derivative_through_the_scan_s_gradients_raises():
    h0, xs, w = data()
    with pytest.raises(ValueError, match="first derivatives only"):
        mx.eval(mx.grad(lambda w: mx.grad(scan_loss, argnums=2)(h0, xs, w).sum())(w))
    with pytest.raises(ValueError, match="first derivatives only"):
        mx.eval(mx.jvp(lambda w: mx.grad(scan_loss, argnums=2)(h0, xs, w), [w], [mx.ones_like(w)]))


def test_random_draws_are_replayed_by_the_recomputation():
    h0, xs, w = data()

    def noisy(h, inputs):
        w, x = inputs
        return rnn(h, (w, x * mx.random.bernoulli(0.5, x.shape)))

    def by_hand(h0, xs, w):  # the chunks one after the other, unchecked: the same draws in the same order
        h, ys = h0, []
        for s in range(0, T, 8):
            h, y = noisy(h, (w, xs[:, s : s + 8]))
            ys.append(y)
        return (mx.concatenate(ys, axis=1) ** 2).sum() + h.sum()

    def scanned(h0, xs, w):
        h, ys = scan(noisy, h0, (w, xs), chunk=8, axis=(None, 1))
        return (ys**2).sum() + h.sum()

    def run(loss):
        mx.random.seed(3)
        return mx.value_and_grad(loss, argnums=(1, 2))(h0, xs, w)

    got, expected = run(scanned), run(by_hand)
    assert mx.array_equal(got[0], expected[0]).item()
    assert_close(list(got[1]), list(expected[1]), 1e-5)


def test_each_chunk_is_a_stage_forward_and_backward():
    h0, xs, w = data()
    step = nv.value_and_grad_flat(lambda a: scan_loss(*a), [0, 1, 2])
    with nv.memory.timeline() as timeline:
        nv.eval(step([h0, xs, w]))
    chunks = -(-T // 8)
    # The forward's chunks, the cotangents of the outputs, the backward's chunks.
    assert [r.kind for r in timeline.readings] == ["chunk"] * (2 * chunks + 1) + ["outputs"]


def test_compiled_as_uncompiled(compiled):
    h0, xs, w = data()
    expected = mx.value_and_grad(plain_loss, argnums=(0, 1, 2))(h0, xs, w)
    step = nv.compile(lambda *a: nv.value_and_grad_flat(lambda a: scan_loss(*a), [0, 1, 2])(list(a)))
    for _ in range(2):
        value, grads = step(h0, xs, w)
        nv.eval(value, grads)
    assert step.traces == 1  # compiled for real: the second call replayed the first one's trace
    assert_close(value, expected[0], 1e-6)
    assert_close(grads, list(expected[1]), 1e-5)


class Recurrent(nn.Module):
    """A block with a recurrence inside: ``x + scan(tanh(h w + proj(x)_t))``; ``calls`` counts its chunks' runs."""

    def __init__(self, chunk):
        super().__init__()
        self.proj, self.w = nn.Linear(D, D), mx.random.normal((D, D)) * 0.3
        self.chunk, self.calls = chunk, [0]

    def __call__(self, x):
        def step(h, inputs):
            self.calls[0] += 1
            return rnn(h, inputs)

        h0 = mx.zeros((x.shape[0], D))
        if self.chunk is None:
            _, ys = step(h0, (self.w, self.proj(x)))
        else:
            _, ys = scan(step, h0, (self.w, self.proj(x)), chunk=self.chunk, axis=(None, 1))
        return x + ys


class Stack(nn.Module):
    def __init__(self, chunk):
        super().__init__()
        mx.random.seed(4)
        self.layers = [Recurrent(chunk) for _ in range(2)]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def stack_loss(model, x):
    return (model(x) ** 2).mean()


def test_nested_in_checkpointed_blocks_a_compiled_training_step_is_the_unchecked_step(compiled):
    _, xs, _ = data()
    plain = Stack(None)
    mx.eval(plain.parameters())
    expected = nn.value_and_grad(plain, stack_loss)(plain, xs)
    model = Stack(8)
    model.update(plain.parameters())
    nv.checkpoint_layers(model)
    step = nv.TrainingStep(model, stack_loss)
    with nv.memory.timeline() as timeline:
        value, grads = step(xs)
    assert_close(value, expected[0], 1e-6)
    for (_, got), (_, want) in zip(tree_flatten(grads), tree_flatten(expected[1]), strict=True):
        assert_close(got, want, 1e-5)
    chunks = -(-T // 8)
    # Each block's forward runs its chunks (stages), then its backward recomputes the block: the chunks
    # forward (stages, they feed the block's backward), the cotangents of the scan's outputs, then the
    # chunks backward, one at a time.
    block = ["chunk"] * chunks + ["forward"]
    assert [r.kind for r in timeline.readings] == (block * 2 + (["chunk"] * (2 * chunks + 1) + ["backward"]) * 2) + [
        "outputs"
    ]
    calls = model.layers[0].calls[0]
    step(xs)  # compiled: the second step runs no Python
    assert model.layers[0].calls[0] == calls


def test_a_training_step_with_an_optimizer_updates_as_the_unchecked_one(compiled):
    _, xs, _ = data()
    models = [Stack(None), Stack(8)]
    models[1].update(models[0].parameters())
    nv.checkpoint_layers(models[1])
    steps = [nv.TrainingStep(m, stack_loss, optim.Adam(1e-2), compile=i == 1) for i, m in enumerate(models)]
    for _ in range(3):
        losses = [s(xs) for s in steps]
    assert_close(losses[1], losses[0], 1e-5)
    for (_, got), (_, want) in zip(tree_flatten(models[1].parameters()), tree_flatten(models[0].parameters())):
        assert_close(got, want, 1e-5)


def test_a_fused_forward_computes_the_values_and_fn_the_gradients():
    """``forward``, the whole scan in one call (a kernel's stand-in): the forward pass runs it once, the backward
    pass chunk by chunk to rebuild the starting states (but the last), then recomputes the chunks with fn."""
    h0, xs, w = data()
    calls = []

    def fused(h, inputs):
        calls.append(inputs[1].shape[1])
        return rnn(h, inputs)

    def loss(h0, xs, w):
        h, ys = scan(rnn, h0, (w, xs), chunk=8, axis=(None, 1), forward=fused)
        return (ys**2).sum() + (3 * h).sum()

    got = mx.value_and_grad(loss, argnums=(0, 1, 2))(h0, xs, w)
    mx.eval(got)
    assert calls == [T] + [8] * (-(-T // 8) - 1)
    expected = mx.value_and_grad(plain_loss, argnums=(0, 1, 2))(h0, xs, w)
    assert_close(got[0], expected[0], 1e-6)
    assert_close(list(got[1]), list(expected[1]), 1e-5)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda h, x, w: scan(None, h, x, chunk=8), TypeError, "fn must be callable"),
        (lambda h, x, w: scan(rnn, h, (w, x), chunk=8.0, axis=(None, 1)), TypeError, "chunk must be an int"),
        (lambda h, x, w: scan(rnn, h, (w, x), chunk=0, axis=(None, 1)), ValueError, "chunk must be >= 1"),
        (lambda h, x, w: scan(rnn, [h, 1], (w, x), chunk=8, axis=(None, 1)), TypeError, "init must be a pytree"),
        (lambda h, x, w: scan(rnn, [], (w, x), chunk=8, axis=(None, 1)), ValueError, "init must hold"),
        (lambda h, x, w: scan(rnn, h, (w, "x"), chunk=8, axis=(None, 1)), TypeError, "xs must be a pytree"),
        (lambda h, x, w: scan(rnn, h, (w, x), chunk=8, axis=(None, 1.0)), TypeError, "axis must be an int"),
        (lambda h, x, w: scan(rnn, h, (w, x), chunk=8, axis=(None, 3)), ValueError, "axis 3 is out of range"),
        (lambda h, x, w: scan(rnn, h, (w, x), chunk=8, axis=(None,)), ValueError, "axis names 1 items"),
        (lambda h, x, w: scan(rnn, h, (w, x), chunk=8, axis=(None, None)), ValueError, "at least one array split"),
        (lambda h, x, w: scan(rnn, h, (x, x[:, :5]), chunk=8), ValueError, "one length along the axis"),
        (lambda h, x, w: scan(rnn, h, (w, x), chunk=8, axis=(None, 1), forward=3), TypeError, "forward must be"),
        (lambda h, x, w: scan(lambda s, i: s, h, (w, x), chunk=8, axis=(None, 1)), TypeError, "a pair"),
        (lambda h, x, w: scan(lambda s, i: (s[:, :2], i), h, x, chunk=8), ValueError, "fn must return a state"),
        (lambda h, x, w: scan(lambda s, i: ((s, s), i), h, x, chunk=8), ValueError, "structure"),
        (lambda h, x, w: scan(lambda s, i: (s.astype(mx.float16), i), h, x, chunk=8), ValueError, "dtype"),
    ],
    ids=lambda v: v.replace(" ", "-") if isinstance(v, str) else "",
)
def test_bad_arguments_raise_naming_them(call, error, match):
    h0, xs, w = data()
    with pytest.raises(error, match=match):
        call(h0, xs, w)


def test_memory_grows_linearly_with_the_sequence_and_below_the_loop_s():
    """The rise of a staged gradient step over 128, 256 and 512 tokens of a recurrence of width 256, in
    chunks of 64: at most 2.1x per doubling (the inputs, outputs, their gradients and one state per chunk
    grow with the sequence; a chunk's intermediates do not), and at 512 tokens under half the rise of the
    token-by-token loop differentiated by MLX (every token's intermediates alive for the backward pass)."""
    mx.random.seed(0)
    dim = 256
    w = mx.random.normal((dim, dim)) / dim**0.5
    h0 = mx.zeros((1, dim))
    mx.eval(w, h0)

    def measure(length, chunked=True):
        x = mx.random.normal((1, length, dim))
        mx.eval(x)

        def loss(xs):
            inputs = (xs[1], xs[0])
            h, ys = scan(rnn, h0, inputs, chunk=64, axis=(None, 1)) if chunked else rnn(h0, inputs)
            return (ys**2).sum() + h.sum()

        vg = nv.value_and_grad_flat(loss, [0, 1])
        return rise(lambda: vg([x, w]), nv.eval)

    rises = [measure(n) for n in (128, 256, 512)]
    assert rises[1] <= 2.1 * rises[0] and rises[2] <= 2.1 * rises[1], rises
    loop = measure(512, chunked=False)
    assert rises[2] <= loop / 2, (rises, loop)
