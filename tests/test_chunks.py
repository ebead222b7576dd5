"""nv.checkpoint_chunks: a function in checkpointed chunks, the values and gradients of the unchunked one,
one chunk's intermediates at a time."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import nuvec_mlx as nv
from tests.helpers import assert_close, unstaged_on_purpose

B, T, D, V = 2, 50, 16, 300


def data(seed: int = 0):
    mx.random.seed(seed)
    head = nn.Linear(D, V)
    h, y = mx.random.normal((B, T, D)), mx.random.randint(0, V, (B, T))
    mx.eval(head.parameters(), h, y)
    return head, h, y


def token_loss(head, h, y):
    return nn.losses.cross_entropy(head(h), y, reduction="sum")


def chunked_loss(head, h, y, size=8):
    return nv.checkpoint_chunks(lambda h, y: token_loss(head, h, y), size=size, out_axes="sum")(h, y)


def attention(q, k, v):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")


def chunked_attention(q, k, v, size=12):
    def part(q, k, v, chunk):  # a query chunk reads the keys up to its last query
        return attention(q, k[:, :, : chunk.stop], v[:, :, : chunk.stop])

    return nv.checkpoint_chunks(part, size=size, in_axes=(2, None, None), out_axes=2, slice_arg="chunk")(q, k, v)


def qkv(seed: int = 1):
    mx.random.seed(seed)
    return [mx.random.normal((1, 2, T, 8)) for _ in range(3)]


@pytest.mark.parametrize("size", [8, 7, T, 1000])
def test_a_sum_over_chunks_has_the_values_and_gradients_of_the_whole(size):
    head, h, y = data()
    plain = [*nn.value_and_grad(head, token_loss)(head, h, y)]
    chunked = [*nn.value_and_grad(head, lambda m, h, y: chunked_loss(m, h, y, size))(head, h, y)]
    assert_close(chunked[0], plain[0], 1e-6)
    assert_close(chunked[1]["weight"], plain[1]["weight"], 1e-5)  # the weight's gradient: a sum over chunks
    assert_close(chunked[1]["bias"], plain[1]["bias"], 1e-5)
    dh = mx.grad(lambda h: chunked_loss(head, h, y, size))(h)
    assert_close(dh, mx.grad(lambda h: token_loss(head, h, y))(h), 1e-6)
    if size >= T:  # one chunk: the same operations in the same order
        assert mx.array_equal(chunked[0], plain[0]).item()


def test_concatenated_chunks_with_their_slice_are_causal_attention_by_query():
    q, k, v = qkv()
    assert_close(chunked_attention(q, k, v), attention(q, k, v), 1e-6)
    plain = mx.grad(lambda q, k, v: (attention(q, k, v) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)
    chunked = mx.grad(lambda q, k, v: (chunked_attention(q, k, v) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)
    assert_close(list(chunked), list(plain), 1e-5)


def test_forward_mode_and_batching_go_through_the_chunks():
    q, k, v = qkv()
    t = mx.random.normal(q.shape)
    assert_close(
        mx.jvp(lambda q: chunked_attention(q, k, v), [q], [t])[1][0],
        mx.jvp(lambda q: attention(q, k, v), [q], [t])[1][0],
        1e-6,
    )
    qs = mx.random.normal((3, *q.shape))
    assert_close(mx.vmap(lambda q: chunked_attention(q, k, v))(qs), mx.vmap(lambda q: attention(q, k, v))(qs), 1e-6)
    per_example = mx.vmap(mx.grad(lambda q: (chunked_attention(q, k, v) ** 2).sum()))(qs)
    assert_close(per_example, mx.vmap(mx.grad(lambda q: (attention(q, k, v) ** 2).sum()))(qs), 1e-5)


def test_compiled_and_nested_in_a_checkpointed_block_as_uncompiled_and_alone(compiled):
    head, h, y = data()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(D, D)]
            self.head = head

        def __call__(self, h, y):  # the block's output through the chunked head, inside the block
            return chunked_loss(self.head, self.layers[0](h), y)

    model = Model()
    mx.eval(model.parameters())
    plain = nv.TrainingStep(model, lambda m, h, y: m(h, y), compile=False)(h, y)
    nv.checkpoint_layers(model, layers=[model])  # the whole model one checkpointed block around the chunks
    step = nv.TrainingStep(model, lambda m, h, y: m(h, y))
    with nv.memory.timeline() as timeline:
        value, grads = step(h, y)
    assert_close(value, plain[0], 1e-6)
    assert_close(grads["layers"][0]["weight"], plain[1]["layers"][0]["weight"], 1e-5)
    chunks = -(-T // 8)
    # The block's forward holds the chunks' forward stages; its backward recomputes the block, each chunk of
    # the summed loss a stage for its value and one for its gradient (under nuvec's gradient none is
    # recomputed again).
    assert [r.kind for r in timeline.readings] == (
        ["chunk"] * chunks + ["forward"] + ["chunk"] * (2 * chunks) + ["backward", "outputs"]
    )


def test_random_draws_are_replayed_chunk_by_chunk():
    head, h, y = data()

    def noisy(m, h, y):
        return token_loss(m, nn.Dropout(0.5)(h), y)

    def run(loss):
        mx.random.seed(7)
        return nn.value_and_grad(head, loss)(head, h, y)

    chunked = run(lambda m, h, y: nv.checkpoint_chunks(lambda h, y: noisy(m, h, y), size=T, out_axes="sum")(h, y))
    plain = run(noisy)  # one chunk draws as the whole does
    assert mx.array_equal(chunked[0], plain[0]).item()
    assert mx.array_equal(chunked[1]["weight"], plain[1]["weight"]).item()


def test_one_chunk_of_logits_is_alive_at_a_time(compiled):
    """A loss head of 8192 classes over 2 x 256 tokens: chunked in 32s, its step holds one chunk's logits
    (softmax, gradient) instead of all: measured, under a third of the whole's rise in memory."""
    mx.random.seed(0)
    head, big_v = nn.Linear(32, 8192, bias=False), 8192
    h, y = mx.random.normal((2, 256, 32)), mx.random.randint(0, big_v, (2, 256))
    mx.eval(head.parameters(), h, y)
    rises = {}
    for size in (None, 32):

        def loss(m, h, y, size=size):
            return token_loss(m, h, y) if size is None else chunked_loss(m, h, y, size)

        step = nv.TrainingStep(head, loss)
        step(h, y)  # traced and compiled
        with nv.memory.measure() as m:
            step(h, y)
        rises[size] = m.rise
    logits = 2 * 256 * big_v * 4
    assert rises[None] >= 2 * logits, rises  # the whole: logits and their softmax or gradient at once
    assert rises[32] <= rises[None] / 3, rises


def counting_loss(head, calls, size=8):
    def part(h, y):
        calls.append(h.shape[1])
        return token_loss(head, h, y)

    return lambda m, h, y: nv.checkpoint_chunks(part, size=size, out_axes="sum")(h, y)


def test_under_nuvec_s_gradient_a_summed_loss_takes_each_chunk_s_gradient_in_its_forward_pass():
    """nv.value_and_grad runs each chunk once, its gradient with its value (and chunk 0 once more, unevaluated,
    to see the output); mx's gradients recompute every chunk in the backward pass. Same values and gradients."""
    head, h, y = data()
    chunks = -(-T // 8)
    eager_calls, recompute_calls = [], []
    eager = nv.value_and_grad(head, counting_loss(head, eager_calls))(head, h, y)
    recomputed = nn.value_and_grad(head, counting_loss(head, recompute_calls))(head, h, y)
    plain = nn.value_and_grad(head, token_loss)(head, h, y)
    nv.eval(eager, recomputed)
    assert len(eager_calls) == chunks + 1 and len(recompute_calls) == 2 * chunks
    assert mx.array_equal(eager[0], recomputed[0]).item()
    for got in (eager, recomputed):
        assert_close(got[0], plain[0], 1e-6)
        assert_close(got[1]["weight"], plain[1]["weight"], 1e-5)
        assert_close(got[1]["bias"], plain[1]["bias"], 1e-5)
    head.freeze()  # as in LoRA: the hidden states' gradient alone
    dh = nv.value_and_grad_flat(lambda xs: chunked_loss(head, xs[0], y) / y.size, 0)([h])[1][0]
    nv.eval(dh)  # scaled by the cotangent after the chunk's gradient, not inside it: float32's rounding apart
    assert_close(dh, mx.grad(lambda h: token_loss(head, h, y) / y.size)(h), 1e-5)


def test_a_chunk_s_random_draws_are_the_same_whether_its_gradient_is_taken_forward_or_recomputed():
    head, h, y = data()

    def noisy(m, h, y):
        return nv.checkpoint_chunks(lambda h, y: token_loss(m, nn.Dropout(0.5)(h), y), size=8, out_axes="sum")(h, y)

    def run(value_and_grad):
        mx.random.seed(7)
        return value_and_grad(head, noisy)(head, h, y)

    eager, recomputed = run(nv.value_and_grad), run(nn.value_and_grad)
    nv.eval(eager, recomputed)
    assert mx.array_equal(eager[0], recomputed[0]).item()
    assert_close(eager[1]["weight"], recomputed[1]["weight"], 1e-5)


@unstaged_on_purpose  # nuvec's gradient inside mx.jvp, never evaluated by nv.eval
def test_a_second_derivative_through_gradients_taken_in_the_forward_pass_raises_and_mx_s_is_exact():
    head, h, _ = data()
    t = mx.random.normal(h.shape)

    def smooth(h):  # cross-entropy's own second derivative is not in MLX (a scatter's indices)
        return (mx.tanh(head(h)) ** 2).sum()

    def chunked(xs):
        return nv.checkpoint_chunks(smooth, size=8, out_axes="sum")(xs[0])

    def through(take):
        return lambda h: take(chunked, 0)([h])[0]

    def mx_grad(loss, argnums):
        return lambda xs: [mx.grad(lambda h: loss([h]))(xs[0])]

    with pytest.raises(ValueError, match="first derivatives only"):
        mx.eval(mx.jvp(through(nv.grad_flat), [h], [t]))
    hvp = mx.jvp(through(mx_grad), [h], [t])[1][0]
    assert_close(hvp, mx.jvp(mx.grad(smooth), [h], [t])[1][0], 1e-5)


def test_a_chunk_s_gradient_taken_in_its_forward_pass_holds_no_more_than_its_recomputation():
    """A frozen bf16 head of 32768 classes over 512 tokens in chunks of 128 (8 MiB of logits a chunk),
    staged under nv.compile: nuvec's gradient (the value, then the gradient, a stage each) against
    mx.value_and_grad's (each chunk recomputed in the backward pass)."""
    mx.random.seed(0)
    head = nn.Linear(64, 32768, bias=False)
    head.set_dtype(mx.bfloat16)
    head.freeze()
    h, y = mx.random.normal((1, 512, 64)).astype(mx.bfloat16), mx.random.randint(0, 32768, (1, 512))
    mx.eval(head.parameters(), h, y)

    def loss(h):
        return nv.losses.cross_entropy(head, h, y, chunk=128)

    def rise(value_and_grad):
        step = nv.compile(value_and_grad)
        nv.eval(step(h))  # traced and compiled
        with nv.memory.measure() as m:
            nv.eval(step(h))
        assert step.traces == 1  # compiled for real: the second call replayed the first one's trace
        return m.rise

    recomputed = rise(mx.value_and_grad(loss))
    in_forward = rise(lambda h: nv.value_and_grad_flat(lambda xs: loss(xs[0]), 0)([h]))
    # Within 64 KiB (the scalars each way holds differ by bytes); one stage for both held 8 MiB more.
    assert 0 < in_forward <= recomputed + (64 << 10), (in_forward, recomputed)


@unstaged_on_purpose  # nuvec's gradient inside mx.vmap, never evaluated by nv.eval
@pytest.mark.parametrize("take", ["nuvec", "mx"])
def test_per_example_gradients_of_a_chunked_loss_with_integer_targets_are_the_unchunked_ones(take):
    head, _, y = data()
    hs = mx.random.normal((3, B, T, D))
    if take == "nuvec":
        grad = lambda h: nv.value_and_grad_flat(lambda xs: chunked_loss(head, xs[0], y), 0)([h])[1][0]  # noqa: E731
    else:
        grad = mx.grad(lambda h: chunked_loss(head, h, y))
    per_example = mx.vmap(grad)(hs)
    assert_close(per_example, mx.vmap(mx.grad(lambda h: token_loss(head, h, y)))(hs), 1e-5)


@pytest.mark.parametrize("returned", [None, 1.0, [1.0]], ids=["None", "float", "list-of-float"])
def test_a_function_that_returns_no_array_raises(returned):
    """MLX 0.32 ended the process (a segmentation fault) on a chunked call of no outputs."""
    with pytest.raises(ValueError, match="returned no array"):
        nv.checkpoint_chunks(lambda x: returned, size=2)(mx.zeros((2, 6)))


class _MLP(nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def __call__(self, x):
        return self.down(nn.gelu(self.up(x)))


def _relative_errors(grads, reference):
    return [(mx.abs(g.astype(mx.float32) - r).max() / mx.abs(r).max()).item() for g, r in zip(grads, reference)]


def _bf16_gradient_errors(name: str) -> tuple[list[float], list[float]]:
    """The relative errors (max-norm) of a bf16 step's parameter gradients against the float32 step's, unchunked
    and in 16-32 chunks: the loss head (a weight read by every chunk), an MLP in token chunks, and attention's
    keys and values (read whole by every query chunk)."""
    mx.random.seed(0)
    x, targets = mx.random.normal((1, 1024, 64)), mx.random.randint(0, 300, (1, 1024))
    if name == "head":
        model: nn.Module = nn.Linear(64, 300)

        def loss(m, x, chunk):
            return nv.losses.cross_entropy(m, x, targets, chunk=chunk or x.shape[1])

    elif name == "mlp":
        model = _MLP()

        def loss(m, x, chunk):
            m = nv.checkpoint_module(m, chunk=chunk) if chunk else m
            return (m(x).astype(mx.float32) ** 2).mean()

    else:
        model = nn.Module()
        model.k, model.v = mx.random.normal((1, 2, 1024, 32)), mx.random.normal((1, 2, 1024, 32))
        q = mx.random.normal((1, 2, 1024, 32))

        def loss(m, x, chunk):
            q_ = q.astype(m.k.dtype)
            out = chunked_attention(q_, m.k, m.v, size=chunk) if chunk else attention(q_, m.k, m.v)
            return (out.astype(mx.float32) ** 2).sum()

    mx.eval(model.parameters())
    weights = model.parameters()

    def gradients(dtype, chunk):
        model.update(weights)
        model.set_dtype(dtype)
        if name == "attention":
            model.k, model.v = weights["k"].astype(dtype), weights["v"].astype(dtype)
        grads = nv.value_and_grad(model, loss)(model, x.astype(dtype), chunk)[1]
        nv.eval(grads)
        return [g for _, g in sorted(tree_flatten(grads))]

    reference = gradients(mx.float32, None)
    return _relative_errors(gradients(mx.bfloat16, None), reference), _relative_errors(
        gradients(mx.bfloat16, 32 if name != "head" else 64), reference
    )


@pytest.mark.parametrize("name", ["head", "mlp", "attention"])
def test_gradients_summed_over_bf16_chunks_are_summed_in_float32(name):
    """Summed in bf16, each chunk's addition rounded: the head's weight gradient was 4-6x the unchunked
    step's error at 16 chunks, the MLP's 3x. In float32, what is left is each chunk's own gradient rounded
    to bf16 by its matrix product before the sum, once more than the unchunked step rounds (which sums every
    token inside one kernel): within 1.6x of its error."""
    plain, chunked = _bf16_gradient_errors(name)
    for p, c in zip(plain, chunked, strict=True):
        assert c <= 1.6 * p, (plain, chunked)
