"""The planner: which blocks to checkpoint, and how, so that a step's peak fits a budget.

:class:`Planner` measures the user's step (a :class:`nuvec_mlx.TrainingStep`,
with its own settings) a few times: unchecked, and with every block run in
each mode it may choose (a checkpoint policy of :mod:`nuvec_mlx.policies`;
``save_everything`` recomputes nothing but keeps the block a stage). Staged
evaluation gives a reading per block and stage (:mod:`._profile`): what each
block keeps from its forward to its backward pass, its stages' peaks, and its
backward pass's time, which shows what recomputing it costs. From those it
predicts the peak of any mix of modes, chooses the mix with the least
recompute time whose predicted peak fits (:mod:`._choose`), applies it, runs
the step and measures the peak, also of a step read only at its end, as it
runs outside the planner (on CUDA the readings after each stage free buffers
sooner). If the mix does not fit, it lowers its target by the miss and
chooses again (at most ``corrections`` times; a near miss, within the spread
between repeats, takes the least plan where that fits, or a faster fixed rule
that fits, below); if no mix fits, it says so, with the smallest peak it can
reach, measured. Last, it sets the mix against the fixed rules it measured
(every block in one mode, and every 2nd block checkpointed, the others
plain): the fastest rule that fits the budget and whose profiled step ran
faster than the profile predicts the mix would is timed against the mix as a
loop runs them, and where it ran faster it is verified as it runs and taken
instead. Staged blocks cost the host a wait each, which the per-block
recompute times do not show. Rules the profile shows slower are not timed:
timing is most of a plan's steps.

A plan fits when its predicted peak, and its measured peak plus the most the
same step's peak varied between repeats, are within the budget
(:attr:`_Verified.needs`); the smallest budget any plan fits so is
``plan.smallest``, so that a plan fits exactly when its budget is at least that.

Peaks are MLX's active memory (after :func:`mlx.core.synchronize`, cache
cleared first), counting everything the process holds in MLX at the step's
start: weights, optimizer state, the batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.nn as nn
from tqdm import tqdm

from .. import _policies, _pytree, _validate
from ..nn import find_layers
from ..policies import Policy, save_everything, save_matmuls, save_nothing
from ..step import TrainingStep
from . import _choose, _profile, _trial
from ._profile import Profile, highest, spread
from ._record import Block, MadeFor, Plan, mode_names
from ._trial import PLAIN

#: The fixed rule that checkpoints every 2nd block and leaves the others plain.
EVERY_2ND = "every 2nd block"
#: Seconds added per mode that keeps less, so that equal measured costs prefer keeping more.
TIE = 1e-6
#: The modes :func:`plan` chooses among by default, most memory first.
DEFAULT_POLICIES = (save_everything, save_matmuls, save_nothing)
#: Steps per measurement read after every stage: two, so that their spread shows what varies between repeats.
OBSERVED_STEPS = 2
#: Steps per time (a median), run as a training loop runs them.
TIMED_STEPS = 3
#: What a correction lowers its target by beyond the miss, as a fraction of the budget (at least a byte):
#: the choice that missed is then out of reach even where the miss measured nothing (it would be chosen
#: again), and the target moves by more than :data:`._choose.RESOLUTION` of it, within which the dynamic
#: programme does not tell choices apart.
CORRECTION_STEP = 1 / 2000


@dataclasses.dataclass(frozen=True)
class _Verified:
    """A choice of modes, its step measured as it runs, the margin its prediction added, the spread
    between repeats of its step, and its time as a loop runs it (where it was timed)."""

    choice: _choose.Choice
    reading: _trial.StepReading
    margin: int
    spread: int
    seconds: float | None = None

    @property
    def predicted(self) -> int:
        """The predicted peak, its margin included (bytes of MLX memory)."""
        return self.reading.start + self.choice.peak + self.margin

    @property
    def miss(self) -> int:
        """How far the measured peak came out above the prediction without its margin (negative: below)."""
        return self.reading.peak - (self.reading.start + self.choice.peak)

    @property
    def needs(self) -> int:
        """The smallest budget the choice fits: its predicted peak, or its measured peak plus the spread
        between repeats where that is higher. Measured once, the same step may peak higher by that much
        when run again, so a budget below it is one the planner cannot stand behind."""
        return max(self.predicted, self.reading.peak + self.spread)


@dataclasses.dataclass(frozen=True)
class _Rule:
    """A fixed rule taken instead of the mix: its name, its verified step, and the mix's time."""

    name: str
    verified: _Verified
    mix_seconds: float


def _warm_seconds(readings: Sequence[_trial.StepReading]) -> float:
    """An observed step's seconds, the last of ``readings`` (the first also traced and compiled)."""
    return readings[-1].seconds


def _groups(blocks: Sequence[nn.Module], keeps: Sequence[int]) -> list[tuple]:
    """Blocks alike (class, parameter shapes, what they keep): their costs are pooled."""
    return [
        (type(b).__name__, tuple(tuple(v.shape) for _, v in _pytree.flatten(b.trainable_parameters())), k // 4096)
        for b, k in zip(blocks, keeps, strict=True)
    ]


def _stage_name(kind: str, block: int | None, names: Sequence[str]) -> str:
    """A stage in words: ``backward pass of model.layers.3``."""
    if kind == "outputs" or block is None:
        return "the evaluation of the outputs"
    return f"{kind} pass of {names[block]}"


def _staged(modes: Sequence[str]) -> list[int]:
    """The blocks that are stages (not plain), in order: timeline readings count only those."""
    return [j for j, m in enumerate(modes) if m != PLAIN]


def _backward_need(keeps: int, rest: int | None, backward: int | None) -> int | None:
    """A block's backward stage's peak above the step's start: what it keeps, what else the step holds
    (``rest``, None only where every mode's ``backward`` is: :class:`Profile` pads both alike), its own
    peak; None where the block has no backward stage."""
    return None if backward is None or rest is None else keeps + rest + backward


class Planner:
    """Plans of one step for any budget, from one set of measurements.

    The first :meth:`plan` measures the step (unchecked, every block in each
    mode, every 2nd block); every plan then chooses from those and verifies
    its choice by running the step with it. The model, the optimizer and MLX's
    random key are left as they were after each plan.

    Args:
        step: the training step to plan (:class:`nuvec_mlx.TrainingStep`).
        batch: the loss's arguments after the model: an array, or a tuple of them.
        layers: the blocks; ``None`` for ``model.layers`` or ``model.model.layers``.
        policies: the checkpoint policies a block may get (each is measured;
            two policies that print alike are told apart by identity).
        corrections: how many times to choose again when the measured peak misses.
        progress: show progress bars.

    Example:
        >>> planner = nv.Planner(step, (x, y))
        >>> for budget in (8 << 30, 12 << 30):
        ...     print(planner.plan(budget))
    """

    def __init__(
        self,
        step: TrainingStep,
        batch: Any,
        *,
        layers: Any = None,
        policies: Sequence[Policy] = DEFAULT_POLICIES,
        corrections: int = 3,
        progress: bool = True,
    ):
        _trial.check_step(step)
        _trial.check_batch(batch)
        self.modes = mode_names(_check_policies(policies))
        self.corrections = _validate.check_int(corrections, "corrections", minimum=0)
        self.progress = _validate.check_bool(progress, "progress")
        blocks = find_layers(step.model, layers)
        if not blocks:
            raise ValueError("layers found no blocks in the model: nothing to plan")
        self.trial, self.batch = _trial.Trial(step, blocks), batch
        paths = {id(m): path for path, m in step.model.named_modules()}
        self.names = [paths.get(id(b), f"block {i}") for i, b in enumerate(blocks)]
        self.profiles: dict[str, Profile] = {}
        self.unchecked: list[_trial.StepReading] = []
        self.rules: dict[str, tuple[tuple[str, ...], list[_trial.StepReading]]] = {}  # name: (modes, readings)
        self.rule_seconds: dict[str, float] = {}  # name: its step's time as a loop runs it (measured when needed)
        self.observed: dict[tuple[str, ...], list[_trial.StepReading]] = {}  # modes: their profiled readings
        self._least_verified: _Verified | None = None  # the verified choice that needs the least budget
        self._measured: dict[tuple[str, ...], list[_trial.StepReading]] = {}  # modes: readings as run, this plan
        self._bar: Any = None  # the verifying progress bar, while a plan verifies

    def plan(self, budget: int) -> Plan:
        """Choose, apply, measure and correct for ``budget`` (bytes of MLX memory at the step's peak).

        Returns:
            The :class:`nuvec_mlx.Plan`; the model is left as it was (call
            :meth:`nuvec_mlx.Plan.apply`).
        """
        _validate.check_int(budget, "budget", minimum=1)
        with self.trial.restoring():
            if not self.profiles:
                self._profile()
            with self._progress("verifying", total=0) as bar:
                self._bar, self._measured = bar, {}
                try:
                    return self._plan(budget)
                finally:
                    self._bar = None

    @contextlib.contextmanager
    def _progress(self, what: str, total: int) -> Iterator[Any]:
        """A progress bar that advances with every step the trial runs inside."""
        with (
            tqdm(total=total, desc=f"nv.plan: {what}", unit="step", disable=not self.progress) as bar,
            self.trial.counting(bar.update),
        ):
            yield bar

    def _set_modes(self, modes: Sequence[str]) -> None:
        """Wrap the blocks as ``modes`` (mode names, or :data:`PLAIN`) say."""
        self.trial.set_modes([m if m == PLAIN else self.modes[m] for m in modes])

    def _measure(self, modes: Sequence[str]) -> list[_trial.StepReading]:
        """The readings of :data:`OBSERVED_STEPS` steps with the blocks as ``modes`` say, kept for the
        verifications of the same modes."""
        self._set_modes(modes)
        readings = self.trial.measure(self.batch, steps=OBSERVED_STEPS)
        self.observed[tuple(modes)] = readings
        return readings

    @contextlib.contextmanager
    def _session(self, modes: Sequence[str], steps: int) -> Iterator[_trial.Session]:
        """A fresh step with the blocks as ``modes`` say, which will run ``steps`` steps (the verifying
        bar's total grows by them)."""
        self._set_modes(modes)
        if self._bar is not None:
            self._bar.total += steps
            self._bar.refresh()
        with self.trial.session(self.batch) as session:
            yield session

    def _profile(self) -> None:
        n = len(self.trial.blocks)
        with self._progress("measuring", total=(len(self.modes) + 2) * OBSERVED_STEPS):
            self.unchecked = self._measure([PLAIN] * n)
            for name in self.modes:
                self.profiles[name] = Profile.of(name, self._measure([name] * n), n)
            # The fixed rules a mix is set against: every block in one mode (measured above), and every
            # 2nd block in the mode that keeps least, the others plain (not wrapped: no stages).
            self.rules = {f"every block {m}": ((m,) * n, p.readings) for m, p in self.profiles.items()}
            least = min(self.profiles, key=lambda m: sum(self.profiles[m].keeps))
            every_2nd = tuple(least if j % 2 == 0 else PLAIN for j in range(n))
            self.rules[EVERY_2ND] = every_2nd, self._measure(every_2nd)

    def _verify(self, choice: _choose.Choice, margin: int, spread: int, timed: bool = False) -> _Verified:
        """``choice`` measured as it runs (:meth:`_readings`), and with ``timed`` its time as a loop runs
        it. The verified choice that needs the least budget so far is kept (:meth:`_least`)."""
        readings, seconds = self._readings(tuple(choice.modes), timed)
        verified = _Verified(choice, highest(readings), margin, spread, seconds)
        if self._least_verified is not None and verified.needs < self._least_verified.needs:
            self._least_verified = verified
        return verified

    def _readings(self, modes: tuple[str, ...], timed: bool) -> tuple[list[_trial.StepReading], float | None]:
        """The readings of ``modes`` as they run, measured once per plan: the profiled ones where the
        profile ran these modes (else :data:`OBSERVED_STEPS` steps), each at least the peak of a step run
        unobserved; and with ``timed``, their time as a loop runs them (else ``None``), whose steps, run
        unobserved too, are the steps run unobserved."""
        known = self._measured.get(modes)
        if known and not timed:
            return known, None
        observed = known or self.observed.get(modes)
        # Timed steps follow a step that compiles: an observed one, else one run unobserved.
        steps = (0 if observed else OBSERVED_STEPS) + (TIMED_STEPS + bool(observed) if timed else 1)
        with self._session(modes, steps) as session:
            observed = observed or session.observe(OBSERVED_STEPS)
            seconds, peak = session.time(TIMED_STEPS) if timed else (None, session.as_run())
        self._measured[modes] = _trial.at_least(observed, peak)
        return self._measured[modes], seconds

    def _time_rule(self, name: str) -> float:
        """A fixed rule's time as a loop runs it; its steps, run unobserved, raise its readings (measured
        as they run this plan, else profiled) to their peak, for its verification."""
        modes, readings = self.rules[name]
        with self._session(modes, 1 + TIMED_STEPS) as session:
            seconds, peak = session.time(TIMED_STEPS)
        self._measured[modes] = _trial.at_least(self._measured.get(modes) or readings, peak)
        return seconds

    def _rivals(self, budget: int, mix: _choose.Choice) -> list[str]:
        """The fixed rules other than ``mix`` whose profiled step fits ``budget`` (with the margin between
        its repeats) and ran faster than the profile predicts ``mix`` would (:meth:`_predicted_seconds`),
        fastest first: the rules worth timing against it."""
        predicted = self._predicted_seconds(mix)
        seconds = {name: _warm_seconds(readings) for name, (_, readings) in self.rules.items()}
        return sorted(
            (
                name
                for name, (modes, readings) in self.rules.items()
                if modes != tuple(mix.modes)
                and highest(readings).peak + self._margin(readings) <= budget
                and seconds[name] < predicted
            ),
            key=seconds.__getitem__,
        )

    def _predicted_seconds(self, choice: _choose.Choice) -> float:
        """The profile's prediction of ``choice``'s step time, observed as the profile's steps were: the
        fastest profiled step's plus the choice's recompute time (each block's backward stage over the
        fastest mode's)."""
        return min(_warm_seconds(p.readings) for p in self.profiles.values()) + choice.cost

    def _faster_rule(self, budget: int, mix: _Verified, rivals: Sequence[str]) -> _Rule | None:
        """The first (fastest) of ``rivals`` (:meth:`_rivals` of the ``mix``), where, timed as a loop runs it
        (once per planner), it ran faster than the ``mix``, verified as it runs; else ``None``."""
        if not rivals or mix.seconds is None:
            return None
        name = rivals[0]
        if name not in self.rule_seconds:
            self.rule_seconds[name] = self._time_rule(name)
        if self.rule_seconds[name] >= mix.seconds:
            return None
        modes, readings = self.rules[name]
        options, _ = self._options()
        cost = sum(o.cost for j, m in enumerate(modes) for o in options[j] if o.mode == m)
        top = _profile.peak_stage(readings[-1])
        at = (_staged(modes)[top.block - 1], top.kind) if top.block else (len(modes), "outputs")
        observed = highest(readings)
        # Its prediction is what the decision took: its profiled peak and the margin between repeats.
        margin = self._margin(readings)
        verified = self._verify(_choose.Choice(modes, observed.peak - observed.start, cost, at), margin, margin)
        if verified.needs > budget:
            return None
        verified = dataclasses.replace(
            verified, reading=dataclasses.replace(verified.reading, seconds=self.rule_seconds[name])
        )
        return _Rule(name, verified, mix.seconds)

    def _margin(self, readings: Sequence[_trial.StepReading]) -> int:
        """A fixed rule's margin: the spread between its repeats, at least the planner's (two repeats of
        one rule can both miss the array in flight at its peak)."""
        return max(spread(readings), self.jitter())

    def _options(self) -> tuple[list[list[_choose.Option]], int]:
        """Each block's options, and the outputs stage's peak (all above the step's start)."""
        n, profiles = len(self.trial.blocks), list(self.profiles.values())
        rest = [max((r for r in (p.rest[j] for p in profiles) if r is not None), default=None) for j in range(n)]
        costs = self._costs()
        options = []
        for j in range(n):
            options.append(
                [
                    _choose.Option(
                        p.mode,
                        p.keeps[j],
                        p.forward[j],
                        _backward_need(p.keeps[j], rest[j], p.backward[j]),
                        costs[p.mode][j],
                    )
                    for p in profiles
                ]
            )
        return options, max(p.outputs for p in profiles)

    def _costs(self) -> dict[str, list[float]]:
        """Recompute seconds per block and mode: its backward stage's time over the fastest mode's,
        the median over blocks alike; a mode that keeps less is taken to cost no less than one
        that keeps more (times on a busy machine are noisy; memory is not)."""
        n = len(self.trial.blocks)
        fastest = [
            min(
                (s for s in (p.backward_seconds[j] for p in self.profiles.values()) if s is not None),
                default=0.0,
            )
            for j in range(n)
        ]
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
            costs[name] = [max(c, b) + TIE for c, b in zip(costs[name], costs[before], strict=True)]
        return costs

    def _least(self) -> _Verified:
        """The verified choice that needs the least budget (:attr:`_Verified.needs`): the choice with the
        smallest predicted peak, measured as it runs once per planner, or a choice verified since that
        needs less. Its need is every plan's ``smallest``."""
        if self._least_verified is None:
            jitter = self.jitter()
            self._least_verified = self._verify(_choose.smallest(*self._options()), jitter, jitter)
        return self._least_verified

    def jitter(self) -> int:
        """How far apart the peaks of the same step came out between repeats (the most seen).

        MLX's evaluator runs ahead of the device by an amount that varies from
        step to step, by about one large array: predictions add this margin.
        """
        return max(spread(p.readings) for p in self.profiles.values())

    def _plan(self, budget: int) -> Plan:
        options, outputs = self._options()
        start = max(r.start for p in self.profiles.values() for r in p.readings)
        unchecked = highest(self.unchecked)
        margin, history = self.jitter(), []
        plain = unchecked.peak + spread(self.unchecked) <= budget
        self._least()  # first: every choice verified after it may need less (smallest agrees with fits)
        for _ in range(self.corrections + 1):
            choice: _choose.Choice | None
            if plain:
                choice = _choose.Choice(
                    (PLAIN,) * len(options), unchecked.peak - unchecked.start, 0.0, (len(options), "outputs")
                )
                margin = repeats = spread(self.unchecked)
            else:
                choice, repeats = _choose.choose(options, budget - start - margin, outputs), self.jitter()
            if choice is None:
                break
            rivals = [] if plain else self._rivals(budget, choice)  # set against a rule: timed
            history.append(self._verify(choice, margin, repeats, timed=bool(rivals)))
            if history[-1].needs <= budget:
                rule = self._faster_rule(budget, history[-1], rivals)
                if rule is not None:
                    history[-1] = rule.verified
                return self._record(budget, history, rule=rule)
            if self._near_miss(budget, history[-1]):  # the least plan, unless a faster rule fits
                rule = self._faster_rule(budget, history[-1], rivals)
                if rule is not None:
                    return self._record(budget, [*history, rule.verified], rule=rule)
                break
            # That choice peaked this much above its prediction: so may others; it is now out of reach.
            margin = max(margin, self.jitter() + history[-1].miss) + max(1, int(budget * CORRECTION_STEP))
            plain = False
        least = self._least()
        if not history or history[-1] is not least:
            history.append(least)
        return self._record(budget, history)

    def _near_miss(self, budget: int, missed: _Verified) -> bool:
        """Whether ``missed`` needs more than ``budget`` by no more than the spread between repeats, where
        the least plan fits: it is taken then, as choosing again would chase the noise of single
        measurements (each near-least choice measured once comes out within that spread of the least's)."""
        return self._least().needs <= budget and missed.needs - budget <= missed.spread

    def _record(self, budget: int, history: list[_Verified], rule: _Rule | None = None) -> Plan:
        """The :class:`Plan` of the last entry of ``history``."""
        last = history[-1]
        choice, reading, start = last.choice, last.reading, last.reading.start
        options, _ = self._options()
        top = _profile.peak_stage(reading)
        blocks = []
        for j, mode in enumerate(choice.modes):
            by_mode = {o.mode: o for o in options[j]}
            o = by_mode.get(mode) or by_mode.get(_policies.name_of(save_everything))
            blocks.append(
                Block(
                    j,
                    self.names[j],
                    type(self.trial.blocks[j]).__name__,
                    mode,
                    o.keeps if o else 0,
                    o.backward if o else None,
                    o.cost if o and mode != PLAIN else 0.0,
                )
            )
        return Plan(
            budget=budget,
            fits=last.needs <= budget,
            modes=list(choice.modes),
            predicted=last.predicted,
            measured=reading.peak,
            spread=last.spread,
            start=start,
            margin=last.margin,
            unchecked=highest(self.unchecked).peak,
            smallest=self._least().needs,
            seconds=reading.seconds,
            recompute=choice.cost,
            measured_peak_at=_stage_name(
                top.kind, None if top.block is None else _staged(choice.modes)[top.block - 1], self.names
            ),
            predicted_peak_at=_stage_name(choice.at[1], choice.at[0], self.names),
            corrections=[(list(v.choice.modes), v.predicted, v.reading.peak) for v in history[:-1]],
            rule=rule.name if rule else None,
            mix_seconds=rule.mix_seconds if rule else None,
            synchronize=self.trial.step.synchronize,
            blocks=blocks,
            made_for=MadeFor.of(self.trial.model, self.batch),
            policies={m: self.modes[m] for m in choice.modes if m != PLAIN},
            _targets=[weakref.ref(b) for b in self.trial.blocks],
        )


def plan(
    step: TrainingStep,
    batch: Any,
    budget: int,
    *,
    layers: Any = None,
    policies: Sequence[Policy] = DEFAULT_POLICIES,
    corrections: int = 3,
    progress: bool = True,
) -> Plan:
    """Plan which blocks to checkpoint, and how, so that a training step's peak fits ``budget``.

    Measures ``step`` (unchecked and with
    every block in each mode), chooses the modes with the least recompute time
    whose predicted peak fits, and measures the step with them applied,
    correcting if it misses. The model, the optimizer and MLX's random key are
    left as they were: call :meth:`Plan.apply` to checkpoint the blocks. To
    plan several budgets from one set of measurements, use :class:`Planner`.

    Args:
        step: the step to plan, with its own settings (:class:`nuvec_mlx.TrainingStep`).
        batch: the loss's arguments after the model: an array, or a tuple of them.
        budget: the peak the step may reach, in bytes of MLX memory (weights,
            optimizer state and batch included).
        layers, policies, corrections, progress: as for :class:`Planner`.

    Returns:
        The :class:`Plan`; ``print(plan)`` shows it as a table.

    Example:
        >>> step = nv.TrainingStep(model, loss_fn, optimizer)
        >>> plan = nv.plan(step, (x, y), budget=12 << 30)
        >>> print(plan)
        >>> plan.apply()
    """
    _trial.check_step(step)
    _validate.check_int(budget, "budget", minimum=1)
    planner = Planner(step, batch, layers=layers, policies=policies, corrections=corrections, progress=progress)
    return planner.plan(budget)


def _check_policies(chosen: object) -> list[Policy]:
    if isinstance(chosen, (str, bytes)) or not isinstance(chosen, Sequence):
        raise TypeError(f"policies must be a sequence of checkpoint policies, got {type(chosen).__name__}")
    if not chosen:
        raise ValueError("policies must name at least one checkpoint policy, got none")
    for i, p in enumerate(chosen):
        _validate.check_callable(p, f"policies[{i}]")
    return list(chosen)
