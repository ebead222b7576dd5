"""The plan sweep's models, and a step of one with its blocks set up as a plan or a fixed rule says.

Every case of the sweep is a :class:`nuvec_mlx.TrainingStep` of a model of its
own, the *twin* of the planned model (:func:`twin`: the same structure holding
the very same parameter arrays, so that without an optimizer the cases share
their weights and take no memory of their own). A step traces again whenever
any module's checkpointing changes, so cases that shared one model and set
their blocks up before each call would trace at every call of a round-robin;
twins are set up once. With an optimizer each twin's update writes its own
weights, and each case holds a model and the optimizer's state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

import nuvec_mlx as nv

from .. import testing
from ..seed.strategies import module
from ..seed.workload import Workload

#: The step's optimizer, by ``--optimizer``: none (the step returns the loss and gradients), or Adam
#: (mlx-lm's default) updating the model through :class:`nuvec_mlx.TrainingStep` (:func:`nuvec_mlx.update`).
OPTIMIZERS: dict[str, Callable[[], optim.Optimizer | None]] = {"none": lambda: None, "adam": lambda: optim.Adam(1e-5)}
#: The fixed rules a plan's time is set against (the fastest of those within its budget).
RULES = ("every block", "every 2nd", "sqrt(n) segments")
#: Every fixed rule a case can take: :data:`RULES`, every block with ``save_matmuls``, none.
ALL_RULES = (*RULES, "every block, save_matmuls", "none")
#: The Llama's vocabulary.
LLAMA_VOCAB = 4096


@dataclasses.dataclass
class Built:
    """A model of the sweep, its loss, its batch, and how to make an unevaluated model of its structure."""

    model: nn.Module
    loss: Callable[..., mx.array]
    batch: mx.array
    make: Callable[[], nn.Module]


def llama_config(hidden: int, layers: int) -> dict[str, Any]:
    """The sweep's mlx-lm Llama: heads of 128 (4 at least), a key-value head per 4 (2 at least), MLP 4x."""
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 4 * hidden,
        "num_attention_heads": max(4, hidden // 128),
        "num_key_value_heads": max(2, hidden // 512),
        "rms_norm_eps": 1e-5,
        "vocab_size": LLAMA_VOCAB,
    }


def next_token_loss(model: nn.Module, tokens: mx.array) -> mx.array:
    """The mean cross-entropy of each next token."""
    return nn.losses.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).mean()


def build(name: str, shape: dict[str, int]) -> Built:
    """A model of the sweep (``mlp``, ``transformer``: the seed workloads as modules; ``llama``: an mlx-lm
    Llama with random float32 weights), its loss and its batch.

    Example:
        >>> built = build("mlp", dict(batch=8, dim=16, blocks=5))
    """
    if name == "llama":
        config = llama_config(shape["hidden"], shape["layers"])
        model, _ = testing.mlx_lm_model(config, "float32")
        tokens, _ = testing.mlx_lm_batch(LLAMA_VOCAB, shape["batch"], shape["seq"], seed=1)
        mx.eval(tokens)
        arch = type(model)
        return Built(model, next_token_loss, tokens, lambda: arch(model.args))
    w = Workload(name, **shape)
    model, x = module(w)
    shapes = [[s for s, _ in w.weight_shapes(i)] for i in range(w.blocks)]
    return Built(
        model, testing.blocks_loss, x, lambda: testing.Blocks(name, [[mx.zeros(s) for s in b] for b in shapes])
    )


def twin(built: Built) -> nn.Module:
    """A model of ``built``'s structure holding ``built.model``'s parameter arrays (none copied).

    Example:
        >>> other = twin(built)
        >>> other.layers[0].up.weight is built.model.layers[0].up.weight
        True
    """
    made = built.make()
    made.update(built.model.parameters())  # the made model's own arrays are dropped unevaluated
    return made


class Segment(nn.Module):
    """Blocks run in turn as one (what ``checkpoint_sequential`` checkpoints together)."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = layers

    def __getattr__(self, key: str) -> Any:
        """What a model reads off a layer (mlx-lm's Llama: ``use_sliding``) is the first block's."""
        try:
            return super().__getattr__(key)
        except AttributeError:
            if key == "layers":
                raise
            return getattr(self.layers[0], key)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        for layer in self.layers:
            x = layer(x, *args, **kwargs)
        return x


def holder(model: nn.Module) -> nn.Module:
    """The module whose ``layers`` are the blocks (the model, or mlx-lm's ``model.model``)."""
    return model if isinstance(model.get("layers"), list) else model["model"]


def set_up(model: nn.Module, rule: str | nv.Plan) -> None:
    """Set ``model``'s blocks up as a plan (:meth:`nuvec_mlx.Plan.apply`) or a fixed rule of :data:`ALL_RULES` says.

    ``sqrt(n) segments`` puts ``ceil(sqrt(n))`` :class:`Segment` s of blocks in
    the blocks' place, each checkpointed; the other rules checkpoint every
    block, every 2nd one (from the first), or none.
    """
    if isinstance(rule, nv.Plan):
        rule.apply(model)
        return
    blocks = list(holder(model).layers)
    if rule == "sqrt(n) segments":
        size = math.ceil(len(blocks) / math.ceil(math.sqrt(len(blocks))))
        holder(model).layers = [
            nv.checkpoint_module(Segment(blocks[i : i + size])) for i in range(0, len(blocks), size)
        ]
        return
    if rule not in ALL_RULES:
        raise ValueError(f"rule must be a plan or one of {ALL_RULES}, got {rule!r}")
    policy = nv.policies.save_matmuls if rule == "every block, save_matmuls" else None
    for i, block in enumerate(blocks):
        enable = rule in ("every block", "every block, save_matmuls") or (rule == "every 2nd" and i % 2 == 0)
        nv.checkpoint_module(block, enable=enable, policy=policy)


@dataclasses.dataclass
class Case:
    """One case of the sweep: a twin set up as its rule says, and its :class:`nuvec_mlx.TrainingStep`.

    ``step()`` runs one step (evaluated, staged: the step's own ``nv.eval``) and
    returns its outputs; ``finish`` has nothing left to evaluate.
    """

    model: nn.Module
    training: nv.TrainingStep
    batch: mx.array

    def step(self) -> Any:
        return self.training(self.batch)

    def optimizer_bytes(self) -> int:
        """Bytes of the optimizer's state (its moments, made at the first step; 0 without an optimizer)."""
        optimizer = self.training.optimizer
        return (
            0
            if optimizer is None
            else sum(a.nbytes for _, a in tree_flatten(optimizer.state) if isinstance(a, mx.array))
        )

    @staticmethod
    def finish(outputs: Any) -> None:
        """Nothing: the step evaluated its outputs (the state included) before returning them."""


def case(built: Built, rule: str | nv.Plan, optimizer: str = "none", synchronize: bool = False) -> Case:
    """A case: a :func:`twin` of ``built``'s model set up by :func:`set_up`, and its step.

    Args:
        built: the model, its loss and its batch.
        rule: a plan, or one of :data:`ALL_RULES`.
        optimizer: a key of :data:`OPTIMIZERS`: the step updates its twin with it, as
            ``nuvec-mlx-lora`` does; ``none`` returns the loss and the gradients.
        synchronize: :class:`nuvec_mlx.TrainingStep`'s ``synchronize``.

    Example:
        >>> c = case(built, "every 2nd")
        >>> loss, grads = c.step()
    """
    model = twin(built)
    set_up(model, rule)
    return Case(
        model, nv.TrainingStep(model, built.loss, OPTIMIZERS[optimizer](), synchronize=synchronize), built.batch
    )
