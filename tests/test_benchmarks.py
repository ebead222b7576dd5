"""The benchmark is one tool that measures what it says, and its smallest runs go end to end.

Sections follow ``benchmarks/nuvec_mlx_bench/`` (a distribution of its own): the layout, then ``core/``,
``seed/`` (with the blocks of ``nuvec_mlx_bench.testing`` it builds on), ``peak/``, ``sweep/``,
``plan/`` and the probes; ``train/`` is in tests/test_benchmarks_train.py, ``peers/`` in
tests/test_peers.py.
"""

import ast
import gc
import json
import math
import re
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import tomllib
from mlx.utils import tree_flatten

import nuvec_mlx as nv
from nuvec_mlx.memory import MiB
from nuvec_mlx_bench import testing
from nuvec_mlx_bench.core import environment, mlx_measure, options, rounds, throttle
from nuvec_mlx_bench.peak import command as peak
from nuvec_mlx_bench.peak import depth, report, targets
from nuvec_mlx_bench.plan import command as plan
from nuvec_mlx_bench.plan import rules
from nuvec_mlx_bench.seed import floors, rows, strategies
from nuvec_mlx_bench.seed.workload import MODELS, SEED, Workload, block_weights, host_inputs
from nuvec_mlx_bench.sweep import command as sweep

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TINY = Workload("mlp", batch=16, dim=32, blocks=2)
SMALLEST = ["--batch", "16", "--dim", "32", "--blocks", "2", "--repeats", "1", "--peers", "none"]


def assert_close(actual, expected, rtol: float) -> None:
    """Arrays (or lists of them) of the same shapes and dtypes, within ``rtol`` of the largest expected value.

    (``tests/helpers.py`` has the same check, but imports mlx-lm's test folders' needs at its top.)
    """
    pairs = list(zip(actual, expected, strict=True)) if isinstance(expected, (list, tuple)) else [(actual, expected)]
    for a, e in pairs:
        assert (a.shape, a.dtype) == (e.shape, e.dtype)
        assert mx.allclose(a, e, rtol=0, atol=rtol * mx.abs(e).max().item()).item(), mx.abs(a - e).max().item()


# --- the layout ------------------------------------------------------------------------


def code_under(folder: Path) -> list[str]:
    """The code files (.py, .sh) anywhere below ``folder``."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.suffix in (".py", ".sh"))


def test_no_code_lies_under_results():
    """Results hold figures and the READMEs that say how they were made; code lives in probes/ or in git."""
    assert code_under(BENCH / "results") == []


def test_the_results_check_sees_code_at_any_depth(tmp_path):
    (tmp_path / "h200" / "run" / "gpu-tests").mkdir(parents=True)
    for name in ("h200/run/gpu-tests/repeat.py", "h200/run.sh", "h200/run/results.json", "h200/README.md"):
        (tmp_path / name).write_text("x")
    assert code_under(tmp_path) == ["h200/run.sh", "h200/run/gpu-tests/repeat.py"]


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def bench_pyproject() -> dict:
    return tomllib.loads((BENCH / "pyproject.toml").read_text())


def test_the_library_and_the_benchmark_are_two_distributions():
    """The library's wheel carries nuvec_mlx alone and none of the benchmark's commands; the benchmark's
    distribution carries its package (the probes are scripts, not part of it)."""
    assert pyproject()["tool"]["setuptools"]["packages"]["find"]["include"] == ["nuvec_mlx*"]
    assert not any(name.startswith("nuvec-mlx-bench") for name in pyproject()["project"]["scripts"])
    assert bench_pyproject()["tool"]["setuptools"]["packages"]["find"]["include"] == ["nuvec_mlx_bench*"]
    assert not (BENCH / "probes" / "__init__.py").exists()


@pytest.mark.parametrize(
    "name", ["nuvec-mlx-bench", "nuvec-mlx-bench-sweep", "nuvec-mlx-bench-plan", "nuvec-mlx-bench-train"]
)
def test_each_installed_command_is_its_sub_packages_main(name):
    target = bench_pyproject()["project"]["scripts"][name]
    module, function = target.split(":")
    assert module == f"nuvec_mlx_bench.{ {'nuvec-mlx-bench': 'peak'}.get(name, name.rsplit('-', 1)[-1]) }.command"
    main = getattr(__import__(module, fromlist=[function]), function)
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0


def test_the_package_imports_itself_relatively():
    """Inside the package a module names its neighbours relatively; only the probes, scripts outside it,
    import it by its installed name."""
    absolute = []
    for path in BENCH.rglob("*.py"):
        if path.parts[len(BENCH.parts)] in ("probes", "results"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            absolute += [f"{path.relative_to(BENCH)}: {n}" for n in names if n.split(".")[0] == "nuvec_mlx_bench"]
    assert absolute == []


def test_no_two_modules_of_a_sub_package_share_a_stem_up_to_plurals():
    """workload.py beside workloads.py was one of the near-homonyms the layout removed."""
    package = BENCH / "nuvec_mlx_bench"
    for folder in [package, *(p for p in package.iterdir() if p.is_dir())]:
        stems = [p.stem.rstrip("s") for p in folder.glob("*.py")]
        assert len(stems) == len(set(stems)), folder


# --- nuvec_mlx_bench.testing's blocks and seed/workload.py -------------------------------------


def test_the_benchmarks_host_values_are_testings_up_to_the_last_bit_of_the_sine():
    """The peers need NumPy values; nuvec_mlx_bench.testing computes the same formula with MLX."""
    w = Workload("transformer", batch=2, dim=16, blocks=2, seq=8)
    weights, x = host_inputs(w)
    ours = [w_ for i in range(w.blocks) for w_ in testing.block_weights("transformer", 16, i)]
    assert [a.shape for a in weights] == [a.shape for a in ours]
    for host, mlx in zip([*weights, x], [*ours, testing.block_input("transformer", 2, 16, 8)]):
        np.testing.assert_allclose(host, np.array(mlx), rtol=0, atol=np.spacing(np.float32(0.05)))
    assert [[s for s, _ in w.weight_shapes(i)] for i in range(2)] == [
        [s for s, _ in testing.weight_shapes("transformer", 16, i)] for i in range(2)
    ]


def test_workload_rejects_an_unknown_model():
    with pytest.raises(ValueError, match="model must be one of"):
        Workload("cnn", 1, 1, 1)


def test_workload_rejects_a_sequence_for_the_mlp():
    with pytest.raises(ValueError, match="seq must be 1 for the mlp"):
        Workload("mlp", 16, 32, 2, seq=8)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [("batch", 0, ValueError), ("dim", 2.0, TypeError), ("blocks", True, TypeError), ("weight_grads", 1, TypeError)],
)
def test_workload_names_the_field_that_is_wrong(field, value, error):
    with pytest.raises(error, match=field):
        Workload(**{"model": "transformer", "batch": 2, "dim": 8, "blocks": 2, field: value})


def test_block_input_bytes_count_the_sequence():
    assert Workload("transformer", batch=2, dim=8, blocks=1, seq=3).block_input_bytes() == 4 * 2 * 3 * 8


def test_host_inputs_are_each_blocks_weights_then_the_input():
    weights, x = host_inputs(Workload("transformer", batch=2, dim=8, blocks=2, seq=3))
    assert [w.shape for w in weights] == [(8, 24), (8, 8), (8, 32), (32, 8)] * 2
    assert x.shape == (2, 3, 8)
    assert not (weights[0] == weights[4]).all()  # every block has its own values


@pytest.mark.parametrize("kind", testing.BLOCK_KINDS)
def test_testings_modules_compute_its_flat_blocks(kind):
    seq = 8 if kind == "transformer" else 1
    model, x = testing.blocks_model(kind, batch=2, dim=16, blocks=2, seq=seq)
    xs = testing.flat_inputs(kind, batch=2, dim=16, blocks=2, seq=seq)
    assert mx.array_equal(xs[-1], x).item()
    value, grads = nv.value_and_grad_flat(testing.flat_loss(kind, 2), list(range(len(xs) - 1)))(xs)
    ours, our_grads = nv.value_and_grad(model, testing.blocks_loss)(model, x)
    assert_close(ours, value, 1e-5)
    # nn.Linear holds the transposed weight: its gradient is the transpose of the flat one's.
    assert_close([g.T for _, g in tree_flatten(our_grads)], grads, 1e-5)


def test_testings_blocks_are_the_same_every_time_and_each_block_its_own():
    (a, x), (b, y) = testing.blocks_model("mlp", 4, 8, 2), testing.blocks_model("mlp", 4, 8, 2)
    assert all(
        mx.array_equal(p, q).item()
        for (_, p), (_, q) in zip(tree_flatten(a.parameters()), tree_flatten(b.parameters()))
    )
    assert mx.array_equal(x, y).item() and not mx.array_equal(a.layers[0].up.weight, a.layers[1].up.weight).item()


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: testing.blocks_model("cnn", 1, 8, 1), ValueError, "kind must be one of"),
        (lambda: testing.blocks_model("mlp", 1, 8, 1, seq=4), ValueError, "seq must be 1 for the mlp"),
        (lambda: testing.blocks_model("mlp", 0, 8, 1), ValueError, "batch"),
        (lambda: testing.filled((2, 2), "x"), TypeError, "seed must be a float"),
        (lambda: testing.block_weights("mlp", 8, -1), ValueError, "index"),
    ],
)
def test_testing_names_the_argument_it_cannot_take(call, error, message):
    with pytest.raises(error, match=message):
        call()


# --- seed/floors.py --------------------------------------------------------------------


def test_mlp_floor_is_the_stored_inputs_and_17_block_inputs():
    w = Workload("mlp", batch=4096, dim=256, blocks=8)
    assert floors.floor(w) == (8 - 1 + 17) * w.block_input_bytes()


def test_mlp_floor_with_weight_grads_counts_finished_gradients_where_they_outweigh_an_input():
    w = Workload("mlp", batch=64, dim=64, blocks=4, weight_grads=True)  # a block's gradients: 8 inputs
    x, grads, dw2 = w.block_input_bytes(), 4 * 8 * 64 * 64, 4 * 4 * 64 * 64
    # Worst at the first block: no stored input, three blocks' gradients, its cotangent.
    assert floors.floor(w) == 3 * grads + 17 * x + x + dw2


def test_transformer_floor_counts_two_score_matrices_when_they_dominate():
    w = Workload("transformer", batch=2, dim=8, blocks=3, seq=64)  # scores: 8 block inputs
    x, s = w.block_input_bytes(), 4 * 2 * 64 * 64
    assert floors.floor(w) == 2 * x + 7 * x + 2 * s


@pytest.mark.parametrize(
    "w",
    [
        Workload("mlp", 256, 64, 4),
        Workload("mlp", 128, 256, 4, weight_grads=True),
        Workload("transformer", 2, 32, 4, seq=128),
    ],
    ids=str,
)
def test_floor_is_below_the_checkpointed_peak_at_throttle_0(compiled, w):
    sc = strategies.build("nuvec", w)
    sc.evaluate(sc.step(sc.inputs))
    peak_ = rounds.peak(lambda: sc.step(sc.inputs), lambda o: nv.eval(o, throttle=0), mlx_measure.MlxProbe())
    assert floors.floor(w) <= peak_


# --- seed/rows.py ----------------------------------------------------------------------


def test_row_carries_the_workload_its_floor_and_the_peak_over_it():
    r = rows.row("strategies", "mlx", "nuvec", SEED, rounds.measured([192 * MiB], [1.0], 2.0), traces=1)
    assert rows.workload_of(r) == SEED
    assert r["floor"] == 96 * MiB and r["peak_to_floor"] == 2.0 and r["traces"] == 1


def test_an_error_row_has_no_measurement():
    r = rows.row("strategies", "jax-jit", "none", SEED, {"error": "no jax"})
    assert "peak_to_floor" not in r and r["error"] == "no jax"


def test_ratios_are_against_the_plain_step():
    got = rows.add_ratios(
        [
            rows.row("s", "mlx", s, SEED, rounds.measured([p], [t], 0))
            for s, p, t in (("none", 100, 1.0), ("nuvec", 25, 1.5))
        ]
    )
    assert [(r["peak_ratio"], r["time_ratio"]) for r in got] == [(1, 1), (0.25, 1.5)]


def test_no_ratios_when_the_plain_step_failed():
    got = rows.add_ratios(
        [
            rows.row("s", "jax-jit", "none", SEED, {"error": "x"}),
            rows.row("s", "jax-jit", "checkpoint", SEED, rounds.measured([1], [1], 0)),
        ]
    )
    assert "peak_ratio" not in got[1]


# --- core/rounds.py --------------------------------------------------------------------


def test_summary_keeps_every_repeat_in_order():
    assert rounds.summary([3, 1, 2, 10]) == {"median": 2.5, "min": 1, "max": 10, "repeats": [3, 1, 2, 10]}


def arange_step(n: int, k: int):
    return lambda: [mx.arange(i, i + n, dtype=mx.float32) for i in range(k)]


def test_peak_of_a_fake_workload_is_its_known_allocation():
    assert rounds.peak(arange_step(1000, 3), mx.eval, mlx_measure.MlxProbe()) == 3 * 1000 * 4


def test_peak_counts_a_freed_temporary_but_not_the_memory_held_before():
    held = mx.ones((1 << 16,))
    mx.eval(held)
    # A 4000-byte arange, freed once it is reduced to 4 bytes.
    assert rounds.peak(lambda: mx.arange(1000, dtype=mx.float32).sum(), mx.eval, mlx_measure.MlxProbe()) == 4004
    del held


class RecordingProbe:
    method, notes = "records", {}

    def __init__(self, events):
        self.events = events

    def start(self):
        self.events.append("peak")

    def stop(self):
        return 1

    def done(self):
        self.events.append("done")


def test_measure_takes_every_peak_round_robin_before_any_time():
    events = []
    cases = {name: (lambda name=name: events.append(name), lambda out: None) for name in ("a", "b")}
    rounds.measure(cases, 2, RecordingProbe(events))
    warmup, peaks = events[:2], events[2:10]
    assert warmup == ["a", "b"]
    assert peaks == ["peak", "a", "peak", "b", "peak", "a", "peak", "b"]
    assert events[10] == "done" and "peak" not in events[11:]


def test_measure_reports_progress_after_every_step():
    calls = []
    rounds.measure({"a": (lambda: None, lambda out: None)}, 3, RecordingProbe([]), progress=lambda: calls.append(1))
    assert len(calls) == 1 + 2 * 3


def test_measure_rejects_zero_repeats():
    with pytest.raises(ValueError, match="repeats"):
        rounds.measure({}, 0, RecordingProbe([]))


class Clock:
    """``time.perf_counter`` for rounds.seconds: a step advances it by what it says it takes."""

    def __init__(self, monkeypatch):
        self.now, self.calls = 0.0, 0
        monkeypatch.setattr(rounds.time, "perf_counter", lambda: self.now)

    def step(self, seconds):
        def run():
            self.calls += 1
            self.now += seconds

        return run


def test_a_short_step_is_timed_as_the_mean_of_steps_that_fill_the_minimum(monkeypatch):
    clock = Clock(monkeypatch)
    assert rounds.seconds(clock.step(0.002), min_seconds=0.05) == pytest.approx(0.002)
    assert clock.calls == 1 + 25  # the first call, then as many as its time says fill 50 ms


def test_a_long_step_is_timed_once(monkeypatch):
    clock = Clock(monkeypatch)
    assert rounds.seconds(clock.step(0.02), min_seconds=0.01) == pytest.approx(0.02)
    assert clock.calls == 1


def test_parts_are_the_mean_per_call_since_a_snapshot():
    parts = rounds.Parts()
    parts.add(dispatch=5.0, evaluation=50.0)  # before the snapshot: not counted
    before = parts.snapshot()
    assert parts.mean_since(before) == {}
    parts.add(dispatch=1.0, evaluation=3.0)
    parts.add(dispatch=3.0, evaluation=5.0)
    assert parts.mean_since(before) == {"dispatch": 2.0, "evaluation": 4.0}


@pytest.mark.parametrize("seconds, expected", [(0.2, [4.0, 5.0]), (0.0625, [5.0, 8.0])])
def test_measure_summarises_each_timed_repeats_parts_over_its_own_calls(monkeypatch, seconds, expected):
    """The parts of the warm-up and peak steps (calls 1-3) are left out; each timed repeat's mean is over
    the calls it made: one where a call fills the minimum time, else the first and the two that fill it."""
    clock, costs = Clock(monkeypatch), iter(range(1, 100))
    parts, advance = rounds.Parts(), clock.step(seconds)

    def step():
        parts.add(dispatch=float(next(costs)))
        advance()

    measured = rounds.measure({"a": (step, lambda out: None)}, 2, RecordingProbe([]), parts={"a": parts})
    assert measured["a"]["parts"] == {"dispatch": rounds.summary(expected)}


# --- core/mlx_measure.py -----------------------------------------------------------------


def test_run_cases_summarises_every_case():
    measured = mlx_measure.run_cases({"a": (arange_step(500, 2), mx.eval), "b": (arange_step(250, 1), mx.eval)}, 3)
    assert measured["a"]["peak"] == {"median": 4000, "min": 4000, "max": 4000, "repeats": [4000] * 3}
    assert measured["b"]["peak"]["median"] == 1000
    t = measured["a"]["time"]
    assert 0 < t["min"] <= t["median"] <= t["max"] and len(t["repeats"]) == 3


def test_rank_peaks_are_added_only_under_several_processes():
    cases = {"a": {"peak": {"median": 5}}}
    assert mlx_measure.add_rank_peaks(cases) == {"a": {"peak": {"median": 5}}}


def test_split_times_the_dispatch_and_the_evaluation_apart(monkeypatch):
    clock, parts = Clock(monkeypatch), rounds.Parts()
    step, evaluate = mlx_measure.split(clock.step(0.01), lambda out: clock.step(0.03)(), parts)
    evaluate(step())
    evaluate(step())
    assert parts.mean_since(({}, 0)) == pytest.approx({"dispatch": 0.01, "evaluation": 0.03})


# --- core/throttle.py, core/options.py, core/environment.py ------------------------------


@pytest.mark.parametrize(("text", "nbytes"), [("inf", math.inf), ("0", 0), ("64", 64 << 20), ("0.5", 1 << 19)])
def test_throttle_option_reads_mib_or_inf(text, nbytes):
    assert throttle.parse_throttle(text) == nbytes


@pytest.mark.parametrize("text", ["-1", "nan", "lots"])
def test_throttle_option_rejects_what_is_not_mib_or_inf(text):
    with pytest.raises(ValueError):
        throttle.parse_throttle(text)


@pytest.mark.parametrize(
    ("text", "nbytes"), [("16GiB", 16 << 30), ("512MiB", 512 << 20), ("3", 3 << 20), ("0", 0), ("1.5GiB", 1536 << 20)]
)
def test_memory_sizes_read_units_or_bare_mib(text, nbytes):
    assert options.memory_size(text) == nbytes


@pytest.mark.parametrize("text", ["-1", "inf", "16GB!", "lots"])
def test_memory_sizes_reject_what_is_not_a_size(text):
    with pytest.raises(ValueError):
        options.memory_size(text)


def test_memory_sizes_print_whole_gib_or_mib():
    assert [options.size_text(n) for n in (8 << 30, 3 << 20, 1536 << 20)] == ["8GiB", "3MiB", "1536MiB"]


def test_environment_names_command_mlx_backend_device_and_blas():
    env = environment.environment("nuvec-mlx-bench --suite full")
    assert env["command"] == "nuvec-mlx-bench --suite full" and env["mlx"] == mx.__version__
    assert env["backend"] in ("cpu", "cuda", "metal") and env["device"]
    if env["backend"] == "cpu":
        assert env["blas"] != "unknown"


def test_command_line_quotes_its_arguments():
    assert environment.command_line("nuvec-mlx-bench", ["--depths", ""]) == "nuvec-mlx-bench --depths ''"


# --- seed/strategies.py ----------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("weight_grads", [False, True])
def test_every_strategy_computes_the_same_step(compiled, model, weight_grads):
    w = Workload(model, batch=8, dim=16, blocks=3, seq=4 if model == "transformer" else 1, weight_grads=weight_grads)

    def outputs(strategy):
        sc = strategies.build(strategy, w)
        out = sc.step(sc.inputs)
        sc.evaluate(out)
        return out

    expected = outputs("none")
    assert len(expected) == (w.blocks * len(block_weights(w, 0)) + 2 if weight_grads else 2)
    for strategy in strategies.STRATEGIES[1:]:
        assert_close(outputs(strategy), expected, rtol=1e-5)


def test_build_rejects_an_unknown_strategy():
    with pytest.raises(ValueError, match="strategy must be one of"):
        strategies.build("remat", TINY)


@pytest.mark.parametrize("model", MODELS)
def test_the_module_form_computes_the_flat_steps_loss_and_weight_gradients(model):
    w = Workload(model, batch=2, dim=16, blocks=2, seq=8 if model == "transformer" else 1, weight_grads=True)
    sc = strategies.build("none", w)
    flat = sc.step(sc.inputs)
    module, x = strategies.module(w)
    value, grads = nv.value_and_grad(module, testing.blocks_loss)(module, x)
    assert_close(value, flat[-1], 1e-5)
    ours = [g.T for _, g in tree_flatten(grads)]
    assert_close(ours, flat[: len(ours)], 1e-5)


# --- peak/depth.py ---------------------------------------------------------------------


def depth_row(blocks: int, peaks: list[float], strategy: str = "nuvec") -> dict:
    w = Workload("mlp", batch=256, dim=64, blocks=blocks)  # a block input: 64 KiB
    return rows.row(
        "depth", "mlx", strategy, w, rounds.measured([p * w.block_input_bytes() for p in peaks], [1.0] * len(peaks), 0)
    )


def test_median_growth_is_per_added_block_between_consecutive_depths():
    got = [depth_row(4, [10, 10, 12]), depth_row(8, [14, 14, 14]), depth_row(16, [30, 18, 18])]
    assert depth.median_growth(got) == {"nuvec": [1.0, 0.5]}


def test_repeat_growth_pairs_the_repeats_of_two_depths_by_index():
    got = [depth_row(4, [10, 10, 12]), depth_row(8, [14, 14, 14]), depth_row(16, [30, 18, 18])]
    assert depth.repeat_growth(got, "nuvec") == [[1.0, 2.0], [1.0, 0.5], [0.5, 0.5]]


# --- peak/targets.py -------------------------------------------------------------------


def fake_row(
    strategy: str,
    peaks: list[float],
    time_: float,
    framework: str = "mlx",
    model: str = "mlp",
    weight_grads: bool = False,
) -> dict:
    w = Workload(model, batch=4096, dim=256, blocks=8, seq=1 if model == "mlp" else 16, weight_grads=weight_grads)
    return rows.row("strategies", framework, strategy, w, rounds.measured(peaks, [time_], 0))


def checks(got: list[dict], backend: str, throttle_: float = 0) -> str:
    by_framework = {}
    for r in got:
        by_framework.setdefault(r["framework"], []).append(r)
    for group in by_framework.values():
        rows.add_ratios(group)
    return "\n".join(targets.checks(got, backend, throttle_))


def test_cpu_targets_bound_the_mlp_peak_time_and_spread():
    text = checks([fake_row("none", [200], 1.0), fake_row("nuvec", [32, 34, 36], 1.6)], "cpu")
    assert "input grad, compiled: nuvec peak / plain peak: 0.170 (target <= 0.17): met" in text
    assert "nuvec time / plain time: 1.600 (target <= 1.55): MISSED by 0.050" in text
    assert "nuvec peak max / min over the repeats: 1.125 (target <= 1.1): MISSED by 0.025" in text


def test_a_missed_target_says_by_how_much_and_at_other_shapes_that_it_was_set_for_others():
    """A MISSED line explains itself: the miss, as a multiple of the target, and, where the run's shapes are not
    those the target was set for (the seed's, on a CPU), which those were and that the miss is a hint there."""
    seed = checks([fake_row("none", [200], 1.0), fake_row("nuvec", [40], 1.6)], "cpu")
    assert "nuvec time / plain time: 1.600 (target <= 1.55): MISSED by 0.050 (1.03x the target)\n" in seed + "\n"
    small = [dict(r, batch=512, dim=64) for r in (fake_row("none", [200], 1.0), fake_row("nuvec", [40], 2.6))]
    assert (
        "- mlp B=512 D=64 8 blocks, input grad, compiled: nuvec time / plain time: 2.600 (target <= 1.55): "
        "MISSED by 1.050 (1.68x the target); set for mlp B=4096 D=256 8 blocks: at this run's shapes a hint, "
        "not the verdict"
    ) in checks(small, "cpu")
    policy = checks([fake_row("none", [100], 1.0), fake_row("none-policy", [93], 1.0)], "cpu")
    assert "mx.eval peak: 0.930 (target 1 ± 0.01): MISSED by 0.060 (7.00x the distance from 1 allowed)\n" in (
        policy + "\n"
    )


def test_gpu_targets_bound_the_time_with_weight_grads_tighter():
    text = checks(
        [fake_row("none", [200], 1.0, weight_grads=True), fake_row("nuvec", [40], 1.3, weight_grads=True)], "cuda"
    )
    assert "nuvec peak / plain peak: 0.200 (target <= 0.22): met" in text
    assert "nuvec time / plain time: 1.300 (target <= 1.25): MISSED by 0.050" in text


def test_gpu_targets_compare_nuvecs_absolute_peak_with_torch_compile():
    text = checks(
        [
            fake_row("none", [200], 1.0),
            fake_row("nuvec", [44], 1.2),
            fake_row("none", [100], 1.0, "torch-compile"),
            fake_row("checkpoint", [40], 1.2, "torch-compile"),
        ],
        "metal",
    )
    assert "nuvec peak / torch.compile+checkpoint peak (absolute): 1.100 (target <= 1): MISSED by 0.100" in text


def test_gpu_target_for_the_transformer_is_its_peak_ratio():
    text = checks(
        [fake_row("none", [100], 1.0, model="transformer"), fake_row("nuvec", [19], 2.0, model="transformer")], "cuda"
    )
    assert (
        "transformer B=4096 T=16 D=256 8 blocks, input grad, compiled: nuvec peak / plain peak: 0.190 "
        "(target <= 0.2): met" in text
    )
    assert "nuvec time" not in text


def test_plain_nv_eval_must_keep_the_peak_within_one_percent_either_way():
    text = checks([fake_row("none", [100], 1.0), fake_row("none-policy", [98], 1.02)], "cpu")
    assert "plain nv.eval peak / mx.eval peak: 0.980 (target 1 ± 0.01): MISSED by 0.010" in text
    assert "plain nv.eval time / mx.eval time: 1.020 (target <= 1.03): met" in text


def test_depth_target_is_the_worst_growth_over_every_repeat():
    text = checks([depth_row(4, [10, 10]), depth_row(8, [14, 15])], "cpu")
    assert (
        "depth sweep (4, 8 blocks; a block input 64 KiB): nuvec peak growth per added block (block inputs), "
        "between consecutive "
        "depths, worst over every repeat: 1.250 (target <= 1.1): MISSED by 0.150" in text
    )


@pytest.mark.parametrize("throttle_, said", [(math.inf, "inf"), (None, "default")])
def test_targets_say_when_nv_eval_was_mx_eval_itself(throttle_, said):
    text = checks([fake_row("none", [100], 1.0), fake_row("none-policy", [100], 1.3)], "cpu", throttle_=throttle_)
    assert f"at throttle {said} `nv.eval` of a step without stages runs `mx.eval` itself" in text
    assert "runs `mx.eval` itself" not in checks(
        [fake_row("none", [100], 1.0), fake_row("none-policy", [100], 1.3)], "cpu", throttle_=0
    )


def test_targets_list_what_the_run_could_not_check():
    text = checks([fake_row("none", [200], 1.0), fake_row("nuvec", [40], 1.2)], "cuda")
    assert (
        "- not checked (a row it needs did not run): mlp B=4096 D=256 8 blocks, input grad, compiled: "
        "nuvec peak / torch.compile+checkpoint peak (absolute)" in text
    )


def test_targets_heading_speaks_of_this_runs_shapes():
    lines = targets.checks(rows.add_ratios([fake_row("none", [1], 1.0), fake_row("nuvec", [1], 1.0)]), "cpu", 0)
    assert lines[1].startswith("Targets on this run's shapes (backend cpu;")


# --- peak/report.py --------------------------------------------------------------------


def test_checkpointed_peaks_set_the_peers_beside_nuvec_and_the_floor():
    got = [fake_row("nuvec", [192 * MiB], 1.0), fake_row("checkpoint", [96 * MiB], 1.0, "torch-compile")]
    lines = report.checkpointed_peaks(got)
    assert (
        lines[-1] == "| mlp B=4096 D=256 8 blocks, input grad, compiled | 96.0 | 192.0 (2.00) | 96.0 (1.00) | not run |"
    )


def test_the_table_shows_each_steps_dispatch_and_evaluation():
    r = rows.row(
        "strategies",
        "mlx",
        "nuvec",
        SEED,
        rounds.measured(
            [MiB], [0.01], 0, parts=[{"dispatch": 0.002, "evaluation": 0.008}, {"dispatch": 0.004, "evaluation": 0.006}]
        ),
    )
    line = report.table(rows.add_ratios([r]))[-1]
    assert line.endswith("| 3.00 (2.00–4.00) | 7.00 (6.00–8.00) |")


def test_plot_caption_names_command_backend_device_mlx_and_blas():
    from nuvec_mlx_bench.core.figures import caption

    env = environment.environment("nuvec-mlx-bench --suite full")
    text = caption(env)
    assert all(env[k] in text for k in ("command", "backend", "device", "mlx", "blas"))


# --- peak/command.py -------------------------------------------------------------------


def test_smallest_run_writes_table_json_markdown_and_plots(tmp_path, capsys, compiled):
    assert peak.main([*SMALLEST, "--seq", "8", "--depths", "2,4", "--out", str(tmp_path)]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert {"results.json", "results.md", "peak_by_strategy.png", "peak_vs_depth.png", "time_vs_peak.png"} <= names
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["environment"]["mlx"] == mx.__version__
    table = [r for r in saved["rows"] if r["section"] == "strategies"]
    assert {r["strategy"] for r in table} == set(strategies.STRATEGIES)
    assert {(r["model"], r["weight_grads"]) for r in table} == {(m, g) for m in MODELS for g in (False, True)}
    assert all(r["traces"] == 1 for r in saved["rows"])
    assert all(r["peak_ratio"] == 1 for r in table if r["strategy"] == "none")
    assert all(len(r["peak"]["repeats"]) == 1 and r["floor"] > 0 for r in saved["rows"])
    for r in saved["rows"]:  # every MLX step's time in its two parts, each repeat's
        parts = r["parts"]
        assert set(parts) == {"dispatch", "evaluation"} and len(parts["dispatch"]["repeats"]) == 1
        assert 0 < parts["dispatch"]["median"] and 0 < parts["evaluation"]["median"]
    assert not any(n.startswith("- partial") for n in saved["notes"])
    out = capsys.readouterr().out
    assert "| nuvec |" in out and "Targets on this run's shapes" in out and "Checkpointed peaks" in out
    assert "dispatch ms | evaluation ms |" in out


@pytest.mark.parametrize("eager", [False, True], ids=["compiled", "eager"])
def test_the_benchmark_does_not_warn_of_its_own_unstaged_strategy(tmp_path, eager, compiled):
    """``nuvec-nopolicy`` evaluates nuvec's checkpoints unstaged by design (``strategies.unstaged_eval``):
    a run shows no NotStagedWarning. It showed one per workload and place its outputs were dropped (12 in
    a run of the four workloads, among the progress bars)."""
    argv = [*SMALLEST, "--seq", "8", "--depths", "2", "--out", str(tmp_path), *(["--eager"] if eager else [])]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        peak.run(argv)
        gc.collect()  # the last steps' registrations go too
    assert not [str(w.message)[:80] for w in seen if issubclass(w.category, nv.NotStagedWarning)]


def test_interrupted_run_leaves_its_finished_parts(tmp_path, monkeypatch):
    real = peak.mlx_rows

    def interrupt_the_depth_sweep(w, chosen, repeats, section):
        if section == "depth":
            raise KeyboardInterrupt
        return real(w, chosen, repeats, section)

    monkeypatch.setattr(peak, "mlx_rows", interrupt_the_depth_sweep)
    with pytest.raises(KeyboardInterrupt):
        peak.run(
            [*SMALLEST, "--models", "mlp", "--strategies", "none,nuvec", "--depths", "2,4", "--out", str(tmp_path)]
        )
    saved = json.loads((tmp_path / "results.json").read_text())
    assert {(r["weight_grads"], r["strategy"]) for r in saved["rows"]} == {
        (False, "none"),
        (False, "nuvec"),
        (True, "none"),
        (True, "nuvec"),
    }
    assert saved["notes"][0] == "- partial: 2 of 4 parts measured (the run was still going)"
    assert "partial" in (tmp_path / "results.md").read_text()


#: A run of the plain step alone, evaluated with mx.eval and with nv.eval.
PLAIN_MLP = [*SMALLEST, "--models", "mlp", "--weight-grads", "off", "--strategies", "none,none-policy", "--depths", ""]


def test_without_a_throttle_option_the_run_keeps_nuvecs_defaults(tmp_path, monkeypatch):
    # A plain step through nv.eval must stay mx.eval, as a user gets it: no throttle is set.
    real, seen = peak.mlx_rows, []
    monkeypatch.setattr(
        peak, "mlx_rows", lambda *a: (seen.append(nv.memory.current_throttle(staged=False)), real(*a))[1]
    )
    peak.run([*PLAIN_MLP, "--out", str(tmp_path)])
    assert seen == [math.inf]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["environment"]["nv.eval throttle"].startswith("nuvec_mlx's default")


@pytest.mark.parametrize("flag", ["--throttle", "--budget"])
def test_throttle_option_is_nv_evals_throttle_for_the_run_only(tmp_path, monkeypatch, flag):
    real, seen = peak.mlx_rows, []

    def record_the_throttle(*args):
        seen.append(nv.memory.current_throttle())
        return real(*args)

    monkeypatch.setattr(peak, "mlx_rows", record_the_throttle)
    default = nv.memory.current_throttle()
    peak.run([*PLAIN_MLP, flag, "inf", "--out", str(tmp_path)])
    assert seen == [math.inf] and nv.memory.current_throttle() == default
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["environment"]["nv.eval throttle"] == "inf (no throttle: the stages alone)"
    assert any("runs `mx.eval` itself" in n for n in saved["notes"])


def test_weight_grads_on_gives_the_transformer_its_weight_gradients():
    args = peak.parse_args(["--models", "transformer", "--weight-grads", "on"])
    assert [(w.model, w.weight_grads) for w in args.workloads] == [("transformer", True)]


def test_full_suite_runs_the_large_mlp_and_transformer_15_times_and_the_peers_3():
    args = peak.parse_args(["--suite", "full", "--weight-grads", "off", "--peers", "torch-eager"])
    assert [(w.model, w.batch, w.seq, w.dim) for w in args.workloads] == [
        ("mlp", 4096, 1, 256),
        ("mlp", 16384, 1, 1024),
        ("transformer", 8, 2048, 1024),
    ]
    assert (args.repeats, args.peer_repeats) == (15, 3)


def test_overrides_that_make_two_workloads_equal_measure_it_once():
    args = peak.parse_args(
        [
            "--suite",
            "full",
            "--models",
            "mlp",
            "--batch",
            "16",
            "--dim",
            "32",
            "--weight-grads",
            "off",
            "--peers",
            "none",
        ]
    )
    assert args.workloads == [Workload("mlp", 16, 32, 8)]


def test_auto_peers_under_eager_are_none():
    assert peak.parse_args(["--eager"]).peers == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategies", "none,remat"], "--strategies: unknown ['remat']"),
        (["--strategies", "nuvec"], "--strategies must include none"),
        (["--models", "mlp", "--seq", "8"], "--seq: only the transformer has a sequence"),
        (["--models", "transformer", "--depths", "4,8"], "--depths: the depth sweep runs the mlp"),
        (["--eager", "--peers", "torch-eager"], "--eager: the peers measure counterparts of the compiled step"),
        (["--peers", "none", "--peer-repeats", "5"], "--peer-python and --peer-repeats need peers to run"),
        (["--strategies", "none,mx", "--throttle", "0"], "--throttle: no strategy evaluates with nv.eval"),
        (["--peers", "tensorflow"], "--peers: choose from"),
        (["--batch", "0"], "batch must be >= 1"),
        (["--depths", "0,4"], "blocks must be >= 1"),
        (["--peer-repeats", "0"], "--peer-repeats: must be an int >= 1"),
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(v),
)
def test_an_option_a_workload_cannot_honour_is_an_error(capsys, argv, message):
    with pytest.raises(SystemExit):
        peak.parse_args(argv)
    assert message in capsys.readouterr().err


# --- sweep/command.py ------------------------------------------------------------------


def test_throttle_sweep_measures_every_strategy_at_every_throttle(tmp_path, compiled):
    assert (
        sweep.main(
            [
                "--batch",
                "16",
                "--dim",
                "32",
                "--blocks",
                "2",
                "--throttles",
                "inf,0",
                "--strategies",
                "none,nuvec",
                "--repeats",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    saved = json.loads((tmp_path / "throttle_sweep.json").read_text())
    assert [(r["throttle"], r["strategy"]) for r in saved["rows"]] == [
        (math.inf, "none"),
        (math.inf, "nuvec"),
        (0, "none"),
        (0, "nuvec"),
    ]
    assert all(r["section"] == "throttles" and "time_vs_plain_mx_eval" in r for r in saved["rows"])
    assert "| inf (no throttle: the stages alone) | nuvec |" in (tmp_path / "throttle_sweep.md").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategies", "nuvec"], "none included"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--budgets", "inf,-1"], "a throttle must be 'inf' or MiB >= 0"),
    ],
)
def test_throttle_sweep_rejects_what_it_cannot_run(capsys, argv, message):
    with pytest.raises(SystemExit):
        sweep.parse_args(argv)
    assert message in capsys.readouterr().err


# --- plan/rules.py and plan/command.py ---------------------------------------------------


def test_a_twin_shares_the_models_arrays_and_takes_no_memory():
    built = rules.build("mlp", dict(batch=8, dim=16, blocks=3))
    mx.synchronize()
    before = mx.get_active_memory()
    twin = rules.twin(built)
    mx.eval(twin.parameters())
    assert mx.get_active_memory() == before
    assert all(
        a is b for (_, a), (_, b) in zip(tree_flatten(twin.parameters()), tree_flatten(built.model.parameters()))
    )


@pytest.mark.parametrize("rule", rules.ALL_RULES)
def test_every_fixed_rule_of_the_plan_sweep_computes_the_same_step(rule, compiled):
    built = rules.build("mlp", dict(batch=8, dim=16, blocks=5))
    reference = nv.value_and_grad(built.model, built.loss)(built.model, built.batch)[0]
    case = rules.case(built, rule)
    value, _ = case.step()
    assert_close(value, reference, 1e-6)
    layers = rules.holder(case.model).layers
    checkpointed = [b for b in layers if nv.is_checkpointed(b)]
    assert len(checkpointed) == {"every block": 5, "every 2nd": 3, "sqrt(n) segments": 3, "none": 0}.get(rule, 5)
    assert not any(nv.is_checkpointed(b) for b in built.model.layers)  # the planned model stays as it was


@pytest.mark.parametrize("rule", ["every block", "every 2nd", "sqrt(n) segments", "none"])
def test_with_an_optimizer_every_rule_updates_its_twin_as_optimizer_update(rule, compiled):
    built = rules.build("mlp", dict(batch=8, dim=16, blocks=5))
    case = rules.case(built, rule, "adam")
    case.step()
    reference = rules.twin(built)
    opt = rules.OPTIMIZERS["adam"]()
    loss_value, grads = nn.value_and_grad(reference, built.loss)(reference, built.batch)
    opt.update(reference, grads)
    mx.eval(reference.parameters(), loss_value)
    # Block by block in order (segments nest the blocks, in their order).
    assert_close(
        [a for _, a in tree_flatten(case.model.parameters())],
        [a for _, a in tree_flatten(reference.parameters())],
        1e-6,
    )


def test_the_plan_sweeps_cases_measure_each_step_as_a_training_loop_runs_it(compiled):
    """Round-robin, every case's step peaks as it does alone. A step that left work unevaluated for the
    next (its update: the weights, 4 MiB, 85% of this peak) would be far off; on a busy CPU, MLX's
    evaluator makes the same step's peak vary by a few block inputs (128 KiB each), hence 15%."""
    built = rules.build("mlp", plan.SUITES["small"]["mlp"])
    cases = {rule: rules.case(built, rule, "adam") for rule in ("every block", "none")}
    swept = mlx_measure.run_cases({r: (c.step, c.finish) for r, c in cases.items()}, repeats=3)["every block"]
    alone = rules.case(built, "every block", "adam")
    alone.step()
    peaks = [rounds.peak(alone.step, mlx_measure.finished(alone.finish), mlx_measure.MlxProbe()) for _ in range(3)]
    assert abs(swept["peak"]["median"] - statistics.median(peaks)) <= 0.15 * statistics.median(peaks)


def test_set_up_rejects_an_unknown_rule():
    built = rules.build("mlp", dict(batch=8, dim=16, blocks=2))
    with pytest.raises(ValueError, match="rule must be a plan or one of"):
        rules.set_up(rules.twin(built), "every 3rd")


@pytest.mark.parametrize("argv", [["--models", "gpt"], ["--budgets", "1"], ["--repeats", "0"], ["--optimizer", "sgd"]])
def test_the_plan_sweep_rejects_what_it_cannot_run(argv):
    with pytest.raises(SystemExit):
        plan.parse_args(argv)


@pytest.mark.slow
def test_the_plan_sweeps_smallest_run_plans_every_budget_and_writes_its_results(tmp_path, compiled):
    got = plan.run(["--models", "mlp", "--budgets", "2", "--repeats", "1", "--out", str(tmp_path)])
    planned = [r for r in got if "budget" in r]
    assert len(planned) == 2 and {r["case"] for r in got} >= set(rules.ALL_RULES)
    assert all(r["fits"] and r["planned_measured"] <= r["budget"] for r in planned)
    assert (tmp_path / "plan_sweep.png").stat().st_size > 0 and "Planner sweep" in (tmp_path / "results.md").read_text()


def test_the_benchmark_reports_leave_matplotlib_s_backend_as_the_caller_chose():
    code = (
        "import matplotlib; matplotlib.use('svg'); "
        "import nuvec_mlx_bench.peak.report, nuvec_mlx_bench.train.report, nuvec_mlx_bench.plan.command; "
        "print(matplotlib.get_backend())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "svg"


# --- probes/ -----------------------------------------------------------------------------


def load_probe(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"probe_{name}", BENCH / "probes" / f"{name}.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def test_every_probe_is_one_this_file_runs():
    assert {p.stem for p in (BENCH / "probes").glob("*.py")} == {
        "attention_backward",
        "gated_delta_time",
        "head_time",
        "host_time",
        "strategy_runs",
        "train_timeline",
    }


@pytest.mark.slow
def test_the_host_time_probe_runs_at_this_commit(tmp_path, capsys):
    results = load_probe("host_time").main(
        ["--layers", "2", "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "t.json")]
    )
    assert set(results[2]) == {"nuvec", "nuvec ahead0", "mx.compile", "mlx-lm"}
    assert all(len(r["host cpu"]["repeats"]) == 2 and r["dispatch"]["median"] > 0 for r in results[2].values())
    assert "| nuvec |" in capsys.readouterr().out and json.loads((tmp_path / "t.json").read_text())["results"]


def test_the_head_time_probe_times_the_head_four_ways_with_the_same_gradient(capsys):
    got = load_probe("head_time").main(["--tokens", "512", "--vocab", "4096", "--repeats", "1", "--trainable"])
    assert set(got) == {"whole", "recomputed 128", "nuvec 128", "unstaged 128"}
    assert all(r["seconds"] > 0 and r["difference"] < 1e-2 for r in got.values())
    assert "chunks of 128 tokens" in capsys.readouterr().out  # 4096 / (8 x 128): 4 chunks of the 512 tokens


def test_the_attention_probe_measures_each_shape_and_rejects_a_malformed_one(capsys):
    found = load_probe("attention_backward").main(["--shapes", "64:64:2:1,32:128:4:2", "--head-dim", "16"])
    assert len(found) == 2 and all(re.fullmatch(r"peak [\d,]+ MiB, \d+\.\d\d s", r) for r in found.values())
    assert "queries 32 keys 128 heads 4 kv 2 dim 16: peak" in capsys.readouterr().out
    for bad in ("64:32:2:1", "64:64:3:2", "64:64:2"):
        with pytest.raises(SystemExit):
            load_probe("attention_backward").main(["--shapes", bad])


def test_the_attention_probe_measures_nuvec_s_query_chunks_beside_mlx_s_call(capsys):
    """On the CPU attention trains unfused: chunks of 128 queries hold a fraction of the whole call's scores."""
    found = load_probe("attention_backward").main(
        ["--shapes", "1024:1024:4:1", "--head-dim", "16", "--chunks", "0,128"]
    )
    whole, chunked = (float(r.split()[1].replace(",", "")) for r in found.values())
    assert list(found) == [
        "queries 1024 keys 1024 heads 4 kv 1 dim 16",
        "queries 1024 keys 1024 heads 4 kv 1 dim 16 chunks 128",
    ]
    assert chunked < whole / 2, found
    with pytest.raises(SystemExit):
        load_probe("attention_backward").main(["--shapes", "64:64:2:1", "--chunks", "-8"])


@pytest.mark.parametrize("way", ["nuvec", "mlx-lm"])
def test_the_gated_delta_probe_times_each_repeat_of_either_way(way, capsys):
    seconds = load_probe("gated_delta_time").main(["--tokens", "40", "--heads", "2", "--dim", "8", "--way", way])
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    out = capsys.readouterr().out
    assert f"{way} T=40 eager repeat 2:" in out and re.search(r"MiB; \d+\.\d\d operations per token", out), out


@pytest.mark.slow
def test_the_strategy_probe_says_whether_each_length_ran_or_what_it_raised(monkeypatch):
    probe = load_probe("strategy_runs")
    argv = ["--config", "qwen3-0.6b", "--layers", "1", "--batch", "1", "--strategy", "nuvec", "--seqs", "8", "16"]
    ran = probe.main(argv)
    assert [line.split(": ")[0] for line in ran] == ["qwen3-0.6b lora nuvec B=1 T=8", "qwen3-0.6b lora nuvec B=1 T=16"]
    assert all(": ran, loss " in line for line in ran)

    def refused(self, batch):
        raise RuntimeError("[scaled_dot_product_attention] Does not support VJP with respect to mask")

    monkeypatch.setattr(probe.Case, "step", refused)
    assert probe.main(argv[:-1])[0].endswith(
        "raised RuntimeError: [scaled_dot_product_attention] Does not support VJP with respect to mask"
    )


@pytest.mark.slow
def test_the_train_timeline_probe_runs_at_this_commit(capsys):
    load_probe("train_timeline").main(["llama", "lora", "float32"])
    assert "backward pass of block" in capsys.readouterr().out


def test_the_train_timeline_probe_steps_with_the_chunks_it_is_given(capsys):
    probe = load_probe("train_timeline")

    def chunk_stages(chunks: str) -> int:
        return sum(r.kind == "chunk" for r in probe.main(["llama", "lora", "float32", "--chunks", chunks]).readings)

    assert chunk_stages("mlp=32") > chunk_stages("mlp=0")
    for argv, message in [
        (["--strategy", "mlx-lm", "--chunks", "mlp=32"], "a nuvec strategy's setting"),
        (["--chunks", "mlp"], "expected name=size"),
        (["--chunks", "ffn=32"], "Chunks has the settings"),
    ]:
        with pytest.raises(SystemExit):
            probe.main(["llama", "lora", "float32", *argv])
        assert message in capsys.readouterr().err, argv


def test_the_train_timeline_probe_bounds_a_deeper_step_by_its_highest_stage_and_the_other_blocks_inputs(capsys):
    """At --depth 6 from 2 blocks: the highest stage's peak plus 4 more blocks' inputs (1,024 tokens x 64 x 2
    bytes each). That this bounds the deeper step was measured on the GPU (results/h100/2026-12-07-8k-chunk-levers);
    at this test's sizes the allocator's own state moves a stage by more than a block's input."""
    probe = load_probe("train_timeline")
    sizes = ["--hidden", "64", "--vocab", "256", "--batch", "1", "--seq", "1024", "--layers", "2"]
    probe.main(["llama", "lora", "bfloat16", *sizes, "--depth", "6"])
    out = capsys.readouterr().out
    top = max(float(v) for v in re.findall(r"peak +([\d.]+)$", out, re.MULTILINE))
    bound = re.search(r"at 6 blocks and ahead=0: at most ([\d.]+) MiB \(([\d.]+)x the blocks' inputs, 0.8 MiB\)", out)
    assert float(bound[1]) == pytest.approx(top + 4 * 1024 * 64 * 2 / 2**20, abs=0.01)
    assert float(bound[2]) == pytest.approx(float(bound[1]) / (6 * 1024 * 64 * 2 / 2**20), abs=0.01)
    for layers in ("1", "7"):
        with pytest.raises(SystemExit):
            probe.main(["llama", "lora", "bfloat16", *sizes[:-1], layers, "--depth", "6"])
        assert "--depth needs a timeline of 2 or more blocks" in capsys.readouterr().err


def test_the_depth_plot_draws_coinciding_lines_in_distinct_colours_markers_and_dashes():
    strategies = ("none", "none-policy", "mx", "nuvec-nopolicy", "nuvec")  # none and none-policy coincide
    got = [depth_row(b, [b], s) for s in strategies for b in (4, 8, 16)]
    lines = report.plot_depth(got).axes[0].get_lines()
    assert [line.get_label() for line in lines] == list(strategies)
    for prop in ("get_color", "get_marker", "get_linestyle"):
        assert len({str(getattr(line, prop)()) for line in lines}) >= 4, prop
    widths = [line.get_linewidth() for line in lines]
    assert widths == sorted(widths, reverse=True)  # each later line thinner, on top of the earlier ones
