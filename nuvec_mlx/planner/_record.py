"""A plan as data: what :func:`nuvec_mlx.plan` decided and measured, for one step and budget.

A :class:`Plan` runs no step and holds neither the batch nor the model (only
weak references to the blocks, so that :meth:`Plan.apply` can checkpoint
them); :class:`nuvec_mlx.Planner` makes it. It prints as a table, saves to
JSON, and loads back (:meth:`Plan.load_json`) to apply to a model with the
same blocks.
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.nn as nn

from .. import _policies, _validate
from ..policies import Policy, save_everything, save_matmuls, save_nothing
from ._trial import PLAIN, set_modes

MiB = 1 << 20
#: The policies a plan saved to JSON names, by the names it prints.
KNOWN = {p.__name__: p for p in (save_everything, save_matmuls, save_nothing)}


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


@dataclasses.dataclass
class Plan:
    """A checkpoint plan for one step and budget: the modes, predicted and measured peaks.

    Attributes:
        budget: the budget, bytes of MLX memory at the step's peak.
        fits: whether the measured peak is within the budget.
        modes: per block, ``"plain"`` (not checkpointed) or the policy's name.
        predicted: the predicted peak, bytes.
        measured: the peak measured with the plan applied, bytes.
        start: active memory at the step's start (weights, optimizer state, batch), bytes.
        margin: what the prediction added for the spread between repeats, bytes.
        unchecked: the peak measured with no block checkpointed, bytes.
        smallest: the smallest budget a plan is predicted to meet, bytes: the
            least plan's predicted peak, or its peak measured as the step runs
            where that is higher (on CUDA, MLX frees a stage's buffers after
            :func:`nuvec_mlx.eval` has gone on to the next one), plus the most
            the same step's peak varied between repeats (measured once, the
            least plan's step may peak that much higher when run again).
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
        blocks: per block, a :class:`Block` row.
        policies: the policy of each mode name (what :meth:`apply` checkpoints with).
    """

    budget: int
    fits: bool
    modes: list[str]
    predicted: int
    measured: int
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
    policies: dict[str, Policy] = dataclasses.field(repr=False)
    _targets: list[weakref.ref] = dataclasses.field(default_factory=list, repr=False, compare=False)
    _planner: Any = dataclasses.field(default=None, repr=False, compare=False)

    def apply(self, model: nn.Module | None = None) -> Plan:
        """Checkpoint the blocks as the plan says (in place); returns the plan.

        A :class:`nuvec_mlx.TrainingStep` of the model traces again by itself
        at its next call.

        Args:
            model: the model whose blocks to checkpoint, found by the names
                the plan lists (``model.layers.3``); ``None`` for the blocks the
                plan was made for.

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
        _validate.check_module(model, "model")
        found = dict(model.named_modules())
        missing = [b.name for b in self.blocks if b.name not in found]
        if missing:
            raise ValueError(f"model has no modules named {missing}, which the plan checkpoints")
        return [found[b.name] for b in self.blocks]

    def replan(self, budget: int) -> Plan:
        """Deprecated: plan several budgets with :class:`nuvec_mlx.Planner`, which keeps the measurements.

        Works where the plan came from the deprecated form ``nv.plan(model,
        loss_fn, batch, ...)``, whose plans kept their planner.
        """
        _validate.deprecated("Plan.replan", "nv.Planner(step, batch).plan(budget)")
        if self._planner is None:
            raise ValueError("this plan keeps no measurements: plan again with nv.Planner(step, batch).plan(budget)")
        return self._planner.plan(budget)

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data (what :meth:`save_json` writes)."""
        data = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("policies", "_targets", "_planner", "blocks")
        }
        data["measured_over_predicted"] = self.measured / self.predicted
        data["blocks"] = [dataclasses.asdict(b) for b in self.blocks]
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
        name a file can bring back).

        Example:
            >>> nv.Plan.load_json("plan.json").apply(model)
        """
        data = json.loads(_validate.check_path(path, "path").read_text())
        unknown = sorted({m for m in data["modes"] if m != PLAIN and m not in KNOWN})
        if unknown:
            raise ValueError(
                f"{path}: modes {unknown} name no policy a saved plan can bring back (known: {', '.join(KNOWN)})"
            )
        data.pop("measured_over_predicted", None)
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
            f"unchecked peak {self.unchecked / MiB:.1f} MiB; smallest reachable {self.smallest / MiB:.1f} MiB",
            f"step {self.seconds:.3f} s measured; recompute {self.recompute:.3f} s predicted; "
            f"peak during {self.measured_peak_at} (predicted: {self.predicted_peak_at})",
        ]
        if not self.fits:
            lines.append(
                f"no plan fits {self.budget / MiB:.1f} MiB: the smallest peak reached, "
                f"measured, is {self.measured / MiB:.1f} MiB (the modes below)"
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
                f"correction: predicted {predicted / MiB:.1f} MiB, measured {measured / MiB:.1f} MiB "
                f"> budget; chose again with the miss as margin"
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
