"""Probe: where a fine-tuning step's time goes against mlx-lm's, by changing one thing of nuvec's step at a time.

One public configuration (random weights; or an architecture at ``--hidden``, ``--layers``, ``--vocab``)
and mode, the fine-tuning benchmark's cases (:class:`nuvec_mlx_bench.train.cases.Case`), measured
round-robin in one process (:func:`nuvec_mlx_bench.core.mlx_measure.run_cases`: a warm-up step each, then
peaks, then times), at nuvec's defaults unless said:

- ``none``, ``mlx-lm``, ``nuvec``, ``nuvec-unchunked``: the benchmark's strategies (``none``: mlx-lm's step unchecked);
- ``nuvec-head-recomputed``: ``nuvec`` with its step traced as outside nuvec's gradients, so that the
  loss head's chunks are recomputed in the backward pass (``nuvec_mlx._gradient.active`` false: how
  ``nuvec-mlx-lora`` ran them before their gradient was taken in the forward pass);
- ``nuvec-updates-folded``: ``nuvec`` with every block's update computed in the stage after its backward
  stage, none a stage of its own (``nuvec_mlx._marks.FOLD`` = 0 while the step is traced): what the update
  stages of full fine-tuning cost;
- ``nuvec-ahead2``: two stages queued ahead instead of one;
- ``nuvec-recomputed-ahead2``: the head recomputed and two stages ahead, the two time levers together;
- ``nuvec-head-chunks``, ``nuvec-attention-chunks``: ``nuvec`` with only the loss head in chunks (attention
  whole), or only attention (mlx-lm's ``default_loss``): which chunks the host's dispatch and the waits
  are spent on;
- ``nuvec-mlp-chunks``, ``nuvec-mlp-chunks-ahead2``: each block's MLP in chunks of ``--mlp-chunk``
  tokens (the benchmark's ``nuvec-mlp-chunks``, ``nuvec-mlx-lora --mlp-chunk``), one or two stages ahead;
- ``nuvec-light-chunk``, ``nuvec-light-forward``, ``nuvec-light-forward-update``,
  ``nuvec-light-forward-update-chunk``: one stage ahead, and one more where it is a chunk's (a block's
  forward pass, an update);
- ``nuvec-head16``, ``nuvec-head32``: the loss head in half or a quarter as many chunks, each two or four
  times larger (``nuvec_mlx.chunking.HEAD_RATIO`` 16 or 32 instead of 8);
- ``nuvec-light-forward-update-head16``: forward and update stages light, and the head in half as many chunks;
- ``nuvec-ahead2-head4``: two stages ahead, the head in twice as many chunks (``HEAD_RATIO`` 4), so that two
  of its chunks in flight hold what one does at the defaults;
- ``nuvec-capped``, ``nuvec-ahead2-capped``, ``nuvec-ahead4-capped``, ``nuvec-light-capped``: one, two or four
  stages ahead, or one and every forward, update and chunk stage light, each with its step's throttle
  (``nv.TrainingStep(throttle=)``, MLX's memory limit) at the peak one step of nuvec's defaults reached,
  measured after its trace: queued further where memory allows, held back by MLX's evaluator where it
  does not;
- ``nuvec-measured``: each stage's own depth of queue, from a memory timeline of one step (``nv.memory.timeline``,
  measured after its trace): past stage ``i``, as many stages as keep the memory they would hold together,
  the memory active before ``i`` plus what each of them adds at its peak, within the most that one stage
  ahead would hold anywhere in the step (:func:`queue_depths`); ``nuvec-measured-floor``: the same within
  the peak the timeline read at 0 ahead (one ahead everywhere, more only below that);
  ``nuvec-measured-forward``: ``nuvec-measured-floor``, further than one ahead only into the forward pass's
  stages (its blocks' and the loss head's chunks: :func:`into`), never into a backward pass or an update.

With ``--dispatch-only N`` it measures the host's part alone, without computing a step: each variant's step
is called ``N`` times after the call that traces it, and nothing is evaluated (nuvec's staged evaluation is
replaced by nothing; mlx-lm's step returns before its ``mx.eval``), so that a CPU shows what a large
configuration costs the host to build and dispatch: the wall time of each call and the calling thread's
CPU time, and the stages of nuvec's. Each call's updated state, unevaluated, is the next call's input: with
every weight trained (full) those chains grow large, and a CPU's times came out bimodal (mlx-lm's Gemma-3-1B
full step 9.7–27.6 ms); LoRA's were steady.

Private settings are patched while each step is traced (its first call), which is all that reads them,
but for the queue's rule (``nuvec_mlx.evaluate._may_queue``), which each evaluation reads: it is patched
around every step of its variant.
Peaks are above the weights and optimizer state (MiB), after ``mx.synchronize()``, the cache cleared;
medians (min–max) of ``--repeats``::

    python benchmarks/probes/step_variants.py --config qwen3-0.6b --mode full
    python benchmarks/probes/step_variants.py --config llama --hidden 32 --layers 1 --vocab 256 --seq 16 --repeats 1
    python benchmarks/probes/step_variants.py --config gemma-3-1b --mode lora --layers 6 --dispatch-only 7 \
        --variants mlx-lm,nuvec,nuvec-head-chunks,nuvec-attention-chunks,nuvec-unchunked
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple
from unittest import mock

import mlx.core as mx

import nuvec_mlx as nv
from nuvec_mlx import _gradient, _marks, evaluate
from nuvec_mlx_bench.core import environment, mlx_measure, options
from nuvec_mlx_bench.core.figures import spread
from nuvec_mlx_bench.core.rounds import summary
from nuvec_mlx_bench.train import cases
from nuvec_mlx_bench.train.cases import MODES, Case, TrainWorkload, add_size_arguments

Context = Callable[[], contextlib.AbstractContextManager[Any]]


def head_recomputed() -> contextlib.AbstractContextManager[Any]:
    """Chunked losses traced inside as outside nuvec's gradients: recomputed in the backward pass."""
    return mock.patch.object(_gradient, "active", lambda: False)


def mlp_chunks(size: int) -> cases.NuvecStep:
    """The benchmark's ``nuvec-mlp-chunks`` with the MLP in chunks of ``size`` tokens."""
    return cases.NuvecStep(nv.Chunks(mlp=size))


def updates_folded() -> contextlib.AbstractContextManager[Any]:
    """Every update folded into the stage after its block's backward stage."""
    return mock.patch.object(_marks, "FOLD", 0)


def light(*kinds: str) -> Context:
    """Stages of ``kinds`` queued one further ahead than the rest (``nuvec_mlx.evaluate._may_queue`` replaced):
    up to ``2 x ahead`` past the one waited for, at most ``ahead`` of them not of ``kinds``."""

    def may_queue(waited: int, beyond: list[str], ahead: int) -> bool:
        return len(beyond) <= 2 * ahead and sum(k not in kinds for k in beyond) <= ahead

    return lambda: mock.patch.object(evaluate, "_may_queue", may_queue)


def head_ratio(ratio: int) -> Context:
    """The loss head in chunks whose logits are at most ``ratio`` times all the hidden states' bytes."""
    return lambda: mock.patch.object(nv.chunking, "HEAD_RATIO", ratio)


def default_peak(training: nv.TrainingStep, batch: Any) -> int:
    """The bytes one step of ``training`` at nuvec's defaults (ahead and throttle ``None``) reaches above the
    memory active before it."""
    settings = training.ahead, training.throttle
    training.ahead = training.throttle = None
    try:
        with nv.memory.measure() as m:
            training(*batch)
    finally:
        training.ahead, training.throttle = settings
    return m.rise


def queue_depths(
    start: int, readings: Sequence[nv.memory.StageReading], ahead: int = 1, within: int | None = None, most: int = 8
) -> list[int]:
    """How many stages may be queued past each stage, from one evaluation's timeline read at 0 ahead.

    Stage ``j`` adds ``adds[j]``, its peak above the memory active before it. Waiting for stage ``i`` with
    ``i + 1 .. i + d`` queued is taken to hold the memory active before ``i`` plus ``adds[i .. i + d]``
    (each queued stage's buffers allocated as the host encodes it, none released yet: an upper bound where
    stages overlap less). Each stage gets ``ahead`` or more: as many as keep that within the budget, the
    most that ``within`` stages ahead hold anywhere in the step by the same reckoning (``ahead``'s, so that
    the step's modelled peak stays that of ``ahead``; 0 for the peak the timeline read itself).

    Args:
        start: the memory active before the evaluation.
        readings: its stages' readings, in order (the last the outputs').
        ahead: the fewest stages queued past each (fewer only where fewer are left).
        within: the stages ahead whose modelled peak is the budget; ``None`` for ``ahead``.
        most: the deepest queue.

    Returns:
        The depth of queue past each stage, one per reading.
    """
    before = [start] + [r.active for r in readings[:-1]]
    adds = [max(0, r.peak - b) for r, b in zip(readings, before)]
    held = [[b + sum(adds[i : i + d + 1]) for d in range(most + 1)] for i, b in enumerate(before)]
    budget = max(h[ahead if within is None else within] for h in held)
    last = [min(most, len(adds) - 1 - i) for i in range(len(adds))]
    return [max(min(ahead, n), *(d for d in range(n + 1) if h[d] <= budget)) for h, n in zip(held, last)]


def into(depths: Sequence[int], kinds: Sequence[str], only: Collection[str], ahead: int = 1) -> list[int]:
    """``depths`` cut so that past each stage no more than ``ahead`` stages are queued but of kinds ``only``:
    the queue goes further only while the next stage is one of those."""
    cut = []
    for i, d in enumerate(depths):
        e = min(ahead, d)
        while e < d and kinds[i + e + 1] in only:
            e += 1
        cut.append(e)
    return cut


def measured_depths(
    training: nv.TrainingStep, batch: Any, within: int | None = None, only: Collection[str] | None = None
) -> list[int]:
    """:func:`queue_depths` of a step of ``training`` (traced already), from its timeline; with ``only``,
    further than ``ahead`` only into stages of those kinds (:func:`into`)."""
    with nv.memory.measure() as m, nv.memory.timeline() as t:  # m.start: the memory active before the step
        training(*batch)
    ahead = training.ahead or 1
    depths = queue_depths(m.start, t.readings, ahead=ahead, within=within)
    return depths if only is None else into(depths, [r.kind for r in t.readings], only, ahead)


def per_stage(depths: Sequence[int]) -> Context:
    """Stages queued past each one as ``depths`` says (``nuvec_mlx.evaluate._may_queue`` replaced)."""

    def may_queue(waited: int, beyond: list[str], ahead: int) -> bool:
        return len(beyond) <= depths[min(waited, len(depths) - 1)]

    return lambda: mock.patch.object(evaluate, "_may_queue", may_queue)


class Variant(NamedTuple):
    """The benchmark's strategy, what its trace runs inside, what each of its steps runs inside, the
    stages ahead (``None``: the default), whether its throttle is the peak of a step at the defaults, and
    whether each stage's queue is measured (:func:`measured_depths`, its budget that of ``within`` ahead,
    further than ``ahead`` only into stages of kinds ``only`` where given), and what of the strategy's
    :class:`~nuvec_mlx_bench.train.cases.NuvecStep` it changes."""

    strategy: str
    tracing: Context = contextlib.nullcontext
    running: Context = contextlib.nullcontext
    ahead: int | None = None
    capped: bool = False
    measured: bool = False
    within: int | None = None
    only: frozenset[str] | None = None
    changes: Mapping[str, Any] | None = None


#: the stages of the forward pass: its blocks' and the loss head's chunks
FORWARD_KINDS = frozenset({_marks.FORWARD, _marks.CHUNK})

VARIANTS: dict[str, Variant] = {
    "none": Variant("none"),
    "mlx-lm": Variant("mlx-lm"),
    "nuvec": Variant("nuvec"),
    "nuvec-unchunked": Variant("nuvec-unchunked"),
    "nuvec-head-recomputed": Variant("nuvec", head_recomputed),
    "nuvec-updates-folded": Variant("nuvec", updates_folded),
    "nuvec-ahead2": Variant("nuvec", ahead=2),
    "nuvec-recomputed-ahead2": Variant("nuvec", head_recomputed, ahead=2),
    "nuvec-head-chunks": Variant("nuvec", changes={"chunks": nv.Chunks(attention=None)}),
    "nuvec-attention-chunks": Variant("nuvec", changes={"chunks": nv.Chunks(head=None)}),
    "nuvec-mlp-chunks": Variant("nuvec-mlp-chunks"),
    "nuvec-mlp-chunks-ahead2": Variant("nuvec-mlp-chunks", ahead=2),
    "nuvec-light-chunk": Variant("nuvec", running=light(_marks.CHUNK)),
    "nuvec-light-forward": Variant("nuvec", running=light(_marks.FORWARD)),
    "nuvec-light-forward-update": Variant("nuvec", running=light(_marks.FORWARD, _marks.UPDATE)),
    "nuvec-light-forward-update-chunk": Variant("nuvec", running=light(_marks.FORWARD, _marks.UPDATE, _marks.CHUNK)),
    "nuvec-head16": Variant("nuvec", head_ratio(16)),
    "nuvec-head32": Variant("nuvec", head_ratio(32)),
    "nuvec-light-forward-update-head16": Variant("nuvec", head_ratio(16), light(_marks.FORWARD, _marks.UPDATE)),
    "nuvec-ahead2-head4": Variant("nuvec", head_ratio(4), ahead=2),
    "nuvec-capped": Variant("nuvec", capped=True),
    "nuvec-ahead2-capped": Variant("nuvec", ahead=2, capped=True),
    "nuvec-ahead4-capped": Variant("nuvec", ahead=4, capped=True),
    "nuvec-light-capped": Variant("nuvec", running=light(_marks.FORWARD, _marks.UPDATE, _marks.CHUNK), capped=True),
    "nuvec-measured": Variant("nuvec", ahead=1, measured=True),
    "nuvec-measured-floor": Variant("nuvec", ahead=1, measured=True, within=0),
    "nuvec-measured-forward": Variant("nuvec", ahead=1, measured=True, within=0, only=FORWARD_KINDS),
}


def dispatch_times(case: Case, batch: Any, calls: int, variant: Variant) -> dict[str, Any]:
    """The wall and thread-CPU seconds of ``calls`` calls of ``case``'s step, none evaluated, after the call
    that traces it (``first``, wall), and the stages of a :class:`nuvec_mlx.TrainingStep`'s call."""
    skipped: dict[str, Any] = {}

    def unevaluated(stages: Sequence[mx.array], arrays: Any, **settings: Any) -> None:
        skipped["stages"] = len(stages)

    wall, cpu = [], []
    with mock.patch.object(evaluate, "staged", unevaluated):
        for call in range(calls + 1):
            with variant.tracing() if call == 0 else contextlib.nullcontext(), variant.running():
                begin, thread = time.perf_counter(), time.thread_time()
                outputs = case.step(batch)
                wall.append(time.perf_counter() - begin)
                cpu.append(time.thread_time() - thread)
            del outputs  # dropped unevaluated
    return {"first": wall[0], "wall": summary(wall[1:]), "cpu": summary(cpu[1:]), "stages": skipped.get("stages")}


def running_inside(
    timed: tuple[Callable[[], Any], Callable[[Any], None]], running: Context
) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """``timed``'s step and evaluation, each call inside ``running()``."""
    step, finish = timed

    def step_inside() -> Any:
        with running():
            return step()

    def finish_inside(outputs: Any) -> None:
        with running():
            finish(outputs)

    return step_inside, finish_inside


def print_dispatch(label: str, dispatched: dict[str, dict[str, Any]]) -> None:
    """The table of :func:`dispatch_times` per variant, in ms."""
    print(f"{label}; the host building and dispatching one step, none evaluated (ms); medians (min–max)")
    print("| variant | stages | wall | thread CPU | first call (traces) |")
    print("| --- | --- | --- | --- | --- |")
    for name, d in dispatched.items():
        stages = "" if d["stages"] is None else d["stages"]
        wall, cpu = spread(d["wall"], 1e3, 2), f"{d['cpu']['median'] * 1e3:.2f}"
        print(f"| {name} | {stages} | {wall} | {cpu} | {d['first'] * 1e3:.0f} |", flush=True)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Run the probe on ``argv``; print each variant's peak and time against mlx-lm's and return them."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="qwen3-0.6b", help="a public configuration, or an architecture (with --hidden)")
    p.add_argument("--mode", choices=MODES, default="full")
    add_size_arguments(p, batch=4, seq=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from the list above")
    p.add_argument("--ahead", type=int, help="stages ahead of the variants that set none (default: the device's)")
    p.add_argument(
        "--mlp-chunk", type=options.positive, default=cases.MLP_CHUNK, help="the MLP variants' tokens per chunk"
    )
    p.add_argument(
        "--dispatch-only", type=options.positive, metavar="N", help="time N calls of each step, none evaluated"
    )
    args = p.parse_args(argv)
    print(environment.environment(environment.command_line("step_variants.py", argv)))
    w = TrainWorkload(args.config, args.batch, args.seq, args.hidden, args.layers, args.vocab, mode=args.mode)
    timed, parts, dispatched = {}, {}, {}
    for name in args.variants.split(","):
        variant = VARIANTS[name]
        steps = {"nuvec-mlp-chunks": mlp_chunks(args.mlp_chunk)}
        if variant.changes:
            steps[variant.strategy] = dataclasses.replace(cases.NUVEC_STEPS[variant.strategy], **variant.changes)
        with mock.patch.dict(cases.NUVEC_STEPS, steps):
            case = Case(w, variant.strategy)
        ahead = args.ahead if variant.ahead is None else variant.ahead
        if ahead is not None and case.training is not None:  # else the strategy's own
            case.training.ahead = ahead
        batch = case.batch(args.seq)
        if args.dispatch_only:
            dispatched[name] = dispatch_times(case, batch, args.dispatch_only, variant)
            continue
        with variant.tracing(), variant.running():
            case.evaluate(case.step(batch))  # traced (and compiled) here, with the variant's settings
        if variant.capped and case.training is not None:
            case.training.throttle = default_peak(case.training, batch)
        running = variant.running
        if variant.measured and case.training is not None:
            depths = measured_depths(case.training, batch, variant.within, variant.only)
            print(f"{name}: stages queued past each stage, {len(depths)} stages: {depths}")
            running = per_stage(depths)
        timed[name], parts[name] = running_inside(case.timed(batch), running), case.parts
    if args.dispatch_only:
        print_dispatch(w.label(), dispatched)
        return dispatched
    measured = mlx_measure.run_cases(timed, args.repeats, desc=w.label(), parts=parts)
    base = measured["mlx-lm"] if "mlx-lm" in measured else next(iter(measured.values()))
    print(f"{w.label()}; peak above weights and optimizer state (MiB), step time (s); medians (min–max)")
    print("| variant | peak | time | time / mlx-lm's | dispatch (s) | evaluation (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, m in measured.items():
        halves = m.get("parts", {})  # the step's dispatch and evaluation, where its case times them apart
        split = [f"{halves[k]['median']:.4f}" if k in halves else "" for k in ("dispatch", "evaluation")]
        print(
            f"| {name} | {spread(m['peak'], 2**-20, 0)} | {spread(m['time'], 1, 4)} | "
            f"{m['time']['median'] / base['time']['median']:.3f} | {split[0]} | {split[1]} |",
            flush=True,
        )
    return measured


if __name__ == "__main__":
    main()
