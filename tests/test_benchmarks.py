"""The benchmark measures what it says, and its smallest run goes end to end.

Sections follow the modules of ``benchmarks/`` (installed as nuvec_mlx_bench);
the peers' are in tests/test_peers.py.
"""

import importlib.metadata
import json
import math
import statistics
import subprocess
import sys
import time

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import nuvec_mlx as nv

from nuvec_mlx_bench import (
    budget_sweep, budgets, depth, environment, floors, inputs, measure, peak_memory, report, results, rounds,
    targets, timing, workloads,
)
from nuvec_mlx_bench.workload import MODELS, SEED, Workload
from tests.helpers import assert_close

MiB = 1 << 20
TINY = Workload("mlp", batch=16, dim=32, blocks=2)
SMALLEST = ["--batch", "16", "--dim", "32", "--blocks", "2", "--repeats", "1", "--peers", "none"]


# --- workload.py ----------------------------------------------------------------------


def test_workload_rejects_an_unknown_model():
    with pytest.raises(ValueError, match="model must be one of"):
        Workload("cnn", 1, 1, 1)


def test_workload_rejects_a_sequence_for_the_mlp():
    with pytest.raises(ValueError, match="seq must be 1 for the mlp"):
        Workload("mlp", 16, 32, 2, seq=8)


@pytest.mark.parametrize(("field", "value", "error"), [("batch", 0, ValueError), ("dim", 2.0, TypeError),
                                                       ("blocks", True, TypeError), ("weight_grads", 1, TypeError)])
def test_workload_names_the_field_that_is_wrong(field, value, error):
    with pytest.raises(error, match=field):
        Workload(**{"model": "transformer", "batch": 2, "dim": 8, "blocks": 2, field: value})


def test_block_input_bytes_count_the_sequence():
    assert Workload("transformer", batch=2, dim=8, blocks=1, seq=3).block_input_bytes() == 4 * 2 * 3 * 8


# --- inputs.py -----------------------------------------------------------------------


def test_host_inputs_are_each_blocks_weights_then_the_input():
    weights, x = inputs.host_inputs(Workload("transformer", batch=2, dim=8, blocks=2, seq=3))
    assert [w.shape for w in weights] == [(8, 24), (8, 8), (8, 32), (32, 8)] * 2
    assert x.shape == (2, 3, 8)
    assert not (weights[0] == weights[4]).all()  # every block has its own values


# --- floors.py -----------------------------------------------------------------------


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


@pytest.mark.parametrize("w", [Workload("mlp", 256, 64, 4), Workload("mlp", 128, 256, 4, weight_grads=True),
                               Workload("transformer", 2, 32, 4, seq=128)], ids=str)
def test_floor_is_below_the_checkpointed_peak_at_budget_0(compiled, w):
    sc = workloads.build("nuvec", w)
    sc.evaluate(sc.step(sc.inputs))
    peak = rounds.peak(lambda: sc.step(sc.inputs), lambda o: nv.eval(o, budget=0), measure.MlxProbe())
    assert floors.floor(w) <= peak


# --- results.py -----------------------------------------------------------------------


def test_summary_keeps_every_repeat_in_order():
    assert results.summary([3, 1, 2, 10]) == {"median": 2.5, "min": 1, "max": 10, "repeats": [3, 1, 2, 10]}


def test_row_carries_the_workload_its_floor_and_the_peak_over_it():
    r = results.row("strategies", "mlx", "nuvec", SEED, results.measured([192 * MiB], [1.0], 2.0), traces=1)
    assert results.workload_of(r) == SEED
    assert r["floor"] == 96 * MiB and r["peak_to_floor"] == 2.0 and r["traces"] == 1


def test_an_error_row_has_no_measurement():
    r = results.row("strategies", "jax-jit", "none", SEED, {"error": "no jax"})
    assert "peak_to_floor" not in r and r["error"] == "no jax"


def test_ratios_are_against_the_plain_step():
    rows = results.add_ratios([results.row("s", "mlx", s, SEED, results.measured([p], [t], 0))
                               for s, p, t in (("none", 100, 1.0), ("nuvec", 25, 1.5))])
    assert [(r["peak_ratio"], r["time_ratio"]) for r in rows] == [(1, 1), (0.25, 1.5)]


def test_no_ratios_when_the_plain_step_failed():
    rows = results.add_ratios([results.row("s", "jax-jit", "none", SEED, {"error": "x"}),
                               results.row("s", "jax-jit", "checkpoint", SEED, results.measured([1], [1], 0))])
    assert "peak_ratio" not in rows[1]


# --- rounds.py ------------------------------------------------------------------------


def arange_step(n: int, k: int):
    return lambda: [mx.arange(i, i + n, dtype=mx.float32) for i in range(k)]


def test_peak_of_a_fake_workload_is_its_known_allocation():
    assert rounds.peak(arange_step(1000, 3), mx.eval, measure.MlxProbe()) == 3 * 1000 * 4


def test_peak_counts_a_freed_temporary_but_not_the_memory_held_before():
    held = mx.ones((1 << 16,))
    mx.eval(held)
    # A 4000-byte arange, freed once it is reduced to 4 bytes.
    assert rounds.peak(lambda: mx.arange(1000, dtype=mx.float32).sum(), mx.eval, measure.MlxProbe()) == 4004
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
    rounds.measure({"a": (lambda: None, lambda out: None)}, 3, RecordingProbe([]),
                   progress=lambda: calls.append(1))
    assert len(calls) == 1 + 2 * 3


def test_measure_rejects_zero_repeats():
    with pytest.raises(ValueError, match="repeats"):
        rounds.measure({}, 0, RecordingProbe([]))


# --- timing.py ------------------------------------------------------------------------


def test_a_short_step_is_timed_as_the_mean_of_steps_that_fill_the_minimum():
    calls = []
    per_step = timing.seconds(lambda: calls.append(time.sleep(0.002)), min_seconds=0.05)
    assert len(calls) >= 1 + 0.05 / 0.01  # the first call, then enough to fill 50 ms
    assert 0.002 <= per_step < 0.05


def test_a_long_step_is_timed_once():
    calls = []
    assert timing.seconds(lambda: calls.append(time.sleep(0.02)), min_seconds=0.01) >= 0.02
    assert len(calls) == 1


# --- budgets.py -----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "nbytes"), [("inf", math.inf), ("0", 0), ("64", 64 << 20), ("0.5", 1 << 19)])
def test_budget_option_reads_mib_or_inf(text, nbytes):
    assert budgets.parse_budget(text) == nbytes


@pytest.mark.parametrize("text", ["-1", "nan", "lots"])
def test_budget_option_rejects_what_is_not_mib_or_inf(text):
    with pytest.raises(ValueError):
        budgets.parse_budget(text)


# --- environment.py -------------------------------------------------------------------


def test_environment_names_command_mlx_backend_device_and_blas():
    env = environment.environment("nuvec-mlx-bench --suite full")
    assert env["command"] == "nuvec-mlx-bench --suite full" and env["mlx"] == mx.__version__
    assert env["backend"] in ("cpu", "cuda", "metal") and env["device"]
    if env["backend"] == "cpu":
        assert env["blas"] != "unknown"


def test_command_line_quotes_its_arguments():
    assert environment.command_line("nuvec-mlx-bench", ["--depths", ""]) == "nuvec-mlx-bench --depths ''"


# --- measure.py -----------------------------------------------------------------------


def test_run_cases_summarises_every_case():
    measured = measure.run_cases({"a": (arange_step(500, 2), mx.eval), "b": (arange_step(250, 1), mx.eval)}, 3)
    assert measured["a"]["peak"] == {"median": 4000, "min": 4000, "max": 4000, "repeats": [4000] * 3}
    assert measured["b"]["peak"]["median"] == 1000
    t = measured["a"]["time"]
    assert 0 < t["min"] <= t["median"] <= t["max"] and len(t["repeats"]) == 3


# --- workloads.py ---------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("weight_grads", [False, True])
def test_every_strategy_computes_the_same_step(compiled, model, weight_grads):
    w = Workload(model, batch=8, dim=16, blocks=3, seq=4 if model == "transformer" else 1,
                 weight_grads=weight_grads)

    def outputs(strategy):
        sc = workloads.build(strategy, w)
        out = sc.step(sc.inputs)
        sc.evaluate(out)
        return out

    expected = outputs("none")
    assert len(expected) == (w.blocks * len(inputs.block_weights(w, 0)) + 2 if weight_grads else 2)
    for strategy in workloads.STRATEGIES[1:]:
        assert_close(outputs(strategy), expected, rtol=1e-5)


def test_build_rejects_an_unknown_strategy():
    with pytest.raises(ValueError, match="strategy must be one of"):
        workloads.build("remat", TINY)


# --- depth.py -------------------------------------------------------------------------


def depth_row(blocks: int, peaks: list[float], strategy: str = "nuvec") -> dict:
    w = Workload("mlp", batch=256, dim=64, blocks=blocks)  # a block input: 64 KiB
    return results.row("depth", "mlx", strategy, w, results.measured([p * w.block_input_bytes() for p in peaks],
                                                                     [1.0] * len(peaks), 0))


def test_median_growth_is_per_added_block_between_consecutive_depths():
    rows = [depth_row(4, [10, 10, 12]), depth_row(8, [14, 14, 14]), depth_row(16, [30, 18, 18])]
    assert depth.median_growth(rows) == {"nuvec": [1.0, 0.5]}


def test_repeat_growth_pairs_the_repeats_of_two_depths_by_index():
    rows = [depth_row(4, [10, 10, 12]), depth_row(8, [14, 14, 14]), depth_row(16, [30, 18, 18])]
    assert depth.repeat_growth(rows, "nuvec") == [[1.0, 2.0], [1.0, 0.5], [0.5, 0.5]]


# --- targets.py -----------------------------------------------------------------------


def fake_row(strategy: str, peaks: list[float], time: float, framework: str = "mlx", model: str = "mlp",
             weight_grads: bool = False) -> dict:
    w = Workload(model, batch=4096, dim=256, blocks=8, seq=1 if model == "mlp" else 16, weight_grads=weight_grads)
    return results.row("strategies", framework, strategy, w, results.measured(peaks, [time], 0))


def checks(rows: list[dict], backend: str, budget: float = 0) -> str:
    by_framework = {}
    for r in rows:
        by_framework.setdefault(r["framework"], []).append(r)
    for group in by_framework.values():
        results.add_ratios(group)
    return "\n".join(targets.checks(rows, backend, budget))


def test_cpu_targets_bound_the_mlp_peak_time_and_spread():
    text = checks([fake_row("none", [200], 1.0), fake_row("nuvec", [32, 34, 36], 1.6)], "cpu")
    assert "input grad, compiled: nuvec peak / plain peak: 0.170 (target <= 0.17): met" in text
    assert "nuvec time / plain time: 1.600 (target <= 1.55): MISSED by 0.050" in text
    assert "nuvec peak max / min over the repeats: 1.125 (target <= 1.1): MISSED by 0.025" in text


def test_gpu_targets_bound_the_time_with_weight_grads_tighter():
    text = checks([fake_row("none", [200], 1.0, weight_grads=True), fake_row("nuvec", [40], 1.3, weight_grads=True)],
                  "cuda")
    assert "nuvec peak / plain peak: 0.200 (target <= 0.22): met" in text
    assert "nuvec time / plain time: 1.300 (target <= 1.25): MISSED by 0.050" in text


def test_gpu_targets_compare_nuvecs_absolute_peak_with_torch_compile():
    text = checks([fake_row("none", [200], 1.0), fake_row("nuvec", [44], 1.2),
                   fake_row("none", [100], 1.0, "torch-compile"), fake_row("checkpoint", [40], 1.2, "torch-compile")],
                  "metal")
    assert "nuvec peak / torch.compile+checkpoint peak (absolute): 1.100 (target <= 1): MISSED by 0.100" in text


def test_gpu_target_for_the_transformer_is_its_peak_ratio():
    text = checks([fake_row("none", [100], 1.0, model="transformer"),
                   fake_row("nuvec", [19], 2.0, model="transformer")], "cuda")
    assert "transformer B=4096 T=16 D=256 8 blocks, input grad, compiled: nuvec peak / plain peak: 0.190 " \
           "(target <= 0.2): met" in text
    assert "nuvec time" not in text


def test_plain_nv_eval_must_keep_the_peak_within_one_percent_either_way():
    text = checks([fake_row("none", [100], 1.0), fake_row("none-policy", [98], 1.02)], "cpu")
    assert "plain nv.eval peak / mx.eval peak: 0.980 (target 1 ± 0.01): MISSED by 0.010" in text
    assert "plain nv.eval time / mx.eval time: 1.020 (target <= 1.03): met" in text


def test_depth_target_is_the_worst_growth_over_every_repeat():
    rows = [depth_row(4, [10, 10]), depth_row(8, [14, 15])]
    text = checks(rows, "cpu")
    assert "depth sweep (4, 8 blocks): nuvec peak growth per added block (block inputs), between consecutive " \
           "depths, worst over every repeat: 1.250 (target <= 1.1): MISSED by 0.150" in text


@pytest.mark.parametrize("budget, said", [(math.inf, "inf"), (None, "default")])
def test_targets_say_when_nv_eval_was_mx_eval_itself(budget, said):
    text = checks([fake_row("none", [100], 1.0), fake_row("none-policy", [100], 1.3)], "cpu", budget=budget)
    assert f"at budget {said} `nv.eval` of a step without stages runs `mx.eval` itself" in text
    assert "runs `mx.eval` itself" not in checks(
        [fake_row("none", [100], 1.0), fake_row("none-policy", [100], 1.3)], "cpu", budget=0)


def test_targets_list_what_the_run_could_not_check():
    text = checks([fake_row("none", [200], 1.0), fake_row("nuvec", [40], 1.2)], "cuda")
    assert "- not checked (a row it needs did not run): mlp B=4096 D=256 8 blocks, input grad, compiled: " \
           "nuvec peak / torch.compile+checkpoint peak (absolute)" in text


def test_targets_heading_speaks_of_this_runs_shapes():
    lines = targets.checks(results.add_ratios([fake_row("none", [1], 1.0), fake_row("nuvec", [1], 1.0)]), "cpu", 0)
    assert lines[1].startswith("Targets on this run's shapes (backend cpu;")


# --- report.py ------------------------------------------------------------------------


def test_checkpointed_peaks_set_the_peers_beside_nuvec_and_the_floor():
    rows = [fake_row("nuvec", [192 * MiB], 1.0), fake_row("checkpoint", [96 * MiB], 1.0, "torch-compile")]
    lines = report.checkpointed_peaks(rows)
    assert lines[-1] == "| mlp B=4096 D=256 8 blocks, input grad, compiled | 96.0 | 192.0 (2.00) | 96.0 (1.00) | not run |"


def test_plot_caption_names_command_backend_device_mlx_and_blas():
    env = environment.environment("nuvec-mlx-bench --suite full")
    text = report.caption(env)
    assert all(env[k] in text for k in ("command", "backend", "device", "mlx", "blas"))


# --- peak_memory.py -------------------------------------------------------------------


def test_smallest_run_writes_table_json_markdown_and_plots(tmp_path, capsys, compiled):
    assert peak_memory.main([*SMALLEST, "--seq", "8", "--depths", "2,4", "--out", str(tmp_path)]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert {"results.json", "results.md", "peak_by_strategy.png", "peak_vs_depth.png", "time_vs_peak.png"} <= names
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["environment"]["mlx"] == mx.__version__
    table = [r for r in saved["rows"] if r["section"] == "strategies"]
    assert {r["strategy"] for r in table} == set(workloads.STRATEGIES)
    assert {(r["model"], r["weight_grads"]) for r in table} == {(m, g) for m in MODELS for g in (False, True)}
    assert all(r["traces"] == 1 for r in saved["rows"])
    assert all(r["peak_ratio"] == 1 for r in table if r["strategy"] == "none")
    assert all(len(r["peak"]["repeats"]) == 1 and r["floor"] > 0 for r in saved["rows"])
    assert not any(n.startswith("- partial") for n in saved["notes"])
    out = capsys.readouterr().out
    assert "| nuvec |" in out and "Targets on this run's shapes" in out and "Checkpointed peaks" in out


def test_installed_commands_are_the_benchmark_and_the_sweep():
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["nuvec-mlx-bench"] == "nuvec_mlx_bench.peak_memory:main"
    assert scripts["nuvec-mlx-bench-sweep"] == "nuvec_mlx_bench.budget_sweep:main"


def test_interrupted_run_leaves_its_finished_parts(tmp_path, monkeypatch):
    real = peak_memory.mlx_rows

    def interrupt_the_depth_sweep(w, strategies, repeats, section):
        if section == "depth":
            raise KeyboardInterrupt
        return real(w, strategies, repeats, section)

    monkeypatch.setattr(peak_memory, "mlx_rows", interrupt_the_depth_sweep)
    with pytest.raises(KeyboardInterrupt):
        peak_memory.run([*SMALLEST, "--models", "mlp", "--strategies", "none,nuvec", "--depths", "2,4",
                         "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert {(r["weight_grads"], r["strategy"]) for r in saved["rows"]} == {
        (False, "none"), (False, "nuvec"), (True, "none"), (True, "nuvec")}
    assert saved["notes"][0] == "- partial: 2 of 4 parts measured (the run was still going)"
    assert "partial" in (tmp_path / "results.md").read_text()


def test_without_a_budget_option_the_run_keeps_nuvecs_defaults(tmp_path, monkeypatch):
    # A plain step through nv.eval must stay mx.eval, as a user gets it: no budget is set.
    real, seen = peak_memory.mlx_rows, []
    monkeypatch.setattr(peak_memory, "mlx_rows", lambda *a: (seen.append(nv.memory.current_budget(staged=False)), real(*a))[1])
    peak_memory.run([*SMALLEST, "--models", "mlp", "--weight-grads", "off", "--strategies", "none,none-policy",
                     "--depths", "", "--out", str(tmp_path)])
    assert seen == [math.inf]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["environment"]["nv.eval budget"].startswith("nuvec_mlx's default")


def test_budget_option_is_nv_evals_budget_for_the_run_only(tmp_path, monkeypatch):
    real, seen = peak_memory.mlx_rows, []

    def record_the_budget(*args):
        seen.append(nv.memory.current_budget())
        return real(*args)

    monkeypatch.setattr(peak_memory, "mlx_rows", record_the_budget)
    default = nv.memory.current_budget()
    peak_memory.run([*SMALLEST, "--models", "mlp", "--weight-grads", "off", "--strategies", "none,none-policy",
                     "--depths", "", "--budget", "inf", "--out", str(tmp_path)])
    assert seen == [math.inf] and nv.memory.current_budget() == default
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["environment"]["nv.eval budget"] == "inf (no throttle: the stages alone)"
    assert any("runs `mx.eval` itself" in n for n in saved["notes"])


def test_weight_grads_on_gives_the_transformer_its_weight_gradients():
    args = peak_memory.parse_args(["--models", "transformer", "--weight-grads", "on"])
    assert [(w.model, w.weight_grads) for w in args.workloads] == [("transformer", True)]


def test_full_suite_runs_the_large_mlp_and_transformer_15_times_and_the_peers_3():
    args = peak_memory.parse_args(["--suite", "full", "--weight-grads", "off", "--peers", "torch-eager"])
    assert [(w.model, w.batch, w.seq, w.dim) for w in args.workloads] == [
        ("mlp", 4096, 1, 256), ("mlp", 16384, 1, 1024), ("transformer", 8, 2048, 1024)]
    assert (args.repeats, args.peer_repeats) == (15, 3)


def test_overrides_that_make_two_workloads_equal_measure_it_once():
    args = peak_memory.parse_args(["--suite", "full", "--models", "mlp", "--batch", "16", "--dim", "32",
                                   "--weight-grads", "off", "--peers", "none"])
    assert args.workloads == [Workload("mlp", 16, 32, 8)]


def test_auto_peers_under_eager_are_none():
    assert peak_memory.parse_args(["--eager"]).peers == []


@pytest.mark.parametrize(("argv", "message"), [
    (["--strategies", "none,remat"], "--strategies: unknown ['remat']"),
    (["--strategies", "nuvec"], "--strategies must include none"),
    (["--models", "mlp", "--seq", "8"], "--seq: only the transformer has a sequence"),
    (["--models", "transformer", "--depths", "4,8"], "--depths: the depth sweep runs the mlp"),
    (["--eager", "--peers", "torch-eager"], "--eager: the peers measure counterparts of the compiled step"),
    (["--peers", "none", "--peer-repeats", "5"], "--peer-python and --peer-repeats need peers to run"),
    (["--strategies", "none,mx", "--budget", "0"], "--budget: no strategy evaluates with nv.eval"),
    (["--peers", "tensorflow"], "--peers: choose from"),
    (["--batch", "0"], "batch must be >= 1"),
    (["--depths", "0,4"], "blocks must be >= 1"),
    (["--peer-repeats", "0"], "--peer-repeats: must be an int >= 1"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_an_option_a_workload_cannot_honour_is_an_error(capsys, argv, message):
    with pytest.raises(SystemExit):
        peak_memory.parse_args(argv)
    assert message in capsys.readouterr().err


# --- budget_sweep.py ------------------------------------------------------------------


def test_budget_sweep_measures_every_strategy_at_every_budget(tmp_path, compiled):
    assert budget_sweep.main(["--batch", "16", "--dim", "32", "--blocks", "2", "--budgets", "inf,0",
                              "--strategies", "none,nuvec", "--repeats", "1", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "budget_sweep.json").read_text())
    assert [(r["budget"], r["strategy"]) for r in saved["rows"]] == [
        (math.inf, "none"), (math.inf, "nuvec"), (0, "none"), (0, "nuvec")]
    assert all(r["section"] == "budgets" and "time_vs_plain_mx_eval" in r for r in saved["rows"])
    assert "| inf (no throttle: the stages alone) | nuvec |" in (tmp_path / "budget_sweep.md").read_text()


@pytest.mark.parametrize(("argv", "message"), [(["--strategies", "nuvec"], "none included"),
                                               (["--repeats", "0"], "--repeats must be >= 1"),
                                               (["--budgets", "inf,-1"], "a budget must be 'inf' or MiB >= 0")])
def test_budget_sweep_rejects_what_it_cannot_run(capsys, argv, message):
    with pytest.raises(SystemExit):
        budget_sweep.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_the_modules_compute_the_workloads_loss_and_weight_gradients(model):
    from nuvec_mlx_bench import modules

    w = Workload(model, batch=2, dim=16, blocks=2, seq=8 if model == "transformer" else 1, weight_grads=True)
    sc = workloads.build("none", w)
    flat = sc.step(sc.inputs)
    module, x = modules.build(w)
    value, grads = nv.value_and_grad(module, modules.loss)(module, x)
    assert_close(value, flat[-1], 1e-5)
    # nn.Linear holds the transposed weight: its gradient is the transpose of the flat one's.
    ours = [g.T for _, g in tree_flatten(grads)]
    assert_close(ours, flat[: len(ours)], 1e-5)


@pytest.mark.parametrize("rule", ["every block", "every 2nd", "sqrt(n) segments", "every block, save_matmuls", "none"])
def test_every_fixed_rule_of_the_plan_sweep_computes_the_same_step(rule, compiled):
    from nuvec_mlx_bench import modules, plan_sweep

    model, loss, x = plan_sweep.build("mlp", dict(batch=8, dim=16, blocks=5))
    blocks = list(model.layers)
    reference = nv.value_and_grad(model, loss)(model, x)[0]
    step, finish = plan_sweep.case(model, loss, x, blocks, rule)
    value, _ = step()
    finish(value)
    assert_close(value, reference, 1e-6)
    checkpointed = [b for b in model.layers if nv.is_checkpointed(b)]
    assert len(checkpointed) == {"every block": 5, "every 2nd": 3, "sqrt(n) segments": 3, "none": 0}.get(rule, 5)
    plan_sweep.setup(blocks, "none")(model)
    assert model.layers == blocks and not any(nv.is_checkpointed(b) for b in blocks)


@pytest.mark.parametrize("rule", ["every block", "every 2nd", "sqrt(n) segments", "none"])
def test_with_an_optimizer_every_rule_of_the_plan_sweep_updates_the_model_as_optimizer_update(rule, compiled):
    from nuvec_mlx_bench import plan_sweep

    updated = []
    for how in ("optimizer.update", rule):
        model, loss, x = plan_sweep.build("mlp", dict(batch=8, dim=16, blocks=5))
        if how == "optimizer.update":
            opt = plan_sweep.OPTIMIZERS["adam"]()
            opt.init(model.trainable_parameters())
            loss_value, grads = nn.value_and_grad(model, loss)(model, x)
            opt.update(model, grads)
            mx.eval(model.parameters(), loss_value)
        else:
            blocks = list(model.layers)
            step, finish = plan_sweep.case(model, loss, x, blocks, rule, "adam")
            finish(step())
            plan_sweep.setup(blocks, "none")(model)
        updated.append(tree_flatten(model.parameters()))
    for (name, a), (_, b) in zip(*updated):
        assert_close(a, b, 1e-6)


def test_with_an_optimizer_the_plan_sweep_measures_each_step_as_a_training_loop_runs_it(compiled):
    """Round-robin, the cases share the model: a case that left its update unevaluated (the unchecked
    step's update is no stage) would hand it to the next case's step, whose peak would be off."""
    from nuvec_mlx_bench import plan_sweep

    model, loss, x = plan_sweep.build("mlp", plan_sweep.SUITES["small"]["mlp"])
    blocks = list(model.layers)
    cases = {rule: plan_sweep.case(model, loss, x, blocks, rule, "adam") for rule in ("every block", "none")}
    swept = measure.run_cases(cases, repeats=3)["every block"]["peak"]["median"]
    step, finish = plan_sweep.case(model, loss, x, blocks, "every block", "adam")
    finish(step())
    alone = statistics.median(rounds.peak(step, measure.finished(finish), measure.MlxProbe()) for _ in range(3))
    plan_sweep.setup(blocks, "none")(model)
    assert abs(swept - alone) <= 0.05 * alone, (swept, alone)


@pytest.mark.parametrize("argv", [["--models", "gpt"], ["--budgets", "1"], ["--repeats", "0"], ["--optimizer", "sgd"]])
def test_the_plan_sweep_rejects_what_it_cannot_run(argv):
    from nuvec_mlx_bench import plan_sweep

    with pytest.raises(SystemExit):
        plan_sweep.parse_args(argv)


def test_the_benchmark_reports_leave_matplotlib_s_backend_as_the_caller_chose():
    code = ("import matplotlib; matplotlib.use('svg'); "
            "import nuvec_mlx_bench.report, nuvec_mlx_bench.train_report, nuvec_mlx_bench.plan_sweep; "
            "print(matplotlib.get_backend())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "svg"

