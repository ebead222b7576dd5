"""Probe: the host's time per layer to call and evaluate a fine-tuning step, nuvec's against the same step
under ``mx.compile`` and against mlx-lm's checkpointed step.

Random-weight mlx-lm Qwen3 models of a tiny width (``nuvec_mlx_bench.testing.mlx_lm_config("qwen3", 64, layers,
vocab=256)``: the device's work is small, the host's is what is left), LoRA on every block's linear
layers, Adam, one batch of ``--batch`` x ``--seq`` tokens, at several depths (16, 28, 48 layers). The steps:

- ``nuvec``: :class:`nuvec_mlx.TrainingStep` of mlx-lm's ``default_loss``, every block checkpointed by
  nuvec (``nv.checkpoint_layers``), at its defaults (compiled with ``nv.compile``, ``nv.update``,
  evaluated staged); its ``dispatch_seconds`` and ``evaluation_seconds`` are the call's two parts;
- ``nuvec ahead0``: the same with ``ahead=0``;
- ``mx.compile``: the same graph (``nv.value_and_grad``, ``nv.update``, the same checkpointed blocks)
  under ``mx.compile`` instead, evaluated with one ``mx.eval``: what ``nv.compile`` and the staged
  evaluation cost beside MLX's own compile;
- ``mlx-lm``: mlx-lm's trainer step with its ``--grad-checkpoint`` (``mx.checkpoint`` on the class of
  ``model.layers[0]``; ``mx.compile`` of ``nn.value_and_grad`` and ``optimizer.update``; ``mx.eval``).

Each step's host time is read two ways: on the wall clock (``time.perf_counter``) and on the calling
thread's CPU clock (``time.thread_time``). The wall clock counts whatever else the machine runs (on a
shared CPU, other processes and MLX's own worker thread, which computes the step on the CPU backend);
the thread's CPU time counts the host's own work only, so it is the figure to compare where the wall
clock is noisy (a shared machine, the CPU backend). ``dispatch`` is the compiled step's call (for nuvec:
``TrainingStep.dispatch_seconds``, wall), ``evaluation`` what follows until the results are computed
(``evaluation_seconds``, wall); ``host cpu`` the thread's CPU time of the whole step (call and
evaluation: nuvec's step makes both in one call, so its CPU time is not split). The variants of one
depth run interleaved, step by step, so that a busy moment hits them all; medians (min–max) over
``--steps`` steps after ``--warmup``, and per layer (us). Ratios are of the medians, against
``mx.compile``::

    python benchmarks/probes/host_time.py                                   # 16, 28, 48 layers
    python benchmarks/probes/host_time.py --layers 28 --steps 50 --out host_time.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from collections.abc import Iterator
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.nn.utils import average_gradients
from mlx_lm.tuner.trainer import default_loss
from mlx_lm.tuner.utils import linear_to_lora_layers

import nuvec_mlx as nv
from nuvec_mlx_bench import testing
from nuvec_mlx_bench.core import environment
from nuvec_mlx_bench.core.figures import spread
from nuvec_mlx_bench.core.rounds import summary

VARIANTS = ("nuvec", "nuvec ahead0", "mx.compile", "mlx-lm")
#: The fields of one step's sample, in seconds.
FIELDS = ("dispatch", "evaluation", "host cpu")


def lora_qwen3(layers: int, args: argparse.Namespace) -> tuple[nn.Module, optim.Optimizer]:
    """A random-weight Qwen3 of ``args.hidden`` and ``layers`` with LoRA on every block, and its Adam."""
    model, _ = testing.mlx_lm_model(testing.mlx_lm_config("qwen3", args.hidden, layers, vocab=args.vocab), "float32")
    model.freeze()
    linear_to_lora_layers(model, layers, {"rank": 8, "dropout": 0.0, "scale": 20.0})
    model.train()
    return model, optim.Adam(learning_rate=1e-5)


class Variant:
    """One variant's model and step, and how one step of it is timed."""

    def __init__(self, name: str, layers: int, args: argparse.Namespace):
        self.name = name
        self.model, optimizer = lora_qwen3(layers, args)
        self.training: nv.TrainingStep | None = None
        if name.startswith("nuvec"):
            nv.checkpoint_layers(self.model)
            self.training = nv.TrainingStep(self.model, default_loss, optimizer, ahead=0 if "ahead0" in name else None)
            return
        optimizer.init(self.model.trainable_parameters())
        self.state = [self.model.state, optimizer.state, mx.random.state]
        ours = name == "mx.compile"
        if ours:
            nv.checkpoint_layers(self.model)
        vg = (nv.value_and_grad if ours else nn.value_and_grad)(self.model, default_loss)
        update = partial(nv.update, optimizer) if ours else optimizer.update

        @partial(mx.compile, inputs=self.state, outputs=self.state)
        def step(batch: tuple[mx.array, mx.array]) -> tuple[mx.array, mx.array]:
            (value, tokens), grad = vg(self.model, *batch)
            update(self.model, average_gradients(grad))
            return value, tokens

        self.step = step

    def context(self) -> contextlib.AbstractContextManager[None]:
        """mlx-lm's checkpoint is a patch of the block's class, in place while its step runs."""
        return testing.mlx_lm_checkpoint(self.model) if self.name == "mlx-lm" else contextlib.nullcontext()

    def timed(self, batch: tuple[mx.array, mx.array]) -> dict[str, float]:
        """One step: its dispatch and evaluation (wall seconds) and the thread's CPU seconds of both."""
        cpu = time.thread_time()
        if self.training is not None:
            self.training(*batch)
            return {
                "dispatch": self.training.dispatch_seconds,
                "evaluation": self.training.evaluation_seconds,
                "host cpu": time.thread_time() - cpu,
            }
        with self.context():
            begin = time.perf_counter()
            outputs = self.step(batch)
            dispatched = time.perf_counter()
        mx.eval(self.state, outputs)
        return {
            "dispatch": dispatched - begin,
            "evaluation": time.perf_counter() - dispatched,
            "host cpu": time.thread_time() - cpu,
        }


@contextlib.contextmanager
def unstaged_on_purpose() -> Iterator[None]:
    """``mx.compile`` runs nuvec's checkpoints unstaged: that is what it is here to show."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nv.NotStagedWarning)
        yield


def run_depth(layers: int, args: argparse.Namespace) -> dict[str, dict[str, dict[str, Any]]]:
    """Every variant's samples at one depth, interleaved: variant -> field -> summary (seconds)."""
    batch = testing.mlx_lm_batch(args.vocab, args.batch, args.seq)
    mx.eval(batch)
    variants = [Variant(name, layers, args) for name in args.variants]
    samples: dict[str, list[dict[str, float]]] = {v.name: [] for v in variants}
    with unstaged_on_purpose():
        for _ in range(args.warmup):  # the first call traces
            for v in variants:
                v.timed(batch)
        for _ in range(args.steps):
            for v in variants:
                samples[v.name].append(v.timed(batch))
    return {name: {f: summary([s[f] for s in got]) for f in FIELDS} for name, got in samples.items()}


def lines(layers: int, results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The depth's table: ms median (min–max), us per layer, ratios of the medians against ``mx.compile``."""
    base = results.get("mx.compile")
    out = [
        f"| {layers} layers | "
        + " | ".join(f"{f} ms | {f} us/layer" for f in FIELDS)
        + (" | dispatch / mx.compile | host cpu / mx.compile |" if base else " |"),
        "| --- " * (1 + 2 * len(FIELDS) + (2 if base else 0)) + "|",
    ]
    for name, fields in results.items():
        cells = [f"{spread(fields[f], 1e3, 2)} | {fields[f]['median'] / layers * 1e6:.0f}" for f in FIELDS]
        if base:
            cells += [f"{fields[f]['median'] / base[f]['median']:.2f}" for f in ("dispatch", "host cpu")]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[16, 28, 48])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant and depth")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--out", help="also write every sample as JSON here")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or min(args.layers) < 1:
        p.error("--steps, --warmup and --layers must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[int, dict[str, dict[str, dict[str, Any]]]]:
    """Run the probe; print each depth's table; return depth -> :func:`run_depth`'s results."""
    args = parse_args(argv)
    env = environment.environment(" ".join(["python benchmarks/probes/host_time.py", *(argv or sys.argv[1:])]))
    print(
        f"MLX {env['mlx']} on {env['backend']} ({env['device']}), nuvec_mlx {env['nuvec_mlx']}; Qwen3 hidden "
        f"{args.hidden}, LoRA, batch {args.batch} x {args.seq}; medians (min–max) of {args.steps} steps"
    )
    every: dict[int, dict[str, dict[str, dict[str, Any]]]] = {}
    for layers in args.layers:
        every[layers] = run_depth(layers, args)
        print("\n".join(["", *lines(layers, every[layers])]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": env, "args": vars(args), "results": every}, f, indent=1)
    return every


if __name__ == "__main__":
    main()
