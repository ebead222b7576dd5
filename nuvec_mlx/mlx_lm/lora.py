"""The ``nuvec-mlx-lora`` command: ``mlx_lm.lora`` with nuvec's trainer (:func:`main`).

Also the frame both commands run in (:func:`run_mlx_lm_lora`): ``mlx_lm.lora``'s
own ``main`` (its parser, config files and defaults), under another name, with
arguments added and another ``run``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

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
NEED_GRAD_CHECKPOINT = ("stages_ahead", "attention_chunk", "loss_chunk", "mlp_chunk", "plan")

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
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Run,
    unset: tuple[str, ...] = (),
) -> None:
    """``mlx_lm.lora``'s ``main`` as ``prog``: its parser with ``add_arguments``, config file and
    defaults, then ``run(args)`` in place of ``mlx_lm.lora.run``; ``--num-layers`` and the config keys
    ``unset`` get no mlx-lm default (``None`` when not given)."""
    if argv is not None and (isinstance(argv, str) or not all(isinstance(a, str) for a in argv)):
        raise TypeError(f"argv must be a list of str, got {type(argv).__name__}")
    # Imported here: importing mlx_lm.lora changes yaml's SafeLoader for every user of yaml.
    from mlx_lm import lora

    mlx_lm_parser = lora.build_parser

    def build_parser() -> argparse.ArgumentParser:
        parser = mlx_lm_parser()
        parser.prog, parser.description = prog, description
        add_arguments(parser)
        return parser

    defaults = {k: v for k, v in lora.CONFIG_DEFAULTS.items() if k not in ("num_layers", *unset)}
    command = [prog, *(sys.argv[1:] if argv is None else argv)]
    with (
        swapped(sys, "argv", command),
        swapped(lora, "build_parser", build_parser),
        swapped(lora, "CONFIG_DEFAULTS", defaults),
        swapped(lora, "run", run),
    ):
        lora.main()


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
def preparing(prog: str, rows: Callable[[Any], list[tuple[str, str]]]) -> Iterator[None]:
    """Inside, ``mlx_lm.lora.train_model`` sets ``--num-layers`` as :func:`fine_tuned_layers` does, and
    its banner is titled ``prog``, ending with ``rows(args)``."""
    from mlx_lm import cli_ui, lora

    mlx_lm_train_model, mlx_lm_panel = lora.train_model, cli_ui.print_header_panel

    def train_model(args: Any, model: Any, *rest: Any, **kwargs: Any) -> Any:
        fine_tuned_layers(prog, args, len(model.layers))

        def panel(console: Any, title: str, mlx_lm_rows: list[tuple[str, str]]) -> None:
            mlx_lm_panel(console, prog, [*mlx_lm_rows, *rows(args)])

        with swapped(cli_ui, "print_header_panel", panel):
            return mlx_lm_train_model(args, model, *rest, **kwargs)

    with swapped(lora, "train_model", train_model):
        yield


def main(argv: list[str] | None = None) -> None:
    """The ``nuvec-mlx-lora`` command: ``mlx_lm.lora`` training with :func:`train`.

    It takes ``mlx_lm.lora``'s arguments and config files unchanged
    (``--grad-checkpoint`` checkpoints every block with nuvec), and five more,
    each also a key of a config file, each needing ``--grad-checkpoint``:
    ``--stages-ahead N`` (``stages_ahead``), :func:`~nuvec_mlx.mlx_lm.train`'s
    ``ahead``; ``--attention-chunk`` (``attention_chunk``) and ``--loss-chunk``
    (``loss_chunk``), its ``attention_chunk`` and ``loss_chunk``: ``auto``
    (the default), a size, or 0 for none; ``--mlp-chunk N`` (``mlp_chunk``),
    its ``mlp_chunk`` (0 or unset: none); ``--plan plan.json`` (``plan``),
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
        for name in ("attention_chunk", "mlp_chunk"):
            if args.plan is not None and getattr(args, name) is not None:
                fail(
                    PROG,
                    f"--{name.replace('_', '-')}: with --plan the blocks are checkpointed as the plan was measured "
                    "(attention_chunk auto, no MLP chunks); leave it out",
                )
        settings = {
            "ahead": args.stages_ahead,
            "attention_chunk": _auto(args.attention_chunk),
            "loss_chunk": _auto(args.loss_chunk),
            "mlp_chunk": args.mlp_chunk,
            "plan": None if args.plan is None else _load_plan(args.plan),
        }
        trainer = functools.partial(_train, settings)
        with swapped(lora, "train", trainer), preparing(PROG, functools.partial(_rows, settings)):
            mlx_lm_run(args)

    run_mlx_lm_lora(PROG, DESCRIPTION, argv, _add_arguments, run)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stages-ahead",
        type=_nonnegative_int,
        default=None,
        help="nuvec, with --grad-checkpoint: checkpointed stages queued ahead of the one waited for; 0 gives "
        "the lowest peak, more a faster step on a GPU at a higher peak (default: 1 on a GPU, 0 on the CPU)",
    )
    parser.add_argument(
        "--attention-chunk",
        type=_chunk_setting,
        default=None,
        help="nuvec, with --grad-checkpoint: attention in query chunks of this many tokens inside the "
        "checkpointed blocks; auto (the default) where the backend trains attention unfused (CPU, Metal), 0 for none",
    )
    parser.add_argument(
        "--loss-chunk",
        type=_chunk_setting,
        default=None,
        help="nuvec, with --grad-checkpoint: the loss head in chunks of this many tokens; auto (the default) "
        "from the vocabulary and hidden size, 0 for none",
    )
    parser.add_argument(
        "--mlp-chunk",
        type=_nonnegative_int,
        default=None,
        help="nuvec, with --grad-checkpoint: each block's MLP in chunks of this many tokens inside the "
        "checkpointed block (lower peak for LoRA on long sequences, same computation); 0 or unset for none",
    )
    parser.add_argument(
        "--plan",
        default=None,
        help="nuvec, with --grad-checkpoint: checkpoint the blocks as this plan says (nuvec-mlx-plan --save "
        "plan.json) instead of every block",
    )


def _rows(settings: dict[str, Any], args: Any) -> list[tuple[str, str]]:
    """The banner's nuvec rows: what is checkpointed, and how."""
    if not args.grad_checkpoint:
        return [("nuvec", "no block checkpointed (--grad-checkpoint checkpoints every block)")]
    blocks = f"as {args.plan} says" if args.plan is not None else "every block"
    ahead = "device default" if settings["ahead"] is None else settings["ahead"]
    return [
        ("nuvec", f"checkpointed: {blocks}"),
        (
            "stages",
            f"ahead {ahead} · attention {settings['attention_chunk']} · loss chunk {settings['loss_chunk']}"
            f" · MLP chunk {settings['mlp_chunk'] or 'none'}",
        ),
    ]


def _train(settings: dict[str, Any], **kwargs: Any) -> None:
    """:func:`train` with nuvec's ``settings`` (mlx-lm passes the rest by keyword), once the plan among them
    is found to fit the model."""
    plan = settings["plan"]
    if plan is not None:
        names = {name for name, _ in kwargs["model"].named_modules()}
        missing = [b.name for b in plan.blocks if b.name not in names]
        if missing:
            fail(PROG, f"--plan: the model has no blocks named {missing[:3]}: the plan was made for another model")
    train(**kwargs, **settings)


def _load_plan(path: str) -> Any:
    """The plan in ``path``, or a command-line error that says what is wrong with it."""
    from ..planner import Plan

    try:
        return Plan.load_json(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(PROG, f"--plan {path}: not a plan that nuvec-mlx-plan --save wrote ({type(e).__name__}: {e})")


def _nonnegative_int(text: str) -> int:
    """``--stages-ahead``'s and ``--mlp-chunk``'s value: an int >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {value}")
    return value


def _chunk_setting(text: str) -> int | str:
    """``--attention-chunk`` and ``--loss-chunk``: ``auto`` or an int >= 0 (0: none)."""
    if text == "auto":
        return text
    return _nonnegative_int(text)


def _auto(setting: object) -> object:
    """A chunk setting from the command line or a config file; unset is ``"auto"``."""
    return "auto" if setting is None else setting
