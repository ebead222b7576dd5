"""The nuvec-mlx-lora command as a newcomer meets it: a small model, --help, the banner, flags that need
--grad-checkpoint, and a plan of nuvec-mlx-plan. The steps run eagerly (mx.compile disabled), as in
tests/test_mlx_lm.py: what is checked does not depend on compiling."""

import json
import re
import sys

import mlx.core as mx
import pytest
import yaml
from mlx_lm import lora

import nuvec_mlx as nv
from nuvec_mlx import mlx_lm as nvlm
from nuvec_mlx.mlx_lm import plan as plan_command
from tests.mlx_lm_folders import data_folder, model_folder

ANSI = re.compile(r"\x1b\[[0-9;]*m")
REPORT = re.compile(r"^\s+(\d+)\s+([0-9.]+) [▼▲]", re.M)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return model_folder(tmp_path_factory.mktemp("model"), "llama", dtype="float32", hidden=32, layers=4)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return data_folder(tmp_path_factory.mktemp("data"))


def args(folder, data, adapters, *extra):
    return [
        "--model",
        str(folder),
        "--train",
        "--data",
        str(data),
        "--adapter-path",
        str(adapters),
        "--iters",
        "2",
        "--batch-size",
        "2",
        "--steps-per-report",
        "1",
        "--val-batches",
        "1",
        "--seed",
        "0",
        *map(str, extra),
    ]


def losses(text: str) -> list[tuple[int, str]]:
    return [(int(it), loss) for it, loss in REPORT.findall(ANSI.sub("", text))]


def test_on_a_model_of_fewer_than_16_layers_it_fine_tunes_them_all_as_mlx_lm_lora_num_layers_all(
    folder, data, tmp_path, eager, monkeypatch, capsys
):
    nvlm.main(args(folder, data, tmp_path / "nuvec"))
    printed = ANSI.sub("", capsys.readouterr().out)
    assert "nuvec-mlx-lora: --num-layers not given: fine-tuning all 4 layers (mlx_lm.lora's default, 16," in printed
    assert json.loads((tmp_path / "nuvec" / "adapter_config.json").read_text())["num_layers"] == 4
    monkeypatch.setattr(sys, "argv", ["mlx_lm.lora", *args(folder, data, tmp_path / "mlx", "--num-layers", "4")])
    lora.main()
    assert losses(printed) == losses(capsys.readouterr().out) and len(losses(printed)) == 2
    ours, theirs = (mx.load(str(tmp_path / d / "adapters.safetensors")) for d in ("nuvec", "mlx"))
    assert sorted(ours) == sorted(theirs) and all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)


def test_more_layers_than_the_model_has_says_what_to_pass(folder, data, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        nvlm.main(args(folder, data, tmp_path, "--num-layers", 16))
    assert info.value.code == 2
    assert (
        "nuvec-mlx-lora: error: --num-layers 16 is more than the model's 4 layers: pass --num-layers 4 (or -1 for all)"
    ) in capsys.readouterr().err


def test_help_and_banner_say_it_is_nuvec_s(folder, data, tmp_path, eager, capsys):
    with pytest.raises(SystemExit) as info:
        nvlm.main(["--help"])
    helped = capsys.readouterr().out
    assert info.value.code == 0 and helped.startswith("usage: nuvec-mlx-lora")
    assert "nuvec's mlx_lm.lora" in " ".join(helped.split())
    for flag in ("--stages-ahead", "--attention-chunk", "--loss-chunk", "--mlp-chunk", "--plan"):
        assert flag in helped
    nvlm.main(args(folder, data, tmp_path, "--grad-checkpoint", "--iters", 1))
    printed = ANSI.sub("", capsys.readouterr().out)
    banner = printed[printed.index("╭") : printed.index("╯")]
    assert banner.startswith("╭─ nuvec-mlx-lora ─") and "mlx_lm.lora" not in banner
    assert "checkpointed: every block" in banner


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--stages-ahead", 1),
        ("--attention-chunk", 64),
        ("--loss-chunk", 0),
        ("--mlp-chunk", 8),
        ("--plan", "plan.json"),
    ],
)
@pytest.mark.parametrize("where", ["flag", "config file"])
def test_a_flag_that_acts_on_checkpointed_blocks_needs_grad_checkpoint(
    folder, data, tmp_path, flag, value, where, capsys
):
    if where == "flag":
        extra = [flag, value]
    else:
        (tmp_path / "config.yaml").write_text(yaml.safe_dump({flag[2:].replace("-", "_"): value}))
        extra = ["--config", tmp_path / "config.yaml"]
    with pytest.raises(SystemExit) as info:
        nvlm.main(args(folder, data, tmp_path, *extra))
    assert info.value.code == 2
    assert f"nuvec-mlx-lora: error: {flag} needs --grad-checkpoint (which checkpoints the blocks)" in (
        capsys.readouterr().err
    )


@pytest.fixture(scope="module")
def saved_plan(folder, data, tmp_path_factory):
    """A plan nuvec-mlx-plan saved for the model and data, its modes then set by hand: one block of each mode."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert (
        plan_command.main(
            ["--model", str(folder), "--data", str(data), "--batch-size", "2", "--budget", "64MB", "--save", str(path)]
        )
        == 0
    )
    saved = json.loads(path.read_text())
    saved["modes"] = ["plain", "save_nothing", "save_matmuls", "plain"]
    path.write_text(json.dumps(saved))
    return path


def test_a_plan_of_nuvec_mlx_plan_checkpoints_the_blocks_it_names_and_trains_as_mlx_lm_lora(
    folder, data, saved_plan, tmp_path, eager, monkeypatch, capsys
):
    capsys.readouterr()
    with nv.memory.timeline() as t:
        nvlm.main(args(folder, data, tmp_path / "nuvec", "--grad-checkpoint", "--plan", saved_plan))
    ours = losses(capsys.readouterr().out)
    steps = sorted({r.evaluation for r in t.readings})
    for s in steps:
        kinds = [r.kind for r in t.readings if r.evaluation == s]
        assert kinds.count("forward") == 2 and kinds.count("backward") == 2, kinds  # the two planned blocks only
    monkeypatch.setattr(sys, "argv", ["mlx_lm.lora", *args(folder, data, tmp_path / "mlx", "--num-layers", "4")])
    lora.main()
    assert ours == losses(capsys.readouterr().out) and len(ours) == 2


@pytest.mark.parametrize("flag", ["--attention-chunk", "--mlp-chunk", "--loss-chunk", "--scan-chunk"])
def test_a_plan_refuses_a_chunk_flag_it_was_not_measured_with(folder, data, saved_plan, tmp_path, flag, capsys):
    with pytest.raises(SystemExit) as info:
        nvlm.main(args(folder, data, tmp_path, "--grad-checkpoint", "--plan", saved_plan, flag, 8))
    assert info.value.code == 2
    assert f"nuvec-mlx-lora: error: {flag}: with --plan the blocks are checkpointed and chunked as the plan was" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json", "--plan {path}: not a plan that nuvec-mlx-plan --save wrote (JSONDecodeError"),
        ('{"modes": ["save_all"]}', "--plan {path}: not a plan that nuvec-mlx-plan --save wrote (ValueError"),
    ],
)
def test_a_file_that_is_no_plan_says_so(folder, data, tmp_path, content, message, capsys):
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as info:
        nvlm.main(args(folder, data, tmp_path, "--grad-checkpoint", "--plan", path))
    assert info.value.code == 2 and message.format(path=path) in capsys.readouterr().err


def test_a_plan_for_another_model_says_so(folder, data, saved_plan, tmp_path, capsys):
    other = json.loads(saved_plan.read_text())
    for b in other["blocks"]:
        b["name"] = b["name"].replace("model.layers", "backbone.blocks")
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit) as info:
        nvlm.main(args(folder, data, tmp_path, "--grad-checkpoint", "--plan", tmp_path / "other.json"))
    assert info.value.code == 2
    assert "--plan: the model has no blocks named ['backbone.blocks.0'" in capsys.readouterr().err
