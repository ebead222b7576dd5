"""A plan as data: what :func:`nuvec_mlx.plan` decided and measured, for one step and budget.

A :class:`Plan` runs no step and holds neither the batch nor the model (only
weak references to the blocks, so that :meth:`Plan.apply` can checkpoint
them); :class:`nuvec_mlx.Planner` makes it. It records what it was made for
(:class:`MadeFor`: the model's class, its blocks, the batch's shapes, the
weights' dtype), prints as a table, saves to JSON, and loads back
(:meth:`Plan.load_json`) to apply to a model with the same blocks.
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .. import _policies, _pytree, _validate
from .._units import MiB
from ..nn import find_layers
from ..policies import NAMED, Policy
from ._trial import PLAIN, as_batch, set_modes

#: The policies a plan saved to JSON names, by the names it prints.
KNOWN = NAMED


@dataclasses.dataclass(frozen=True)
class Block:
    """One block's row of a plan."""

    index: int
    name: str
    kind: str
    mode: str
    keeps: int
    backward: int | None
    recompute: float


@dataclasses.dataclass(frozen=True)
class MadeFor:
    """What a plan was made for: its peaks hold for this model, batch and dtype only.

    The blocks the plan checkpoints are its rows (:attr:`Plan.blocks`: their
    names, and so their count).

    Attributes:
        model: the model's class, with its module (``mlx_lm.models.llama.Model``).
        layers: how many blocks the model holds in ``model.layers`` (or
            ``model.model.layers``); ``None`` for a model with neither.
        batch: the shape of each array of the batch the plan was measured on,
            in the loss's argument order: the first is ``(rows, tokens)`` for
            token ids, as mlx-lm's batches are.
        dtype: the dtype of the model's weights: the one that holds most of the
            bytes of its parameters (``uint32`` for a quantized model).
    """

    model: str
    layers: int | None
    batch: tuple[tuple[int, ...], ...]
    dtype: str

    @classmethod
    def of(cls, model: nn.Module, batch: Any) -> MadeFor:
        """What a plan of ``model`` measured on ``batch`` (the loss's arguments) is made for."""
        return cls(
            model=f"{type(model).__module__}.{type(model).__qualname__}",
            layers=layer_count(model),
            batch=tuple(tuple(a.shape) for a in as_batch(batch) if isinstance(a, mx.array)),
            dtype=weights_dtype(model),
        )

    @property
    def rows(self) -> int | None:
        """The rows of the batch (its first array's first dimension); ``None`` for a batch of scalars."""
        return self.batch[0][0] if self.batch and self.batch[0] else None

    @property
    def tokens(self) -> int | None:
        """The tokens per row of the batch (its first array's second dimension); ``None`` where it has none."""
        return self.batch[0][1] if self.batch and len(self.batch[0]) > 1 else None


def layer_count(model: nn.Module) -> int | None:
    """How many blocks ``model.layers`` (or ``model.model.layers``) holds; ``None`` where it has neither."""
    try:
        return len(find_layers(model))
    except ValueError:
        return None


def weights_dtype(model: nn.Module) -> str:
    """The dtype that holds most of the bytes of ``model``'s parameters, by name (``bfloat16``)."""
    nbytes: dict[str, int] = {}
    for _, a in _pytree.flatten(model.parameters()):
        name = str(a.dtype).rsplit(".", 1)[-1]
        nbytes[name] = nbytes.get(name, 0) + a.nbytes
    return max(nbytes, key=nbytes.__getitem__, default="none")


@dataclasses.dataclass
class Plan:
    """A checkpoint plan for one step and budget: the modes, predicted and measured peaks.

    A plan fits when both its predicted peak and its measured peak plus the
    spread between repeats are within the budget; ``smallest`` is the least
    budget any plan of the step fits so, so that ``fits`` is ``budget >=
    smallest``.

    Attributes:
        budget: the budget, bytes of MLX memory at the step's peak.
        fits: whether the plan fits the budget: ``max(predicted, measured +
            spread) <= budget`` (a peak within the budget by less than the
            spread may go past it when the step runs again).
        modes: per block, ``"plain"`` (not checkpointed) or the policy's name.
        predicted: the predicted peak, its margin included, bytes.
        measured: the peak measured with the plan applied, bytes: the highest of
            its steps read after every stage and one read only at its end, as
            the step runs (on CUDA, MLX frees a stage's buffers after
            :func:`nuvec_mlx.eval` has gone on to the next one).
        spread: the most the same step's peak varied between repeats, bytes.
        start: active memory at the step's start (weights, optimizer state, batch), bytes.
        margin: what the prediction added: the spread between repeats and,
            after a correction, the miss it corrected, bytes.
        unchecked: the peak measured with no block checkpointed, bytes.
        smallest: the smallest budget a plan of the step fits, as ``fits``
            tests it, bytes: the least ``max(predicted, measured + spread)``
            of the plans measured, the plan of the smallest predicted peak
            always among them.
        seconds: the measured step's time with the plan applied.
        recompute: the predicted recompute seconds per step.
        measured_peak_at, predicted_peak_at: the stage where the step peaked, in words.
        corrections: the (modes, predicted, measured) of the tries before the last.
        rule: the fixed rule taken instead of the mix chosen for the budget
            (``"every 2nd block"``, ``"every block save_nothing"`` ...) because it
            fitted and ran faster; ``None`` for the mix.
        mix_seconds: with a rule, the time of the mix it replaced; both are then
            medians of 3 steps run as a loop runs them (``seconds`` is otherwise
            from the planner's measured steps, which read memory after each stage).
        synchronize: the step was measured evaluated with ``synchronize=True``.
        blocks: per block, a :class:`Block` row: the blocks the plan
            checkpoints, by name.
        made_for: the model, batch and dtype the plan was made for (:class:`MadeFor`).
        policies: the policy of each mode name (what :meth:`apply` checkpoints with).
    """

    budget: int
    fits: bool
    modes: list[str]
    predicted: int
    measured: int
    spread: int
    start: int
    margin: int
    unchecked: int
    smallest: int
    seconds: float
    recompute: float
    measured_peak_at: str
    predicted_peak_at: str
    corrections: list[tuple[list[str], int, int]]
    rule: str | None
    mix_seconds: float | None
    synchronize: bool
    blocks: list[Block]
    made_for: MadeFor
    policies: dict[str, Policy] = dataclasses.field(repr=False)
    _targets: list[weakref.ref] = dataclasses.field(default_factory=list, repr=False, compare=False)

    def apply(self, model: nn.Module | None = None) -> Plan:
        """Checkpoint the blocks as the plan says (in place); returns the plan.

        A :class:`nuvec_mlx.TrainingStep` of the model traces again by itself
        at its next call.

        Args:
            model: the model whose blocks to checkpoint, found by the names
                the plan lists (``model.layers.3``); ``None`` for the blocks the
                plan was made for.

        Raises:
            ValueError: ``model``'s blocks differ from those the plan was made
                for: a block it names is missing, or ``model.layers`` holds
                another number of blocks (:meth:`blocks_of`).

        Example:
            >>> nv.plan(step, batch, budget=12 << 30).apply()
        """
        set_modes(self._blocks(model), [self.policies.get(m, m) for m in self.modes])
        return self

    def _blocks(self, model: nn.Module | None) -> list[nn.Module]:
        if model is None:
            blocks = [ref() for ref in self._targets]
            if not blocks or any(b is None for b in blocks):
                raise ValueError(
                    "the blocks this plan was made for are gone (or it was loaded): pass plan.apply(model)"
                )
            return blocks  # type: ignore[return-value]
        return self.blocks_of(model)

    def blocks_of(self, model: nn.Module) -> list[nn.Module]:
        """The blocks of ``model`` the plan checkpoints, found by the names it lists.

        Raises:
            ValueError: a block the plan names is missing from ``model``, or
                ``model.layers`` (``model.model.layers``) holds another number of
                blocks than the model the plan was made for: its peaks hold for
                that model only.

        Example:
            >>> blocks = nv.Plan.load_json("plan.json").blocks_of(model)
        """
        _validate.check_module(model, "model")
        found = dict(model.named_modules())
        missing = [b.name for b in self.blocks if b.name not in found]
        layers = layer_count(model)
        if missing or layers != self.made_for.layers:
            raise ValueError(
                f"the plan was made for a model with {_blocks_text(self.made_for.layers)} "
                f"({_names_text([b.name for b in self.blocks])}); this model has {_blocks_text(layers)}"
                + (f" and no modules named {missing[:3]}" if missing else "")
                + ": plan again for this model"
            )
        return [found[b.name] for b in self.blocks]

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data (what :meth:`save_json` writes)."""
        data = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("policies", "_targets", "blocks", "made_for")
        }
        data["measured_over_predicted"] = self.measured / self.predicted
        data["blocks"] = [dataclasses.asdict(b) for b in self.blocks]
        data["made_for"] = dataclasses.asdict(self.made_for)
        return data

    def save_json(self, path: str | Path) -> Path:
        """Write :meth:`to_dict` to ``path`` as JSON."""
        path = _validate.check_path(path, "path")
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load_json(cls, path: str | Path) -> Plan:
        """A plan :meth:`save_json` wrote, to :meth:`apply` to a model with the same blocks.

        Its modes must be ``plain`` or the policies ``save_everything``,
        ``save_matmuls`` and ``save_nothing`` (a policy of your own has no
        name a file can bring back), and it must record what it was made for
        (``made_for``): a plan saved before plans did is refused (plan again).

        Example:
            >>> nv.Plan.load_json("plan.json").apply(model)
        """
        data = json.loads(_validate.check_path(path, "path").read_text())
        unknown = sorted({m for m in data["modes"] if m != PLAIN and m not in KNOWN})
        if unknown:
            raise ValueError(
                f"{path}: modes {unknown} name no policy a saved plan can bring back (known: {', '.join(KNOWN)})"
            )
        if "made_for" not in data:
            raise ValueError(
                f"{path}: the plan does not record what it was made for (the model, its blocks, the batch, the "
                "dtype), as plans saved by earlier versions of nuvec_mlx do not: plan again (nuvec-mlx-plan ... "
                "--save, or nv.plan(...).save_json)"
            )
        data.pop("measured_over_predicted", None)
        made_for = data.pop("made_for")
        data["made_for"] = MadeFor(**{**made_for, "batch": tuple(tuple(shape) for shape in made_for["batch"])})
        data["blocks"] = [Block(**b) for b in data["blocks"]]
        data["corrections"] = [tuple(c) for c in data["corrections"]]
        return cls(**data, policies={m: KNOWN[m] for m in data["modes"] if m != PLAIN})

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines = [
            f"nv.plan for a budget of {self.budget / MiB:.1f} MiB: {verdict}, measured peak "
            f"{self.measured / MiB:.1f} MiB, predicted {self.predicted / MiB:.1f} MiB "
            f"(measured/predicted {self.measured / self.predicted:.3f})",
            f"at the step's start {self.start / MiB:.1f} MiB (weights, optimizer state, batch); "
            f"unchecked peak {self.unchecked / MiB:.1f} MiB; smallest budget that fits {self.smallest / MiB:.1f} MiB "
            f"(peaks varied by up to {self.spread / MiB:.1f} MiB between repeats)",
            f"step {self.seconds:.3f} s measured; recompute {self.recompute:.3f} s predicted; "
            f"peak during {self.measured_peak_at} (predicted: {self.predicted_peak_at})",
        ]
        if not self.fits:
            lines.append(
                f"no plan fits {self.budget / MiB:.1f} MiB: the smallest peak reached, "
                f"measured, is {self.measured / MiB:.1f} MiB (the modes below); plans fit from "
                f"{self.smallest / MiB:.1f} MiB"
            )
        if self.synchronize:
            lines.append("measured evaluated with synchronize=True (the step's setting)")
        if self.rule:
            lines.append(
                f"taken: the fixed rule {self.rule}, which fits and measured {self.seconds:.3f} s against "
                f"{self.mix_seconds:.3f} s for the mix chosen for the budget"
            )
        for _, predicted, measured in self.corrections:
            lines.append(
                f"correction: predicted {predicted / MiB:.1f} MiB, measured {measured / MiB:.1f} MiB: "
                f"above the budget with the spread between repeats, not taken"
            )
        lines += [
            "",
            f"{'block':>5}  {'layer':<24} {'class':<20} {'mode':<16} {'keeps MiB':>9} "
            f"{'backward MiB':>12} {'recompute s':>11}",
        ]
        for b in self.blocks:
            back = "" if b.backward is None else f"{b.backward / MiB:.2f}"
            lines.append(
                f"{b.index:>5}  {b.name:<24} {b.kind:<20} {b.mode:<16} {b.keeps / MiB:>9.2f} "
                f"{back:>12} {b.recompute:>11.4f}"
            )
        return "\n".join(lines)


def _blocks_text(layers: int | None) -> str:
    """A model's count of blocks in words: ``4 blocks in model.layers``."""
    return "no model.layers" if layers is None else f"{layers} block{'s' * (layers != 1)} in model.layers"


def _names_text(names: Sequence[str]) -> str:
    """The names of a plan's blocks, a long list cut: ``model.layers.0, model.layers.1, ..., model.layers.7``."""
    shown = names if len(names) <= 3 else [*names[:2], "...", names[-1]]
    return f"{len(names)} planned: {', '.join(shown)}"


def mode_names(chosen: Sequence[Policy]) -> dict[str, Policy]:
    """Each policy under the name plans print, told apart by identity: two policies that print
    alike (two lambdas) get ``#2``, ``#3`` after the second and later."""
    names: dict[str, Policy] = {}
    for policy in chosen:
        base = _policies.name_of(policy)
        if any(p is policy for p in names.values()):
            continue
        name, k = base, 1
        while name in names:
            k += 1
            name = f"{base}#{k}"
        names[name] = policy
    return names
