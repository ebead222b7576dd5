"""One fine-tuning step of an mlx-lm model, as each strategy runs it.

The strategies, each the step a user's trainer runs:

- ``none``: mlx-lm's trainer without checkpointing (``mlx_lm.tuner.trainer.train``:
  :func:`mlx.nn.value_and_grad`, :func:`mlx.core.compile` with the model's,
  the optimizer's and the random state, one :func:`mlx.core.eval`);
- ``mlx-lm``: the same with ``--grad-checkpoint``: mlx-lm's ``grad_checkpoint``
  on ``model.layers[0]`` (:func:`mlx.core.checkpoint` on every instance of that
  one class);
- ``nuvec``: ``nuvec-mlx-lora --grad-checkpoint``: every block checkpointed by
  nuvec, the step of :func:`nuvec_mlx.mlx_lm.training_step`, :func:`nuvec_mlx.eval`
  at nuvec_mlx's default budget (or the one in force), the trainer's stages
  ahead (:func:`nuvec_mlx.mlx_lm.default_ahead`: 1 on a GPU, 0 on the CPU);
- ``nuvec-inf``: the same, ``nv.eval`` at budget ``math.inf``: no throttle within
  the stages (on a GPU, nuvec_mlx's default; on a CPU the default throttles at 1 MiB);
- ``nuvec-ahead0``, ``nuvec-ahead1``, ``nuvec-ahead2``: ``nuvec`` with that many
  stages queued ahead (``nv.eval(..., ahead=n)``): 0 waits for each stage before
  the host builds the next, more let the device run while the host builds;
- ``nuvec-mx-eval``: nuvec's checkpoint on every block inside mlx-lm's own trainer
  step (``mx.compile``, ``mx.eval``): what ``nv.checkpoint_layers(model)`` before
  ``mlx_lm.tuner.trainer.train`` gives, unstaged.

The modes are mlx-lm's: ``full`` (every block trained), ``lora`` (LoRA on every
block's linear layers) and ``qlora`` (LoRA on a 4-bit quantized base).
mlx-lm's ``grad_checkpoint`` replaces the class's ``__call__`` for good; here
it is in place only while its steps run, so that the other strategies' models
(the same classes) stay unchecked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.nn.utils import average_gradients
from mlx.utils import tree_flatten
from mlx_lm.tuner.trainer import default_loss, grad_checkpoint
from mlx_lm.tuner.utils import linear_to_lora_layers

import nuvec_mlx as nv
from nuvec_mlx import mlx_lm as nv_mlx_lm
from nuvec_mlx_bench import architectures

#: The strategies that set nv.eval's ahead, and to what.
AHEAD = {"nuvec-ahead0": 0, "nuvec-ahead1": 1, "nuvec-ahead2": 2}
STRATEGIES = ("none", "mlx-lm", "nuvec", "nuvec-inf", *AHEAD, "nuvec-mx-eval")
#: The strategies that checkpoint with nuvec, and those of them that run nuvec's step and nv.eval.
STAGED = ("nuvec", "nuvec-inf", *AHEAD)
NUVEC = (*STAGED, "nuvec-mx-eval")
MODES = ("full", "lora", "qlora")


@dataclasses.dataclass(frozen=True)
class TrainWorkload:
    """An mlx-lm architecture at one size, fine-tuned one way.

    Attributes:
        arch: one of :data:`nuvec_mlx_bench.architectures.ARCHITECTURES`.
        hidden, layers, vocab: the model's width, depth and vocabulary.
        batch, seq: the batch: ``batch`` sequences of ``seq`` tokens (mlx-lm's
            batches hold one more, the last token's target).
        dtype: the weights' dtype.
        mode: one of :data:`MODES`.
        lora_rank, lora_dropout: LoRA's rank and dropout (mlx-lm's scale, 20).

    Raises:
        TypeError, ValueError: naming the field that is not of its kind or range.
    """

    arch: str
    hidden: int
    layers: int
    batch: int
    seq: int
    dtype: str = "bfloat16"
    mode: str = "lora"
    vocab: int = 32000
    lora_rank: int = 8
    lora_dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("batch", "seq", "lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.dtype not in architectures.DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(architectures.DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        architectures.config(self.arch, self.hidden, self.layers, self.vocab)  # raises for a bad size

    def label(self) -> str:
        """The workload as a short heading."""
        dropout = f", dropout {self.lora_dropout:g}" if self.mode != "full" and self.lora_dropout else ""
        return (f"{self.arch} {self.mode}{dropout} H={self.hidden} L={self.layers} "
                f"B={self.batch} T={self.seq} {self.dtype}")


def _nbytes(tree: Any) -> int:
    return sum(a.nbytes for _, a in tree_flatten(tree) if isinstance(a, mx.array))


class Case:
    """One strategy's model and optimizer, and its training step at any sequence length.

    Example:
        >>> case = Case(TrainWorkload("llama", 128, 4, batch=2, seq=256), "nuvec")
        >>> case.evaluate(case.step(case.batch(256)))
    """

    def __init__(self, w: TrainWorkload, strategy: str):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        self.workload, self.strategy = w, strategy
        config = architectures.config(w.arch, w.hidden, w.layers, w.vocab)
        self.model, _ = architectures.build(config, w.dtype, quantized=w.mode == "qlora")
        self.model.freeze()  # as mlx_lm.lora's train_model, with --num-layers -1
        if w.mode == "full":
            for layer in self.model.layers:
                layer.unfreeze()
        else:
            linear_to_lora_layers(self.model, len(self.model.layers),
                                  {"rank": w.lora_rank, "dropout": w.lora_dropout, "scale": 20.0})
        self.model.train()
        self.optimizer = optim.Adam(learning_rate=1e-5)  # mlx_lm.lora's defaults
        self.optimizer.init(self.model.trainable_parameters())
        if strategy in STAGED:
            self._step, self.state = nv_mlx_lm.training_step(self.model, self.optimizer)
        else:
            self.state = [self.model.state, self.optimizer.state, mx.random.state]
            self._step = _mlx_lm_step(self.model, self.optimizer, self.state)
        mx.eval(self.state)

    def batch(self, seq: int) -> tuple[mx.array, mx.array]:
        """mlx-lm's batch of ``seq`` tokens per sequence: tokens and (offset, length) pairs."""
        w = self.workload
        tokens = mx.random.randint(0, w.vocab, (w.batch, seq + 1), key=mx.random.key(seq))
        return tokens, mx.array([[0, seq + 1]] * w.batch)

    def step(self, batch: tuple[mx.array, mx.array]) -> tuple[mx.array, mx.array]:
        """Dispatch one training step (its strategy's checkpoints in place while it is traced)."""
        with checkpointing(self.strategy, self.model):
            if self.strategy in STAGED:
                return self._step(batch, None, True)[:2]
            return self._step(batch)

    def evaluate(self, outputs: Any) -> None:
        """Evaluate a step as its trainer does: ``nv.eval`` for nuvec, ``mx.eval`` for mlx-lm's."""
        if self.strategy in STAGED:
            budget = math.inf if self.strategy == "nuvec-inf" else None
            ahead = AHEAD.get(self.strategy, nv_mlx_lm.default_ahead())
            nv.eval(self.state, outputs, budget=budget, ahead=ahead)
        else:
            mx.eval(self.state, outputs)

    def resident(self) -> int:
        """Bytes this case holds between steps: the model's parameters and the optimizer's state."""
        return _nbytes(self.model.parameters()) + _nbytes(self.optimizer.state)


@contextlib.contextmanager
def checkpointing(strategy: str, model: nn.Module) -> Iterator[None]:
    """The strategy's checkpoints on ``model``'s blocks inside, and none after.

    ``mlx-lm``: mlx-lm's ``grad_checkpoint`` on ``model.layers[0]`` (its class's
    ``__call__`` put back after); the nuvec strategies: nuvec's on every block (:func:`nuvec_mlx.mlx_lm.checkpointed_blocks`); ``none``: nothing.

    Example:
        >>> with checkpointing("mlx-lm", model):
        ...     grads = step(batch)
    """
    if strategy in NUVEC:
        with nv_mlx_lm.checkpointed_blocks(model):
            yield
    elif strategy == "mlx-lm":
        cls = type(model.layers[0])
        held = cls.__dict__["__call__"]
        grad_checkpoint(model.layers[0])
        try:
            yield
        finally:
            cls.__call__ = held
    else:
        yield


def _mlx_lm_step(model: nn.Module, optimizer: optim.Optimizer, state: list) -> Any:
    """The step of ``mlx_lm.tuner.trainer.train`` (no gradient accumulation)."""
    loss_value_and_grad = nn.value_and_grad(model, default_loss)

    @partial(mx.compile, inputs=state, outputs=state)
    def step(batch):
        (value, tokens), grad = loss_value_and_grad(model, *batch)
        optimizer.update(model, average_gradients(grad))
        return value, tokens

    return step
