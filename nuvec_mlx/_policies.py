"""Checkpoint policies and the helpers that apply them; :mod:`nuvec_mlx.policies` is their public face.


A checkpoint keeps its block's inputs and recomputes everything else in the
backward pass. A *policy* keeps some forward values as well, and the
recomputation reuses them instead of computing them again: less recompute
work, more memory held between the forward and the backward pass. As in
JAX's ``jax.checkpoint_policies``, a policy is a plain function; it is asked
about each value the checkpoint can keep, described by a :class:`Saveable`,
and returns whether to keep it. Gradients are exact whatever it returns.

The values a checkpoint can keep (everything else is recomputed):

- ``"matmul"``: the output of every call of an ``mlx.nn.Linear`` or
  ``mlx.nn.QuantizedLinear`` layer (or a subclass) inside a checkpointed
  module (``checkpoint_module``, ``checkpoint_layers``) or inside a module
  that an ``nv.checkpoint`` function captures or that
  ``checkpoint_sequential`` runs. Bare ``x @ w``, ``mx.matmul``,
  ``mx.addmm``, ``mx.quantized_matmul``, mlx-lm's ``SwitchLinear`` and
  tied embeddings (``Embedding.as_linear``) are not intercepted: name
  the function that computes them with :func:`checkpoint_name` to keep them.
- ``"name"``: a value passed through :func:`checkpoint_name` inside the
  checkpointed function (also in ``checkpoint_flat`` functions), or the
  output of a function named with it, whose work is then spared.

:func:`save_everything` is the one policy recognised by identity: the block is
not recomputed at all (it keeps all it would keep unchecked), but its forward
and backward are still stages of :func:`nuvec_mlx.eval`, so that it is
evaluated block by block like its checkpointed neighbours. A policy of your own
that returns ``True`` for everything keeps every layer output and named value,
and still recomputes the rest.

Example:
    >>> nv.checkpoint_layers(model, policy=nv.policies.save_matmuls)
    >>> keep = lambda v: nv.policies.save_names("attn_out")(v) or v.name.endswith("up_proj")
    >>> nv.checkpoint_layers(model, policy=keep)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from . import _saving
from ._saving import Saveable

#: A policy: ``Saveable -> bool``.
Policy = Callable[[Saveable], bool]

MATMUL, NAME = _saving.MATMUL, _saving.NAME


def save_nothing(value: Saveable) -> bool:
    """Keep nothing: recompute the whole block (the default, as ``jax.checkpoint_policies.nothing_saveable``).

    Example:
        >>> nv.checkpoint_layers(model, policy=nv.policies.save_nothing)
    """
    return False


def save_matmuls(value: Saveable) -> bool:
    """Keep the outputs of ``nn.Linear`` and ``nn.QuantizedLinear`` layers; recompute the rest.

    The recomputation then runs the element-wise work (norms, activations,
    attention) and none of the layers' matrix multiplies (as
    ``jax.checkpoint_policies.dots_saveable``).

    Example:
        >>> nv.checkpoint_layers(model, policy=nv.policies.save_matmuls)
    """
    return value.kind == MATMUL


def save_everything(value: Saveable) -> bool:
    """Recompute nothing: the block keeps what it keeps unchecked, and stays a stage.

    Recognised by identity (see the module's description): the block runs
    unchecked, but its forward output and the gradients of its backward pass
    are stages of :func:`nuvec_mlx.eval`, and its gradients are finished
    together, so that a step mixing such blocks with checkpointed ones is
    still evaluated one block at a time (as ``jax.checkpoint_policies.everything_saveable``).

    Example:
        >>> nv.checkpoint_module(model.layers[-1], policy=nv.policies.save_everything)
    """
    return True


#: The policies known by name (what a saved plan and ``nuvec-mlx-plan --policies`` name).
NAMED: dict[str, Policy] = {p.__name__: p for p in (save_everything, save_matmuls, save_nothing)}


def save_names(*names: str) -> Policy:
    """A policy that keeps the values named with :func:`checkpoint_name` as one of ``names``.

    Args:
        names: the names to keep.

    Returns:
        The policy (as ``jax.checkpoint_policies.save_only_these_names``).

    Raises:
        ValueError: without names (a policy that keeps nothing is :func:`save_nothing`).

    Example:
        >>> nv.checkpoint_layers(model, policy=nv.policies.save_names("attn_out"))
    """
    if not names:
        raise ValueError("save_names needs at least one name: a policy that keeps nothing is nv.policies.save_nothing")
    for i, name in enumerate(names):
        _check_name(name, f"names[{i}]")
    wanted = frozenset(names)

    def policy(value: Saveable) -> bool:
        return value.kind == NAME and value.name in wanted

    policy.__qualname__ = f"save_names({', '.join(map(repr, names))})"
    return policy


def checkpoint_name(x: mx.array | Callable[..., Any], name: str) -> Any:
    """Name a value, or a function's outputs, inside a checkpointed function, so that a policy can keep it.

    Kept (by :func:`save_names`, or a policy of your own), the recomputation
    reads the value of the forward pass in its place, and the gradient flows
    through it as through the value. Outside a checkpoint, or when the policy
    does not keep it, nothing changes.

    Name the function that makes a value to spare its work: the recomputation
    then builds the function's vjp at its arguments and never computes the
    function itself (as :func:`save_matmuls` does for layers). A named value
    is reused, but what made it is still computed, because the kept value
    stands in for the recomputed one, which MLX computes first; it saves
    work only where what made it was needed anyway.

    Args:
        x: an array computed inside the checkpointed function, or a function
            of arrays (pytrees of them, other arguments static) whose output
            arrays are named at each call, for example
            ``mx.fast.scaled_dot_product_attention``.
        name: the name policies see (:attr:`Saveable.name`).

    Returns:
        For an array, ``x`` or the value kept from the forward pass while
        recomputing; for a function, the function that names its outputs.

    Example:
        >>> attention = nv.checkpoint_name(mx.fast.scaled_dot_product_attention, "attention")
        >>> def block(x, w):
        ...     q, k, v = mx.split((x @ w)[:, None], 3, axis=-1)
        ...     return attention(q, k, v, scale=1.0)[:, 0]
        >>> nv.checkpoint(block, policy=nv.policies.save_names("attention"))(x, w)
    """
    _check_name(name, "name")
    if isinstance(x, mx.array):
        return _saving.offer_name(x, name)
    if callable(x):
        return _saving.offering_calls(x, name)
    raise TypeError(f"x must be an mlx.core.array or a function, got {type(x).__name__}")


def _check_name(name: object, argument: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"{argument} must be a str, got {type(name).__name__}")
    if not name:
        raise ValueError(f"{argument} must be a non-empty str, got ''")


def name_of(policy: Callable) -> str:
    """A policy's name as plans and reports print it (``save_matmuls``, ``save_names('attn_out')``)."""
    return getattr(policy, "__qualname__", None) or repr(policy)


def check_policy(policy: object) -> Policy | None:
    """``policy`` if it is ``None`` or callable, else ``TypeError``; :func:`save_nothing` is ``None``."""
    if policy is None or policy is save_nothing:
        return None
    if not callable(policy):
        raise TypeError(
            f"policy must be a function of a nuvec_mlx.policies.Saveable (or None), got {type(policy).__name__}"
        )
    return policy


def recomputes_nothing(policy: Policy | None) -> bool:
    """Whether ``policy`` is :func:`save_everything`."""
    return policy is save_everything


def offering_layers(fn: Callable, policy: Policy | None) -> Callable:
    """``fn``, with the layers of the modules it reaches offering their outputs to ``policy`` while
    it runs (``fn`` itself when the policy keeps nothing or recomputes nothing)."""
    if policy is None or recomputes_nothing(policy):
        return fn
    return _saving.intercepting(fn)
