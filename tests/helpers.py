"""Helpers shared by the tests: comparisons that do not hide what they compare."""

from __future__ import annotations

import mlx.core as mx


def assert_close(actual, expected, rtol: float = 1e-6) -> None:
    """Relative closeness of two arrays (or lists of arrays), measured by max-norm.

    It evaluates both sides (``.item()``): use :func:`assert_evaluated` first
    where the test is about whether something else evaluated them.
    """
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_close(a, e, rtol)
        return
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = max(mx.abs(expected).max().item(), 1e-30)
    err = mx.abs(actual - expected).max().item()
    assert err <= rtol * scale, f"max error {err:.3g} > {rtol:g} x {scale:.3g}"


def lazy_arrays(nbytes: int, count: int = 1) -> list[mx.array]:
    """``count`` unevaluated float32 arrays of ``nbytes`` each (nothing allocated yet)."""
    return [mx.full((nbytes // 4,), float(i + 2)) for i in range(count)]


def assert_evaluated(before: int, nbytes: int) -> None:
    """Active memory grew by about ``nbytes`` since ``before``: arrays were computed.

    MLX allocates an array's buffer only when it is evaluated, so this tells an
    evaluation that happened from one that did not, without evaluating anything.
    A little slack (4 KiB) allows for small inputs the evaluation freed.
    """
    mx.synchronize()
    grown = mx.get_active_memory() - before
    assert grown >= nbytes - 4096, f"active memory grew by {grown} bytes, expected >= {nbytes}: not evaluated"


def tiny_llama(layers: int = 4, hidden: int = 64, vocab: int = 256, seed: int = 0):
    """A random-weight mlx-lm Llama (4 heads, 2 of them key/value), evaluated."""
    from mlx_lm.models import llama

    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab))
    mx.eval(model.parameters())
    return model


def tiny_model_folder(path, layers: int = 4, hidden: int = 64, vocab: int = 256):
    """An mlx-lm model folder (config.json, model.safetensors, a word-level tokenizer) with random
    weights, as ``mlx_lm.utils.load`` reads it: no download."""
    import json
    from pathlib import Path

    from mlx.utils import tree_flatten
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_llama(layers, hidden, vocab)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = dict(model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab)
    (path / "config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab - 1)} | {"<unk>": vocab - 1},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<unk>"}))
    return path
