"""mlx-lm architectures at a chosen size: configs and random-weight models.

No model can be downloaded where the benchmark and the tests run, and the
figures should not depend on trained weights: a model is built from an
mlx-lm config (``config.json``'s fields) with mlx-lm's own random
initialisation, cast to a dtype and, for QLoRA, quantized as
``mlx_lm.convert -q`` quantizes it. Every architecture is scaled by its width
(``hidden``) and depth (``layers``): heads of 64 (or ``hidden // 2``, for
tiny widths), a quarter as many key-value heads, an MLP four times as wide.
"""

from __future__ import annotations

import contextlib
import importlib
import io

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.utils import quantize_model

#: The architectures, by mlx-lm ``model_type``: dense (llama, qwen3, gemma3_text, phi3), mixture
#: of experts (qwen3_moe), layers returning more than an array (gemma4_text: ``(h, shared_kv,
#: offset)``), and a hybrid of two layer classes (olmo_hybrid: gated delta-net and attention).
ARCHITECTURES = ("llama", "qwen3", "gemma3_text", "phi3", "qwen3_moe", "gemma4_text", "olmo_hybrid")
#: The dtypes a model's weights can take.
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
#: Quantization for QLoRA (the base model's weights), as ``mlx_lm.convert -q`` writes it.
QUANTIZATION = {"group_size": 32, "bits": 4}


def _heads(hidden: int) -> tuple[int, int, int]:
    """(attention heads, key-value heads, head dim) for a width."""
    head_dim = 64 if hidden >= 128 else max(hidden // 2, 8)
    heads = max(hidden // head_dim, 1)
    return heads, max(heads // 4, 1), head_dim


def config(arch: str, hidden: int, layers: int, vocab: int = 32000) -> dict:
    """An mlx-lm ``config.json`` for ``arch`` at a width and depth.

    Args:
        arch: one of :data:`ARCHITECTURES`.
        hidden: the model width (a multiple of 32, which QLoRA's groups need).
        layers: the number of blocks (gemma4_text needs 3 or more: its last
            block reads the keys and values of an earlier one).
        vocab: the vocabulary size.

    Raises:
        ValueError: an unknown architecture or a size it cannot take.

    Example:
        >>> config("llama", hidden=2048, layers=16)["num_attention_heads"]
        32
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    for name, value, least in (("hidden", hidden, 32), ("layers", layers, 1), ("vocab", vocab, 8)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if hidden % 32:
        raise ValueError(f"hidden must be a multiple of 32 (QLoRA quantizes in groups of 32), got {hidden}")
    if arch == "gemma4_text" and layers < 3:
        raise ValueError(f"gemma4_text needs layers >= 3 (one shares an earlier one's keys), got {layers}")
    heads, kv_heads, head_dim = _heads(hidden)
    base = {"model_type": arch, "hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": vocab,
            "intermediate_size": 4 * hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 131072,
            "tie_word_embeddings": False}
    if arch == "gemma3_text":
        base.update(query_pre_attn_scalar=head_dim, sliding_window=512, sliding_window_pattern=2)
    elif arch == "qwen3_moe":
        base.update(num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                    moe_intermediate_size=hidden, norm_topk_prob=True)
    elif arch == "gemma4_text":
        base.update(global_head_dim=head_dim, num_kv_shared_layers=1, sliding_window=512, sliding_window_pattern=2,
                    hidden_size_per_layer_input=16, vocab_size_per_layer_input=vocab, tie_word_embeddings=True)
    elif arch == "olmo_hybrid":
        base.update(linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=head_dim,
                    linear_value_head_dim=head_dim, linear_conv_kernel_dim=4, linear_allow_neg_eigval=False,
                    attention_bias=False,
                    layer_types=["full_attention" if i % 2 else "linear_attention" for i in range(layers)])
    return base


def build(config: dict, dtype: str = "bfloat16", quantized: bool = False, seed: int = 0) -> tuple[nn.Module, dict]:
    """The mlx-lm model of ``config``, randomly initialised by mlx-lm, its weights in ``dtype``.

    Args:
        config: an mlx-lm config (:func:`config`'s).
        dtype: a key of :data:`DTYPES`.
        quantized: quantize the weights as :data:`QUANTIZATION` says (the base of QLoRA).
        seed: the random seed of the initialisation.

    Returns:
        The model, evaluated, in eval mode (as ``mlx_lm.utils.load`` returns it), and
        its config (with ``quantization`` where quantized, as ``mlx_lm.convert`` writes it).

    Example:
        >>> model, cfg = build(config("llama", 64, 2, vocab=64), "bfloat16")
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    to = DTYPES[dtype]
    model.update(tree_map(lambda p: p.astype(to) if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters()))
    if quantized:  # as mlx_lm.convert -q: the layers whose rows split into whole groups
        with contextlib.redirect_stdout(io.StringIO()):  # its "[INFO] Quantized ..." line
            model, config = quantize_model(model, config, **QUANTIZATION)
    mx.eval(model.parameters())
    model.eval()
    return model, config
