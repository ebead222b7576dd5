"""Each trainer in a process of its own, through its own ``train()``: the runs of the long-sequence suite.

A *run* fine-tunes one model (a :class:`~.cases.TrainWorkload` at batch 1, whose ``seq`` is the length)
with one trainer for a few steps, the way a user runs it: in a fresh Python process, through the
trainer's own ``train()``, with mlx-lm's batches of a one-row dataset:

- ``none``: ``mlx_lm.tuner.trainer.train`` without ``grad_checkpoint``;
- ``mlx-lm``: the same with ``grad_checkpoint=True`` (``mlx_lm.lora --grad-checkpoint``);
- ``nuvec``: ``nuvec_mlx.mlx_lm.train`` with ``grad_checkpoint=True`` (``nuvec-mlx-lora
  --grad-checkpoint``), at its defaults or with the :class:`nuvec_mlx.Chunks` settings and the stages
  ahead that its :class:`Trainer` names.

Each run loads its model from a folder in mlx-lm's format (``mlx_lm.utils.load_model``), which
:func:`build` writes once per model and mode: random weights in the workload's dtype, for ``qlora``
quantized as ``mlx_lm.convert -q`` quantizes (:data:`QUANTIZATION`). On this project's CPU, building and
quantizing Llama-3.2-1B at 4 layers took 38 s and loading the folder 0.24 s.

What a run measures: the memory the model, its adapters and the initialised optimizer hold
(``held``, MLX's active memory before training), then, at mlx-lm's report after every step
(``steps_per_report=1``), the step's peak above ``held`` (``mx.get_peak_memory()`` after
``mx.synchronize()``, then ``mx.reset_peak_memory()``) and the wall time since the previous report. A run
that runs out of memory is an outcome, not an error: MLX's exception is caught in the run's process, and
a process that ends without a result (killed, crashed) is one too (:data:`NOT_FITTING`). With a ``cap``
(the length search's memory plus a little), the run sets MLX's memory limit to it and a
:class:`Guard` ends the process as soon as MLX's memory passes it: MLX's limit alone only frees its
cache and waits for running work before going past it (every backend, MLX 0.32), it never fails.

``python -m nuvec_mlx_bench.train.trainers TASK JSON RESULT`` is the run's process (:func:`main`);
:func:`run`, :func:`build_in_child` and :func:`describe` start it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from .. import testing
from .cases import TrainWorkload

#: The trainers: each one's ``train()`` and whether it checkpoints.
TRAINERS = ("none", "mlx-lm", "nuvec")
#: The base model's quantization for ``qlora``: ``mlx_lm.convert -q``'s defaults (4 bits, groups of 64).
QUANTIZATION = {"group_size": 64, "bits": 4}
#: Adam's learning rate: ``mlx_lm.lora``'s default.
LEARNING_RATE = 1e-5
#: LoRA's scale, ``mlx_lm.lora``'s default (its rank and dropout are the workload's).
LORA_SCALE = 20.0
#: The random seed of the weights (the model folder's) and of the adapters and tokens (each run's).
SEED = 0

#: A run's outcomes: its steps ran; MLX raised that it ran out of memory; the :class:`Guard` saw MLX's
#: memory pass the cap; the process ended without a result (killed: the system ran out of memory, or
#: MLX crashed); it did not end within the timeout; another error (a bug: it fits nothing and says why).
OK, OUT_OF_MEMORY, OVER_CAP, CRASHED, TIMED_OUT, ERROR = (
    "ok",
    "out of memory",
    "over the cap",
    "out of memory or crashed",
    "timed out",
    "error",
)
#: The outcomes that say the run's steps did not fit.
NOT_FITTING = (OUT_OF_MEMORY, OVER_CAP, CRASHED, TIMED_OUT)
#: What MLX's (and Python's) out-of-memory errors say, lower-cased: CUDA's ``[malloc] Unable to allocate``
#: and ``cudaMallocAsync ... out of memory``, Metal's ``[metal::malloc]`` and ``Insufficient Memory``.
OUT_OF_MEMORY_SIGNS = ("out of memory", "unable to allocate", "malloc", "insufficient memory", "resource limit")
#: The exit status of a run the :class:`Guard` ended.
EXIT_OVER_CAP = 3
#: How often the :class:`Guard` reads MLX's memory, in seconds.
GUARD_PERIOD = 0.01
#: The characters of a failed run's output and error kept in its outcome.
TAIL = 2000
#: The process of a run: this module run as a script by this Python.
CHILD = (sys.executable, "-m", __name__)


@dataclasses.dataclass(frozen=True)
class Trainer:
    """A trainer (one of :data:`TRAINERS`) and, for ``nuvec``, its settings beyond the defaults.

    Attributes:
        name: ``none``, ``mlx-lm`` or ``nuvec``.
        chunks: ``nuvec_mlx.mlx_lm.train``'s ``chunks`` as :meth:`nuvec_mlx.Chunks.from_settings` takes them
            (``(("mlp", 2048),)``; 0 turns a part off); empty for its default.
        ahead: its stages ahead; ``None`` for its default.
        segment: its blocks per segment (``nuvec_mlx.mlx_lm.train``'s ``segment``); 1 for its default.

    Example:
        >>> Trainer("nuvec", chunks=(("mlp", 2048),), ahead=0).label()
        'nuvec (mlp=2048, ahead=0)'
    """

    name: str
    chunks: tuple[tuple[str, int | str], ...] = ()
    ahead: int | None = None
    segment: int | str = 1

    def __post_init__(self) -> None:
        if self.name not in TRAINERS:
            raise ValueError(f"trainer must be one of {', '.join(TRAINERS)}, got {self.name!r}")
        if self.name != "nuvec" and (self.chunks or self.ahead is not None or self.segment != 1):
            raise ValueError(f"chunks, ahead and segment are nuvec's settings, not {self.name}'s")
        self.settings()  # raises for a setting nv.Chunks cannot take

    def settings(self) -> dict[str, Any]:
        """``nuvec_mlx.mlx_lm.train``'s keywords beyond mlx-lm's: ``chunks``, ``ahead`` and ``segment``, where
        set."""
        import nuvec_mlx as nv

        given: dict[str, Any] = {} if self.ahead is None else {"ahead": self.ahead}
        if self.chunks:
            given["chunks"] = nv.Chunks.from_settings(**dict(self.chunks))
        if self.segment != 1:
            given["segment"] = self.segment
        return given

    def label(self) -> str:
        """The trainer's name, and its settings in brackets."""
        words = [f"{k}={v}" for k, v in self.chunks] + ([] if self.ahead is None else [f"ahead={self.ahead}"])
        words += [] if self.segment == 1 else [f"segment={self.segment}"]
        return f"{self.name} ({', '.join(words)})" if words else self.name


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run: a model (at ``workload.batch`` rows of ``workload.seq`` tokens), a trainer, its steps, where its model
    folder is, and the cap of its memory in bytes (``None``: none)."""

    workload: TrainWorkload
    trainer: Trainer
    steps: int
    folder: str
    cap: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-able values (:meth:`from_dict` reads them back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSpec:
        """The spec that :meth:`to_dict` wrote."""
        trainer = data["trainer"]
        chunks = tuple((k, v) for k, v in trainer["chunks"])
        return cls(
            workload=TrainWorkload(**data["workload"]),
            trainer=Trainer(trainer["name"], chunks, trainer["ahead"], trainer.get("segment", 1)),
            steps=data["steps"],
            folder=data["folder"],
            cap=data["cap"],
        )


@dataclasses.dataclass
class Outcome:
    """What a run gave.

    Attributes:
        status: one of :data:`OK` and the other outcomes (:data:`NOT_FITTING`, :data:`ERROR`).
        held: bytes MLX held before training (the model, its adapters, the optimizer's state).
        peaks: each step's peak above ``held``, in bytes, in order (those that finished).
        seconds: each step's wall time, from the previous report to its own.
        losses: each step's training loss.
        cap: the run's cap in bytes, or ``None``.
        error: what went wrong (the end of the message, or of the process's output).
        returncode: the process's exit status (``None`` where it timed out).
        trainer_peaks: each step's peak in all as the trainer reports it, in bytes (nuvec's callbacks'
            ``step_peak_memory``, measured from the step's start; mlx-lm's trainer reports none).
        trainer_function: the ``train()`` the run called (module and name).
        load_seconds: the time to load the model and set up its adapters and optimizer.
        wall_seconds: the whole process's time, as its parent saw it.
    """

    status: str
    held: int | None = None
    peaks: list[int] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    cap: int | None = None
    error: str = ""
    returncode: int | None = None
    trainer_peaks: list[int] = dataclasses.field(default_factory=list)
    trainer_function: str = ""
    load_seconds: float | None = None
    wall_seconds: float | None = None

    def peak_in_all(self) -> int | None:
        """What the run needed: ``held`` plus its highest step peak (``None`` before a step finished)."""
        return None if self.held is None or not self.peaks else self.held + max(self.peaks)

    def fits(self, memory: int) -> bool | None:
        """Whether the run's steps fit ``memory`` bytes in all; ``None`` where it cannot say: a run stopped
        under a cap below ``memory``, which a run under a larger cap may fit.

        Raises:
            RuntimeError: the run failed with an error other than running out of memory.
        """
        if self.status == OK:
            needed = self.peak_in_all()
            return needed is not None and needed <= memory
        if self.status in NOT_FITTING:
            return False if self.cap is None or memory <= self.cap else None
        raise RuntimeError(f"the run failed: {self.error}")


class Finished(Exception):
    """Raised by :class:`StepReader` after the last step's report: the trainer then stops before it saves
    its adapter file (a full fine-tune's is the whole model)."""


class StepReader:
    """An mlx-lm training callback that reads each step's peak above ``held`` and its time into ``outcome``.

    mlx-lm's trainers call ``on_train_loss_report`` after every step when ``steps_per_report`` is 1. The
    peak is the larger of MLX's peak counter and its active memory (a reset counter reads 0 until the next
    allocation), after ``mx.synchronize()``; the counter is reset after each reading. The time is the wall
    time since the previous report (or since :meth:`start`). After step ``steps`` it raises :class:`Finished`.
    """

    def __init__(self, held: int, steps: int, outcome: Outcome):
        self.held, self.steps, self.outcome = held, steps, outcome
        self.since = time.perf_counter()

    def start(self) -> None:
        """The first step's time counts from here (the call of ``train()``)."""
        self.since = time.perf_counter()

    def on_train_loss_report(self, info: dict[str, Any]) -> None:
        """Read the step's peak and time; stop after the last step."""
        mx.synchronize()
        now = time.perf_counter()
        self.outcome.peaks.append(max(mx.get_peak_memory(), mx.get_active_memory()) - self.held)
        self.outcome.seconds.append(now - self.since)
        self.outcome.losses.append(float(info["train_loss"]))
        if "step_peak_memory" in info:  # nuvec's, in GB as mlx-lm's peak_memory
            self.outcome.trainer_peaks.append(round(info["step_peak_memory"] * 1e9))
        mx.reset_peak_memory()
        self.since = time.perf_counter()
        if info["iteration"] >= self.steps:
            raise Finished

    def on_val_loss_report(self, info: dict[str, Any]) -> None:
        """No validation set: never called."""


class Guard:
    """Inside, a thread ends this process as soon as MLX's memory passes ``cap`` bytes, after writing
    ``outcome`` (status :data:`OVER_CAP`) to ``result``; exit status :data:`EXIT_OVER_CAP`.

    It reads the larger of MLX's peak counter and its active memory every :data:`GUARD_PERIOD` seconds
    (MLX releases the interpreter while it evaluates), so it sees a peak between two readings unless the
    counter was reset in between: it makes a step that cannot fit fail fast, and a step it misses is
    measured whole. It never stops a step that fits ``cap``.
    """

    def __init__(self, cap: int, outcome: Outcome, result: Path, period: float = GUARD_PERIOD):
        self.cap, self.outcome, self.result, self.period = cap, outcome, result, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nuvec-bench-guard", daemon=True)

    def __enter__(self) -> Guard:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.period):
            used = max(mx.get_peak_memory(), mx.get_active_memory())
            if used > self.cap:
                self.outcome.status = OVER_CAP
                self.outcome.error = f"MLX's memory reached {used} bytes, over the cap of {self.cap}"
                write_json(self.result, dataclasses.asdict(self.outcome))
                os._exit(EXIT_OVER_CAP)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file renamed)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data))
    partial.replace(path)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says that memory ran out (:data:`OUT_OF_MEMORY_SIGNS`, or a :class:`MemoryError`).

    Example:
        >>> is_out_of_memory(RuntimeError("[malloc] Unable to allocate 8589934592 bytes."))
        True
    """
    return isinstance(error, MemoryError) or any(s in str(error).lower() for s in OUT_OF_MEMORY_SIGNS)


# ---------------------------------------------------------------- the model folder


def model_folder(cache: Path, w: TrainWorkload) -> Path:
    """The folder of ``w``'s model under ``cache``: one per configuration, depth, dtype and quantization
    (the sequence length and the trainer do not matter; ``lora`` and ``full`` share the unquantized one)."""
    config, quantized = w.config(), w.mode == "qlora"
    key = json.dumps([config, w.dtype, QUANTIZATION if quantized else None, SEED], sort_keys=True)
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    kind = "q{bits}g{group_size}".format(**QUANTIZATION) if quantized else "unquantized"
    return cache / f"{w.model}-L{config['num_hidden_layers']}-{w.dtype}-{kind}-{digest}"


def build(w: TrainWorkload, folder: Path) -> None:
    """Write ``w``'s model into ``folder`` in mlx-lm's format (``config.json``, safetensors): random
    weights (:func:`nuvec_mlx_bench.testing.mlx_lm_model`) in ``w.dtype``, quantized for ``qlora`` as
    ``mlx_lm.convert -q`` does (:data:`QUANTIZATION`). Written into a temporary folder and renamed, so that
    ``folder`` exists only whole."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    model, config = testing.mlx_lm_model(w.config(), w.dtype, seed=SEED)
    if w.mode == "qlora":
        with contextlib.redirect_stdout(io.StringIO()):  # its "[INFO] Quantized ..." line
            model, config = quantize_model(model, config, QUANTIZATION["group_size"], QUANTIZATION["bits"])
    partial = folder.with_name(folder.name + ".partial")
    save_model(partial, model)
    save_config(config, partial / "config.json")
    partial.replace(folder)


def load(w: TrainWorkload, folder: Path) -> tuple[nn.Module, optim.Optimizer, int]:
    """The model of ``folder`` set up for ``w.mode`` as ``mlx_lm.lora`` sets it up on every layer, and an
    initialised Adam: returns them and the bytes MLX holds then (``held``).

    ``full`` trains every block (embeddings and head frozen); ``lora`` and ``qlora`` put LoRA adapters of
    ``w.lora_rank`` on mlx-lm's default layers of every block (``linear_to_lora_layers``)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    mx.random.seed(SEED)
    model.freeze()
    if w.mode == "full":
        for layer in model.layers:
            layer.unfreeze()
    else:
        lora = {"rank": w.lora_rank, "scale": LORA_SCALE, "dropout": w.lora_dropout}
        linear_to_lora_layers(model, len(model.layers), lora)
    optimizer = optim.Adam(learning_rate=LEARNING_RATE)
    optimizer.init(model.trainable_parameters())
    mx.eval(model.parameters(), optimizer.state)
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    return model, optimizer, mx.get_active_memory()


def one_row(vocab: int, length: int, rows: int = 1) -> list[tuple[np.ndarray, int]]:
    """A dataset of ``rows`` rows (one batch) as mlx-lm's ``iterate_batches`` takes it (``(tokens, offset)``
    items): ``length + 1`` random token ids each, so that the model reads ``length`` tokens (the last id is only
    a target)."""
    ids = np.random.default_rng(SEED).integers(0, vocab, (rows, length + 1), dtype=np.int32)
    return [(row, 0) for row in ids]


def trainer_function(trainer: Trainer) -> Callable[..., Any]:
    """The ``train()`` that ``trainer`` runs: mlx-lm's, or ``nuvec_mlx.mlx_lm.train``."""
    if trainer.name == "nuvec":
        from nuvec_mlx.mlx_lm import train

        return train
    from mlx_lm.tuner.trainer import train as mlx_lm_train

    return mlx_lm_train


def train_run(spec: RunSpec, result: Path) -> Outcome:
    """Run ``spec`` in this process: load the model, train ``spec.steps`` steps with the trainer's
    ``train()``, and return what each step took. Running out of memory is an outcome (:data:`OUT_OF_MEMORY`);
    with a cap, MLX's memory limit is set to it and a :class:`Guard` watches it."""
    from mlx_lm.tuner.trainer import TrainingArgs

    w, trainer = spec.workload, spec.trainer
    function = trainer_function(trainer)
    outcome = Outcome(OK, cap=spec.cap, trainer_function=f"{function.__module__}.{function.__qualname__}")
    start = time.perf_counter()
    model, optimizer, outcome.held = load(w, Path(spec.folder))
    outcome.load_seconds = time.perf_counter() - start
    reader = StepReader(outcome.held, spec.steps, outcome)
    args = TrainingArgs(
        batch_size=w.batch,
        iters=spec.steps,
        max_seq_length=w.seq + 1,  # the row's length + 1 ids: iterate_batches keeps every one
        grad_checkpoint=trainer.name != "none",
        steps_per_report=1,
        steps_per_eval=10**9,
        steps_per_save=10**9,
        adapter_file=str(result.with_name("adapters.safetensors")),  # never written: Finished comes first
    )
    if spec.cap is not None:
        mx.set_memory_limit(spec.cap)
    guard = Guard(spec.cap, outcome, result) if spec.cap is not None else contextlib.nullcontext()
    mx.reset_peak_memory()
    with guard:
        reader.start()
        try:
            dataset = one_row(w.config()["vocab_size"], w.seq, w.batch)
            function(model, optimizer, dataset, args=args, training_callback=reader, **trainer.settings())
        except Finished:
            pass
        except (RuntimeError, MemoryError) as e:
            if not is_out_of_memory(e):
                raise
            outcome.status, outcome.error = OUT_OF_MEMORY, str(e)[-TAIL:]
    return outcome


# ---------------------------------------------------------------- the process


def _run_task(data: dict[str, Any], result: Path) -> dict[str, Any]:
    return dataclasses.asdict(train_run(RunSpec.from_dict(data), result))


def _build_task(data: dict[str, Any], result: Path) -> dict[str, Any]:
    start = time.perf_counter()
    folder = Path(data["folder"])
    build(TrainWorkload(**data["workload"]), folder)
    size = sum(f.stat().st_size for f in folder.iterdir())
    return {"status": OK, "seconds": time.perf_counter() - start, "bytes": size}


def _describe_task(data: dict[str, Any], result: Path) -> dict[str, Any]:
    import mlx_lm

    from ..core import environment

    return {
        **environment.environment(data["command"]),
        "mlx_lm": mlx_lm.__version__,
        "device_memory": device_memory(),
    }


def device_memory() -> int:
    """The device's memory in bytes as MLX reports it (CUDA's ``total_memory``, Metal's ``memory_size``);
    0 where it reports none (the CPU)."""
    info = mx.device_info()
    return int(info.get("total_memory") or info.get("memory_size") or 0)


#: What the process can do: a run, building a model folder, describing the machine.
TASKS: dict[str, Callable[[dict[str, Any], Path], dict[str, Any]]] = {
    "run": _run_task,
    "build": _build_task,
    "describe": _describe_task,
}


def main(argv: Sequence[str] | None = None) -> int:
    """The run's process: ``TASK JSON RESULT``; writes the task's result, or the error, to ``RESULT``."""
    task, payload, result = sys.argv[1:] if argv is None else argv
    try:
        written = TASKS[task](json.loads(payload), Path(result))
    except Exception:  # a bug, not a measurement: said in the result, for the parent to report
        written = {"status": ERROR, "error": traceback.format_exc()[-TAIL:]}
    write_json(Path(result), written)
    return 0


def _spawn(
    task: str, payload: dict[str, Any], command: Sequence[str], timeout: float | None
) -> tuple[dict[str, Any] | None, int | None, str]:
    """Run ``task`` in a process of its own: its result (``None`` if it wrote none), exit status (``None``
    if it ran past ``timeout`` seconds and was killed) and the end of its output."""
    with tempfile.TemporaryDirectory(prefix="nuvec-bench-") as tmp:
        result = Path(tmp) / "result.json"
        argv = [*command, task, json.dumps(payload), str(result)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
            returncode, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            returncode, output = None, _text(e.stdout) + _text(e.stderr)
        data = json.loads(result.read_text()) if result.exists() else None
    return data, returncode, output[-TAIL:]


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def run(spec: RunSpec, command: Sequence[str] = CHILD, timeout: float | None = None) -> Outcome:
    """Run ``spec`` in a fresh process (``command`` and the task's arguments): its :class:`Outcome`, also
    where the process was killed (:data:`CRASHED`, with its exit status) or timed out (:data:`TIMED_OUT`)."""
    start = time.perf_counter()
    data, returncode, output = _spawn("run", spec.to_dict(), command, timeout)
    if data is not None:
        outcome = Outcome(**data)
    elif returncode is None:
        outcome = Outcome(TIMED_OUT, cap=spec.cap, error=f"no result within {timeout} s: {output}")
    else:
        outcome = Outcome(CRASHED, cap=spec.cap, error=f"exit status {returncode}, no result: {output}")
    if outcome.status == ERROR:
        outcome.error += f"\noutput: {output}"
    outcome.returncode, outcome.wall_seconds = returncode, time.perf_counter() - start
    return outcome


def _checked(data: dict[str, Any] | None, what: str, returncode: int | None, output: str) -> dict[str, Any]:
    if data is None or data.get("status") == ERROR:
        error = data["error"] if data else f"exit status {returncode}"
        raise RuntimeError(f"{what} failed: {error}\noutput: {output}")
    return data


def build_in_child(
    w: TrainWorkload, folder: Path, command: Sequence[str] = CHILD, timeout: float | None = None
) -> dict[str, Any]:
    """Write ``w``'s model folder (:func:`build`) in a process of its own; its seconds and bytes.

    Raises:
        RuntimeError: the process failed (with its error and output).
    """
    data, returncode, output = _spawn(
        "build", {"workload": dataclasses.asdict(w), "folder": str(folder)}, command, timeout
    )
    return _checked(data, f"building {folder.name}", returncode, output)


def describe(command_line: str, command: Sequence[str] = CHILD) -> dict[str, Any]:
    """Where the runs run, as a run's process sees it: :func:`~nuvec_mlx_bench.core.environment.environment`
    (command, MLX, backend, device ...), mlx-lm's version and the device's memory in bytes."""
    data, returncode, output = _spawn("describe", {"command": command_line}, command, None)
    return _checked(data, "describing the machine", returncode, output)


@contextlib.contextmanager
def model_cache(folder: Path | None) -> Iterator[Path]:
    """``folder`` (created), or a temporary folder removed after."""
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="nuvec-bench-models-") as tmp:
        yield Path(tmp)


if __name__ == "__main__":
    sys.exit(main())
