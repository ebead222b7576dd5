"""The ``nuvec-mlx-plan`` command: plan an mlx-lm model's fine-tuning step for a memory budget.

    nuvec-mlx-plan --model ./my-model --budget 12GiB --batch-size 4 --max-seq-length 2048
    nuvec-mlx-plan --model ./my-model --budget 12GiB --fine-tune-type full --largest seq
    python -m nuvec_mlx.mlx_lm.plan ...   # the same

Loads the model folder with ``mlx_lm.utils.load``, prepares it as
``mlx_lm.lora`` does (``--fine-tune-type``, ``--num-layers`` and
``--optimizer`` take mlx-lm's meanings and defaults), and measures its
training step (mlx-lm's default loss on a batch of random tokens of
``--batch-size`` x ``--max-seq-length``): prints the plan
(:func:`nuvec_mlx.plan`), the saved-activations report
(:func:`nuvec_mlx.saved_activations`) and, with ``--largest``, the largest
sequence length or batch that fits (:func:`nuvec_mlx.largest_fit`). Exit
status 0 when the plan fits, 1 when it does not, 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from .. import policies
from ..planner import largest_fit, plan, saved_activations
from ..step import TrainingStep

UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
OPTIMIZERS = {"adam": optim.Adam, "adamw": optim.AdamW, "sgd": optim.SGD, "adafactor": optim.Adafactor, "none": None}
POLICIES = {
    "save_everything": policies.save_everything,
    "save_matmuls": policies.save_matmuls,
    "save_nothing": policies.save_nothing,
}


def parse_bytes(text: str) -> int:
    """A size in bytes from ``"12GiB"``, ``"800MiB"``, ``"1.5GiB"`` or ``"1048576"``.

    Example:
        >>> parse_bytes("1.5KiB")
        1536
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)\s*", text, flags=re.IGNORECASE)
    unit = match and match.group(2).upper()
    if not match or unit not in UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"a size must be a positive number of bytes with KiB, MiB, GiB or TiB, got {text!r}")
    return int(float(match.group(1)) * UNITS[unit])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; a bad value is a parser error (exit status 2)."""
    p = argparse.ArgumentParser(prog="nuvec-mlx-plan", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", required=True, type=Path, help="an mlx-lm model folder (config.json, safetensors, tokenizer)"
    )
    p.add_argument("--budget", required=True, help="peak MLX memory of a step, e.g. 12GiB or 800MiB")
    p.add_argument("--fine-tune-type", choices=("lora", "dora", "full"), default="lora", help="as mlx_lm.lora")
    p.add_argument(
        "--num-layers", type=int, default=16, help="layers to fine-tune, from the last (-1: all); as mlx_lm.lora"
    )
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-seq-length", type=int, default=2048, help="tokens per sequence of the measured batch")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adam")
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument(
        "--policies",
        default="save_everything,save_matmuls,save_nothing",
        help=f"the checkpoint policies the plan may use, comma-separated from {', '.join(POLICIES)}",
    )
    p.add_argument(
        "--largest", choices=("seq", "batch"), help="also find the largest sequence length or batch that fits"
    )
    p.add_argument("--no-compile", action="store_true", help="plan for an uncompiled step")
    p.add_argument(
        "--synchronize",
        action="store_true",
        help="verify the plan as evaluated with nv.eval(..., synchronize=True) (CUDA: a steadier peak)",
    )
    p.add_argument("--no-report", action="store_true", help="skip the saved-activations report")
    p.add_argument("--json", type=Path, help="also write the plan, report and answer to this file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.budget = parse_bytes(args.budget)
    except ValueError as e:
        p.error(f"--budget: {e}")
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_seq_length < 2:
        p.error(f"--max-seq-length must be >= 2 (inputs and targets), got {args.max_seq_length}")
    chosen = args.policies.split(",")
    if not chosen or any(c not in POLICIES for c in chosen):
        p.error(f"--policies: choose from {', '.join(POLICIES)}; got {args.policies!r}")
    args.policies = [POLICIES[c] for c in chosen]
    if not args.model.is_dir():
        p.error(f"--model: {args.model} is not a folder")
    return args


def prepare(model: nn.Module, fine_tune_type: str, num_layers: int) -> None:
    """Freeze and unfreeze (or add adapters) as ``mlx_lm.lora`` does before training."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    layers = model.layers
    if num_layers > len(layers):
        raise ValueError(f"--num-layers {num_layers} is more than the model's {len(layers)} layers")
    model.freeze()
    if fine_tune_type == "full":
        for layer in layers[-max(num_layers, 0) :]:
            layer.unfreeze()
    else:
        linear_to_lora_layers(
            model, num_layers, {"rank": 8, "dropout": 0.0, "scale": 20.0}, use_dora=fine_tune_type == "dora"
        )


def tokens(vocab: int, batch: int, length: int, seed: int) -> tuple[mx.array, mx.array]:
    """A batch of random tokens and its lengths, as ``mlx_lm``'s ``default_loss`` takes them."""
    ids = mx.random.randint(0, vocab, (batch, length), key=mx.random.key(seed))
    lengths = mx.array([[0, length - 1]] * batch)
    mx.eval(ids, lengths)
    return ids, lengths


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the command; returns what it printed, as data."""
    args = parse_args(argv)
    from mlx_lm.tuner.trainer import default_loss
    from mlx_lm.utils import load

    mx.random.seed(args.seed)
    model, tokenizer = load(str(args.model))
    try:
        prepare(model, args.fine_tune_type, args.num_layers)
    except ValueError as e:  # as the parser's errors: the command line asked for what the model has not
        print(f"nuvec-mlx-plan: error: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    vocab = getattr(getattr(model, "args", None), "vocab_size", None) or tokenizer.vocab_size
    batch = tokens(vocab, args.batch_size, args.max_seq_length, args.seed)
    optimizer_class = OPTIMIZERS[args.optimizer]
    optimizer = optimizer_class(learning_rate=args.learning_rate) if optimizer_class else None
    step = TrainingStep(model, default_loss, optimizer, compile=not args.no_compile, synchronize=args.synchronize)
    found = plan(step, batch, args.budget, policies=args.policies)
    print(found)
    result: dict[str, Any] = {
        "command": " ".join(["nuvec-mlx-plan", *(sys.argv[1:] if argv is None else argv)]),
        "mlx": mx.__version__,
        "plan": found.to_dict(),
    }
    if not args.no_report:
        report = saved_activations(step, batch, policy=policies.save_matmuls)
        print("\nSaved activations per block (uncompiled graph; see nuvec_mlx.planner.saved):\n" + str(report))
        result["saved_activations"] = report.to_dict()
    if args.largest:

        def make(size: int) -> tuple[mx.array, mx.array]:
            if args.largest == "seq":
                return tokens(vocab, args.batch_size, size, args.seed)
            return tokens(vocab, size, args.max_seq_length, args.seed)

        start = args.max_seq_length if args.largest == "seq" else args.batch_size
        sizes = sorted({max(2, start // 4), max(3, start // 2), max(4, start)})
        fit = largest_fit(step, make, args.budget, sizes=sizes, multiple=8 if args.largest == "seq" else 1)
        print(f"\n--largest {args.largest}: " + str(fit))
        result["largest"] = {"dimension": args.largest, **fit.__dict__}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv: list[str] | None = None) -> int:
    """The ``nuvec-mlx-plan`` command: exit status 0 if the plan fits, 1 if not."""
    return 0 if run(argv)["plan"]["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
