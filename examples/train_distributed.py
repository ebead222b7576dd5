"""Data-parallel training of a small residual MLP with nuvec checkpointing.

Every rank holds the whole model, trains on its own shard of each batch, and
averages the gradients with mlx.nn.average_gradients inside the compiled step,
so all ranks apply the same update. Rank 0 prints the loss over the whole
batch and every rank's peak memory.

Run with two processes on this machine (MLX's ring backend):
    mlx.launch -n 2 --backend ring --python .venv/bin/python examples/train_distributed.py
or alone (a group of one): python examples/train_distributed.py
Add --no-checkpoint to compare the peaks without checkpointing.
"""

import argparse
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

import nuvec_mlx as nv

STEPS, BATCH, DIM, CLASSES = 5, 1024, 64, 8  # BATCH is the whole batch, split across ranks


class Block(nn.Module):
    """A pre-norm residual MLP block, [B, DIM] -> [B, 4 DIM] -> [B, DIM]."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def __call__(self, x: mx.array) -> mx.array:
        return x + self.down(nn.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    """Residual blocks, a norm and a classifier; nv.checkpoint_layers wraps ``layers``."""

    def __init__(self, dim: int, classes: int, depth: int = 8):
        super().__init__()
        self.layers = [Block(dim) for _ in range(depth)]
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def __call__(self, x: mx.array) -> mx.array:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def shard(group: mx.distributed.Group) -> tuple[mx.array, mx.array]:
    """This rank's rows of a synthetic batch (the class is the argmax of a fixed linear map)."""
    x = mx.random.normal((BATCH, DIM))
    y = mx.argmax(x @ mx.random.normal((DIM, CLASSES)), axis=1)
    rows = slice(group.rank() * BATCH // group.size(), (group.rank() + 1) * BATCH // group.size())
    return x[rows], y[rows]


def main(checkpoint: bool) -> None:
    group = mx.distributed.init()  # a group of one when not launched distributed
    if BATCH % group.size():
        raise SystemExit(f"{group.size()} ranks cannot split a batch of {BATCH}")
    mx.random.seed(0)  # the same weights and batch on every rank
    model = Model(DIM, CLASSES)
    if checkpoint:
        nv.checkpoint_layers(model)
    # Each rank's loss and gradients, the gradients averaged over the ranks, compiled, staged.
    step = nv.TrainingStep(model, lambda m, x, y: nn.losses.cross_entropy(m(x), y).mean(), optim.AdamW(1e-3))
    x, y = shard(group)
    rank0 = group.rank() == 0
    if rank0:
        print(f"{group.size()} rank(s), {len(x)} rows each, checkpointing {checkpoint}")
    for i in range(STEPS):
        nv.memory.reset_peak()
        start = time.perf_counter()
        loss = mx.distributed.all_sum(step(x, y), group=group) / group.size()  # the whole batch's loss
        seconds = time.perf_counter() - start
        # Each rank's high-water mark in this step (weights, optimizer state,
        # activations). all_stats is collective: every rank must call it.
        peaks = [s.peak / 2**20 for s in nv.memory.all_stats(group)]
        if rank0:
            print(
                f"step {i} loss {loss.item():.4f} time {seconds:.2f} s peak per rank "
                + ", ".join(f"{p:.1f}" for p in peaks)
                + " MiB"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-checkpoint", dest="checkpoint", action="store_false")
    main(parser.parse_args().checkpoint)
