"""One fine-tuning step of an mlx-lm model, as each strategy runs it.

The strategies, each the step a user's trainer runs:

- ``none``: mlx-lm's trainer without checkpointing (``mlx_lm.tuner.trainer.train``:
  :func:`mlx.nn.value_and_grad` of ``default_loss``, :func:`mlx.core.compile`
  with the model's, the optimizer's and the random state, one :func:`mlx.core.eval`);
- ``mlx-lm``: the same with ``--grad-checkpoint``: mlx-lm's ``grad_checkpoint``
  on ``model.layers[0]`` (:func:`mlx.core.checkpoint` on every instance of that
  one class);
- ``nuvec``: ``nuvec-mlx-lora --grad-checkpoint``: every block checkpointed by
  nuvec and chunked along the sequence as ``nv.Chunks()`` says (every part
  ``"auto"``: :func:`nuvec_mlx.chunk_layers`), the loss head in chunks of tokens
  (:func:`nuvec_mlx.mlx_lm.chunked_loss`), the step a
  :class:`nuvec_mlx.TrainingStep` at its defaults (the device's stages ahead:
  :func:`nuvec_mlx.default_ahead`, 1 on a GPU, 0 on the CPU; the throttle in force);
- ``nuvec-unchunked``: the same without chunks (every part of ``nv.Chunks``
  ``None``, mlx-lm's ``default_loss``): what ``nuvec-mlx-lora`` ran before the chunks;
- ``nuvec-mlp-chunks``: ``nuvec`` with each block's MLP in chunks of
  :data:`MLP_CHUNK` tokens inside the checkpointed block (``nuvec-mlx-lora
  --mlp-chunk``), so that a block's backward pass holds one chunk of it;
- ``nuvec-ahead0``, ``nuvec-ahead2``: ``nuvec`` with that many stages queued
  ahead (``TrainingStep(..., ahead=n)``): 0 waits for each stage before the host
  builds the next, more let the device run while the host builds;
- ``nuvec-mx-eval``: nuvec's checkpoint on every block
  inside mlx-lm's own trainer step (``mx.compile``, ``mx.eval``, ``default_loss``):
  what ``nv.checkpoint_layers(model)`` before ``mlx_lm.tuner.trainer.train``
  gives, unstaged.

The modes are mlx-lm's: ``full`` (every block trained), ``lora`` (LoRA on every
block's linear layers) and ``qlora`` (LoRA on a 4-bit quantized base).
mlx-lm's ``grad_checkpoint`` replaces the class's ``__call__`` for good; here
it is in place only while its steps run, so that the other strategies' models
(the same classes) stay unchecked. nuvec's checkpoints are per instance and
set once, for the case's life (a :class:`nuvec_mlx.TrainingStep` traces again
whenever any module's checkpointing changes).

Each case times its steps in two parts (:class:`~nuvec_mlx_bench.core.rounds.Parts`):
the host's ``dispatch`` (the compiled step's call: building and dispatching
it) and the ``evaluation``; a :class:`nuvec_mlx.TrainingStep` reports both
(``dispatch_seconds``, ``evaluation_seconds``), mlx-lm's step is timed around
its call and its ``mx.eval``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.nn.utils import average_gradients
from mlx.utils import tree_flatten
from mlx_lm.tuner.trainer import default_loss
from mlx_lm.tuner.utils import linear_to_lora_layers

import nuvec_mlx as nv
from nuvec_mlx.mlx_lm.losses import loss_for

from .. import testing
from ..core import mlx_measure, rounds


@dataclasses.dataclass(frozen=True)
class NuvecStep:
    """How a nuvec strategy steps: its chunks along the sequence (the loss head's with mlx-lm's default loss;
    attention's, the MLP's and the recurrences' inside the checkpointed blocks), and the stages ahead."""

    chunks: nv.Chunks
    ahead: int | None = None

    @property
    def loss(self) -> Callable[..., tuple[mx.array, mx.array]]:
        """mlx-lm's default loss, its head in chunks as :attr:`chunks` says (what ``nuvec_mlx.mlx_lm.train`` uses)."""
        return loss_for(self.chunks.head)


#: The tokens per chunk of ``nuvec-mlp-chunks``' MLPs: 4 chunks of a 2048-token sequence.
MLP_CHUNK = 512
UNCHUNKED = nv.Chunks(head=None, attention=None, mlp=None, scan=None, projections=None)


#: The strategies that run a :class:`nuvec_mlx.TrainingStep`, and how.
NUVEC_STEPS = {
    "nuvec": NuvecStep(nv.Chunks()),
    "nuvec-unchunked": NuvecStep(UNCHUNKED),
    "nuvec-mlp-chunks": NuvecStep(nv.Chunks(mlp=MLP_CHUNK)),
    "nuvec-ahead0": NuvecStep(nv.Chunks(), ahead=0),
    "nuvec-ahead2": NuvecStep(nv.Chunks(), ahead=2),
}
STRATEGIES = ("none", "mlx-lm", *NUVEC_STEPS, "nuvec-mx-eval")
#: A step that builds the whole logits is not run at this many elements or more: on MLX 0.32.4's CUDA
#: backend it ended the process (integer divide-by-zero in libmlx, a 32-bit index; Gemma-3-1B at batch 4 x
#: 4096 tokens, ``benchmarks/results/h200/2026-12-05-train/``), which no ``except`` can catch. Not tried on
#: other backends, where such a step (16 GiB of float32 logits) is out of a benchmark's reach anyway.
LOGITS_LIMIT = 2**32
MODES = ("full", "lora", "qlora")
#: The vocabulary of an architecture scaled by :func:`nuvec_mlx_bench.testing.mlx_lm_config` unless told.
VOCAB = 32000


@dataclasses.dataclass(frozen=True)
class TrainWorkload:
    """An mlx-lm model, fine-tuned one way on one batch size.

    Attributes:
        model: a public configuration (a key of :data:`nuvec_mlx_bench.testing.PUBLIC_CONFIGS`,
            ``"qwen3-0.6b"``), or an architecture (one of
            :data:`nuvec_mlx_bench.testing.ARCHITECTURES`, ``"llama"``) scaled to
            ``hidden``, ``layers`` and ``vocab``.
        batch, seq: the batch: ``batch`` sequences of ``seq`` tokens (mlx-lm's
            batches hold one more, the last token's target).
        hidden, vocab: an architecture's width and vocabulary (``None`` for a
            public configuration, which has its own; an architecture's vocabulary
            defaults to :data:`VOCAB`).
        layers: the depth: an architecture's (required), or fewer layers than a
            public configuration's (``None`` for all of them).
        dtype: the weights' dtype.
        mode: one of :data:`MODES`.
        lora_rank, lora_dropout: LoRA's rank and dropout (mlx-lm's scale, 20).

    Raises:
        TypeError, ValueError: naming the field that is not of its kind or range.

    Example:
        >>> TrainWorkload("qwen3-0.6b", batch=4, seq=2048, layers=4).config()["vocab_size"]
        151936
    """

    model: str
    batch: int
    seq: int
    hidden: int | None = None
    layers: int | None = None
    vocab: int | None = None
    dtype: str = "bfloat16"
    mode: str = "lora"
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
        if self.dtype not in testing.DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(testing.DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        public = self.model in testing.PUBLIC_CONFIGS
        if public and (self.hidden is not None or self.vocab is not None):
            raise ValueError(f"hidden and vocab must be None for {self.model}, a public configuration with its own")
        if not public and self.model not in testing.ARCHITECTURES:
            raise ValueError(
                f"model must be one of {', '.join(testing.PUBLIC_CONFIGS)} (public configurations) or "
                f"{', '.join(testing.ARCHITECTURES)} (architectures), got {self.model!r}"
            )
        if not public and (self.hidden is None or self.layers is None):
            raise ValueError(f"hidden and layers must be given for the architecture {self.model}")
        self.config()  # raises for a size the model cannot take

    @property
    def public(self) -> bool:
        """Whether :attr:`model` is a public configuration."""
        return self.model in testing.PUBLIC_CONFIGS

    def config(self) -> dict[str, Any]:
        """The mlx-lm config (:func:`.testing.public_config` or :func:`.testing.mlx_lm_config`)."""
        if self.public:
            return testing.public_config(self.model, self.layers)
        assert self.hidden is not None and self.layers is not None
        return testing.mlx_lm_config(self.model, self.hidden, self.layers, self.vocab or VOCAB)

    def label(self) -> str:
        """The workload as a short heading."""
        c = self.config()
        dropout = f", dropout {self.lora_dropout:g}" if self.mode != "full" and self.lora_dropout else ""
        size = "" if self.public else f" H={c['hidden_size']} V={c['vocab_size']}"
        shape = f"L={c['num_hidden_layers']} B={self.batch} T={self.seq}"
        return f"{self.model} {self.mode}{dropout}{size} {shape} {self.dtype}"


def add_size_arguments(p: argparse.ArgumentParser, batch: int, seq: int) -> None:
    """A :class:`TrainWorkload`'s sizes as a probe's flags: ``--hidden``, ``--vocab``, ``--layers`` (``None``
    unless given), ``--batch`` and ``--seq`` (``batch`` and ``seq`` unless given)."""
    p.add_argument("--hidden", type=int, help="an architecture's width (not for a public configuration)")
    p.add_argument("--vocab", type=int, help="an architecture's vocabulary (not for a public configuration)")
    p.add_argument("--layers", type=int, help="an architecture's depth, or fewer layers than a configuration's")
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq", type=int, default=seq)


def _nbytes(tree: Any) -> int:
    return sum(a.nbytes for _, a in tree_flatten(tree) if isinstance(a, mx.array))


class Case:
    """One strategy's model and optimizer, and its training step at any sequence length.

    :meth:`step` dispatches a step and :meth:`evaluate` evaluates it (a
    :class:`nuvec_mlx.TrainingStep` does both in its call, and its evaluation
    has nothing left to do); :meth:`timed` is the pair with each call's
    dispatch and evaluation added to :attr:`parts`. A nuvec strategy steps as
    :data:`NUVEC_STEPS` says, or as ``how`` says where given (a probe's own chunks).

    Example:
        >>> case = Case(TrainWorkload("llama", batch=2, seq=256, hidden=128, layers=4), "nuvec")
        >>> case.evaluate(case.step(case.batch(256)))
    """

    def __init__(self, w: TrainWorkload, strategy: str, how: NuvecStep | None = None):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if how is not None and strategy not in NUVEC_STEPS:
            raise ValueError(f"how is a nuvec strategy's setting, not {strategy!r}'s")
        self.workload, self.strategy = w, strategy
        self.how = how or NUVEC_STEPS.get(strategy)
        self.model, config = testing.mlx_lm_model(w.config(), w.dtype, quantized=w.mode == "qlora")
        self.vocab = config["vocab_size"]
        # Every case draws its LoRA adapters, and its steps their dropout masks, from the same key: the
        # strategies then take the very same step (the weights are seeded apart, by mlx_lm_model).
        mx.random.seed(0)
        self.model.freeze()  # as mlx_lm.lora's train_model, with --num-layers -1
        if w.mode == "full":
            for layer in self.model.layers:
                layer.unfreeze()
        else:
            linear_to_lora_layers(
                self.model, len(self.model.layers), {"rank": w.lora_rank, "dropout": w.lora_dropout, "scale": 20.0}
            )
        self.model.train()
        self.optimizer = optim.Adam(learning_rate=1e-5)  # mlx_lm.lora's defaults
        self.optimizer.init(self.model.trainable_parameters())
        self.parts = rounds.Parts()
        self.training: nv.TrainingStep | None = None
        if self.how is not None:
            nv.checkpoint_layers(self.model)  # as nuvec_mlx.mlx_lm.train's checkpointed_blocks, for good
            nv.chunk_layers(self.model, self.how.chunks)
            self.training = nv.TrainingStep(self.model, self.how.loss, self.optimizer, ahead=self.how.ahead)
            self.state = self.training.state
        else:
            if strategy == "nuvec-mx-eval":
                nv.checkpoint_layers(self.model)
            self.state = [self.model.state, self.optimizer.state, mx.random.state]
            self._step = _mlx_lm_step(self.model, self.optimizer, self.state)
        mx.eval(self.state)

    def batch(self, seq: int) -> tuple[mx.array, mx.array]:
        """mlx-lm's batch of ``seq`` tokens per sequence (:func:`.testing.mlx_lm_batch`, seeded by ``seq``)."""
        return testing.mlx_lm_batch(self.vocab, self.workload.batch, seq, seed=seq)

    def step(self, batch: tuple[mx.array, mx.array]) -> Any:
        """One training step: dispatched (mlx-lm's), or run and evaluated (a :class:`nuvec_mlx.TrainingStep`).

        Returns ``(loss, tokens)``, and :meth:`evaluate` finishes them.
        """
        if self.training is not None:
            return self.training(*batch)
        with self._checkpointing(), warnings.catch_warnings():
            # nuvec-mx-eval evaluates nuvec's checkpoints unstaged on purpose: that is what it measures.
            warnings.simplefilter("ignore", nv.NotStagedWarning)
            return self._step(batch)

    def evaluate(self, outputs: Any) -> None:
        """Evaluate a step as its trainer does: mlx-lm's with ``mx.eval`` of the state and outputs; a
        :class:`nuvec_mlx.TrainingStep` evaluated its own."""
        if self.training is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", nv.NotStagedWarning)
                mx.eval(self.state, outputs)

    def timed(self, batch: tuple[mx.array, mx.array]) -> tuple[rounds.Step, Callable[[Any], None]]:
        """``(step, evaluate)`` of ``batch`` for :func:`~nuvec_mlx_bench.core.mlx_measure.run_cases`, each
        call's dispatch and evaluation seconds added to :attr:`parts`."""
        if self.training is None:
            return mlx_measure.split(lambda: self.step(batch), self.evaluate, self.parts)
        training = self.training

        def step() -> Any:
            outputs = self.step(batch)
            self.parts.add(dispatch=training.dispatch_seconds, evaluation=training.evaluation_seconds)
            return outputs

        return step, self.evaluate

    def runs_at(self, seq: int) -> bool:
        """Whether a step of ``seq`` tokens is run: not where it would build whole logits of
        :data:`LOGITS_LIMIT` elements or more (nuvec's chunked head never builds them)."""
        whole = self.how is None or self.how.chunks.head is None
        return not whole or self.workload.batch * seq * self.vocab < LOGITS_LIMIT

    def resident(self) -> int:
        """Bytes this case holds between steps: the model's parameters and the optimizer's state."""
        return _nbytes(self.model.parameters()) + _nbytes(self.optimizer.state)

    def _checkpointing(self) -> contextlib.AbstractContextManager[None]:
        return testing.mlx_lm_checkpoint(self.model) if self.strategy == "mlx-lm" else contextlib.nullcontext()


def _mlx_lm_step(model: nn.Module, optimizer: optim.Optimizer, state: list) -> Callable[..., Any]:
    """The step of ``mlx_lm.tuner.trainer.train`` (no gradient accumulation)."""
    loss_value_and_grad = nn.value_and_grad(model, default_loss)

    @partial(mx.compile, inputs=state, outputs=state)
    def step(batch):
        (value, tokens), grad = loss_value_and_grad(model, *batch)
        optimizer.update(model, average_gradients(grad))
        return value, tokens

    return step
