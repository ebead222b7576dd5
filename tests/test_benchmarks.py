"""The benchmark measures what it says, and its smallest run goes end to end."""

import json
import math
import time

import mlx.core as mx
import pytest

import nuvec_mlx as nv

from nuvec_mlx_bench import measure, peak_memory, targets, timing, workloads
from tests.helpers import assert_close


def arange_step(n: int, k: int):
    return lambda: [mx.arange(i, i + n, dtype=mx.float32) for i in range(k)]


def test_peak_of_a_fake_workload_is_its_known_allocation():
    assert measure.peak(arange_step(1000, 3), mx.eval) == 3 * 1000 * 4


def test_peak_counts_a_freed_temporary_but_not_the_memory_held_before():
    held = mx.ones((1 << 16,))
    mx.eval(held)
    # A 4000-byte arange, freed once it is reduced to 4 bytes.
    assert measure.peak(lambda: mx.arange(1000, dtype=mx.float32).sum(), mx.eval) == 4004
    del held


def test_run_cases_summarises_every_case():
    results = measure.run_cases({"a": (arange_step(500, 2), mx.eval), "b": (arange_step(250, 1), mx.eval)}, 3)
    assert results["a"]["peak"] == {"median": 4000, "min": 4000, "max": 4000}
    assert results["b"]["peak"]["median"] == 1000
    t = results["a"]["time"]
    assert 0 < t["min"] <= t["median"] <= t["max"]


def test_a_short_step_is_timed_as_the_mean_of_steps_that_fill_the_minimum():
    calls = []
    per_step = timing.seconds(lambda: calls.append(time.sleep(0.002)), min_seconds=0.05)
    assert len(calls) >= 1 + 0.05 / 0.01  # the first call, then enough to fill 50 ms
    assert 0.002 <= per_step < 0.05


def test_a_long_step_is_timed_once():
    calls = []
    assert timing.seconds(lambda: calls.append(time.sleep(0.02)), min_seconds=0.01) >= 0.02
    assert len(calls) == 1


@pytest.mark.parametrize(("text", "nbytes"), [("inf", math.inf), ("0", 0), ("64", 64 << 20), ("0.5", 1 << 19)])
def test_budget_option_reads_mib_or_inf(text, nbytes):
    assert measure.parse_budget(text) == nbytes


@pytest.mark.parametrize("text", ["-1", "nan", "lots"])
def test_budget_option_rejects_what_is_not_mib_or_inf(text):
    with pytest.raises(ValueError):
        measure.parse_budget(text)


def test_summary_is_median_min_max():
    assert measure.summary([3, 1, 2, 10]) == {"median": 2.5, "min": 1, "max": 10}


def test_run_cases_rejects_zero_repeats():
    with pytest.raises(ValueError, match="repeats"):
        measure.run_cases({}, 0)


def test_environment_names_mlx_backend_device_and_blas():
    env = measure.environment()
    assert env["mlx"] == mx.__version__
    assert env["backend"] in ("cpu", "cuda", "metal") and env["device"]
    if env["backend"] == "cpu":
        assert env["blas"] != "unknown"


@pytest.mark.parametrize("model", workloads.MODELS)
@pytest.mark.parametrize("weight_grads", [False, True])
def test_every_strategy_computes_the_same_step(compiled, model, weight_grads):
    def outputs(strategy):
        sc = workloads.build(strategy, batch=8, dim=16, blocks=3, seq=4, model=model, weight_grads=weight_grads)
        out = sc.step(sc.inputs)
        sc.evaluate(out)
        return out

    expected = outputs("none")
    for strategy in workloads.STRATEGIES[1:]:
        assert_close(outputs(strategy), expected, rtol=1e-5)


def test_build_rejects_unknown_names():
    with pytest.raises(ValueError, match="strategy must be one of"):
        workloads.build("remat")
    with pytest.raises(ValueError, match="model must be one of"):
        workloads.build(model="cnn")


def test_smallest_run_writes_table_json_markdown_and_plots(tmp_path, capsys, compiled):
    rows = peak_memory.run([
        "--batch", "16", "--dim", "32", "--blocks", "2", "--seq", "8", "--depths", "2,4",
        "--repeats", "1", "--peers", "none", "--out", str(tmp_path),
    ])
    names = {p.name for p in tmp_path.iterdir()}
    assert {"results.json", "results.md", "peak_by_strategy.png", "peak_vs_depth.png", "time_vs_peak.png"} <= names
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["environment"]["mlx"] == mx.__version__
    table = [r for r in saved["rows"] if r["section"] == "strategies"]
    assert {r["strategy"] for r in table} == set(workloads.STRATEGIES)
    assert {r["model"] for r in table} == set(workloads.MODELS)
    assert all(r["traces"] == 1 for r in rows)
    assert all(r["peak_ratio"] == 1 for r in table if r["strategy"] == "none")
    assert all(r["peak"]["min"] <= r["peak"]["median"] <= r["peak"]["max"] for r in table)
    assert not any(n.startswith("- partial") for n in saved["notes"])
    assert "| nuvec |" in capsys.readouterr().out


def test_interrupted_run_leaves_its_finished_parts(tmp_path, monkeypatch):
    real = peak_memory.mlx_rows

    def interrupt_the_depth_sweep(w, strategies, repeats, section):
        if section == "depth":
            raise KeyboardInterrupt
        return real(w, strategies, repeats, section)

    monkeypatch.setattr(peak_memory, "mlx_rows", interrupt_the_depth_sweep)
    with pytest.raises(KeyboardInterrupt):
        peak_memory.run(["--batch", "16", "--dim", "32", "--blocks", "2", "--models", "mlp",
                          "--strategies", "none,nuvec", "--depths", "2,4", "--repeats", "1",
                          "--peers", "none", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert {(r["weight_grads"], r["strategy"]) for r in saved["rows"]} == {
        (False, "none"), (False, "nuvec"), (True, "none"), (True, "nuvec")}
    assert saved["notes"][0] == "- partial: 2 of 4 parts measured (the run was still going)"
    assert "partial" in (tmp_path / "results.md").read_text()


def test_budget_option_is_nv_evals_budget_for_the_run_only(tmp_path, monkeypatch):
    real, seen = peak_memory.mlx_rows, []

    def record_the_budget(*args):
        seen.append(nv.memory.current_budget())
        return real(*args)

    monkeypatch.setattr(peak_memory, "mlx_rows", record_the_budget)
    default = nv.memory.current_budget()
    peak_memory.run(["--batch", "16", "--dim", "32", "--blocks", "2", "--models", "mlp", "--weight-grads", "off",
                      "--strategies", "none,none-policy", "--depths", "", "--repeats", "1", "--peers", "none",
                      "--budget", "inf", "--out", str(tmp_path)])
    assert seen == [math.inf] and nv.memory.current_budget() == default
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["environment"]["nv.eval budget"] == "inf (nv.eval runs mx.eval)"
    assert any("runs `mx.eval` itself" in n for n in saved["notes"])


def test_bad_strategy_option_names_the_choices(capsys):
    with pytest.raises(SystemExit):
        peak_memory.run(["--strategies", "none,remat"])
    assert "--strategies: unknown ['remat']" in capsys.readouterr().err


def fake_row(strategy: str, peak: float, time: float, weight_grads: bool = False) -> dict:
    return {"section": "strategies", "framework": "mlx", "strategy": strategy, "model": "mlp",
            "batch": 4096, "seq": 1, "blocks": 8, "weight_grads": weight_grads,
            "peak": {"median": peak}, "time": {"median": time}}


def test_targets_say_which_were_met_and_by_how_much_one_was_missed():
    rows = peak_memory.add_ratios([fake_row("none", 200, 1.0), fake_row("none-policy", 100, 1.2),
                                   fake_row("nuvec", 25, 1.5)])
    lines = targets.checks(rows, {"nuvec": [1.0, 1.5]}, [4, 8, 16], budget=1 << 20)
    text = "\n".join(lines)
    assert "nuvec peak / plain peak (both nv.eval): 0.250 (target <= 0.25): met" in text
    assert "nuvec time / plain time (both nv.eval): 1.250 (target <= 1.55): met" in text
    assert "plain nv.eval time / mx.eval time: 1.200 (target <= 1.1): MISSED by 0.100" in text
    assert "plain nv.eval peak / mx.eval peak: 0.500 (target <= 1): met" in text
    assert "(block inputs, shallowest to deepest): 1.333 (target <= 1.25): MISSED by 0.083" in text
    assert "compare one evaluation with itself" not in text


def test_targets_say_when_nv_eval_was_mx_eval_itself():
    rows = peak_memory.add_ratios([fake_row("none", 100, 1.0), fake_row("none-policy", 100, 1.3)])
    text = "\n".join(targets.checks(rows, {}, [], budget=math.inf))
    assert "plain nv.eval time / mx.eval time: 1.300 (target <= 1.1): MISSED by 0.200" in text
    assert "at budget inf `nv.eval` runs `mx.eval` itself" in text


def test_targets_with_weight_gradients_use_their_own_bounds():
    rows = peak_memory.add_ratios([fake_row("none", 100, 1.0, True), fake_row("none-policy", 100, 1.0, True),
                                   fake_row("nuvec", 29, 1.5, True)])
    text = "\n".join(targets.checks(rows, {}, [], budget=0))
    assert "input+weight grads: nuvec peak / plain peak (both nv.eval): 0.290 (target <= 0.3): met" in text
    assert "nuvec time / plain time (both nv.eval): 1.500 (target <= 1.45): MISSED by 0.050" in text
