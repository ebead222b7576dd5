"""The checkpoint: a block's activations recomputed in the backward pass, also under compile.

:func:`mlx.core.checkpoint` recomputes a block from its inputs and forward
outputs, so the evaluator is free to run the recomputation long before the
backward pass reaches the block, and under :func:`mlx.core.compile` the
recomputation can cost more memory than it saves. Here the recomputation reads
its inputs through a dependency (:func:`nuvec_mlx._depends.depends`) on the
block's *cotangents*: it cannot start before the backward pass arrives, and
compile's common subexpression elimination cannot merge it with the forward
pass. The gradients a block returns also depend on one another (the "chain"),
so that a block's parameter gradients are finished before the cotangent moves
on to the previous block and its recomputed activations can be freed.

The checkpoint is an :func:`mlx.core.custom_function` with ``vjp`` (that
recomputation), ``jvp`` and ``vmap`` rules, so every transform goes through
it. Its rules differentiate its inputs only; whatever else the function reads
is differentiated by MLX through the forward's own graph
(:func:`nuvec_mlx._depends.also_into`), so that no derivative is silently lost.

:func:`checkpoint_flat` is that mechanism for flat functions; :func:`checkpoint`
puts functions of pytrees, and the modules they reach, through it.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx

from . import (
    _calls,
    _constants,
    _depends,
    _gradient,
    _marks,
    _policies,
    _pytree,
    _random,
    _saving,
    _validate,
    policies,
)

FlatFn = Callable[[list[mx.array]], Sequence[mx.array]]


def _in_shapeless_trace() -> bool:
    """Whether the code runs inside the trace of ``mx.compile(..., shapeless=True)``.

    ``mx.compile(..., shapeless=True)`` replays its graph for new input shapes
    by asking every node for its output shapes. MLX's custom functions (which a
    checkpoint is made of) cannot answer, so such a compile fails at the first
    call with new shapes, far from the cause: a checkpoint asks here when it is
    traced, to fail at once with a clear message instead. In a shapeless trace
    MLX counts an array's elements with a graph node (the count may change with
    the shapes), elsewhere with a constant: a mean's graph shows which. Nothing
    is evaluated.
    """
    graph = io.StringIO()
    mx.export_to_dot(graph, mx.zeros((1,)).mean())
    return "NumberOfElements" in graph.getvalue()


def _signature(arrays: Sequence[mx.array]) -> list[tuple[tuple[int, ...], mx.Dtype]]:
    return [(tuple(a.shape), a.dtype) for a in arrays]


#: Where a checkpointed call sits in a segment of consecutive blocks: the segment, and its position there.
Link = tuple[object, int]


class _Segment:
    """The calls of one segment of consecutive checkpointed blocks, in the order the forward pass made them.

    Each call's carried input (its first array: the hidden state blocks pass on) is the previous call's
    first output; only the first call's is kept between the forward and the backward pass. When the
    backward pass reaches the segment (at its last call), the others' carried inputs are recomputed from
    the first's, each a stage, and each call then recomputes and differentiates itself as a checkpoint
    does: the segment's carried inputs and one block's backward pass are alive at a time.
    """

    def __init__(self, first: _Call, position: int):
        self.calls = [first]
        self.next = position + 1  # the position in the link of the call that may join next
        self.start = first.xs[0]
        self.inputs: dict[int, mx.array] = {}  # the carried inputs recomputed and not yet taken, by call
        self.recomputed = 0  # the calls whose carried inputs are recomputed: 1 ... recomputed
        self.carried: mx.array | None = None  # the last call's carried output, as the model received it

    def carried_input(self, index: int, cotangents: list[mx.array]) -> mx.array:
        """The carried input of ``calls[index]``, recomputed (once for the segment, as far as needed) and
        handed over (the segment no longer holds it); the first recomputation reads the first call's input
        through ``cotangents``, so that it waits for the backward pass to reach the segment."""
        if index > self.recomputed:
            x = _depends.depends([self.start], cotangents)[0]
            for i in range(index):
                x = self.calls[i].rerun(x, cotangents)
                self.inputs[i + 1] = x
            self.recomputed = index
        return self.inputs.pop(index)


class _Call:
    """One call of a checkpointed ``fn``: its inputs, and the rules ``mx.custom_function`` runs.

    The custom function takes every input (integer ones too, so that its
    ``vmap`` rule sees them batched); gradients are computed for the floating
    ones that are not declared constant (:mod:`nuvec_mlx._constants`).
    """

    def __init__(
        self,
        fn: FlatFn,
        xs: list[mx.array],
        captured: str,
        policy: policies.Policy | None,
        link: Link | None = None,
    ):
        self.fn, self.xs, self.captured = fn, xs, captured
        self.segment, self.index = _join(self, link) if link is not None else (None, 0)
        self.kept = _saving.Record(policy)  # forward values the recomputation reuses
        self.diff = [i for i, x in enumerate(xs) if _validate.is_differentiable(x)]
        # The inputs whose gradients are wanted.
        self.wanted = [i for i in self.diff if not _constants.is_constant(xs[i])]
        self.key = _random.key()  # the forward's draws, replayed by the recomputation
        self.signature: list = []
        self.empty = False  # fn returned no arrays: the custom function returns a stand-in
        self.graph: list[mx.array] = []  # the forward's outputs, as fn computed them
        self.modules = _marks.held()  # whose gradients the backward stage completes

    def run(self, xs: Sequence[mx.array]) -> list[mx.array]:
        return _validate.check_outputs(self.fn(list(xs)), self.fn)

    def forward(self, xs: list[mx.array]) -> list[mx.array]:
        # On stopped inputs: what the forward's own graph differentiates is
        # only what fn read from elsewhere (see _also_into). Its values are
        # recomputed for the backward pass: no gradient is taken of these.
        with self.kept.recording(), _gradient.building(False):
            out = self.run([mx.stop_gradient(x) for x in xs])
        self.signature = _signature(out)
        if not out:  # mx.custom_function needs an output; nothing depends on this one
            self.empty = True
            return [mx.zeros(())]
        self.graph = _marks.mark(out, _marks.FORWARD)
        return self.graph

    def recompute(self, xs: Sequence[mx.array], key: mx.array) -> list[mx.array]:
        with _random.drawing_from(key), self.kept.replaying(), _marks.recomputing():
            out = self.run(xs)
        if _signature(out) != self.signature:
            raise ValueError(
                f"checkpoint_flat: fn ({_validate.name_of(self.fn)}) returned outputs "
                f"{_signature(out)} when recomputed in the backward pass, but "
                f"{self.signature} in the forward pass; fn must return the same "
                "number, shapes and dtypes of outputs every time"
            )
        return out

    def rerun(self, carried: mx.array, cotangents: list[mx.array]) -> mx.array:
        """This call's carried output, computed again from ``carried`` (its carried input, recomputed) and its
        other inputs as the forward pass had them (read through ``cotangents``), with the forward's draws: a
        stage of its own."""
        others = _depends.depends_floating(self.xs[1:], cotangents)
        key = _depends.depends([self.key], cotangents)[0]
        with _random.drawing_from(key), _gradient.building(False):
            out = self.run([carried, *others])
        return _marks.mark([mx.stop_gradient(out[0])], _marks.FORWARD)[0]

    def backward(self, primals: list[mx.array], cotangents: Sequence[mx.array], outputs: Any) -> list[mx.array]:
        zeros = [mx.zeros_like(p) for p in primals]
        if not self.wanted:  # every input a constant: nothing to recompute
            return zeros
        if self.segment is not None and self.index > 0:  # its carried input, recomputed from the segment's first
            primals = [self.segment.carried_input(self.index, list(cotangents)), *primals[1:]]
        # Read through the cotangents: the recomputation, its random draws
        # included, waits for the backward pass to reach this block.
        primals = _depends.depends_floating(primals, list(cotangents))
        # A local, not an attribute: the key depends on the cotangents, whose graph
        # reaches this custom function and its rules (bound to self). Kept on self,
        # that cycle runs through MLX's graph, which the garbage collector cannot
        # see; under compile the traced arrays are never evaluated (which would cut
        # it), and the step's weights outlived the step.
        key = _depends.depends([self.key], list(cotangents))[0]

        def recompute_wanted(*wanted: mx.array) -> list[mx.array]:
            return self.recompute(_pytree.substitute(primals, self.wanted, wanted), key)

        # Only the wanted gradients are computed (a constant's is never used).
        grads = mx.vjp(recompute_wanted, [primals[i] for i in self.wanted], list(cotangents))[1]
        grads = _marks.finished(grads, _marks.BACKWARD, self.modules)  # nv.eval waits here
        return _pytree.substitute(zeros, self.wanted, grads)

    def jvp(self, primals: list[mx.array], tangents: list[mx.array | None]) -> list[mx.array]:
        """Forward mode needs no checkpoint: the tangents of ``fn``, with the forward's draws."""
        with _random.drawing_from(self.key):
            return _depends.jvp_floating(lambda *xs: self.run(xs), primals, tangents)

    def vmap(self, xs: list[mx.array], axes: list[int | None]) -> tuple[list[mx.array], list[int]]:
        """The batched function, checkpointed in turn, with the forward's draws."""

        def batched(xs: list[mx.array]) -> list[mx.array]:
            return mx.vmap(lambda *ys: self.run(ys), in_axes=tuple(axes))(*xs)

        with _random.drawing_from(self.key):
            out = checkpoint_flat(batched, captured=self.captured, policy=self.kept.policy)(xs)
        return out, [0] * len(out)


def _join(call: _Call, link: Link) -> tuple[_Segment | None, int]:
    """The segment ``call`` joins as ``link`` says, and its index there: the segment of the step being built
    under ``link``'s key if ``call`` is its next block and reads the last one's carried output; else a new
    segment (a first block, a block whose model changed the carried value between blocks); ``None`` outside a
    step's gradient (nothing to recompute)."""
    segments = _marks.segments()
    if segments is None or not call.xs or not _validate.is_differentiable(call.xs[0]):
        return None, 0
    key, position = link
    segment = segments.get(key)
    if segment is not None and segment.next == position and segment.carried is call.xs[0]:
        segment.calls.append(call)
        segment.next += 1
        segment.carried = None  # this call's input now: not kept (its own output is carried next)
        return segment, len(segment.calls) - 1
    segments[key] = _Segment(call, position)
    return segments[key], 0


def checkpoint_flat(
    fn: FlatFn,
    *,
    policy: policies.Policy | None = None,
    captured: str = "differentiate",
) -> Callable[[Sequence[mx.array]], list[mx.array]]:
    """Checkpoint a flat function: same values and gradients, less memory.

    The forward pass keeps only the inputs of ``fn``; its activations are
    recomputed in the backward pass, when the cotangents of its outputs exist.
    Integer and bool inputs are passed through undifferentiated. Random draws
    (``mx.random``) are repeated identically on recomputation. ``mx.vmap``
    and ``mx.jvp`` go through it (also of its gradient: per-example gradients,
    Hessian-vector products). Arrays ``fn`` reads besides its inputs (by
    closure, say) are differentiated too, exactly, through the forward's
    graph, which then stays alive until the backward pass: pass them as
    inputs to have them recomputed.

    Args:
        fn: ``list[mx.array] -> list[mx.array]``.
        policy: which forward values to keep rather than recompute
            (:mod:`nuvec_mlx.policies`); ``None`` keeps none. A flat function
            offers only the values it names with :func:`nuvec_mlx.checkpoint_name`.
        captured: ``"differentiate"`` (the default): arrays ``fn`` reads
            besides its inputs are differentiated exactly, through the
            forward's graph; ``"constant"``: they get no gradient (zero).

    Returns:
        A flat function with the values and gradients of ``fn``.

    Raises:
        ValueError: called inside ``mx.compile(..., shapeless=True)``, which
            cannot infer the output shapes of the custom functions a
            checkpoint is made of.

    Example:
        >>> block = nv.checkpoint_flat(lambda xs: [mx.tanh(xs[0] @ xs[1])])
        >>> h = block([x, w])[0]
    """
    _validate.check_callable(fn, "fn")
    return linked(fn, policy=_policies.check_policy(policy), captured=_check_captured(captured))


def linked(
    fn: FlatFn, *, policy: policies.Policy | None, captured: str, link: Link | None = None
) -> Callable[[Sequence[mx.array]], list[mx.array]]:
    """:func:`checkpoint_flat` of checked arguments, as the ``link``-th block of a segment of consecutive
    checkpointed blocks (:class:`_Segment`; ``None``: on its own)."""
    if _policies.recomputes_nothing(policy):
        return _saving.unrecomputed(fn, _constants.is_constant)

    @functools.wraps(fn)
    def checkpointed(xs: Sequence[mx.array]) -> list[mx.array]:
        call = _Call(fn, _validate.check_array_list(xs, "xs"), captured, policy, link)
        if not call.diff:
            return call.run(call.xs)
        if _in_shapeless_trace():
            raise ValueError(
                f"checkpoint: fn ({_validate.name_of(fn)}) is checkpointed inside "
                f"mx.compile(..., shapeless=True), which MLX {_validate.MLX_VERSION} cannot do: "
                "the custom functions a checkpoint is made of cannot infer their output "
                "shapes for new input shapes. Compile with shapeless=False (one trace per "
                "input shape)"
            )
        block = mx.custom_function(call.forward)
        block.vjp(call.backward)
        block.jvp(call.jvp)
        block.vmap(call.vmap)
        # mx.custom_function's __call__ is typed object; it returns what call.forward returns, a list of arrays.
        out = list(cast(list[mx.array], block(call.xs)))
        if call.empty:
            return []
        out = out if captured == "constant" else _depends.also_into(out, call.graph)
        call.graph = []  # held by also_into's node while needed; held here, the rules would keep it (eagerly)
        if call.segment is not None:
            call.segment.carried = out[0]
            if call.index > 0:  # not kept: the segment recomputes it
                call.xs[0] = mx.array(0.0)
        return out

    return checkpointed


def _check_captured(captured: object) -> str:
    """``captured`` if it is ``"differentiate"`` or ``"constant"``."""
    if captured not in ("differentiate", "constant"):
        raise ValueError(f"captured must be 'differentiate' or 'constant', got {captured!r}")
    return captured


def checkpoint(
    fn: Callable | None = None,
    *,
    policy: policies.Policy | None = None,
    captured: str = "differentiate",
) -> Callable:
    """Checkpoint a function of pytrees: same values and gradients, less memory.

    Usable as ``@nv.checkpoint`` or ``@nv.checkpoint(policy=...)``.
    Positional and keyword arguments may be arrays, modules, or nested lists,
    tuples and dicts of them; other leaves are static. Integer and bool arrays
    are not differentiated. Outputs may hold leaves that are not arrays
    (``None``, ints, caches): they pass through, and must be equal (``==``)
    when ``fn`` is recomputed. Random draws repeat identically on
    recomputation, eagerly and under compile (with ``mx.random.state`` as
    compile state).

    Modules: those among the arguments, and those ``fn`` reaches (itself, a
    bound method's ``self``, closure cells, defaults, ``functools.partial``
    arguments, globals, containers and attributes of objects reached so, and
    helper functions' closures and globals: :mod:`nuvec_mlx._capture` lists
    the routes) hold the checkpoint's inputs while ``fn`` runs: their
    trainable parameters are differentiated, their other arrays (frozen
    parameters, running statistics) are constants, and arrays the forward
    assigns to them (BatchNorm's running statistics) stay, as without the
    checkpoint. Anything else ``fn`` reads (an array by any route, a module by
    a route not searched) is differentiated exactly through the forward's
    graph, which then stays alive until the backward pass.

    Args:
        fn: the function to checkpoint (may also be an ``nn.Module``).
        policy: which forward values to keep rather than recompute
            (:mod:`nuvec_mlx.policies`): the outputs of the ``nn.Linear`` layers
            of those modules, values named with :func:`nuvec_mlx.checkpoint_name`;
            ``None`` keeps none.
        captured: ``"differentiate"`` (the default) or ``"constant"``: how
            arrays ``fn`` reads besides its arguments and those modules are
            differentiated (see :func:`checkpoint_flat`).

    Returns:
        A function with the signature, values and gradients of ``fn``.

    Example:
        >>> @nv.checkpoint
        ... def block(x, params, scale=2.0):
        ...     return {"h": mx.tanh(x @ params["w"]) * scale}
        >>> out = block(x, {"w": w})["h"]
    """
    captured = _check_captured(captured)
    policy = _policies.check_policy(policy)
    if fn is None:
        return functools.partial(checkpoint, captured=captured, policy=policy)
    _validate.check_callable(fn, "fn")
    transform = functools.partial(checkpoint_flat, captured=captured, policy=policy)
    body = _policies.offering_layers(fn, policy)

    @functools.wraps(fn)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return _calls.call_flat(transform, body, args, kwargs)

    return checkpointed
