"""Checkpointed scans: a recurrence over a sequence computed in chunks, each chunk recomputed in the backward pass.

Recurrent layers (gated delta rules, state-space models) carry a state along
the sequence: ``state, y_t = step(state, x_t)``. Written as a Python loop over
tokens and differentiated by MLX, every token's slice of the inputs has a
vjp that builds a gradient buffer of the whole input, and every token's
intermediates stay alive until the backward pass: the training peak grows
faster than the sequence. :func:`scan` runs the recurrence chunk by chunk
(``fn`` gets a chunk of tokens and the state at its start) and keeps, in the
forward pass, only each chunk's starting state. The backward pass recomputes
the chunks one at a time, last first, each reading its inputs through the
cotangents of the chunk after it (so that the evaluator cannot start it
early), and hands the cotangent of each chunk's starting state on to the
chunk before. The gradients of the inputs split along the sequence are made
per chunk and concatenated once; those of inputs every chunk reads whole are
summed in float32 as the chunks go. Each chunk, forward and backward, is a
stage of :func:`nuvec_mlx.eval` (:mod:`nuvec_mlx._marks`), as in
:func:`nuvec_mlx.checkpoint_chunks`.

The scan is an :func:`mlx.core.custom_function` with ``vjp``, ``jvp`` and
``vmap`` rules, so :func:`mlx.core.grad`, :func:`mlx.core.vjp`,
:func:`mlx.core.jvp`, :func:`mlx.core.vmap` and :func:`mlx.core.compile` go
through it, also nested in checkpointed blocks. The gradients it returns are
first derivatives only: its backward pass treats each chunk's starting state
as given, so a derivative of them (a Hessian-vector product through the scan)
raises instead of silently missing the dependence of those states on
earlier chunks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx

from . import _calls, _constants, _depends, _marks, _pytree, _random, _validate

__all__ = ["scan"]

FlatFn = Callable[[list[mx.array]], list[mx.array]]


def _take(x: mx.array, axis: int, bounds: slice) -> mx.array:
    index = [slice(None)] * x.ndim
    index[axis] = bounds
    return x[tuple(index)]


class _Scan:
    """One call of a flat scan: its inputs, its chunks, and the rules ``mx.custom_function`` runs.

    Args:
        fn: ``fn(state + chunk inputs) -> new state + chunk outputs``, flat.
        xs: every input: the ``n`` state arrays first, then the others.
        n: the number of state arrays.
        axes: per input, the axis it is split along (non-negative), or ``None`` (state, read whole).
        axis: the scan's axis as given, for the outputs (normalised per output).
        size: the chunk length.
        forward: ``None``, or a flat function of the same inputs giving the whole scan's outputs
            (see :func:`scan`).
    """

    def __init__(
        self,
        fn: FlatFn,
        xs: list[mx.array],
        n: int,
        axes: list[int | None],
        axis: int,
        size: int,
        forward: FlatFn | None,
    ):
        self.fn, self.xs, self.n, self.axes, self.axis, self.size = fn, xs, n, axes, axis, size
        self.whole_forward = forward
        lengths = {x.shape[a] for x, a in zip(xs, axes, strict=True) if a is not None}
        if len(lengths) != 1:
            shapes = [(tuple(x.shape), a) for x, a in zip(xs, axes, strict=True) if a is not None]
            raise ValueError(f"scan: the arrays of xs must have one length along the axis, got (shape, axis) {shapes}")
        length = lengths.pop()
        if length == 0:
            raise ValueError("scan: xs is empty along the axis (no tokens to scan)")
        self.chunks = [slice(s, min(s + size, length)) for s in range(0, length, size)]
        self.diff = [i for i, x in enumerate(xs) if _validate.is_differentiable(x)]
        self.state_diff = [i for i in self.diff if i < n]  # carried cotangents: every floating state array
        # The other inputs whose gradients are returned (frozen parameters are constants: none).
        self.wanted = [i for i in self.diff if i >= n and not _constants.is_constant(xs[i])]
        self.signature = [(tuple(x.shape), x.dtype) for x in xs[:n]]
        self.keys: list[mx.array] = []  # the random key at each chunk's start in the forward, replayed
        self.starts: list[list[mx.array]] = []  # each chunk's starting state, kept by the forward
        self.y_axes: list[int] = []
        self.graph: list[mx.array] = []

    # -- running chunks -------------------------------------------------------------------------------

    def part(self, state: Sequence[mx.array], xs: Sequence[mx.array], c: int) -> list[mx.array]:
        """Chunk ``c``'s inputs: ``state``, then a slice of each input split along the axis, the others whole."""
        rest = [x if a is None else _take(x, a, self.chunks[c]) for x, a in zip(xs[self.n :], self.axes[self.n :])]
        return [*state, *rest]

    def run_part(self, part: Sequence[mx.array]) -> list[mx.array]:
        out = _validate.check_outputs(self.fn(list(part)), self.fn)
        got = [(tuple(s.shape), s.dtype) for s in out[: self.n]]
        if got != self.signature:
            raise ValueError(
                f"scan: fn ({_validate.name_of(self.fn)}) returned a state of (shape, dtype) {got}, but the state "
                f"it was given (init) has {self.signature}; fn must return a state like the one it gets"
            )
        return out

    def _y_axes(self, ys: Sequence[mx.array]) -> list[int]:
        axes = []
        for y in ys:
            if not -y.ndim <= self.axis < y.ndim:
                raise ValueError(
                    f"scan: fn ({_validate.name_of(self.fn)}) returned an output of shape {tuple(y.shape)}, which has "
                    f"no axis {self.axis} to concatenate the chunks along"
                )
            axes.append(self.axis % y.ndim)
        return axes

    def _combine(self, state: Sequence[mx.array], parts: list[list[mx.array]]) -> list[mx.array]:
        ys = [p[0] if len(p) == 1 else mx.concatenate(list(p), axis=a) for a, p in zip(self.y_axes, zip(*parts))]
        return [*state, *ys]

    # -- the custom function's rules -------------------------------------------------------------------

    def checkpointed(self) -> list[mx.array]:
        """The scan over ``xs``, chunk by chunk, checkpointed and staged."""
        if not self.diff:
            return self.forward(self.xs)
        scanned = mx.custom_function(self.forward)
        scanned.vjp(self.backward)
        scanned.jvp(self.jvp)
        scanned.vmap(self.vmap)
        # mx.custom_function's __call__ is typed object; it returns what self.forward returns, a list of arrays.
        out = list(cast(list[mx.array], scanned(self.xs)))
        # Arrays fn reads besides its inputs and modules are differentiated through the forward's graph.
        return _depends.also_into(out, self.graph)

    def forward(self, xs: list[mx.array]) -> list[mx.array]:
        stopped = [mx.stop_gradient(x) for x in xs]
        if self.whole_forward is not None:
            # fn's first chunk is traced for its outputs' structure (what pytree callers rebuild), never evaluated.
            self.y_axes = self._y_axes(self.run_part(self.part(stopped[: self.n], stopped, 0))[self.n :])
            out = _validate.check_outputs(self.whole_forward(stopped), self.whole_forward)
            self.graph = _marks.mark(out, _marks.CHUNK)
            return self.graph
        state: list[mx.array] = stopped[: self.n]
        parts: list[list[mx.array]] = []
        for c in range(len(self.chunks)):
            self.keys.append(_random.key())
            self.starts.append(state)
            out = _marks.mark(self.run_part(self.part(state, stopped, c)), _marks.CHUNK)
            if not c:
                self.y_axes = self._y_axes(out[self.n :])
            state = out[: self.n]
            parts.append(out[self.n :])
        self.graph = self._combine(state, parts)
        return self.graph

    def _replayed_starts(self, primals: list[mx.array], after: list[mx.array]) -> list[list[mx.array]]:
        """Each chunk's starting state, from ``forward`` run chunk by chunk (each a stage), once the backward
        pass reaches the scan: the forward pass computed the whole scan at once and kept none."""
        assert self.whole_forward is not None  # called only where the forward pass kept no starting states
        xs = _depends.depends([mx.stop_gradient(p) for p in primals], after)
        state = xs[: self.n]
        starts = [state]
        for c in range(len(self.chunks) - 1):
            part = self.part(state, xs, c)
            out = _validate.check_outputs(self.whole_forward(part), self.whole_forward)
            state = _marks.mark(out[: self.n], _marks.CHUNK)
            starts.append(state)
        return starts

    def backward(self, primals: list[mx.array], cotangents: Sequence[mx.array], outputs: Any) -> list[mx.array]:
        n = self.n
        zeros = [mx.zeros_like(p) for p in primals]
        if not self.diff:
            return zeros
        # The cotangents a stage of their own: what computes them (the backward pass of what reads the scan's
        # outputs, over the whole sequence) is then not alive in the stage of the first chunk's recomputation.
        cotangents = _marks.finished(list(cotangents), _marks.CHUNK)
        after = list(cotangents)  # what the next chunk's recomputation waits for
        starts = self.starts or self._replayed_starts(primals, after)
        carried = [cotangents[i] for i in self.state_diff]  # the cotangent of the running chunk's final state
        pieces: dict[int, list[mx.array]] = {i: [] for i in self.wanted if self.axes[i] is not None}
        sums: dict[int, mx.array] = {}
        positions = [*self.state_diff, *self.wanted]  # what each chunk's recomputation differentiates
        for c in reversed(range(len(self.chunks))):
            xs = _depends.depends(primals, after)
            state = xs[:n] if c == 0 else _depends.depends(starts[c], after)
            part = self.part(state, xs, c)
            key = _depends.depends([self.keys[c]], after)[0] if self.keys else None

            def recompute(*values: mx.array, part: list[mx.array] = part, key: mx.array | None = key) -> list:
                full = _pytree.substitute(part, positions, values)
                if key is None:
                    return self.run_part(full)
                with _random.drawing_from(key):
                    return self.run_part(full)

            cots = [*self._state_cotangents(carried), *self._y_cotangents(cotangents, c)]
            grads = mx.vjp(recompute, [part[i] for i in positions], cots)[1]
            carried, rest = list(grads[: len(self.state_diff)]), grads[len(self.state_diff) :]
            for i, g in zip(self.wanted, rest, strict=True):
                if i in pieces:
                    pieces[i].append(g)
                else:  # read whole: summed in float32 as the chunks go
                    g32 = g.astype(mx.float32)
                    sums[i] = g32 if i not in sums else sums[i] + g32
            latest = [*carried, *(pieces[i][-1] if i in pieces else sums[i] for i in self.wanted)]
            done = _marks.finished(latest, _marks.CHUNK)  # the chunk's backward: a stage
            carried = done[: len(carried)]
            for i, g in zip(self.wanted, done[len(carried) :], strict=True):
                if i in pieces:
                    pieces[i][-1] = g
                else:
                    sums[i] = g
            after = done
        grads_out = [*carried]
        for i in self.wanted:
            a = self.axes[i]
            if a is None:
                grads_out.append(sums[i].astype(primals[i].dtype))
            else:
                parts = pieces[i][::-1]
                grads_out.append(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=a))
        guarded = cast(list[mx.array], _first_order(grads_out, [primals[i] for i in (*self.state_diff, *self.wanted)]))
        return _pytree.substitute(zeros, [*self.state_diff, *self.wanted], guarded)

    def _state_cotangents(self, carried: list[mx.array]) -> list[mx.array]:
        """The cotangents of a chunk's state outputs: those carried for the floating ones, zeros for the others."""
        it = iter(carried)
        return [next(it) if i in self.state_diff else mx.zeros(s, d) for i, (s, d) in enumerate(self.signature)]

    def _y_cotangents(self, cotangents: Sequence[mx.array], c: int) -> list[mx.array]:
        return [_take(cot, a, self.chunks[c]) for cot, a in zip(cotangents[self.n :], self.y_axes, strict=True)]

    def jvp(self, primals: list[mx.array], tangents: list[mx.array | None]) -> list[mx.array]:
        """Forward mode needs no checkpoint: the tangents chunk by chunk, the state's carried, the forward's draws."""
        filled = [mx.zeros_like(p) if t is None else t for p, t in zip(primals, tangents, strict=True)]
        state, dstate = primals[: self.n], filled[: self.n]
        parts = []
        for c in range(len(self.chunks)):
            with _random.drawing_from(self.keys[c]) if self.keys else contextlib.nullcontext():
                out, dout = mx.jvp(
                    lambda *part: self.run_part(part), self.part(state, primals, c), self.part(dstate, filled, c)
                )
            state, dstate = out[: self.n], dout[: self.n]
            parts.append(dout[self.n :])
        return self._combine(dstate, parts)

    def vmap(self, xs: list[mx.array], axes: list[int | None]) -> tuple[list[mx.array], list[int]]:
        """The batched scan, chunked in turn: the batch axis first, the state batched throughout."""
        size = next(x.shape[a] for x, a in zip(xs, axes, strict=True) if a is not None)
        moved = []
        for i, (x, a) in enumerate(zip(xs, axes, strict=True)):
            if a is not None:
                moved.append(mx.moveaxis(x, a, 0))
            elif i < self.n:  # the state is carried batched from the first chunk on
                moved.append(mx.broadcast_to(x[None], (size, *x.shape)))
            else:
                moved.append(x)
        batched = [i < self.n or a is not None for i, a in enumerate(axes)]
        split = [None if s is None else s + 1 if b else s for s, b in zip(self.axes, batched, strict=True)]
        in_axes = tuple(0 if b else None for b in batched)

        def batch(flat: FlatFn) -> FlatFn:
            return lambda part: mx.vmap(lambda *ys: flat(list(ys)), in_axes=in_axes)(*part)

        whole = None if self.whole_forward is None else batch(self.whole_forward)
        axis = self.axis + 1 if self.axis >= 0 else self.axis
        with _random.drawing_from(self.keys[0]) if self.keys else contextlib.nullcontext():
            out = _Scan(batch(self.fn), moved, self.n, split, axis, self.size, whole).checkpointed()
        return out, [0] * len(out)


_SECOND_ORDER = (
    "a derivative of a gradient taken through nv.scan: the scan's backward pass treats each chunk's starting "
    "state as given, so it supports first derivatives only (forward mode, mx.jvp of the scan itself, works)"
)
#: The scan's gradients, refusing a second derivative.
_first_order = _depends.first_order(_SECOND_ORDER)


def _axes_of(xs: Any, axis: object) -> list[int | None]:
    """Per array of ``xs``, in tree order: the axis it is split along (normalised), or ``None`` (read whole)."""
    if isinstance(axis, (list, tuple)):
        if not isinstance(xs, (list, tuple)) or len(xs) != len(axis):
            raise ValueError(
                f"axis names {len(axis)} items, so xs must be a list or tuple of {len(axis)} items, "
                f"got {type(xs).__name__}" + (f" of {len(xs)}" if isinstance(xs, (list, tuple)) else "")
            )
        items = list(zip(xs, axis))
    else:
        items = [(xs, axis)]
    out: list[int | None] = []
    for item, a in items:
        if a is not None and (isinstance(a, bool) or not isinstance(a, int)):
            raise TypeError(f"axis must be an int, or a list or tuple of ints and None, got {a!r}")
        for path, x in _pytree.flatten(item):
            if not isinstance(x, mx.array):
                raise TypeError(f"xs must be a pytree of mlx.core.array, got {type(x).__name__} at {path or 'the top'}")
            if a is None:
                out.append(None)
            elif not -x.ndim <= a < x.ndim:
                raise ValueError(f"axis {a} is out of range for an array of xs of shape {tuple(x.shape)}")
            else:
                out.append(a % x.ndim)
    if all(a is None for a in out):
        raise ValueError("xs must hold at least one array split along the axis (axis not None), got none")
    return out


def scan(
    fn: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any,
    *,
    chunk: int,
    axis: int | Sequence[int | None] = 1,
    forward: Callable[[Any, Any], tuple[Any, Any]] | None = None,
) -> tuple[Any, Any]:
    """Scan ``fn`` over ``xs`` in chunks of ``chunk`` tokens, each chunk recomputed in the backward pass.

    Computes ``state, ys_c = fn(state, xs_c)`` for the chunks ``xs_c`` of
    ``xs`` along ``axis``, from ``state = init``, and concatenates the
    ``ys_c`` along ``axis``. The forward pass keeps only each chunk's starting
    state; the backward pass recomputes one chunk at a time, last first, each
    a stage of :func:`nuvec_mlx.eval`, so that the memory of the recurrence
    grows with the sequence as its states and inputs do, not with its
    per-token intermediates. Values and gradients are those of the chunks
    computed one after the other (for a recurrence that treats every token
    alike, those of ``fn`` on the whole sequence, up to the order of float
    sums); gradients of the arrays ``fn`` reads whole are summed in float32.
    ``mx.grad``, ``mx.vjp``, ``mx.jvp``, ``mx.vmap`` and ``mx.compile`` go through
    it; a second derivative through its gradients raises (see the module).

    Modules ``fn`` reaches are handled as :func:`nuvec_mlx.checkpoint` handles
    them: their trainable parameters are differentiated, read whole by every
    chunk; other arrays ``fn`` reads by closure are differentiated through the
    forward's graph, which then stays alive until the backward pass: pass
    them in ``xs`` with ``axis`` ``None`` to have them read whole instead.
    Random draws in ``fn`` are replayed by its recomputation.

    Args:
        fn: ``fn(state, xs_chunk) -> (state, ys_chunk)``: ``state`` a pytree
            of arrays like ``init`` (the same structure, shapes and dtypes),
            ``xs_chunk`` like ``xs`` with its split arrays cut to the chunk,
            ``ys_chunk`` a pytree of arrays (or ``None``) whose chunks are
            concatenated along ``axis``.
        init: the state before the first token, a pytree of arrays.
        xs: the inputs, a pytree of arrays; those split have one length
            along their axis.
        chunk: the tokens per chunk (the last chunk may be shorter).
        axis: the axis the arrays of ``xs`` are split along and the outputs
            concatenated along; or, for an ``xs`` that is a list or tuple,
            one entry per item, ``None`` for an item read whole by every chunk
            (the outputs are then concatenated along the first int given).
        forward: ``None``, or a function of ``(init, xs)`` with the values of
            the whole scan, ``(state, ys)``, that need not be differentiable
            (a fused kernel): it computes the forward pass, in one call, and
            the backward pass runs it chunk by chunk to rebuild the chunks'
            starting states before recomputing them with ``fn``. ``fn`` must
            then draw no random numbers.

    Returns:
        ``(state, ys)``: the state after the last token, and the chunks'
        outputs concatenated.

    Raises:
        TypeError: ``fn`` or ``forward`` not callable, ``init`` or ``xs`` not
            pytrees of arrays, ``chunk`` or ``axis`` of the wrong type.
        ValueError: ``chunk`` < 1, ``axis`` out of range, the split arrays of
            unequal lengths, ``fn`` returning another state than it got.

    Example:
        >>> def step(h, x):  # an exponential moving average, token by token inside a chunk
        ...     ys = []
        ...     for t in range(x.shape[1]):
        ...         h = 0.9 * h + x[:, t]
        ...         ys.append(h)
        ...     return h, mx.stack(ys, axis=1)
        >>> h, ys = nv.scan(step, mx.zeros((2, 8)), mx.ones((2, 1024, 8)), chunk=64)
    """
    _validate.check_callable(fn, "fn")
    _validate.check_int(chunk, "chunk", minimum=1)
    if forward is not None:
        _validate.check_callable(forward, "forward")
    init_leaves = _pytree.flatten(init)
    for path, x in init_leaves:
        if not isinstance(x, mx.array):
            raise TypeError(f"init must be a pytree of mlx.core.array, got {type(x).__name__} at {path or 'the top'}")
    if not init_leaves:
        raise ValueError("init must hold at least one array (the state carried from chunk to chunk)")
    x_axes = _axes_of(xs, axis)
    out_axis = next(a for a in ([*axis] if isinstance(axis, (list, tuple)) else [axis]) if isinstance(a, int))
    n = len(init_leaves)
    init_structure = [path for path, _ in init_leaves]

    def step(state: Any, chunk_xs: Any) -> tuple[Any, Any]:
        out = fn(state, chunk_xs)
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(f"fn ({_validate.name_of(fn)}) must return a pair (state, ys), got {type(out).__name__}")
        paths = [path for path, _ in _pytree.flatten(out[0])]
        if paths != init_structure:
            raise ValueError(
                f"fn ({_validate.name_of(fn)}) returned a state of structure {paths}, but init has {init_structure}"
            )
        return out

    def whole_forward(flat: list[mx.array]) -> list[mx.array]:
        assert forward is not None  # only built with one
        state, chunk_xs = _pytree.rebuild((init, xs), list(flat[: n + len(x_axes)]))
        out = forward(state, chunk_xs)
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(f"forward ({_validate.name_of(forward)}) must return a pair (state, ys)")
        return [v for v in _pytree.leaves(out) if isinstance(v, mx.array)]

    def transform(flat: FlatFn) -> FlatFn:
        def run(flat_xs: list[mx.array]) -> list[mx.array]:
            axes = [None] * n + x_axes + [None] * (len(flat_xs) - n - len(x_axes))  # modules' arrays: whole
            whole = None if forward is None else whole_forward
            return _Scan(flat, flat_xs, n, axes, out_axis, chunk, whole).checkpointed()

        return run

    return cast(tuple[Any, Any], _calls.call_flat(transform, step, (init, xs), {}))
