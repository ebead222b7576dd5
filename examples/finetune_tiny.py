"""Fine-tune a tiny mlx-lm Llama (built from a config) on synthetic data,
with and without nuvec checkpointing; prints loss, peak memory and step time.

Run: python examples/finetune_tiny.py
"""

import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_lm.models import llama
from tqdm import tqdm

import nuvec_mlx as nv

STEPS, BATCH, SEQ = 5, 2, 512


def run(ckpt: bool) -> None:
    mx.random.seed(0)
    model = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=64,
            num_hidden_layers=8,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=4,
            rms_norm_eps=1e-5,
            vocab_size=128,
        )
    )
    mx.eval(model.parameters())
    if ckpt:
        print(f"checkpointed {nv.checkpoint_layers(model)} layers")

    def loss_fn(m, x):
        return nn.losses.cross_entropy(m(x[:, :-1]), x[:, 1:]).mean()

    # Compiled, each block's update right after its backward pass, evaluated one block at a time.
    step = nv.TrainingStep(model, loss_fn, optim.AdamW(1e-3))
    # synthetic data: a repeating pattern the model can learn
    data = (mx.arange(SEQ + 1)[None] * 7 + mx.arange(BATCH)[:, None]) % 128
    for i in tqdm(range(STEPS), desc="ckpt" if ckpt else "plain"):
        t = time.perf_counter()
        with nv.memory.measure() as m:
            loss = step(data)
        tqdm.write(
            f"step {i} loss {loss.item():.4f} peak {(m.start + m.rise) / 2**20:.1f} MiB "
            f"time {time.perf_counter() - t:.2f} s"
        )


if __name__ == "__main__":
    run(False)
    run(True)
