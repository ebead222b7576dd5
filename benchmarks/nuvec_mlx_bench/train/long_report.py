"""The long-sequence suite's outputs: its tables, JSON, and plots of the peak against the length and of the
longest length that fits against the memory.

Each run's step peak is set against the blocks' inputs, ``L x T x hidden x 2`` bytes (bf16): what a
step that checkpoints every block keeps between its forward and backward passes, the checkpointed
step's floor; its time against mlx-lm's at the same length.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from nuvec_mlx.memory import MiB

from ..core import options, rounds
from ..core.figures import caption, save_figure, spread
from . import planner
from .cases import LOGITS_LIMIT, TrainWorkload
from .trainers import CRASHED

#: Each trainer's colour and marker in the plot (a nuvec with settings is drawn as nuvec, dashed).
STYLES = {"none": ("tab:gray", "o"), "mlx-lm": ("tab:blue", "s"), "nuvec": ("tab:green", "o")}
#: The characters of a failed run's error shown in the table.
SHOWN = 60


def model_label(w: TrainWorkload) -> str:
    """``w`` as a heading, without its length (the runs of one model and mode share it).

    Example:
        >>> model_label(TrainWorkload("llama", batch=1, seq=64, hidden=64, layers=2, vocab=64))
        'llama lora H=64 V=64 L=2 B=1 bfloat16'
    """
    return w.label().replace(f" T={w.seq}", "")


def steps_after_first(values: list[float]) -> dict[str, Any] | None:
    """The median (min–max) of the steps after the first (which compiles); of the one step if only one
    ran; ``None`` if none did (:func:`~nuvec_mlx_bench.core.rounds.summary`)."""
    return rounds.summary(values[1:] or values) if values else None


def blocks_inputs(r: dict) -> int:
    """The bytes of the blocks' inputs of run ``r``: layers x batch x tokens x hidden x the activations' bytes."""
    return int(r["layers"] * r.get("batch", 1) * r["length"] * r["hidden"] * r["activation_bytes"])


def _base_time(runs: list[dict], r: dict) -> float | None:
    """mlx-lm's median step time in the sweep at ``r``'s model and length (in ``r``'s folder where results were
    merged), if it ran."""
    for other in runs:
        keys = (other["workload"], other["length"], other["phase"], other.get("source"))  # source: a merged folder
        same = keys == (r["workload"], r["length"], "sweep", r.get("source"))
        if same and other["trainer"] == "mlx-lm" and other["status"] == "ok" and len(other["seconds"]) > 1:
            return float(statistics.median(other["seconds"][1:]))
    return None


def table(runs: list[dict]) -> list[str]:
    """The sweep's Markdown table: one line per model, length and trainer; where results were merged
    (:func:`merge`), the folder each run came from."""
    sweep = [r for r in runs if r["phase"] == "sweep"]
    merged = any("source" in r for r in sweep)
    lines = [
        "| model | tokens | trainer | held MiB | step peak MiB (min–max) | peak in all MiB | blocks' inputs MiB "
        "| peak / blocks' inputs | step s (min–max) | time / mlx-lm's | outcome |" + (" from |" if merged else ""),
        "| --- " * (12 if merged else 11) + "|",
    ]
    for r in sorted(sweep, key=lambda r: (r["workload"], r["length"])):
        peak, seconds = steps_after_first(r["peaks"]), steps_after_first(r["seconds"])
        inputs = blocks_inputs(r)
        base = _base_time(runs, r)
        cells = [
            r["workload"],
            str(r["length"]),
            r["trainer"],
            f"{r['held'] / MiB:,.1f}" if r["held"] is not None else "",
            spread(peak, 1 / MiB) if peak else "",
            f"{(r['held'] + max(r['peaks'])) / MiB:,.1f}" if peak else "",
            f"{inputs / MiB:,.1f}",
            f"{peak['median'] / inputs:.2f}" if peak else "",
            spread(seconds, 1, 2) if seconds else "",
            f"{seconds['median'] / base:.2f}" if seconds and base and r["status"] == "ok" else "",
            outcome_text(r),
            *([f"`{r.get('source', '')}`"] if merged else []),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def shortened(error: str) -> str:
    """An error's first :data:`SHOWN` characters on one line, ``…`` where it goes on; of a traceback, its
    exception's line (``RuntimeError: ...``)."""
    raised = [line for line in error.splitlines() if re.match(r"\w+(Error|Exception): ", line)]
    text = " ".join((raised[-1] if raised else error).split())
    return text[:SHOWN].rstrip() + ("…" if len(text) > SHOWN else "")


def outcome_text(r: dict) -> str:
    """A run's outcome in a few words: ``ok``, or what stopped it and the start of its error; a crash of a
    trainer that builds the whole logits says where those reach :data:`~.cases.LOGITS_LIMIT` elements."""
    if r["status"] == "ok":
        return "ok"
    text = f"{r['status']}: {shortened(r['error'])}"
    whole = r["trainer"] in ("none", "mlx-lm") and r["length"] * r["vocab"] >= LOGITS_LIMIT
    if r["status"] == CRASHED and whole:
        text += f" (whole logits of {r['length'] * r['vocab']:,} elements: 2^32 or more end MLX's CUDA process)"
    return text


def search_table(searches: list[dict], plans: list[dict] | None = None) -> list[str]:
    """The search's Markdown table: one line per model, trainer and memory; beside each, the planner's answer
    where ``plans`` (:func:`nuvec_mlx_bench.train.long.plan_beside`'s records) has one for that model and
    trainer, and a line for each memory the planner was asked for that no search found a length for."""
    plans = plans or []
    if not searches and not plans:
        return []
    lines = [
        "| model | trainer | memory | longest tokens that fit | its peak in all MiB | shortest measured not to fit "
        "| nuvec-mlx-plan --longest | / the search's |",
        "| --- " * 8 + "|",
    ]
    searched = set()
    for s in searches:
        for size, found in s["results"].items():
            searched.add((s["workload"], s["trainer"], found["memory"]))
            head = f"| {s['workload']} | {s['trainer']} | {size} |"
            if "error" in found:
                lines.append(f"{head} error: {shortened(found['error'])} | | | | |")
                continue
            peak, over = found["peak_in_all"], found["shortest_not_fitting"]
            failed = f" (error: {shortened(found['failed'])})" if "failed" in found else ""
            cells = [
                s["workload"],
                s["trainer"],
                size,
                f"{found['longest']:,}" + (" (its probes' longest)" if found.get("measured_only") else ""),
                f"{peak / MiB:,.1f}" if peak else "",
                (f"{over:,}" if over else "") + failed,
                *planner_cells(planned(plans, s["workload"], s["trainer"], found["memory"]), found["longest"]),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    for p in plans:
        for memory in p["memories"]:
            if (p["workload"], p["trainer"], memory) not in searched:
                searched.add((p["workload"], p["trainer"], memory))  # one line a memory, whichever record asked
                cells = [p["workload"], p["trainer"], options.size_text(memory), "not searched", "", ""]
                lines.append("| " + " | ".join(cells + planner_cells(planner.answer(p, memory), 0)) + " |")
    return lines


def planned(plans: list[dict], workload: str, trainer: str, memory: int) -> dict | None:
    """The planner's answer for ``memory`` bytes (:func:`nuvec_mlx_bench.train.planner.answer`) from the record
    of ``plans`` for ``workload`` and ``trainer`` that was asked for that memory, else the first for them;
    ``None`` where none was asked."""
    mine = [p for p in plans if (p["workload"], p["trainer"]) == (workload, trainer)]
    asked = next((p for p in mine if memory in p["memories"]), mine[0] if mine else None)
    return None if asked is None else planner.answer(asked, memory)


def planner_cells(answer: dict | None, longest: int) -> list[str]:
    """The planner's answer (:func:`planned`) beside a search's: its tokens ("at least" where it is as far as
    the command extrapolates), the lengths it measured and its time, and its ratio to the longest length
    measured to fit (none where nothing was searched)."""
    if answer is None:
        return ["", ""]
    if "error" in answer:
        return [f"error: {shortened(answer['error'])}", ""]
    measured = ", ".join(f"{t:,}" for t, _ in answer["peaks"])
    least = "at least " if answer.get("at_reach") else ""  # as far as it extrapolates
    text = f"{least}{answer['tokens']:,} (measured at {measured}; {answer['seconds']:.0f} s)"
    ratio = f"{'>= ' if least else ''}{answer['tokens'] / longest:.2f}" if longest else ""
    return [text, ratio]


def notes(results: dict, args: argparse.Namespace) -> list[str]:
    """How the figures were measured."""
    lines = [
        "- each run: one process per model, mode, trainer and length, through the trainer's own `train()` "
        "(`none`: `mlx_lm.tuner.trainer.train` without `grad_checkpoint`; `mlx-lm`: the same with it; `nuvec`: "
        "`nuvec_mlx.mlx_lm.train` with it, at its defaults or the settings in brackets); random weights, "
        f"batch {args.batch} of rows of random tokens (the model reads `tokens`; `max_seq_length` is tokens + 1), "
        "Adam at mlx-lm's learning rate, LoRA of rank "
        f"{args.lora_rank} on mlx-lm's default layers of every block; `qlora`: the base quantized as `mlx_lm.convert "
        "-q` does (4 bits, groups of 64); the model loaded from a folder built once (`mlx_lm.utils.load_model`)",
        "- held: MLX's active memory once the model, its adapters and the initialised optimizer exist, before "
        "training; step peak: at mlx-lm's report after each step (`steps_per_report=1`), `mx.get_peak_memory()` "
        "after `mx.synchronize()`, minus held, then `mx.reset_peak_memory()`; step s: the wall time between two "
        f"reports; both the median (min–max) of steps 2 to {args.steps} (the first compiles); peak in all: held + "
        "the highest step peak, the first step's included: what the run needed",
        "- blocks' inputs: layers x tokens x hidden x 2 bytes (bf16), what checkpointing every block keeps; "
        "time / mlx-lm's: the median step time over mlx-lm's at the same length",
        "- a run that runs out of memory is a result: MLX's exception (`out of memory`), or a process ended "
        "without a result (`out of memory or crashed`, with its exit status)",
    ]
    if args.memory:
        lines.append(
            f"- longest tokens that fit: the longest multiple of {args.granularity} (up to {args.max_length}) whose "
            f"every step's peak in all fits the memory, measured: probes of {args.search_steps} steps (the first "
            "included), doubling from the longest length measured to fit (the sweep's count), then bisecting; "
            "each probe's memory capped at the memory + 1/16: MLX's memory limit set there (it frees MLX's cache "
            "and waits for running work before going past it, it does not fail) and a guard thread that ends the "
            "probe as soon as MLX's peak or active memory passes it (`over the cap`)"
        )
    if args.plan_length:
        lines.append(
            "- nuvec-mlx-plan --longest: the command on the same model folder (a tiny tokenizer added), in a process "
            "of its own, `--budget` the largest memory searched, `--num-layers -1`, LoRA as the runs, nuvec's settings "
            f"as its flags, `--max-seq-length {args.plan_length} --verify 0`: its step's peak in all measured at a "
            "half, three quarters and all of that length (or three lengths past where the chunk rules start cutting a "
            "module), a parabola through them solved for each memory (once run, "
            "as the command solves it for its budget; its time is that one run's); nothing run at its answer"
        )
    for m in results.get("models", []):
        lines.append(f"- model folder built: `{m['folder']}`, {m['bytes'] / 2**30:.2f} GiB in {m['seconds']:.1f} s")
    skipped = sorted(set(args.memory) - set(getattr(args, "searched", args.memory)))
    if skipped:
        lines.append(f"- not searched (over the device's memory): {', '.join(map(options.size_text, skipped))}")
    return lines


def findings(search: dict) -> list[dict]:
    """A search's findings, one per memory it found a length for (none where it failed)."""
    return [f for f in search["results"].values() if "error" not in f]


def plot(results: dict, memory: list[int]) -> Figure | None:
    """Peak in all against length, one panel per model and mode, one line per trainer; held + the
    blocks' inputs dashed, the memories searched (``memory``, bytes) dotted, each trainer's longest
    fitting length a vertical line; a run that did not fit is a cross at the top."""
    runs = results["runs"]
    labels = list(dict.fromkeys(r["workload"] for r in runs))
    if not labels:
        return None
    fig = Figure(figsize=(8, 1.5 + 3.8 * len(labels)))
    axes = fig.subplots(len(labels), 1, squeeze=False)
    for ax, label in zip(axes[:, 0], labels):
        mine = [r for r in runs if r["workload"] == label]
        _panel(ax, mine, [s for s in results["searches"] if s["workload"] == label], memory)
        ax.set_title(f"{label} (dashed: held + blocks' inputs; x: did not fit)", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def _panel(ax: Any, runs: list[dict], searches: list[dict], memory: list[int]) -> None:
    for trainer in dict.fromkeys(r["trainer"] for r in runs):
        color, marker = STYLES.get(trainer.split(" ")[0], ("k", "o"))
        style = "-" if trainer in STYLES else "--"
        mine = [r for r in runs if r["trainer"] == trainer]
        points = sorted(
            {r["length"]: r["held"] + max(r["peaks"]) for r in mine if r["status"] == "ok" and r["peaks"]}.items()
        )
        ax.plot([t for t, _ in points], [p / MiB for _, p in points], marker + style, ms=4, color=color, label=trainer)
        failed = sorted({r["length"] for r in mine if r["status"] != "ok"} - {t for t, _ in points})
        ax.plot(failed, [1.0] * len(failed), "x", color=color, ms=7, transform=ax.get_xaxis_transform(), clip_on=False)
        for s in searches:
            for found in findings(s) if s["trainer"] == trainer else []:
                if found["longest"]:
                    ax.axvline(found["longest"], color=color, ls=":", lw=0.8)
    held = next((r["held"] for r in runs if r["held"] is not None), 0)
    grid = sorted({r["length"] for r in runs})
    ax.plot(grid, [(held + blocks_inputs({**runs[0], "length": t})) / MiB for t in grid], "k--", lw=0.8)
    for m in memory:
        ax.axhline(m / MiB, color="k", ls=":", lw=0.6)
        ax.annotate(f" {options.size_text(m)}", (0, m / MiB), xycoords=("axes fraction", "data"), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("held + step peak, MiB")
    ax.legend(fontsize=7)


def fits_plot(results: dict) -> Figure | None:
    """What fits: the longest length measured to fit against the memory, one panel per model and mode, one
    line per trainer (its searches' findings together: a merge's folders may each have searched some memories);
    the planner's answers (``--plan-length``, ``--plan-only``) as open markers, also for memories not searched,
    an open triangle where the answer is as far as the planner extrapolates (a lower bound).
    ``None`` before a search found a length or the planner answered."""
    searches = [s for s in results["searches"] if any(f["longest"] for f in findings(s))]
    plans = [p for p in results.get("plans", []) if "error" not in p]
    labels = list(dict.fromkeys([s["workload"] for s in searches] + [p["workload"] for p in plans]))
    if not labels:
        return None
    fig = Figure(figsize=(6, 1.5 + 3.2 * len(labels)))
    for ax, label in zip(fig.subplots(len(labels), 1, squeeze=False)[:, 0], labels):
        ticks: dict[float, str] = {}
        mine = [s for s in searches if s["workload"] == label]
        for trainer in dict.fromkeys(s["trainer"] for s in mine):
            color, marker = STYLES.get(trainer.split(" ")[0], ("k", "o"))
            found = sorted((f for s in mine if s["trainer"] == trainer for f in findings(s)), key=lambda f: f["memory"])
            gib = [f["memory"] / 2**30 for f in found]
            ticks.update({m: options.size_text(f["memory"]) for m, f in zip(gib, found)})
            ax.plot(gib, [f["longest"] for f in found], marker + "-", ms=4, color=color, label=trainer)
        for p in (p for p in plans if p["workload"] == label):
            color, marker = STYLES.get(p["trainer"].split(" ")[0], ("k", "o"))
            answers = [(m, planner.answer(p, m)) for m in sorted(p["memories"])]
            answers = [(m, a) for m, a in answers if a["tokens"]]
            ticks.update({m / 2**30: options.size_text(m) for m, _ in answers})
            for least, shape, what in ((False, marker, ""), (True, "^", ", at least (past its reach)")):
                drawn = [(m / 2**30, a["tokens"]) for m, a in answers if bool(a.get("at_reach")) == least]
                if drawn:
                    gib, tokens = zip(*drawn)
                    label = f"{p['trainer']}: nuvec-mlx-plan{what}"
                    ax.plot(gib, tokens, shape, ms=7, mfc="none", color=color, label=label)
        ax.set_yscale("log", base=2)
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(FuncFormatter(lambda y, _: f"{y:,.0f}"))
        ax.set_xticks(list(ticks), list(ticks.values()), fontsize=7)
        ax.set_xlabel("memory in all: weights, adapters, optimizer state, step")
        ax.set_ylabel("longest sequence that fits (tokens)")
        ax.set_title(f"{label}: measured by search (open: the planner's answer)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def write(out: Path, results: dict, lines: list[str], memory: list[int]) -> list[Path]:
    """Write ``results.json``, ``results.md`` (with ``lines``, the notes: :func:`notes`), ``peak_vs_length.png``
    and, once a search found a length, ``longest_vs_memory.png`` into ``out``; return the files. ``memory``:
    the memories searched, in bytes, drawn in the first plot."""
    out.mkdir(parents=True, exist_ok=True)
    env = results["environment"]
    text = caption(env) + f", mlx-lm {env.get('mlx_lm', '?')}"
    figures = {"peak_vs_length.png": plot(results, memory), "longest_vs_memory.png": fits_plot(results)}
    plots = [save_figure(fig, out / name, text) for name, fig in figures.items() if fig is not None]
    (out / "results.json").write_text(json.dumps({**results, "notes": lines}, indent=1))
    head = ["# Fine-tuning benchmark: long sequences", "", *(f"- {k}: `{v}`" for k, v in env.items()), ""]
    body = table(results["runs"]) + [""] + search_table(results["searches"], results.get("plans"))
    pics = [f"![{p.stem}]({p.name})" for p in plots]
    (out / "results.md").write_text("\n".join(head + lines + [""] + body + [""] + pics) + "\n")
    return [out / "results.json", out / "results.md", *plots]


def plans_of(results: dict) -> list[dict]:
    """A folder's planner records: its ``plans``, and for a folder written before they were kept apart, each
    search's answers kept beside its findings (``planner``), one record per memory (each may have been
    measured apart)."""
    nested = [
        {"workload": s["workload"], "trainer": s["trainer"], "memories": [f["memory"]], **f["planner"]}
        for s in results["searches"]
        for f in s["results"].values()
        if "planner" in f
    ]
    return results.get("plans", []) + nested


def merge(folders: list[Path]) -> tuple[dict, list[str]]:
    """The results of earlier runs of the suite, one folder each, as one: the runs, searches and plans of every
    folder, each tagged with its folder's name (``source``), and their notes.

    So that lengths measured on separate runs (a long length each, or a loan each) are drawn and tabled
    together. The environment keeps what every folder shares and says ``by folder`` where they differ; the
    notes say each folder's command, date and device, then each folder's notes, each once. A time is set
    against mlx-lm's of the same folder only.

    Args:
        folders: folders holding a ``results.json`` written by the suite.

    Returns:
        The merged results (as :func:`nuvec_mlx_bench.train.long.run` returns) and their notes.

    Example:
        >>> results, lines = merge([Path("8k"), Path("16k")])
    """
    parts = {Path(f).name: json.loads((Path(f) / "results.json").read_text()) for f in folders}
    envs = [p["environment"] for p in parts.values()]
    keys = dict.fromkeys(k for e in envs for k in e)
    env = {k: envs[0].get(k) if all(e.get(k) == envs[0].get(k) for e in envs) else "by folder" for k in keys}
    results = {
        "environment": env,
        "models": [m for p in parts.values() for m in p["models"]],
        "runs": [{**r, "source": name} for name, p in parts.items() for r in p["runs"]],
        "searches": [{**s, "source": name} for name, p in parts.items() for s in p["searches"]],
        "plans": [{**plan, "source": name} for name, p in parts.items() for plan in plans_of(p)],
    }
    sources = [
        f"- `{name}`: `{e['command']}`, {e.get('date', '?')}, {e.get('device', '?')}" for name, e in zip(parts, envs)
    ]
    lines = [f"- merged from {len(parts)} folders:", *(f"  {line}" for line in sources)]
    return results, lines + list(dict.fromkeys(line for p in parts.values() for line in p.get("notes", [])))
