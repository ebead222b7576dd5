"""The nuvec-mlx-plan command on an mlx-lm model folder built here (random weights, local tokenizer)."""

import json
import os
import subprocess
import sys

import pytest

from nuvec_mlx.mlx_lm import plan as command
from tests.helpers import model_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return model_folder(tmp_path_factory.mktemp("model"), "llama", dtype="float32", hidden=64, layers=4)


def test_a_plan_that_fits_prints_the_plan_and_the_report_and_exits_0(folder, tmp_path, capsys):
    out = tmp_path / "plan.json"
    status = command.main(["--model", str(folder), "--budget", "64MiB", "--batch-size", "2", "--max-seq-length",
                           "64", "--fine-tune-type", "full", "--num-layers", "-1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert status == 0
    assert printed.startswith("nv.plan for a budget of 64.0 MiB: fits")
    assert "model.layers.3" in printed and "Saved activations per block" in printed
    assert "self_attn.q_proj (nn.Linear output)" in printed
    data = json.loads(out.read_text())
    assert data["plan"]["fits"] and len(data["saved_activations"]["blocks"]) == 4


def test_synchronize_is_passed_to_the_planner(folder, tmp_path, capsys):
    out = tmp_path / "plan.json"
    status = command.main(["--model", str(folder), "--budget", "64MiB", "--batch-size", "2", "--max-seq-length",
                           "64", "--num-layers", "-1", "--no-report", "--synchronize", "--json", str(out)])
    assert status == 0 and "synchronize=True" in capsys.readouterr().out
    assert json.loads(out.read_text())["plan"]["synchronize"] is True


def test_a_budget_no_plan_meets_exits_1_and_says_so(folder, capsys):
    status = command.main(["--model", str(folder), "--budget", "1KiB", "--batch-size", "2", "--max-seq-length",
                           "64", "--num-layers", "4", "--no-report"])
    assert status == 1 and "no plan fits 0.0 MiB" in capsys.readouterr().out


def test_lora_and_the_largest_sequence(folder, capsys):
    status = command.main(["--model", str(folder), "--budget", "8MiB", "--batch-size", "2", "--max-seq-length",
                           "64", "--num-layers", "2", "--no-report", "--largest", "seq", "--optimizer", "adamw"])
    printed = capsys.readouterr().out
    assert status == 0 and "--largest seq: largest size that fits 8.0 MiB:" in printed


@pytest.mark.parametrize("args, message", [
    (["--budget", "lots"], "--budget: a size must be"),
    (["--budget", "1GiB", "--policies", "save_all"], "--policies: choose from"),
    (["--budget", "1GiB", "--max-seq-length", "1"], "--max-seq-length must be >= 2"),
])
def test_a_bad_command_line_is_a_parser_error(folder, args, message, capsys):
    with pytest.raises(SystemExit) as info:
        command.parse_args(["--model", str(folder), *args])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_more_layers_than_the_model_has_is_an_error(folder, capsys):
    with pytest.raises(SystemExit) as info:
        command.main(["--model", str(folder), "--budget", "1GiB"])  # mlx_lm.lora's default: 16 layers
    assert info.value.code == 2 and "--num-layers 16 is more than the model's 4 layers" in capsys.readouterr().err


def test_parse_bytes():
    assert command.parse_bytes("12GiB") == 12 << 30 and command.parse_bytes("1.5KiB") == 1536
    assert command.parse_bytes("800 MiB") == 800 << 20 and command.parse_bytes("4096") == 4096
    with pytest.raises(ValueError):
        command.parse_bytes("-1MiB")


def test_the_installed_command_runs(folder):
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "nuvec-mlx-plan"), "--model", str(folder),
                           "--budget", "64MiB", "--batch-size", "1", "--max-seq-length", "16", "--num-layers", "-1",
                           "--no-report"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fits" in done.stdout
