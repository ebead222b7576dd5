"""Chunked checkpoints: a function computed chunk by chunk along an axis, each chunk recomputed in the backward.

Some computations of a step are large along the sequence and split cleanly
along it: the loss head (batch x tokens x vocabulary logits) and attention's
scores (tokens x tokens). A block checkpoint keeps them whole while its
backward pass runs. :func:`checkpoint_chunks` computes such a function in
chunks of ``size`` along an axis: the forward keeps no chunk's intermediates;
the backward recomputes the chunks one at a time, last first, each chunk's
recomputation reading its inputs through the gradients of the chunk after it
(so the evaluator cannot start it early), and each chunk is a stage of
:func:`nuvec_mlx.eval` (forward and backward), so that one chunk's
intermediates are alive at a time. The gradients of inputs every chunk reads
whole (weights, attention's keys) are summed as the chunks go, not kept per
chunk.

A function with one output summed over the chunks, a scalar (a loss), needs no
recomputation under nuvec's gradients (:func:`nuvec_mlx.value_and_grad`,
:func:`nuvec_mlx.TrainingStep`; :mod:`nuvec_mlx._gradient`): each chunk's
gradient is taken in the forward pass with its value (the value a stage, then
the gradient), and the backward pass scales them by the loss's cotangent. The
peak is no higher (a chunk's logits and their gradient are alive in one stage
either way); the chunk is computed once instead of twice. Those gradients
support first derivatives only: a derivative of them raises.

The chunked custom function has ``vjp`` (that recomputation), ``jvp`` (forward
mode, chunk by chunk) and ``vmap`` rules, so every transform goes through it,
also nested inside checkpointed blocks and under :func:`nuvec_mlx.compile`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx

from . import _calls, _constants, _depends, _gradient, _marks, _pytree, _random, _validate

#: ``out_axes`` for an output summed over the chunks (a loss), not concatenated.
SUM = "sum"

FlatChunkFn = Callable[[list[mx.array], slice], Sequence[mx.array]]

# The chunk's slice along the axis, while a chunk of a pytree function runs (see slice_arg).
_slice: contextvars.ContextVar[slice | None] = contextvars.ContextVar("nuvec_mlx_chunk_slice", default=None)


def _take(x: mx.array, axis: int, bounds: slice) -> mx.array:
    index = [slice(None)] * x.ndim
    index[axis] = bounds
    return x[tuple(index)]


class _Sums:
    """The gradients of a chunked call's wanted inputs, chunk by chunk: the pieces of the inputs split along
    the axis, and running sums for the inputs read whole (a weight's gradient summed as the chunks go).

    The sums are kept in float32 whatever the inputs' dtype, and cast back to it once, at the end: summed
    in bfloat16, each chunk's addition would round, and the error would grow with the number of chunks."""

    def __init__(self, wanted: list[int], axes: list[int | None], dtypes: list[mx.Dtype]):
        self.wanted, self.axes, self.dtypes = wanted, axes, dtypes
        self.pieces: dict[int, list[mx.array]] = {i: [] for i in wanted if axes[i] is not None}
        self.summed: dict[int, mx.array] = {}

    def add(self, grads: Sequence[mx.array]) -> list[mx.array]:
        """Add one chunk's gradients (of the wanted inputs, in order) and finish them as a stage
        (:func:`nuvec_mlx._marks.finished`): the chunk's pieces and the sums so far. Returns what the
        stage finished: what the next chunk waits for."""
        for i, g in zip(self.wanted, grads, strict=True):
            if i in self.pieces:
                self.pieces[i].append(g)
            else:
                g = _widened(g)
                self.summed[i] = g if i not in self.summed else self.summed[i] + g
        latest = [self.pieces[i][-1] if i in self.pieces else self.summed[i] for i in self.wanted]
        done = _marks.finished(latest, _marks.CHUNK)
        for i, g in zip(self.wanted, done, strict=True):
            if i in self.pieces:
                self.pieces[i][-1] = g
            else:
                self.summed[i] = g
        return done

    def result(self, reverse: bool) -> list[mx.array]:
        """Each wanted input's gradient: its pieces concatenated (``reverse``: they were added last chunk
        first), or its sum."""
        out = []
        for i in self.wanted:
            axis = self.axes[i]
            parts = self.pieces.get(i, [])
            if axis is None:
                out.append(self.summed[i].astype(self.dtypes[i]))
            else:
                out.append(mx.concatenate(parts[::-1] if reverse else parts, axis=axis))
        return out


def _widened(g: mx.array) -> mx.array:
    """``g`` in float32 if it is a narrower float (a running sum's dtype), else as it is."""
    narrow = g.dtype in (mx.float16, mx.bfloat16)
    return g.astype(mx.float32) if narrow else g


class _Call:
    """One call of a chunked function: its inputs, its chunks, and the rules ``mx.custom_function`` runs.

    Args:
        fn: ``fn(chunk_inputs, bounds) -> outputs`` for one chunk.
        xs: every input.
        axes: per input, the axis it is split along (non-negative), or ``None`` (read whole).
        size: the chunk length.
        out_axes: per output, the axis chunks are concatenated along, or :data:`SUM`.
        captured: ``"differentiate"`` or ``"constant"`` (see :func:`checkpoint_chunks`).
        lazy_in_recompute: see :func:`checkpoint_chunks`.
    """

    def __init__(
        self,
        fn: FlatChunkFn,
        xs: list[mx.array],
        axes: list[int | None],
        size: int,
        out_axes: int | str | Sequence[int | str],
        captured: str,
        lazy_in_recompute: bool = False,
    ):
        self.fn, self.xs, self.axes, self.out_axes_spec, self.captured = fn, xs, axes, out_axes, captured
        self.lazy_in_recompute = lazy_in_recompute
        lengths = {x.shape[a] for x, a in zip(xs, axes, strict=True) if a is not None}
        if len(lengths) != 1:
            shapes = [(tuple(x.shape), a) for x, a in zip(xs, axes, strict=True) if a is not None]
            raise ValueError(
                "checkpoint_chunks: the inputs split into chunks must have one length along their axes "
                f"(in_axes), got (shape, axis) {shapes}"
            )
        n = lengths.pop()
        self.chunks = [slice(s, min(s + size, n)) for s in range(0, n, size)]
        self.diff = [i for i, x in enumerate(xs) if _validate.is_differentiable(x)]
        self.wanted = [i for i in self.diff if not _constants.is_constant(xs[i])]
        self.keys: list[mx.array] = []  # each chunk's random key in the forward, replayed by its recomputation
        # The wanted inputs' gradients for a cotangent of 1 where they were taken in the forward pass
        # (_forward_with_gradients), else empty: the backward pass recomputes the chunks.
        self.taken: list[mx.array] = []
        self.out_axes: list[int | str] = []
        self.starts: list[list[int]] = []  # per chunk, where its part of each concatenated output starts
        self.graph: list[mx.array] = []

    def checkpointed(self) -> list[mx.array]:
        """``fn`` over ``xs`` in chunks, each checkpointed and staged."""
        if not self.diff:
            return self._combine([self.run(self.xs, c) for c in range(len(self.chunks))]) if self.chunks else []
        chunked = mx.custom_function(self.forward)
        chunked.vjp(self.backward)
        chunked.jvp(self.jvp)
        chunked.vmap(self.vmap)
        # mx.custom_function's __call__ is typed object; it returns what self.forward returns, a list of arrays.
        out = list(cast(list[mx.array], chunked(self.xs)))
        return out if self.captured == "constant" else _depends.also_into(out, self.graph)

    def part(self, xs: Sequence[mx.array], c: int) -> list[mx.array]:
        """Chunk ``c``'s inputs cut from ``xs``: a slice of those split along the axis, the others whole."""
        return [x if a is None else _take(x, a, self.chunks[c]) for x, a in zip(xs, self.axes, strict=True)]

    def run(self, xs: Sequence[mx.array], c: int) -> list[mx.array]:
        """Chunk ``c`` of ``fn``, on the chunk's inputs cut from ``xs``."""
        return self.run_part(self.part(xs, c), c)

    def run_part(self, part: Sequence[mx.array], c: int) -> list[mx.array]:
        return _validate.check_outputs(self.fn(list(part), self.chunks[c]), self.fn)

    def forward(self, xs: list[mx.array]) -> list[mx.array]:
        stopped = [mx.stop_gradient(x) for x in xs]
        self.keys.append(_random.key())
        first = self.run(stopped, 0)
        if not first:  # MLX 0.32 crashes (segmentation fault) on a custom function of no outputs here
            raise ValueError(
                f"checkpoint_chunks: fn ({_validate.name_of(self.fn)}) returned no array: it must return an "
                "array, or a list, tuple or dict of arrays, whose chunks are concatenated or summed"
            )
        self.out_axes = self._out_axes(first)
        if _gradient.active() and self.wanted and self.out_axes == [SUM] and first[0].ndim == 0:
            # first is dropped unevaluated: chunk 0 runs again with its gradient
            return self._forward_with_gradients(stopped, first[0].dtype)
        # In a checkpoint's recomputation a lazy call's chunks are no stages: MLX computes them only if read.
        lazy = self.lazy_in_recompute and _marks.in_recomputation()
        stage = list if lazy else functools.partial(_marks.mark, stage_kind=_marks.CHUNK)
        outs = [stage(first)]
        for c in range(1, len(self.chunks)):
            self.keys.append(_random.key())
            outs.append(stage(self.run(stopped, c)))
        ends = [0] * len(self.out_axes)
        for out in outs:
            self.starts.append(list(ends))
            ends = [
                e + (o.shape[a] if isinstance(a, int) else 0) for e, o, a in zip(ends, out, self.out_axes, strict=True)
            ]
        self.graph = self._combine(outs)
        return self.graph

    def _forward_with_gradients(self, stopped: list[mx.array], dtype: mx.Dtype) -> list[mx.array]:
        """The summed scalar and, chunk by chunk, its gradients: the backward only scales them.

        Each chunk's value and gradients come from one ``mx.vjp`` (cotangent 1),
        so the chunk is computed once, not again in the backward pass; its
        value is a stage, then its gradients, so that its logits (say) are
        alive in those two stages only. The gradients of inputs split along the
        axis are concatenated, those of inputs read whole summed as the chunks
        go (a stage holds the sum so far).
        """
        total: mx.array | None = None
        sums = _Sums(self.wanted, self.axes, [x.dtype for x in self.xs])
        after: list[mx.array] = []  # what the next chunk waits for
        for c in range(len(self.chunks)):
            if c:
                self.keys.append(_random.key())
            xs = _depends.depends_floating(stopped, after) if after else stopped
            part = self.part(xs, c)

            def value(*wanted: mx.array, part: list[mx.array] = part, c: int = c) -> list[mx.array]:
                return self.run_part(_pytree.substitute(part, self.wanted, wanted), c)

            # Chunk 0 replays the draws of its first run; the others draw on from the thread's key.
            with _random.drawing_from(self.keys[0]) if c == 0 else contextlib.nullcontext():
                (loss,), grads = mx.vjp(value, [part[i] for i in self.wanted], [mx.ones((), dtype=dtype)])
            # The value a stage of its own, then the gradient: within a stage the evaluator may hold every
            # buffer it makes (MLX runs ahead of the device), and one stage for both held one more chunk of
            # logits than the recomputation's backward stage did.
            total = _marks.finished([loss if total is None else total + loss], _marks.CHUNK)[0]
            after = [total, *sums.add(grads)]
        assert total is not None  # a chunked call has a chunk
        self.taken = sums.result(reverse=False)
        self.graph = [total]
        return self.graph

    def _out_axes(self, out: Sequence[mx.array]) -> list[int | str]:
        spec = self.out_axes_spec
        axes = list(spec) if isinstance(spec, (list, tuple)) else [spec] * len(out)
        if len(axes) != len(out):
            raise ValueError(f"checkpoint_chunks: out_axes names {len(axes)} outputs, fn returned {len(out)}")
        normal: list[int | str] = []
        for a, o in zip(axes, out, strict=True):
            if a == SUM:
                normal.append(SUM)
            elif not -o.ndim <= a < o.ndim:  # type: ignore[operator]
                raise ValueError(f"checkpoint_chunks: out_axes {a} is out of range for an output of shape {o.shape}")
            else:
                normal.append(a % o.ndim)  # type: ignore[operator]
        return normal

    def _combine(self, outs: list[list[mx.array]]) -> list[mx.array]:
        return [
            mx.concatenate(list(parts), axis=a) if isinstance(a, int) else functools.reduce(mx.add, parts)  # a: SUM
            for a, parts in zip(self.out_axes, zip(*outs), strict=True)
        ]

    def _cotangents(self, cotangents: Sequence[mx.array], c: int) -> list[mx.array]:
        """Chunk ``c``'s share of the outputs' cotangents: a slice, or the whole for a sum."""
        out = []
        for k, (a, cot) in enumerate(zip(self.out_axes, cotangents, strict=True)):
            if a == SUM:
                out.append(cot)
            else:
                stop = self.starts[c + 1][k] if c + 1 < len(self.starts) else cot.shape[a]  # type: ignore[index]
                out.append(_take(cot, a, slice(self.starts[c][k], stop)))  # type: ignore[arg-type]
        return out

    def backward(self, primals: list[mx.array], cotangents: Sequence[mx.array], outputs: Any) -> list[mx.array]:
        zeros = [mx.zeros_like(p) for p in primals]
        if not self.wanted:
            return zeros
        if self.taken:  # a scalar's cotangent scales the gradients taken for 1
            scaled = [(cotangents[0] * g).astype(g.dtype) for g in self.taken]
            # mx.custom_function's __call__ is typed object; _first_order returns a list of arrays.
            guarded = cast(list[mx.array], _first_order(scaled, [primals[i] for i in self.wanted]))
            return _pytree.substitute(zeros, self.wanted, guarded)
        cotangents = list(cotangents)
        sums = _Sums(self.wanted, self.axes, [x.dtype for x in self.xs])
        after = cotangents  # what the next chunk's recomputation waits for
        for c in reversed(range(len(self.chunks))):
            xs = _depends.depends_floating(primals, after)
            key = _depends.depends([self.keys[c]], after)[0]
            part = self.part(xs, c)

            def recompute(*wanted: mx.array, part: list[mx.array] = part, key: mx.array = key, c: int = c) -> list:
                with _random.drawing_from(key):
                    return self.run_part(_pytree.substitute(part, self.wanted, wanted), c)

            after = sums.add(mx.vjp(recompute, [part[i] for i in self.wanted], self._cotangents(cotangents, c))[1])
        return _pytree.substitute(zeros, self.wanted, sums.result(reverse=True))

    def jvp(self, primals: list[mx.array], tangents: list[mx.array | None]) -> list[mx.array]:
        """Forward mode needs no checkpoint: the tangents chunk by chunk, with the forward's draws."""
        outs = []
        for c in range(len(self.chunks)):
            with _random.drawing_from(self.keys[c]):
                outs.append(_depends.jvp_floating(lambda *xs, c=c: self.run(xs, c), primals, tangents))
        return self._combine(outs)

    def vmap(self, xs: list[mx.array], axes: list[int | None]) -> tuple[list[mx.array], list[int]]:
        """The batched function, chunked in turn (the batch axis first), with the forward's draws."""
        xs = [x if a is None else mx.moveaxis(x, a, 0) for x, a in zip(xs, axes, strict=True)]
        batched = [a is not None for a in axes]
        split = [None if s is None else s + b for s, b in zip(self.axes, batched, strict=True)]
        in_axes = tuple(0 if b else None for b in batched)

        def fn(part: list[mx.array], bounds: slice) -> Sequence[mx.array]:
            return mx.vmap(lambda *ys: self.fn(list(ys), bounds), in_axes=in_axes)(*part)

        out_axes = [SUM if a == SUM else a + 1 for a in self.out_axes]  # type: ignore[operator]
        keys = iter(self.keys)
        with _random.drawing_from(next(keys)):
            size = self.chunks[0].stop - self.chunks[0].start
            out = _Call(fn, xs, split, size, out_axes, self.captured, self.lazy_in_recompute).checkpointed()
        return out, [0] * len(out)


_SECOND_ORDER = (
    "a derivative of a gradient that nuvec took in the forward pass of a chunked loss (nv.losses.cross_entropy, "
    "nv.checkpoint_chunks with one summed scalar output, under nv.value_and_grad or nv.TrainingStep): those "
    "chunks support first derivatives only; take the inner gradient with mx.grad or nn.value_and_grad, which "
    "recompute the chunks in the backward pass"
)
#: Gradients taken in a forward pass, refusing a second derivative.
_first_order = _depends.first_order(_SECOND_ORDER)


def _check_axes(spec: object, name: str) -> None:
    items = spec if isinstance(spec, (list, tuple)) else [spec]
    allowed = (None,) if name == "in_axes" else (SUM,)
    for a in items:
        if a not in allowed and (isinstance(a, bool) or not isinstance(a, int)):
            what = "an int, 'sum', or a list of them" if name == "out_axes" else "an int, None, or a list of them"
            raise TypeError(f"{name} must be {what}, got {a!r}")


def checkpoint_chunks(
    fn: Callable[..., Any] | None = None,
    *,
    size: int,
    in_axes: int | None | Sequence[int | None] = 1,
    out_axes: int | str | Sequence[int | str] = 1,
    slice_arg: str | None = None,
    captured: str = "differentiate",
    lazy_in_recompute: bool = False,
) -> Callable[..., Any]:
    """Compute ``fn`` in chunks of ``size`` along an axis, each chunk checkpointed: one chunk's memory at a time.

    ``fn`` is called once per chunk, with the chunk of each argument that
    ``in_axes`` splits and the whole of the others; the chunks' outputs are
    concatenated along ``out_axes``, or summed (``"sum"``). The forward keeps
    no chunk's intermediates; the backward pass recomputes one chunk at a time,
    last first, each a stage of :func:`nuvec_mlx.eval`, and sums the gradients
    of the arguments read whole as it goes. Values and gradients are those of
    the chunks computed one by one and combined: for a function that treats
    positions along the axis independently (a loss summed over tokens,
    attention by query), those of ``fn`` on the whole, up to the order of sums.
    Under nuvec's gradients (:func:`nuvec_mlx.value_and_grad`,
    :class:`nuvec_mlx.TrainingStep`) a function with one scalar output summed
    over the chunks (a loss) is not recomputed: each chunk's gradient is taken
    in its forward stage, and the backward pass scales it by the cotangent (a
    second derivative through it raises; ``mx.grad`` recomputes, and supports it).
    Modules ``fn`` reaches are handled as :func:`nuvec_mlx.checkpoint` handles
    them (their trainable parameters differentiated, read whole by every
    chunk). Usable as a decorator with its keyword arguments.

    Args:
        fn: the function, of arrays, modules, and pytrees of them.
        size: the chunk length along the axis (the last chunk may be shorter).
        in_axes: the axis each positional argument is split along (every
            array in it), or ``None`` to pass it whole; an int or ``None`` for
            all of them. Keyword arguments are passed whole.
        out_axes: the axis along which each output's chunks are concatenated,
            or ``"sum"`` to add them; one for all outputs or one per output array.
        slice_arg: the name of a keyword argument through which ``fn`` receives
            the chunk's ``slice(start, stop)`` along the axis (causal attention
            reads the keys up to ``stop``); ``None`` passes none.
        captured: ``"differentiate"`` (the default): arrays ``fn`` reads besides
            its arguments and their modules are differentiated exactly, through
            the forward's graph, which then stays whole until the backward
            pass; ``"constant"``: they get no gradient.
        lazy_in_recompute: inside a checkpoint's recomputation (the backward
            pass of a checkpointed block), leave the chunks' forward pass to
            MLX instead of making each chunk a stage, so that it is computed
            only if the block's backward pass reads its outputs. A block's MLP,
            whose output only joins the residual sum, then runs twice, as
            without chunks: in the block's forward pass, and chunk by chunk in
            its own backward pass. Leave it ``False`` where the outputs are
            read (attention's feed the output projection's gradient): staged,
            the recomputed chunks are computed one at a time.

    Returns:
        A function with the signature of ``fn``.

    Example:
        >>> def token_loss(h, targets):  # h: (batch, tokens, hidden)
        ...     return nn.losses.cross_entropy(model.lm_head(h), targets, reduction="sum")
        >>> total = nv.checkpoint_chunks(token_loss, size=256, out_axes="sum")(h, targets)
    """
    _validate.check_int(size, "size", minimum=1)
    _check_axes(in_axes, "in_axes")
    _check_axes(out_axes, "out_axes")
    if slice_arg is not None and not (isinstance(slice_arg, str) and slice_arg.isidentifier()):
        raise ValueError(f"slice_arg must be None or a keyword argument's name, got {slice_arg!r}")
    if captured not in ("differentiate", "constant"):
        raise ValueError(f"captured must be 'differentiate' or 'constant', got {captured!r}")
    _validate.check_bool(lazy_in_recompute, "lazy_in_recompute")
    if fn is None:
        return functools.partial(
            checkpoint_chunks,
            size=size,
            in_axes=in_axes,
            out_axes=out_axes,
            slice_arg=slice_arg,
            captured=captured,
            lazy_in_recompute=lazy_in_recompute,
        )
    _validate.check_callable(fn, "fn")
    body = fn if slice_arg is None else _given_slice(fn, slice_arg)

    @functools.wraps(fn)
    def chunked(*args: Any, **kwargs: Any) -> Any:
        # Not a list or tuple, in_axes is an int or None: _check_axes let nothing else through.
        spec = list(in_axes) if isinstance(in_axes, (list, tuple)) else [cast(int | None, in_axes)] * len(args)
        if len(spec) != len(args):
            raise ValueError(f"in_axes names {len(spec)} arguments, the call passed {len(args)}")
        axes: list[int | None] = []
        for arg, a in zip(args, spec, strict=True):
            for x in _pytree.leaves(arg):
                if isinstance(x, mx.array):
                    axes.append(None if a is None else _axis(a, x))

        def transform(flat: Callable[[list[mx.array]], list[mx.array]]) -> Callable[[list[mx.array]], list]:
            def run(xs: Sequence[mx.array]) -> list[mx.array]:
                full = axes + [None] * (len(xs) - len(axes))  # kwargs' and modules' arrays: whole

                def one(part: list[mx.array], bounds: slice) -> list[mx.array]:
                    token = _slice.set(bounds)
                    try:
                        return flat(part)
                    finally:
                        _slice.reset(token)

                one.__name__ = one.__qualname__ = _validate.name_of(fn)  # for messages about fn
                xs = _validate.check_array_list(xs, "xs")
                return _Call(one, xs, full, size, out_axes, captured, lazy_in_recompute).checkpointed()

            return run

        return _calls.call_flat(transform, body, args, kwargs)

    return chunked


def _axis(axis: int, x: mx.array) -> int:
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"in_axes {axis} is out of range for an argument of shape {tuple(x.shape)}")
    return axis % x.ndim


def _given_slice(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn``, called with the running chunk's slice as keyword argument ``name``."""

    @functools.wraps(fn)
    def sliced(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **{name: _slice.get()}, **kwargs)

    return sliced
