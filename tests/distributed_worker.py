"""One rank of the data-parallel test in tests/test_distributed.py.

``python tests/distributed_worker.py OUT_DIR``, started once per rank with
``MLX_RANK`` and ``MLX_HOSTFILE`` set for MLX's ring backend (``OUT_DIR train
MODEL DATA`` instead fine-tunes an mlx-lm model folder with
:func:`nuvec_mlx.mlx_lm.train`: :func:`train` below). The rank takes
its shard of a fixed batch and runs the step of :func:`make_step` (8 residual
MLP blocks, weight gradients averaged across ranks by
:func:`mlx.nn.average_gradients` inside the compiled function) once plain and
once checkpointed, each evaluated with :func:`nuvec_mlx.eval`. It writes the
averaged gradients to ``OUT_DIR/rank{r}.npz`` and its peaks, trace counts and
memory statistics to ``OUT_DIR/rank{r}.json``; the test compares them.

The test also imports this module to compute the single-process reference.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
import mlx.nn as nn

import nuvec_mlx as nv
from nuvec_mlx_bench.testing import block_weights, filled, mlp_block
from tests.helpers import rise

#: The model and the whole batch (split across ranks): 8 blocks
#: [B, 64] -> [B, 256] -> [B, 64] in float32, hidden activations of 512 KiB
#: per rank with two ranks, about 0.8 GFLOP per plain step and rank.
BLOCKS, DIM, BATCH = 8, 64, 1024
#: Which steps each rank runs: no checkpoint, and nv.checkpoint_flat per block,
#: in float32 (peaks measured) and in float64 (gradients compared at 1e-6).
VARIANTS = ("plain", "ckpt", "plain64", "ckpt64")


def inputs(rank: int, size: int, dtype: mx.Dtype = mx.float32) -> list[mx.array]:
    """The weights (2 per block), then this rank's rows of the batch, as ``dtype``."""
    if BATCH % size:
        raise ValueError(f"size must divide the batch of {BATCH}, got {size}")
    shard = BATCH // size
    # Rows grow down the batch, so that one rank's rows alone give gradients
    # far from the whole batch's: a missing or wrong average cannot pass.
    x = filled((BATCH, DIM), 0.37) * mx.linspace(0, 2, BATCH)[:, None]
    x = x[rank * shard : (rank + 1) * shard]
    xs = [w.astype(dtype) for i in range(BLOCKS) for w in block_weights("mlp", DIM, i)]
    xs.append(x.astype(dtype))
    mx.eval(xs)
    return xs


def make_step(checkpointed: bool, group: mx.distributed.Group) -> nv.CompiledFlat:
    """The compiled step: mean loss over this rank's rows, weight gradients
    averaged over ``group``; returns the gradients, then the rank's loss."""
    block = nv.checkpoint_flat(mlp_block) if checkpointed else mlp_block

    def loss(xs: list[mx.array]) -> mx.array:
        h = xs[-1]
        for i in range(BLOCKS):
            h = block([h, xs[2 * i], xs[2 * i + 1]])[0]
        return h.sum() / h.shape[0]

    value_and_grad = nv.value_and_grad_flat(loss, list(range(2 * BLOCKS)))

    def step(xs: list[mx.array]) -> list[mx.array]:
        value, grads = value_and_grad(xs)
        return nn.average_gradients(grads, group) + [value]

    return nv.compile_flat(step)


def gradients_and_peak(step: nv.CompiledFlat, xs: list[mx.array]) -> tuple[list[mx.array], int, list[str]]:
    """Run ``step`` once (compiling it) for its gradients, measure the peak of a
    second step evaluated with :func:`nuvec_mlx.eval`, and the stages of a third."""
    outputs = step(xs)
    nv.eval(outputs)
    peak = rise(lambda: step(xs), nv.eval)
    with nv.memory.timeline() as t:
        nv.eval(step(xs))
    return outputs[:-1], peak, [f"{r.kind} {r.block}" for r in t.readings]


def main(out_dir: Path) -> None:
    group = mx.distributed.init(backend="ring", strict=True)
    rank = group.rank()
    report = {"rank": rank, "size": group.size(), "peak": {}, "traces": {}, "stages": {}}
    arrays = {}
    for name in VARIANTS:
        xs = inputs(rank, group.size(), mx.float64 if name.endswith("64") else mx.float32)
        step = make_step(name.startswith("ckpt"), group)
        grads, report["peak"][name], report["stages"][name] = gradients_and_peak(step, xs)
        report["traces"][name] = step.traces
        arrays.update({f"{name}_{i}": g for i, g in enumerate(grads)})
    mx.savez(str(out_dir / f"rank{rank}.npz"), **arrays)
    # A buffer of a different size on each rank, so that the ranks' counters
    # differ and the test can tell whether all_stats keeps rank order.
    marker = mx.zeros(((rank + 1) << 10,))
    mx.eval(marker)
    own = nv.memory.stats()
    report["own_stats"] = dataclasses.asdict(own)
    report["all_stats"] = [dataclasses.asdict(s) for s in nv.memory.all_stats(group)]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


def train(out_dir: Path, model_dir: str, data_dir: str) -> None:
    """LoRA on every layer of the mlx-lm model in ``model_dir``, data-parallel, every block checkpointed, two
    steps reported; writes what the callback was told at each report to ``OUT_DIR/train{rank}.json``."""
    import types

    import mlx.optimizers as optim
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.datasets import CacheDataset, load_dataset
    from mlx_lm.tuner.trainer import TrainingArgs
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    from nuvec_mlx import mlx_lm as nvlm

    class Reports(TrainingCallback):
        def __init__(self) -> None:
            self.seen: list[dict] = []

        def on_train_loss_report(self, info: dict) -> None:
            self.seen.append(info)

    rank = mx.distributed.init(backend="ring", strict=True).rank()
    model, tokenizer = load(model_dir)
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 4, "dropout": 0.0, "scale": 10.0})
    train_set, _, _ = load_dataset(types.SimpleNamespace(data=data_dir, train=True, test=False), tokenizer)
    args = TrainingArgs(
        batch_size=2,
        iters=2,
        steps_per_report=1,
        grad_checkpoint=True,
        adapter_file=str(out_dir / "adapters.safetensors"),
    )
    reports = Reports()
    nvlm.train(model, optim.Adam(1e-3), CacheDataset(train_set), args=args, training_callback=reports)
    (out_dir / f"train{rank}.json").write_text(json.dumps(reports.seen))


if __name__ == "__main__":
    if sys.argv[2:3] == ["train"]:
        train(Path(sys.argv[1]), *sys.argv[3:5])
    else:
        main(Path(sys.argv[1]))
