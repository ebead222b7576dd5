"""The loss head in chunks of tokens: nv.losses.cross_entropy, and mlx-lm's default loss run from the
model's own head code (nuvec_mlx.mlx_lm.chunked_loss)."""

import functools

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import cohere, gemma3_text, llama, qwen3
from mlx_lm.tuner.trainer import default_loss

import nuvec_mlx as nv
from nuvec_mlx.mlx_lm import chunked_loss
from nuvec_mlx.mlx_lm.losses import Head, hidden_states
from tests.helpers import assert_close, seeded_model

VOCAB = 300


def head_data():
    mx.random.seed(0)
    head = nn.Linear(16, VOCAB)
    h, y = mx.random.normal((2, 37, 16)), mx.random.randint(0, VOCAB, (2, 37))
    weights = (mx.random.uniform(shape=(2, 37)) > 0.3).astype(mx.float32)
    mx.eval(head.parameters(), h, y, weights)
    return head, h, y, weights


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_in_chunks_is_the_whole_s(reduction, smoothing):
    head, h, y, w = head_data()

    def plain(m, h):
        ce = nn.losses.cross_entropy(m(h), y, weights=w, label_smoothing=smoothing)
        return ce.sum() if reduction == "sum" else ce.mean() if reduction == "mean" else ce

    def chunked(m, h):
        return nv.losses.cross_entropy(m, h, y, weights=w, chunk=8, label_smoothing=smoothing, reduction=reduction)

    assert_close(chunked(head, h), plain(head, h), 1e-6)
    for loss in (plain, chunked):  # the gradients of the head and of the hidden states
        grads = nn.value_and_grad(head, lambda m, h, loss=loss: loss(m, h).sum())(head, h)[1]
        dh = mx.grad(lambda h, loss=loss: loss(head, h).sum())(h)
        if loss is plain:
            expected = [grads["weight"], grads["bias"], dh]
    assert_close([grads["weight"], grads["bias"], dh], expected, 1e-5)


def test_the_head_is_split_into_vocabulary_over_8_hidden_chunks_of_128_rows_at_least():
    head_tokens = nv.chunking.head_tokens
    assert head_tokens(2048, 2048, 128256, batch=4) == 256  # Llama-3.2-1B: 8 chunks
    assert head_tokens(2048, 1024, 151936, batch=4) == 108  # Qwen3-0.6B: 19 chunks
    assert head_tokens(2048, 1152, 262144, batch=4) == 71  # Gemma-3-1B: 29 chunks
    assert head_tokens(100, 64, 64) == 100  # a small vocabulary: one chunk
    assert head_tokens(512, 128, 128256) == 128  # 126 chunks of 4 rows would be: 128 rows
    assert head_tokens(512, 128, 128256, batch=8) == 16  # 16 tokens x 8 = 128 rows
    assert head_tokens(64, 128, 128256) == 64  # fewer tokens than rows: the whole sequence


def build(module, **fields):
    return seeded_model(module, vocab_size=VOCAB, **fields)


SMALL = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
NORM = dict(rms_norm_eps=1e-5)
MODELS = {  # the heads: tied embeddings, a separate lm_head, Gemma 3's, Cohere's scaled logits
    "llama tied": lambda: build(llama, model_type="llama", tie_word_embeddings=True, **SMALL, **NORM),
    "llama untied": lambda: build(llama, model_type="llama", tie_word_embeddings=False, **SMALL, **NORM),
    "qwen3": lambda: build(
        qwen3,
        model_type="qwen3",
        head_dim=8,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        rope_theta=10000.0,
        **SMALL,
        **NORM,
    ),
    "gemma3_text": lambda: build(
        gemma3_text,
        model_type="gemma3_text",
        **{**SMALL, "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1},
        head_dim=16,
        **NORM,
    ),
    "cohere": lambda: build(cohere, model_type="cohere", logit_scale=0.5, **SMALL),
}


def batch():
    ids = mx.random.randint(0, VOCAB, (2, 38), key=mx.random.key(1))
    return ids, mx.array([[0, 37], [5, 30]])  # the second row's loss counts positions 5..30 (a masked prompt)


@pytest.mark.parametrize("value_and_grad", [nn.value_and_grad, nv.value_and_grad], ids=["recomputed", "nuvec"])
@pytest.mark.parametrize("arch", list(MODELS))
def test_mlx_lm_s_loss_in_chunks_runs_the_model_s_own_head(arch, value_and_grad):
    """Under mx's gradient each chunk is recomputed in the backward pass; under nuvec's its gradient is
    taken in the forward pass (the head's weight, tied or not, summed over the chunks there)."""
    model = MODELS[arch]()
    ids, lengths = batch()
    plain = nn.value_and_grad(model, default_loss)(model, ids, lengths)
    chunked = value_and_grad(model, functools.partial(chunked_loss, chunk=8))(model, ids, lengths)
    nv.eval(chunked)
    (loss, tokens), grads = plain
    (chunked_value, chunked_tokens), chunked_grads = chunked
    assert chunked_tokens.item() == tokens.item()
    assert_close(chunked_value, loss, 1e-6)
    assert_close([g for _, g in tree_flatten(chunked_grads)], [g for _, g in tree_flatten(grads)], 1e-5)
    head = Head(model, hidden_states(model, ids[:, :-1]), ids[:, :-1])
    assert set(head.modules) <= {"lm_head", "model.embed_tokens"}  # the chunks' inputs: the head's modules only


def test_one_chunk_is_mlx_lm_s_loss_bitwise():
    model = MODELS["llama tied"]()
    ids, lengths = batch()
    plain = default_loss(model, ids, lengths)[0]
    assert mx.array_equal(chunked_loss(model, ids, lengths, chunk=1000)[0], plain).item()


def test_a_wrapper_model_s_loss_is_its_language_model_s_head_in_chunks():
    """A model whose __call__ returns another child's output (Qwen3.5's and multimodal models' wrappers) has no
    head of its own: the chunked loss is its child's, found without running the model."""
    inner = MODELS["llama tied"]()

    class Wrapper(nn.Module):  # a multimodal-style wrapper: its __call__ calls another attribute
        def __init__(self):
            super().__init__()
            self.language_model = inner

        def __call__(self, inputs):
            return self.language_model(inputs)

    model = Wrapper()
    ids, lengths = batch()
    with pytest.raises(ValueError, match="calls self.model"):
        Head(model, mx.zeros((1, 1, 32)), ids[:, :1])
    assert_close(chunked_loss(model, ids, lengths, chunk=8)[0], default_loss(model, ids, lengths)[0], 1e-6)


def test_the_chunked_head_holds_one_chunk_of_logits(compiled):
    """A 4096-word vocabulary over 2 x 512 tokens: trained through the chunked head, the step rises under
    a third of what mlx-lm's loss makes it rise (its logits, softmax and gradient at once)."""
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(model_type="llama", vocab_size=4096, tie_word_embeddings=True, **SMALL, **NORM))
    mx.eval(model.parameters())
    nv.checkpoint_layers(model)
    nv.chunk_layers(model)  # attention in query chunks too (the CPU trains it unfused), as the trainer does
    ids = mx.random.randint(0, 4096, (2, 513), key=mx.random.key(1))
    lengths = mx.array([[0, 512]] * 2)
    rises = {}
    for name, loss in (("mlx-lm", default_loss), ("chunked", chunked_loss)):
        step = nv.TrainingStep(model, loss)
        step(ids, lengths)
        with nv.memory.measure() as m:
            step(ids, lengths)
        rises[name] = m.rise
    assert rises["chunked"] <= rises["mlx-lm"] / 3, rises


@pytest.mark.xfail(
    strict=True,
    reason="MLX: nn.losses.cross_entropy off the GPU takes the target's logit with mx.take_along_axis, whose "
    "gradient scatters into zeros of the logits' shape; mx.compile merges those zeros, alike in every chunk, "
    "into one array made in the first chunk's gradient stage and freed after the last: one chunk of logits "
    "more from stage to stage (eagerly, none)",
)
def test_a_compiled_chunked_head_keeps_no_chunk_of_logits_between_chunks(compiled):
    """Over 4 chunks of 512 tokens x 4096 words (8 MiB of float32 logits each), after each chunk's gradient
    stage less than one chunk's logits is still alive."""
    mx.random.seed(0)
    w, h = mx.random.normal((4096, 64)), mx.random.normal((1, 2048, 64))
    y = mx.random.randint(0, 4096, (1, 2048))
    mx.eval(w, h, y)
    step = nv.compile(
        nv.value_and_grad_flat(lambda xs: nv.losses.cross_entropy(lambda x: x @ w.T, xs[0], y, chunk=512), 0)
    )
    nv.eval(step([h]))
    mx.synchronize()
    mx.clear_cache()
    start = mx.get_active_memory()
    with nv.memory.timeline() as t:
        nv.eval(step([h]))
    after_gradients = [r.active - start for r in t.readings[1:-1:2]]  # each chunk's value stage, then its gradient's
    assert len(after_gradients) == 4 and max(after_gradients) < 4 << 20, after_gradients


def test_a_head_that_reads_a_weight_taken_from_the_parameters_differentiates_it_as_unchunked():
    """The targets, integer, never pass through the chunks' ordering dependency: read through it, they were on
    the gradient's path and MLX refused a gather's derivative with respect to indices."""
    head, h, y, _ = head_data()

    def loss(m, h, chunk):
        weight = m.weight  # read inside the loss: captured by the head, not an input of the chunks
        return nv.losses.cross_entropy(lambda z: z @ weight.T, h, y, chunk=chunk)

    for value_and_grad in (nv.value_and_grad, nn.value_and_grad):
        value, grads = value_and_grad(head, loss)(head, h, 8)
        nv.eval(value, grads)
        expected_value, expected = nn.value_and_grad(head, loss)(head, h, h.shape[1])
        assert_close(value, expected_value, 1e-6)
        assert_close(grads["weight"], expected["weight"], 1e-5)


def test_forward_mode_and_second_derivatives_go_through_a_chunked_cross_entropy():
    head, h, y, _ = head_data()
    tangent = mx.random.normal(h.shape)

    def chunked(h):
        return nv.losses.cross_entropy(head, h, y, chunk=8)

    def plain(h):
        return nn.losses.cross_entropy(head(h), y).astype(mx.float32).mean()

    assert_close(mx.jvp(chunked, [h], [tangent])[1][0], mx.jvp(plain, [h], [tangent])[1][0], 1e-5)
    # A second derivative: of the squared norm of the first (MLX has none of cross-entropy's own gather).
    second = [mx.grad(lambda h, f=f: (mx.grad(f)(h) ** 2).sum())(h) for f in (chunked, plain)]
    assert_close(second[0], second[1], 1e-4)


@pytest.mark.parametrize(
    "hidden, targets, error, match",
    [
        (mx.zeros((2, 0, 16)), mx.zeros((2, 0), dtype=mx.int32), ValueError, "at least one token"),
        (mx.zeros((2, 4, 16)), mx.zeros((2, 4)), TypeError, "integer token ids"),
        (mx.zeros((2, 4, 16)), mx.zeros((2, 5), dtype=mx.int32), ValueError, "batch and tokens"),
    ],
    ids=["no-token", "float-targets", "other-length"],
)
def test_cross_entropy_says_what_is_wrong_with_its_inputs_before_it_runs(hidden, targets, error, match):
    head = nn.Linear(16, VOCAB)
    with pytest.raises(error, match=match):
        nv.losses.cross_entropy(head, hidden, targets, chunk=2)
