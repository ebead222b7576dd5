"""The long-sequence suite of the fine-tuning benchmark: each trainer in its own process, as users run it.

    nuvec-mlx-bench-train --suite long                      # Llama-3.1-8B QLoRA, 4096 to 65536 tokens
    nuvec-mlx-bench-train --suite long --configs llama-3.1-8b --modes qlora --trainers mlx-lm,nuvec \\
        --lengths 4096,8192,16384,32768,65536 --steps 4 --memory 24GiB

For each model (``--configs``, ``--archs``) and mode, every trainer (``--trainers``) trains batch 1
at each length of ``--lengths`` for ``--steps`` steps, each (model, mode, trainer, length) in a fresh
process through the trainer's own ``train()`` (:mod:`.trainers`): each step's peak above what the model,
adapters and optimizer hold, and its time. Then, for each memory of ``--memory``, the longest length
(a multiple of ``--granularity``) whose every step fits that memory in all (held + step peak), found by
measuring: doubling from the longest length measured to fit, then bisecting, each probe a process of
``--search-steps`` steps whose memory is capped at the memory plus :data:`CAP_MARGIN` of it (MLX's memory
limit, and a guard that ends a probe as soon as MLX's memory passes the cap). The lengths the sweep
measured count in the search. A run that runs out of memory is a result, not the end of the run.
With ``--plan-length``, ``nuvec-mlx-plan --longest``'s answer to the same question stands beside each of
nuvec's (:mod:`.planner`); with ``--plan-only`` too, it is asked instead of searching.
Writes ``results.json``, ``results.md``, ``peak_vs_length.png`` and (after a search) ``longest_vs_memory.png``
into ``--out`` after every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .. import testing
from ..core import environment, options
from . import lengths, long_report, planner, trainers
from .cases import MODES, TrainWorkload
from .trainers import Outcome, RunSpec, Trainer

PROG = "nuvec-mlx-bench-train --suite long"

#: The suite's settings; every one can be overridden on the command line.
DEFAULTS = dict(
    configs="llama-3.1-8b",
    archs="",
    modes="qlora",
    trainers="mlx-lm,nuvec",
    lengths="4096,8192,16384,32768,65536",
    steps=4,
    memory="",
    granularity=1024,
    max_length=131072,
    search_steps=2,
)
#: A search probe's cap: the memory it tests plus this fraction of it.
CAP_MARGIN = 1 / 16

#: Runs one run (:func:`nuvec_mlx_bench.train.trainers.run` by default).
Runner = Callable[[RunSpec], Outcome]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The suite's command line; a value no run can take is an error."""
    defaults = " ".join(f"--{k.replace('_', '-')} {v if v != '' else repr('')}" for k, v in DEFAULTS.items())
    epilog = (
        f"Defaults: {defaults} (--memory '': no search). Writes results.json, results.md, peak_vs_length.png "
        "and, with --memory, longest_vs_memory.png."
    )
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], epilog=epilog)
    p.add_argument("--suite", choices=["long"], default="long", help="this suite")
    p.add_argument("--configs", help=f"public configurations, comma-separated from {', '.join(testing.PUBLIC_CONFIGS)}")
    p.add_argument(
        "--archs", help=f"architectures at --hidden, --layers, --vocab, from {', '.join(testing.ARCHITECTURES)}"
    )
    p.add_argument(
        "--layers", type=options.positive, help="an architecture's depth; fewer layers than a configuration's"
    )
    p.add_argument("--hidden", type=options.positive, help="an architecture's width")
    p.add_argument("--vocab", type=options.positive, default=32000, help="an architecture's vocabulary")
    p.add_argument("--modes", help=f"comma-separated from {', '.join(MODES)} (qlora: 4-bit groups of 64, then LoRA)")
    p.add_argument(
        "--trainers", help=f"comma-separated from {', '.join(trainers.TRAINERS)} (none: mlx-lm's, unchecked)"
    )
    p.add_argument(
        "--chunks",
        default="",
        help="nuvec's nv.Chunks settings, e.g. mlp=2048,attention=auto (0 turns a part off; default: its own)",
    )
    p.add_argument("--ahead", type=int, help="nuvec's stages ahead (default: its own, 1 on a GPU, 0 on the CPU)")
    p.add_argument(
        "--segment",
        default="1",
        help="nuvec's blocks per segment: an int, or sqrt (only every segment-th block's input kept; default 1)",
    )
    p.add_argument("--lengths", help="sequence lengths of the sweep, comma-separated; '' skips it")
    p.add_argument("--batch", type=options.positive, default=1, help="rows per batch (default 1)")
    p.add_argument("--steps", type=options.positive, help="steps of each sweep run (the first compiles), >= 2")
    p.add_argument(
        "--memory",
        help="memories to find the longest fitting length for (16GiB, 512MiB, or MiB), comma-separated; '' skips",
    )
    p.add_argument("--granularity", type=options.positive, help="the search's lengths are multiples of it")
    p.add_argument("--max-length", type=options.positive, help="the longest length the search tries")
    p.add_argument("--search-steps", type=options.positive, help="steps of each search probe, the first included")
    p.add_argument(
        "--search-from", type=options.positive, help="the search's first length (default: the sweep's shortest)"
    )
    p.add_argument(
        "--plan-length",
        type=options.positive,
        help="beside each nuvec search, nuvec-mlx-plan --longest's answer for each memory, measured at a half, three "
        "quarters and all of this many tokens, extrapolated (default: none)",
    )
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="with --plan-length: nuvec-mlx-plan's answer for each memory of --memory, no search (minutes where a "
        "search takes tens; set beside a search of another run by --merge)",
    )
    p.add_argument("--dtype", choices=testing.DTYPES, default="bfloat16", help="the weights' dtype")
    p.add_argument("--lora-rank", type=options.positive, default=8)
    p.add_argument(
        "--model-cache",
        type=Path,
        help="folder of the model folders (built once per model and mode, kept); default: a temporary one",
    )
    p.add_argument("--run-timeout", type=float, help="seconds a run may take before it is stopped (default: none)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/train-long"), help="output folder")
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="FOLDER",
        help="run nothing: write the results of these earlier runs' --out folders together into --out (their "
        "tables and plots as one, e.g. one length per run)",
    )
    args = p.parse_args(argv)
    if args.archs is not None or args.configs is not None:  # one given: the other is none unless given too
        args.archs, args.configs = args.archs or "", args.configs or ""
    for k, v in DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    try:
        _check(args)
    except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
        p.error(str(e))
    return args


def _check(args: argparse.Namespace) -> None:
    """Turn the lists into values (``args.workloads``, ``args.trainer_list`` ...) or raise naming the flag."""
    missing = [str(f) for f in args.merge or [] if not (f / "results.json").is_file()]
    if missing:
        raise ValueError(f"--merge: no results.json (a folder this suite wrote) in {', '.join(missing)}")
    if args.merge and len({f.name for f in args.merge}) < len(args.merge):
        raise ValueError(f"--merge: the folders' names tell their runs apart; these repeat: {args.merge}")
    args.lengths = sorted({options.positive(s) for s in options.csv(args.lengths)})
    args.memory = sorted({options.memory_size(m) for m in options.csv(args.memory)} - {0})
    if args.steps < 2:
        raise ValueError(f"--steps must be >= 2 (the first compiles), got {args.steps}")
    if not args.lengths and not args.memory:
        raise ValueError("--lengths and --memory are both empty: nothing to run")
    if args.memory and args.max_length < args.granularity:
        raise ValueError(f"--max-length {args.max_length} is below --granularity {args.granularity}")
    chunks = tuple(options.chunk_settings(args.chunks).items())
    names = options.csv(args.trainers)
    if not names or set(names) - set(trainers.TRAINERS):
        raise ValueError(f"--trainers: choose from {', '.join(trainers.TRAINERS)}, got {args.trainers!r}")
    if (chunks or args.ahead is not None) and "nuvec" not in names:
        raise ValueError("--chunks and --ahead are nuvec's settings: add nuvec to --trainers")
    segment = args.segment if args.segment == "sqrt" else options.positive(args.segment)
    nuvec = {"chunks": chunks, "ahead": args.ahead, "segment": segment}
    args.trainer_list = [Trainer(n, **(nuvec if n == "nuvec" else {})) for n in dict.fromkeys(names)]
    if args.plan_length and not (args.memory and any(planner.plans(t) for t in args.trainer_list)):
        raise ValueError(
            "--plan-length puts the planner beside nuvec's search: it needs --memory and nuvec among --trainers, "
            "without --segment (nuvec-mlx-plan does not take segments)"
        )
    unknown = set(options.csv(args.configs)) - set(testing.PUBLIC_CONFIGS)
    if unknown:
        raise ValueError(f"--configs: unknown {sorted(unknown)}; choose from {', '.join(testing.PUBLIC_CONFIGS)}")
    if args.plan_only and not args.plan_length:
        raise ValueError("--plan-only asks the planner instead of searching: give --plan-length")
    first = args.search_from or (args.lengths[0] if args.lengths else 4096)
    common = dict(batch=args.batch, seq=first, dtype=args.dtype, lora_rank=args.lora_rank)
    modes = options.csv(args.modes)
    args.workloads = [
        TrainWorkload(c, layers=args.layers, mode=m, **common) for c in options.csv(args.configs) for m in modes
    ]
    args.workloads += [
        TrainWorkload(a, hidden=args.hidden, layers=args.layers, vocab=args.vocab, mode=m, **common)
        for a in options.csv(args.archs)
        for m in modes
    ]
    if not args.workloads:
        raise ValueError("--configs or --archs, and --modes, must name at least one each")


def record(w: TrainWorkload, trainer: Trainer, outcome: Outcome, phase: str, memory: int | None = None) -> dict:
    """A run as the results keep it: the workload, trainer, length, phase (``sweep`` or ``search``, with
    the memory searched), and its :class:`~nuvec_mlx_bench.train.trainers.Outcome`."""
    config = w.config()
    return {
        "workload": long_report.model_label(w),
        "model": w.model,
        "mode": w.mode,
        "trainer": trainer.label(),
        "length": w.seq,
        "batch": w.batch,
        "layers": config["num_hidden_layers"],
        "hidden": config["hidden_size"],
        "vocab": config["vocab_size"],
        "activation_bytes": testing.DTYPES[w.dtype].size,
        "phase": phase,
        "memory": memory,
        **dataclasses.asdict(outcome),
    }


def sweep(
    w: TrainWorkload, args: argparse.Namespace, folder: Path, runner: Runner, done: Callable[[dict], None]
) -> dict:
    """Every trainer at every length of ``args.lengths`` (``args.steps`` steps each, uncapped), each run
    handed to ``done`` as it ends; returns each trainer's outcomes by length, for the search."""
    known: dict[str, dict[int, Outcome]] = {t.label(): {} for t in args.trainer_list}
    for length in args.lengths:
        at = dataclasses.replace(w, seq=length)
        for t in args.trainer_list:
            outcome = runner(RunSpec(at, t, args.steps, str(folder)))
            known[t.label()][length] = outcome
            done(record(at, t, outcome, "sweep"))
    return known


def search(
    probe: Callable[[int, int], Outcome],
    known: dict[int, Outcome],
    memories: list[int],
    start: int,
    granularity: int,
    max_length: int,
) -> dict[str, dict[str, Any]]:
    """The longest multiple of ``granularity`` (up to ``max_length``) whose run fits each memory in all.

    Args:
        probe: runs a length under the cap of a memory (``probe(length, memory)``).
        known: outcomes by length already measured (the sweep's, earlier probes'); each probe is added.
        memories: bytes; searched from the smallest, each from the longest length known to fit it.
        start: the first length tried where none is known to fit.
        granularity, max_length: as :func:`~nuvec_mlx_bench.train.lengths.largest_fitting`.

    Returns:
        For each memory (:func:`~nuvec_mlx_bench.core.options.size_text`): ``longest`` (0 if none fits),
        its ``peak_in_all``, and ``shortest_not_fitting``, the shortest length measured past it that did not
        fit (``longest + granularity`` once the bisection has closed; ``None`` at ``max_length``). Where a
        probe fails with an error other than running out of memory (a trainer that cannot run a length at
        all), that memory has the ``error`` instead, and larger memories are not searched: what the smaller
        ones found stands.
    """
    found: dict[str, dict[str, Any]] = {}
    for memory in sorted(memories):

        def fits(length: int, memory: int = memory) -> bool:
            verdict = known[length].fits(memory) if length in known else None
            if verdict is None:
                known[length] = probe(length, memory)
                verdict = known[length].fits(memory)
            return bool(verdict)

        try:
            fitting = [t for t, o in known.items() if o.fits(memory)]
            longest = lengths.largest_fitting(fits, max(fitting, default=start), granularity, max_length)
        except RuntimeError as e:
            found[options.size_text(memory)] = {"memory": memory, "error": str(e)}
            break
        over = [t for t, o in known.items() if t > longest and o.fits(memory) is False]
        found[options.size_text(memory)] = {
            "memory": memory,
            "longest": longest,
            "peak_in_all": known[longest].peak_in_all() if longest else None,
            "shortest_not_fitting": min(over, default=None),
        }
    return found


def cap(memory: int) -> int:
    """A probe's cap for ``memory``: the memory plus :data:`CAP_MARGIN` of it.

    Example:
        >>> cap(16 << 30) == 17 << 30
        True
    """
    return memory + int(memory * CAP_MARGIN)


def search_trainer(
    w: TrainWorkload,
    t: Trainer,
    args: argparse.Namespace,
    folder: Path,
    known: dict[int, Outcome],
    runner: Runner,
    done: Callable[[dict], None],
) -> dict[str, Any]:
    """:func:`search` for one trainer over ``args.searched``, each probe a run of ``args.search_steps`` steps
    handed to ``done``."""
    with tqdm(desc=f"{long_report.model_label(w)}: {t.label()}: longest lengths", unit="probe", leave=False) as bar:

        def probe(length: int, memory: int) -> Outcome:
            bar.set_postfix_str(f"{options.size_text(memory)}, {length} tokens")
            at = dataclasses.replace(w, seq=length)
            outcome = runner(RunSpec(at, t, args.search_steps, str(folder), cap=cap(memory)))
            done(record(at, t, outcome, "search", memory))
            bar.update()
            return outcome

        start = args.search_from or (args.lengths[0] if args.lengths else 4096)
        found = search(probe, known, args.searched, start, args.granularity, args.max_length)
    return {"workload": long_report.model_label(w), "trainer": t.label(), "results": found}


def write(args: argparse.Namespace, results: dict[str, Any], partial: bool = False) -> list[Path]:
    """Write the suite's files for ``results`` into ``--out`` (:func:`.long_report.write`), with their notes; a
    ``partial`` run's say it was still going."""
    lines = long_report.notes(results, args)
    if partial:
        lines.insert(0, "- partial: the run was still going")
    return long_report.write(args.out, results, lines, args.memory)


def measured(runs: list[dict]) -> dict[str, dict[str, Any]]:
    """What a search's probes (``runs``, one workload and trainer) say for each memory probed, read without
    asking for more: ``longest`` measured to fit, its ``peak_in_all``, ``shortest_not_fitting`` measured past
    it (a length the trainer failed at with an error among them, its error in ``failed``) and
    ``measured_only``: the bisection of a search cut off (a call's time up) may not have closed there.

    Example:
        >>> measured([r for r in results["runs"] if r["trainer"] == "nuvec"])["16GiB"]["longest"]
    """
    fields = [f.name for f in dataclasses.fields(Outcome)]
    outcomes = [(r["length"], Outcome(**{f: r[f] for f in fields})) for r in runs]
    found = {}
    for memory in sorted({r["memory"] for r in runs if r["phase"] == "search"}):
        verdicts = [(t, False if o.status == trainers.ERROR else o.fits(memory), o) for t, o in outcomes]
        longest = max((t for t, fits, _ in verdicts if fits), default=0)
        over = [(t, o) for t, fits, o in verdicts if fits is False and t > longest]
        shortest, stopped = min(over, default=(None, None), key=lambda p: p[0])
        peaks = [o.peak_in_all() or 0 for t, fits, o in verdicts if fits and t == longest]
        found[options.size_text(memory)] = {
            "memory": memory,
            "longest": longest,
            "peak_in_all": max(peaks, default=None),
            "shortest_not_fitting": shortest,
            **({"failed": stopped.error} if stopped and stopped.status == trainers.ERROR else {}),
            "measured_only": True,
        }
    return found


def _finished(search: dict) -> bool:
    """Whether a search entry has its findings (a search cut off left none; one before per-memory errors
    kept a single ``error`` for all)."""
    return "error" not in search["results"]


def merge(args: argparse.Namespace) -> dict[str, Any]:
    """``--merge``: the folders' results as one (:func:`.long_report.merge`), written into ``--out``; nothing run.
    A memory probed for a workload and trainer that no folder's search finished is read from the probes
    (:func:`measured`), also where a search finished for another memory."""
    results, lines = long_report.merge(args.merge)
    searches = [s for s in results["searches"] if _finished(s)]
    done = {(s["workload"], s["trainer"], size) for s in searches for size in s["results"]}
    probed = dict.fromkeys((r["workload"], r["trainer"]) for r in results["runs"] if r["phase"] == "search")
    for workload, trainer in probed:
        runs = [r for r in results["runs"] if (r["workload"], r["trainer"]) == (workload, trainer)]
        found = {size: f for size, f in measured(runs).items() if (workload, trainer, size) not in done}
        if found:
            searches.append({"workload": workload, "trainer": trainer, "results": found})
            where = f"{workload}, {trainer}, {', '.join(found)}"
            lines.append(f"- {where}: the search not finished; its findings read from its probes")
    results["searches"] = searches
    memory = sorted({f["memory"] for s in results["searches"] for f in long_report.findings(s)})
    written = long_report.write(args.out, results, lines, memory)
    print("\n".join(long_report.table(results["runs"])))
    print(f"wrote {', '.join(p.name for p in written)} into {args.out}")
    return results


def run(argv: list[str] | None = None, runner: Runner | None = None) -> dict[str, Any]:
    """Run the suite that the command line ``argv`` asks for; write and return its results.

    Args:
        argv: the command line (``sys.argv``'s arguments by default).
        runner: runs one run (default: :func:`nuvec_mlx_bench.train.trainers.run`, in a process of its own).

    Returns:
        ``environment``, ``models`` (the model folders built), ``runs`` (every run's :func:`record`) and
        ``searches``.
    """
    args = parse_args(argv)
    if args.merge:
        return merge(args)
    run_one = runner or functools.partial(trainers.run, timeout=args.run_timeout)
    env = trainers.describe(environment.command_line("nuvec-mlx-bench-train", argv))
    args.searched = _searchable(args.memory, env.get("device_memory", 0))
    results: dict[str, Any] = {"environment": env, "models": [], "runs": [], "searches": [], "plans": []}

    def done(r: dict) -> None:
        results["runs"].append(r)
        write(args, results, partial=True)

    with trainers.model_cache(args.model_cache) as cache:
        total = len(args.workloads) * len(args.trainer_list) * len(args.lengths)
        with tqdm(total=total, desc="runs", unit="run", disable=not total) as bar:
            for w in args.workloads:
                folder = _model(w, cache, results["models"])

                def ended(r: dict) -> None:
                    done(r)
                    bar.set_postfix_str(f"{r['trainer']} {r['length']}: {r['status']}")
                    bar.update(r["phase"] == "sweep")

                known = sweep(w, args, folder, run_one, ended)
                for t in args.trainer_list if args.searched or args.plan_only else []:
                    if not args.plan_only:
                        found = search_trainer(w, t, args, folder, known[t.label()], run_one, ended)
                        results["searches"].append(found)
                        write(args, results, partial=True)  # before the planner, which may take minutes
                    if args.plan_length and planner.plans(t):
                        results["plans"].append(plan_beside(w, t, args, folder))
                        write(args, results, partial=True)
    written = write(args, results)
    print("\n".join(long_report.table(results["runs"])))
    print("\n".join(long_report.search_table(results["searches"], results["plans"])))
    print(f"wrote {', '.join(p.name for p in written)} into {args.out}")
    return results


def plan_beside(w: TrainWorkload, t: Trainer, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """``nuvec-mlx-plan --longest``'s answer to the search's question, measured at up to ``args.plan_length``
    tokens: the command run once, for the largest memory of ``args.memory``
    (:func:`~nuvec_mlx_bench.train.planner.longest`), minutes on a large model. Returns its record: the model
    (``workload``), ``trainer`` and ``memories`` (bytes) with the command's measurements, from which
    :func:`~nuvec_mlx_bench.train.planner.answer` solves each memory as the command would."""
    tqdm.write(f"{long_report.model_label(w)}: {t.label()}: nuvec-mlx-plan --longest", file=sys.stderr)
    asked = planner.longest(w, t, folder, max(args.memory), args.plan_length, timeout=args.run_timeout)
    return {"workload": long_report.model_label(w), "trainer": t.label(), "memories": args.memory, **asked}


def _model(w: TrainWorkload, cache: Path, models: list[dict]) -> Path:
    """``w``'s model folder in ``cache``, built first (in a process of its own) where it is not there;
    each build's folder, bytes and seconds added to ``models``."""
    folder = trainers.model_folder(cache, w)
    if not folder.exists():
        built = trainers.build_in_child(w, folder)
        models.append({"folder": folder.name, "bytes": built["bytes"], "seconds": built["seconds"]})
        size = built["bytes"] / 2**30
        tqdm.write(f"built {folder.name}: {size:.2f} GiB in {built['seconds']:.1f} s", file=sys.stderr)
    return folder


def _searchable(memories: list[int], device: int) -> list[int]:
    """The memories a search can test: up to the device's (0: unknown, every one)."""
    return [m for m in memories if not device or m <= device]


def main(argv: list[str] | None = None) -> int:
    """``nuvec-mlx-bench-train --suite long``: exit status 0, or 1 where a run failed with an error
    other than running out of memory (a bug; written into the results like every run)."""
    results = run(argv)
    failed = [r for r in results["runs"] if r["status"] == trainers.ERROR]
    failed += [s for s in results["searches"] if any("error" in r for r in s["results"].values())]
    return 1 if failed else 0
