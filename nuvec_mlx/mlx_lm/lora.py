"""The ``nuvec-mlx-lora`` command: ``mlx_lm.lora`` with nuvec's trainer (:func:`main`).

Also the frame both commands run in (:func:`run_mlx_lm_lora`): ``mlx_lm.lora``'s
own ``main`` (its parser, config files and defaults), under another name, with
arguments added and another ``run``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..chunking import Chunks
from .trainer import train

#: The command's name.
PROG = "nuvec-mlx-lora"
#: mlx_lm.lora's --num-layers default, used here only where the model has that many layers.
NUM_LAYERS = 16
#: What ``--help`` says the command is.
DESCRIPTION = (
    "nuvec's mlx_lm.lora: LoRA, DoRA, QLoRA and full fine-tuning with mlx_lm.lora's arguments, config files, "
    "datasets and adapter files, trained by nuvec_mlx. With --grad-checkpoint every block is checkpointed by "
    "nuvec (each block a stage of its own, its optimizer update right after its backward pass, attention and "
    "the loss head in chunks; or as a plan of nuvec-mlx-plan says, --plan); every report line ends with the "
    "step's peak memory (each rank's, under mlx.launch). Without --num-layers, it fine-tunes mlx_lm.lora's "
    "16 layers, or all of them on a model with fewer."
)
#: The flags that act on the checkpointed blocks, as config keys.
NEED_GRAD_CHECKPOINT = (
    "stages_ahead",
    "attention_chunk",
    "loss_chunk",
    "mlp_chunk",
    "projection_chunk",
    "norm_chunk",
    "scan_chunk",
    "plan",
)
#: The files of a ``--data`` folder, as mlx-lm reads them (``mlx_lm.tuner.datasets.load_local_dataset``).
SPLITS = ("train", "valid", "test")
#: Each chunk flag (as a config key) and the :class:`nuvec_mlx.Chunks` setting it gives.
CHUNK_FLAGS = {
    "loss_chunk": "head",
    "attention_chunk": "attention",
    "mlp_chunk": "mlp",
    "projection_chunk": "projections",
    "norm_chunk": "norms",
    "scan_chunk": "scan",
}

Run = Callable[[argparse.Namespace], None]


@contextlib.contextmanager
def swapped(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside, and what it was after."""
    held = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, held)


def fail(prog: str, message: str) -> None:
    """Stop the command as a bad command line does: ``prog: error: message`` on stderr, exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run_mlx_lm_lora(
    prog: str,
    description: str,
    argv: list[str] | None,
    add_arguments: Callable[[argparse.ArgumentParser], list[argparse.Action]],
    run: Run,
    unset: tuple[str, ...] = (),
) -> None:
    """``mlx_lm.lora``'s ``main`` as ``prog``: its parser with ``add_arguments``, config file and
    defaults, then ``run(args)`` in place of ``mlx_lm.lora.run``; ``--num-layers`` and the config keys
    ``unset`` get no mlx-lm default (``None`` when not given). A config file's values for the
    arguments ``add_arguments`` adds (the actions it returns) are checked and converted as their flags'
    are (:func:`_configured`), before ``run``."""
    if argv is not None and (isinstance(argv, str) or not all(isinstance(a, str) for a in argv)):
        raise TypeError(f"argv must be a list of str, got {type(argv).__name__}")
    # Imported here: importing mlx_lm.lora changes yaml's SafeLoader for every user of yaml.
    from mlx_lm import lora

    mlx_lm_parser, added = lora.build_parser, list[argparse.Action]()

    def build_parser() -> argparse.ArgumentParser:
        parser = mlx_lm_parser()
        parser.prog, parser.description = prog, description
        added[:] = add_arguments(parser)
        return parser

    def checked(args: Any) -> None:
        _configured(prog, added, args)
        run(args)

    defaults = {k: v for k, v in lora.CONFIG_DEFAULTS.items() if k not in ("num_layers", *unset)}
    command = [prog, *(sys.argv[1:] if argv is None else argv)]
    with (
        swapped(sys, "argv", command),
        swapped(lora, "build_parser", build_parser),
        swapped(lora, "CONFIG_DEFAULTS", defaults),
        swapped(lora, "run", checked),
    ):
        lora.main()


def _configured(prog: str, actions: Sequence[argparse.Action], args: Any) -> None:
    """Check the values of ``actions`` in ``args`` as their flags' are (``type``, ``choices``), and set them
    converted; a bad one, which only a config file can give (argparse checked the flags), is a command-line
    error naming its key and file."""
    for action in actions:
        value = getattr(args, action.dest, None)
        if value is None or value == action.default:
            continue
        try:
            value = action.type(str(value)) if callable(action.type) else value
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            fail(prog, f"{action.dest} in {args.config}: {e}")
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            fail(prog, f"{action.dest} in {args.config}: expected one of {choices}, got {value!r}")
        setattr(args, action.dest, value)


def check_sources(prog: str, args: Any) -> None:
    """A command-line error, before anything is loaded, where mlx-lm could not load ``--model`` or
    ``--data`` as ``args`` asks (``mlx_lm.utils.load``, ``mlx_lm.tuner.datasets.load_dataset``): a local
    path that does not exist (a name that could be a Hugging Face repository is left to mlx-lm), a data
    folder without the files ``--train`` and ``--test`` need, or with an empty one."""
    model = Path(str(args.model))
    if not model.exists() and not _repository_id(str(args.model)):
        fail(prog, f"--model {args.model}: no such folder (nor a Hugging Face repository, such as org/name)")
    if model.exists() and not (model / "config.json").is_file():
        fail(prog, f"--model {args.model}: no config.json in it: not a model folder that mlx-lm loads")
    if args.data is None or getattr(args, "hf_dataset", None):
        return
    data = Path(str(args.data))
    if data.exists():
        _check_data_folder(prog, args)
    elif not _repository_id(str(args.data)):
        fail(prog, f"--data {args.data}: no such folder (a folder of {', '.join(f'{s}.jsonl' for s in SPLITS)})")
    elif importlib.util.find_spec("datasets") is None:
        fail(
            prog,
            f"--data {args.data}: no such folder, and not a Hugging Face dataset here: loading one needs the "
            "datasets package (pip install datasets)",
        )


def _check_data_folder(prog: str, args: Any) -> None:
    """An existing ``--data``: a folder whose JSONL files mlx-lm reads hold a row each, with the training
    set for ``--train`` and the test set for ``--test``."""
    data = Path(str(args.data))
    if not data.is_dir():
        fail(prog, f"--data {args.data}: not a folder (a folder of {', '.join(f'{s}.jsonl' for s in SPLITS)})")
    for split, needed in zip(SPLITS, (args.train, False, args.test), strict=True):
        path = data / f"{split}.jsonl"
        if needed and not path.is_file():
            flag = "--train" if split == "train" else "--test"
            fail(prog, f"--data {args.data}: no {split}.jsonl, which {flag} needs")
        if path.is_file() and _empty(path):
            fail(prog, f"--data {args.data}: {split}.jsonl is empty")


def _empty(path: Path) -> bool:
    """Whether a JSONL file holds no row (no line but blank ones), which mlx-lm cannot read a format from."""
    with path.open() as lines:
        return not any(line.strip() for line in lines)


def _repository_id(name: str) -> bool:
    """Whether ``name`` could name a Hugging Face repository (``name`` or ``org/name``), as mlx-lm tries
    where no local path has it."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def fine_tuned_layers(prog: str, args: Any, layers: int) -> None:
    """Set ``args.num_layers`` for a model of ``layers`` blocks: unset, mlx_lm.lora's 16 or all of them
    where it has fewer (said in a line); more than it has, an error that says what to pass."""
    if args.num_layers is None:
        args.num_layers = min(NUM_LAYERS, layers)
        if layers < NUM_LAYERS:
            print(
                f"{prog}: --num-layers not given: fine-tuning all {layers} layers (mlx_lm.lora's default, "
                f"{NUM_LAYERS}, is more than the model has)"
            )
    elif args.num_layers > layers:
        fail(
            prog,
            f"--num-layers {args.num_layers} is more than the model's {layers} layers: pass --num-layers "
            f"{layers} (or -1 for all)",
        )


@contextlib.contextmanager
def preparing(prog: str, rows: Callable[[Any], list[tuple[str, str]]], leave_out: Sequence[str] = ()) -> Iterator[None]:
    """Inside, ``mlx_lm.lora.train_model`` sets ``--num-layers`` as :func:`fine_tuned_layers` does, and
    its banner is titled ``prog``, mlx-lm's rows but those labelled as in ``leave_out``, then ``rows(args)``."""
    from mlx_lm import cli_ui, lora

    mlx_lm_train_model, mlx_lm_panel = lora.train_model, cli_ui.print_header_panel

    def train_model(args: Any, model: Any, *rest: Any, **kwargs: Any) -> Any:
        fine_tuned_layers(prog, args, len(model.layers))

        def panel(console: Any, title: str, mlx_lm_rows: list[tuple[str, str]]) -> None:
            kept = [(label, value) for label, value in mlx_lm_rows if label not in leave_out]
            mlx_lm_panel(console, prog, [*kept, *rows(args)])

        with swapped(cli_ui, "print_header_panel", panel):
            return mlx_lm_train_model(args, model, *rest, **kwargs)

    with swapped(lora, "train_model", train_model):
        yield


def main(argv: list[str] | None = None) -> None:
    """The ``nuvec-mlx-lora`` command: ``mlx_lm.lora`` training with :func:`train`.

    It takes ``mlx_lm.lora``'s arguments and config files unchanged
    (``--grad-checkpoint`` checkpoints every block with nuvec), and eight more,
    each also a key of a config file, each needing ``--grad-checkpoint``:
    ``--stages-ahead N`` (``stages_ahead``), :func:`~nuvec_mlx.mlx_lm.train`'s
    ``ahead``; ``--loss-chunk``, ``--attention-chunk``, ``--mlp-chunk``,
    ``--projection-chunk``, ``--norm-chunk`` and ``--scan-chunk``
    (``loss_chunk`` ...), its ``chunks`` (:class:`nuvec_mlx.Chunks`: the loss
    head's, attention's, the MLP's, attention's projections', the norms' and
    the recurrences' chunks): ``auto`` (the default), a size in tokens, or 0
    for none; ``--plan plan.json`` (``plan``),
    the blocks checkpointed as a plan of ``nuvec-mlx-plan --save`` says
    (:meth:`nuvec_mlx.Plan.apply` after mlx-lm's LoRA conversion) instead of
    every block. Without ``--num-layers`` (or ``num_layers``), it fine-tunes
    mlx-lm's 16 layers, or every layer of a model with fewer.

    Args:
        argv: the arguments, as on the command line (default ``sys.argv[1:]``).

    Example:
        >>> main(["--model", "./model", "--train", "--data", "./data", "--grad-checkpoint"])
    """
    from mlx_lm import lora

    mlx_lm_run = lora.run

    def run(args: Any) -> None:
        given = [k for k in NEED_GRAD_CHECKPOINT if getattr(args, k) is not None]
        if given and not args.grad_checkpoint:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            fail(
                PROG,
                f"{flags} {'needs' if len(given) == 1 else 'need'} --grad-checkpoint (which checkpoints the blocks)",
            )
        for name in CHUNK_FLAGS:
            if args.plan is not None and getattr(args, name) is not None:
                fail(
                    PROG,
                    f"--{name.replace('_', '-')}: with --plan the blocks are checkpointed and chunked as the plan was "
                    "measured (every chunk auto); leave it out",
                )
        if not args.train and not args.test:
            fail(PROG, "pass --train (fine-tune) or --test (evaluate adapters): mlx_lm.lora does one of them")
        settings = {
            "ahead": args.stages_ahead,
            "chunks": chunks_of(args),
            "plan": None if args.plan is None else _load_plan(args.plan, args.batch_size),
        }
        check_sources(PROG, args)
        trainer = functools.partial(_train, settings, args.plan)
        with swapped(lora, "train", trainer), preparing(PROG, functools.partial(_rows, settings)):
            mlx_lm_run(args)

    run_mlx_lm_lora(PROG, DESCRIPTION, argv, _add_arguments, run)


def step_arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The flags that set how the checkpointed step runs (stages ahead, chunks), added to mlx_lm.lora's
    parser; the actions added. Both commands take them: ``nuvec-mlx-plan`` plans that step."""
    return [
        parser.add_argument(
            "--stages-ahead",
            type=nonnegative_int,
            default=None,
            help="nuvec, with --grad-checkpoint: checkpointed stages queued ahead of the one waited for; 0 gives "
            "the lowest peak, more a faster step on a GPU at a higher peak (default: 1 on a GPU, 0 on the CPU)",
        ),
        parser.add_argument(
            "--attention-chunk",
            type=_chunk_setting,
            default=None,
            help="nuvec, with --grad-checkpoint: attention in query chunks of this many tokens inside the "
            "checkpointed blocks; auto (the default) where the backend trains attention unfused (CPU, Metal), "
            "0 for none",
        ),
        parser.add_argument(
            "--loss-chunk",
            type=_chunk_setting,
            default=None,
            help="nuvec, with --grad-checkpoint: the loss head in chunks of this many tokens; auto (the default) "
            "from the vocabulary and hidden size, 0 for none",
        ),
        parser.add_argument(
            "--mlp-chunk",
            type=_chunk_setting,
            default=None,
            help="nuvec, with --grad-checkpoint: each block's MLP in chunks of this many tokens inside the "
            "checkpointed block (lower peak on long sequences, same computation); auto (the default) where the "
            "sequence is long enough for it to pay, 0 for none",
        ),
        parser.add_argument(
            "--projection-chunk",
            type=_chunk_setting,
            default=None,
            help="nuvec, with --grad-checkpoint: attention's projections (q_proj, k_proj, v_proj, o_proj) in "
            "chunks of this many tokens inside the checkpointed block (LoRA's float32 products a chunk at a time); "
            "auto (the default) where the sequence is long enough for it to pay, 0 for none",
        ),
        parser.add_argument(
            "--norm-chunk",
            type=_chunk_setting,
            default=None,
            help="nuvec, with --grad-checkpoint: each block's norms (input_layernorm, post_attention_layernorm ...) "
            "in chunks of this many tokens inside the checkpointed block; auto (the default) where MLX computes "
            "them unfused, in float32 (the CPU), and the sequence is long enough for it to pay, 0 for none",
        ),
        parser.add_argument(
            "--scan-chunk",
            type=_chunk_setting,
            default=None,
            help="nuvec, with --grad-checkpoint: recurrences over the sequence (gated delta, state-space scans) in "
            "checkpointed chunks of this many tokens; auto (the default), 0 for none",
        ),
    ]


def _add_arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """nuvec-mlx-lora's flags, added to mlx_lm.lora's parser; the actions added (:func:`run_mlx_lm_lora`
    checks their values from a config file as theirs from the command line)."""
    return [
        *step_arguments(parser),
        parser.add_argument(
            "--plan",
            default=None,
            help="nuvec, with --grad-checkpoint: checkpoint the blocks as this plan says (nuvec-mlx-plan --save "
            "plan.json) instead of every block",
        ),
    ]


def _rows(settings: dict[str, Any], args: Any) -> list[tuple[str, str]]:
    """The banner's nuvec rows: what is checkpointed, and how."""
    if not args.grad_checkpoint:
        return [("nuvec", "no block checkpointed (--grad-checkpoint checkpoints every block)")]
    blocks = f"as {args.plan} says" if args.plan is not None else "every block"
    ahead = "device default" if settings["ahead"] is None else settings["ahead"]
    chunks = settings["chunks"]
    said = " · ".join(f"{name} {getattr(chunks, name) or 'none'}" for name in CHUNK_FLAGS.values())
    return [("nuvec", f"checkpointed: {blocks}"), ("stages", f"ahead {ahead}"), ("chunks", said)]


def _train(settings: dict[str, Any], path: str | None, **kwargs: Any) -> None:
    """:func:`train` with nuvec's ``settings`` (mlx-lm passes the rest by keyword), once the plan among them
    (from ``path``) is found to be made for this model and data (:func:`_check_plan`)."""
    if settings["plan"] is not None:
        _check_plan(settings["plan"], path, kwargs["model"], kwargs["args"], kwargs["train_dataset"])
    train(**kwargs, **settings)


def _load_plan(path: str, batch_size: int) -> Any:
    """The plan in ``path``, made for batches of ``batch_size`` rows, or a command-line error that says
    what is wrong with it."""
    from ..planner import Plan

    try:
        plan = Plan.load_json(path)
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        fail(PROG, f"--plan {path}: not a plan that nuvec-mlx-plan --save wrote ({type(e).__name__}: {e})")
    except ValueError as e:  # what load_json says of a plan it cannot bring back, the file named
        fail(PROG, f"--plan {e}")
    rows = plan.made_for.rows
    if rows is not None and rows != batch_size:
        fail(
            PROG,
            f"--plan {path}: the plan was made for batches of {rows} rows, this run has --batch-size {batch_size}: "
            f"pass --batch-size {rows}, or plan again with --batch-size {batch_size}",
        )
    return plan


def _check_plan(plan: Any, path: str | None, model: Any, args: Any, dataset: Any) -> None:
    """A command-line error where ``plan`` was made for another model (its class, its blocks), another
    dtype, or shorter rows than the longest of the training set ``dataset`` makes as mlx-lm pads it."""
    from ..planner import MadeFor

    made, here = plan.made_for, MadeFor.of(model, ())
    if made.model != here.model:
        fail(PROG, f"--plan {path}: the plan was made for a {made.model}, this model is a {here.model}: plan again")
    if made.dtype != here.dtype:
        fail(
            PROG,
            f"--plan {path}: the plan was made for {made.dtype} weights, this model has {here.dtype} weights: "
            "plan again",
        )
    try:
        plan.blocks_of(model)
    except ValueError as e:
        fail(PROG, f"--plan {path}: {e}")
    longest = max(row_lengths(dataset), default=0)
    width = _padded_width(min(longest, args.max_seq_length), args.max_seq_length)
    if made.tokens is not None and width > made.tokens:
        cut = f", cut to --max-seq-length {args.max_seq_length}" if longest > args.max_seq_length else ""
        fail(
            PROG,
            f"--plan {path}: the plan was made for batches of {made.rows} x {made.tokens} tokens; the longest row of "
            f"this run's training set has {longest} tokens{cut}, which mlx-lm pads to {width}: plan again on this "
            f"data, or pass --max-seq-length {made.tokens}",
        )


def row_lengths(dataset: Any) -> list[int]:
    """The tokens of each row of an mlx-lm dataset, its rows processed as training processes them (a
    ``CacheDataset`` keeps them for the run; its ``itemlen`` counts the keys of the unprocessed row, not
    its tokens, in mlx-lm 0.32)."""
    return [len(dataset[i][0]) for i in range(len(dataset))]


def _padded_width(tokens: int, max_seq_length: int) -> int:
    """The tokens of a batch whose longest row has ``tokens`` (at most ``max_seq_length``), padded as
    mlx-lm's ``iterate_batches`` pads it (to a multiple of 32, plus one)."""
    from mlx_lm.tuner.trainer import iterate_batches

    ids, _ = next(iterate_batches([([0] * tokens, 0)], 1, max_seq_length))
    return int(ids.shape[1])


def nonnegative_int(text: str) -> int:
    """An int >= 0 flag's value (``--stages-ahead``, ``--verify``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {value}")
    return value


def _chunk_setting(text: str) -> int | str:
    """A chunk flag's value: ``auto`` or an int >= 0 (0: none)."""
    if text == "auto":
        return text
    try:
        return nonnegative_int(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(str(e).replace("expected an int", "expected auto or an int")) from None


def chunks_of(args: Any) -> Chunks:
    """The :class:`nuvec_mlx.Chunks` the chunk flags (or config keys) give: unset is ``auto``, 0 none."""
    return Chunks.from_settings(**{setting: getattr(args, flag, None) for flag, setting in CHUNK_FLAGS.items()})
