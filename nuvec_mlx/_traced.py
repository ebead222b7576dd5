"""What Python can tell about the trace MLX is running: whether it is shapeless.

``mx.compile(..., shapeless=True)`` replays its graph for new input shapes by
asking every node for its output shapes. MLX 0.32's custom functions (which a
checkpoint is made of) cannot answer, so such a compile fails at the first
call with new shapes, far from the cause. A checkpoint asks
:func:`in_shapeless_trace` when it is traced, to fail at once with a clear
message instead.
"""

from __future__ import annotations

import io

import mlx.core as mx


def in_shapeless_trace() -> bool:
    """Whether the code runs inside the trace of ``mx.compile(..., shapeless=True)``.

    There MLX counts an array's elements with a graph node (the count may
    change with the shapes), elsewhere with a constant: a mean's graph shows
    which. Nothing is evaluated.
    """
    graph = io.StringIO()
    mx.export_to_dot(graph, mx.zeros((1,)).mean())
    return "NumberOfElements" in graph.getvalue()
