"""The planner's answer beside the length search: ``nuvec-mlx-plan --longest`` on the suite's model folders.

The search (:func:`nuvec_mlx_bench.train.long.search`) measures the longest length that fits a memory by
training at each length it tries, minutes per probe on a long sequence. ``nuvec-mlx-plan --longest`` answers the
same question from a few short measurements: :func:`longest` runs it as a user runs it, in a process of its
own, on the model folder the runs load (a tiny tokenizer written into the folder first: the command loads
the model with one), with the trainer's settings as its flags, the budget the memory searched, and
``--verify 0``: the extrapolation alone, nothing run at the length it answers. The suite puts its answer
beside the measured one (``--plan-length``). Its measurements do not depend on the budget (a half, three
quarters and all of ``--max-seq-length``), only its answer does: :func:`answer` solves one run's
measurements for any other budget as the command would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nuvec_mlx.mlx_lm import lora
from nuvec_mlx.mlx_lm.plan import LENGTH_MULTIPLE
from nuvec_mlx.planner import fit

from .. import testing
from .cases import TrainWorkload
from .trainers import LORA_SCALE, TAIL, Trainer

#: The command, run by this Python.
COMMAND = (sys.executable, "-m", "nuvec_mlx.mlx_lm.plan")
#: nuvec-mlx-plan's flag for each chunk setting (``nv.Chunks``' field names): the commands' own table, turned round.
CHUNK_FLAGS = {setting: f"--{flag.replace('_', '-')}" for flag, setting in lora.CHUNK_FLAGS.items()}


def plans(trainer: Trainer) -> bool:
    """Whether ``nuvec-mlx-plan`` plans ``trainer``'s step: nuvec's, with every block checkpointed on its own
    (the command takes chunks and stages ahead, not segments)."""
    return trainer.name == "nuvec" and trainer.segment == 1


def arguments(w: TrainWorkload, trainer: Trainer, folder: Path, memory: int, length: int, config: Path) -> list[str]:
    """``nuvec-mlx-plan``'s command line for ``w`` and ``trainer`` in ``folder``: the longest sequence at
    ``w.batch`` rows that fits ``memory`` bytes, measured at three lengths up to ``length`` tokens (a half,
    three quarters and all, or past where the chunk rules start cutting a module), extrapolated
    (``--verify 0``); LoRA as the runs set it (``config``: its parameters, on every block)."""
    argv = ["--model", str(folder), "-c", str(config), "--batch-size", str(w.batch), "--num-layers", "-1"]
    argv += ["--fine-tune-type", "full" if w.mode == "full" else "lora", "--max-seq-length", str(length)]
    argv += ["--budget", f"{memory}B", "--longest", "--verify", "0"]
    for name, value in trainer.chunks:
        argv += [CHUNK_FLAGS[name], str(value)]
    return argv + ([] if trainer.ahead is None else ["--stages-ahead", str(trainer.ahead)])


def longest(
    w: TrainWorkload,
    trainer: Trainer,
    folder: Path,
    memory: int,
    length: int,
    command: Sequence[str] = COMMAND,
    timeout: float | None = None,
) -> dict[str, Any]:
    """``nuvec-mlx-plan --longest``'s answer for ``memory`` bytes, measured at up to ``length`` tokens.

    Args:
        w, trainer: the model and mode (its ``seq`` unused), and a trainer :func:`plans`.
        folder: the model folder the runs load; a tokenizer is written into it where it has none.
        memory: the budget, bytes in all (weights, adapters, optimizer state, step).
        length: the command's ``--max-seq-length``.
        command: the command to run (:data:`COMMAND`).
        timeout: seconds before the command is stopped (``None``: none).

    Returns:
        ``tokens`` (its answer; 0 when nothing fits), ``peaks`` (each length it measured, with its peak in
        bytes), ``seconds`` (the command's wall time), ``length``; or ``error`` with the end of its output.

    Example:
        >>> longest(w, Trainer("nuvec"), folder, memory=24 << 30, length=16384)["tokens"]
    """
    if not plans(trainer):
        raise ValueError(f"nuvec-mlx-plan plans nuvec's step without segments, not {trainer.label()}")
    if not (folder / "tokenizer.json").exists():
        testing.write_tokenizer(folder)
    with tempfile.TemporaryDirectory(prefix="nuvec-bench-plan-") as tmp:
        config, found = Path(tmp) / "lora.json", Path(tmp) / "plan.json"
        lora = {"rank": w.lora_rank, "scale": LORA_SCALE, "dropout": w.lora_dropout}
        config.write_text(json.dumps({"lora_parameters": lora}))  # JSON is YAML: mlx-lm's -c reads it
        argv = [*command, *arguments(w, trainer, folder, memory, length, config), "--json", str(found)]
        start = time.perf_counter()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
            output, ended = done.stdout + done.stderr, done.returncode in (0, 1)  # 1: nothing fits
        except subprocess.TimeoutExpired:
            output, ended = f"no answer within {timeout} s", False
        seconds = time.perf_counter() - start
        result = json.loads(found.read_text()).get("longest") if ended and found.exists() else None
    if result is None:
        return {"error": output[-TAIL:], "seconds": seconds, "length": length}
    return {"tokens": result["tokens"], "peaks": result["peaks"], "seconds": seconds, "length": length}


def answer(asked: dict[str, Any], memory: int) -> dict[str, Any]:
    """:func:`longest`'s result ``asked`` for another budget, ``memory`` bytes: the command's answer at
    ``--verify 0`` (its parabola through the peaks it measured, solved for the budget), without running it
    again, and ``at_reach``: whether the answer is as far as the command extrapolates
    (:func:`nuvec_mlx.planner.fit.at_reach`), a lower bound; an ``error`` stays as it is.

    Example:
        >>> asked = longest(w, Trainer("nuvec"), folder, memory=64 << 30, length=8192)
        >>> answer(asked, 16 << 30)["tokens"]
    """
    if "error" in asked:
        return asked
    tokens = fit.solve(asked["peaks"], memory, LENGTH_MULTIPLE)
    reach = fit.at_reach(tokens, max(t for t, _ in asked["peaks"]), LENGTH_MULTIPLE)
    return {**asked, "tokens": tokens, "at_reach": reach}
