"""LoRA dropout under checkpointing: mlx-lm's ``--grad-checkpoint`` against nuvec's, measured.

A Llama-style mlx-lm model (random weights, bf16, hidden 64, 4 blocks), LoRA
on every block, a fixed batch of 2 x 128 random tokens. For LoRA dropout 0.1
and 0, with the same seed:

1. the gradients of the first step, taken as mlx-lm's trainer takes them
   (``mx.compile`` of ``nn.value_and_grad`` with the model and random state;
   nuvec: ``nv.compile`` of ``nv.value_and_grad``, ``nv.eval``), against the
   unchecked run's: the relative max-norm difference over the LoRA weights;
   and whether the random key after the step is the unchecked run's (a
   recomputation that draws its dropout masks anew moves it on);
2. the losses of 5 training steps (Adam, lr 1e-3) through the trainers
   themselves: ``mlx_lm.tuner.trainer.train`` without and with
   ``grad_checkpoint``, and ``nuvec_mlx.mlx_lm.train`` with it.

Run: python examples/mlx_lm_dropout.py
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten
from mlx_lm.tuner import trainer
from mlx_lm.tuner.callbacks import TrainingCallback
from mlx_lm.tuner.utils import linear_to_lora_layers

import nuvec_mlx as nv
from nuvec_mlx import mlx_lm as nv_mlx_lm
from nuvec_mlx_bench import testing

BATCH, SEQ, STEPS, VOCAB = 2, 128, 5, 256
STRATEGIES = ("none", "mlx-lm", "nuvec")


def lora_model(dropout: float) -> nn.Module:
    mx.random.seed(0)  # the LoRA weights are drawn from the global key: the same model every call
    model, _ = testing.mlx_lm_model(testing.mlx_lm_config("llama", 64, 4, vocab=VOCAB), "bfloat16")
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 8, "dropout": dropout, "scale": 20.0})
    model.train()
    return model


@contextlib.contextmanager
def checkpointing(strategy: str, model: nn.Module) -> Iterator[None]:
    """The strategy's checkpoints on the blocks inside: mlx-lm's ``--grad-checkpoint`` or nuvec's."""
    if strategy == "none":
        yield
        return
    with nv_mlx_lm.checkpointed_blocks(model) if strategy == "nuvec" else testing.mlx_lm_checkpoint(model):
        yield


def batch() -> tuple[mx.array, mx.array]:
    tokens = mx.random.randint(0, VOCAB, (BATCH, SEQ + 1), key=mx.random.key(1))
    return tokens, mx.array([[0, SEQ + 1]] * BATCH)


def first_gradients(strategy: str, dropout: float) -> tuple[list[mx.array], mx.array]:
    """The LoRA gradients of one step, compiled as the strategy's trainer compiles it, and the
    random key after it (a recomputation that draws anew leaves another key behind)."""
    model = lora_model(dropout)
    mx.random.seed(0)
    state = [model.state, mx.random.state]
    if strategy == "nuvec":
        vg, compile_, eval_ = nv.value_and_grad(model, trainer.default_loss), nv.compile, nv.eval
    else:
        vg, compile_, eval_ = nn.value_and_grad(model, trainer.default_loss), mx.compile, mx.eval
    step = compile_(lambda b: vg(model, *b)[1], inputs=state, outputs=state)
    with checkpointing(strategy, model):
        grads = step(batch())
        eval_(grads, state)
    return [g.astype(mx.float32) for _, g in tree_flatten(grads)], mx.random.state[0]


class Losses(TrainingCallback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_loss_report(self, info: dict) -> None:
        self.losses.append(info["train_loss"])


def losses(strategy: str, dropout: float) -> list[float]:
    """The losses of STEPS steps of the strategy's trainer on the same batch."""
    model = lora_model(dropout)
    mx.random.seed(0)
    args = trainer.TrainingArgs(
        batch_size=BATCH,
        iters=STEPS,
        steps_per_report=1,
        grad_checkpoint=False,
        adapter_file="/tmp/nuvec_mlx_dropout_adapters.safetensors",
    )
    fixed = batch()
    callback = Losses()
    run = dict(
        model=model,
        optimizer=optim.Adam(1e-3),
        train_dataset=[None] * BATCH,
        args=args,
        iterate_batches=lambda **_: iter([fixed] * STEPS),
        training_callback=callback,
    )
    with contextlib.redirect_stdout(sys.stderr):  # the trainers' own report lines
        if strategy == "nuvec":
            args.grad_checkpoint = True
            nv_mlx_lm.train(**run)
        else:
            with checkpointing(strategy, model):
                trainer.train(**run)
    return callback.losses


def main() -> None:
    print(
        f"MLX {mx.__version__}, backend {mx.default_device()}; Llama H=64 L=4, LoRA rank 8 on every block, "
        f"bf16, batch {BATCH}x{SEQ}"
    )
    print(
        "| dropout | strategy | first-step gradients vs unchecked (rel. max-norm) | random key after it "
        "| losses of 5 steps |"
    )
    print("| --- | --- | --- | --- | --- |")
    for dropout in (0.1, 0.0):
        plain, plain_key = first_gradients("none", dropout)
        scale = max(mx.abs(g).max().item() for g in plain)
        for strategy in STRATEGIES:
            grads, key = first_gradients(strategy, dropout)
            diff = max(mx.abs(g - p).max().item() for g, p in zip(grads, plain)) / scale
            same_key = "unchecked's" if mx.array_equal(key, plain_key).item() else "another"
            shown = ", ".join(f"{v:.4f}" for v in losses(strategy, dropout))
            print(f"| {dropout:g} | {strategy} | {diff:.3g} | {same_key} | {shown} |")


if __name__ == "__main__":
    main()
