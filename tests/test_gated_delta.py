"""nuvec_mlx.mlx_lm.gated_delta: mlx-lm's gated delta rule in checkpointed chunks, chunkwise-parallel in blocks
inside a chunk: mlx-lm's values, final state and gradients; its memory linear in the sequence; the kernel path
with the kernel swapped for the per-token ops (Metal is not run here)."""

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta as mlx_lm_gated_delta

import nuvec_mlx as nv
from nuvec_mlx.mlx_lm import gated_delta
from nuvec_mlx.mlx_lm.gated_delta import (
    DEFAULT_BLOCK,
    DEFAULT_CHUNK,
    DEFAULT_VECTOR_BLOCK,
    DEFAULT_VECTOR_CHUNK,
    gated_delta_update,
    make_gated_delta_update,
)
from tests.helpers import assert_close, recurrence_gradients, recurrence_loss, rise

reference = mlx_lm_gated_delta.gated_delta_update
NAMES = ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state")


def inputs(
    batch=2,
    length=50,
    k_heads=2,
    v_heads=4,
    dk=16,
    dv=8,
    vector=False,
    dtype=mx.float32,
    state=True,
    seed=1,
):
    """Normalised queries and keys (as ``normalize_qk`` makes them), gates of mixed strength, an initial state."""
    keys = mx.random.split(mx.random.key(seed), 8)
    q = mx.random.normal((batch, length, k_heads, dk), key=keys[0])
    k = mx.random.normal((batch, length, k_heads, dk), key=keys[1])
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) / dk**0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((batch, length, v_heads, dv), key=keys[2])
    a = mx.random.normal((batch, length, v_heads, dk) if vector else (batch, length, v_heads), key=keys[3])
    b = mx.random.normal((batch, length, v_heads), key=keys[4])
    a_log = mx.log(mx.random.uniform(1, 16, (v_heads, 1) if vector else (v_heads,), key=keys[5]))
    dt_bias = mx.random.normal((v_heads, dk) if vector else (v_heads,), key=keys[6])
    s0 = 0.1 * mx.random.normal((batch, v_heads, dv, dk), key=keys[7]) if state else None
    out = [x.astype(dtype) for x in (q, k, v, a, b)] + [a_log, dt_bias, s0]
    mx.eval([x for x in out if x is not None])
    return out


def weighted(update, *args, **kwargs):
    """:func:`recurrence_loss` of ``update`` (the ops, unless ``use_kernel`` says otherwise)."""
    return recurrence_loss(update, *args, use_kernel=kwargs.pop("use_kernel", False), **kwargs)


def gradients(update, args, **kwargs):
    return recurrence_gradients(update, args, use_kernel=kwargs.pop("use_kernel", False), **kwargs)


@pytest.mark.parametrize("chunk", [8, 7, DEFAULT_CHUNK])
@pytest.mark.parametrize("vector", [False, True], ids=["scalar-gates", "vector-gates"])
def test_values_final_state_and_gradients_are_mlx_lm_s_in_float32(vector, chunk):
    args = inputs(vector=vector)
    update = make_gated_delta_update(chunk=chunk)
    y, s = update(*args, use_kernel=False)
    y_ref, s_ref = reference(*args, use_kernel=False)
    assert_close(y, y_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)
    got, expected = gradients(update, args), gradients(reference, args)
    for g, e in zip(got, expected, strict=True):
        assert_close(g, e, 1e-5)


@pytest.mark.parametrize(
    "chunk, block", [(None, None), (64, 24)], ids=["default-sizes", "chunks-of-64-in-blocks-of-24"]
)
@pytest.mark.parametrize("vector", [False, True], ids=["scalar-gates", "vector-gates"])
def test_chunks_of_several_blocks_a_multiple_of_neither_are_mlx_lm_s_in_float32(vector, chunk, block):
    """170 tokens, a multiple of no chunk or block size, each chunk's last block padded with tokens that
    change nothing: by default one chunk in blocks of 64 + 64 + 42 (one gate per head), chunks of 128 + 42 in
    blocks of 16, the last of 10 (vector gates); chunks of 64 + 64 + 42 in blocks of 24 + 24 + 16 and 24 + 18."""
    args = inputs(length=170, vector=vector)
    update = make_gated_delta_update(chunk=chunk, block=block)
    y, s = update(*args, use_kernel=False)
    y_ref, s_ref = reference(*args, use_kernel=False)
    assert_close(y, y_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)
    for g, e in zip(gradients(update, args), gradients(reference, args), strict=True):
        assert_close(g, e, 1e-5)


@pytest.mark.parametrize(
    "options",
    [{"lower_bound": -5.0}, {"allow_neg_eigval": True}, {"state": None}],
    ids=["lower-bound", "negative-eigenvalues", "no-initial-state"],
)
def test_mlx_lm_s_options_and_a_missing_state(options):
    options = dict(options)
    args = inputs(state=options.pop("state", True) is not None)
    update = make_gated_delta_update(chunk=16)
    y, s = update(*args, use_kernel=False, **options)
    y_ref, s_ref = reference(*args, use_kernel=False, **options)
    assert s.dtype == s_ref.dtype == mx.float32
    assert_close(y, y_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)
    for g, e in zip(gradients(update, args, **options), gradients(reference, args, **options), strict=True):
        assert_close(g, e, 1e-5)


@pytest.mark.parametrize("vector", [False, True], ids=["scalar-gates", "vector-gates"])
def test_bfloat16_inputs_as_mlx_lm_computes_them(vector):
    """bf16 q, k, v, a, b (the state float32, as mlx-lm keeps it): both compute in float32 and round the
    outputs to bf16, so outputs differ by bf16 roundings of float32 sums taken in another order."""
    args = inputs(vector=vector, dtype=mx.bfloat16)
    y, s = gated_delta_update(*args, use_kernel=False)
    y_ref, s_ref = reference(*args, use_kernel=False)
    assert y.dtype == y_ref.dtype == mx.bfloat16 and s.dtype == s_ref.dtype == mx.float32
    assert_close(y.astype(mx.float32), y_ref.astype(mx.float32), 1e-2)
    assert_close(s, s_ref, 1e-4)
    for g, e in zip(gradients(gated_delta_update, args), gradients(reference, args), strict=True):
        assert_close(g.astype(mx.float32), e.astype(mx.float32), 2e-2)


def test_nearly_parallel_keys_with_no_decay_and_full_writes_stay_exact():
    """The chunk matrix ``I + A`` at its worst: keys nearly parallel, gates ~1, beta ~1, 64 tokens. Its inverse
    has entries of size 1, but the powers of ``A`` grow like binomial coefficients: a Neumann-series inverse
    is off by orders of magnitude there; block forward substitution is not."""
    keys = mx.random.split(mx.random.key(5), 3)
    base = mx.random.normal((1, 1, 2, 16), key=keys[0])
    k = base + 0.01 * mx.random.normal((1, 128, 2, 16), key=keys[1])
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    args = [k / 4, k, mx.random.normal((1, 128, 2, 8), key=keys[2])]
    args += [mx.full((1, 128, 2), -12.0), mx.full((1, 128, 2), 8.0), mx.zeros((2,)), mx.zeros((2,))]
    y, s = gated_delta_update(*args, use_kernel=False)
    y_ref, s_ref = reference(*args, use_kernel=False)
    assert_close(y, y_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)


def test_a_gate_that_nearly_resets_the_state_mid_chunk_keeps_the_decays_after_it_exact():
    """A log-gate of -80000 at one token per chunk, slow gates after it: the decays between later tokens are
    sums of the log-gates between them, not differences of cumulative sums of size 80000 (which lose them)."""
    args = inputs(batch=1, length=128, k_heads=2, v_heads=2, state=False)
    a = mx.where((mx.arange(128) % 64 == 5)[None, :, None], 5000.0, mx.full((1, 128, 2), -6.0))
    args[3], args[5], args[6] = a, mx.log(mx.full((2,), 16.0)), mx.zeros((2,))
    y, s = gated_delta_update(*args, use_kernel=False)
    y_ref, s_ref = reference(*args, use_kernel=False)
    assert_close(y, y_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)


def test_a_mask_is_computed_token_by_token_as_mlx_lm_does():
    """mlx-lm's padding mask: a masked token's output is computed, its state update dropped."""
    args = inputs()
    mask = mx.random.uniform(shape=(2, 50), key=mx.random.key(9)) > 0.3
    update = make_gated_delta_update(chunk=16)
    y, s = update(*args, mask, use_kernel=False)
    y_ref, s_ref = reference(*args, mask, use_kernel=False)
    assert_close(y, y_ref, 1e-6)
    assert_close(s, s_ref, 1e-6)
    for g, e in zip(gradients(update, [*args, mask]), gradients(reference, [*args, mask]), strict=True):
        assert_close(g, e, 1e-5)


def test_the_kernel_path_runs_the_kernel_forward_and_the_chunks_backward():
    """The Metal path with mlx-lm's per-token ops standing in for its kernel (same signature): the forward
    pass is one call of it, the backward pass calls it per chunk (but the last) to rebuild the chunks'
    starting states, then recomputes each chunk in the differentiable form. ``use_kernel=False`` never calls it."""
    args = inputs()
    calls = []

    def kernel(q, k, v, g, beta, state, mask=None):
        calls.append(q.shape[1])
        return mlx_lm_gated_delta.gated_delta_ops(q, k, v, g, beta, state, mask)

    update = make_gated_delta_update(chunk=16, kernel=kernel)
    y, s = update(*args, use_kernel=True)
    y_ref, s_ref = reference(*args, use_kernel=False)
    assert mx.array_equal(y, y_ref).item() and mx.array_equal(s, s_ref).item()  # the kernel's own values
    assert calls == [50]
    calls.clear()
    got = gradients(update, args, use_kernel=True)
    mx.eval(got)
    assert calls == [50, 16, 16, 16]
    for g, e in zip(got, gradients(reference, args), strict=True):
        assert_close(g, e, 1e-5)
    calls.clear()
    mx.eval(update(*args, use_kernel=False))
    assert calls == []
    mask = mx.random.uniform(shape=(2, 50), key=mx.random.key(9)) > 0.3
    y, s = update(*args, mask, use_kernel=True)
    assert mx.array_equal(y, reference(*args, mask, use_kernel=False)[0]).item()


def test_compiled_and_staged_as_uncompiled(compiled):
    args = inputs()

    def step(*xs):
        return nv.value_and_grad_flat(lambda xs: weighted(gated_delta_update, *xs), list(range(8)))(list(xs))

    expected = step(*args)
    nv.eval(expected)
    compiled_step = nv.compile(step)
    for _ in range(2):
        got = compiled_step(*args)
        with nv.memory.timeline() as timeline:
            nv.eval(got)
    assert compiled_step.traces == 1  # compiled for real: the second call replayed the first one's trace
    assert_close(got[0], expected[0], 1e-6)
    assert_close(got[1], expected[1], 1e-5)
    # 50 tokens, one chunk: its forward, the outputs' cotangents, its backward.
    assert [r.kind for r in timeline.readings] == ["chunk"] * 3 + ["outputs"]


@pytest.mark.parametrize("vector", [False, True], ids=["scalar-gates", "vector-gates"])
def test_chunks_and_blocks_default_to_their_gates_sizes(vector, monkeypatch):
    """200 tokens: one chunk of 512 in blocks of 64 with one gate per head; with vector gates, whose decays
    between tokens are (block x block x key size) per head, chunks of 128 in blocks of 16. Each chunk is a
    stage, forward and backward; the blocks are batched in each chunk's (block x block) matrices."""
    blocks = []
    inverse = gated_delta._unit_lower_inverse
    monkeypatch.setattr(gated_delta, "_unit_lower_inverse", lambda a: blocks.append(a.shape[-3:]) or inverse(a))
    args = inputs(length=200, vector=vector)
    step = nv.value_and_grad_flat(lambda xs: weighted(gated_delta_update, *xs), list(range(8)))
    with nv.memory.timeline() as timeline:
        nv.eval(step(args))
    assert (DEFAULT_CHUNK, DEFAULT_BLOCK, DEFAULT_VECTOR_CHUNK, DEFAULT_VECTOR_BLOCK) == (512, 64, 128, 16)
    chunks = 2 if vector else 1
    assert [r.kind for r in timeline.readings] == ["chunk"] * (2 * chunks + 1) + ["outputs"]
    expected = [(8, 16, 16), (5, 16, 16)] if vector else [(4, 64, 64)]  # forward, then backward last chunk first
    assert blocks == expected + expected[::-1]


def test_memory_grows_linearly_with_the_sequence_far_below_mlx_lm_s():
    """A staged gradient step of the rule alone (4 value heads of 32, batch 1) at 512, 1024 and 2048 tokens (1, 2
    and 4 chunks of 8 blocks): at most 2.1x per doubling, and at 512 tokens under a quarter of mlx-lm's
    per-token loop's rise (a chunk's intermediates, then its state and the inputs' gradients per chunk)."""

    def measure(update, length):
        args = inputs(batch=1, length=length, dk=32, dv=32, state=False)[:7]
        vg = nv.value_and_grad_flat(lambda xs: weighted(update, *xs), list(range(7)))
        return rise(lambda: vg(args), nv.eval)

    rises = [measure(gated_delta_update, n) for n in (512, 1024, 2048)]
    assert rises[1] <= 2.1 * rises[0] and rises[2] <= 2.1 * rises[1], rises
    per_token = measure(reference, 512)
    assert rises[0] <= per_token / 4, (rises, per_token)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"q": "q"}, TypeError, "q must be an mlx.core.array"),
        ({"state": 1.0}, TypeError, "state must be an mlx.core.array or None"),
        ({"k": mx.zeros((2, 50, 2, 8))}, ValueError, "q and k must have one shape"),
        ({"v": mx.zeros((2, 50, 3, 8))}, ValueError, "v must be"),
        ({"a": mx.zeros((2, 50, 3))}, ValueError, "a must be"),
        ({"b": mx.zeros((2, 49, 4))}, ValueError, "b must be"),
        ({"state": mx.zeros((2, 4, 8, 8))}, ValueError, "state must be"),
        ({"mask": mx.ones((2, 49), dtype=mx.bool_)}, ValueError, "mask must be"),
    ],
    ids=lambda v: v.split(" ")[0] if isinstance(v, str) else "",
)
def test_bad_arguments_raise_naming_them(change, error, match):
    args = dict(zip(NAMES, inputs()))
    args.update(change)
    with pytest.raises(error, match=match):
        gated_delta_update(**args)


def test_bad_settings_raise_naming_them():
    with pytest.raises(TypeError, match="chunk must be an int"):
        make_gated_delta_update(chunk=16.0)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        make_gated_delta_update(chunk=0)
    with pytest.raises(TypeError, match="block must be an int"):
        make_gated_delta_update(block=16.0)
    with pytest.raises(ValueError, match="block must be >= 1"):
        make_gated_delta_update(block=0)
    with pytest.raises(TypeError, match="kernel must be"):
        make_gated_delta_update(kernel="metal")
