"""The planner against a sweep of budgets, and against the fixed checkpointing rules it replaces.

For each model (the benchmark's MLP and transformer as modules, an mlx-lm
Llama with random weights), :func:`nuvec_mlx.plan` measures the step once, then
plans for budgets spread from the smallest peak it can reach to the unchecked
peak (:meth:`nuvec_mlx.Plan.replan`, each verified by the planner's own
measurement). Then every plan and the fixed rules (every block checkpointed,
every 2nd, ``ceil(sqrt(n))`` segments of blocks, none) are measured side by
side, round-robin, with the benchmark's own probe; for each budget the plan's
time is set beside the fastest rule that fits the same budget. Writes
``results.json``, ``results.md`` and ``plan_sweep.png``:

    nuvec-mlx-bench-plan --out benchmarks/results/cpu/plan
    python -m nuvec_mlx_bench.plan_sweep --out benchmarks/results/cpu/plan   # the same
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

import nuvec_mlx as nv
from nuvec_mlx_bench import environment, measure, modules, report
from nuvec_mlx_bench.workload import Workload

MiB = 1 << 20
MODELS = ("mlp", "transformer", "llama")
#: The step's optimizer, by ``--optimizer``: none (the step returns the loss and gradients), or Adam
#: (mlx-lm's default) updating the model with :func:`nuvec_mlx.update`.
OPTIMIZERS: dict[str, Callable[[], optim.Optimizer | None]] = {"none": lambda: None, "adam": lambda: optim.Adam(1e-5)}
#: The fixed rules a plan's time is set against (the fastest of those within its budget).
RULES = ("every block", "every 2nd", "sqrt(n) segments")
#: The shapes: ``small`` for a CPU (minutes), ``full`` for a GPU.
SUITES = {
    "small": {"mlp": dict(batch=256, dim=128, blocks=8), "transformer": dict(batch=2, dim=128, blocks=8, seq=256),
              "llama": dict(hidden=128, layers=8, batch=2, seq=128)},
    "full": {"mlp": dict(batch=16384, dim=1024, blocks=16),
             "transformer": dict(batch=8, dim=1024, blocks=16, seq=2048),
             "llama": dict(hidden=2048, layers=16, batch=4, seq=2048)},
}


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


def llama(hidden: int, layers: int, batch: int, seq: int) -> tuple[nn.Module, Callable, mx.array]:
    """An mlx-lm Llama with random weights, its next-token loss and a batch of random tokens."""
    from mlx_lm.models import llama as mlx_lm_llama

    mx.random.seed(0)
    model = mlx_lm_llama.Model(mlx_lm_llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=4 * hidden,
        num_attention_heads=max(4, hidden // 128), num_key_value_heads=max(2, hidden // 512), rms_norm_eps=1e-5,
        vocab_size=4096))
    tokens = mx.random.randint(0, 4096, (batch, seq + 1), key=mx.random.key(1))
    mx.eval(model.parameters(), tokens)
    return model, lambda m, x: nn.losses.cross_entropy(m(x[:, :-1]), x[:, 1:]).mean(), tokens


def build(name: str, shape: dict) -> tuple[nn.Module, Callable, mx.array]:
    """A model of the sweep, its loss and its batch."""
    if name == "llama":
        return llama(**shape)
    model, x = modules.build(Workload(name, **shape))
    return model, modules.loss, x


def holder(model: nn.Module) -> nn.Module:
    """The module whose ``layers`` are the blocks (the model, or mlx-lm's ``model.model``)."""
    return model if isinstance(model.get("layers"), list) else model["model"]


def setup(blocks: list[nn.Module], rule: Any) -> Callable[[nn.Module], None]:
    """What sets a model's blocks up as ``rule`` says: a plan's modes (``"plain"``, a policy's name
    in :mod:`nuvec_mlx.policies`, or a policy), or a fixed rule's name."""
    layers: list[nn.Module] = list(blocks)
    if rule == "sqrt(n) segments":
        size = math.ceil(len(blocks) / math.ceil(math.sqrt(len(blocks))))
        layers = [Segment(blocks[i:i + size]) for i in range(0, len(blocks), size)]
    rules = {"every block": ["save_nothing"] * len(blocks), "every block, save_matmuls": ["save_matmuls"] * len(blocks),
             "every 2nd": ["save_nothing" if i % 2 == 0 else "plain" for i in range(len(blocks))],
             "sqrt(n) segments": ["plain"] * len(blocks), "none": ["plain"] * len(blocks)}
    modes = rule if isinstance(rule, list) else rules[rule]

    def apply(model: nn.Module) -> None:
        holder(model).layers = layers
        for block, mode in zip(blocks, modes):
            nv.checkpoint_module(block, enable=mode != "plain", policy=None if mode == "plain" else
                                 getattr(nv.policies, mode) if isinstance(mode, str) else mode)
        for segment in layers if rule == "sqrt(n) segments" else []:
            nv.checkpoint_module(segment)

    return apply


def initialised(optimizer: str, model: nn.Module) -> optim.Optimizer | None:
    """``OPTIMIZERS[optimizer]`` with its state made for ``model``'s trainable parameters, or ``None``."""
    opt = OPTIMIZERS[optimizer]()
    if opt is not None:
        opt.init(model.trainable_parameters())
        mx.eval(opt.state)
    return opt


def case(model: nn.Module, loss_fn: Callable, batch: mx.array, blocks: list[nn.Module], rule: Any,
         optimizer: str = "none", synchronize: bool = False) -> tuple:
    """A ``(step, finish)`` pair for :func:`nuvec_mlx_bench.measure.run_cases`: the blocks set up as
    ``rule`` says before each call (the first traces it; compiled, evaluated with nv.eval with the
    state it updates). With an ``optimizer`` (a key of :data:`OPTIMIZERS`) the step updates the
    model with :func:`nuvec_mlx.update`, as ``nuvec-mlx-lora`` does; the case makes its own at its
    first call, for the model's tree as ``rule`` has it (``sqrt(n) segments`` nests the blocks).
    ``synchronize`` is :func:`nuvec_mlx.eval`'s."""
    apply, compiled = setup(blocks, rule), {}

    def step() -> Any:
        apply(model)
        if "fn" not in compiled:
            vg = nv.value_and_grad(model, loss_fn)
            state = [model.state, mx.random.state]  # checkpoints read the random key
            opt = initialised(optimizer, model)
            if opt is not None:
                state.append(opt.state)

            def run(x: mx.array) -> Any:
                loss, grads = vg(model, x)
                if opt is None:
                    return loss, grads
                nv.update(opt, model, grads)
                return loss

            compiled["fn"], compiled["state"] = nv.compile(run, inputs=state, outputs=state), state
        return compiled["fn"](batch)

    def finish(outputs: Any) -> None:
        nv.eval(outputs, compiled["state"], synchronize=synchronize)  # as a loop does: the updated state too

    return step, finish


def sweep(name: str, shape: dict, budgets: int, repeats: int, optimizer: str = "none",
          synchronize: bool = False) -> list[dict]:
    """One model's rows: each budget's plan and the fixed rules, measured side by side (every step
    evaluated with ``nv.eval(..., synchronize=synchronize)``, the planner's as-run steps too)."""
    model, loss_fn, batch = build(name, shape)
    blocks = list(holder(model).layers)
    opt = initialised(optimizer, model)  # the planner's; its state stays for the start each case's step adds to
    first = nv.plan(model, loss_fn, batch, budget=1 << 50, optimizer=opt, synchronize=synchronize)
    plans = [first.replan(int(first.smallest + k * (first.unchecked - first.smallest) / (budgets - 1)))
             for k in range(budgets)]
    rules: dict[str, Any] = {f"plan for {p.budget / MiB:.1f} MiB": p.modes for p in plans}
    rules |= {r: r for r in (*RULES, "every block, save_matmuls", "none")}
    gc.collect()
    mx.synchronize()
    start = mx.get_active_memory()
    cases = {r: case(model, loss_fn, batch, blocks, rule, optimizer, synchronize) for r, rule in rules.items()}
    measured = measure.run_cases(cases, repeats, desc=f"{name}: plans and rules")
    setup(blocks, "none")(model)
    rows = []
    for r, m in measured.items():
        plan = next((p for p in plans if rules[r] is p.modes), None)
        rows.append({
            "model": name, "shape": shape, "case": r, "start": start,
            "peak": {k: v + start if k != "repeats" else [x + start for x in v] for k, v in m["peak"].items()},
            "time": m["time"], **({
                "budget": plan.budget, "fits": plan.fits, "planned_measured": plan.measured,
                "predicted": plan.predicted, "smallest": plan.smallest, "unchecked": plan.unchecked,
                "modes": plan.modes, "corrections": len(plan.corrections), "rule": plan.rule} if plan else {}),
        })
    none = next(r for r in rows if r["case"] == "none")
    for row in rows:
        row["peak_vs_none"] = row["peak"]["median"] / none["peak"]["median"]
        row["time_vs_none"] = row["time"]["median"] / none["time"]["median"]
        if "budget" in row:
            fitting = [r for r in rows if r["case"] in RULES and r["peak"]["max"] <= row["budget"]]
            best = min(fitting, key=lambda r: r["time"]["median"], default=None)
            row["best_rule"] = best and best["case"]
            row["time_vs_best_rule"] = best and row["time"]["median"] / best["time"]["median"]
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; a bad value is a parser error."""
    p = argparse.ArgumentParser(prog="nuvec-mlx-bench-plan", description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=tuple(SUITES), default="small")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated from {', '.join(MODELS)}")
    p.add_argument("--budgets", type=int, default=5, help="budgets per model, from the smallest to unchecked")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="none",
                   help="the step's optimizer: none (loss and gradients), or Adam updating with nv.update")
    p.add_argument("--synchronize", action="store_true",
                   help="evaluate every step with nv.eval(..., synchronize=True), as the plans are then verified")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/plan"))
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    if not set(args.models) <= set(MODELS):
        p.error(f"--models: choose from {', '.join(MODELS)}; got {args.models}")
    if args.budgets < 2 or args.repeats < 1:
        p.error(f"--budgets must be >= 2 and --repeats >= 1, got {args.budgets} and {args.repeats}")
    return args


def lines(rows: list[dict]) -> list[str]:
    """The results table, Markdown."""
    out = ["| model | case | budget MiB | planner's measured / predicted MiB | ratio | fits | peak MiB, median "
           "(min–max) | vs none | step ms | vs none | fastest of every block, every 2nd, sqrt(n) within the budget "
           "| time vs it | modes |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        p, t = r["peak"], r["time"]
        planned = (f"{r['planned_measured'] / MiB:.2f} / {r['predicted'] / MiB:.2f} | "
                   f"{r['planned_measured'] / r['predicted']:.3f} | {r['fits']}") if "budget" in r else " | |"
        modes = " ".join(m.replace("save_", "")[:4] for m in r.get("modes", []))
        rule = (f"{r['best_rule']} | {r['time_vs_best_rule']:.2f}" if r.get("best_rule") else
                "none fits | " if "budget" in r else " | ")
        budget = f"{r['budget'] / MiB:.2f}" if "budget" in r else ""
        out.append(f"| {r['model']} | {r['case']} | {budget} | "
                   f"{planned} | {p['median'] / MiB:.2f} ({p['min'] / MiB:.2f}–{p['max'] / MiB:.2f}) | "
                   f"{r['peak_vs_none']:.2f} | {t['median'] * 1e3:.0f} | {r['time_vs_none']:.2f} | {rule} | {modes} |")
    return out


def plot(rows: list[dict], env: dict, path: Path) -> Path:
    """Measured peak against budget per model (the line is peak = budget), the rules as marks."""
    from matplotlib.figure import Figure

    names = list(dict.fromkeys(r["model"] for r in rows))
    fig = Figure(figsize=(4.5 * len(names), 4))
    axes = fig.subplots(1, len(names), squeeze=False)
    for ax, name in zip(axes[0], names):
        rs = [r for r in rows if r["model"] == name]
        planned = [r for r in rs if "budget" in r]
        b = [r["budget"] / MiB for r in planned]
        ax.plot(b, b, "k--", lw=0.8, label="peak = budget")
        ax.plot(b, [r["planned_measured"] / MiB for r in planned], "o-", label="plan, planner's measurement")
        ax.plot(b, [r["predicted"] / MiB for r in planned], "x:", label="plan, predicted")
        ax.plot(b, [r["peak"]["max"] / MiB for r in planned], "s", mfc="none", label="plan, max of the repeats")
        for r in rs:
            if "budget" not in r:
                ax.axhline(r["peak"]["median"] / MiB, lw=0.6, color="tab:gray")
                ax.annotate(r["case"], (b[0], r["peak"]["median"] / MiB), fontsize=6, va="bottom")
        ax.set_xlabel("budget MiB")
        ax.set_ylabel("peak MiB")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=6)
    fig.text(0.01, 0.01, report.caption(env), fontsize=6, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    return path


def run(argv: list[str] | None = None) -> list[dict]:
    """Run the sweep the command line asks for; write and return its rows."""
    args = parse_args(argv)
    env = environment.environment(environment.command_line("nuvec-mlx-bench-plan", argv))
    rows = [row for name in args.models
            for row in sweep(name, SUITES[args.suite][name], args.budgets, args.repeats, args.optimizer, args.synchronize)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    planned = [r for r in rows if "budget" in r]
    within = sum(r["fits"] and r["planned_measured"] <= r["budget"] for r in planned)
    ratios = [r["planned_measured"] / r["predicted"] for r in planned]
    text = [
        "# Planner sweep", "", *(f"- {k}: `{v}`" for k, v in env.items()), "",
        f"Budgets met by the planner's own measurement: {within} of {len(planned)}; measured/predicted "
        f"{min(ratios):.3f}–{max(ratios):.3f}; the rows' peaks are then measured again, round-robin with the "
        f"rules (median, min–max of {args.repeats}, after `mx.synchronize()`, cache cleared, absolute: the "
        "model and batch included); times: " + measure.TIMES + ".", "", *lines(rows), "",
        "![peak against budget](plan_sweep.png)",
    ]
    (args.out / "results.md").write_text("\n".join(text) + "\n")
    plot(rows, env, args.out / "plan_sweep.png")
    print("\n".join(text))
    return rows


def main(argv: list[str] | None = None) -> int:
    """The ``nuvec-mlx-bench-plan`` command: run the sweep, exit status 0."""
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
