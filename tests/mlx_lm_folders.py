"""mlx-lm model and data folders for the tests: what ``mlx_lm.utils.load`` and ``mlx_lm.lora`` read.

The only test helpers that need mlx-lm, transformers and tokenizers (the numeric helpers,
:mod:`tests.helpers`, need none of them).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from mlx_lm.utils import save_config, save_model

from nuvec_mlx_bench import testing
from nuvec_mlx_bench.testing import WORDS, write_tokenizer

#: The vocabulary of the test models: the tiny tokenizer's (:func:`nuvec_mlx_bench.testing.write_tokenizer`).
VOCAB = testing.TOKENIZER_VOCAB


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
