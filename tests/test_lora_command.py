"""The nuvec-mlx-lora command as a newcomer meets it: a small model, --help, the banner, flags that need
--grad-checkpoint, and a plan of nuvec-mlx-plan. The steps run eagerly (mx.compile disabled), as in
tests/test_mlx_lm.py: what is checked does not depend on compiling."""

import importlib.util
import json
import re
import sys

import mlx.core as mx
import pytest
import yaml
from mlx_lm import lora

import nuvec_mlx as nv
from nuvec_mlx import mlx_lm as nvlm
from nuvec_mlx.mlx_lm import lora as lora_command
from nuvec_mlx.mlx_lm import plan as plan_command
from tests.mlx_lm_folders import WORDS, data_folder, model_folder

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
    flags = ("--stages-ahead", "--attention-chunk", "--loss-chunk", "--mlp-chunk", "--projection-chunk", "--norm-chunk")
    for flag in (*flags, "--plan"):
        assert flag in helped
    nvlm.main(args(folder, data, tmp_path, "--grad-checkpoint", "--iters", 1))
    printed = ANSI.sub("", capsys.readouterr().out)
    banner = printed[printed.index("╭") : printed.index("╯")]
    assert banner.startswith("╭─ nuvec-mlx-lora ─") and "mlx_lm.lora" not in banner
    assert "checkpointed: every block" in banner


@pytest.mark.parametrize("key, setting", list(lora_command.CHUNK_FLAGS.items()))
def test_each_chunk_flag_sets_its_part_of_the_step_s_chunks(folder, data, tmp_path, eager, key, setting, capsys):
    nvlm.main(args(folder, data, tmp_path, "--grad-checkpoint", "--iters", 1, f"--{key.replace('_', '-')}", 16))
    printed = " ".join(ANSI.sub("", capsys.readouterr().out).split())
    said = dict(part.split(" ") for part in re.search(r"│ chunks (.+?) │", printed)[1].split(" · "))
    assert said == {part: "16" if part == setting else "auto" for part in lora_command.CHUNK_FLAGS.values()}


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--stages-ahead", 1),
        ("--attention-chunk", 64),
        ("--loss-chunk", 0),
        ("--mlp-chunk", 8),
        ("--projection-chunk", 16),
        ("--norm-chunk", 16),
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


@pytest.mark.parametrize(
    "flag", ["--attention-chunk", "--mlp-chunk", "--projection-chunk", "--norm-chunk", "--loss-chunk", "--scan-chunk"]
)
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
        ('{"modes": ["save_all"]}', "--plan {path}: modes ['save_all'] name no policy a saved plan can bring back"),
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
    error = capsys.readouterr().err
    assert "this model has 4 blocks in model.layers and no modules named ['backbone.blocks.0'" in error


@pytest.fixture(scope="module")
def deeper(tmp_path_factory):
    """``folder``'s model with 20 blocks: its first four have the names of ``folder``'s four."""
    return model_folder(tmp_path_factory.mktemp("deeper"), "llama", dtype="float32", hidden=32, layers=20)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """``folder``'s model in bfloat16."""
    return model_folder(tmp_path_factory.mktemp("bf16"), "llama", dtype="bfloat16", hidden=32, layers=4)


@pytest.fixture(scope="module")
def longer(data, tmp_path_factory):
    """``data`` with one training row of 40 words: 41 tokens, which mlx-lm pads to 65 (the plan's rows: 33)."""
    folder = data_folder(tmp_path_factory.mktemp("longer"))
    (folder / "train.jsonl").write_text(
        (data / "train.jsonl").read_text() + json.dumps({"text": " ".join(WORDS[:40])}) + "\n"
    )
    return folder


def fails(what):
    """A stand-in that fails the test when called: ``what`` must not happen before the error."""

    def called(*args, **kwargs):
        raise AssertionError(f"{what} before the command said what was wrong")

    return called


def test_a_plan_for_a_deeper_model_whose_first_blocks_match_is_refused_naming_both(
    deeper, data, saved_plan, tmp_path, capsys
):
    """On a 20-block model whose blocks 0-3 have the names of the plan's four, the plan would checkpoint
    blocks 0-3 and leave 16 unchecked (exit 0 before the plan recorded what it was made for)."""
    with pytest.raises(SystemExit) as info:
        nvlm.main(args(deeper, data, tmp_path, "--grad-checkpoint", "--plan", saved_plan))
    error = capsys.readouterr().err
    assert info.value.code == 2
    assert (
        f"nuvec-mlx-lora: error: --plan {saved_plan}: the plan was made for a model with 4 blocks in model.layers "
        "(4 planned: model.layers.0, model.layers.1, ..., model.layers.3); this model has 20 blocks in model.layers: "
        "plan again for this model"
    ) in error


@pytest.mark.parametrize(
    "case, message",
    [
        ("batch size", "the plan was made for batches of 2 rows, this run has --batch-size 4: pass --batch-size 2"),
        ("dtype", "the plan was made for float32 weights, this model has bfloat16 weights: plan again"),
        (
            "longer rows",
            "the plan was made for batches of 2 x 33 tokens; the longest row of this run's training set has 41 "
            "tokens, which mlx-lm pads to 65: plan again on this data, or pass --max-seq-length 33",
        ),
        ("saved before", "the plan does not record what it was made for"),
    ],
)
def test_a_plan_made_for_another_run_is_refused_before_training_naming_both(
    folder, bf16, data, longer, saved_plan, tmp_path, case, message, monkeypatch, capsys
):
    plan = saved_plan
    argv = args(folder, data, tmp_path, "--grad-checkpoint", "--plan", plan)
    if case == "batch size":
        argv += ["--batch-size", "4"]
        monkeypatch.setattr(lora, "load", fails("the model was loaded"))  # known from the command line
    elif case == "dtype":
        argv = args(bf16, data, tmp_path, "--grad-checkpoint", "--plan", plan)
    elif case == "longer rows":
        argv = args(folder, longer, tmp_path, "--grad-checkpoint", "--plan", plan)
    else:
        saved = json.loads(plan.read_text())
        del saved["made_for"]
        plan = tmp_path / "old.json"
        plan.write_text(json.dumps(saved))
        argv = args(folder, data, tmp_path, "--grad-checkpoint", "--plan", plan)
    monkeypatch.setattr(lora_command, "train", fails("training started"))
    with pytest.raises(SystemExit) as info:
        nvlm.main(argv)
    assert info.value.code == 2 and f"nuvec-mlx-lora: error: --plan {plan}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("attention_chunk", "lots", "expected auto or an int >= 0, got 'lots'"),
        ("stages_ahead", -1, "expected an int >= 0, got -1"),
        ("mlp_chunk", -3, "expected auto or an int >= 0, got -3"),
        ("projection_chunk", 1.5, "expected auto or an int >= 0, got '1.5'"),
        ("loss_chunk", "x", "expected auto or an int >= 0, got 'x'"),
    ],
)
def test_a_bad_value_of_a_config_file_is_refused_as_its_flag_is_before_loading(
    folder, data, tmp_path, key, value, message, unloaded, capsys
):
    flag = "--" + key.replace("_", "-")
    with pytest.raises(SystemExit) as info:
        nvlm.main(args(folder, data, tmp_path, "--grad-checkpoint", flag, str(value)))
    assert info.value.code == 2 and f"nuvec-mlx-lora: error: argument {flag}: {message}" in capsys.readouterr().err
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({key: value}))
    with pytest.raises(SystemExit) as info:
        nvlm.main(args(folder, data, tmp_path, "--grad-checkpoint", "--config", config))
    assert info.value.code == 2 and f"nuvec-mlx-lora: error: {key} in {config}: {message}" in capsys.readouterr().err


def broken(kind, folder, data, tmp_path):
    """The ``--model`` and ``--data`` of a case mlx-lm cannot load, and what the command says of it."""
    bad = tmp_path / "bad"
    if kind == "no data folder":
        return folder, tmp_path / "x", f"--data {tmp_path / 'x'}: no such folder"
    if kind == "a file as data":
        return folder, data / "train.jsonl", f"--data {data / 'train.jsonl'}: not a folder"
    if kind == "no model folder":
        return tmp_path / "m", data, f"--model {tmp_path / 'm'}: no such folder (nor a Hugging Face repository"
    if kind == "not a model folder":
        return data, data, f"--model {data}: no config.json in it: not a model folder that mlx-lm loads"
    bad.mkdir()
    for split in ("train", "valid"):
        (bad / f"{split}.jsonl").write_text((data / f"{split}.jsonl").read_text())
    if kind == "no train.jsonl":
        (bad / "train.jsonl").unlink()
        return folder, bad, f"--data {bad}: no train.jsonl, which --train needs"
    split = kind.split()[1]  # "empty train.jsonl"
    (bad / split).write_text("\n")
    return folder, bad, f"--data {bad}: {split} is empty"


KINDS = [
    "no data folder",
    "a file as data",
    "no model folder",
    "not a model folder",
    "no train.jsonl",
    "empty train.jsonl",
    "empty valid.jsonl",
]


@pytest.mark.parametrize("kind", KINDS)
def test_a_model_or_data_mlx_lm_cannot_load_is_a_usage_error_before_loading(
    folder, data, tmp_path, kind, unloaded, capsys
):
    model, data, message = broken(kind, folder, data, tmp_path)
    with pytest.raises(SystemExit) as info:
        nvlm.main(args(model, data, tmp_path))
    assert info.value.code == 2 and f"nuvec-mlx-lora: error: {message}" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets would look the name up")
def test_a_dataset_name_without_the_datasets_package_says_so_before_loading(folder, tmp_path, unloaded, capsys):
    with pytest.raises(SystemExit) as info:
        nvlm.main(args(folder, "org/no-such-set", tmp_path))
    assert info.value.code == 2
    assert "--data org/no-such-set: no such folder, and not a Hugging Face dataset here: loading one needs the " in (
        capsys.readouterr().err
    )


def test_without_train_or_test_it_says_so_before_loading(folder, data, tmp_path, unloaded, capsys):
    with pytest.raises(SystemExit) as info:
        nvlm.main([a for a in args(folder, data, tmp_path) if a != "--train"])
    assert info.value.code == 2
    assert "nuvec-mlx-lora: error: pass --train (fine-tune) or --test (evaluate adapters)" in capsys.readouterr().err
