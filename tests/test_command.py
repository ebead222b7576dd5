"""The nuvec-mlx-plan command on an mlx-lm model folder and dataset built here (random weights, local tokenizer)."""

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys

import pytest

import nuvec_mlx as nv
from nuvec_mlx.mlx_lm import plan as command
from nuvec_mlx.planner import fit
from tests.mlx_lm_folders import data_folder, model_folder

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return model_folder(tmp_path_factory.mktemp("model"), "llama", dtype="float32", hidden=64, layers=4)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return data_folder(tmp_path_factory.mktemp("data"))


def plan(capsys, *argv):
    """The command's exit status and what it printed after mlx-lm's banner (stdout)."""
    status = command.main([str(a) for a in argv])
    printed = ANSI.sub("", capsys.readouterr().out)
    return status, printed.split("Trainable parameters:", 1)[1].split("\n", 1)[1]


def longest_padded(data) -> int:
    """The tokens of the batch mlx-lm pads the longest row of ``data``'s training set to (one token per word,
    and the end of text)."""
    words = max(len(json.loads(line)["text"].split()) for line in (data / "train.jsonl").read_text().splitlines())
    return 1 + 32 * math.ceil((words + 1) / 32)


@pytest.fixture(scope="module")
def fitting(folder, data, tmp_path_factory):
    """One plan that fits, of the longest rows of the data: its exit status, output, JSON and saved plan."""
    out = tmp_path_factory.mktemp("plan")
    argv = [
        "--model",
        folder,
        "--data",
        data,
        "--batch-size",
        "8",
        "--budget",
        "64MB",
        "--save",
        out / "plan.json",
        "--json",
        out / "out.json",
    ]
    with contextlib.redirect_stdout(io.StringIO()) as printed:  # capsys is for one test
        status = command.main([str(a) for a in argv])
    return status, ANSI.sub("", printed.getvalue()), json.loads((out / "out.json").read_text()), out / "plan.json"


def test_a_plan_that_fits_is_short_plans_the_longest_rows_of_the_data_and_saves_a_plan(fitting, folder, data):
    status, printed, result, saved = fitting
    assert status == 0
    after = printed.split("Trainable parameters:", 1)[1].splitlines()[1:]
    assert after[0].startswith("fits 64.0 MB: the step peaks at ") and len(after) <= 6, after
    assert f"batch 8 x {longest_padded(data)} tokens: the longest sequences of the training set" in after[1]
    assert result["batch"] == {
        "rows": 8,
        "tokens": longest_padded(data),
        "source": "the longest sequences of the training set",
    }
    assert "Saved activations" not in printed and "recompute s" not in printed  # the details are behind a flag
    assert "nuvec-mlx-plan" in printed.split("Trainable")[0]  # the banner is the command's
    loaded = nv.Plan.load_json(saved)
    assert [b.name for b in loaded.blocks] == [f"model.layers.{i}" for i in range(4)]
    assert loaded.fits and loaded.budget == 64_000_000 == result["plan"]["budget"]


@pytest.mark.slow
def test_when_the_batch_does_not_fit_it_says_the_largest_batch_that_does(fitting, folder, data, tmp_path, capsys):
    _, _, result, _ = fitting
    start, least = result["plan"]["start"], result["plan"]["smallest"]
    budget = start + (least - start) * 6 // 10  # below the least any plan of 8 rows reaches
    status, printed = plan(
        capsys,
        "--model",
        folder,
        "--data",
        data,
        "--batch-size",
        8,
        "--budget",
        budget,
        "--json",
        tmp_path / "out.json",
    )
    found = json.loads((tmp_path / "out.json").read_text())["largest"]["batch"]
    assert status == 1 and printed.startswith(f"DOES NOT FIT {budget / 1e6:.1f} MB: the least any plan reaches is")
    assert 1 <= found["size"] < 8 and dict(map(tuple, found["peaks"]))[found["size"]] <= budget
    assert f"what fits: --batch-size {found['size']} (peak " in printed
    assert f"--grad-accumulation-steps {math.ceil(8 / found['size'])} keeps 8 rows per update" in printed


def test_the_summary_and_the_json_say_the_same_smallest_budget_and_the_banner_what_the_planner_runs(fitting):
    """``smallest`` is the least budget any plan fits by ``fits``'s own test, and the summary says it; the
    banner shows the batch the planner runs, not mlx-lm's training rows (``iters 1,000``)."""
    _, printed, result, _ = fitting
    found = result["plan"]
    assert found["fits"] and found["smallest"] <= found["budget"], found
    assert max(found["predicted"], found["measured"] + found["spread"]) <= found["budget"], found
    head = printed.split("Trainable parameters:", 1)[1].splitlines()[1]
    assert head.endswith(f"plans fit from {found['smallest'] / 1e6:.1f} MB"), head
    banner = printed[printed.index("╭") : printed.index("╯")]
    assert "iters" not in banner and "1,000" not in banner and re.search(r"│\s+batch\s+8\s", banner), banner


def test_when_nothing_fits_it_says_what_the_step_starts_with(folder, data, capsys):
    status, printed = plan(capsys, "--model", folder, "--data", data, "--batch-size", 2, "--budget", "1KiB")
    assert status == 1 and printed.startswith("DOES NOT FIT 1.0 kB: the least any plan reaches is ")
    said = next(line for line in printed.splitlines() if "nothing fits 1.0 kB: the step starts at " in line)
    # A LoRA run of an unquantized model, all 4 layers fine-tuned: LoRA is not a suggestion.
    assert said.endswith("; try fewer layers than --num-layers 4, a quantized model (QLoRA)"), said


def test_without_data_it_plans_random_tokens_and_details_show_each_block(folder, tmp_path, capsys):
    status, printed = plan(
        capsys,
        "--model",
        folder,
        "--batch-size",
        2,
        "--max-seq-length",
        64,
        "--budget",
        "64MiB",
        "--details",
        "--json",
        tmp_path / "out.json",
    )
    assert status == 0 and "batch 2 x 64 tokens: random tokens" in printed
    assert "model.layers.3" in printed and "Saved activations per block" in printed  # the details
    assert json.loads((tmp_path / "out.json").read_text())["batch"]["tokens"] == 64


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budget", "lots"], "--budget: a size is a number and a unit: B, KB, MB, GB, TB (powers of 1000) or KiB"),
        (["--budget", "12GiBs"], "--budget: a size is a number and a unit"),
        ([], "--budget is required"),
        (["--budget", "1GB", "--policies", "save_all"], "--policies: choose from save_everything"),
        (
            ["--budget", "1GB", "--num-layers", "16"],
            "--num-layers 16 is more than the model's 4 layers: pass --num-layers 4 (or -1 for all)",
        ),
    ],
)
def test_a_bad_command_line_says_what_was_wrong(folder, argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        command.main(["--model", str(folder), *argv])
    assert info.value.code == 2 and f"nuvec-mlx-plan: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, nbytes",
    [
        ("12GB", 12 * 10**9),
        ("12G", 12 * 10**9),
        ("12GiB", 12 << 30),
        ("800 MB", 800 * 10**6),
        ("800MiB", 800 << 20),
        ("1.5KiB", 1536),
        ("1.5kb", 1500),
        ("4096", 4096),
        ("2TB", 2 * 10**12),
    ],
)
def test_sizes_are_decimal_or_binary_as_their_unit_says(text, nbytes):
    assert command.parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["-1MB", "12 gigs", "0", "MB", ""])
def test_a_size_that_is_not_one_says_what_a_size_is(text):
    with pytest.raises(ValueError, match="a size (is a number and a unit|must be at least 1 byte)"):
        command.parse_bytes(text)


def test_the_installed_command_runs(folder):
    done = subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "nuvec-mlx-plan"),
            "--model",
            str(folder),
            "--budget",
            "64MiB",
            "--batch-size",
            "1",
            "--max-seq-length",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fits 67.1 MB" in ANSI.sub("", done.stdout)


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"attention_chunk": "lots"}, "attention_chunk in {config}: expected auto or an int >= 0, got 'lots'"),
        ({"stages_ahead": -1}, "stages_ahead in {config}: expected an int >= 0, got -1"),
        ({"largest": "all"}, "largest in {config}: expected one of seq, batch, got 'all'"),
        ({"data": "{tmp}/x"}, "--data {tmp}/x: no such folder"),
        ({"data": "{tmp}/empty"}, "--data {tmp}/empty: train.jsonl is empty"),
        ({"model": "{tmp}/m"}, "--model {tmp}/m: no such folder"),
    ],
)
def test_a_bad_config_value_data_or_model_is_a_usage_error_before_loading(
    folder, tmp_path, setting, message, unloaded, capsys
):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "train.jsonl").write_text("")
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in setting.items()}))
    with pytest.raises(SystemExit) as info:
        command.main([*([] if "model" in setting else ["--model", str(folder)]), "--budget", "1GB", "-c", str(config)])
    expected = message.format(config=config, tmp=tmp_path)
    assert info.value.code == 2 and f"nuvec-mlx-plan: error: {expected}" in capsys.readouterr().err


def test_longest_answers_the_length_that_fits_from_short_steps(folder, tmp_path, capsys):
    """--longest measures a half, three quarters and all of --max-seq-length and extrapolates to the budget: with
    --verify 0 the answer is the measurements' curve solved for it, beyond what was run and short of its reach.
    (--verify measures at the answer: at a budget the curve answers, a measurement a little over it falls back to
    the longest measured to fit; the test of the reach below checks a verified answer, far inside its budget.)"""
    argv = ["--model", folder, "--batch-size", "1", "--max-seq-length", "256", "--budget", "10MB"]
    status, printed = plan(capsys, *argv, "--longest", "--verify", 0, "--json", tmp_path / "o.json")
    found = json.loads((tmp_path / "o.json").read_text())["longest"]
    assert status == 0 and [size for size, _ in found["peaks"]] == [128, 192, 256]
    assert found["tokens"] > 256 and found["tokens"] % 8 == 0 and not found["verified"]
    assert not found["at_reach"]  # the curve's answer, short of 4 x 256
    assert f"longest sequence that fits 10.0 MB at batch 1: {found['tokens']} tokens" in printed
    assert "not run at that length" in printed
    # the budget's only use: the answer is the measurements' parabola solved for it
    assert found["tokens"] == fit.solve(found["peaks"], 10_000_000, command.LENGTH_MULTIPLE)


def test_longest_measures_past_the_length_where_the_chunk_rules_start_cutting_a_module(folder, tmp_path, capsys):
    """The MLP whole up to 160 tokens and in chunks of 160 past them (projections and norms whole): a step's peak
    falls where the MLP starts to be cut, so --longest measures three lengths past 160 where --max-seq-length
    leaves room (256), and where it does not (192) measures as before and says the answer is likely short."""
    argv = ["--model", folder, "--batch-size", "1", "--budget", "10MB", "--longest", "--verify", "0"]
    argv += ["--mlp-chunk", "160", "--projection-chunk", "0", "--norm-chunk", "0"]
    status, printed = plan(capsys, *argv, "--max-seq-length", 256, "--json", tmp_path / "past.json")
    found = json.loads((tmp_path / "past.json").read_text())["longest"]
    assert status == 0 and [size for size, _ in found["peaks"]] == [168, 208, 256] and found["whole_up_to"] == 160
    assert "short, likely" not in printed
    status, printed = plan(capsys, *argv, "--max-seq-length", 192, "--json", tmp_path / "across.json")
    found = json.loads((tmp_path / "across.json").read_text())["longest"]
    assert status == 0 and [size for size, _ in found["peaks"]] == [96, 144, 192] and found["tokens"] > 160
    assert "whole up to 160 tokens and cut it past them" in printed and "--max-seq-length 336 measures past" in printed


@pytest.mark.parametrize(
    "tokens, whole, lengths",
    [
        (12288, 8192, [8200, 10240, 12288]),  # Llama-3.1-8B on a GPU, its projections whole up to 8,192
        (8192, 8192, [4096, 6144, 8192]),  # none past it: as before
        (9216, 8192, [4608, 6912, 9216]),  # less than a quarter past it: as before
        (12288, 2341, [6144, 9216, 12288]),  # cut below every length measured
        (12288, 0, [6144, 9216, 12288]),
    ],
)
def test_longest_s_lengths_are_past_a_module_s_cut_where_a_quarter_of_the_longest_is(tokens, whole, lengths):
    assert command._lengths(tokens, whole) == lengths


@pytest.mark.parametrize("verify", [0, 1])
def test_longest_says_its_answer_is_a_lower_bound_where_the_budget_outreaches_its_extrapolation(
    folder, tmp_path, capsys, verify
):
    """A budget far above what --max-seq-length's steps take: the answer stops at 4x the longest length
    measured (measured there with --verify), and the command says longer may fit and how to measure it."""
    argv = ["--model", folder, "--batch-size", "1", "--max-seq-length", "64", "--budget", "4GB", "--longest"]
    status, printed = plan(capsys, *argv, "--verify", verify, "--json", tmp_path / "o.json")
    found = json.loads((tmp_path / "o.json").read_text())["longest"]
    assert status == 0 and found["tokens"] == 4 * 64 - command.LENGTH_MULTIPLE and found["at_reach"]
    assert "at least this: the extrapolation goes no further than 4x the longest length measured first" in printed
    assert "--max-seq-length 256 measures longer lengths" in printed and ("measured there" in printed) == bool(verify)
    assert found["verified"] == bool(verify) and len(found["peaks"]) == 3 + verify
    if verify:  # measured at the answer, where it fits
        assert dict(map(tuple, found["peaks"]))[found["tokens"]] <= 4e9


def test_longest_says_when_it_extrapolated_below_every_length_it_measured(folder, tmp_path, capsys):
    """Where a half, three quarters and all of --max-seq-length all peak over the budget, --verify 0's answer is
    read off the curve below its points: the command says so, and which --max-seq-length measures nearer it."""
    argv = ["--model", folder, "--batch-size", "1", "--max-seq-length", "256", "--budget", "2.5MB", "--longest"]
    status, printed = plan(capsys, *argv, "--verify", 0, "--json", tmp_path / "o.json")
    found = json.loads((tmp_path / "o.json").read_text())["longest"]
    assert all(peak > 2.5e6 for _, peak in found["peaks"]) and found["size"] == 0 and found["tokens"] < 128
    assert "extrapolated below every length measured, all over the budget" in printed
    assert f"--max-seq-length {max(24, 2 * found['tokens'])}, or let --verify run it" in printed


def test_a_plan_to_save_is_measured_with_the_chunks_nuvec_mlx_lora_trains_with(folder, tmp_path, unloaded, capsys):
    """nuvec-mlx-lora --plan trains with every chunk auto: --save with a chunk flag is refused before loading."""
    with pytest.raises(SystemExit) as info:
        command.main(["--model", str(folder), "--budget", "1GB", "--mlp-chunk", "64", "--save", str(tmp_path / "p")])
    assert info.value.code == 2
    assert "--save with --mlp-chunk: nuvec-mlx-lora --plan trains with every chunk auto" in capsys.readouterr().err
