"""What each block keeps for the backward pass: the saved-activations report of a step.

Modelled on JAX's ``print_saved_residuals``. For each block of a model,
:func:`saved_activations` lists the arrays its backward pass reads from its
forward pass (shape, dtype, bytes, the MLX primitive that made them), unchecked
and checkpointed with a policy, without evaluating anything.

How it sees them. MLX builds a step lazily, and :func:`mlx.core.export_function`
hands a traced function's graph to a callback: every primitive with its inputs'
and outputs' shapes and dtypes, in order. The report runs the loss once lazily
to catch each block's arguments, then exports, per block, the function
``(arguments, weights, cotangents) -> (outputs, vjp)`` of the block unchecked:
an array is *saved* when the graph's backward part (what the outputs do not
depend on) reads it and it comes from the forward part or from the block's
arguments. Views (reshape, transpose, slices, broadcasts ...) share their
source's buffer, so bytes are counted once per buffer. A checkpointed block
keeps its array arguments and the values its policy keeps (caught while the
block runs forward, as a checkpoint does).

What it cannot see: the graph is the uncompiled one (``mx.compile`` fuses
element-wise chains, which can drop some saved intermediates, never add
any); blocks whose graph holds a custom function (a checkpoint nested inside,
``mx.custom_function`` layers) cannot be exported and list no arrays; the parts
of the model outside the blocks (embedding, head, loss) are not listed; and
which arrays are alive at once also depends on the evaluation order, which
only a measurement shows (:func:`nuvec_mlx.plan`'s per-block figures, or
``measure=True`` here).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, overload

import mlx.core as mx
import mlx.nn as nn

from .. import _calls, _policies, _pytree, _saving, _validate
from .. import nn as nv_nn
from .._units import MiB
from ..nn import find_layers
from ..policies import Policy, save_everything, save_nothing
from ..step import TrainingStep
from . import _trial

#: Primitives whose output shares its input's buffer (MLX makes them views when it can).
VIEWS = frozenset(
    {
        "Reshape",
        "Transpose",
        "ExpandDims",
        "Squeeze",
        "Slice",
        "Split",
        "Broadcast",
        "BroadcastAxes",
        "AsStrided",
        "Flatten",
        "Unflatten",
        "StopGradient",
        "Depends",
    }
)


@dataclasses.dataclass(frozen=True)
class Saved:
    """One array a block keeps for its backward pass.

    Attributes:
        shape, dtype, nbytes: the array's.
        made_by: the MLX primitive that made it (``"argument"`` for the
            block's own input, a layer's path for a policy's value).
        view_of: for a view, the primitive that made the buffer it shares.
        shared: whether its buffer was already counted (a view of another saved array's).
    """

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    made_by: str
    view_of: str | None = None
    shared: bool = False


@dataclasses.dataclass
class BlockReport:
    """The arrays one block keeps, unchecked and checkpointed."""

    index: int
    name: str
    kind: str
    outputs: int  # bytes of the block's outputs (the next block's input)
    unchecked: list[Saved] | None  # None: the block's graph could not be exported
    checkpointed: list[Saved]
    error: str | None = None
    measured_unchecked: int | None = None  # kept bytes per stage, measured (outputs included)
    measured_checkpointed: int | None = None

    @overload
    @staticmethod
    def total(arrays: Sequence[Saved]) -> int: ...

    @overload
    @staticmethod
    def total(arrays: Sequence[Saved] | None) -> int | None: ...

    @staticmethod
    def total(arrays: Sequence[Saved] | None) -> int | None:
        """Distinct bytes of ``arrays`` (views counted once)."""
        return None if arrays is None else sum(a.nbytes for a in arrays if not a.shared)


class SavedActivations:
    """The report: one :class:`BlockReport` per block; ``str()`` is the text, :meth:`to_dict` the JSON."""

    def __init__(self, blocks: list[BlockReport], policy: str):
        self.blocks, self.policy = blocks, policy

    def to_dict(self) -> dict:
        """The report as plain data."""
        rows = []
        for b in self.blocks:
            row = dataclasses.asdict(b)
            row["unchecked_bytes"], row["checkpointed_bytes"] = b.total(b.unchecked), b.total(b.checkpointed)
            rows.append(row)
        return {"policy": self.policy, "blocks": rows}

    def save_json(self, path: str | Path) -> Path:
        """Write :meth:`to_dict` to ``path`` as JSON."""
        path = _validate.check_path(path, "path")
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    def __str__(self) -> str:
        lines = []
        for b in self.blocks:
            head = f"block {b.index} ({b.name}, {b.kind}), outputs {_mib(b.outputs)}"
            if b.measured_unchecked is not None:
                head += (
                    f"; measured between its stages: {_mib(b.measured_unchecked)} unchecked, "
                    f"{_mib(b.measured_checkpointed)} checkpointed (outputs included)"
                )
            lines += [head]
            if b.unchecked is None:
                lines.append(f"  unchecked: not listed ({b.error})")
            else:
                lines.append(f"  unchecked: {len(b.unchecked)} arrays, {_mib(b.total(b.unchecked))}")
                lines += _rows(b.unchecked)
            lines.append(
                f"  checkpointed ({self.policy}): {len(b.checkpointed)} arrays, {_mib(b.total(b.checkpointed))}"
            )
            lines += _rows(b.checkpointed)
        unchecked = [b.total(b.unchecked) for b in self.blocks]
        listed = [t for t in unchecked if t is not None]
        if len(listed) == len(unchecked):
            lines.append(
                f"all blocks: {_mib(sum(listed))} unchecked, "
                f"{_mib(sum(b.total(b.checkpointed) for b in self.blocks))} checkpointed ({self.policy})"
            )
        return "\n".join(lines)


def _mib(nbytes: int | None) -> str:
    return "?" if nbytes is None else f"{nbytes / MiB:.2f} MiB"


def _rows(arrays: Sequence[Saved]) -> list[str]:
    """One line per array, the largest buffers first."""
    out = []
    for a in sorted(arrays, key=lambda a: (a.shared, -a.nbytes)):
        made = a.made_by + (f" (view of {a.view_of})" if a.view_of else "")
        note = ", shares a buffer above" if a.shared else ""
        out.append(f"    {str(a.shape):<22} {a.dtype:<9} {a.nbytes / 1024:>10.1f} KiB  {made}{note}")
    return out


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def residuals(events: Sequence[dict], outputs: int, arguments: set[str], weights: set[str]) -> list[Saved]:
    """The saved arrays of an exported ``(inputs) -> (outputs, vjp)`` graph.

    Args:
        events: what :func:`mlx.core.export_function` handed its callback.
        outputs: how many of the graph's outputs are the forward outputs (the rest are the vjp).
        arguments: the input names that are the block's arguments (saved when read).
        weights: the input names that are weights (resident anyway: not listed).
    """
    made: dict[str, dict] = {}  # array name -> the primitive that made it
    known: dict[str, tuple] = {}  # array name -> (shape, dtype)
    order: list[dict] = []
    for e in events:
        if e["type"] == "outputs":
            forward_outputs = [name for name, *_ in e["outputs"][:outputs]]
        elif e["type"] == "primitive":
            order.append(e)
            for name, shape, dtype in e["outputs"]:
                made[name], known[name] = e, (tuple(shape), dtype)
        elif e["type"] == "inputs":
            known.update((name, (tuple(shape), dtype)) for name, shape, dtype in e["inputs"])
        elif e["type"] == "constants":
            known.update((name, (tuple(a.shape), a.dtype)) for name, a in e["constants"])
    forward, todo = set(), list(forward_outputs)
    while todo:
        producer = made.get(todo.pop())
        if producer is not None and id(producer) not in forward:
            forward.add(id(producer))
            todo += [n for n, *_ in producer["inputs"]]
    saved: list[str] = []
    for e in order:
        if id(e) not in forward:
            saved += [
                n
                for n, *_ in e["inputs"]
                if n not in saved and ((n in made and id(made[n]) in forward) or n in arguments)
            ]

    def base(name: str) -> str:
        while name in made and made[name]["name"] in VIEWS and made[name]["inputs"]:
            name = made[name]["inputs"][0][0]
        return name

    def maker(name: str) -> str:
        return made[name]["name"] if name in made else "argument" if name in arguments else "constant"

    result, counted = [], set()
    for name in saved:
        root = base(name)
        if name in weights or root in weights:
            continue
        shape, dtype = known[name]
        view = root != name
        result.append(
            Saved(
                shape,
                _dtype_name(dtype),
                _nbytes(*known[root]),
                maker(name),
                maker(root) if view else None,
                root in counted,
            )
        )
        counted.add(root)
    return result


def _nbytes(shape: Sequence[int], dtype: mx.Dtype) -> int:
    size = 1
    for d in shape:
        size *= d
    return size * dtype.size


def _export(block: nn.Module, args: tuple, kwargs: dict) -> tuple[list[Saved], int]:
    """The arrays ``block`` saves unchecked when called with ``args``, ``kwargs``; its outputs' bytes."""
    found: list = []

    def transform(flat: Callable) -> Callable:
        def exporting(xs: list[mx.array]) -> list[mx.array]:
            outs = flat(xs)
            # The block's floating arguments and trainable parameters are differentiated, as in a step.
            diff = [
                i for i, x in enumerate(xs) if _validate.is_differentiable(x) and (i < n_args or id(x) in trainable)
            ]

            def graph(*inputs: mx.array) -> list[mx.array]:
                primals, cotangents = list(inputs[: len(xs)]), list(inputs[len(xs) :])

                def forward(*d: mx.array) -> list[mx.array]:
                    return flat(_pytree.substitute(primals, diff, d))

                out, grads = mx.vjp(forward, [primals[i] for i in diff], cotangents)
                return [*out, *grads]

            events: list[dict] = []
            mx.export_function(events.append, graph, *xs, *[mx.zeros(o.shape, o.dtype) for o in outs])
            names = [name for e in events if e["type"] == "inputs" for name, *_ in e["inputs"]]
            found.append(
                (events, len(outs), set(names[:n_args]), set(names[n_args : len(xs)]), sum(o.nbytes for o in outs))
            )
            return outs

        return exporting

    # The flat inputs: the arguments' arrays, then the arrays of the modules the call reaches.
    n_args = sum(isinstance(v, mx.array) for _, v in _pytree.flatten((list(args), kwargs)))
    trainable = {id(v) for _, v in _pytree.flatten(block.trainable_parameters())}
    _calls.call_flat(transform, lambda *a, **k: block(*a, **k), args, kwargs)
    events, outputs, arguments, weights, out_bytes = found[0]
    return residuals(events, outputs, arguments, weights), out_bytes


def _kept(block: nn.Module, args: tuple, kwargs: dict, policy: Callable | None) -> list[Saved]:
    """What ``block`` keeps checkpointed with ``policy``: its array arguments and the policy's values."""
    arrays = [a for _, a in _pytree.flatten((list(args), kwargs)) if isinstance(a, mx.array)]
    kept = [
        Saved(tuple(a.shape), _dtype_name(a.dtype), a.nbytes, "argument")
        for a in arrays
        if _validate.is_differentiable(a)
    ]
    if policy is None or _policies.recomputes_nothing(policy):
        return kept
    record = _saving.Record(policy)
    paths = {id(m): p for p, m in block.named_modules()}
    with record.recording():
        _policies.offering_layers(lambda: block(*args, **kwargs), policy)()
    for (kind, where, _), value in record.values.items():
        made = f"{paths.get(where, '?')} (nn.Linear output)" if kind == _saving.MATMUL else f"checkpoint_name {where!r}"
        kept.append(Saved(tuple(value.shape), _dtype_name(value.dtype), value.nbytes, made))
    return kept


def _first_calls(model: nn.Module, loss_fn: Callable, batch: tuple, blocks: Sequence[nn.Module]) -> list:
    """Each block's first call (args, kwargs), caught by running the loss lazily (nothing is evaluated)."""
    calls: list = [None] * len(blocks)
    classes = [type(b) for b in blocks]

    def catching(j: int, cls: type) -> type:
        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if calls[j] is None:
                calls[j] = (args, kwargs)
            return cls.__call__(self, *args, **kwargs)

        return type(cls.__name__, (cls,), {"__call__": __call__})

    try:
        for j, (b, cls) in enumerate(zip(blocks, classes)):
            b.__class__ = catching(j, cls)
        loss_fn(model, *batch)
    finally:
        for b, cls in zip(blocks, classes):
            b.__class__ = cls
    missing = [j for j, c in enumerate(calls) if c is None]
    if missing:
        raise ValueError(f"blocks {missing} were not called by loss_fn(model, *batch): nothing to report for them")
    return calls


def saved_activations(
    step: TrainingStep, batch: Any, *, policy: Policy | None = None, layers: Any = None, measure: bool = False
) -> SavedActivations:
    """Per block, the arrays a step keeps for its backward pass, unchecked and checkpointed.

    Nothing is evaluated (unless ``measure``), and the model
    is left as it was. See the module's description for how the arrays are
    found and what the report cannot see.

    Args:
        step: the training step (:class:`nuvec_mlx.TrainingStep`).
        batch: the loss's arguments after the model: an array, or a tuple of them.
        policy: the checkpoint policy of the "checkpointed" column
            (:mod:`nuvec_mlx.policies`); ``None`` keeps nothing.
        layers: the blocks; ``None`` for ``model.layers`` or ``model.model.layers``.
        measure: also run two staged steps (every block ``save_everything``,
            then checkpointed with ``policy``) and read what each block kept
            between its stages, measured (outputs included).

    Returns:
        A :class:`SavedActivations`: ``print()`` it, or ``save_json`` it.

    Example:
        >>> print(nv.saved_activations(step, (x, y), policy=nv.policies.save_matmuls))
    """
    _trial.check_step(step)
    _trial.check_batch(batch)
    policy = _policies.check_policy(policy)
    _validate.check_bool(measure, "measure")
    model, loss_fn = step.model, step.loss_fn
    blocks = find_layers(model, layers)
    args = _trial.as_batch(batch)
    names = {id(m): p for p, m in model.named_modules()}
    reports = []
    with nv_nn.restoring(blocks):
        for b in blocks:  # the unchecked blocks are what is exported
            nv_nn.checkpoint_module(b, enable=False)
        calls = _first_calls(model, loss_fn, args, blocks)
        for j, (b, (a, k)) in enumerate(zip(blocks, calls, strict=True)):
            try:
                unchecked, out_bytes, error = *_export(b, a, k), None
            except (ValueError, RuntimeError) as e:
                unchecked, error = None, str(e).splitlines()[0]
                out_bytes = sum(o.nbytes for _, o in _pytree.flatten(b(*a, **k)) if isinstance(o, mx.array))
            reports.append(
                BlockReport(
                    j,
                    names.get(id(b), f"block {j}"),
                    type(b).__name__,
                    out_bytes,
                    unchecked,
                    _kept(b, a, k, policy),
                    error,
                )
            )
    if measure:
        _measure(reports, step, batch, blocks, policy)
    return SavedActivations(reports, _policies.name_of(policy or save_nothing))


def _measure(
    reports: list[BlockReport], step: TrainingStep, batch: Any, blocks: Sequence[nn.Module], policy: Policy | None
) -> None:
    """Fill in what each block kept between its forward stages, measured, in both modes."""
    trial = _trial.Trial(step, blocks)
    with trial.restoring():
        for mode, field in ((save_everything, "measured_unchecked"), (policy, "measured_checkpointed")):
            trial.set_modes([mode] * len(blocks))
            reading = trial.measure(batch)[-1]
            held = [reading.start] + [r.active for r in reading.stages if r.kind == "forward"]
            for j, r in enumerate(reports):
                setattr(r, field, held[j + 1] - held[j])
