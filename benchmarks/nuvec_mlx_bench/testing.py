"""Models for tests and benchmarks: deterministic blocks, and mlx-lm models with random weights.

Two families, each built with MLX alone (mlx-lm is imported only by the
functions that build its models):

- **Blocks**: residual blocks in float32 with deterministic weights and
  inputs (:func:`filled`): the seed's MLP block, ``[B, D] -> [B, 4D] -> [B, D]``
  (nuvec-compile 0.6.1's checkpoint memory test), and a pre-norm decoder block
  on ``[B, T, D]`` (causal single-head attention, then a 4x gelu MLP). Each is a
  flat function (:func:`mlp_block`, :func:`transformer_block`: a list of arrays
  to a list of arrays, as :func:`nuvec_mlx.checkpoint_flat` takes it) and an
  ``mlx.nn`` module (:class:`MLPBlock`, :class:`TransformerBlock`, whose
  ``nn.Linear`` layers the ``save_matmuls`` policy sees), held in a model's
  ``layers`` (:class:`Blocks`, :func:`blocks_model`). The loss is
  ``sum(blocks(x))`` (:func:`blocks_loss`).
- **mlx-lm models**: an architecture at a chosen width and depth
  (:func:`mlx_lm_config`), or a public model's configuration
  (:data:`PUBLIC_CONFIGS`, :func:`public_config`), built by mlx-lm with its own
  random initialisation (:func:`mlx_lm_model`), with a batch of random tokens
  (:func:`mlx_lm_batch`); a tiny tokenizer for a model folder (:func:`write_tokenizer`).

Example:
    >>> from nuvec_mlx_bench import testing
    >>> model, x = testing.blocks_model("mlp", batch=64, dim=32, blocks=4)
    >>> loss, grads = nv.value_and_grad(model, testing.blocks_loss)(model, x)
    >>> model, config = testing.mlx_lm_model(testing.public_config("qwen3-0.6b", layers=2))
"""

from __future__ import annotations

import contextlib
import importlib
import io
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

# nuvec_mlx's one handle on MLX's thread key (MLX 0.32 has no setter): a model built here draws
# from its own seed and leaves the caller's random state as it was. The one private name this
# distribution takes from the library, which it is released with.
from nuvec_mlx import _random

__all__ = [
    "ARCHITECTURES",
    "BLOCK_FUNCTIONS",
    "BLOCK_KINDS",
    "DTYPES",
    "INPUT_SEED",
    "PUBLIC_CONFIGS",
    "QUANTIZATION",
    "Blocks",
    "MLPBlock",
    "TransformerBlock",
    "block_input",
    "block_weights",
    "blocks_loss",
    "blocks_model",
    "filled",
    "flat_inputs",
    "flat_loss",
    "input_shape",
    "mlp_block",
    "mlx_lm_batch",
    "mlx_lm_checkpoint",
    "mlx_lm_config",
    "mlx_lm_model",
    "public_config",
    "transformer_block",
    "weight_shapes",
]

# ---------------------------------------------------------------- blocks

#: The block models: ``mlp`` the seed's block, ``transformer`` the pre-norm decoder block.
BLOCK_KINDS = ("mlp", "transformer")
#: Each block's weights per kind: (rows, columns) in units of the width D, and a seed
#: (block ``i`` adds ``i`` to it, so that every block has its own values).
WEIGHTS = {
    "mlp": [((1, 4), 0.11), ((4, 1), 0.23)],
    "transformer": [((1, 3), 0.13), ((1, 1), 0.17), ((1, 4), 0.11), ((4, 1), 0.23)],
}
#: The seed of the blocks' input.
INPUT_SEED = 0.37
#: The layer norms' epsilon.
LN_EPS = 1e-5


def filled(shape: Sequence[int], seed: float) -> mx.array:
    """Deterministic, well-scaled float32 values: ``sin(arange(n) * seed) * 0.05``, reshaped.

    Args:
        shape: the array's shape.
        seed: the factor of the ramp; another seed gives other values.

    Returns:
        The array, float32, unevaluated.

    Example:
        >>> filled((2, 3), 0.5).shape
        (2, 3)
    """
    if not isinstance(seed, (int, float)) or isinstance(seed, bool):
        raise TypeError(f"seed must be a float, got {type(seed).__name__} ({seed!r})")
    shape = tuple(_int(n, "shape", minimum=0) for n in shape)
    return (mx.sin(mx.arange(math.prod(shape), dtype=mx.float32) * seed) * 0.05).reshape(shape)


def _check_kind(kind: str) -> str:
    if kind not in BLOCK_KINDS:
        raise ValueError(f"kind must be one of {BLOCK_KINDS}, got {kind!r}")
    return kind


def weight_shapes(kind: str, dim: int, index: int) -> list[tuple[tuple[int, int], float]]:
    """The (shape, seed) of each weight of block ``index`` of ``kind`` at width ``dim``.

    Example:
        >>> weight_shapes("mlp", 8, 0)
        [((8, 32), 0.11), ((32, 8), 0.23)]
    """
    _check_kind(kind)
    _int(dim, "dim", minimum=1)
    _int(index, "index", minimum=0)
    return [((rows * dim, cols * dim), seed + index) for (rows, cols), seed in WEIGHTS[kind]]


def block_weights(kind: str, dim: int, index: int) -> list[mx.array]:
    """The weights of block ``index`` (:func:`filled` at :func:`weight_shapes`), in the block's order.

    Example:
        >>> [w.shape for w in block_weights("transformer", 8, 0)]
        [(8, 24), (8, 8), (8, 32), (32, 8)]
    """
    return [filled(shape, seed) for shape, seed in weight_shapes(kind, dim, index)]


def input_shape(kind: str, batch: int, dim: int, seq: int = 1) -> tuple[int, ...]:
    """The shape of the blocks' input (and of every block's output): ``[B, D]`` or ``[B, T, D]``.

    Raises:
        ValueError: a size below 1, or ``seq`` other than 1 for the MLP, which has no sequence.
    """
    _check_kind(kind)
    for name, value in (("batch", batch), ("dim", dim), ("seq", seq)):
        _int(value, name, minimum=1)
    if kind == "mlp":
        if seq != 1:
            raise ValueError(f"seq must be 1 for the mlp, which has no sequence, got {seq}")
        return (batch, dim)
    return (batch, seq, dim)


def block_input(kind: str, batch: int, dim: int, seq: int = 1) -> mx.array:
    """The blocks' input: :func:`filled` at :data:`INPUT_SEED` in :func:`input_shape`."""
    return filled(input_shape(kind, batch, dim, seq), INPUT_SEED)


def mlp_block(xs: list[mx.array]) -> list[mx.array]:
    """The seed's block ``[x, w1, w2] -> [x + tanh(tanh(tanh(x @ w1)²) @ w2)]``.

    Example:
        >>> y, = mlp_block([block_input("mlp", 4, 8), *block_weights("mlp", 8, 0)])
    """
    x, w1, w2 = xs
    h = mx.tanh(x @ w1)
    h = mx.tanh(h * h)
    return [x + mx.tanh(h @ w2)]


def transformer_block(xs: list[mx.array]) -> list[mx.array]:
    """The pre-norm decoder block ``[x, wqkv, wo, w1, w2] -> [y]`` on ``[B, T, D]``.

    Causal single-head attention (scale ``D ** -0.5``), then a 4x MLP with
    exact gelu, each after a layer norm without affine parameters, each added
    to its input.
    """
    x, wqkv, wo, w1, w2 = xs
    h = mx.fast.layer_norm(x, None, None, LN_EPS)
    q, k, v = mx.split((h @ wqkv)[:, None], 3, axis=-1)
    a = mx.fast.scaled_dot_product_attention(q, k, v, scale=x.shape[-1] ** -0.5, mask="causal")
    x = x + a[:, 0] @ wo
    h = mx.fast.layer_norm(x, None, None, LN_EPS)
    return [x + nn.gelu(h @ w1) @ w2]


#: Each kind's block as a flat function.
BLOCK_FUNCTIONS = {"mlp": mlp_block, "transformer": transformer_block}


def flat_inputs(kind: str, batch: int, dim: int, blocks: int, seq: int = 1) -> list[mx.array]:
    """What :func:`flat_loss` takes: every block's weights in turn (:func:`block_weights`), then the
    input (:func:`block_input`), evaluated.

    Example:
        >>> len(flat_inputs("mlp", batch=4, dim=8, blocks=3))
        7
    """
    x = block_input(kind, batch, dim, seq)
    _int(blocks, "blocks", minimum=1)
    xs = [w for i in range(blocks) for w in block_weights(kind, dim, i)] + [x]
    mx.eval(xs)
    return xs


def flat_loss(
    kind: str, blocks: int, wrap: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
) -> Callable[[list[mx.array]], mx.array]:
    """The blocks' loss ``sum(blocks(x))`` as a flat function of :func:`flat_inputs`' list.

    Args:
        kind: one of :data:`BLOCK_KINDS`.
        blocks: the number of blocks.
        wrap: applied to the block's flat function before the blocks run it
            (:func:`nuvec_mlx.checkpoint_flat`, for example); ``None`` runs it as it is.

    Example:
        >>> loss = flat_loss("mlp", 3, wrap=nv.checkpoint_flat)
        >>> value, grads = nv.value_and_grad_flat(loss, [6])(flat_inputs("mlp", 4, 8, 3))
    """
    block = BLOCK_FUNCTIONS[_check_kind(kind)]
    block = block if wrap is None else wrap(block)
    per = len(WEIGHTS[kind])
    _int(blocks, "blocks", minimum=1)

    def loss(xs: list[mx.array]) -> mx.array:
        h = xs[-1]
        for i in range(blocks):
            h = block([h, *xs[per * i : per * (i + 1)]])[0]
        return h.sum()

    return loss


def _linear(weight: mx.array) -> nn.Linear:
    """An ``nn.Linear`` without bias computing ``x @ weight`` (it holds ``weight.T``)."""
    layer = nn.Linear(weight.shape[0], weight.shape[1], bias=False)
    layer.weight = weight.T
    return layer


class MLPBlock(nn.Module):
    """:func:`mlp_block` as a module: ``x + tanh(down(tanh(tanh(up(x))²)))``.

    Args:
        w1, w2: the weights as :func:`mlp_block` takes them (``[D, 4D]``, ``[4D, D]``).
    """

    def __init__(self, w1: mx.array, w2: mx.array):
        super().__init__()
        self.up, self.down = _linear(w1), _linear(w2)

    def __call__(self, x: mx.array) -> mx.array:
        h = mx.tanh(self.up(x))
        return x + mx.tanh(self.down(mx.tanh(h * h)))


class TransformerBlock(nn.Module):
    """:func:`transformer_block` as a module, its four matrices ``nn.Linear`` layers (qkv, out, up, down).

    Args:
        wqkv, wo, w1, w2: the weights as :func:`transformer_block` takes them.
    """

    def __init__(self, wqkv: mx.array, wo: mx.array, w1: mx.array, w2: mx.array):
        super().__init__()
        self.qkv, self.out, self.up, self.down = _linear(wqkv), _linear(wo), _linear(w1), _linear(w2)

    def __call__(self, x: mx.array) -> mx.array:
        h = mx.fast.layer_norm(x, None, None, LN_EPS)
        q, k, v = mx.split(self.qkv(h)[:, None], 3, axis=-1)
        a = mx.fast.scaled_dot_product_attention(q, k, v, scale=x.shape[-1] ** -0.5, mask="causal")
        x = x + self.out(a[:, 0])
        h = mx.fast.layer_norm(x, None, None, LN_EPS)
        return x + self.down(nn.gelu(self.up(h)))


class Blocks(nn.Module):
    """Blocks of one kind in ``layers``, applied in turn.

    Args:
        kind: one of :data:`BLOCK_KINDS`.
        weights: each block's weights, in the block's order (:func:`block_weights`'s).

    Example:
        >>> model = Blocks("mlp", [block_weights("mlp", 8, i) for i in range(3)])
        >>> len(model.layers)
        3
    """

    def __init__(self, kind: str, weights: Sequence[Sequence[mx.array]]):
        super().__init__()
        block = MLPBlock if _check_kind(kind) == "mlp" else TransformerBlock
        self.kind = kind
        self.layers = [block(*ws) for ws in weights]

    def __call__(self, x: mx.array) -> mx.array:
        for layer in self.layers:
            x = layer(x)
        return x


def blocks_loss(model: nn.Module, x: mx.array) -> mx.array:
    """The blocks' loss: the sum of the last block's output."""
    return model(x).sum()


def blocks_model(kind: str, batch: int, dim: int, blocks: int, seq: int = 1) -> tuple[Blocks, mx.array]:
    """A :class:`Blocks` model with :func:`block_weights` and its :func:`block_input`, evaluated.

    Args:
        kind: one of :data:`BLOCK_KINDS`.
        batch, dim, blocks: B, the width D and the number of blocks.
        seq: the transformer's sequence length T (1 for the MLP).

    Returns:
        The model and its input.

    Example:
        >>> model, x = blocks_model("transformer", batch=2, dim=64, blocks=4, seq=128)
        >>> nv.value_and_grad(model, blocks_loss)(model, x)
    """
    x = block_input(kind, batch, dim, seq)
    _int(blocks, "blocks", minimum=1)
    model = Blocks(kind, [block_weights(kind, dim, i) for i in range(blocks)])
    mx.eval(model.parameters(), x)
    return model, x


# ---------------------------------------------------------------- mlx-lm models

#: The architectures :func:`mlx_lm_config` scales, by mlx-lm ``model_type``: dense (llama, qwen3,
#: gemma3_text, phi3), mixture of experts (qwen3_moe), layers returning more than an array
#: (gemma4_text: ``(h, shared_kv, offset)``), and a hybrid of two layer classes (olmo_hybrid:
#: gated delta-net and attention).
ARCHITECTURES = (
    "llama",
    "qwen3",
    "gemma3_text",
    "phi3",
    "qwen3_moe",
    "gemma4_text",
    "olmo_hybrid",
    "qwen3_5",
    "mamba2",
)
#: The dtypes a model's weights can take.
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
#: Quantization for QLoRA (the base model's weights), as ``mlx_lm.convert -q`` writes it.
QUANTIZATION = {"group_size": 32, "bits": 4}

_LLAMA_3_2 = {  # what Llama 3.2's configurations share
    "model_type": "llama",
    "intermediate_size": 8192,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "attention_bias": False,
    "mlp_bias": False,
}
_QWEN3 = {  # what Qwen3's configurations share (q and k normed per head: mlx-lm's qwen3 always has them)
    "model_type": "qwen3",
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "max_position_embeddings": 40960,
}

#: Public models' configurations: the ``config.json`` fields mlx-lm reads, as published
#: (hidden / layers / heads / kv heads / head dim / intermediate / vocabulary / tied).
PUBLIC_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        **_LLAMA_3_2,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "head_dim": 64,
    },
    "llama-3.2-3b": {
        **_LLAMA_3_2,
        "hidden_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "head_dim": 128,
    },
    "llama-3.1-8b": {  # Llama 3.2's fields, untied, with a rope scaling factor of 8 (3.2's is 32)
        **_LLAMA_3_2,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "head_dim": 128,
        "intermediate_size": 14336,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    },
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072},
    "qwen3-1.7b": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144},
    "qwen3-8b": {
        **_QWEN3,
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "intermediate_size": 12288,
        "tie_word_embeddings": False,
    },
    "qwen3.5-0.8b": {  # its text_config, flat (mlx-lm's qwen3_5 reads it so): 3 gated delta-net layers to 1 attention
        "model_type": "qwen3_5",
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "intermediate_size": 3584,
        "vocab_size": 248320,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "attention_bias": False,
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
    },
    "gemma-3-1b": {  # 5 local layers (sliding window 512) to 1 global
        "model_type": "gemma3_text",
        "hidden_size": 1152,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "intermediate_size": 6912,
        "vocab_size": 262144,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 32768,
    },
    "smollm2-1.7b": {  # a Llama; assumed (as recalled, not read here): rope_theta 130000, 8192 positions
        "model_type": "llama",
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "rope_theta": 130000.0,
        "rope_scaling": None,
        "max_position_embeddings": 8192,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen3-30b-a3b": {  # every layer a mixture of 128 experts (8 per token); intermediate_size is unused
        **_QWEN3,
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "intermediate_size": 6144,
        "tie_word_embeddings": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
}


def _heads(hidden: int) -> tuple[int, int, int]:
    """(attention heads, key-value heads, head dim) for a width: heads of 64 (``hidden // 2`` for
    tiny widths) and the largest divisor of the heads up to a quarter of them as key-value heads."""
    head_dim = 64 if hidden >= 128 else max(hidden // 2, 8)
    heads = max(hidden // head_dim, 1)
    kv_heads = max(d for d in range(1, max(heads // 4, 1) + 1) if heads % d == 0)
    return heads, kv_heads, head_dim


def mlx_lm_config(arch: str, hidden: int, layers: int, vocab: int = 32000) -> dict[str, Any]:
    """An mlx-lm ``config.json`` for ``arch`` scaled to a width and depth.

    Heads of 64 (or ``hidden // 2`` for tiny widths), the largest divisor of
    the heads up to a quarter of them as key-value heads (so that grouped
    attention is valid at any width), an MLP four times as wide, untied
    embeddings (tied for gemma4_text, which has no head of its own).

    Args:
        arch: one of :data:`ARCHITECTURES`.
        hidden: the model width (a multiple of 32, which QLoRA's groups need).
        layers: the number of blocks (gemma4_text needs 3 or more: its last
            block reads the keys and values of an earlier one).
        vocab: the vocabulary size.

    Raises:
        TypeError, ValueError: naming the argument it cannot take.

    Example:
        >>> mlx_lm_config("llama", hidden=2048, layers=16)["num_attention_heads"]
        32
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    for name, value, least in (("hidden", hidden, 32), ("layers", layers, 1), ("vocab", vocab, 8)):
        _int(value, name, minimum=least)
    if hidden % 32:
        raise ValueError(f"hidden must be a multiple of 32 (QLoRA quantizes in groups of 32), got {hidden}")
    if arch == "gemma4_text" and layers < 3:
        raise ValueError(f"gemma4_text needs layers >= 3 (one shares an earlier one's keys), got {layers}")
    if arch == "gemma3_text" and layers < 2:
        raise ValueError(f"gemma3_text needs layers >= 2 (its sliding window pattern, 2 here), got {layers}")
    heads, kv_heads, head_dim = _heads(hidden)
    base = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "intermediate_size": 4 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    }
    if arch == "gemma3_text":
        base.update(query_pre_attn_scalar=head_dim, sliding_window=512, sliding_window_pattern=2)
    elif arch == "qwen3_moe":
        base.update(
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            moe_intermediate_size=hidden,
            norm_topk_prob=True,
        )
    elif arch == "gemma4_text":
        base.update(
            global_head_dim=head_dim,
            num_kv_shared_layers=1,
            sliding_window=512,
            sliding_window_pattern=2,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=vocab,
            tie_word_embeddings=True,
        )
    elif arch == "qwen3_5":  # gated-delta heads of 32, half as many key heads; every 4th block full attention
        base.update(
            linear_num_value_heads=hidden // 32,
            linear_num_key_heads=max(1, hidden // 64),
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            full_attention_interval=4 if layers >= 4 else 2,
        )
    elif arch == "mamba2":  # state-space blocks only
        base.update(
            num_heads=heads,
            head_dim=2 * hidden // heads,
            intermediate_size=2 * hidden,
            state_size=16,
            n_groups=1,
            conv_kernel=4,
            layer_norm_epsilon=1e-5,
            use_bias=False,
            use_conv_bias=True,
            time_step_limit=(0.001, 100.0),
            time_step_rank="auto",
        )
    elif arch == "olmo_hybrid":
        base.update(
            linear_num_key_heads=heads,
            linear_num_value_heads=heads,
            linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim,
            linear_conv_kernel_dim=4,
            linear_allow_neg_eigval=False,
            attention_bias=False,
            layer_types=["full_attention" if i % 2 else "linear_attention" for i in range(layers)],
        )
    return base


def public_config(name: str, layers: int | None = None) -> dict[str, Any]:
    """A public model's configuration (:data:`PUBLIC_CONFIGS`), at its depth or fewer layers.

    Args:
        name: a key of :data:`PUBLIC_CONFIGS` (``"llama-3.2-1b"``, ``"qwen3-0.6b"`` ...).
        layers: the number of blocks (at most the model's, and for Gemma 3 at
            least its ``sliding_window_pattern``, 6, where its first global
            layer is; ``None`` for all of them): a shallower model with every
            other field as published.

    Returns:
        A new dict (changing it leaves :data:`PUBLIC_CONFIGS` as it is).

    Example:
        >>> public_config("gemma-3-1b", layers=6)["num_hidden_layers"]
        6
    """
    if name not in PUBLIC_CONFIGS:
        raise ValueError(f"name must be one of {', '.join(PUBLIC_CONFIGS)}, got {name!r}")
    config: dict[str, Any] = {
        k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
        for k, v in PUBLIC_CONFIGS[name].items()
    }
    if layers is not None:
        depth = config["num_hidden_layers"]
        least = config.get("sliding_window_pattern", 1)  # mlx-lm's gemma3_text reads a global layer's mask
        if not least <= _int(layers, "layers", minimum=1) <= depth:
            raise ValueError(f"layers must be from {least} to {name}'s {depth}, got {layers}")
        config["num_hidden_layers"] = layers
    return config


def mlx_lm_model(
    config: dict[str, Any], dtype: str = "bfloat16", quantized: bool = False, seed: int = 0
) -> tuple[nn.Module, dict[str, Any]]:
    """The mlx-lm model of ``config``, initialised at random by mlx-lm, its weights in ``dtype``.

    Tied embeddings are set up as ``mlx_lm.utils.load`` sets them up for a
    checkpoint without head weights (``model.sanitize``); the global random
    state is left as it was. Needs mlx-lm.

    Args:
        config: an mlx-lm config (:func:`mlx_lm_config`'s, :func:`public_config`'s).
        dtype: a key of :data:`DTYPES`.
        quantized: quantize the weights as :data:`QUANTIZATION` says (the base
            of QLoRA), as ``mlx_lm.convert -q`` does.
        seed: the random seed of the initialisation.

    Returns:
        The model, evaluated, in eval mode (as ``mlx_lm.utils.load`` returns it),
        and its config (with ``quantization`` where quantized, as
        ``mlx_lm.convert`` writes it).

    Example:
        >>> model, config = mlx_lm_model(mlx_lm_config("llama", 64, 2, vocab=64), "bfloat16")
    """
    if not isinstance(config, dict) or "model_type" not in config:
        raise TypeError(f"config must be an mlx-lm config dict with a model_type, got {config!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    _bool(quantized, "quantized")
    _int(seed, "seed", minimum=0)
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    with _random.drawing_from(mx.random.key(seed)):
        model = arch.Model(arch.ModelArgs.from_dict(config))
        if config.get("tie_word_embeddings") and hasattr(model, "sanitize"):
            model.sanitize({})  # a checkpoint without head weights: mlx-lm ties the head (gemma3_text)
        to = DTYPES[dtype]
        model.update(tree_map(lambda p: p.astype(to) if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters()))
        if quantized:  # as mlx_lm.convert -q: the layers whose rows split into whole groups
            from mlx_lm.utils import quantize_model

            with contextlib.redirect_stdout(io.StringIO()):  # its "[INFO] Quantized ..." line
                model, config = quantize_model(model, config, QUANTIZATION["group_size"], QUANTIZATION["bits"])
        mx.eval(model.parameters())
    model.eval()
    return model, config


def mlx_lm_batch(vocab: int, batch: int, seq: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    """mlx-lm's training batch of random tokens: ``(batch, seq + 1)`` ids and each row's ``(offset, length)``.

    The tokens are drawn with their own key (``mx.random.key(seed)``); the
    global random state is not touched.

    Example:
        >>> tokens, lengths = mlx_lm_batch(vocab=64, batch=2, seq=16)
        >>> default_loss(model, tokens, lengths)
    """
    for name, value in (("vocab", vocab), ("batch", batch), ("seq", seq)):
        _int(value, name, minimum=1)
    _int(seed, "seed", minimum=0)
    tokens = mx.random.randint(0, vocab, (batch, seq + 1), key=mx.random.key(seed))
    return tokens, mx.array([[0, seq + 1]] * batch)


#: The words of the tiny tokenizer (:func:`write_tokenizer`), and its special tokens before them.
WORDS = [f"w{i}" for i in range(60)]
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]
#: The tiny tokenizer's vocabulary.
TOKENIZER_VOCAB = len(SPECIAL) + len(WORDS)


def write_tokenizer(folder: str | Path) -> None:
    """A word-level tokenizer of :data:`WORDS` in ``folder``, saved as ``transformers`` saves one: what
    ``mlx_lm.utils.load`` needs beside a model's weights (the commands load a model with its tokenizer). Needs
    ``transformers`` and ``tokenizers`` (mlx-lm's dependencies).

    Example:
        >>> write_tokenizer("./model")  # then mlx_lm.utils.load("./model") loads it
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    ).save_pretrained(str(folder))


@contextlib.contextmanager
def mlx_lm_checkpoint(model: nn.Module) -> Iterator[None]:
    """mlx-lm's ``--grad-checkpoint`` on ``model``'s blocks inside, as its trainer applies it, and not after.

    mlx-lm's ``grad_checkpoint(model.layers[0])`` replaces the ``__call__`` of the block's class (every
    block of it, in every model of that class); here it is put back on leaving. For comparing nuvec's
    checkpoints with mlx-lm's in one process. Needs mlx-lm.

    Example:
        >>> with mlx_lm_checkpoint(model):
        ...     loss, grads = nn.value_and_grad(model, default_loss)(model, tokens, lengths)
    """
    from mlx_lm.tuner.trainer import grad_checkpoint

    cls = type(model.layers[0])
    held = cls.__dict__["__call__"]
    grad_checkpoint(model.layers[0])
    try:
        yield
    finally:
        cls.__call__ = held


def _int(value: object, name: str, minimum: int) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``; else a ``TypeError`` or ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _bool(value: object, name: str) -> bool:
    """``value`` if it is a bool; else a ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value
