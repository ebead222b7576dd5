"""The ``nuvec-mlx-plan`` command: the checkpointing of a fine-tuning run, planned for a memory budget.

    nuvec-mlx-plan --model ./model --data ./data --budget 12GB --save plan.json
    nuvec-mlx-lora --model ./model --train --data ./data --grad-checkpoint --plan plan.json
    python -m nuvec_mlx.mlx_lm.plan ...   # the same

It takes ``nuvec-mlx-lora``'s command line (``mlx_lm.lora``'s arguments, config
files and defaults: ``--data``, ``--batch-size``, ``--max-seq-length``,
``--fine-tune-type``, ``--num-layers``, ``--optimizer``, ``lora_parameters``,
``--mask-prompt`` ...), prepares the model and the optimizer as ``mlx_lm.lora``
does, and plans (:func:`nuvec_mlx.plan`) the step that ``nuvec-mlx-lora
--grad-checkpoint`` trains (mlx-lm's default loss with the head in chunks,
:func:`nuvec_mlx.mlx_lm.chunked_loss`; attention in chunks where unfused) on a
batch of your data: ``--batch-size`` rows of the longest sequences of the
training set, padded as mlx-lm pads them, up to ``--max-seq-length`` (random
tokens of ``--batch-size`` x ``--max-seq-length`` without ``--data``). It prints
the plan's summary (``--details``: every block's row and the
saved-activations report); when nothing fits, what would: the largest batch,
else the longest sequence, that fits, measured (:func:`nuvec_mlx.largest_fit`,
every block checkpointed). ``--save plan.json`` writes the plan for
``nuvec-mlx-lora --plan``. Exit status 0 when the plan fits, 1 when it does
not, 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from .. import _validate, policies
from ..chunking import Chunks, chunk_layers, whole_up_to
from ..planner import Fit, Plan, largest_fit, plan, saved_activations
from ..planner.fit import REACH, at_reach
from ..step import TrainingStep
from . import lora, recurrences
from ._report import peak_text
from .losses import loss_for

#: The command's name.
PROG = "nuvec-mlx-plan"
#: Bytes per unit: decimal (as mlx-lm's sizes and nuvec-mlx-lora's report) and binary.
UNITS = {
    "": 1,
    "B": 1,
    **{f"{p}{b}": 1000**k for k, p in enumerate("KMGT", 1) for b in ("", "B")},
    **{f"{p}IB": 1024**k for k, p in enumerate("KMGT", 1)},
}
POLICIES = policies.NAMED
#: ``--longest`` answers a multiple of this many tokens.
LENGTH_MULTIPLE = 8
#: mlx-lm's banner rows that only a training run reads (the planner runs no iterations: its batch is its own row).
TRAINING_ROWS = ("batch · iters",)
DESCRIPTION = (
    "nuvec's planner for nuvec-mlx-lora: takes nuvec-mlx-lora's command line (mlx_lm.lora's arguments and "
    "config files) and a --budget, measures the step it trains with --grad-checkpoint on a batch of your "
    "data, and plans which blocks to checkpoint, and how, to fit the budget; --save plan.json writes it for "
    "nuvec-mlx-lora --plan. Exit status 0 when it fits, 1 when not (it then says what would), 2 for a bad "
    "command line."
)


def parse_bytes(text: str) -> int:
    """A size in bytes: a number and a unit, decimal (``KB``, ``MB``, ``GB``, ``TB``, or ``K``, ``M``,
    ``G``, ``T`` as mlx-lm reads them) or binary (``KiB``, ``MiB``, ``GiB``, ``TiB``), or bytes alone.

    Example:
        >>> parse_bytes("12GB"), parse_bytes("1.5KiB"), parse_bytes("800 MiB")
        (12000000000, 1536, 838860800)
    """
    if not isinstance(text, str):
        raise TypeError(f"a size must be a str such as 12GB or 800MiB, got {type(text).__name__}")
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in UNITS:
        raise ValueError(
            f"a size is a number and a unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
            f"(powers of 1024), as in 12GB or 800MiB; got {text!r}"
        )
    nbytes = int(float(match.group(1)) * UNITS[unit])
    if nbytes < 1:
        raise ValueError(f"a size must be at least 1 byte, got {text!r}")
    return nbytes


def _add_arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """nuvec-mlx-plan's flags, added to mlx_lm.lora's parser; the actions added (:func:`lora.run_mlx_lm_lora`
    checks their values from a config file as theirs from the command line)."""
    return [
        *lora.step_arguments(parser),
        parser.add_argument(
            "--budget", help="nuvec: the peak MLX memory the step may reach, e.g. 12GB or 11GiB (config key budget)"
        ),
        parser.add_argument("--save", help="nuvec: write the plan here, for nuvec-mlx-lora --plan"),
        parser.add_argument(
            "--details",
            action="store_true",
            help="nuvec: also print every block's row and the saved-activations report",
        ),
        parser.add_argument(
            "--largest",
            choices=("seq", "batch"),
            help="nuvec: also find the largest sequence length or batch that fits (done by itself when nothing fits)",
        ),
        parser.add_argument(
            "--longest",
            action="store_true",
            help="nuvec: instead of a plan, the longest sequence at --batch-size whose step fits --budget, every "
            "block checkpointed: measured at a half, three quarters and all of --max-seq-length (or at three "
            "lengths past where the chunk rules start cutting a module), extrapolated, and measured at the answer "
            "(--verify)",
        ),
        parser.add_argument(
            "--verify",
            type=lora.nonnegative_int,
            default=1,
            help="nuvec, with --longest: measurements at or around the extrapolated length (default 1; 0 "
            "answers with the extrapolation alone, without running the long step)",
        ),
        parser.add_argument(
            "--policies",
            default="save_everything,save_matmuls,save_nothing",
            help=f"nuvec: the checkpoint policies the plan may use, comma-separated from {', '.join(POLICIES)}",
        ),
        parser.add_argument("--no-compile", action="store_true", help="nuvec: plan an uncompiled step"),
        parser.add_argument(
            "--synchronize",
            action="store_true",
            help="nuvec: verify the plan as evaluated with nv.eval(..., synchronize=True) (CUDA: a steadier peak)",
        ),
        parser.add_argument("--json", help="nuvec: also write the plan, settings and answers to this file"),
    ]


def _checked(args: Any) -> tuple[int, list[Any]]:
    """The budget and the policies of the command line, or a command-line error that says what is wrong."""
    if args.budget is None:
        lora.fail(PROG, "--budget is required: the peak MLX memory the step may reach, e.g. 12GB or 11GiB")
    try:
        budget = parse_bytes(str(args.budget))
    except ValueError as e:
        lora.fail(PROG, f"--budget: {e}")
    given = [flag for flag in lora.CHUNK_FLAGS if getattr(args, flag) is not None]
    if args.save is not None and given:
        flags = ", ".join(f"--{flag.replace('_', '-')}" for flag in given)
        lora.fail(
            PROG,
            f"--save with {flags}: nuvec-mlx-lora --plan trains with every chunk auto, so a saved plan is measured "
            "that way; leave them out, or plan without --save to see their effect",
        )
    chosen = args.policies.split(",")
    if any(c not in POLICIES for c in chosen):
        lora.fail(PROG, f"--policies: choose from {', '.join(POLICIES)}; got {args.policies!r}")
    return budget, [POLICIES[c] for c in chosen]


def main(argv: list[str] | None = None) -> int:
    """The ``nuvec-mlx-plan`` command: exit status 0 if the plan fits, 1 if not (2 for a bad command line).

    Example:
        >>> main(["--model", "./model", "--data", "./data", "--budget", "12GB", "--save", "plan.json"])
    """
    found = run(argv)
    if "longest" in found:
        return 0 if found["longest"]["tokens"] else 1
    return 0 if found["plan"]["fits"] else 1


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the command; returns what it found, as data (what ``--json`` writes)."""
    found: list[dict[str, Any]] = []
    lora.run_mlx_lm_lora(
        PROG, DESCRIPTION, argv, _add_arguments, lambda args: found.append(_run(args)), unset=("data",)
    )
    found[0]["command"] = " ".join([PROG, *(sys.argv[1:] if argv is None else argv)])
    return found[0]


def _run(args: Any) -> dict[str, Any]:
    """Load the model and the data as ``mlx_lm.lora`` does, prepare them with its ``train_model``, and plan
    the step where it would train."""
    from mlx_lm import lora as mlx_lm_lora
    from mlx_lm.tuner.datasets import load_dataset
    from mlx_lm.utils import load

    planning = _Planning(args, *_checked(args))
    args.train = True  # mlx-lm's dataset loading then asks for a training set
    lora.check_sources(PROG, args)
    loaded = load(
        args.model,
        tokenizer_config={"trust_remote_code": args.trust_remote_code},
        trust_remote_code=args.trust_remote_code,
    )
    model, tokenizer = loaded[0], cast(Any, loaded[1])
    planning.vocabulary = getattr(getattr(model, "args", None), "vocab_size", None) or tokenizer.vocab_size
    train_set, valid_set = load_dataset(args, tokenizer)[:2] if args.data is not None else ([], [])
    with (
        tempfile.TemporaryDirectory() as adapters,  # train_model writes its adapter config: not where it trains
        lora.swapped(args, "adapter_path", adapters),
        lora.swapped(mlx_lm_lora, "train", planning),
        lora.preparing(PROG, planning.rows, leave_out=TRAINING_ROWS),
    ):
        mlx_lm_lora.train_model(args, model, train_set, valid_set)
    if args.json:
        Path(args.json).write_text(json.dumps(planning.result, indent=1, default=str))
    return planning.result


class _Planning:
    """In place of mlx-lm's ``train``: plans the step ``nuvec-mlx-lora --grad-checkpoint`` would train there."""

    def __init__(self, command: Any, budget: int, chosen: list[Any]):
        self.command, self.budget, self.chosen = command, budget, chosen
        self.vocabulary = 0
        self.result: dict[str, Any] = {"mlx": _validate.MLX_VERSION}

    def rows(self, args: Any) -> list[tuple[str, str]]:
        """The banner's rows after mlx-lm's: the batch the planner measures, and nuvec's."""
        measured = "the longest sequences of --data" if args.data is not None else "random tokens (no --data)"
        return [("batch", f"{args.batch_size}"), ("budget", peak_text(self.budget)), ("measured on", measured)]

    def __call__(self, *, model: Any, args: Any, optimizer: Any, train_dataset: Any, **_: Any) -> None:
        command = self.command
        batch = self._batch(args, train_dataset)
        rows, tokens = batch[0].shape
        source = "the longest sequences of the training set" if command.data is not None else "random tokens"
        chunks = lora.chunks_of(command)
        step = TrainingStep(
            model,
            loss_for(chunks.head),
            optimizer,
            ahead=command.stages_ahead,
            compile=not command.no_compile,
            synchronize=command.synchronize,
        )
        # As nuvec-mlx-lora trains it (recurrences routed too); the plan checkpoints the blocks.
        chunk_layers(model, chunks, routes=recurrences.routes(chunks.scan))
        if command.longest:
            print(self._longest(step, batch, source, _whole_up_to(model, chunks, batch[0].shape[0])))
            return
        found = plan(step, batch, self.budget, policies=self.chosen)
        lines = _summary(found, f"batch {rows} x {tokens} tokens: {source}")
        self.result.update(plan=found.to_dict(), batch={"rows": rows, "tokens": tokens, "source": source})
        if command.largest:
            lines.append(self._search(step, batch, command.largest, found.fits))
        if not found.fits:
            lines.append(self._what_fits(step, batch, found))
        if command.save:
            found.save_json(command.save)
            lines.append(
                f"saved the plan to {command.save}"
                + ("" if found.fits else " (it does not fit the budget)")
                + f": train with nuvec-mlx-lora ... --grad-checkpoint --plan {command.save}"
            )
        print("\n".join(line for line in lines if line))  # a search that found nothing says nothing
        if command.details:
            print("\n" + str(found))
            report = saved_activations(step, batch, policy=policies.save_matmuls)
            print("\nSaved activations per block (uncompiled graph; see nuvec_mlx.planner.saved):\n" + str(report))
            self.result["saved_activations"] = report.to_dict()

    def _longest(self, step: TrainingStep, batch: tuple[mx.array, mx.array], source: str, whole: int) -> str:
        """The longest sequence at the batch's rows that fits, every block checkpointed: peaks measured at
        three lengths up to the batch's tokens (:func:`_lengths`), a parabola through them solved for the
        budget, then ``--verify`` measurements that narrow it (:func:`nuvec_mlx.largest_fit`). The chunk rules
        often make the peak grow more slowly at longer lengths, so the extrapolation errs short, but not always
        (see docs/planning.md): ``--verify`` runs the answer before giving it. ``whole``: the longest length
        at which the chunk rules leave a module of the blocks whole (:func:`nuvec_mlx.chunking.whole_up_to`)."""
        rows, tokens = batch[0].shape
        sizes = _lengths(tokens, whole)
        make = functools.partial(_tokens_of, batch)
        tries = self.command.verify
        fit = largest_fit(step, make, self.budget, sizes=sizes, multiple=LENGTH_MULTIPLE, tolerance=0.05, tries=tries)
        measured = ", ".join(f"{size}: {peak_text(peak)}" for size, peak in fit.peaks)
        verified = fit.size > max(sizes)
        answer = fit.size if verified or self.command.verify else fit.predicted
        # Nothing measured failed and the curve fits the budget as far as it is read: longer may fit too.
        reached = fit.below is None and fit.size > 0 and at_reach(answer, max(sizes), LENGTH_MULTIPLE)
        # The peak falls where a module starts to be cut: measured below that length only, the answer errs short.
        short = min(sizes) <= whole < answer
        self.result["longest"] = {
            **dataclasses.asdict(fit),
            "tokens": answer,
            "verified": verified,
            "at_reach": reached,
            "rows": rows,
            "whole_up_to": whole,
        }
        if reached:
            how = (
                ("measured there; " if verified else "")
                + f"at least this: the extrapolation goes no further than {REACH}x the longest length measured first"
                + ("" if verified else ", not run there")
                + f"; --max-seq-length {REACH * max(sizes)} measures longer lengths for a longer answer"
            )
        elif verified:
            how = "measured there"
        elif self.command.verify:
            how = f"the longest measured to fit: {fit.below} was measured not to; a larger --verify narrows it"
        elif not fit.size:  # every length measured peaked over the budget: the curve is read below its points
            nearer = max(24, 2 * answer)
            how = (
                "extrapolated below every length measured, all over the budget, not run at that length: a rough "
                f"guess; measure nearer it with --max-seq-length {nearer}, or let --verify run it"
            )
        else:
            how = "extrapolated, not run at that length"
        cut = (
            f"\n  short, likely: the chunk rules leave a module of the blocks whole up to {whole} tokens and cut it "
            f"past them, where the peak grows more slowly; --max-seq-length {2 * _past(whole)} measures past it"
        )
        return (
            f"longest sequence that fits {peak_text(self.budget)} at batch {rows}: {answer} tokens ({how}; "
            f"first extrapolation {fit.predicted})\n  every block checkpointed, chunks as nuvec-mlx-lora's; "
            f"peaks measured on {source} (tokens: peak): {measured}" + (cut if short else "")
        )

    def _search(self, step: TrainingStep, batch: tuple[mx.array, mx.array], dimension: str, fits: bool) -> str:
        """The largest batch or sequence that fits, as the flags to pass (``""`` if none does)."""
        fit = _largest(step, batch, self.budget, dimension, fits)
        self.result.setdefault("largest", {})[dimension] = dataclasses.asdict(fit)
        if not fit.size:
            return ""
        rows = batch[0].shape[0]
        said = f"  {'largest' if fits else 'what fits'}:"
        peak = f" (peak {peak_text(dict(fit.peaks)[fit.size])}, measured with every block checkpointed)"
        if dimension == "seq":
            return f"{said}{'' if fits else ' --batch-size 1'} --max-seq-length {fit.size}{peak}"
        accumulate = math.ceil(rows / fit.size)
        same = f"; --grad-accumulation-steps {accumulate} keeps {rows} rows per update" if accumulate > 1 else ""
        return f"{said} --batch-size {fit.size}{peak}{same}"

    def _what_fits(self, step: TrainingStep, batch: tuple[mx.array, mx.array], found: Plan) -> str:
        """What fits when the command's batch does not: fewer rows, else one row of fewer tokens."""
        for dimension in ("batch", "seq") if batch[0].shape[0] > 1 else ("seq",):
            if dimension not in self.result.get("largest", {}):
                answer = self._search(step, batch, dimension, fits=False)
                if answer:
                    return answer
        tries = _remedies(self.command, step.model)
        return (
            f"  nothing fits {peak_text(self.budget)}: the step starts at {peak_text(found.start)} (weights, "
            "optimizer state, batch)" + (f"; try {', '.join(tries)}" if tries else "")
        )

    def _batch(self, args: Any, dataset: Any) -> tuple[mx.array, mx.array]:
        """``args.batch_size`` rows of the longest sequences of ``dataset`` as mlx-lm pads them; random
        tokens without data."""
        if self.command.data is None:
            ids = mx.random.randint(
                0, self.vocabulary, (args.batch_size, args.max_seq_length), key=mx.random.key(self.command.seed)
            )
            return ids, mx.array([[0, args.max_seq_length]] * args.batch_size)
        from mlx_lm.tuner.trainer import iterate_batches

        if len(dataset) < args.batch_size:
            lora.fail(PROG, f"--batch-size {args.batch_size} is more than the {len(dataset)} rows of the training set")
        lengths = lora.row_lengths(dataset)
        longest = sorted(range(len(dataset)), key=lengths.__getitem__)[-args.batch_size :]
        return next(iterate_batches([dataset[i] for i in longest], args.batch_size, args.max_seq_length))


def _summary(found: Plan, batch: str) -> list[str]:
    """The plan in a few lines: whether it fits, its peak, what it checkpoints; the smallest budget any plan
    fits, by the same test as ``fits`` (its predicted peak, and its measured peak plus the spread between
    repeats, within the budget)."""
    figures = (
        f"(predicted {peak_text(found.predicted)}; repeats varied by up to {peak_text(found.spread)}); "
        f"plans fit from {peak_text(found.smallest)}"
    )
    if found.fits:
        head = f"fits {peak_text(found.budget)}: the step peaks at {peak_text(found.measured)}, measured {figures}"
    else:
        head = (
            f"DOES NOT FIT {peak_text(found.budget)}: the least any plan reaches is "
            f"{peak_text(found.measured)}, measured {figures}"
        )
    return [
        head,
        f"  {batch}",
        f"  checkpointed: {_modes(found.modes)}" + (f" (the fixed rule {found.rule})" if found.rule else ""),
        f"  unchecked it peaks at {peak_text(found.unchecked)}; at its start {peak_text(found.start)} "
        "(weights, optimizer state, batch)",
    ]


def _remedies(command: Any, model: Any) -> list[str]:
    """What else may make a step fit, of what the run does not do already: fewer fine-tuned layers, LoRA
    in place of full fine-tuning, a quantized model."""
    tries = []
    if command.num_layers == -1 or command.num_layers > 1:
        tries.append(f"fewer layers than --num-layers {command.num_layers}")
    if command.fine_tune_type == "full":
        tries.append("LoRA (--fine-tune-type lora)")
    if not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules()):
        tries.append("a quantized model (QLoRA)")
    return tries


def _modes(modes: list[str]) -> str:
    """Each block's mode in words, blocks alike in runs: ``blocks 0-1 plain, 2-3 save_nothing (of 4)``."""
    if len(set(modes)) == 1:
        return "no block: it fits unchecked" if modes[0] == "plain" else f"every block, {modes[0]}"
    runs: list[list[Any]] = []
    for i, mode in enumerate(modes):
        if runs and runs[-1][2] == mode:
            runs[-1][1] = i
        else:
            runs.append([i, i, mode])
    parts = [f"{a}-{b} {m}" if a != b else f"{a} {m}" for a, b, m in runs]
    return f"blocks {', '.join(parts)} (of {len(modes)})"


def _lengths(tokens: int, whole: int) -> list[int]:
    """The three lengths ``--longest`` measures: a half, three quarters and all of ``tokens``; where the chunk
    rules leave a module whole up to ``whole`` tokens among them and cut it past (the peak falls there, and a
    curve across it bends the wrong way), three lengths past ``whole`` instead, if a quarter of ``tokens`` is.
    Multiples of :data:`LENGTH_MULTIPLE`.

    Example:
        >>> _lengths(12288, whole=8192)  # Llama-3.1-8B on a GPU: its projections whole up to 8,192 tokens
        [8200, 10240, 12288]
    """
    step = LENGTH_MULTIPLE
    sizes = sorted({max(step, tokens // 2 // step * step), max(2 * step, tokens * 3 // 4 // step * step)})
    low = _past(whole)
    if sizes[0] <= whole and tokens - whole >= tokens // 4 and low + 2 * step <= tokens:
        sizes = [low, (low + tokens) // 2 // step * step]
    return sorted({*sizes, max(3 * step, tokens)})


def _past(whole: int) -> int:
    """The shortest length past ``whole`` tokens that is a multiple of :data:`LENGTH_MULTIPLE`."""
    return (whole // LENGTH_MULTIPLE + 1) * LENGTH_MULTIPLE


def _whole_up_to(model: nn.Module, chunks: Chunks, rows: int) -> int:
    """:func:`nuvec_mlx.chunking.whole_up_to` for an mlx-lm model (its ``args.hidden_size``), 0 for a model
    whose arguments do not say its hidden size."""
    hidden = getattr(getattr(model, "args", None), "hidden_size", None)
    return whole_up_to(model, hidden, chunks, batch=rows) if isinstance(hidden, int) else 0


def _rows_of(batch: tuple[mx.array, mx.array], n: int) -> tuple[mx.array, mx.array]:
    """``n`` rows of ``batch`` (its rows over again past its own)."""
    index = mx.arange(n) % batch[0].shape[0]
    return batch[0][index], batch[1][index]


def _tokens_of(batch: tuple[mx.array, mx.array], n: int) -> tuple[mx.array, mx.array]:
    """The rows of ``batch`` cut (or, past their length, repeated) to ``n`` tokens."""
    ids, lengths = batch
    return ids[:, mx.arange(n) % ids.shape[1]], mx.stack([lengths[:, 0], mx.minimum(lengths[:, 1], n)], axis=1)


def _largest(step: TrainingStep, batch: tuple[mx.array, mx.array], budget: int, dimension: str, fits: bool) -> Fit:
    """The largest batch (rows) or sequence (tokens) that fits ``budget``: above the command's when its
    plan fits, else below it (a sequence with one row)."""
    rows, tokens = batch[0].shape
    if dimension == "batch":
        make: Callable[[int], Any] = functools.partial(_rows_of, batch)
        sizes, multiple = ((rows, 2 * rows) if fits else (1, 2)), 1
    else:
        base = batch if fits else _rows_of(batch, 1)
        make = functools.partial(_tokens_of, base)
        sizes, multiple = ((tokens, 2 * tokens) if fits else (max(2, tokens // 4), max(3, tokens // 2))), 8
    return largest_fit(step, make, budget, sizes=sizes, multiple=multiple, tolerance=0.05, tries=4)


if __name__ == "__main__":
    sys.exit(main())
