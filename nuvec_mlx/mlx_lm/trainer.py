"""mlx-lm's trainer with nuvec's checkpoints: :func:`train` (what ``nuvec-mlx-lora --grad-checkpoint`` runs).

:func:`train` is mlx-lm's training loop (mlx-lm 0.32: the same batches,
validation, reports, callbacks and adapter files) with four changes:

- ``grad_checkpoint`` puts nuvec's checkpoint on every block of
  ``model.layers``, each instance whatever its class, for the run (mlx-lm
  replaces ``type(model.layers[0]).__call__`` with :func:`mlx.core.checkpoint`:
  one class, so hybrid models keep their other blocks unchecked; and its
  recomputation draws new dropout masks);
- with it, the loss head, attention (where the backend trains it unfused),
  each block's MLP and the recurrences of hybrid models run in chunks of the
  sequence, sized by the rules of :mod:`nuvec_mlx.chunking` unless ``chunks``
  says otherwise, and ``segment`` keeps only every segment's input;
- the step is a :class:`nuvec_mlx.TrainingStep`: compiled, each block's
  optimizer update right after its backward pass, evaluated one checkpointed
  block at a time;
- each report line ends with the peak memory of the steps since the last
  report, each rank's under ``mlx.launch`` (``step_peak_memory`` for the
  callbacks, this rank's, and ``step_peak_memory_per_rank``, in GB as
  mlx-lm's ``peak_memory``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

try:
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.trainer import TrainingArgs, default_loss, evaluate, iterate_batches
    from mlx_lm.utils import maybe_set_recommended_wired_limit
except ImportError as e:  # pragma: no cover - the extra is installed where this runs
    raise ImportError('nuvec_mlx.mlx_lm needs mlx-lm: pip install "nuvec-mlx[mlx-lm]"') from e

from .. import _validate
from ..chunking import Chunks, chunk_layers
from ..nn import checkpoint_layers, checkpoint_module, find_layers, is_checkpointed, restoring
from ..planner import Plan
from ..step import TrainingStep
from . import _report, recurrences
from .losses import loss_for

__all__ = ["checkpointed_blocks", "train"]


@contextlib.contextmanager
def checkpointed_blocks(
    model: nn.Module, chunks: Chunks | None = None, segment: int | str = 1
) -> Iterator[list[nn.Module]]:
    """Checkpoint every block of ``model.layers`` inside, whatever its class, and compute them along the
    sequence in chunks as ``chunks`` says (:func:`nuvec_mlx.chunk_layers`); undone after.

    Blocks already checkpointed stay so, where ``segment`` is 1.

    Args:
        model: an mlx-lm model (its repeated blocks are ``model.layers``).
        chunks: attention's, the MLP's and the recurrences' chunks inside the
            blocks; ``None`` for ``nv.Chunks()`` (the rules decide).
        segment: blocks per segment (:func:`nuvec_mlx.checkpoint_layers`):
            only every ``segment``-th block's input is kept; 1 keeps every
            block's, ``"sqrt"`` the fewest.

    Yields:
        The blocks.

    Example:
        >>> with checkpointed_blocks(model):
        ...     loss, grads = nv.value_and_grad(model, default_loss)(model, batch, lengths)
    """
    blocks = _blocks(model)
    with restoring([m for b in blocks for m in b.modules()]):
        if segment == 1:
            for b in blocks:
                if not is_checkpointed(b):
                    checkpoint_module(b)
        else:
            checkpoint_layers(model, blocks, segment=segment)
        chunk_layers(model, chunks, layers=blocks, routes=_routes(chunks))
        yield blocks


def _routes(chunks: Chunks | None) -> dict[str, Any]:
    """The recurrences nuvec computes in chunks inside the blocks, as ``chunks.scan`` says."""
    if chunks is not None and not isinstance(chunks, Chunks):
        raise TypeError(f"chunks must be an nv.Chunks or None, got {type(chunks).__name__}")
    return recurrences.routes((chunks or Chunks()).scan)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """``model.layers``, checked: the blocks of an mlx-lm model."""
    _validate.check_module(model, "model")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError("model must have its blocks in model.layers (a list, as mlx-lm's models have)")
    return find_layers(model, [_validate.check_module(b, f"model.layers[{i}]") for i, b in enumerate(layers)])


def train(
    model: nn.Module,
    optimizer: optim.Optimizer,
    train_dataset: Any,
    val_dataset: Any = None,
    args: TrainingArgs = TrainingArgs(),  # noqa: B008 - mlx-lm's signature
    loss: Callable = default_loss,
    iterate_batches: Callable = iterate_batches,
    training_callback: TrainingCallback | None = None,
    ahead: int | None = None,
    chunks: Chunks | None = None,
    segment: int | str = 1,
    plan: Plan | None = None,
) -> None:
    """``mlx_lm.tuner.trainer.train``, with nuvec's checkpoints and staged evaluation.

    The same arguments, batches, validation, report lines, callbacks and
    adapter files as mlx-lm's; the step is a :class:`nuvec_mlx.TrainingStep`.
    With ``args.grad_checkpoint`` every block of ``model.layers`` is
    checkpointed for the run and computed along the sequence in chunks
    (:func:`checkpointed_blocks`: attention, the MLP, recurrences, as
    ``chunks`` says), and mlx-lm's default loss is computed with the loss head
    in chunks of tokens (:func:`nuvec_mlx.mlx_lm.chunked_loss`); a loss of your
    own is used as it is. Each report line ends with the highest peak memory of the steps since
    the last report (active memory, weights and optimizer state included, read
    after :func:`mlx.core.synchronize` by :func:`nuvec_mlx.memory.measure`
    without clearing the cache), every rank's when launched distributed; the
    callbacks get this rank's as ``step_peak_memory`` and every rank's as
    ``step_peak_memory_per_rank`` (GB), beside mlx-lm's ``peak_memory``. As
    mlx-lm's, it sets MLX's wired limit on a Mac
    (``mlx_lm.utils.maybe_set_recommended_wired_limit``).

    Args:
        model, optimizer, train_dataset, val_dataset, args, loss,
        iterate_batches, training_callback: as for ``mlx_lm.tuner.trainer.train``.
        ahead: stages queued past the one waited for (:func:`nuvec_mlx.eval`'s
            ``ahead``): 0 for the lowest peak; ``None`` for :func:`nuvec_mlx.default_ahead`.
        chunks: with ``grad_checkpoint``, the chunks along the sequence
            (:class:`nuvec_mlx.Chunks`: the loss head's, with mlx-lm's default
            loss; attention's, the MLP's and the recurrences' inside the blocks);
            ``None`` for ``nv.Chunks()``, every part ``"auto"``.
        segment: with ``grad_checkpoint``, blocks per segment
            (:func:`checkpointed_blocks`): 1 keeps every block's input, more
            (or ``"sqrt"``) only every ``segment``-th, for sequences whose
            blocks' inputs are the wall; unused with ``plan``.
        plan: with ``grad_checkpoint``, a :class:`nuvec_mlx.Plan` (``nuvec-mlx-plan
            --save``, :meth:`nuvec_mlx.Plan.load_json`): the blocks are
            checkpointed as it says (:meth:`nuvec_mlx.Plan.apply`, for the run)
            instead of every block; ``None`` for every block.

    Example:
        >>> from mlx_lm.tuner.trainer import TrainingArgs
        >>> train(model, optim.Adam(1e-5), CacheDataset(train_set),
        ...       args=TrainingArgs(iters=100, grad_checkpoint=True))
    """
    if not isinstance(args, TrainingArgs):
        raise TypeError(f"args must be an mlx_lm.tuner.trainer.TrainingArgs, got {type(args).__name__}")
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be an nv.Plan or None, got {type(plan).__name__}")
    _validate.check_callable(iterate_batches, "iterate_batches")
    if training_callback is not None and not all(
        callable(getattr(training_callback, name, None)) for name in ("on_train_loss_report", "on_val_loss_report")
    ):
        raise TypeError(
            "training_callback must be None or an mlx_lm TrainingCallback (on_train_loss_report, on_val_loss_report), "
            f"got {type(training_callback).__name__}"
        )
    _validate.check_int(args.grad_accumulation_steps, "grad_accumulation_steps", minimum=1)
    chunks = Chunks.of(chunks)
    if args.grad_checkpoint and loss is default_loss:
        loss = loss_for(chunks.head)
    step = TrainingStep(model, loss, optimizer, ahead=ahead, accumulate=args.grad_accumulation_steps)
    maybe_set_recommended_wired_limit()
    blocks = checkpointed_blocks(model, chunks, segment) if plan is None else _planned(model, plan, chunks)
    with blocks if args.grad_checkpoint else contextlib.nullcontext():
        _loop(model, optimizer, train_dataset, val_dataset, args, loss, iterate_batches, training_callback, step)


@contextlib.contextmanager
def _planned(model: nn.Module, plan: Plan, chunks: Chunks) -> Iterator[None]:
    """Inside, the blocks of ``model`` are checkpointed as ``plan`` says, and chunked; after, as before."""
    blocks = _blocks(model)
    with restoring([m for b in blocks for m in b.modules()]):
        plan.apply(model)
        chunk_layers(model, chunks, layers=blocks, routes=_routes(chunks))
        yield


def _loop(model, optimizer, train_dataset, val_dataset, args, loss, iterate_batches, callback, step):
    """mlx-lm's loop (``mlx_lm.tuner.trainer.train``), each step a :class:`nuvec_mlx.TrainingStep`, measured."""
    world = mx.distributed.init()
    rank = world.rank()
    peaks = _report.StepPeaks()
    model.train()
    losses, n_tokens, steps, trained_tokens, train_time = 0, 0, 0, 0, 0.0
    batches = iterate_batches(
        dataset=train_dataset,
        batch_size=args.batch_size,
        max_seq_length=args.max_seq_length,
        loop=True,
        comm_group=world,
    )
    with _report.TrainUI(args.iters, rank=rank) as ui:
        for it, batch in zip(range(1, args.iters + 1), batches):
            tic = time.perf_counter()
            if val_dataset and (it == 1 or it % args.steps_per_eval == 0 or it == args.iters):
                _validate_model(model, val_dataset, args, loss, iterate_batches, callback, ui, it)
                tic = time.perf_counter()
            with peaks.step():
                value, tokens = step(*batch)
            losses += value
            n_tokens += tokens
            steps += 1
            if mx.get_cache_memory() > args.clear_cache_threshold:
                mx.clear_cache()
            train_time += time.perf_counter() - tic
            ui.advance()

            if it % args.steps_per_report == 0 or it == args.iters:
                train_loss = mx.distributed.all_sum(losses, stream=mx.cpu).item() / (steps * world.size())
                n_tokens = mx.distributed.all_sum(n_tokens, stream=mx.cpu).item()
                tokens_sec = float(n_tokens) / train_time
                trained_tokens += n_tokens
                process_peak, step_peaks = peaks.report(world)  # every rank reports here: a collective
                ui.report_train(it, train_loss, tokens_sec, trained_tokens, step_peaks)
                if callback is not None:
                    callback.on_train_loss_report(
                        {
                            "iteration": it,
                            "train_loss": train_loss,
                            "learning_rate": optimizer.learning_rate.item(),
                            "iterations_per_second": args.steps_per_report / train_time,
                            "tokens_per_second": tokens_sec,
                            "trained_tokens": trained_tokens,
                            "peak_memory": process_peak / 1e9,
                            "step_peak_memory": step_peaks[rank] / 1e9,
                            "step_peak_memory_per_rank": [p / 1e9 for p in step_peaks],
                        }
                    )
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
        val_loss = evaluate(
            model=model,
            dataset=val_dataset,
            loss=loss,
            batch_size=args.batch_size,
            num_batches=args.val_batches,
            max_seq_length=args.max_seq_length,
            iterate_batches=iterate_batches,
            progress_callback=advance,
        )
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
