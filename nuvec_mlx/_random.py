"""The calling thread's random key: read it, draw from another one, put it back.

MLX keeps one key per thread, behind ``mx.random.state``: a read-only view
whose only item is the current key. Replaying a block's draws in the backward
pass needs that key swapped for a saved one and swapped back, and a failed
``mx.compile`` trace leaves a placeholder there that must be replaced. MLX
0.32 offers no setter; the view's iterator is the one public handle that
reaches the list itself. That is the most version-fragile line of the package,
so it lives here alone and fails loudly if MLX changes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from . import _validate


def _key_list() -> list:
    """The calling thread's random-state list, whose only item is the current key."""
    view: Any = mx.random.state  # typed object in MLX's stub; the except below covers a view that is not iterable
    try:
        state = iter(view).__reduce__()[1][0]
    except (AttributeError, IndexError, TypeError):
        state = None
    if not isinstance(state, list) or len(state) != 1 or not isinstance(state[0], mx.array):
        raise RuntimeError(
            f"nuvec_mlx cannot reach mx.random.state's key in MLX {_validate.MLX_VERSION}; "
            "random draws cannot be replayed in checkpoints with this version"
        )
    return state


def key() -> mx.array:
    """The calling thread's current random key."""
    return _key_list()[0]


def set_key(new_key: mx.array) -> None:
    """Make ``new_key`` the calling thread's random key."""
    _key_list()[0] = new_key


@contextlib.contextmanager
def drawing_from(new_key: mx.array) -> Iterator[None]:
    """Draw random numbers from ``new_key`` inside; the thread's key is as before after."""
    state = _key_list()
    saved = state[0]
    state[0] = new_key
    try:
        yield
    finally:
        state[0] = saved


@contextlib.contextmanager
def restored_on_error() -> Iterator[None]:
    """Put the thread's key back if the block raises (a failed trace leaves a placeholder)."""
    state = _key_list()
    saved = state[0]
    try:
        yield
    except BaseException:
        state[0] = saved
        raise
