"""nv.chunk_layers and nv.Chunks: a model's blocks along the sequence in chunks (attention in query chunks,
the MLP in token chunks), exact, by the backend's rule, one chunk at a time, and nothing changed outside the
instances asked for."""

import pickle
import threading

import mlx.core as mx
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import ernie4_5_moe, gemma3_text, gemma4_text, gpt_oss, llama, qwen3
from mlx_lm.tuner.trainer import default_loss

import nuvec_mlx as nv
from nuvec_mlx import _attention
from nuvec_mlx_bench import testing
from tests.helpers import assert_close, seeded_model

VOCAB = 64


#: The sizes of every small model here, which each architecture's own fields override.
SMALL = {
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-5,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def build(module, **fields):
    """A small random-weight model of ``module``'s architecture (``mlx_lm.models.<model_type>``): :data:`SMALL`'s
    sizes with ``fields`` over them."""
    return seeded_model(module, **{**SMALL, "model_type": module.__name__.rsplit(".", 1)[-1], **fields})


MODELS = {  # the attention each exercises: causal, GQA with q/k norms, a sliding-window array mask, sinks
    "llama": lambda: build(llama, tie_word_embeddings=True),
    "qwen3": lambda: build(
        qwen3, head_dim=8, tie_word_embeddings=True, max_position_embeddings=512, rope_theta=10000.0
    ),
    "gemma3_text": lambda: build(
        gemma3_text, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=24
    ),
    "gpt_oss": lambda experts=2, per_token=1: build(
        gpt_oss,
        intermediate_size=32,
        head_dim=8,
        num_local_experts=experts,
        num_experts_per_tok=per_token,
        sliding_window=24,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


def batch(tokens: int):
    ids = mx.random.randint(0, VOCAB, (1, tokens + 1), key=mx.random.key(1))
    return ids, mx.array([[0, tokens]])


def gradients(model, setting, tokens, projections=None, norms=None, mlp=None):
    """The loss and gradients of a step with every block checkpointed, attention chunked as ``setting`` says,
    attention's projections as ``projections``, the blocks' norms as ``norms`` and their MLP as ``mlp`` (whole
    by default), and the kinds of the step's stages."""
    nv.checkpoint_layers(model)
    nv.chunk_layers(model, nv.Chunks(attention=setting, mlp=mlp, projections=projections, norms=norms))
    step = nv.TrainingStep(model, default_loss, compile=False)
    with nv.memory.timeline() as timeline:
        ((loss, _), grads) = step(*batch(tokens))
    nv.chunk_layers(model, enable=False)
    nv.checkpoint_layers(model, enable=False)
    return loss, [g for _, g in tree_flatten(grads)], [r.kind for r in timeline.readings]


@pytest.mark.parametrize("arch", list(MODELS))
def test_chunked_attention_has_the_unchunked_loss_and_gradients(arch):
    model = MODELS[arch]()
    loss, grads, kinds = gradients(model, None, 80)
    chunked_loss, chunked_grads, chunked_kinds = gradients(model, 16, 80)
    assert "chunk" not in kinds and chunked_kinds.count("chunk") >= 2 * 5 * 2  # 5 query chunks, forward and back
    assert_close(chunked_loss, loss, 1e-6)
    assert_close(chunked_grads, grads, 2e-5)


def test_auto_chunks_where_the_backend_trains_attention_unfused(monkeypatch):
    q = mx.zeros((1, 2, 256, 64), dtype=mx.bfloat16)
    assert _attention.backend() == "cpu" and _attention.trains_unfused(q, q, q, causal=True)
    monkeypatch.setattr(_attention, "backend", lambda: "metal")
    assert _attention.trains_unfused(q, q, q, causal=True)  # Metal has no fused attention backward
    monkeypatch.setattr(_attention, "backend", lambda: "cuda")
    monkeypatch.setattr(mx, "device_info", lambda: {"compute_capability_major": 9})
    assert not _attention.trains_unfused(q, q, q, causal=True)  # cuDNN's fused backward
    assert _attention.trains_unfused(q.astype(mx.float32), q, q, causal=True)  # float32: the fallback
    assert _attention.trains_unfused(q[:, :, :200], q, q, causal=True)  # not a multiple of 128 queries
    wide = mx.zeros((1, 2, 256, 256), dtype=mx.bfloat16)
    assert _attention.trains_unfused(wide, wide, wide, causal=True)  # head size above 128
    assert _attention.default_size(q) == 4 * 64


def test_auto_chunks_fused_attention_past_mlx_fused_limit(monkeypatch):
    """On CUDA, 32 heads of 128 at 65,536 queries (2^28) are past what MLX's fused backward allocates: fused
    chunks (multiples of 128 queries) instead; 32,768 queries stay whole. The arrays are never evaluated."""
    monkeypatch.setattr(_attention, "backend", lambda: "cuda")
    monkeypatch.setattr(mx, "device_info", lambda: {"compute_capability_major": 9})
    q, kv = mx.zeros((1, 32, 65536, 128), dtype=mx.bfloat16), mx.zeros((1, 8, 65536, 128), dtype=mx.bfloat16)
    assert not _attention.trains_unfused(q, kv, kv, causal=True)
    assert _attention.chunk_size(q, kv, kv, "causal", "auto") == 32768
    assert _attention.chunk_size(q[:, :, :32768], kv, kv, "causal", "auto") is None
    odd = mx.zeros((1, 24, 65536, 128), dtype=mx.bfloat16)  # 2^27 / (24 x 128) = 43,690.7: 341 x 128
    assert _attention.chunk_size(odd, kv, kv, "causal", "auto") == 43648
    assert _attention.chunk_size(q, kv, kv, "causal", None) is None
    routed = nv.chunking.attention_routes(llama.Attention, "auto", blocks=32)["scaled_dot_product_attention"]
    seen = []  # what a chunked model's attention hands on: the same sizes
    monkeypatch.setattr(_attention, "scaled_dot_product_attention", lambda *a, chunk, **k: seen.append(chunk))
    routed(q, kv, kv, None, 1.0, "causal")
    routed(q[:, :, :32768], kv, kv, None, 1.0, "causal")
    assert seen == [32768, None]


def test_fused_attention_past_mlx_key_limit_runs_in_groups_of_heads_with_the_same_values_and_gradients(monkeypatch):
    """On CUDA, 32 query heads sharing 8 key-value heads of 128 at 131,072 keys are past what MLX's fused backward
    allocates: 16 query heads (4 key-value heads) per call; at 65,536 keys, or with no heads shared, one call.
    Computed so on the CPU (the fused path taken, with a small limit): the values and gradients of one call."""
    assert _attention.head_group(mx.zeros((1, 32, 8192, 128)), mx.zeros((1, 8, 131072, 128))) == 16
    assert _attention.head_group(mx.zeros((1, 32, 8192, 128)), mx.zeros((1, 8, 65536, 128))) is None
    assert _attention.head_group(mx.zeros((1, 32, 8192, 128)), mx.zeros((1, 32, 131072, 128))) is None
    monkeypatch.setattr(_attention, "trains_unfused", lambda *args: False)
    monkeypatch.setattr(_attention, "FUSED_KEY_LIMIT", 4 * 64 * 16)  # 4 query heads of 16 over 64 keys per call
    q, k, v = (mx.random.normal((1, h, 64, 16), key=mx.random.key(h)) for h in (8, 2, 3))
    v = v[:, :2]
    sinks, per_head = mx.random.normal((8,), key=mx.random.key(4)), mx.random.normal((8, 64, 64), key=mx.random.key(5))
    fast, calls = mx.fast.scaled_dot_product_attention, []
    monkeypatch.setattr(
        mx.fast, "scaled_dot_product_attention", lambda *a, **o: calls.append(a[0].shape) or fast(*a, **o)
    )
    for mask, options in (("causal", {}), (per_head, {}), (None, {"sinks": sinks})):

        def loss(q, k, v, attention, mask=mask, options=options):
            return (attention(q, k, v, scale=0.25, mask=mask, **options) ** 2).sum()

        calls.clear()
        grouped = mx.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, nv.scaled_dot_product_attention)
        assert calls == [(1, 4, 64, 16)] * 2, calls
        assert_close(grouped, mx.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, fast), rtol=1e-5)


def test_auto_leaves_attention_whole_where_it_is_fused(monkeypatch):
    model = MODELS["llama"]()
    monkeypatch.setattr(_attention, "trains_unfused", lambda *args: False)
    assert "chunk" not in gradients(model, "auto", 80)[2]
    monkeypatch.undo()
    assert "chunk" in gradients(model, "auto", 80)[2]  # head size 8: chunks of 32 queries on the CPU


def test_only_the_instances_asked_for_change_and_mlx_is_untouched():
    """No process-wide patch: mx.fast's function, another model of the same classes, and a thread that calls
    attention while a chunked step runs all see MLX's own attention."""
    original = mx.fast.scaled_dot_product_attention
    chunked, other = MODELS["llama"](), MODELS["llama"]()
    nv.chunk_layers(chunked, nv.Chunks(attention=16))
    assert mx.fast.scaled_dot_product_attention is original
    assert type(other.layers[0].self_attn) is not type(chunked.layers[0].self_attn)
    assert type(other.layers[0].self_attn) is nv.nn.original_class(chunked.layers[0].self_attn)
    kinds: list = []

    def elsewhere():  # another model's step, in another thread, at the same time
        step = nv.TrainingStep(other, default_loss, compile=False)
        with nv.memory.timeline() as timeline:
            step(*batch(40))
        kinds.extend(r.kind for r in timeline.readings)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    assert "chunk" in gradients(chunked, 16, 40)[2]
    thread.join()
    assert kinds and "chunk" not in kinds


def test_a_chunked_model_pickles_chunked_and_chunks_compose_with_checkpoints_either_way():
    model = MODELS["llama"]()
    nv.chunk_layers(model, nv.Chunks(attention=16))
    nv.checkpoint_module(model.layers[0].self_attn)  # a rerouted module, checkpointed after
    loaded = pickle.loads(pickle.dumps(model))
    for m in (model, loaded):
        attention = m.layers[0].self_attn
        assert nv.is_checkpointed(attention) and "scaled_dot_product_attention" in nv.nn.routes(attention)
    nv.chunk_layers(model, enable=False)  # the checkpoint stays, the route goes
    attention = model.layers[0].self_attn
    assert nv.is_checkpointed(attention) and not nv.nn.routes(attention)
    nv.chunk_layers(model, nv.Chunks(attention=16))  # rerouted while checkpointed
    assert nv.is_checkpointed(attention) and nv.nn.routes(attention)
    nv.checkpoint_module(attention, enable=False)
    assert not nv.is_checkpointed(attention) and nv.nn.routes(attention)


def test_chunks_settings_are_checked_and_zero_from_a_command_line_is_none():
    assert nv.Chunks.from_settings(mlp=0, attention="auto", head=None) == nv.Chunks(mlp=None)
    with pytest.raises(TypeError, match="attention must be 'auto', None or an int chunk size, got 'on'"):
        nv.Chunks(attention="on")
    with pytest.raises(ValueError, match="mlp must be >= 1, got -2"):
        nv.Chunks(mlp=-2)
    with pytest.raises(
        TypeError,
        match=r"Chunks has the settings \['attention', 'head', 'mlp', 'norms', 'projections', 'scan'\], got \['loss'\]",
    ):
        nv.Chunks.from_settings(loss=8)


@pytest.mark.slow
def test_the_step_s_peak_grows_with_tokens_not_their_square(compiled):
    """Attention unfused (the CPU, as Metal trains it): chunked, each doubling of the tokens at most doubles
    the step's rise in memory, plus 10%; unchunked, the scores make it grow about fourfold."""
    model = build(llama, hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
    rises = {}
    nv.checkpoint_layers(model)
    for setting in ("auto", None):
        nv.chunk_layers(model, nv.Chunks(attention=setting, mlp=None))
        step = nv.TrainingStep(model, default_loss, optim.SGD(0.0))
        for tokens in (512, 1024):
            step(*batch(tokens))  # traced for this length
            with nv.memory.measure() as m:
                step(*batch(tokens))
            rises[setting, tokens] = m.rise
    assert rises["auto", 1024] <= 2.2 * rises["auto", 512], rises
    assert rises[None, 1024] >= 3 * rises["auto", 1024], rises


def test_the_rules_bound_each_part_by_a_share_of_the_blocks_inputs_at_long_lengths():
    """Llama-3.1-8B's sizes (hidden 4096, 32 blocks, MLP 14336, vocabulary 128,256), batch 1: from 32k tokens
    on, a chunk of the head or of the MLP holds at most an eighth of the blocks' inputs, so the chunks grow no
    more with the sequence than the blocks' inputs do; at 1B sizes and batch 4 x 2048 the head keeps its chunks
    of 256 tokens and the MLP stays whole on a GPU."""
    chunking = nv.chunking
    for tokens in (32768, 65536, 131072):
        inputs = chunking.blocks_inputs(tokens, 4096, blocks=32)
        head = chunking.head_tokens(tokens, 4096, 128256, blocks=32)
        mlp = chunking.mlp_tokens(tokens, 4096, 14336, blocks=32)
        assert head * 128256 * chunking.HEAD_BYTES <= chunking.SHARE * inputs
        assert mlp is not None and mlp * 14336 * chunking.MLP_BYTES <= 1.1 * chunking.SHARE * inputs
    assert chunking.head_tokens(2048, 2048, 128256, batch=4, blocks=16) == 256
    assert chunking.mlp_tokens(2048, 2048, 8192, batch=4, blocks=16) is None  # a GPU: the MLP whole
    assert chunking.mlp_tokens(2048, 2048, 8192, batch=4, blocks=16, backend="cpu") == 60  # the CPU: chunked
    with pytest.raises(ValueError, match="backend must be one of cpu, gpu, got 'tpu'"):
        chunking.mlp_tokens(2048, 2048, 8192, backend="tpu")


def mlp_chunks(model, tokens: int) -> int:
    """The chunk stages of a step with every block checkpointed and only the MLP in chunks, by its rule."""
    return gradients(model, None, tokens, mlp="auto")[2].count("chunk")


def test_auto_chunks_a_long_sequence_s_mlp_and_leaves_a_short_one_whole(monkeypatch):
    """The rule asked at each call, with the call's sizes: a Llama of hidden 32 (MLP 64, 2 blocks), with the
    CPU's least work per chunk lowered to this model's size, in chunks of 32 tokens at 256 tokens (each MLP's 8
    chunks a stage in its forward and its backward pass), whole at 32."""
    monkeypatch.setitem(nv.chunking.MLP_MIN_WORK, "cpu", 32 * 32 * 64)
    assert nv.chunking.mlp_tokens(256, 32, 64, blocks=2, backend="cpu") == 32
    assert nv.chunking.mlp_tokens(32, 32, 64, blocks=2, backend="cpu") is None
    counts = [mlp_chunks(MODELS["llama"](), tokens) for tokens in (32, 256)]
    assert counts[1] - counts[0] == 2 * 2 * 8, counts  # 2 blocks, forward and backward, 8 chunks each


def ernie_moe(experts: int = 4, per_token: int = 1):
    """ERNIE-4.5-MoE, whose MoE keeps its experts per token only in its configuration (``args.moe_k``)."""
    return build(
        ernie4_5_moe,
        intermediate_size=32,
        moe_intermediate_size=32,
        max_position_embeddings=512,
        rope_theta=10000.0,
        use_bias=False,
        tie_word_embeddings=True,
        moe_num_experts=experts,
        moe_k=per_token,
    )


@pytest.mark.parametrize("make", [MODELS["gpt_oss"], ernie_moe], ids=["on the module", "in its configuration"])
def test_auto_sizes_a_mixture_of_experts_by_its_experts_per_token(monkeypatch, make):
    """A mixture of experts computes its chosen experts for each token: the rule sizes it as an MLP of its experts
    per token x their width. Hidden 32 with experts 32 wide, at 256 tokens, the CPU's least work per chunk lowered
    to 32 rows of a 64-wide MLP: one expert per token, chunks of 64 tokens (4 a block); two of four experts per
    token, chunks of 32 (8 a block)."""
    monkeypatch.setitem(nv.chunking.MLP_MIN_WORK, "cpu", 32 * 32 * 64)
    one, two = (mlp_chunks(make(4, k), 256) - mlp_chunks(make(4, k), 32) for k in (1, 2))
    assert (one, two) == (2 * 2 * 4, 2 * 2 * 8)  # 2 blocks, forward and backward


#: Gemma 4's own fields at this size: no keys and values shared, no per-layer inputs, every 2nd block sliding.
GEMMA4 = {
    "head_dim": 8,
    "global_head_dim": 16,
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": VOCAB,
    "sliding_window": 24,
    "sliding_window_pattern": 2,
}


def gemma4_moe(experts: int = 4, per_token: int = 1, width: int = 32):
    """Gemma 4's mixture of experts (the 26B-A4B's): a block's router and experts beside its MLP, called with the
    router's choices for each token, and its experts per token only in the configuration the block keeps
    (``config.top_k_experts``)."""
    moe = {"num_experts": experts, "top_k_experts": per_token, "moe_intermediate_size": width}
    return build(gemma4_text, **GEMMA4, enable_moe_block=True, **moe)


def test_gemma4_s_experts_beside_its_mlp_are_chunked_with_the_router_s_choices_and_the_same_gradients(monkeypatch):
    """Gemma 4's experts are a block's child beside its MLP, called as ``experts(h, indices, weights)``: both are
    checkpointed in chunks, the router's indices and weights split with the tokens, with the unchunked loss and
    gradients (the router's included). At 256 tokens, the CPU's least work per chunk lowered to 32 rows of a 64-wide
    MLP: the MLP (64 wide) in chunks of 32 (8 a block), the experts by their experts per token x their width (32),
    one per token in chunks of 64 (4 a block), two in chunks of 32 (8 a block)."""
    model = gemma4_moe(4, 2)
    assert [len(nv.chunking.feed_forwards(b)) for b in model.layers] == [2, 2]
    loss, grads, kinds = gradients(model, None, 32)
    chunked_loss, chunked_grads, chunked_kinds = gradients(model, None, 32, mlp=8)
    assert chunked_kinds.count("chunk") - kinds.count("chunk") == 2 * 2 * 2 * 4  # 2 blocks, 2 modules, 2 stages
    assert_close(chunked_loss, loss, 1e-6)
    assert_close(chunked_grads, grads, 2e-5)
    monkeypatch.setitem(nv.chunking.MLP_MIN_WORK, "cpu", 32 * 32 * 64)
    one, two = (mlp_chunks(gemma4_moe(4, k), 256) - mlp_chunks(gemma4_moe(4, k), 32) for k in (1, 2))
    assert (one, two) == (2 * 2 * (8 + 4), 2 * 2 * (8 + 8))  # 2 blocks, forward and backward


def test_gemma4_s_experts_in_chunks_lower_the_step_s_peak(monkeypatch):
    """Gemma 4's experts (4 of 8 per token, 128 wide: 512 per token against its MLP's 64) hold most of a block's
    backward pass: at 512 tokens, the CPU's least work per chunk lowered to this model's size, the step's rise with
    them in chunks is at most 0.6x the rise with only its MLP in chunks."""
    monkeypatch.setitem(nv.chunking.MLP_MIN_WORK, "cpu", 32 * 32 * 64)
    rises = []
    for names in (nv.chunking.FEED_FORWARD, ("mlp",)):
        monkeypatch.setattr(nv.chunking, "FEED_FORWARD", names)
        model = gemma4_moe(8, 4, width=128)
        nv.checkpoint_layers(model)
        nv.chunk_layers(model)
        step = nv.TrainingStep(model, default_loss, optim.SGD(0.0))
        step(*batch(512))  # traced for this length
        with nv.memory.measure() as m:
            step(*batch(512))
        rises.append(m.rise)
    assert rises[0] <= 0.6 * rises[1], rises


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("part, per_block", [("projections", 4), ("norms", 2)])
def test_projections_and_norms_in_chunks_have_the_unchunked_loss_and_gradients(arch, part, per_block):
    """Attention's projections (q_proj, k_proj, v_proj, o_proj), or a block's norms (input_layernorm,
    post_attention_layernorm, and Gemma's two around the MLP), checkpointed in chunks of 8 of 32 tokens: each
    one's 4 chunks a stage in its forward pass, in the block's recomputation (which reads their outputs: left
    to MLX, every chunk would be computed in one stage) and in its backward pass, and the same loss and
    gradients."""
    model = MODELS[arch]()
    find = getattr(nv.chunking, part)
    found = sum(len(find(b)) for b in model.layers)
    loss, grads, kinds = gradients(model, None, 32)
    chunked_loss, chunked_grads, chunked_kinds = gradients(model, None, 32, **{part: 8})
    assert found >= per_block * len(model.layers)
    assert chunked_kinds.count("chunk") - kinds.count("chunk") == found * 4 * 3
    assert_close(chunked_loss, loss, 1e-6)
    assert_close(chunked_grads, grads, 2e-5)
    assert not any(nv.is_checkpointed(m) for b in model.layers for m in find(b))  # undone


def test_auto_chunks_a_long_sequence_s_projections_alike_and_leaves_a_short_one_whole(monkeypatch):
    """The projections' rule is the MLP's, of each projection's width or its input's, the wider: with the CPU's
    least work per chunk lowered to 32 rows of this Llama's width (32), every projection in chunks of 32 at 256
    tokens, the key and value projections too (their output is 16 wide: 2 of the 4 heads, but their backward
    pass holds a float32 copy of their 32-wide input), and none at 32 tokens."""
    monkeypatch.setitem(nv.chunking.MLP_MIN_WORK, "cpu", 32 * 32 * 32)
    counts = [gradients(MODELS["llama"](), None, tokens, projections="auto")[2].count("chunk") for tokens in (32, 256)]
    assert counts == [0, 2 * 4 * 8 * 3]  # 2 blocks, 4 projections, 8 chunks in 3 stages each


def test_auto_chunks_the_norms_where_mlx_computes_them_unfused_and_leaves_fused_ones_whole(monkeypatch):
    """On the CPU MLX computes a norm in float32 with plain operations: ``"auto"`` chunks it as the MLP's rule
    sizes an MLP of the hidden width (here at 256 tokens, not at 32); on a GPU the norm is one fused kernel,
    left whole."""
    monkeypatch.setitem(nv.chunking.MLP_MIN_WORK, "cpu", 32 * 32 * 32)
    counts = [gradients(MODELS["llama"](), None, tokens, norms="auto")[2].count("chunk") for tokens in (32, 256)]
    assert counts[0] == 0 and counts[1] >= 2 * 2 * 2 * 2, counts  # 2 blocks, 2 norms, 2 chunks or more
    monkeypatch.setitem(nv.chunking.MLP_MIN_WORK, "gpu", 32 * 32 * 32)  # the MLP's rule alone would chunk them
    for gpu in ("metal", "cuda"):
        monkeypatch.setattr(_attention, "backend", lambda gpu=gpu: gpu)
        assert gradients(MODELS["llama"](), None, 256, norms="auto")[2].count("chunk") == 0, gpu


def test_whole_up_to_is_the_longest_length_the_rules_leave_a_module_whole(monkeypatch):
    """Llama-3.1-8B's public configuration (built, never evaluated) on a GPU: its attention projections whole up
    to 8,192 tokens (the least work of a chunk over 4,096 x 4,096), its MLP up to 2,341 (over 4,096 x 14,336),
    its norms always (fused there); a chunk setting's own size; on the CPU, lower least work, shorter lengths."""
    config = testing.public_config("llama-3.1-8b")
    model = llama.Model(llama.ModelArgs.from_dict(config))
    monkeypatch.setattr(_attention, "backend", lambda: "cuda")
    assert nv.chunking.whole_up_to(model, 4096) == 8192
    assert nv.chunking.whole_up_to(model, 4096, nv.Chunks(projections=None)) == 2341
    assert nv.chunking.mlp_tokens(2341, 4096, 14336, blocks=32) is None
    assert nv.chunking.mlp_tokens(2342, 4096, 14336, blocks=32) == 2341
    assert nv.chunking.whole_up_to(model, 4096, nv.Chunks(projections=None, mlp=None)) == 0
    assert nv.chunking.whole_up_to(model, 4096, nv.Chunks(projections=None, mlp=1000)) == 1000
    monkeypatch.setattr(_attention, "backend", lambda: "cpu")
    assert nv.chunking.whole_up_to(model, 4096) == 4  # 1 << 26 over 4,096 x 4,096: the norms' and projections'
    with pytest.raises(TypeError, match="chunks must be an nv.Chunks or None"):
        nv.chunking.whole_up_to(model, 4096, {"mlp": 1})
