"""The planner: which blocks to checkpoint, and how, so that a step's peak fits a budget.

:func:`plan` measures the step it is given (the model's loss and gradients,
the optimizer's update when given (:func:`nuvec_mlx.update`: each block's
parameters updated in a stage right after its backward pass, whose peak counts
as the block's), compiled with :func:`nuvec_mlx.compile`,
evaluated with :func:`nuvec_mlx.eval`) a few times: unchecked, and with every
block run in each mode it may choose (a checkpoint policy of
:mod:`nuvec_mlx.policies`; ``save_everything`` recomputes nothing but keeps
the block a stage). Staged evaluation gives a reading per block and stage
(:func:`nuvec_mlx.memory.timeline`): what each block keeps from its forward
to its backward pass, its stages' peaks, and its backward pass's time, which
shows what recomputing it costs. From those it predicts the peak of any mix of
modes, chooses the mix with the least recompute time whose predicted peak fits
(:mod:`nuvec_mlx._choose`), applies it, runs the step and measures the peak,
also of a step read only at its end, as it runs outside the planner (on CUDA
the readings after each stage free buffers sooner). If the measured peak
misses the budget, it lowers its target by the miss and chooses again (at most ``corrections`` times); if no mix fits, it says so, with
the smallest peak it can reach, measured. Last, it sets the mix against the
fixed rules it measured (every block in one mode, and every 2nd block
checkpointed, the others plain): a rule that fits the budget and ran faster
is verified as it runs and taken instead. Staged blocks cost the host a wait
each, which the per-block recompute times do not show.

Peaks are MLX's active memory (after :func:`mlx.core.synchronize`, cache
cleared first), counting everything the process holds in MLX at the step's
start: weights, optimizer state, the batch.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten
from tqdm import tqdm

from .. import _policies, _validate, policies
from ..nn import find_layers
from . import _choose, _trial

MiB = 1 << 20
PLAIN = _trial.PLAIN
#: The fixed rule that checkpoints every 2nd block and leaves the others plain.
EVERY_2ND = "every 2nd block"
#: Seconds added per mode that keeps less, so that equal measured costs prefer keeping more.
TIE = 1e-6
#: The modes :func:`plan` chooses among by default, most memory first.
DEFAULT_POLICIES = (policies.save_everything, policies.save_matmuls, policies.save_nothing)


@dataclasses.dataclass
class Profile:
    """One measured step with every block in one mode: what each block keeps and costs."""

    mode: str
    readings: list[_trial.Reading]
    keeps: list[int]  # per block, bytes held from its forward to its backward stage
    forward: list[int]  # per block, its forward stage's peak above what was held before it
    backward: list[int | None]  # per block, its backward stage's peak above what was held before it
    rest: list[int | None]  # per block, what else the step held at its backward stage
    backward_seconds: list[float | None]
    outputs: int  # the last stage's peak, above the start

    @classmethod
    def of(cls, mode: str, readings: Sequence[_trial.Reading], blocks: int) -> Profile:
        """Read a profile off steps' stages (``blocks`` forward stages, then up to as many backward
        ones): the mean of each figure over the steps (how far they vary is :meth:`Planner.jitter`),
        the last step's times (the first step also compiles)."""
        each = [cls._one(mode, r, blocks) for r in readings]
        mean = lambda *values: None if values[0] is None else round(statistics.fmean(values))  # noqa: E731
        return cls(
            mode, list(readings),
            *[[mean(*v) for v in zip(*(getattr(p, f) for p in each))] for f in ("keeps", "forward", "backward", "rest")],
            each[-1].backward_seconds, mean(*(p.outputs for p in each)),
        )

    @classmethod
    def _one(cls, mode: str, reading: _trial.Reading, blocks: int) -> Profile:
        stages = reading.stages
        forward = [r for r in stages if r.kind == "forward"]
        backward = [r for r in stages if r.kind == "backward"][::-1]  # block order
        if len(forward) != blocks or len(backward) > blocks:
            raise ValueError(
                f"nv.plan expects each of the {blocks} blocks to run once per step, as one forward "
                f"and at most one backward stage; the step in mode {mode} had {len(forward)} forward "
                f"and {len(backward)} backward stages"
            )
        start, first = reading.start, blocks - len(backward)  # blocks before `first`: no backward stage
        held = [start] + [r.active for r in forward]
        where = {id(r): k for k, r in enumerate(stages)}
        previous = [stages[where[id(r)] - 1] for r in backward]  # the stage each backward stage follows
        # A block's update stage (nv.update) follows its backward stage: its peak counts as the block's.
        after = [stages[where[id(r)] + 1] for r in backward]
        peaks = [max(r.peak, a.peak if a.kind == "update" else 0) for r, a in zip(backward, after)]
        before = [r.active for r in previous]
        pad: list[Any] = [None] * first
        return cls(
            mode, [reading],
            [held[j + 1] - held[j] for j in range(blocks)],
            [forward[j].peak - held[j] for j in range(blocks)],
            pad + [peaks[i] - before[i] for i in range(len(backward))],
            pad + [before[i] - held[first + i + 1] for i in range(len(backward))],
            pad + [r.seconds - p.seconds for r, p in zip(backward, previous)],
            stages[-1].peak - start,
        )


@dataclasses.dataclass
class Block:
    """One block's row of a plan."""

    index: int
    name: str
    kind: str
    mode: str
    keeps: int
    backward: int | None
    recompute: float


def _groups(blocks: Sequence[nn.Module], keeps: Sequence[int]) -> list[tuple]:
    """Blocks alike (class, parameter shapes, what they keep): their costs are pooled."""
    return [(type(b).__name__, tuple(tuple(v.shape) for _, v in _flat_parameters(b)), k // 4096)
            for b, k in zip(blocks, keeps)]


def _flat_parameters(module: nn.Module) -> list[tuple[str, mx.array]]:
    return tree_flatten(module.trainable_parameters())


class Planner:
    """The measurements behind plans of one step: kept across budgets (:meth:`Plan.replan`)."""

    def __init__(self, trial: _trial.Trial, batch: Any, modes: dict[str, Any], names: list[str],
                 corrections: int, progress: bool):
        self.trial, self.batch, self.modes, self.names = trial, batch, modes, names
        self.corrections, self.progress = corrections, progress
        self.profiles: dict[str, Profile] = {}
        self.unchecked: list[_trial.Reading] = []
        self.rules: dict[str, tuple[tuple[str, ...], list[_trial.Reading]]] = {}  # name: (modes, readings)
        self.rule_seconds: dict[str, float] = {}  # name: its step's time as a loop runs it (measured when needed)
        self._least: tuple[_choose.Choice, _trial.Reading] | None = None

    def set_modes(self, modes: Sequence[str]) -> None:
        """Wrap the blocks as ``modes`` (mode names, or :data:`PLAIN`) say."""
        self.trial.set_modes([m if m == PLAIN else self.modes[m] for m in modes])

    def measure(self, modes: Sequence[str], as_run: bool = False) -> list[_trial.Reading]:
        self.set_modes(modes)
        return self.trial.measure(self.batch, as_run=as_run)

    def profile(self) -> None:
        n = len(self.trial.blocks)
        with tqdm(total=len(self.modes) + 2, desc="nv.plan: measuring", unit="step pair",
                  disable=not self.progress) as bar:
            self.unchecked = self.measure([PLAIN] * n)
            bar.update()
            for name in self.modes:
                self.profiles[name] = Profile.of(name, self.measure([name] * n), n)
                bar.update()
            # The fixed rules a mix is set against: every block in one mode (measured above), and every
            # 2nd block in the mode that keeps least, the others plain (not wrapped: no stages).
            self.rules = {f"every block {m}": ((m,) * n, p.readings) for m, p in self.profiles.items()}
            least = min(self.profiles, key=lambda m: sum(self.profiles[m].keeps))
            every_2nd = tuple(least if j % 2 == 0 else PLAIN for j in range(n))
            self.rules[EVERY_2ND] = every_2nd, self.measure(every_2nd)
            bar.update()

    def _faster_rule(self, budget: int, mix: Sequence[str]) -> tuple[str, tuple, float] | None:
        """The fastest rule whose profiled step fits ``budget`` (with the margin between its repeats)
        and runs faster than the ``mix`` (:meth:`nuvec_mlx._trial.Trial.time`; each rule's once),
        verified as it runs: its name, history entry and the mix's seconds; else ``None``."""
        fitting = [name for name, (_, r) in self.rules.items() if _highest(r).peak + _spread(r) <= budget]
        if not fitting:
            return None
        for name in fitting:
            if name not in self.rule_seconds:
                self.rule_seconds[name] = self._time(self.rules[name][0])
        mix_seconds = self._time(mix)
        name = min(fitting, key=self.rule_seconds.__getitem__)
        if self.rule_seconds[name] >= mix_seconds:
            return None
        modes, readings = self.rules[name]
        reading = _highest(self.measure(modes, as_run=True))
        if reading.peak > budget:
            return None
        options, _ = self.options()
        cost = sum(o.cost for j, m in enumerate(modes) for o in options[j] if o.mode == m)
        top = max(readings[-1].stages, key=lambda r: r.peak)
        at = (_staged(modes)[top.block - 1], top.kind) if top.block else (len(modes), "outputs")
        observed = _highest(readings)
        # Its prediction is what the decision took: its profiled peak and the margin between repeats.
        reading = dataclasses.replace(reading, seconds=self.rule_seconds[name])
        choice = _choose.Choice(modes, observed.peak - observed.start, cost, at)
        return name, (choice, reading, _spread(readings)), mix_seconds

    def _time(self, modes: Sequence[str]) -> float:
        self.set_modes(modes)
        return self.trial.time(self.batch)

    def options(self) -> tuple[list[list[_choose.Option]], int]:
        """Each block's options, and the outputs stage's peak (all above the step's start)."""
        n, profiles = len(self.trial.blocks), list(self.profiles.values())
        rest = [max((p.rest[j] for p in profiles if p.rest[j] is not None), default=None) for j in range(n)]
        costs = self._costs()
        options = []
        for j in range(n):
            options.append([
                _choose.Option(p.mode, p.keeps[j], p.forward[j],
                               None if p.backward[j] is None else p.keeps[j] + rest[j] + p.backward[j],
                               costs[p.mode][j])
                for p in profiles])
        return options, max(p.outputs for p in profiles)

    def _costs(self) -> dict[str, list[float]]:
        """Recompute seconds per block and mode: its backward stage's time over the fastest mode's,
        the median over blocks alike; a mode that keeps less is taken to cost no less than one
        that keeps more (times on a busy machine are noisy; memory is not)."""
        n = len(self.trial.blocks)
        fastest = [min((p.backward_seconds[j] for p in self.profiles.values()
                        if p.backward_seconds[j] is not None), default=0.0) for j in range(n)]
        first = next(iter(self.profiles.values()))
        groups = _groups(self.trial.blocks, first.keeps)
        costs = {}
        for name, p in self.profiles.items():
            own = [max(0.0, (p.backward_seconds[j] or 0.0) - fastest[j]) for j in range(n)]
            pooled = {g: statistics.median(own[j] for j in range(n) if groups[j] == g) for g in set(groups)}
            costs[name] = [pooled[groups[j]] for j in range(n)]
        # Most kept first; each mode after costs at least the one before, and a little more.
        order = sorted(self.profiles, key=lambda name: -sum(self.profiles[name].keeps))
        if _policies.recomputes_nothing(self.modes[order[0]]):
            costs[order[0]] = [0.0] * n
        for before, name in zip(order, order[1:]):
            costs[name] = [max(c, b) + TIE for c, b in zip(costs[name], costs[before])]
        return costs

    def smallest(self) -> _choose.Choice:
        """The modes with the smallest predicted peak."""
        return _choose.smallest(*self.options())

    def least(self) -> tuple[_choose.Choice, _trial.Reading]:
        """:meth:`smallest`, and its step measured as it runs (once: every plan reports it)."""
        if self._least is None:
            choice = self.smallest()
            self._least = choice, _highest(self.measure(choice.modes, as_run=True))
        return self._least

    def jitter(self) -> int:
        """How far apart the peaks of the same step came out between repeats (the most seen).

        MLX's evaluator runs ahead of the device by an amount that varies from
        step to step, by about one large array: predictions add this margin.
        """
        return max(_spread(p.readings) for p in self.profiles.values())

    def plan(self, budget: int) -> Plan:
        """Choose, apply, measure and correct for ``budget``; the model is left as it was."""
        options, outputs = self.options()
        start = max(r.start for p in self.profiles.values() for r in p.readings)
        unchecked = _highest(self.unchecked)
        margin, history = self.jitter(), []
        plain = unchecked.peak + _spread(self.unchecked) <= budget
        with tqdm(total=self.corrections + 1, desc="nv.plan: verifying", unit="step pair",
                  disable=not self.progress) as bar:
            for _ in range(self.corrections + 1):
                if plain:
                    choice = _choose.Choice((PLAIN,) * len(options), unchecked.peak - unchecked.start, 0.0,
                                            (len(options), "outputs"))
                    margin = _spread(self.unchecked)
                else:
                    choice = _choose.choose(options, budget - start - margin, outputs)
                if choice is None:
                    break
                reading = _highest(self.measure(choice.modes, as_run=True))
                bar.update()
                history.append((choice, reading, margin))
                if reading.peak <= budget:
                    rule = None if plain else self._faster_rule(budget, choice.modes)
                    if rule is not None:
                        history[-1] = rule[1]
                    return Plan(self, budget, history, fits=True, instead=rule and (rule[0], rule[2]))
                # That choice peaked this much above its prediction: so may others; it is now out of reach.
                margin = max(self.jitter(), margin, reading.peak - (reading.start + choice.peak)) + max(1, budget // 2000)
                plain = False
        least, reading = self.least()
        if not history or history[-1][0].modes != least.modes:
            history.append((least, reading, self.jitter()))
        return Plan(self, budget, history, fits=history[-1][1].peak <= budget)


class Plan:
    """A checkpoint plan for one step and budget: the modes, predicted and measured peaks.

    Attributes:
        budget: the budget, bytes of MLX memory at the step's peak.
        fits: whether the measured peak is within the budget.
        modes: per block, ``"plain"`` (not checkpointed) or the policy's name.
        predicted: the predicted peak, bytes.
        measured: the peak measured with the plan applied, bytes.
        unchecked: the peak measured with no block checkpointed, bytes.
        smallest: the smallest peak any plan reaches, bytes: the least plan's
            predicted peak, or its peak measured as the step runs where that
            is higher (on CUDA, MLX frees a stage's buffers after
            :func:`nuvec_mlx.eval` has gone on to the next one).
        seconds: the measured step's time with the plan applied.
        recompute: the predicted recompute seconds per step.
        blocks: per block, a :class:`Block` row.
        corrections: the (predicted, measured) peaks of the tries before the last.
        rule: the fixed rule taken instead of the mix chosen for the budget
            (``"every 2nd block"``, ``"every block save_nothing"`` ...) because it
            fitted and ran faster; ``None`` for the mix.
        synchronize: the step was verified as evaluated with
            ``nv.eval(..., synchronize=True)``: evaluate it so.
        mix_seconds: with a rule, the time of the mix it replaced; both are then
            medians of 3 steps run as a loop runs them (``seconds`` is otherwise
            from the planner's measured steps, which read memory after each stage).
    """

    def __init__(self, planner: Planner, budget: int, history: list, fits: bool,
                 instead: tuple[str, float] | None = None):
        choice, reading, margin = history[-1]
        self.rule, self.mix_seconds = instead or (None, None)
        self.synchronize = planner.trial.synchronize
        self._planner = planner
        self.budget, self.fits = budget, fits
        self.modes = list(choice.modes)
        start = reading.start
        self.start = start
        self.margin = margin
        self.predicted = start + choice.peak + margin
        self.measured = reading.peak
        self.seconds = reading.seconds
        self.recompute = choice.cost
        self.unchecked = _highest(planner.unchecked).peak
        options, _ = planner.options()
        self.smallest = max(start + planner.smallest().peak + planner.jitter(), planner.least()[1].peak)
        top = max(reading.stages, key=lambda r: r.peak)
        names = planner.names
        self.measured_peak_at = _stage_name(top.kind, None if top.block is None else _staged(self.modes)[top.block - 1],
                                            names)
        self.predicted_peak_at = _stage_name(choice.at[1], choice.at[0], names)
        self.corrections = [(list(c.modes), start + c.peak + m, r.peak) for c, r, m in history[:-1]]
        self.blocks = []
        for j, mode in enumerate(self.modes):
            by_mode = {o.mode: o for o in options[j]}
            o = by_mode.get(mode) or by_mode.get(_policies.name_of(policies.save_everything))
            self.blocks.append(Block(j, names[j], type(planner.trial.blocks[j]).__name__, mode,
                                     o.keeps if o else 0, o.backward if o else None,
                                     o.cost if o and mode != PLAIN else 0.0))

    def apply(self) -> Plan:
        """Checkpoint the model's blocks as the plan says (in place); returns the plan.

        Example:
            >>> nv.plan(model, loss_fn, batch, budget=12 << 30).apply()
        """
        self._planner.set_modes(self.modes)
        return self

    def replan(self, budget: int) -> Plan:
        """A plan for another budget from the same measurements (verified by measuring its step again).

        Example:
            >>> tighter = plan.replan(8 << 30)
        """
        _validate.check_int(budget, "budget", minimum=1)
        with self._planner.trial.restoring():
            return self._planner.plan(budget)

    def to_dict(self) -> dict:
        """The plan as plain data (what :meth:`save_json` writes)."""
        return {
            "budget": self.budget, "fits": self.fits, "predicted": self.predicted, "measured": self.measured,
            "measured_over_predicted": self.measured / self.predicted, "start": self.start,
            "unchecked": self.unchecked, "smallest": self.smallest, "seconds": self.seconds,
            "recompute_seconds": self.recompute, "measured_peak_at": self.measured_peak_at,
            "predicted_peak_at": self.predicted_peak_at, "corrections": self.corrections,
            "rule": self.rule, "mix_seconds": self.mix_seconds, "synchronize": self.synchronize,
            "blocks": [dataclasses.asdict(b) for b in self.blocks],
        }

    def save_json(self, path: str | Path) -> Path:
        """Write :meth:`to_dict` to ``path`` as JSON."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

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
            lines.append(f"no plan fits {self.budget / MiB:.1f} MiB: the smallest peak reached, "
                         f"measured, is {self.measured / MiB:.1f} MiB (the modes below)")
        if self.synchronize:
            lines.append("verified as evaluated with nv.eval(..., synchronize=True): evaluate the step so")
        if self.rule:
            lines.append(f"taken: the fixed rule {self.rule}, which fits and measured {self.seconds:.3f} s against "
                         f"{self.mix_seconds:.3f} s for the mix chosen for the budget")
        for _, predicted, measured in self.corrections:
            lines.append(f"correction: predicted {predicted / MiB:.1f} MiB, measured {measured / MiB:.1f} MiB "
                         f"> budget; chose again with the miss as margin")
        lines += ["", f"{'block':>5}  {'layer':<24} {'class':<20} {'mode':<16} {'keeps MiB':>9} "
                  f"{'backward MiB':>12} {'recompute s':>11}"]
        for b in self.blocks:
            back = "" if b.backward is None else f"{b.backward / MiB:.2f}"
            lines.append(f"{b.index:>5}  {b.name:<24} {b.kind:<20} {b.mode:<16} {b.keeps / MiB:>9.2f} "
                         f"{back:>12} {b.recompute:>11.4f}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Plan budget={self.budget} fits={self.fits} measured={self.measured} predicted={self.predicted}>"


def _stage_name(kind: str, block: int | None, names: Sequence[str]) -> str:
    """A stage in words: ``backward pass of model.layers.3``."""
    if kind == "outputs" or block is None:
        return "the evaluation of the outputs"
    return f"{kind} pass of {names[block]}"


def _staged(modes: Sequence[str]) -> list[int]:
    """The blocks that are stages (not plain), in order: timeline readings count only those."""
    return [j for j, m in enumerate(modes) if m != PLAIN]


def _spread(readings: Sequence[_trial.Reading]) -> int:
    """The most any stage's peak (above the step's start) differed between the readings of one step."""
    stages = zip(*([s.peak - r.start for s in r.stages] for r in readings))
    return max((max(peaks) - min(peaks) for peaks in stages), default=0)


def _highest(readings: Sequence[_trial.Reading]) -> _trial.Reading:
    """The reading with the highest peak, with the last one's time (the first step also compiles)."""
    top = max(readings, key=lambda r: r.peak)
    return dataclasses.replace(top, seconds=readings[-1].seconds)


def _block_names(model: nn.Module, blocks: Sequence[nn.Module]) -> list[str]:
    paths = {id(m): path for path, m in model.named_modules()}
    return [paths.get(id(b), f"block {i}") for i, b in enumerate(blocks)]


def plan(
    model: nn.Module,
    loss_fn: Callable,
    batch: Any,
    budget: int,
    *,
    optimizer: optim.Optimizer | None = None,
    layers: Any = None,
    policies: Sequence[Callable] = DEFAULT_POLICIES,
    compile: bool = True,
    corrections: int = 3,
    synchronize: bool = False,
    progress: bool = True,
) -> Plan:
    """Plan which blocks to checkpoint, and how, so that a training step's peak fits ``budget``.

    Measures the step (the loss and gradients of ``model``'s trainable
    parameters, then ``optimizer``'s update if given; compiled; evaluated with
    :func:`nuvec_mlx.eval`) unchecked and with every block in each mode, chooses
    the modes with the least recompute time whose predicted peak fits, and
    measures the step with them applied, correcting if it misses. The model,
    the optimizer and MLX's random key are left as they were: call
    :meth:`Plan.apply` to checkpoint the blocks.

    Args:
        model: the model; its blocks are ``layers`` (as for :func:`nuvec_mlx.checkpoint_layers`).
        loss_fn: ``loss_fn(model, *batch)`` returning the loss (or a tuple whose first item is it).
        batch: the loss's arguments after the model: an array, or a tuple of them.
        budget: the peak the step may reach, in bytes of MLX memory (weights,
            optimizer state and batch included).
        optimizer: an ``mlx.optimizers`` optimizer whose update is part of the step.
        layers: the blocks; ``None`` for ``model.layers`` or ``model.model.layers``.
        policies: the checkpoint policies a block may get (each is measured);
            ``save_everything`` recomputes nothing.
        compile: measure the step compiled with :func:`nuvec_mlx.compile`, as it
            should then be run.
        corrections: how many times to choose again when the measured peak misses.
        synchronize: verify and time the step as evaluated with
            ``nv.eval(..., synchronize=True)``, and evaluate it so: on CUDA its
            peak is then the same every step, not only in the planner's
            readings (:attr:`Plan.synchronize`).
        progress: show progress bars.

    Returns:
        The :class:`Plan`; ``print(plan)`` shows it as a table.

    Example:
        >>> plan = nv.plan(model, loss_fn, (x, y), budget=12 << 30, optimizer=opt)
        >>> print(plan)
        >>> plan.apply()
    """
    _validate.check_module(model, "model")
    _validate.check_callable(loss_fn, "loss_fn")
    _check_batch(batch)
    _validate.check_int(budget, "budget", minimum=1)
    _validate.check_optimizer(optimizer, "optimizer", allow_none=True)
    chosen = _check_policies(policies)
    _validate.check_bool(compile, "compile")
    _validate.check_int(corrections, "corrections", minimum=0)
    _validate.check_bool(synchronize, "synchronize")
    _validate.check_bool(progress, "progress")
    blocks = find_layers(model, layers)
    if not blocks:
        raise ValueError("layers found no blocks in model: nothing to plan")
    trial = _trial.Trial(model, loss_fn, blocks, optimizer, compile, synchronize)
    planner = Planner(trial, batch, chosen, _block_names(model, blocks), corrections, progress)
    with trial.restoring():
        planner.profile()
        return planner.plan(budget)


def _check_policies(chosen: object) -> dict[str, Callable]:
    if isinstance(chosen, (str, bytes)) or not isinstance(chosen, Sequence):
        raise TypeError(f"policies must be a sequence of checkpoint policies, got {type(chosen).__name__}")
    if not chosen:
        raise ValueError("policies must name at least one checkpoint policy, got none")
    for i, p in enumerate(chosen):
        _validate.check_callable(p, f"policies[{i}]")
    return {_policies.name_of(p): p for p in chosen}


def _check_batch(batch: object) -> None:
    if not any(isinstance(a, mx.array) for a in _trial.as_batch(batch)):
        raise TypeError(
            "batch must be an mlx.core.array or a tuple of the loss's arguments holding arrays, "
            f"got {type(batch).__name__}"
        )
