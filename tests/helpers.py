"""Helpers shared by the tests: comparisons that do not hide what they compare."""

from __future__ import annotations

import json
import random
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import save_config, save_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from nuvec_mlx_bench import architectures


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


# --- mlx-lm model and data folders ---------------------------------------------------------

#: The words of the tiny tokenizer; with its four special tokens, the vocabulary of the test models.
WORDS = [f"w{i}" for i in range(60)]
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]
VOCAB = len(SPECIAL) + len(WORDS)


def write_tokenizer(folder) -> None:
    """A word-level tokenizer of :data:`WORDS`, saved as ``transformers`` saves one (mlx-lm loads it)."""
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>", pad_token="<pad>").save_pretrained(str(folder))


def model_folder(folder, arch: str, dtype: str = "bfloat16", quantized: bool = False,
                 hidden: int = 32, layers: int = 2):
    """An mlx-lm model folder with random weights: config.json, safetensors and a tokenizer.

    What ``mlx_lm.utils.load`` (and so ``mlx_lm.lora --model folder``) loads; quantized, what
    ``mlx_lm.convert -q`` writes (the base model of QLoRA).
    """
    folder = Path(folder)
    model, config = architectures.build(architectures.config(arch, hidden, layers, vocab=VOCAB), dtype, quantized)
    save_model(folder, model)
    save_config(config, folder / "config.json")
    write_tokenizer(folder)
    return folder


def data_folder(folder, rows: int = 8, seed: int = 0):
    """``train.jsonl``, ``valid.jsonl`` and ``test.jsonl`` of ``{"text": ...}`` lines of 8 to 24 words."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pick = random.Random(seed)
    for split, n in (("train", rows), ("valid", 4), ("test", 4)):
        lines = [json.dumps({"text": " ".join(pick.choice(WORDS) for _ in range(pick.randint(8, 24)))})
                 for _ in range(n)]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def tiny_llama(layers: int = 4, hidden: int = 64, vocab: int = 256, seed: int = 0):
    """A random-weight mlx-lm Llama (4 heads, 2 of them key/value), evaluated."""
    from mlx_lm.models import llama

    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab))
    mx.eval(model.parameters())
    return model


def held_while_unobserved(monkeypatch, extra: int) -> None:
    """Staged evaluations hold ``extra`` more bytes when nothing reads memory after each stage,
    as CUDA holds a stage's buffers until MLX's worker frees them, later than mx.eval returns."""
    from nuvec_mlx import _registry, evaluate

    real = evaluate.staged

    def late_frees(*args, **kwargs):
        if _registry.observed():
            return real(*args, **kwargs)
        held = mx.zeros((extra // 4,))
        mx.eval(held)
        real(*args, **kwargs)
        del held

    monkeypatch.setattr(evaluate, "staged", late_frees)


# --- a model of residual MLP blocks and the README's training step ----------------------------


class Blocks(nn.Module):
    """``blocks`` residual blocks ``x + W2 tanh(W1 x)`` of width ``dim`` and ``hidden``, in ``model.layers``."""

    def __init__(self, dim: int = 64, hidden: int = 256, blocks: int = 6):
        super().__init__()
        self.layers = [nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim)) for _ in range(blocks)]

    def __call__(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def readme_step(model, loss_fn, optimizer):
    """The README's own loop: ``loss_fn`` and ``nv.update`` compiled with ``nv.compile``, the model,
    optimizer and random key its state; ``run(x)`` runs it and evaluates it with ``nv.eval``."""
    import nuvec_mlx as nv

    state = [model.state, optimizer.state, mx.random.state]

    @nv.compile(inputs=state, outputs=state)
    def step(x):
        loss, grads = nv.value_and_grad(model, loss_fn)(model, x)
        nv.update(optimizer, model, grads)
        return loss

    return state, lambda x: nv.eval(step(x), state)
