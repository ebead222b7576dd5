"""The ``nuvec-mlx-lora`` command: ``mlx_lm.lora`` with nuvec's trainer (:func:`main`)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

from .trainer import train

#: The command's name.
PROG = "nuvec-mlx-lora"


@contextlib.contextmanager
def _swapped(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside, and what it was after."""
    held = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, held)


def main(argv: list[str] | None = None) -> None:
    """The ``nuvec-mlx-lora`` command: ``mlx_lm.lora`` training with :func:`train`.

    It takes ``mlx_lm.lora``'s arguments and config files unchanged
    (``--grad-checkpoint`` checkpoints every block with nuvec), and three more,
    each also a key of a config file: ``--stages-ahead N`` (``stages_ahead``),
    :func:`~nuvec_mlx.mlx_lm.train`'s ``ahead``; ``--attention-chunk``
    (``attention_chunk``) and ``--loss-chunk`` (``loss_chunk``), its
    ``attention_chunk`` and ``loss_chunk``: ``auto`` (the default), a size, or
    0 for none.

    Args:
        argv: the arguments, as on the command line (default ``sys.argv[1:]``).

    Example:
        >>> main(["--model", "./model", "--train", "--data", "./data", "--grad-checkpoint"])
    """
    if argv is not None and (isinstance(argv, str) or not all(isinstance(a, str) for a in argv)):
        raise TypeError(f"argv must be a list of str, got {type(argv).__name__}")
    # Imported here: importing mlx_lm.lora changes yaml's SafeLoader for every user of yaml.
    from mlx_lm import lora

    mlx_lm_parser, mlx_lm_run = lora.build_parser, lora.run

    def build_parser() -> argparse.ArgumentParser:
        parser = mlx_lm_parser()
        parser.add_argument(
            "--stages-ahead",
            type=_stages_ahead,
            default=None,
            help="nuvec: checkpointed stages queued ahead of the one waited for; 0 gives the "
            "lowest peak (default: 1 on a GPU, 0 on the CPU)",
        )
        parser.add_argument(
            "--attention-chunk",
            type=_chunk_setting,
            default=None,
            help="nuvec, with --grad-checkpoint: attention in query chunks of this many tokens "
            "inside the checkpointed blocks; auto (the default) where the backend trains "
            "attention unfused (CPU, Metal), 0 for none",
        )
        parser.add_argument(
            "--loss-chunk",
            type=_chunk_setting,
            default=None,
            help="nuvec, with --grad-checkpoint: the loss head in chunks of this many tokens; "
            "auto (the default) from the vocabulary and hidden size, 0 for none",
        )
        return parser

    def run(args: Any) -> None:
        settings = {
            "ahead": args.stages_ahead,
            "attention_chunk": _auto(args.attention_chunk),
            "loss_chunk": _auto(args.loss_chunk),
        }
        with _swapped(lora, "train", functools.partial(train, **settings)):
            mlx_lm_run(args)

    command = [PROG, *(sys.argv[1:] if argv is None else argv)]
    with _swapped(sys, "argv", command), _swapped(lora, "build_parser", build_parser), _swapped(lora, "run", run):
        lora.main()


def _stages_ahead(text: str) -> int:
    """``--stages-ahead``'s value: an int >= 0."""
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
    return _stages_ahead(text)


def _auto(setting: object) -> object:
    """A chunk setting from the command line or a config file; unset is ``"auto"``."""
    return "auto" if setting is None else setting
