"""mlx-lm's trainer with nuvec's checkpoints: :func:`train`, and the ``nuvec-mlx-lora`` command (:func:`main`).

:func:`train` is mlx-lm's training loop (mlx-lm 0.32: the same batches,
validation, reports, callbacks and adapter files) with three changes:

- ``grad_checkpoint`` puts nuvec's checkpoint on every block of
  ``model.layers``, each instance whatever its class, for the run (mlx-lm
  replaces ``type(model.layers[0]).__call__`` with :func:`mlx.core.checkpoint`:
  one class, so hybrid models keep their other blocks unchecked; and its
  recomputation draws new dropout masks);
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

try:
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.trainer import TrainingArgs, default_loss, evaluate, iterate_batches
    from mlx_lm.utils import maybe_set_recommended_wired_limit
except ImportError as e:  # pragma: no cover - the extra is installed where this runs
    raise ImportError('nuvec_mlx.mlx_lm needs mlx-lm: pip install "nuvec-mlx[mlx-lm]"') from e

from .. import _attention, _pytree, _registry, _validate
from ..evaluate import default_ahead
from ..nn import checkpoint_module, is_checkpointed, restoring
from ..planner import Plan
from ..step import TrainingStep
from . import _report
from .losses import loss_for

__all__ = ["checkpointed_blocks", "default_ahead", "train", "training_step"]


def training_step(
    model: nn.Module, optimizer: optim.Optimizer, loss: Callable = default_loss, grad_accumulation_steps: int = 1
) -> tuple[Callable, list]:
    """Deprecated: use :class:`nuvec_mlx.TrainingStep` (``TrainingStep(model, loss, optimizer, accumulate=n)``).

    mlx-lm's training step as a compiled function of ``(batch, prev_grad,
    do_update)`` returning ``(loss, tokens, grad)`` unevaluated, and the state
    it updates: evaluate its results with ``nv.eval(state, loss, tokens, grad)``.

    Example:
        >>> step, state = training_step(model, optimizer)
        >>> loss, tokens, _ = step(batch, None, True)
        >>> nv.eval(state, loss, tokens)
    """
    _validate.deprecated("nuvec_mlx.mlx_lm.training_step", "nuvec_mlx.TrainingStep(model, loss, optimizer)")
    _validate.check_optimizer(optimizer, "optimizer")
    training = TrainingStep(model, loss, optimizer, accumulate=grad_accumulation_steps)
    traced = training._trace()

    def step(batch: tuple, prev_grad: Any, do_update: bool) -> tuple[mx.array, mx.array, Any]:
        ((value, tokens), grad), stages = traced(tuple(batch), {}, prev_grad, do_update)
        _registry.hand_on(
            [a for _, a in _pytree.flatten([value, tokens, grad, training.state]) if isinstance(a, mx.array)], stages
        )
        return value, tokens, grad

    return step, training.state


#: The names mlx-lm's blocks give their feed-forward module (MLP, or mixture of experts), which treats tokens
#: independently: what ``mlp_chunk`` checkpoints in chunks.
FEED_FORWARD = ("mlp", "feed_forward", "block_sparse_moe")


def feed_forward(block: nn.Module) -> nn.Module | None:
    """``block``'s feed-forward module (its child named as in :data:`FEED_FORWARD`), or ``None``."""
    _validate.check_module(block, "block")
    return next((c for name in FEED_FORWARD if isinstance(c := block.get(name), nn.Module)), None)


@contextlib.contextmanager
def checkpointed_blocks(
    model: nn.Module, attention_chunk: int | str | None = "auto", mlp_chunk: int | None = None
) -> Iterator[list[nn.Module]]:
    """Checkpoint every block of ``model.layers`` inside, whatever its class; undone after.

    Blocks already checkpointed stay so.

    Args:
        model: an mlx-lm model (its repeated blocks are ``model.layers``).
        attention_chunk: attention's query chunks (:func:`nuvec_mlx.checkpoint_module`).
        mlp_chunk: ``None``, or the tokens per chunk of each checkpointed
            block's feed-forward module (:func:`feed_forward`), checkpointed in
            chunks inside it (:func:`nuvec_mlx.checkpoint_module`'s ``chunk``):
            the block's backward pass then holds one chunk of the MLP's
            intermediates; blocks without one are left whole.

    Yields:
        The blocks checkpointed here.

    Example:
        >>> with checkpointed_blocks(model):
        ...     loss, grads = nv.value_and_grad(model, default_loss)(model, batch, lengths)
    """
    _validate.check_module(model, "model")
    if mlp_chunk is not None:
        _validate.check_int(mlp_chunk, "mlp_chunk", minimum=1)
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError("model must have its blocks in model.layers (a list, as mlx-lm's models have)")
    blocks = [b for i, b in enumerate(layers) if not is_checkpointed(_validate.check_module(b, f"model.layers[{i}]"))]
    mlps = [m for b in blocks if mlp_chunk is not None and (m := feed_forward(b)) is not None]
    with restoring(blocks + mlps):
        for b in blocks:
            checkpoint_module(b, attention_chunk=attention_chunk)
        for m in mlps:
            checkpoint_module(m, chunk=mlp_chunk)
        yield blocks


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
    attention_chunk: int | str | None = "auto",
    loss_chunk: int | str | None = "auto",
    mlp_chunk: int | None = None,
    plan: Plan | None = None,
) -> None:
    """``mlx_lm.tuner.trainer.train``, with nuvec's checkpoints and staged evaluation.

    The same arguments, batches, validation, report lines, callbacks and
    adapter files as mlx-lm's; the step is a :class:`nuvec_mlx.TrainingStep`.
    With ``args.grad_checkpoint`` every block of ``model.layers`` is
    checkpointed for the run (:func:`checkpointed_blocks`), attention inside
    them in query chunks where the backend trains it unfused, and mlx-lm's
    default loss is computed with the loss head in chunks of tokens
    (:func:`nuvec_mlx.mlx_lm.chunked_loss`); a loss of your own is used as it
    is. Each report line ends with the highest peak memory of the steps since
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
            ``ahead``): 0 for the lowest peak; ``None`` for :func:`default_ahead`.
        attention_chunk: with ``grad_checkpoint``, attention's query chunks
            (:func:`nuvec_mlx.checkpoint_module`): ``"auto"``, a size, or ``None``.
        loss_chunk: with ``grad_checkpoint`` and mlx-lm's default loss, the
            loss head's tokens per chunk (:func:`nuvec_mlx.mlx_lm.chunked_loss`):
            ``"auto"``, a size, or ``None`` for mlx-lm's unchunked loss.
        mlp_chunk: with ``grad_checkpoint``, ``None`` or the tokens per chunk
            of each block's MLP inside the checkpointed block
            (:func:`checkpointed_blocks`); unused with ``plan``.
        plan: with ``grad_checkpoint``, a :class:`nuvec_mlx.Plan` (``nuvec-mlx-plan
            --save``, :meth:`nuvec_mlx.Plan.load_json`): the blocks are
            checkpointed as it says (:meth:`nuvec_mlx.Plan.apply`, for the run)
            instead of every block, ``attention_chunk`` then unused; ``None``
            for every block.

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
    if args.grad_checkpoint and loss is default_loss:
        loss = loss_for(_chunk(loss_chunk, "loss_chunk"))
    step = TrainingStep(model, loss, optimizer, ahead=ahead, accumulate=args.grad_accumulation_steps)
    maybe_set_recommended_wired_limit()
    blocks = (
        checkpointed_blocks(model, _chunk(attention_chunk, "attention_chunk"), _size(mlp_chunk, "mlp_chunk"))
        if plan is None
        else _planned(model, plan)
    )
    with blocks if args.grad_checkpoint else contextlib.nullcontext():
        _loop(model, optimizer, train_dataset, val_dataset, args, loss, iterate_batches, training_callback, step)


@contextlib.contextmanager
def _planned(model: nn.Module, plan: Plan) -> Iterator[None]:
    """Inside, the blocks of ``model`` are checkpointed as ``plan`` says; after, as before."""
    with restoring(list(model.layers)):
        plan.apply(model)
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
    weights = dict(_pytree.flatten(model.trainable_parameters()))
    mx.save_safetensors(str(adapter_file), weights)
    if it is None:
        return Path(adapter_file)
    numbered = Path(adapter_file).parent / f"{it:07d}_adapters.safetensors"
    mx.save_safetensors(str(numbered), weights)
    return numbered


def _off(setting: object) -> bool:
    """Whether a chunk setting turns chunks off: ``None``, or 0 (as on the command line)."""
    return setting is None or (setting == 0 and not isinstance(setting, bool))


def _size(setting: object, name: str) -> int | None:
    """A chunk size with no ``"auto"``: ``None`` (0 too: off) or an int >= 1."""
    return None if _off(setting) else _validate.check_int(setting, name, minimum=1)


def _chunk(setting: object, name: str) -> int | str | None:
    """A chunk setting: ``"auto"``, ``None`` (0 too: off) or a size."""
    return None if _off(setting) else _attention.check(setting, name)
