"""Fine-tuning with mlx-lm, checkpointed by nuvec: :func:`train` and the ``nuvec-mlx-lora`` command.

``nuvec-mlx-lora`` is ``mlx_lm.lora`` (its arguments, config files, datasets,
losses, LoRA conversion and adapter files) with :func:`train` in place of
``mlx_lm.tuner.trainer.train``, so switching is one word::

    mlx_lm.lora    --model ./model --train --data ./data --grad-checkpoint
    nuvec-mlx-lora --model ./model --train --data ./data --grad-checkpoint

:func:`train` is mlx-lm's training loop (mlx-lm 0.32: the same batches,
validation, reports, callbacks and adapter files) with three changes:

- ``grad_checkpoint`` puts nuvec's checkpoint on every block of
  ``model.layers``, each instance whatever its class, for the run (mlx-lm
  replaces ``type(model.layers[0]).__call__`` with :func:`mlx.core.checkpoint`:
  one class, so hybrid models keep their other blocks unchecked; and its
  recomputation draws new dropout masks);
- the step is compiled with :func:`nuvec_mlx.compile` and evaluated with
  :func:`nuvec_mlx.eval`, one checkpointed block at a time, each block's
  optimizer update right after its backward pass (:func:`nuvec_mlx.update`);
  on a GPU one stage is queued ahead of the one waited for
  (:func:`default_ahead`), which keeps the step near mlx-lm's time;
- each report line ends with the peak memory of the steps since the last
  report (``step_peak_memory`` for the callbacks, in GB as mlx-lm's
  ``peak_memory``).

Needs mlx-lm: ``pip install "nuvec-mlx[mlx-lm]"``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.nn.utils import average_gradients
from mlx.utils import tree_flatten, tree_map

try:
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.trainer import TrainingArgs, default_loss, evaluate, iterate_batches
    from mlx_lm.utils import maybe_set_recommended_wired_limit
except ImportError as e:  # pragma: no cover - the extra is installed where this runs
    raise ImportError('nuvec_mlx.mlx_lm needs mlx-lm: pip install "nuvec-mlx[mlx-lm]"') from e

from .. import _validate
from ..compile import compile as nv_compile
from ..evaluate import eval as nv_eval
from ..grad import value_and_grad
from ..nn import checkpoint_module, is_checkpointed
from ..update import update
from . import _report

__all__ = ["PROG", "checkpointed_blocks", "default_ahead", "main", "train", "training_step"]

#: The command's name.
PROG = "nuvec-mlx-lora"


def default_ahead(device: mx.Device | None = None) -> int:
    """The stages :func:`train` queues ahead (``nv.eval``'s ``ahead``) on ``device``.

    1 on a GPU: without it the device idles while the host builds each
    stage, and a step took 1.00-1.18x mlx-lm's on an H200; with it
    0.94-1.10x, at a peak 4-43% higher, still 0.26-0.38 of mlx-lm's
    (``benchmarks/results/h200/2026-12-04-ahead/``).
    0 on the CPU, where the host's work is small beside the kernels'. On
    Metal (a GPU too) it has not been measured.

    Args:
        device: an :class:`mlx.core.Device` or a device type (``mx.gpu``,
            ``mx.cpu``), as :func:`mlx.core.set_default_device` takes; ``None``
            for MLX's default device.

    Example:
        >>> default_ahead(mx.cpu), default_ahead(mx.gpu)
        (0, 1)
    """
    if device is None:
        device = mx.default_device()
    if not isinstance(device, (mx.Device, mx.DeviceType)):
        raise TypeError(f"device must be an mlx.core.Device, a device type or None, got {type(device).__name__}")
    return 1 if getattr(device, "type", device) == mx.gpu else 0


def training_step(
    model: nn.Module, optimizer: optim.Optimizer, loss: Callable = default_loss, grad_accumulation_steps: int = 1
) -> tuple[Callable, list]:
    """mlx-lm's training step, compiled with :func:`nuvec_mlx.compile`, updating with :func:`nuvec_mlx.update`.

    Args:
        model: the model; its checkpointed blocks become the step's stages.
        optimizer: the optimizer that updates the model's trainable parameters.
        loss: ``loss(model, *batch) -> (value, tokens)``, as mlx-lm's losses.
        grad_accumulation_steps: the updates' gradients are the mean over this many steps.

    Returns:
        ``(step, state)``: ``step(batch, prev_grad, do_update) -> (loss, tokens, grad)``
        as in ``mlx_lm.tuner.trainer.train`` (``grad`` is the accumulated
        gradient, ``None`` after an update), and the state it updates: evaluate
        its results with ``nv.eval(state, loss, tokens, grad)``.

    Example:
        >>> step, state = training_step(model, optimizer)
        >>> loss, tokens, _ = step(batch, None, True)
        >>> nv.eval(state, loss, tokens)
    """
    _validate.check_module(model, "model")
    _validate.check_optimizer(optimizer, "optimizer")
    _validate.check_callable(loss, "loss")
    _validate.check_int(grad_accumulation_steps, "grad_accumulation_steps", minimum=1)
    state = [model.state, optimizer.state, mx.random.state]
    loss_value_and_grad = value_and_grad(model, loss)

    @nv_compile(inputs=state, outputs=state)
    def step(batch: tuple, prev_grad: Any, do_update: bool) -> tuple[mx.array, mx.array, Any]:
        (value, tokens), grad = loss_value_and_grad(model, *batch)
        if prev_grad is not None:
            grad = tree_map(mx.add, grad, prev_grad)
        if do_update:
            grad = average_gradients(grad)
            if grad_accumulation_steps > 1:
                grad = tree_map(lambda g: g / grad_accumulation_steps, grad)
            update(optimizer, model, grad)  # each block's update a stage after its backward
            grad = None
        return value, tokens, grad

    return step, state


@contextlib.contextmanager
def checkpointed_blocks(model: nn.Module) -> Iterator[list[nn.Module]]:
    """Checkpoint every block of ``model.layers`` inside, whatever its class; undone after.

    Blocks already checkpointed stay so.

    Args:
        model: an mlx-lm model (its repeated blocks are ``model.layers``).

    Yields:
        The blocks checkpointed here.

    Example:
        >>> with checkpointed_blocks(model):
        ...     loss, grads = nv.value_and_grad(model, default_loss)(model, batch, lengths)
    """
    _validate.check_module(model, "model")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError("model must have its blocks in model.layers (a list, as mlx-lm's models have)")
    blocks = [b for i, b in enumerate(layers) if not is_checkpointed(_validate.check_module(b, f"model.layers[{i}]"))]
    for b in blocks:
        checkpoint_module(b)
    try:
        yield blocks
    finally:
        for b in blocks:
            checkpoint_module(b, enable=False)


def train(
    model: nn.Module,
    optimizer: optim.Optimizer,
    train_dataset: Any,
    val_dataset: Any = None,
    args: TrainingArgs = TrainingArgs(),
    loss: Callable = default_loss,
    iterate_batches: Callable = iterate_batches,
    training_callback: TrainingCallback | None = None,
    ahead: int | None = None,
) -> None:
    """``mlx_lm.tuner.trainer.train``, with nuvec's checkpoints and staged evaluation.

    The same arguments, batches, validation, report lines, callbacks and
    adapter files as mlx-lm's; with ``args.grad_checkpoint`` every block of
    ``model.layers`` is checkpointed for the run (:func:`checkpointed_blocks`),
    the step is compiled by :func:`training_step` and evaluated by
    :func:`nuvec_mlx.eval`. Each report line ends with the highest peak memory
    of the steps since the last report (active memory, weights and optimizer
    state included, read after :func:`mlx.core.synchronize` by
    :func:`nuvec_mlx.memory.measure` without clearing the cache); the callbacks
    get it as ``step_peak_memory`` (GB), beside mlx-lm's ``peak_memory``. As
    mlx-lm's, it sets MLX's wired limit on a Mac
    (``mlx_lm.utils.maybe_set_recommended_wired_limit``).

    Args:
        model, optimizer, train_dataset, val_dataset, args, loss,
        iterate_batches, training_callback: as for ``mlx_lm.tuner.trainer.train``.
        ahead: stages queued past the one waited for (:func:`nuvec_mlx.eval`'s
            ``ahead``): 0 for the lowest peak; ``None`` for :func:`default_ahead`.

    Example:
        >>> from mlx_lm.tuner.trainer import TrainingArgs
        >>> train(model, optim.Adam(1e-5), CacheDataset(train_set),
        ...       args=TrainingArgs(iters=100, grad_checkpoint=True))
    """
    if not isinstance(args, TrainingArgs):
        raise TypeError(f"args must be an mlx_lm.tuner.trainer.TrainingArgs, got {type(args).__name__}")
    _validate.check_callable(iterate_batches, "iterate_batches")
    ahead = default_ahead() if ahead is None else _validate.check_int(ahead, "ahead", minimum=0)
    step, state = training_step(model, optimizer, loss, args.grad_accumulation_steps)
    maybe_set_recommended_wired_limit()
    with checkpointed_blocks(model) if args.grad_checkpoint else contextlib.nullcontext():
        _loop(model, optimizer, train_dataset, val_dataset, args, loss, iterate_batches, training_callback,
              step, state, ahead)


def _loop(model, optimizer, train_dataset, val_dataset, args, loss, iterate_batches, callback, step, state, ahead):
    """mlx-lm's loop (``mlx_lm.tuner.trainer.train``), the step measured and evaluated staged."""
    world = mx.distributed.init()
    rank = world.rank()
    peaks = _report.StepPeaks()
    model.train()
    losses, n_tokens, steps, trained_tokens, train_time, grad = 0, 0, 0, 0, 0.0, None
    batches = iterate_batches(dataset=train_dataset, batch_size=args.batch_size,
                              max_seq_length=args.max_seq_length, loop=True, comm_group=world)
    with _report.TrainUI(args.iters, rank=rank) as ui:
        for it, batch in zip(range(1, args.iters + 1), batches):
            tic = time.perf_counter()
            if val_dataset and (it == 1 or it % args.steps_per_eval == 0 or it == args.iters):
                _validate_model(model, val_dataset, args, loss, iterate_batches, callback, ui, it)
                tic = time.perf_counter()
            with peaks.step():
                value, tokens, grad = step(batch, grad, it % args.grad_accumulation_steps == 0)
                losses += value
                n_tokens += tokens
                steps += 1
                nv_eval(state, losses, n_tokens, grad, ahead=ahead)
            if mx.get_cache_memory() > args.clear_cache_threshold:
                mx.clear_cache()
            train_time += time.perf_counter() - tic
            ui.advance()

            if it % args.steps_per_report == 0 or it == args.iters:
                train_loss = mx.distributed.all_sum(losses, stream=mx.cpu).item() / (steps * world.size())
                n_tokens = mx.distributed.all_sum(n_tokens, stream=mx.cpu).item()
                tokens_sec = float(n_tokens) / train_time
                trained_tokens += n_tokens
                process_peak, step_peak = peaks.report()
                ui.report_train(it, train_loss, tokens_sec, trained_tokens, step_peak)
                if callback is not None:
                    callback.on_train_loss_report({
                        "iteration": it, "train_loss": train_loss,
                        "learning_rate": optimizer.learning_rate.item(),
                        "iterations_per_second": args.steps_per_report / train_time,
                        "tokens_per_second": tokens_sec, "trained_tokens": trained_tokens,
                        "peak_memory": process_peak / 1e9, "step_peak_memory": step_peak / 1e9,
                    })
                losses, n_tokens, steps, train_time = 0, 0, 0, 0.0

            if it % args.steps_per_save == 0 and rank == 0:
                ui.report_save(_save_adapters(model, args.adapter_file, it))
    if rank == 0:
        _save_adapters(model, args.adapter_file)


def _validate_model(model, val_dataset, args, loss, iterate_batches, callback, ui, it) -> None:
    """mlx-lm's validation: the loss over ``args.val_batches``, reported and told to the callback."""
    total = len(val_dataset) // args.batch_size
    tic = time.perf_counter()
    with ui.val_task(total if args.val_batches == -1 else min(total, args.val_batches)) as advance:
        val_loss = evaluate(model=model, dataset=val_dataset, loss=loss, batch_size=args.batch_size,
                            num_batches=args.val_batches, max_seq_length=args.max_seq_length,
                            iterate_batches=iterate_batches, progress_callback=advance)
    model.train()
    val_time = time.perf_counter() - tic
    ui.report_val(it, val_loss, val_time)
    if callback is not None:
        callback.on_val_loss_report({"iteration": it - 1, "val_loss": val_loss, "val_time": val_time})


def _save_adapters(model: nn.Module, adapter_file: str | Path, it: int | None = None) -> Path:
    """Save the trainable parameters to ``adapter_file`` (and, at iteration ``it``, a numbered copy)."""
    weights = dict(tree_flatten(model.trainable_parameters()))
    mx.save_safetensors(str(adapter_file), weights)
    if it is None:
        return Path(adapter_file)
    numbered = Path(adapter_file).parent / f"{it:07d}_adapters.safetensors"
    mx.save_safetensors(str(numbered), weights)
    return numbered


@contextlib.contextmanager
def _swapped(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside, and what it was after."""
    held = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, held)


def main(argv: list[str] | None = None) -> None:
    """The ``nuvec-mlx-lora`` command: ``mlx_lm.lora`` training with :func:`train`.

    It takes ``mlx_lm.lora``'s arguments and config files unchanged
    (``--grad-checkpoint`` checkpoints every block with nuvec), and one more:
    ``--stages-ahead N`` (``stages_ahead`` in a config file), :func:`train`'s
    ``ahead``: 0 for the lowest peak; by default :func:`default_ahead`.

    Args:
        argv: the arguments, as on the command line (default ``sys.argv[1:]``).

    Example:
        >>> main(["--model", "./model", "--train", "--data", "./data", "--grad-checkpoint"])
    """
    if argv is not None and (isinstance(argv, str) or not all(isinstance(a, str) for a in argv)):
        raise TypeError(f"argv must be a list of str, got {type(argv).__name__}")
    # Imported here: importing mlx_lm.lora changes yaml's SafeLoader for every user of yaml.
    from mlx_lm import lora

    mlx_lm_parser, mlx_lm_run = lora.build_parser, lora.run

    def build_parser() -> argparse.ArgumentParser:
        parser = mlx_lm_parser()
        parser.add_argument("--stages-ahead", type=_stages_ahead, default=None,
                            help="nuvec: checkpointed stages queued ahead of the one waited for; 0 gives the "
                                 "lowest peak (default: 1 on a GPU, 0 on the CPU)")
        return parser

    def run(args: Any) -> None:
        with _swapped(lora, "train", functools.partial(train, ahead=args.stages_ahead)):
            mlx_lm_run(args)

    command = [PROG, *(sys.argv[1:] if argv is None else argv)]
    with _swapped(sys, "argv", command), _swapped(lora, "build_parser", build_parser), _swapped(lora, "run", run):
        lora.main()


def _stages_ahead(text: str) -> int:
    """``--stages-ahead``'s value: an int >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {value}")
    return value
