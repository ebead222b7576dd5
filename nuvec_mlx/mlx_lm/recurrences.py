"""mlx-lm's recurrences over the sequence, computed by nuvec's chunked scan inside the blocks that call them.

mlx-lm's recurrent and hybrid models call their recurrence by a module-level
name: ``gated_delta_update`` (``qwen3_5``, ``qwen3_next``, ``kimi_linear``,
``olmo_hybrid`` ...) and ``ssm_update`` (``mamba2``, ``granitemoehybrid``,
``falcon_h1``, ``nemotron_h``, ``plamo2``). :func:`routes` gives, for a scan
setting, the functions those names should reach inside the blocks
(:func:`nuvec_mlx.mlx_lm.gated_delta.gated_delta_update`,
:func:`nuvec_mlx.mlx_lm.ssm.ssm_update`: the same contracts, computed with
:func:`nuvec_mlx.scan`); :func:`nuvec_mlx.chunk_layers` makes each module that
calls one see it (only those modules, nothing else in the process).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..chunking import AUTO, Setting
from .gated_delta import make_gated_delta_update
from .ssm import make_ssm_update

__all__ = ["routes"]


@functools.cache
def routes(scan: Setting = AUTO) -> dict[str, Callable[..., Any]]:
    """The recurrences' names in mlx-lm's models, each with the function that computes it in chunks of
    ``scan`` tokens (``"auto"``: each function's default; ``None``: none, mlx-lm's own loops run).

    The same functions for the same setting (a module's rerouted class is cached by them).

    Example:
        >>> nv.chunk_layers(model, routes=routes(128))
    """
    if scan is None:
        return {}
    chunk = None if scan == AUTO else int(scan)
    ssm = make_ssm_update() if chunk is None else make_ssm_update(chunk=chunk)
    return {"gated_delta_update": make_gated_delta_update(chunk=chunk), "ssm_update": ssm}
