"""mlx-lm model and data folders for the tests: what ``mlx_lm.utils.load`` and ``mlx_lm.lora`` read.

The only test helpers that need mlx-lm, transformers and tokenizers (the numeric helpers,
:mod:`tests.helpers`, need none of them).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from mlx_lm.utils import save_config, save_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from nuvec_mlx_bench import testing

#: The words of the tiny tokenizer; with its four special tokens, the vocabulary of the test models.
WORDS = [f"w{i}" for i in range(60)]
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]
VOCAB = len(SPECIAL) + len(WORDS)


def write_tokenizer(folder) -> None:
    """A word-level tokenizer of :data:`WORDS`, saved as ``transformers`` saves one (mlx-lm loads it)."""
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    ).save_pretrained(str(folder))


def model_folder(
    folder, arch: str, dtype: str = "bfloat16", quantized: bool = False, hidden: int = 32, layers: int = 2
):
    """An mlx-lm model folder with random weights: config.json, safetensors and a tokenizer.

    What ``mlx_lm.utils.load`` (and so ``mlx_lm.lora --model folder``) loads; quantized, what
    ``mlx_lm.convert -q`` writes (the base model of QLoRA).
    """
    folder = Path(folder)
    model, config = testing.mlx_lm_model(testing.mlx_lm_config(arch, hidden, layers, vocab=VOCAB), dtype, quantized)
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
        lines = [
            json.dumps({"text": " ".join(pick.choice(WORDS) for _ in range(pick.randint(8, 24)))}) for _ in range(n)
        ]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder
