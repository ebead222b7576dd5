"""The fine-tuning benchmark (nuvec-mlx-bench-train) and the mlx-lm models of nuvec_mlx_bench.testing it trains.

Sections: ``nuvec_mlx_bench.testing``'s mlx-lm models (architectures at a size, public configurations),
then ``benchmarks/train/`` (installed as nuvec_mlx_bench.train): its lengths, cases, report and command.
"""

import dataclasses
import itertools
import json
import signal
import sys
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.trainer import default_loss

import nuvec_mlx as nv
from nuvec_mlx import mlx_lm as nv_mlx_lm
from nuvec_mlx.memory import MiB
from nuvec_mlx.planner import fit as nv_planner_fit
from nuvec_mlx_bench import testing
from nuvec_mlx_bench.core import options
from nuvec_mlx_bench.train import cases, command, lengths, long, long_report, planner, report, trainers
from nuvec_mlx_bench.train.cases import NUVEC_STEPS, STRATEGIES, Case, TrainWorkload

TINY = TrainWorkload("llama", batch=2, seq=32, hidden=32, layers=2, vocab=64)
SMALLEST = ["--hidden", "32", "--layers", "2", "--seq", "32", "--vocab", "64", "--repeats", "1"]

# The public configurations as published (hidden / layers / heads / kv heads / head dim / intermediate /
# vocabulary / tied), written out again here so that a typo in either place fails.
PUBLISHED = {
    "llama-3.2-1b": (2048, 16, 32, 8, 64, 8192, 128256, True),
    "llama-3.2-3b": (3072, 28, 24, 8, 128, 8192, 128256, True),
    "llama-3.1-8b": (4096, 32, 32, 8, 128, 14336, 128256, False),
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936, True),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, 151936, True),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936, False),
    "qwen3.5-0.8b": (1024, 24, 8, 2, 256, 3584, 248320, True),
    "gemma-3-1b": (1152, 26, 4, 1, 256, 6912, 262144, True),
    "smollm2-1.7b": (2048, 24, 32, 32, 64, 8192, 49152, True),
    "qwen3-30b-a3b": (2048, 48, 32, 4, 128, 6144, 151936, False),
}
FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)


# --- nuvec_mlx_bench.testing: architectures at a size ------------------------------------------


@pytest.mark.parametrize("arch", testing.ARCHITECTURES)
def test_every_architecture_builds_at_a_tiny_size_in_its_dtype(arch):
    model, config = testing.mlx_lm_model(testing.mlx_lm_config(arch, 64, 3, vocab=64), "bfloat16")
    assert config["model_type"] == arch and len(model.layers) == 3
    assert model.layers[0].parameters()  # a block with weights
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.bfloat16}


def test_quantized_build_is_what_mlx_lm_convert_writes():
    model, config = testing.mlx_lm_model(testing.mlx_lm_config("llama", 64, 2, vocab=64), quantized=True)
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert model.layers[0].self_attn.q_proj.weight.dtype == mx.uint32


def test_1b_llama_config_has_the_shape_of_llama_3_2_1b():
    c = testing.mlx_lm_config("llama", 2048, 16)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["intermediate_size"]) == (
        32,
        8,
        64,
        8192,
    )


def test_at_every_width_the_key_value_heads_divide_the_heads():
    for hidden in range(32, 4097, 32):
        c = testing.mlx_lm_config("llama", hidden, 1)
        assert c["num_attention_heads"] % c["num_key_value_heads"] == 0, hidden


def test_a_width_of_18_heads_runs_its_attention():
    """1152 is 18 heads of 64: a quarter, 4 key-value heads, cannot group them; 3 can."""
    model, config = testing.mlx_lm_model(testing.mlx_lm_config("llama", 1152, 1, vocab=64), "float32")
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (18, 3)
    tokens, _ = testing.mlx_lm_batch(64, 1, 8)
    assert model(tokens).shape == (1, 9, 64)


def test_building_leaves_the_random_state_as_it_was_and_a_seed_gives_the_same_weights():
    key = mx.random.state[0]
    a, _ = testing.mlx_lm_model(testing.mlx_lm_config("qwen3", 64, 2, vocab=64), "float32", seed=3)
    assert mx.random.state[0] is key
    b, _ = testing.mlx_lm_model(testing.mlx_lm_config("qwen3", 64, 2, vocab=64), "float32", seed=3)
    c, _ = testing.mlx_lm_model(testing.mlx_lm_config("qwen3", 64, 2, vocab=64), "float32", seed=4)
    pa, pb, pc = (dict(tree_flatten(m.parameters())) for m in (a, b, c))
    assert all(mx.array_equal(pa[k], pb[k]).item() for k in pa)
    assert not mx.array_equal(pa["model.embed_tokens.weight"], pc["model.embed_tokens.weight"]).item()


@pytest.mark.parametrize(
    "args, error, message",
    [
        (("mamba", 64, 2), ValueError, "arch must be one of"),
        (("llama", 48, 2), ValueError, "hidden must be a multiple of 32"),
        (("llama", 64, 0), ValueError, "layers must be >= 1"),
        (("llama", 64.0, 2), TypeError, "hidden must be an int"),
        (("gemma4_text", 64, 2), ValueError, "gemma4_text needs layers >= 3"),
        (("gemma3_text", 64, 1), ValueError, "gemma3_text needs layers >= 2"),
    ],
)
def test_config_names_what_it_cannot_build(args, error, message):
    with pytest.raises(error, match=message):
        testing.mlx_lm_config(*args)


# --- nuvec_mlx_bench.testing: public configurations --------------------------------------------


def test_the_public_configurations_are_as_published():
    assert {name: tuple(c[f] for f in FIELDS) for name, c in testing.PUBLIC_CONFIGS.items()} == PUBLISHED
    types = {name: c["model_type"] for name, c in testing.PUBLIC_CONFIGS.items()}
    assert types == {
        "llama-3.2-1b": "llama",
        "llama-3.2-3b": "llama",
        "llama-3.1-8b": "llama",
        "qwen3-0.6b": "qwen3",
        "qwen3-1.7b": "qwen3",
        "qwen3-8b": "qwen3",
        "qwen3.5-0.8b": "qwen3_5",
        "gemma-3-1b": "gemma3_text",
        "smollm2-1.7b": "llama",
        "qwen3-30b-a3b": "qwen3_moe",
    }
    gemma, moe = testing.PUBLIC_CONFIGS["gemma-3-1b"], testing.PUBLIC_CONFIGS["qwen3-30b-a3b"]
    assert (gemma["sliding_window"], gemma["sliding_window_pattern"], gemma["query_pre_attn_scalar"]) == (512, 6, 256)
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["moe_intermediate_size"]) == (128, 8, 768)


def test_the_long_suite_s_configurations_have_their_published_positions_norms_and_layers():
    llama, qwen, hybrid = (testing.PUBLIC_CONFIGS[n] for n in ("llama-3.1-8b", "qwen3-8b", "qwen3.5-0.8b"))
    assert llama["rope_scaling"] == {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }
    assert (llama["rope_theta"], llama["rms_norm_eps"], llama["max_position_embeddings"]) == (500000.0, 1e-5, 131072)
    assert (qwen["rope_theta"], qwen["rms_norm_eps"], qwen["max_position_embeddings"]) == (1000000.0, 1e-6, 40960)
    linear = tuple(
        hybrid[f"linear_{k}"] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim")
    )
    assert linear == (16, 16, 128, 128) and (hybrid["linear_conv_kernel_dim"], hybrid["full_attention_interval"]) == (
        4,
        4,
    )
    rope = hybrid["rope_parameters"]
    assert (rope["rope_theta"], rope["partial_rotary_factor"], hybrid["max_position_embeddings"]) == (1e7, 0.25, 262144)
    assert testing.PUBLIC_CONFIGS["llama-3.2-1b"]["rope_scaling"]["factor"] == 32.0  # 3.1's own copy, not 3.2's


def test_a_public_configuration_at_fewer_layers_is_a_copy():
    config = testing.public_config("qwen3-30b-a3b", layers=2)
    config["mlp_only_layers"].append(1)
    assert config["num_hidden_layers"] == 2 and testing.PUBLIC_CONFIGS["qwen3-30b-a3b"]["num_hidden_layers"] == 48
    assert testing.PUBLIC_CONFIGS["qwen3-30b-a3b"]["mlp_only_layers"] == []


@pytest.mark.parametrize(
    "name, layers, message",
    [
        ("gpt-2", None, "name must be one of"),
        ("qwen3-0.6b", 29, "layers must be from 1 to qwen3-0.6b's 28"),
        ("gemma-3-1b", 5, "layers must be from 6 to gemma-3-1b's 26"),
        ("qwen3-0.6b", 0, "layers must be >= 1"),
    ],
)
def test_public_config_names_what_it_cannot_take(name, layers, message):
    with pytest.raises(ValueError, match=message):
        testing.public_config(name, layers)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(testing.PUBLIC_CONFIGS))
def test_every_public_configuration_builds_shallow_and_runs_with_its_heads_and_vocabulary(name):
    """At its full width and vocabulary, one layer deep (six for Gemma 3: its first global layer; four for
    Qwen3.5: its first attention layer, after three gated delta-net ones)."""
    config = testing.public_config(name, layers={"gemma-3-1b": 6, "qwen3.5-0.8b": 4}.get(name, 1))
    # MLX's CPU gather matmul (the experts') takes float32 only.
    model, _ = testing.mlx_lm_model(config, "float32" if name == "qwen3-30b-a3b" else "bfloat16")
    hidden, _, heads, kv_heads, head_dim, _, vocab, tied = PUBLISHED[name]
    attention = next(b.self_attn for b in model.layers if "self_attn" in b)
    gate = 2 if config.get("attn_output_gate") else 1  # Qwen3.5's queries carry their output gate
    counts = [
        getattr(attention, n, None) for n in ("n_heads", "n_kv_heads", "num_attention_heads", "num_key_value_heads")
    ]
    assert [c for c in counts if c is not None] == [heads, kv_heads]  # mlx-lm's names, or Qwen3-Next's (Qwen3.5)
    assert attention.q_proj.weight.shape == (gate * heads * head_dim, hidden)
    assert attention.k_proj.weight.shape == (kv_heads * head_dim, hidden)
    assert ("lm_head" not in model) == tied  # a tied head is the embedding's (gemma3_text as mlx-lm loads it)
    tokens, _ = testing.mlx_lm_batch(vocab, 1, 8)
    logits = model(tokens[:, :-1])
    assert logits.shape == (1, 8, vocab) and mx.isfinite(logits).all().item()


# --- train/lengths.py -------------------------------------------------------------------


@pytest.mark.parametrize(
    "limit, start, expected", [(500, 256, 448), (500, 64, 448), (100, 256, 64), (10, 256, 0), (10**6, 256, 4096)]
)
def test_search_finds_the_largest_fitting_multiple_by_measuring(limit, start, expected):
    tried = []

    def fits(seq):
        tried.append(seq)
        return seq <= limit

    assert lengths.largest_fitting(fits, start, granularity=64, cap=4096) == expected
    assert expected in tried or expected == 0  # measured, not inferred
    assert all(s % 64 == 0 and s <= 4096 for s in tried)


def test_search_rejects_a_cap_below_its_granularity():
    with pytest.raises(ValueError, match="cap must be at least the granularity 64"):
        lengths.largest_fitting(lambda s: True, 64, 64, 32)


def test_growth_tells_what_grows_with_the_length_from_what_grows_with_its_square():
    peaks = {t: 5 * MiB + 2048 * t + 16 * t * t for t in (512, 1024, 2048, 4096)}
    fit = lengths.growth(peaks)
    assert fit["constant"] == pytest.approx(5 * MiB) and fit["per_token"] == pytest.approx(2048)
    assert fit["per_token_squared"] == pytest.approx(16) and fit["max_residual"] < 1e-3 * MiB
    linear = lengths.growth({t: 5 * MiB + 2048 * t for t in (512, 1024, 2048)})
    assert abs(linear["per_token_squared"]) < 1e-9 and lengths.growth({512: 1, 1024: 2}) is None


def test_growth_is_said_in_mib_at_a_length():
    fit = lengths.growth({t: 4 * MiB + MiB * t + (MiB // 4) * t * t for t in (1, 2, 4)})
    assert report.growth_text(fit, 4) == "at 4 tokens: 4.0 + 4.0 (x T) + 4.0 (x T²) MiB"


# --- train/cases.py ---------------------------------------------------------------------


def one_step(w: TrainWorkload, strategy: str) -> tuple[float, dict, list[str]]:
    """The loss of a strategy's first step, the trainable weights after it, and the kinds of its stages."""
    case = Case(w, strategy)
    with nv.memory.timeline() as t:
        loss, _ = case.step(case.batch(w.seq))
        case.evaluate(loss)
    return loss.item(), dict(tree_flatten(case.model.trainable_parameters())), [r.kind for r in t.readings]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


@pytest.mark.parametrize("mode", ["full", "lora", "qlora"])
def test_every_strategy_takes_the_same_training_step(eager, mode):
    """A vocabulary of 1024 over a width of 32 splits nuvec's loss head into chunks (two of 16 tokens x 8
    rows, the 128-row floor): the same step, the sum over tokens reordered (equal to the bit here); without
    chunks, the very same operations."""
    w = TrainWorkload("llama", batch=8, seq=32, hidden=32, layers=2, vocab=1024, mode=mode)
    plain_loss, plain, _ = one_step(w, "none")
    for s in STRATEGIES[1:]:
        loss, weights, kinds = one_step(w, s)
        if s not in NUVEC_STEPS or NUVEC_STEPS[s].loss is default_loss:
            assert loss == plain_loss and "chunk" not in kinds, s
            assert_same_weights(weights, plain)
            continue
        assert kinds.count("chunk") >= 4, (s, kinds)  # the head's chunks, each its value and its gradient
        assert loss == pytest.approx(plain_loss, rel=1e-6)
        for k in plain:  # within a bfloat16 rounding of the largest weight
            ours, theirs = (np.array(a[k].astype(mx.float32)) for a in (weights, plain))
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=2**-8 * np.abs(theirs).max())


def test_nuvecs_strategies_are_training_steps_with_the_chunks_they_name():
    for s, how in NUVEC_STEPS.items():
        case = Case(TINY, s)
        assert isinstance(case.training, nv.TrainingStep) and case.training.ahead == how.ahead
        loss = case.training.loss_fn
        if how.chunks.head is None:
            assert loss is default_loss
        else:
            assert loss.func is nv_mlx_lm.chunked_loss and loss.keywords == {"chunk": how.chunks.head}
        assert all(nv.is_checkpointed(b) for b in case.model.layers)  # for the case's life


def test_with_lora_dropout_mlx_lm_s_checkpoint_takes_another_step_and_nuvec_the_unchecked_one(eager):
    w = TrainWorkload("llama", batch=2, seq=32, hidden=32, layers=2, vocab=64, mode="lora", lora_dropout=0.5)
    _, plain, _ = one_step(w, "none")
    assert_same_weights(one_step(w, "nuvec")[1], plain)
    theirs = one_step(w, "mlx-lm")[1]
    assert any(not mx.array_equal(theirs[k], plain[k]).item() for k in plain)


def test_mlx_lm_strategy_checkpoints_its_class_only_while_its_step_runs():
    case = Case(TINY, "mlx-lm")
    cls = type(case.model.layers[0])
    plain = cls.__dict__["__call__"]
    case.evaluate(case.step(case.batch(32)))
    assert cls.__dict__["__call__"] is plain


@pytest.mark.parametrize(
    "strategy, head, mlp",
    [("nuvec", ["chunk"] * 2, []), ("nuvec-unchunked", [], []), ("nuvec-mlp-chunks", ["chunk"] * 2, ["chunk"] * 2)],
)
def test_nuvecs_steps_stage_every_block_its_update_and_the_chunked_head(strategy, head, mlp, monkeypatch):
    """The head here is one chunk (64 tokens of vocabulary over a width of 32): its value, then its
    gradient, taken in the forward pass; each MLP of nuvec-mlp-chunks is two chunks of 16 tokens here, each
    a stage in the forward pass and in the backward pass."""
    how = cases.NUVEC_STEPS["nuvec-mlp-chunks"]
    monkeypatch.setitem(cases.NUVEC_STEPS, "nuvec-mlp-chunks", dataclasses.replace(how, chunks=nv.Chunks(mlp=16)))
    case = Case(TINY, strategy)
    with nv.memory.timeline() as t:
        case.evaluate(case.step(case.batch(32)))
    expected = (mlp + ["forward"]) * 2 + head + (mlp + ["backward", "update"]) * 2 + ["outputs"]
    assert [r.kind for r in t.readings] == expected


@pytest.mark.parametrize("strategy", ["nuvec", "mlx-lm"])
def test_a_timed_step_adds_its_dispatch_and_evaluation_to_the_cases_parts(strategy):
    case = Case(TINY, strategy)
    step, evaluate = case.timed(case.batch(32))
    evaluate(step())
    before = case.parts.snapshot()
    evaluate(step())
    parts = case.parts.mean_since(before)
    assert set(parts) == {"dispatch", "evaluation"} and all(v > 0 for v in parts.values())
    if strategy == "nuvec":  # the TrainingStep's own account of its last call
        assert parts == {"dispatch": case.training.dispatch_seconds, "evaluation": case.training.evaluation_seconds}


@pytest.mark.parametrize(
    "fields, error, message",
    [
        (dict(mode="dora"), ValueError, "mode"),
        (dict(batch=0), ValueError, "batch"),
        (dict(seq=1.5), TypeError, "seq"),
        (dict(dtype="int8"), ValueError, "dtype"),
        (dict(lora_dropout=1.0), ValueError, "lora_dropout"),
        (dict(model="gpt-2"), ValueError, "model must be one of"),
        (dict(hidden=None), ValueError, "hidden and layers"),
        (dict(model="qwen3-0.6b", layers=None), ValueError, "hidden and vocab must be None for qwen3-0.6b"),
        (dict(model="qwen3-0.6b", hidden=None, vocab=None, layers=40), ValueError, "layers must be from 1"),
    ],
)
def test_train_workload_names_the_field_that_is_wrong(fields, error, message):
    with pytest.raises(error, match=message):
        TrainWorkload(**{**TINY.__dict__, **fields})


def test_a_public_workload_takes_the_configuration_and_fewer_layers():
    w = TrainWorkload("gemma-3-1b", batch=1, seq=16, layers=6)
    assert w.config() == testing.public_config("gemma-3-1b", 6) and w.label().startswith("gemma-3-1b lora L=6 B=1")


# --- train/report.py and train/command.py -----------------------------------------------


def test_smallest_run_writes_table_json_markdown_and_the_plot(tmp_path, capsys, compiled):
    argv = [
        *SMALLEST,
        "--modes",
        "lora",
        "--memory",
        "3,4MiB",
        "--seqs",
        "32,64,96",
        "--seq-step",
        "32",
        "--max-seq",
        "128",
        "--out",
        str(tmp_path),
    ]
    assert command.main(argv) == 0
    out = capsys.readouterr().out
    assert "| llama lora H=32 V=64 L=2 B=2 T=32 bfloat16 | nuvec |" in out and "- llama lora" in out
    assert (
        "dispatch ms (min–max) | evaluation ms (min–max) | tokens/s | largest seq in 3MiB | largest seq in 4MiB |"
        in out
    )
    header, rule, *body = [line for line in out.splitlines() if line.startswith("| ")]
    assert header.count("|") == rule.count("|") == body[0].count("|")  # a Markdown table: one cell each
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["environment"]["command"].startswith("nuvec-mlx-bench-train --hidden 32")
    rows = {r["strategy"]: r for r in data["rows"]}
    assert sorted(rows) == sorted(STRATEGIES)
    for r in rows.values():
        assert sorted(int(s) for s in r["sweep"]) == [32, 64, 96]
        assert set(r["largest_seq"]) == {"3MiB", "4MiB"} and r["largest_seq"]["3MiB"] <= r["largest_seq"]["4MiB"]
        for size, memory in (("3MiB", 3 * MiB), ("4MiB", 4 * MiB)):
            peaks = {int(s): p for s, p in {**r["sweep"], **r["search"]}.items()}
            fitting = [s for s, p in peaks.items() if r["resident"] + p <= memory and s % 32 == 0]
            assert r["largest_seq"][size] == max(fitting, default=0)  # the largest length measured to fit
        assert r["tokens_per_s"] == pytest.approx(2 * 32 / r["time"]["median"])
        assert set(r["parts"]) == {"dispatch", "evaluation"} and r["parts"]["dispatch"]["median"] > 0
        assert set(r["growth"]) == {"constant", "per_token", "per_token_squared", "max_residual"}
    assert rows["none"]["peak_vs_none"] == 1 and rows["mlx-lm"]["peak_vs_mlx-lm"] == 1
    assert rows["nuvec-unchunked"]["peak_vs_nuvec-unchunked"] == 1
    assert (tmp_path / "peak_vs_seq.png").stat().st_size > 0
    assert "peak_vs_seq.png" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
def test_a_public_configuration_runs_shallow_end_to_end(tmp_path, compiled, capsys):
    argv = [
        "--configs",
        "qwen3-0.6b",
        "--layers",
        "1",
        "--modes",
        "lora",
        "--strategies",
        "none,nuvec",
        "--seq",
        "32",
        "--batch",
        "1",
        "--repeats",
        "1",
        "--memory",
        "0",
        "--seqs",
        "",
        "--out",
        str(tmp_path),
    ]
    got = command.run(argv)
    assert [r["label"] for r in got] == ["qwen3-0.6b lora L=1 B=1 T=32 bfloat16"] * 2
    assert f"wrote results.json, results.md into {tmp_path}" in capsys.readouterr().out  # no lengths: no plot
    assert got[1]["peak_vs_none"] > 0 and "largest_seq" not in got[1]


def test_target_check_says_met_or_by_how_much_it_missed():
    assert report._check("peak", 0.25, "<=", 0.3) == "peak 0.25 (target <= 0.3: met)"
    assert report._check("largest seq", 2.5, ">=", 3) == "largest seq 2.50 (target >= 3: MISSED by 0.50)"


def test_h200_suite_is_the_issues_public_configurations_and_memories():
    args = command.parse_args(["--suite", "h200"])
    assert [(w.model, w.mode, w.layers) for w in args.workloads] == [
        (c, m, None) for c in ("llama-3.2-1b", "qwen3-0.6b", "gemma-3-1b") for m in ("full", "lora")
    ]
    assert (args.seq, args.batch, args.dtype, args.memory) == (2048, 4, "bfloat16", [8 << 30, 16 << 30, 32 << 30])
    assert args.seqs[-1] == 8192 and {"none", "mlx-lm", "nuvec", "nuvec-unchunked"} == set(args.strategies)


def test_configs_alone_run_no_architecture_and_archs_alone_no_configuration():
    args = command.parse_args(
        ["--suite", "h200", "--archs", "qwen3", "--hidden", "1024", "--layers", "28", "--vocab", "151936"]
    )
    assert {(w.model, w.hidden, w.layers, w.vocab) for w in args.workloads} == {("qwen3", 1024, 28, 151936)}
    args = command.parse_args(["--configs", "qwen3-0.6b,smollm2-1.7b", "--layers", "2", "--modes", "full"])
    assert [(w.model, w.layers) for w in args.workloads] == [("qwen3-0.6b", 2), ("smollm2-1.7b", 2)]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--strategies", "mlx-lm,nuvec"], "none included"),
        (["--strategies", "none,mx"], "choose from"),
        (["--archs", "mamba"], "model must be one of"),
        (["--configs", "gpt-2"], "--configs: unknown ['gpt-2']"),
        (["--hidden", "48"], "multiple of 32"),
        (["--modes", "dora"], "mode must be one of"),
        (["--repeats", "0"], "--repeats: must be an int >= 1"),
        (["--throttle", "1", "--strategies", "none,mlx-lm"], "only nuvec's steps evaluate with nv.eval"),
        (["--memory", "-1"], "--memory sizes"),
        (["--memory", "16GB!"], "--memory sizes"),
        (["--configs", "gemma-3-1b", "--layers", "2"], "layers must be from 6"),
    ],
)
def test_an_option_no_workload_can_take_is_an_error(capsys, argv, message):
    with pytest.raises(SystemExit):
        command.parse_args(argv)
    assert message in capsys.readouterr().err


def test_doublings_are_the_peak_ratios_of_each_length_measured_with_its_double_from_1024():
    sweep = {"512": 4, "1024": 10, "2048": 21, "3000": 30, "4096": 44}
    assert report.doublings(sweep) == [(1024, 2.1), (2048, 44 / 21)]
    assert report.doublings({"512": 4, "1024": 9}) == []


def test_a_length_the_device_cannot_hold_does_not_fit_and_the_search_goes_on_with_a_fresh_case(tmp_path, monkeypatch):
    measure, stepped = command.peak_at, []

    def peak_at(case, seq, steps=1):  # the device runs out of memory past 64 tokens, as a CUDA allocation does
        stepped.append((case, seq))  # held: each case's identity stays its own
        if seq > 64:
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
        return measure(case, seq, steps)

    monkeypatch.setattr(command, "peak_at", peak_at)
    argv = [*SMALLEST, "--modes", "lora", "--strategies", "none,nuvec", "--seqs", "", "--memory", "1GiB"]
    rows = command.run([*argv, "--seq-step", "32", "--max-seq", "256", "--out", str(tmp_path)])
    for r in rows:
        assert r["largest_seq"] == {"1GiB": 64} and r["out_of_memory"] == [128, 96]
        assert set(r["search"]) == {32, 64}  # a length that did not run has no peak
    after = [next(case for case, seq in stepped[i + 1 :]) for i, (_, seq) in enumerate(stepped) if seq == 128]
    assert len(after) == 2 and all(a is not b for a, b in zip(after, [c for c, s in stepped if s == 128]))


def test_the_search_s_peak_at_a_length_is_the_highest_of_repeats_steps(tmp_path, monkeypatch):
    peaks = itertools.cycle([2 << 20, 9 << 20, 5 << 20])  # any three steps in a row: one of each
    monkeypatch.setattr(command.rounds, "peak", lambda step, finish, probe: next(peaks))
    argv = [*SMALLEST, "--modes", "lora", "--strategies", "none", "--seqs", "", "--memory", "1GiB", "--repeats", "3"]
    (row,) = command.run([*argv, "--seq-step", "32", "--max-seq", "64", "--out", str(tmp_path)])
    assert row["search"] == {32: 9 << 20, 64: 9 << 20}  # not the first, nor the median, of each length's three
    assert "in each of 3 steps after a warm-up step" in (tmp_path / "results.md").read_text()


def test_an_error_other_than_running_out_of_memory_stops_the_search(tmp_path, monkeypatch):
    def peak_at(case, seq, steps=1):
        raise RuntimeError("[scaled_dot_product_attention] Does not support VJP with respect to mask")

    monkeypatch.setattr(command, "peak_at", peak_at)
    argv = [*SMALLEST, "--modes", "lora", "--strategies", "none", "--seqs", "", "--memory", "1GiB"]
    with pytest.raises(RuntimeError, match="Does not support VJP"):
        command.run([*argv, "--out", str(tmp_path)])


def test_a_step_that_would_build_whole_logits_past_the_limit_is_not_run_and_does_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr("nuvec_mlx_bench.train.cases.LOGITS_LIMIT", 2 * 64 * 64)  # batch 2 x 64 tokens x 64
    argv = [*SMALLEST, "--modes", "lora", "--strategies", "none,nuvec-unchunked,nuvec", "--seqs", "32,64"]
    rows = {
        r["strategy"]: r
        for r in command.run(
            [*argv, "--memory", "1GiB", "--seq-step", "32", "--max-seq", "128", "--out", str(tmp_path)]
        )
    }
    for whole in ("none", "nuvec-unchunked"):  # mlx-lm's loss and the unchunked one build the whole logits
        assert set(rows[whole]["sweep"]) == {32} and rows[whole]["not_run"] == [64, 64]  # the sweep's, the search's
        assert rows[whole]["largest_seq"] == {"1GiB": 32}
    assert set(rows["nuvec"]["sweep"]) == {32, 64} and "not_run" not in rows["nuvec"]  # chunked: never whole
    assert rows["nuvec"]["largest_seq"] == {"1GiB": 128}
    assert "- not run (whole logits of 8,192 elements or more" in (tmp_path / "results.md").read_text()


# --- train/trainers.py, long.py, long_report.py: the long-sequence suite ----------------------


LONG = TrainWorkload("llama", batch=1, seq=128, hidden=64, layers=2, vocab=64, mode="lora")
LONG_ARGV = ["--suite", "long", "--archs", "llama", "--hidden", "64", "--layers", "2", "--vocab", "64"]


@pytest.fixture(scope="module")
def long_folder(tmp_path_factory):
    """LONG's model folder, built in this process (a tiny model: a fraction of a second)."""
    folder = trainers.model_folder(tmp_path_factory.mktemp("models"), LONG)
    trainers.build(LONG, folder)
    return folder


def fake_outcome(held: int, step_peaks: list[int], cap: int | None = None) -> trainers.Outcome:
    return trainers.Outcome(trainers.OK, held=held, peaks=step_peaks, seconds=[1.0] * len(step_peaks), cap=cap)


@pytest.mark.slow
def test_each_trainer_gives_every_steps_peak_and_time_through_its_own_train(long_folder):
    outcomes = {
        name: trainers.run(trainers.RunSpec(LONG, trainers.Trainer(name), 3, str(long_folder)))
        for name in ("mlx-lm", "nuvec")
    }
    mlx_lm, nuvec = outcomes["mlx-lm"], outcomes["nuvec"]
    assert mlx_lm.trainer_function == "mlx_lm.tuner.trainer.train"
    assert nuvec.trainer_function == "nuvec_mlx.mlx_lm.trainer.train"
    for o in outcomes.values():
        assert o.status == trainers.OK and o.returncode == 0, o.error
        assert len(o.peaks) == len(o.seconds) == len(o.losses) == 3  # one reading after each step
        assert all(p > 0 for p in o.peaks) and all(s > 0 for s in o.seconds)
    model, optimizer, _ = trainers.load(LONG, long_folder)  # what the model, adapters and Adam hold
    nbytes = sum(a.nbytes for t in (model.parameters(), optimizer.state) for _, a in tree_flatten(t))
    assert mlx_lm.held == nuvec.held and nbytes <= nuvec.held <= nbytes + (64 << 10)
    assert mlx_lm.trainer_peaks == [] and len(nuvec.trainer_peaks) == 3  # nuvec's train measures its own
    assert [nuvec.held + p for p in nuvec.peaks] == pytest.approx(nuvec.trainer_peaks, rel=0.01)
    assert mlx_lm.losses[0] == pytest.approx(nuvec.losses[0], rel=1e-3)  # the same model, row and adapters


def test_a_step_that_runs_out_of_memory_is_an_outcome_in_its_process(long_folder, tmp_path, monkeypatch):
    def train(*args, **kwargs):
        raise RuntimeError("[malloc] Unable to allocate 1099511627776 bytes.")

    monkeypatch.setattr(trainers, "trainer_function", lambda trainer: train)
    spec = trainers.RunSpec(LONG, trainers.Trainer("nuvec"), 2, str(long_folder))
    outcome = trainers.train_run(spec, tmp_path / "result.json")
    assert outcome.status == trainers.OUT_OF_MEMORY and "Unable to allocate" in outcome.error
    assert outcome.fits(1 << 40) is False and outcome.held > 0 and outcome.peaks == []

    def bug(*args, **kwargs):
        raise RuntimeError("[scaled_dot_product_attention] Does not support VJP with respect to mask")

    monkeypatch.setattr(trainers, "trainer_function", lambda trainer: bug)
    with pytest.raises(RuntimeError, match="Does not support VJP"):  # not memory: an error, not an outcome
        trainers.train_run(spec, tmp_path / "result.json")


def test_a_run_whose_process_ends_without_a_result_is_out_of_memory_or_crashed(long_folder):
    killed = (sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    spec = trainers.RunSpec(LONG, trainers.Trainer("mlx-lm"), 2, str(long_folder), cap=1 << 30)
    outcome = trainers.run(spec, command=killed)
    assert outcome.status == trainers.CRASHED and outcome.returncode == -signal.SIGKILL
    assert "exit status -9" in outcome.error
    assert outcome.fits(1 << 30) is False and outcome.fits(2 << 30) is None  # a larger cap may fit it


@pytest.mark.slow
def test_a_run_over_its_cap_is_ended_by_the_guard_as_it_passes_it(long_folder):
    spec = trainers.RunSpec(LONG, trainers.Trainer("nuvec"), 3, str(long_folder), cap=1 << 19)  # below the model
    outcome = trainers.run(spec)
    assert outcome.status == trainers.OVER_CAP and outcome.returncode == trainers.EXIT_OVER_CAP
    assert outcome.held > 1 << 19 and outcome.peaks == []  # ended before its first step finished
    assert outcome.fits(1 << 19) is False and outcome.fits(1 << 30) is None


def test_a_run_out_of_memory_does_not_stop_the_sweep(tmp_path):
    args = long.parse_args([*LONG_ARGV, "--modes", "lora", "--lengths", "64,128,256", "--steps", "2"])
    seen = []

    def runner(spec):
        if spec.trainer.name == "mlx-lm" and spec.workload.seq >= 128:
            return trainers.Outcome(trainers.OUT_OF_MEMORY, held=1 << 20, error="[malloc] Unable to allocate")
        return fake_outcome(1 << 20, [spec.workload.seq << 10] * 2)

    known = long.sweep(args.workloads[0], args, tmp_path, runner, seen.append)
    assert [(r["trainer"], r["length"], r["status"]) for r in seen] == [
        ("mlx-lm", 64, "ok"),
        ("nuvec", 64, "ok"),
        ("mlx-lm", 128, "out of memory"),
        ("nuvec", 128, "ok"),
        ("mlx-lm", 256, "out of memory"),
        ("nuvec", 256, "ok"),
    ]
    assert sorted(known["nuvec"]) == [64, 128, 256] and known["mlx-lm"][256].fits(1 << 40) is False


def test_search_finds_a_length_that_fits_and_one_granularity_longer_that_does_not():
    """Each probe's first step peaks highest (it counts: a run must survive it), at 1 KiB a token."""
    held, probes = 1 << 20, []

    def probe(length, memory):
        probes.append((length, memory))
        return fake_outcome(held, [length << 10, length << 9], cap=long.cap(memory))

    known = {256: fake_outcome(held, [256 << 10, 1]), 512: fake_outcome(held, [512 << 10, 1])}  # the sweep's
    memories = [held + (700 << 10), held + (3000 << 10)]
    found = long.search(probe, known, memories, start=256, granularity=64, max_length=8192)
    for memory, (size, f) in zip(memories, found.items()):
        assert size == options.size_text(memory)
        assert known[f["longest"]].fits(memory) and f["peak_in_all"] <= memory
        assert f["shortest_not_fitting"] == f["longest"] + 64 and not known[f["longest"] + 64].fits(memory)
    assert [f["longest"] for f in found.values()] == [640, 2944]  # 700 and 3000 KiB over held, 1 KiB a token
    assert 256 not in [t for t, _ in probes] and all(t % 64 == 0 for t, _ in probes)  # the sweep's length counts
    assert probes[0] == (1024, memories[0])  # from the longest length known to fit: 512, doubled


def test_a_length_stopped_under_a_smaller_memory_s_cap_is_measured_again_for_a_larger_memory():
    held, probes = 1 << 20, []

    def probe(length, memory):
        probes.append((length, memory))
        if held + (length << 10) > long.cap(memory):  # as the guard does
            return trainers.Outcome(trainers.OVER_CAP, held=held, cap=long.cap(memory))
        return fake_outcome(held, [length << 10], cap=long.cap(memory))

    memories, known = [held + (100 << 10), held + (1000 << 10)], {}
    found = long.search(probe, known, memories, start=256, granularity=64, max_length=4096)
    assert [f["longest"] for f in found.values()] == [64, 960]
    assert probes.index((256, memories[0])) < probes.index(
        (256, memories[1])
    )  # stopped at the first cap, not at the second
    assert known[256].status == trainers.OK


def test_a_length_the_trainer_fails_at_ends_the_search_there_and_what_smaller_memories_found_stands():
    """mlx-lm's step on CUDA fails past 2^31 logits with an error, not out of memory: the memories searched
    before it keep their lengths, the one searching it says the error, larger ones are not searched."""
    held, probes = MiB, []

    def probe(length, memory):
        probes.append(length)
        if length >= 4096:
            return trainers.Outcome(trainers.ERROR, error="cudaGraphAddKernelNode(...) failed: invalid argument")
        return fake_outcome(held, [length << 10], cap=long.cap(memory))  # 1 KiB a token

    found = long.search(probe, {}, [2 * MiB, 5 * MiB, 9 * MiB], start=64, granularity=64, max_length=8192)
    assert found["2MiB"]["longest"] == 1024 and found["2MiB"]["shortest_not_fitting"] == 1088
    error = "the run failed: cudaGraphAddKernelNode(...) failed: invalid argument"
    assert found["5MiB"] == {"memory": 5 * MiB, "error": error} and "9MiB" not in found
    assert probes.count(4096) == 1
    lines = long_report.search_table([{"workload": "w", "trainer": "mlx-lm", "results": found}])
    assert len({line.count("|") for line in lines}) == 1
    assert f"| 5MiB | error: {long_report.shortened(error)} |" in lines[3] and lines[3].endswith("invalid… | | | | |")


@pytest.mark.slow
def test_the_long_suite_searches_by_measuring_and_writes_its_files(tmp_path, capsys):
    argv = [*LONG_ARGV, "--modes", "lora", "--trainers", "nuvec", "--lengths", "64", "--steps", "2"]
    argv += ["--memory", "3MiB", "--granularity", "64", "--max-length", "512", "--plan-length", "128"]
    assert command.main([*argv, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    (search,) = data["searches"]
    found = search["results"]["3MiB"]
    (planned,) = data["plans"]  # nuvec-mlx-plan --longest on the same folder: measured at 64, 96 and 128 tokens
    assert [t for t, _ in planned["peaks"]] == [64, 96, 128] and planned["length"] == 128
    assert (planned["workload"], planned["trainer"], planned["memories"]) == (search["workload"], "nuvec", [3 << 20])
    assert planned["tokens"] > 128 and planned["seconds"] > 0  # extrapolated past what it measured
    runs = {r["length"]: r for r in data["runs"] if r["phase"] == "search" or r["length"] == 64}
    longest, over = runs[found["longest"]], runs[found["shortest_not_fitting"]]
    assert found["shortest_not_fitting"] == found["longest"] + 64
    assert longest["status"] == "ok" and longest["held"] + max(longest["peaks"]) <= 3 << 20
    if over["status"] == "ok":  # measured whole, over the memory
        assert over["held"] + max(over["peaks"]) > 3 << 20
    else:  # stopped past a cap at or above the memory
        assert over["status"] == trainers.OVER_CAP and over["cap"] >= 3 << 20
    assert data["environment"]["command"].startswith("nuvec-mlx-bench-train --suite long")
    assert {"mlx_lm", "device", "backend"} <= set(data["environment"])
    assert "| 3MiB | " in capsys.readouterr().out and (tmp_path / "peak_vs_length.png").stat().st_size > 0
    assert (tmp_path / "longest_vs_memory.png").stat().st_size > 0


def test_a_search_s_finding_is_written_before_the_planner_is_asked(tmp_path, monkeypatch):
    """A run cut off while the planner measures (minutes on a GPU) keeps what its search found."""

    def cut_off(*args, **kwargs):
        raise KeyboardInterrupt  # the run's time is up

    monkeypatch.setattr(long, "_model", lambda w, cache, models: tmp_path)
    monkeypatch.setattr(planner, "longest", cut_off)
    argv = [*LONG_ARGV, "--modes", "lora", "--trainers", "nuvec", "--lengths", "", "--memory", "3MiB"]
    argv += ["--granularity", "64", "--max-length", "512", "--plan-length", "128", "--out", str(tmp_path / "out")]
    with pytest.raises(KeyboardInterrupt):
        long.run(argv, runner=lambda spec: fake_outcome(MiB, [spec.workload.seq << 12]))  # 4 KiB a token
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    (search,) = data["searches"]
    assert search["results"]["3MiB"]["longest"] == 512 and data["plans"] == []


def test_the_planner_runs_once_beside_a_search_and_answers_each_memory_as_its_budget_would(tmp_path, monkeypatch):
    """One nuvec-mlx-plan run (minutes on a large model) for the largest memory; each smaller memory gets the
    command's own solve of the same measurements, the answer it would give for that budget at --verify 0."""
    peaks = [[128, 2 * MiB], [192, 3 * MiB], [256, 4 * MiB]]  # 16 KiB a token over 0 held
    asked = []

    def longest(w, t, folder, memory, length, timeout=None):
        asked.append((memory, length))
        return {"tokens": nv_planner_fit.solve(peaks, memory, 8), "peaks": peaks, "seconds": 3.0, "length": length}

    monkeypatch.setattr(long, "_model", lambda w, cache, models: tmp_path)
    monkeypatch.setattr(planner, "longest", longest)
    argv = [*LONG_ARGV, "--modes", "lora", "--trainers", "nuvec", "--lengths", "", "--memory", "3MiB,5MiB"]
    argv += ["--granularity", "64", "--max-length", "512", "--plan-length", "256", "--out", str(tmp_path / "out")]
    results = long.run(argv, runner=lambda spec: fake_outcome(MiB, [spec.workload.seq << 12]))
    assert asked == [(5 * MiB, 256)]
    ((search,), plans) = results["searches"], results["plans"]
    answers = {size: long_report.planned(plans, search["workload"], "nuvec", f["memory"])["tokens"]
               for size, f in search["results"].items()}  # fmt: skip
    assert answers == {"3MiB": 192, "5MiB": 320}  # 3 and 5 MiB at 16 KiB a token
    rows = [line for line in (tmp_path / "out" / "results.md").read_text().splitlines() if "| nuvec | 3MiB |" in line]
    assert rows[0].endswith(f"| 192 (measured at 128, 192, 256; 3 s) | {192 / 512:.2f} |")  # 512 fits 3 MiB here


def test_plan_only_asks_the_planner_for_every_memory_and_runs_no_probe(tmp_path, monkeypatch):
    """Minutes where a search takes tens: the planner's answers for memories a search of another run covers
    or none does (more memory than the device has), each a line of the table marked not searched."""
    peaks = [[128, 2 * MiB], [192, 3 * MiB], [256, 4 * MiB]]  # 16 KiB a token over 0 held
    monkeypatch.setattr(long, "_model", lambda w, cache, models: tmp_path)
    monkeypatch.setattr(planner, "longest", lambda *a, **k: {"peaks": peaks, "seconds": 3.0, "length": 256})

    def no_probe(spec):
        raise AssertionError(f"a run of {spec.workload.seq} tokens: --plan-only runs none")

    memories = "3MiB,9MiB,64MiB"  # 64 MiB: past 4 x 256 tokens, as far as the command extrapolates
    argv = [*LONG_ARGV, "--modes", "lora", "--trainers", "mlx-lm,nuvec", "--lengths", "", "--memory", memories]
    with pytest.raises(SystemExit):
        long.parse_args([*argv, "--plan-only"])  # no --plan-length: nothing to ask
    argv += ["--plan-length", "256", "--plan-only", "--out", str(tmp_path / "out")]
    results = long.run(argv, runner=no_probe)
    assert results["searches"] == [] and [p["trainer"] for p in results["plans"]] == ["nuvec"]
    md = (tmp_path / "out" / "results.md").read_text().splitlines()
    rows = [line for line in md if "| not searched |" in line]
    assert [r.split(" | ")[2:4] + [r.split(" | ")[6]] for r in rows] == [
        ["3MiB", "not searched", "192 (measured at 128, 192, 256; 3 s)"],
        ["9MiB", "not searched", "576 (measured at 128, 192, 256; 3 s)"],
        ["64MiB", "not searched", "at least 1,016 (measured at 128, 192, 256; 3 s)"],
    ]
    (ax,) = long_report.fits_plot(results).axes  # the lower bound drawn apart, a triangle
    drawn = [(line.get_marker(), list(line.get_ydata())) for line in ax.get_lines()]
    assert drawn == [("o", [192, 576]), ("^", [1016])]


def test_the_long_report_writes_its_table_json_and_plot(tmp_path):
    args = long.parse_args(
        [*LONG_ARGV, "--lengths", "64,128", "--memory", "4MiB", "--steps", "3", "--out", str(tmp_path)]
    )
    args.searched = args.memory
    at = {t: dataclasses.replace(args.workloads[0], seq=t) for t in (64, 128)}
    mlx_lm, nuvec = trainers.Trainer("mlx-lm"), trainers.Trainer("nuvec", chunks=(("mlp", 32),))
    runs = [
        long.record(at[64], mlx_lm, fake_outcome(MiB, [3 * MiB, 2 * MiB, 2 * MiB]), "sweep"),
        long.record(at[64], nuvec, trainers.Outcome(trainers.OK, MiB, [MiB] * 3, [9.0, 3.0, 5.0]), "sweep"),
        long.record(at[128], mlx_lm, trainers.Outcome(trainers.CRASHED, error="exit status -9, no result"), "sweep"),
        long.record(at[128], nuvec, fake_outcome(MiB, [2 * MiB] * 3), "sweep"),
    ]
    peaks = [[32, MiB], [48, MiB], [64, 2 * MiB]]  # 4 MiB: 80 tokens by the parabola through them
    plans = [{"workload": runs[0]["workload"], "trainer": "nuvec (mlp=32)", "memories": [4 * MiB], "peaks": peaks,
              "seconds": 7.2, "length": 64}]  # fmt: skip
    searches = [{"workload": runs[0]["workload"], "trainer": "mlx-lm", "results": {"4MiB": {
        "memory": 4 * MiB, "longest": 64, "peak_in_all": 4 * MiB, "shortest_not_fitting": 128}}},
        {"workload": runs[0]["workload"], "trainer": "nuvec (mlp=32)", "results": {"4MiB": {
        "memory": 4 * MiB, "longest": 128, "peak_in_all": 3 * MiB, "shortest_not_fitting": None}}}]  # fmt: skip
    results = {"environment": {"command": "c", "backend": "cpu", "device": "d", "mlx": "m", "blas": "b"}}
    written = long.write(args, {**results, "runs": runs, "searches": searches, "plans": plans})
    assert [p.name for p in written] == ["results.json", "results.md", "peak_vs_length.png", "longest_vs_memory.png"]
    md = (tmp_path / "results.md").read_text().splitlines()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md if line.startswith("| llama")]
    assert len({line.count("|") for line in md if line.startswith("| ")}) == 2  # the two tables, each regular
    blocks = f"{2 * 64 * 64 * 2 / MiB:.1f}"  # layers x tokens x hidden x 2 bytes
    assert rows[1][2:] == [
        "nuvec (mlp=32)", "1.0", "1.0 (1.0–1.0)", "2.0", blocks, f"{MiB / (2 * 64 * 64 * 2):.2f}",
        "4.00 (3.00–5.00)", "4.00", "ok",
    ]  # fmt: skip
    assert rows[2][-1] == "out of memory or crashed: exit status -9, no result"
    assert ["mlx-lm", "4MiB", "64", "4.0", "128", "", ""] in [r[1:] for r in rows]
    assert ["4MiB", "128", "3.0", "", "80 (measured at 32, 48, 64; 7 s)", "0.62"] in [r[2:] for r in rows]
    assert json.loads((tmp_path / "results.json").read_text())["runs"][2]["status"] == trainers.CRASHED


def test_the_planner_is_asked_with_the_runs_lora_and_nuvec_s_settings_as_its_flags(tmp_path):
    nuvec = trainers.Trainer("nuvec", chunks=(("mlp", 512), ("attention", "auto")), ahead=0)
    argv = planner.arguments(dataclasses.replace(LONG, batch=2), nuvec, tmp_path, 3 << 30, 4096, tmp_path / "c.json")
    flags = {a: b for a, b in zip(argv, [*argv[1:], ""]) if a.startswith("-") and not b.startswith("--")}
    assert flags["--max-seq-length"] == "4096" and flags["--budget"] == f"{3 << 30}B" and flags["--batch-size"] == "2"
    assert flags["--mlp-chunk"] == "512" and flags["--attention-chunk"] == "auto" and flags["--stages-ahead"] == "0"
    assert flags["--num-layers"] == "-1" and flags["--fine-tune-type"] == "lora" and "--longest" in argv
    assert planner.plans(trainers.Trainer("nuvec")) and not planner.plans(trainers.Trainer("mlx-lm"))
    with pytest.raises(ValueError, match="without segments, not nuvec \\(segment=sqrt\\)"):
        planner.longest(LONG, trainers.Trainer("nuvec", segment="sqrt"), tmp_path, 1 << 30, 128)


def test_qlora_s_model_is_quantized_as_mlx_lm_convert_does_and_lora_and_full_share_one(tmp_path):
    qlora = dataclasses.replace(LONG, mode="qlora")
    folder = trainers.model_folder(tmp_path, qlora)
    trainers.build(qlora, folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert (
        trainers.model_folder(tmp_path, dataclasses.replace(LONG, mode="full"))
        == trainers.model_folder(tmp_path, LONG)
        != folder
    )


def test_the_long_suite_s_defaults_and_the_values_it_refuses(capsys):
    args = long.parse_args(["--suite", "long"])
    assert [(w.model, w.mode, w.batch) for w in args.workloads] == [("llama-3.1-8b", "qlora", 1)]
    assert [t.label() for t in args.trainer_list] == ["mlx-lm", "nuvec"] and args.lengths[-1] == 65536
    args = long.parse_args(["--suite", "long", "--trainers", "nuvec", "--chunks", "mlp=2048,head=0", "--ahead", "0"])
    assert args.trainer_list[0].settings()["chunks"] == nv.Chunks(mlp=2048, head=None)
    for argv, message in [
        (["--trainers", "mlx-lm,torch"], "--trainers: choose from"),
        (["--steps", "1"], "--steps must be >= 2"),
        (["--chunks", "mlp"], "expected name=size"),
        (["--chunks", "mlp=-64"], "expected name=size"),
        (["--chunks", "mlp=64"], "nuvec's settings: add nuvec"),
        (["--trainers", "nuvec", "--chunks", "ffn=64"], "Chunks has the settings"),
        (["--lengths", "", "--memory", ""], "nothing to run"),
        (["--configs", "llama-4"], "--configs: unknown"),
        (["--plan-length", "4096", "--memory", "8GiB"], "it needs --memory and nuvec among --trainers"),
        (["--trainers", "nuvec", "--plan-length", "4096"], "it needs --memory and nuvec"),
        (["--trainers", "nuvec", "--segment", "2", "--memory", "8GiB", "--plan-length", "64"], "without --segment"),
    ]:
        with pytest.raises(SystemExit):
            long.parse_args(["--suite", "long", "--trainers", "mlx-lm", *argv])
        assert message in capsys.readouterr().err, argv


def test_the_command_runs_the_long_suite_with_its_own_options(monkeypatch, capsys):
    monkeypatch.setattr(long, "main", lambda argv: 7)
    assert command.main(["--suite", "long", "--steps", "3"]) == 7
    monkeypatch.undo()
    with pytest.raises(SystemExit):
        command.main(["--suite", "long", "--help"])
    out = capsys.readouterr().out
    assert "nuvec-mlx-bench-train --suite long" in out and "--search-steps" in out and "--chunks" in out
    with pytest.raises(SystemExit):
        command.parse_args(["--suite", "long"])
    assert "options of its own" in capsys.readouterr().err


def test_what_fits_draws_a_trainer_s_findings_as_one_line_across_its_searches():
    """As a merge of folders that each searched some memories gives them."""

    def found(gib: int, longest: int) -> dict:
        return {f"{gib}GiB": {"memory": gib << 30, "longest": longest, "peak_in_all": 1, "shortest_not_fitting": None}}

    searches = [
        {"workload": "w", "trainer": "nuvec", "results": found(24, 49152)},
        {"workload": "w", "trainer": "mlx-lm", "results": found(16, 1024)},
        {"workload": "w", "trainer": "nuvec", "results": found(16, 24576)},
    ]
    (ax,) = long_report.fits_plot({"searches": searches}).axes
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    assert lines == {"nuvec": ([16.0, 24.0], [24576, 49152]), "mlx-lm": ([16.0], [1024])}


#: A trainer's error as a run keeps it: the traceback, then the process's output.
TRACEBACK = 'Traceback (most recent call last):\n  File "t.py"\nRuntimeError: cudaGraph(...) failed\n\noutput: x'


def test_merge_reads_a_cut_off_search_s_findings_from_the_probes_it_measured(tmp_path):
    """A call's time ran out mid-search: the folder has its probes and no search; merged, each memory probed
    gets the longest length measured to fit and the shortest measured past it not to, an error among them."""
    args = long.parse_args([*LONG_ARGV, "--out", str(tmp_path / "a")])
    mlx_lm, memories = trainers.Trainer("mlx-lm"), [3 * MiB, 5 * MiB]
    probes = [  # (length, memory searched, outcome), 1 KiB a token over 1 MiB held
        (1024, memories[0], fake_outcome(MiB, [1 << 20, 1 << 20], cap=long.cap(memories[0]))),
        (2048, memories[0], fake_outcome(MiB, [2 << 20, 2 << 20], cap=long.cap(memories[0]))),
        (4096, memories[0], trainers.Outcome(trainers.OVER_CAP, held=MiB, cap=long.cap(memories[0]))),
        (3072, memories[1], fake_outcome(MiB, [3 << 20, 3 << 20], cap=long.cap(memories[1]))),
        (4096, memories[1], trainers.Outcome(trainers.ERROR, error=TRACEBACK)),
    ]
    runs = [long.record(dataclasses.replace(args.workloads[0], seq=t), mlx_lm, o, "search", m) for t, m, o in probes]
    env = {"command": "c", "backend": "cuda", "device": "d", "mlx": "m", "blas": "b"}
    long.write(args, {"environment": env, "models": [], "runs": runs, "searches": []})
    results = long.run(["--suite", "long", "--merge", str(tmp_path / "a"), "--out", str(tmp_path / "all")])
    (search,) = results["searches"]
    small, large = search["results"]["3MiB"], search["results"]["5MiB"]
    assert (small["longest"], small["peak_in_all"], small["shortest_not_fitting"]) == (2048, 3 * MiB, 3072)
    assert (large["longest"], large["shortest_not_fitting"], large["failed"]) == (3072, 4096, probes[-1][2].error)
    assert small["measured_only"] and "failed" not in small
    md = (tmp_path / "all" / "results.md").read_text()
    assert "| 5MiB | 3,072 (its probes' longest) | 4.0 | 4,096 (error: RuntimeError: cudaGraph(...) failed) |" in md
    assert "the search not finished; its findings read from its probes" in md


def test_merge_reads_a_memory_cut_off_in_one_folder_beside_a_search_finished_for_another_memory(tmp_path):
    """One folder's search finished for 3 MiB; another's, for 5 MiB, was cut off: merged, both memories have
    their findings, the cut-off one read from its probes."""
    args = long.parse_args([*LONG_ARGV, "--out", str(tmp_path / "a")])
    mlx_lm, small, large = trainers.Trainer("mlx-lm"), 3 * MiB, 5 * MiB
    env = {"command": "c", "backend": "cuda", "device": "d", "mlx": "m", "blas": "b"}
    fits = {"memory": small, "longest": 2048, "peak_in_all": 3 * MiB, "shortest_not_fitting": 3072}
    done = {"workload": long_report.model_label(args.workloads[0]), "trainer": "mlx-lm", "results": {"3MiB": fits}}
    long.write(args, {"environment": env, "models": [], "runs": [], "searches": [done]})
    probes = [(3072, fake_outcome(MiB, [3 << 20] * 2)), (4096, trainers.Outcome(trainers.OVER_CAP, held=MiB))]
    runs = [long.record(dataclasses.replace(args.workloads[0], seq=t), mlx_lm, o, "search", large) for t, o in probes]
    other = long.parse_args([*LONG_ARGV, "--out", str(tmp_path / "b")])
    long.write(other, {"environment": env, "models": [], "runs": runs, "searches": []})
    results = long.run(
        ["--suite", "long", "--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "all")]
    )
    found = {size: f for s in results["searches"] for size, f in s["results"].items()}
    assert found["3MiB"] == fits
    cut_off = found["5MiB"]
    assert (cut_off["longest"], cut_off["shortest_not_fitting"], cut_off["measured_only"]) == (3072, 4096, True)


def test_merge_sets_the_planner_s_answers_of_one_folder_beside_the_searches_of_others(tmp_path):
    """A --plan-only folder's answers go beside another folder's finished search, memory by memory; a folder
    written before the planner's records were kept apart gives each memory's answer, measured apart there,
    beside its own search still."""
    args = long.parse_args([*LONG_ARGV, "--out", str(tmp_path / "search")])
    workload = long_report.model_label(args.workloads[0])
    env = {"command": "c", "backend": "cuda", "device": "d", "mlx": "m", "blas": "b"}
    peaks = [[128, 2 * MiB], [192, 3 * MiB], [256, 4 * MiB]]  # 16 KiB a token over 0 held
    asked = {"peaks": peaks, "seconds": 3.0, "length": 256}

    def found(memory: int, longest: int, **planned: Any) -> dict:
        return {"memory": memory, "longest": longest, "peak_in_all": MiB, "shortest_not_fitting": None, **planned}

    search = {"workload": workload, "trainer": "nuvec", "results": {"3MiB": found(3 * MiB, 256)}}
    long.write(args, {"environment": env, "models": [], "runs": [], "searches": [search]})
    plan = {"workload": workload, "trainer": "nuvec", "memories": [3 * MiB, 9 * MiB], **asked}
    other = long.parse_args([*LONG_ARGV, "--out", str(tmp_path / "plan")])
    twice = [plan, {**plan, "memories": [9 * MiB]}]  # two runs asked for 9 MiB: one line for it
    long.write(other, {"environment": env, "models": [], "runs": [], "searches": [], "plans": twice})
    apart = {"peaks": [[t, p // 2] for t, p in peaks], "seconds": 5.0, "length": 256}  # 8 KiB a token
    old = {
        "workload": "old",
        "trainer": "nuvec",
        "results": {
            "4MiB": found(4 * MiB, 200, planner={"tokens": 1, **asked}),
            "6MiB": found(6 * MiB, 700, planner={"tokens": 1, **apart}),
        },
    }
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.json").write_text(
        json.dumps({"environment": env, "models": [], "runs": [], "searches": [old]})
    )
    folders = [str(tmp_path / f) for f in ("search", "plan", "old")]
    long.run(["--suite", "long", "--merge", *folders, "--out", str(tmp_path / "all")])
    md = (tmp_path / "all" / "results.md").read_text().splitlines()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md if "| nuvec |" in line]
    assert len(rows) == len({tuple(r[:3]) for r in rows}) == 4
    assert {tuple(r[:3]): r[6:] for r in rows} == {
        (workload, "nuvec", "3MiB"): ["192 (measured at 128, 192, 256; 3 s)", f"{192 / 256:.2f}"],
        ("old", "nuvec", "4MiB"): ["256 (measured at 128, 192, 256; 3 s)", f"{256 / 200:.2f}"],
        ("old", "nuvec", "6MiB"): ["768 (measured at 128, 192, 256; 5 s)", f"{768 / 700:.2f}"],
        (workload, "nuvec", "9MiB"): ["576 (measured at 128, 192, 256; 3 s)", ""],
    }


def test_merge_draws_earlier_runs_folders_as_one_with_times_set_against_their_own_folder_s(tmp_path, capsys):
    mlx_lm, nuvec = trainers.Trainer("mlx-lm"), trainers.Trainer("nuvec")
    folders = {"a": [(nuvec, 64)], "b": [(mlx_lm, 64), (nuvec, 128), (mlx_lm, 128)]}  # nuvec at 64: no mlx-lm in a
    for name, trained in folders.items():
        args = long.parse_args([*LONG_ARGV, "--out", str(tmp_path / name)])
        runs = []
        for trainer, length in trained:
            w = dataclasses.replace(args.workloads[0], seq=length)
            runs.append(long.record(w, trainer, fake_outcome(MiB, [MiB] * 3), "sweep"))
            runs[-1]["seconds"] = [2.0 if trainer is nuvec else 1.0] * 3
        env = {"command": f"c-{name}", "backend": "cpu", "device": f"d-{name}", "mlx": "m", "blas": "b"}
        long.write(args, {"environment": env, "models": [], "runs": runs, "searches": []})
    out = tmp_path / "all"
    results = long.run(["--suite", "long", "--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)])
    assert [(r["trainer"], r["length"], r["source"]) for r in results["runs"]] == [
        ("nuvec", 64, "a"), ("mlx-lm", 64, "b"), ("nuvec", 128, "b"), ("mlx-lm", 128, "b")]  # fmt: skip
    md = (out / "results.md").read_text()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| llama")]
    assert sorted((r[1], r[2], r[9], r[-1]) for r in rows) == [
        ("128", "mlx-lm", "1.00", "`b`"), ("128", "nuvec", "2.00", "`b`"),
        ("64", "mlx-lm", "1.00", "`b`"), ("64", "nuvec", "", "`a`")]  # fmt: skip
    assert "- device: `by folder`" in md and "- `a`: `c-a`, ?, d-a" in md and "- `b`: `c-b`, ?, d-b" in md
    assert (out / "peak_vs_length.png").stat().st_size > 0 and "wrote" in capsys.readouterr().out
    for argv, message in [([str(tmp_path)], "no results.json"), ([str(tmp_path / "a")] * 2, "these repeat")]:
        with pytest.raises(SystemExit):
            long.parse_args(["--suite", "long", "--merge", *argv])
        assert message in capsys.readouterr().err
