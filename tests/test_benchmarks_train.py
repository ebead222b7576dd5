"""The fine-tuning benchmark (nuvec-mlx-bench-train): models, strategies, the search, a smallest run.

Sections follow its modules in ``benchmarks/`` (installed as nuvec_mlx_bench).
"""

import importlib.metadata
import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import nuvec_mlx as nv
from nuvec_mlx_bench import architectures, seq_search, train, train_report
from nuvec_mlx_bench.train_steps import STRATEGIES, Case, TrainWorkload

TINY = TrainWorkload("llama", hidden=32, layers=2, batch=2, seq=32, vocab=64)
SMALLEST = ["--hidden", "32", "--layers", "2", "--seq", "32", "--vocab", "64", "--repeats", "1"]


# --- architectures.py -------------------------------------------------------------------


@pytest.mark.parametrize("arch", architectures.ARCHITECTURES)
def test_every_architecture_builds_at_a_tiny_size_in_its_dtype(arch):
    model, config = architectures.build(architectures.config(arch, 64, 3, vocab=64), "bfloat16")
    assert config["model_type"] == arch and len(model.layers) == 3
    assert model.layers[0].parameters()  # a block with weights
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.bfloat16}


def test_quantized_build_is_what_mlx_lm_convert_writes():
    model, config = architectures.build(architectures.config("llama", 64, 2, vocab=64), quantized=True)
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert model.layers[0].self_attn.q_proj.weight.dtype == mx.uint32


def test_1b_llama_config_has_the_shape_of_llama_3_2_1b():
    c = architectures.config("llama", 2048, 16)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["intermediate_size"]) == (32, 8, 64, 8192)


@pytest.mark.parametrize("args, error, message", [
    (("mamba", 64, 2), ValueError, "arch must be one of"),
    (("llama", 48, 2), ValueError, "hidden must be a multiple of 32"),
    (("llama", 64, 0), ValueError, "layers must be >= 1"),
    (("llama", 64.0, 2), TypeError, "hidden must be an int"),
    (("gemma4_text", 64, 2), ValueError, "gemma4_text needs layers >= 3"),
])
def test_config_names_what_it_cannot_build(args, error, message):
    with pytest.raises(error, match=message):
        architectures.config(*args)


# --- seq_search.py ----------------------------------------------------------------------


@pytest.mark.parametrize("limit, start, expected", [(500, 256, 448), (500, 64, 448), (100, 256, 64),
                                                     (10, 256, 0), (10**6, 256, 4096)])
def test_search_finds_the_largest_fitting_multiple_by_measuring(limit, start, expected):
    tried = []

    def fits(seq):
        tried.append(seq)
        return seq <= limit

    assert seq_search.largest_fitting(fits, start, granularity=64, cap=4096) == expected
    assert expected in tried or expected == 0  # measured, not inferred
    assert all(s % 64 == 0 and s <= 4096 for s in tried)


def test_search_rejects_a_cap_below_its_granularity():
    with pytest.raises(ValueError, match="cap must be at least the granularity 64"):
        seq_search.largest_fitting(lambda s: True, 64, 64, 32)


# --- train_steps.py ---------------------------------------------------------------------


def one_step(w: TrainWorkload, strategy: str) -> tuple[float, dict]:
    """The loss of a strategy's first step, and the trainable weights after it."""
    case = Case(w, strategy)
    loss, _ = case.step(case.batch(32))
    case.evaluate(loss)
    return loss.item(), dict(tree_flatten(case.model.trainable_parameters()))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


@pytest.mark.parametrize("mode", ["full", "lora", "qlora"])
def test_every_strategy_takes_the_same_training_step(eager, mode):
    w = TrainWorkload("llama", 32, 2, batch=2, seq=32, vocab=64, mode=mode)
    plain_loss, plain = one_step(w, "none")
    for s in STRATEGIES[1:]:
        loss, weights = one_step(w, s)
        assert loss == plain_loss
        assert_same_weights(weights, plain)


def test_with_lora_dropout_mlx_lm_s_checkpoint_takes_another_step_and_nuvec_the_unchecked_one(eager):
    w = TrainWorkload("llama", 32, 2, batch=2, seq=32, vocab=64, mode="lora", lora_dropout=0.5)
    _, plain = one_step(w, "none")
    assert_same_weights(one_step(w, "nuvec")[1], plain)
    theirs = one_step(w, "mlx-lm")[1]
    assert any(not mx.array_equal(theirs[k], plain[k]).item() for k in plain)


def test_mlx_lm_strategy_checkpoints_its_class_only_while_its_step_runs():
    case = Case(TINY, "mlx-lm")
    cls = type(case.model.layers[0])
    plain = cls.__dict__["__call__"]
    case.evaluate(case.step(case.batch(32)))
    assert cls.__dict__["__call__"] is plain


def test_nuvec_strategy_checkpoints_every_block_while_its_step_runs():
    case = Case(TINY, "nuvec")
    with nv.memory.timeline() as t:
        case.evaluate(case.step(case.batch(32)))
    assert [r.kind for r in t.readings] == ["forward"] * 2 + ["backward", "update"] * 2 + ["outputs"]
    assert not any(nv.is_checkpointed(b) for b in case.model.layers)


@pytest.mark.parametrize("field, value, error", [("mode", "dora", ValueError), ("batch", 0, ValueError),
                                                 ("seq", 1.5, TypeError), ("dtype", "int8", ValueError),
                                                 ("lora_dropout", 1.0, ValueError)])
def test_train_workload_names_the_field_that_is_wrong(field, value, error):
    with pytest.raises(error, match=field):
        TrainWorkload(**{**TINY.__dict__, field: value})


# --- train.py and train_report.py -------------------------------------------------------


def test_smallest_run_writes_table_json_markdown_and_the_plot(tmp_path, capsys, compiled):
    argv = [*SMALLEST, "--modes", "lora", "--memory", "3", "--seqs", "32,64", "--seq-step", "32", "--max-seq", "128",
            "--out", str(tmp_path)]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    assert "| llama lora H=32 L=2 B=2 T=32 bfloat16 | nuvec |" in out and "nuvec / mlx-lm: peak" in out
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["environment"]["command"].startswith("nuvec-mlx-bench-train --hidden 32")
    rows = {r["strategy"]: r for r in data["rows"]}
    assert sorted(rows) == sorted(STRATEGIES)
    for r in rows.values():
        assert sorted(int(s) for s in r["sweep"]) == [32, 64]
        assert 0 <= r["largest_seq"] <= 128 and r["largest_seq"] % 32 == 0
        fitting = [int(s) for s, p in r["search"].items() if r["resident"] + p <= 3 << 20]
        assert r["largest_seq"] == max(fitting, default=0)  # the largest length measured to fit
        assert r["tokens_per_s"] == pytest.approx(2 * 32 / r["time"]["median"])
    assert rows["none"]["peak_vs_none"] == 1 and rows["mlx-lm"]["peak_vs_mlx-lm"] == 1
    assert (tmp_path / "peak_vs_seq.png").stat().st_size > 0
    assert "peak_vs_seq.png" in (tmp_path / "results.md").read_text()


def test_installed_command_is_the_train_benchmark():
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["nuvec-mlx-bench-train"] == "nuvec_mlx_bench.train:main"


def test_target_check_says_met_or_by_how_much_it_missed():
    assert train_report._check("peak", 0.5, "<=", 0.6) == "peak 0.50 (target <= 0.6: met)"
    assert train_report._check("largest seq", 1.25, ">=", 1.5) == "largest seq 1.25 (target >= 1.5: MISSED by 0.25)"


def test_h200_suite_is_the_issues_target_sizes():
    args = train.parse_args(["--suite", "h200"])
    assert (args.hidden, args.layers, args.seq, args.batch, args.dtype, args.memory) == (
        2048, 16, 2048, 4, "bfloat16", 16 * 1024)
    assert args.archs == ["llama", "qwen3_moe"] and args.modes == ["full", "lora", "qlora"]


@pytest.mark.parametrize("argv, message", [
    (["--strategies", "mlx-lm,nuvec"], "none included"),
    (["--strategies", "none,mx"], "choose from"),
    (["--archs", "mamba"], "arch must be one of"),
    (["--hidden", "48"], "multiple of 32"),
    (["--modes", "dora"], "mode must be one of"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--budget", "1", "--strategies", "none,mlx-lm"], "only nuvec evaluates with nv.eval"),
    (["--memory", "-1"], "--memory must be >= 0"),
])
def test_an_option_no_workload_can_take_is_an_error(capsys, argv, message):
    with pytest.raises(SystemExit):
        train.parse_args(argv)
    assert message in capsys.readouterr().err
