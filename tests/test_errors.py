"""A catalogue of misuses: each raises a TypeError or ValueError naming the argument."""

import json
import math
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx_lm.tuner.trainer import TrainingArgs

import nuvec_mlx as nv
from nuvec_mlx import mlx_lm as nvlm

a = mx.ones((2,))
i = mx.array([1], dtype=mx.int32)
LINEAR = nn.Linear(2, 2)  # made once: building a module draws from the random key the catalogue checks
BLOCKS = nn.Sequential(nn.Linear(2, 2))  # a model with its blocks in model.layers
IN_CHUNKS = nv.checkpoint_module(nn.Linear(2, 2), chunk=8)


def total(xs):
    return xs[0].sum()


def changes_shape_when_recomputed():
    calls = []

    def fn(xs):
        calls.append(1)
        return [xs[0] * 2] if len(calls) == 1 else [xs[0][:1]]

    return nv.checkpoint_flat(fn)


def counts_calls():
    calls = []

    def fn(x):
        calls.append(1)
        return [x * 2, len(calls)]

    return fn


def enter(context_manager):
    with context_manager:
        pass


TWO_BLOCKS = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))  # BLOCKS's block, and one more


def plan_of_blocks():
    """A plan of BLOCKS (one block, in model.layers), for any budget."""
    return nv.plan(nv.TrainingStep(BLOCKS, lambda m, x: m(x).sum()), a[None], 1 << 40, progress=False)


def saved_without_made_for():
    """A plan saved as plans were before they recorded what they were made for."""
    path = Path(tempfile.mkdtemp()) / "old.json"
    saved = plan_of_blocks().to_dict()
    del saved["made_for"]
    path.write_text(json.dumps(saved))
    return path


CATALOGUE = [
    # compile_flat
    ("compile_flat: fn not callable", lambda: nv.compile_flat(3), TypeError, r"^fn must be callable, got int$"),
    (
        "compiled step: xs is a bare array",
        lambda: nv.compile_flat(lambda xs: xs)(a),
        TypeError,
        r"^xs must be a list or tuple of mlx.core.array, got array$",
    ),
    (
        "compiled step: xs holds a float",
        lambda: nv.compile_flat(lambda xs: xs)([1.0]),
        TypeError,
        r"^xs\[0\] must be an mlx.core.array, got float$",
    ),
    (
        "compiled step: fn returns a bare array",
        lambda: nv.compile_flat(lambda xs: xs[0])([a]),
        TypeError,
        r"value returned by fn \(.*\) must be a list or tuple of mlx.core.array, got array",
    ),
    # compile
    ("compile: fun not callable", lambda: nv.compile(3), TypeError, r"^fun must be callable, got int$"),
    (
        "compile: shapeless not a bool",
        lambda: nv.compile(total, shapeless="yes"),
        TypeError,
        r"^shapeless must be a bool, got str$",
    ),
    # value_and_grad
    (
        "value_and_grad: model not a module",
        lambda: nv.value_and_grad(total, total),
        TypeError,
        r"^model must be an mlx.nn.Module, got function$",
    ),
    (
        "value_and_grad: fn not callable",
        lambda: nv.value_and_grad(LINEAR, None),
        TypeError,
        r"^fn must be callable, got NoneType$",
    ),
    # value_and_grad_flat
    (
        "value_and_grad_flat: loss not callable",
        lambda: nv.value_and_grad_flat(None, 0),
        TypeError,
        r"^loss must be callable, got NoneType$",
    ),
    (
        "value_and_grad_flat: argnums a string",
        lambda: nv.value_and_grad_flat(total, "0"),
        TypeError,
        r"^argnums must be an int or a sequence of ints, got str$",
    ),
    (
        "value_and_grad_flat: argnums empty",
        lambda: nv.value_and_grad_flat(total, []),
        ValueError,
        r"^argnums must name at least one input, got an empty sequence$",
    ),
    (
        "value_and_grad_flat: argnums holds a float",
        lambda: nv.value_and_grad_flat(total, [0, 1.0]),
        TypeError,
        r"^argnums must hold ints, got float \(1.0\)$",
    ),
    (
        "value_and_grad_flat: argnums holds a bool",
        lambda: nv.value_and_grad_flat(total, True),
        TypeError,
        r"^argnums must hold ints, got bool \(True\)$",
    ),
    (
        "value_and_grad_flat: argnums repeated",
        lambda: nv.value_and_grad_flat(total, [1, 1]),
        ValueError,
        r"^argnums names an input more than once: \[1, 1\]$",
    ),
    (
        "value_and_grad_flat: argnums repeated by a negative index",
        lambda: nv.value_and_grad_flat(total, [0, -2])([a, a]),
        ValueError,
        r"^argnums names input 0 more than once: \[0, -2\]$",
    ),
    (
        "value_and_grad_flat: argnums out of range",
        lambda: nv.value_and_grad_flat(total, 2)([a, a]),
        ValueError,
        r"^argnums entry 2 is out of range for 2 inputs \(expected -2 <= i < 2\)$",
    ),
    (
        "value_and_grad_flat: xs empty",
        lambda: nv.value_and_grad_flat(lambda xs: mx.array(0.0), 0)([]),
        ValueError,
        r"^xs is empty, but argnums \[0\] selects inputs",
    ),
    (
        "value_and_grad_flat: argnums selects an int input",
        lambda: nv.value_and_grad_flat(total, 1)([a, i]),
        ValueError,
        r"^argnums selects xs\[1\] of dtype mlx.core.int32; gradients need a floating-point input$",
    ),
    (
        "value_and_grad_flat: xs a bare array",
        lambda: nv.value_and_grad_flat(total, 0)(a),
        TypeError,
        r"^xs must be a list or tuple of mlx.core.array, got array$",
    ),
    # grad_flat
    ("grad_flat: loss not callable", lambda: nv.grad_flat("f", 0), TypeError, r"^loss must be callable, got str$"),
    (
        "grad_flat: loss returns a vector",
        lambda: nv.grad_flat(lambda xs: xs[0], 0)([a]),
        ValueError,
        r"^loss \(.*\) must return a scalar \(shape \(\)\), got an array of shape \(2,\)$",
    ),
    (
        "grad_flat: loss returns a float",
        lambda: nv.grad_flat(lambda xs: 1.0, 0)([a]),
        TypeError,
        r"^loss \(.*\) must return a scalar mlx.core.array, got float$",
    ),
    # checkpoint_flat
    ("checkpoint_flat: fn not callable", lambda: nv.checkpoint_flat(3), TypeError, r"^fn must be callable, got int$"),
    (
        "checkpointed: xs a bare array",
        lambda: nv.checkpoint_flat(lambda xs: xs)(a),
        TypeError,
        r"^xs must be a list or tuple of mlx.core.array, got array$",
    ),
    (
        "checkpointed: fn returns a bare array",
        lambda: nv.checkpoint_flat(lambda xs: xs[0])([a]),
        TypeError,
        r"value returned by fn \(.*\) must be a list or tuple of mlx.core.array, got array$",
    ),
    (
        "checkpointed: fn returns a float",
        lambda: nv.checkpoint_flat(lambda xs: (1.0,))([a]),
        TypeError,
        r"value returned by fn \(.*\)\[0\] must be an mlx.core.array, got float$",
    ),
    (
        "checkpointed: fn returns other shapes when recomputed",
        lambda: nv.grad_flat(lambda xs: changes_shape_when_recomputed()(xs)[0].sum(), 0)([a]),
        ValueError,
        r"fn \(.*\) returned outputs .* when recomputed in the backward pass, but .* in the forward pass",
    ),
    # checkpoint
    ("checkpoint: fn not callable", lambda: nv.checkpoint(3), TypeError, r"^fn must be callable, got int$"),
    (
        "checkpointed: inside a shapeless compile",
        lambda: mx.compile(lambda x: nv.checkpoint(mx.sin)(x), shapeless=True)(a),
        ValueError,
        r"^checkpoint: fn \(.*\) is checkpointed inside mx.compile\(\.\.\., shapeless=True\), which MLX .* "
        r"cannot do: .* Compile with shapeless=False \(one trace per input shape\)$",
    ),
    (
        "checkpointed: fn returns other non-array outputs when recomputed",
        lambda: mx.grad(lambda x: nv.checkpoint(counts_calls())(x)[0].sum())(a),
        ValueError,
        r"^checkpoint: fn \(.*\) returned \[<array>, 2\] when recomputed in the backward pass, "
        r"but \[<array>, 1\] in the forward pass; its outputs that are not arrays must be equal",
    ),
    # checkpoint_module, is_checkpointed
    (
        "checkpoint_module: not a module",
        lambda: nv.checkpoint_module(lambda x: x),
        TypeError,
        r"^module must be an mlx.nn.Module, got function$",
    ),
    (
        "checkpoint_module: a module without __call__",
        lambda: nv.checkpoint_module(nn.Module()),
        TypeError,
        r"^module \(Module\) has no __call__, so nothing calls it through a checkpoint; ",
    ),
    (
        "checkpoint_layers: a block without __call__",
        lambda: nv.checkpoint_layers(nn.Sequential(nn.Module())),
        TypeError,
        r"^layers\[0\] \(Module\) has no __call__, so nothing calls it through a checkpoint; ",
    ),
    (
        "checkpoint_module: enable not a bool",
        lambda: nv.checkpoint_module(LINEAR, enable="no"),
        TypeError,
        r"^enable must be a bool, got str$",
    ),
    (
        "is_checkpointed: not a module",
        lambda: nv.is_checkpointed(3),
        TypeError,
        r"^module must be an mlx.nn.Module, got int$",
    ),
    # checkpoint_layers
    (
        "checkpoint_layers: model not a module",
        lambda: nv.checkpoint_layers([LINEAR]),
        TypeError,
        r"^model must be an mlx.nn.Module, got list$",
    ),
    (
        "checkpoint_layers: every a float",
        lambda: nv.checkpoint_layers(nn.Sequential(), every=1.0),
        TypeError,
        r"^every must be an int, got float \(1.0\)$",
    ),
    (
        "checkpoint_layers: every zero",
        lambda: nv.checkpoint_layers(nn.Sequential(), every=0),
        ValueError,
        r"^every must be >= 1, got 0$",
    ),
    (
        "checkpoint_layers: no layers to find",
        lambda: nv.checkpoint_layers(LINEAR),
        ValueError,
        r"^layers=None expects model.layers or model.model.layers",
    ),
    (
        "checkpoint_layers: layers of another kind",
        lambda: nv.checkpoint_layers(LINEAR, layers="all"),
        TypeError,
        r"^layers must be None, a list of modules or a predicate, got str$",
    ),
    (
        "checkpoint_layers: a layer not a module",
        lambda: nv.checkpoint_layers(LINEAR, layers=[LINEAR, 3]),
        TypeError,
        r"^layers\[1\] must be an mlx.nn.Module, got int$",
    ),
    # checkpoint_sequential
    (
        "checkpoint_sequential: layers not a sequence",
        lambda: nv.checkpoint_sequential(LINEAR),
        TypeError,
        r"^layers must be an nn.Sequential or a list or tuple of layers, got Linear$",
    ),
    (
        "checkpoint_sequential: no layers",
        lambda: nv.checkpoint_sequential([]),
        ValueError,
        r"^layers must hold at least one layer, got none$",
    ),
    (
        "checkpoint_sequential: a layer not callable",
        lambda: nv.checkpoint_sequential([LINEAR, 3]),
        TypeError,
        r"^layers\[1\] must be callable, got int$",
    ),
    (
        "checkpoint_sequential: segments a float",
        lambda: nv.checkpoint_sequential([LINEAR], 1.0),
        TypeError,
        r"^segments must be an int, got float \(1.0\)$",
    ),
    (
        "checkpoint_sequential: segments an unknown word",
        lambda: nv.checkpoint_sequential([LINEAR], "log"),
        ValueError,
        r"^segments must be 'sqrt' or an int, got 'log'$",
    ),
    (
        "checkpoint_sequential: more segments than layers",
        lambda: nv.checkpoint_sequential([LINEAR], 2),
        ValueError,
        r"^segments must be at most the 1 layers, got 2$",
    ),
    # eval (it takes whatever mx.eval takes: only its throttle, ahead and synchronize can be wrong)
    ("eval: throttle negative", lambda: nv.eval(a, throttle=-1), ValueError, r"^throttle must be >= 0 bytes, got -1$"),
    (
        "eval: throttle a fraction",
        lambda: nv.eval(a, throttle=1.5),
        TypeError,
        r"^throttle must be an int number of bytes or math.inf, got float \(1.5\)$",
    ),
    (
        "eval: throttle nan",
        lambda: nv.eval(a, throttle=math.nan),
        TypeError,
        r"^throttle must be an int number of bytes or math.inf, got float \(nan\)$",
    ),
    (
        "eval: throttle -inf",
        lambda: nv.eval(a, throttle=-math.inf),
        TypeError,
        r"^throttle must be an int number of bytes or math.inf, got float \(-inf\)$",
    ),
    ("eval: ahead negative", lambda: nv.eval(a, ahead=-1), ValueError, r"^ahead must be >= 0, got -1$"),
    ("eval: ahead a bool", lambda: nv.eval(a, ahead=True), TypeError, r"^ahead must be an int, got bool \(True\)$"),
    (
        "eval: synchronize not a bool",
        lambda: nv.eval(a, synchronize=1),
        TypeError,
        r"^synchronize must be a bool, got int$",
    ),
    # memory
    (
        "memory.throttle: negative",
        lambda: enter(nv.memory.throttle(-5)),
        ValueError,
        r"^nbytes must be >= 0 bytes, got -5$",
    ),
    (
        "memory.throttle: a string",
        lambda: enter(nv.memory.throttle("1MB")),
        TypeError,
        r"^nbytes must be an int number of bytes or math.inf, got str \('1MB'\)$",
    ),
    (
        "memory.throttle: a bool",
        lambda: enter(nv.memory.throttle(True)),
        TypeError,
        r"^nbytes must be an int number of bytes or math.inf, got bool \(True\)$",
    ),
    (
        "memory.measure: clear_cache not a bool",
        lambda: enter(nv.memory.measure(clear_cache="yes")),
        TypeError,
        r"^clear_cache must be a bool, got str$",
    ),
    (
        "memory.all_stats: group not a Group",
        lambda: nv.memory.all_stats(group=0),
        TypeError,
        r"^group must be an mlx.core.distributed.Group or None, got int$",
    ),
    (
        "memory.stats: an argument",
        lambda: nv.memory.stats(True),
        TypeError,
        r"stats\(\) takes 0 positional arguments but 1 was given$",
    ),
    (
        "memory.reset_peak: an argument",
        lambda: nv.memory.reset_peak(0),
        TypeError,
        r"reset_peak\(\) takes 0 positional arguments but 1 was given$",
    ),
    (
        "memory.current_throttle: staged not a bool",
        lambda: nv.memory.current_throttle(0),
        TypeError,
        r"^staged must be a bool, got int$",
    ),
    (
        "memory.ceiling: a string",
        lambda: enter(nv.memory.ceiling("12GB")),
        TypeError,
        r"^nbytes must be an int, got str \('12GB'\)$",
    ),
    ("memory.ceiling: negative", lambda: enter(nv.memory.ceiling(-1)), ValueError, r"^nbytes must be >= 0, got -1$"),
    (
        "memory.timeline: an argument",
        lambda: enter(nv.memory.timeline(1)),
        TypeError,
        r"timeline\(\) takes 0 positional arguments but 1 was given$",
    ),
    # mlx_lm
    (
        "mlx_lm.train: args not TrainingArgs",
        lambda: nvlm.train(LINEAR, optim.Adam(1e-3), [], args={}),
        TypeError,
        r"^args must be an mlx_lm.tuner.trainer.TrainingArgs, got dict$",
    ),
    (
        "default_ahead: device a string",
        lambda: nv.default_ahead("gpu"),
        TypeError,
        r"^device must be an mlx.core.Device, a device type or None, got str$",
    ),
    (
        "mlx_lm.train: ahead negative",
        lambda: nvlm.train(LINEAR, optim.Adam(1e-3), [], ahead=-1),
        ValueError,
        r"^ahead must be >= 0, got -1$",
    ),
    (
        "mlx_lm.train: grad_accumulation_steps zero",
        lambda: nvlm.train(LINEAR, optim.Adam(1e-3), [], args=TrainingArgs(grad_accumulation_steps=0)),
        ValueError,
        r"^grad_accumulation_steps must be >= 1, got 0$",
    ),
    (
        "chunking.feed_forwards: block not a module",
        lambda: nv.chunking.feed_forwards([LINEAR]),
        TypeError,
        r"^block must be an mlx.nn.Module, got list$",
    ),
    (
        "chunking.projections: block not a module",
        lambda: nv.chunking.projections("block"),
        TypeError,
        r"^block must be an mlx.nn.Module, got str$",
    ),
    (
        "mlx_lm.checkpointed_blocks: chunks not Chunks",
        lambda: enter(nvlm.checkpointed_blocks(BLOCKS, {"mlp": 8})),
        TypeError,
        r"^chunks must be an nv.Chunks or None, got dict$",
    ),
    (
        "mlx_lm.checkpointed_blocks: no model.layers",
        lambda: enter(nvlm.checkpointed_blocks(LINEAR)),
        ValueError,
        r"^model must have its blocks in model.layers \(a list, as mlx-lm's models have\)$",
    ),
    (
        "mlx_lm.checkpointed_blocks: no model.layers",
        lambda: enter(nvlm.checkpointed_blocks(LINEAR)),
        ValueError,
        r"^model must have its blocks in model.layers \(a list, as mlx-lm's models have\)$",
    ),
    ("mlx_lm.main: argv a string", lambda: nvlm.main("--train"), TypeError, r"^argv must be a list of str, got str$"),
    (
        "memory.ceiling: a fraction",
        lambda: enter(nv.memory.ceiling(1.5)),
        TypeError,
        r"^nbytes must be an int, got float \(1.5\)$",
    ),
    (
        "memory.timeline: the peak of an empty timeline",
        lambda: nv.memory.Timeline().peak(),
        ValueError,
        r"^the timeline holds no readings: no nv.eval ran inside it$",
    ),
    # policies, checkpoint_name
    (
        "checkpoint_name: x not an array",
        lambda: nv.checkpoint_name(1.0, "h"),
        TypeError,
        r"^x must be an mlx.core.array or a function, got float$",
    ),
    (
        "checkpoint_name: an empty name",
        lambda: nv.checkpoint_name(a, ""),
        ValueError,
        r"^name must be a non-empty str, got ''$",
    ),
    (
        "checkpoint_name: a name not a str",
        lambda: nv.checkpoint_name(a, 3),
        TypeError,
        r"^name must be a str, got int$",
    ),
    (
        "policies.save_names: a name not a str",
        lambda: nv.policies.save_names("a", 3),
        TypeError,
        r"^names\[1\] must be a str, got int$",
    ),
    (
        "checkpoint_flat: policy not callable",
        lambda: nv.checkpoint_flat(total, policy="matmuls"),
        TypeError,
        r"^policy must be a function of a nuvec_mlx.policies.Saveable \(or None\), got str$",
    ),
    (
        "checkpoint: policy not callable",
        lambda: nv.checkpoint(total, policy=1),
        TypeError,
        r"^policy must be a function of a nuvec_mlx.policies.Saveable \(or None\), got int$",
    ),
    (
        "checkpoint_module: policy not callable",
        lambda: nv.checkpoint_module(LINEAR, policy=[]),
        TypeError,
        r"^policy must be a function .*, got list$",
    ),
    # checkpoint_chunks
    (
        "checkpoint_chunks: fn returns no array",
        lambda: nv.checkpoint_chunks(lambda x: None, size=1)(a[None]),
        ValueError,
        r"^checkpoint_chunks: fn \(<lambda>.<locals>.<lambda>\) returned no array: it must return an array, or a list, "
        r"tuple or dict of arrays, whose chunks are concatenated or summed$",
    ),
    (
        "checkpoint_chunks: size zero",
        lambda: nv.checkpoint_chunks(total, size=0),
        ValueError,
        r"^size must be >= 1, got 0$",
    ),
    (
        "checkpoint_chunks: in_axes a string",
        lambda: nv.checkpoint_chunks(total, size=2, in_axes="tokens"),
        TypeError,
        r"^in_axes must be an int, None, or a list of them, got 'tokens'$",
    ),
    (
        "checkpoint_chunks: out_axes None",
        lambda: nv.checkpoint_chunks(total, size=2, out_axes=[None]),
        TypeError,
        r"^out_axes must be an int, 'sum', or a list of them, got None$",
    ),
    (
        "checkpoint_chunks: an axis out of range",
        lambda: nv.checkpoint_chunks(lambda x: x, size=2, in_axes=3)(a),
        ValueError,
        r"^in_axes 3 is out of range for an argument of shape \(2,\)$",
    ),
    (
        "checkpoint_chunks: split inputs of two lengths",
        lambda: nv.checkpoint_chunks(lambda x, y: x, size=2, in_axes=0)(a, mx.ones((3,))),
        ValueError,
        r"^checkpoint_chunks: the inputs split into chunks must have one length along their axes",
    ),
    (
        "checkpoint_chunks: captured misspelt",
        lambda: nv.checkpoint_chunks(total, size=2, captured="const"),
        ValueError,
        r"^captured must be 'differentiate' or 'constant', got 'const'$",
    ),
    (
        "checkpoint_chunks: slice_arg not a name",
        lambda: nv.checkpoint_chunks(total, size=2, slice_arg="a b"),
        ValueError,
        r"^slice_arg must be None or a keyword argument's name, got 'a b'$",
    ),
    (
        "scan: fn not callable",
        lambda: nv.scan(None, a, a[None], chunk=1, axis=1),
        TypeError,
        r"^fn must be callable, got NoneType$",
    ),
    (
        "scan: chunk zero",
        lambda: nv.scan(lambda s, x: (s, x), a, a[None, :, None], chunk=0),
        ValueError,
        r"^chunk must be >= 1, got 0$",
    ),
    (
        "Chunks: attention a string",
        lambda: nv.Chunks(attention="on"),
        TypeError,
        r"^attention must be 'auto', None or an int chunk size, got 'on'$",
    ),
    (
        "Chunks: mlp zero",
        lambda: nv.Chunks(mlp=0),
        ValueError,
        r"^mlp must be >= 1, got 0$",
    ),
    (
        "chunk_layers: model not a module",
        lambda: nv.chunk_layers([LINEAR]),
        TypeError,
        r"^model must be an mlx.nn.Module, got list$",
    ),
    (
        "chunk_layers: chunks not Chunks",
        lambda: nv.chunk_layers(BLOCKS, "auto"),
        TypeError,
        r"^chunks must be an nv.Chunks or None, got str$",
    ),
    (
        "scaled_dot_product_attention: chunk a float",
        lambda: nv.scaled_dot_product_attention(
            a[None, None, None], a[None, None, None], a[None, None, None], scale=1.0, chunk=1.5
        ),  # fmt: skip
        TypeError,
        r"^chunk must be 'auto', None or an int chunk size, got 1.5$",
    ),
    (
        "checkpoint_module: chunk with a policy",
        lambda: nv.checkpoint_module(LINEAR, policy=nv.policies.save_matmuls, chunk=8),
        ValueError,
        r"^chunk must be None with a policy: a policy keeps values of a whole module's forward pass$",
    ),
    (
        "checkpoint_module: chunk of 0",
        lambda: nv.checkpoint_module(LINEAR, chunk=0),
        ValueError,
        r"^chunk must be >= 1, got 0$",
    ),
    (
        "a module in chunks called on a vector",
        lambda: IN_CHUNKS(a),
        ValueError,
        r"^a module checkpointed in chunks \(Linear.__call__\) splits its first positional argument along axis 1 "
        r"\(tokens of batch x tokens x features\): it must be an array of 2 or more dimensions, got shape \(2,\)$",
    ),
    (
        "checkpoint_chunks: lazy_in_recompute not a bool",
        lambda: nv.checkpoint_chunks(total, size=2, lazy_in_recompute=1),
        TypeError,
        r"^lazy_in_recompute must be a bool, got int$",
    ),
    (
        "checkpoint: captured misspelt",
        lambda: nv.checkpoint(total, captured="zero"),
        ValueError,
        r"^captured must be 'differentiate' or 'constant', got 'zero'$",
    ),
    # losses
    (
        "losses.cross_entropy: head not callable",
        lambda: nv.losses.cross_entropy(3, mx.ones((1, 2, 2)), i[None]),
        TypeError,
        r"^head must be callable, got int$",
    ),
    (
        "losses.cross_entropy: hidden of two dimensions",
        lambda: nv.losses.cross_entropy(LINEAR, mx.ones((2, 2)), i[None]),
        TypeError,
        r"^hidden must be an mlx.core.array of 3 dimensions, got shape \(2, 2\)$",
    ),
    (
        "losses.cross_entropy: weights of another shape",
        lambda: nv.losses.cross_entropy(LINEAR, mx.ones((1, 1, 2)), i[None], weights=mx.ones((2, 2))),
        ValueError,
        r"^weights must be None or an array of targets' shape \(1, 1\), got shape \(2, 2\)$",
    ),
    (
        "losses.cross_entropy: reduction misspelt",
        lambda: nv.losses.cross_entropy(LINEAR, mx.ones((1, 1, 2)), i[None], reduction="avg"),
        ValueError,
        r"^reduction must be 'mean', 'sum' or 'none', got 'avg'$",
    ),
    (
        "losses.cross_entropy: chunk zero",
        lambda: nv.losses.cross_entropy(LINEAR, mx.ones((1, 1, 2)), i[None], chunk=0),
        ValueError,
        r"^chunk must be >= 1, got 0$",
    ),
    (
        "losses.cross_entropy: float targets",
        lambda: nv.losses.cross_entropy(LINEAR, mx.ones((1, 1, 2)), mx.ones((1, 1))),
        TypeError,
        r"^targets must be an array of integer token ids, got dtype mlx.core.float32$",
    ),
    (
        "losses.cross_entropy: targets of another length",
        lambda: nv.losses.cross_entropy(LINEAR, mx.ones((1, 2, 2)), i[None]),
        ValueError,
        r"^targets must have hidden's batch and tokens \(1, 2\), got shape \(1, 1\)$",
    ),
    (
        "losses.cross_entropy: no token",
        lambda: nv.losses.cross_entropy(LINEAR, mx.ones((1, 0, 2)), mx.ones((1, 0), dtype=mx.int32)),
        ValueError,
        r"^hidden must hold at least one token, got a sequence of 0 tokens$",
    ),
    (
        "chunking.mlp_tokens: width a float",
        lambda: nv.chunking.mlp_tokens(8, 4, 2.0),
        TypeError,
        r"^width must be an int, got float \(2.0\)$",
    ),
    (
        "chunking.head_tokens: vocabulary zero",
        lambda: nv.chunking.head_tokens(8, 4, 0),
        ValueError,
        r"^vocabulary must be >= 1, got 0$",
    ),
    (
        "mlx_lm.chunked_loss: chunk a float",
        lambda: nvlm.chunked_loss(LINEAR, mx.ones((1, 3), dtype=mx.int32), mx.array([[0, 2]]), chunk=1.5),
        TypeError,
        r"^chunk must be an int, got float \(1.5\)$",
    ),
    (
        "mlx_lm.train: chunks a string",
        lambda: nvlm.train(LINEAR, optim.Adam(1e-3), [], args=TrainingArgs(grad_checkpoint=True), chunks="big"),
        TypeError,
        r"^chunks must be an nv.Chunks or None, got str$",
    ),
    # TrainingStep
    (
        "TrainingStep: model not a module",
        lambda: nv.TrainingStep(total, total),
        TypeError,
        r"^model must be an mlx.nn.Module, got function$",
    ),
    (
        "TrainingStep: the loss not a scalar",
        lambda: nv.TrainingStep(LINEAR, lambda m, x: m(x), optim.SGD(0.1))(mx.ones((1, 2))),
        ValueError,
        r"^loss \(<lambda>.<locals>.<lambda>\) must return a scalar \(shape \(\)\), got an array of shape \(1, 2\)$",
    ),
    (
        "TrainingStep: loss_fn not callable",
        lambda: nv.TrainingStep(LINEAR, None),
        TypeError,
        r"^loss_fn must be callable, got NoneType$",
    ),
    (
        "TrainingStep: optimizer not an optimizer",
        lambda: nv.TrainingStep(LINEAR, total, "adam"),
        TypeError,
        r"^optimizer must be an mlx.optimizers.Optimizer or None, got str$",
    ),
    (
        "TrainingStep: synchronize not a bool",
        lambda: nv.TrainingStep(LINEAR, total, synchronize="yes"),
        TypeError,
        r"^synchronize must be a bool, got str$",
    ),
    (
        "TrainingStep: ahead negative",
        lambda: nv.TrainingStep(LINEAR, total, ahead=-1),
        ValueError,
        r"^ahead must be >= 0, got -1$",
    ),
    (
        "TrainingStep: throttle a string",
        lambda: nv.TrainingStep(LINEAR, total, throttle="1MB"),
        TypeError,
        r"^throttle must be an int number of bytes or math.inf, got str \('1MB'\)$",
    ),
    (
        "TrainingStep: accumulate zero",
        lambda: nv.TrainingStep(LINEAR, total, optim.SGD(0.1), accumulate=0),
        ValueError,
        r"^accumulate must be >= 1, got 0$",
    ),
    (
        "TrainingStep: accumulate without an optimizer",
        lambda: nv.TrainingStep(LINEAR, total, accumulate=2),
        ValueError,
        r"^accumulate must be 1 without an optimizer \(nothing to update\), got 2$",
    ),
    (
        "TrainingStep: compile not a bool",
        lambda: nv.TrainingStep(LINEAR, total, compile=1),
        TypeError,
        r"^compile must be a bool, got int$",
    ),
    (
        "TrainingStep: replace an unknown setting",
        lambda: nv.TrainingStep(LINEAR, total).replace(budget=1),
        TypeError,
        r"^replace\(\) takes the step's settings .*, got \['budget'\]$",
    ),
    # plan, Planner
    (
        "plan: step not a TrainingStep",
        lambda: nv.plan(total, a, 1 << 20),
        TypeError,
        r"^step must be an nv.TrainingStep, got function$",
    ),
    (
        "plan: batch holds no array",
        lambda: nv.plan(nv.TrainingStep(LINEAR, total), [1.0, 2.0], 1 << 20),
        TypeError,
        r"^batch must be an mlx.core.array or a tuple of the loss's arguments holding arrays, got list$",
    ),
    (
        "plan: budget zero",
        lambda: nv.plan(nv.TrainingStep(LINEAR, total), a, 0),
        ValueError,
        r"^budget must be >= 1, got 0$",
    ),
    (
        "plan: budget a float",
        lambda: nv.plan(nv.TrainingStep(LINEAR, total), a, 1e9),
        TypeError,
        r"^budget must be an int, got float \(1000000000.0\)$",
    ),
    (
        "plan: no policies",
        lambda: nv.plan(nv.TrainingStep(LINEAR, total), a, 1 << 20, policies=[]),
        ValueError,
        r"^policies must name at least one checkpoint policy, got none$",
    ),
    (
        "plan: policies a string",
        lambda: nv.plan(nv.TrainingStep(LINEAR, total), a, 1 << 20, policies="save_matmuls"),
        TypeError,
        r"^policies must be a sequence of checkpoint policies, got str$",
    ),
    (
        "plan: corrections negative",
        lambda: nv.plan(nv.TrainingStep(LINEAR, total), a, 1 << 20, corrections=-1),
        ValueError,
        r"^corrections must be >= 0, got -1$",
    ),
    (
        "plan: a model without blocks",
        lambda: nv.plan(nv.TrainingStep(LINEAR, total), a, 1 << 20),
        ValueError,
        r"^layers=None expects model.layers or model.model.layers",
    ),
    (
        "Planner: step not a TrainingStep",
        lambda: nv.Planner(LINEAR, a),
        TypeError,
        r"^step must be an nv.TrainingStep, got Linear$",
    ),
    (
        "Planner: progress not a bool",
        lambda: nv.Planner(nv.TrainingStep(LINEAR, total), a, progress=1),
        TypeError,
        r"^progress must be a bool, got int$",
    ),
    (
        "Plan.apply: a model whose blocks differ from those it was made for",
        lambda: plan_of_blocks().apply(TWO_BLOCKS),
        ValueError,
        r"^the plan was made for a model with 1 block in model.layers \(1 planned: layers.0\); this model has 2 "
        r"blocks in model.layers: plan again for this model$",
    ),
    (
        "Plan.load_json: a plan saved without what it was made for",
        lambda: nv.Plan.load_json(saved_without_made_for()),
        ValueError,
        r"^.*old.json: the plan does not record what it was made for \(the model, its blocks, the batch, the dtype\)",
    ),
    # largest_fit
    (
        "largest_fit: make_batch not callable",
        lambda: nv.largest_fit(nv.TrainingStep(LINEAR, total), 4, 1 << 20),
        TypeError,
        r"^make_batch must be callable, got int$",
    ),
    (
        "largest_fit: one size",
        lambda: nv.largest_fit(nv.TrainingStep(LINEAR, total), total, 1 << 20, sizes=(4,)),
        ValueError,
        r"^sizes must hold at least two increasing sizes, got \[4\]$",
    ),
    (
        "largest_fit: multiple zero",
        lambda: nv.largest_fit(nv.TrainingStep(LINEAR, total), total, 1 << 20, multiple=0),
        ValueError,
        r"^multiple must be >= 1, got 0$",
    ),
    (
        "largest_fit: tolerance above 1",
        lambda: nv.largest_fit(nv.TrainingStep(LINEAR, total), total, 1 << 20, tolerance=2),
        ValueError,
        r"^tolerance must be a number between 0 and 1, got 2$",
    ),
    # update
    (
        "update: optimizer not an optimizer",
        lambda: nv.update(LINEAR, LINEAR, {}),
        TypeError,
        r"^optimizer must be an mlx.optimizers.Optimizer, got Linear$",
    ),
    (
        "update: model not a module",
        lambda: nv.update(optim.SGD(0.1), 3, {}),
        TypeError,
        r"^model must be an mlx.nn.Module, got int$",
    ),
    # saved_activations
    (
        "saved_activations: step not a TrainingStep",
        lambda: nv.saved_activations(3, a),
        TypeError,
        r"^step must be an nv.TrainingStep, got int$",
    ),
    (
        "saved_activations: batch holds no array",
        lambda: nv.saved_activations(nv.TrainingStep(LINEAR, total), 3),
        TypeError,
        r"^batch must be an mlx.core.array or a tuple of the loss's arguments holding arrays, got int$",
    ),
    (
        "saved_activations: policy not callable",
        lambda: nv.saved_activations(nv.TrainingStep(LINEAR, total), a, policy=2),
        TypeError,
        r"^policy must be a function .*, got int$",
    ),
]


@pytest.mark.parametrize("misuse, error, match", [c[1:] for c in CATALOGUE], ids=[c[0] for c in CATALOGUE])
def test_misuse_raises_a_precise_error(misuse, error, match):
    with pytest.raises(error, match=match) as info:
        misuse()
    assert type(info.value) is error


PUBLIC = [
    *(
        n
        for n in nv.__all__
        if n
        not in (
            "memory",
            "policies",
            "losses",
            "Compiled",
            "CompiledFlat",
            "Fit",
            "Plan",
            "SavedActivations",
            "NotStagedWarning",
            "chunking",
        )
    ),
    *(f"chunking.{n}" for n in ("feed_forwards", "head_tokens", "mlp_tokens", "projections")),
    *(f"memory.{n}" for n in nv.memory.__all__ if n[0].islower()),
    *(f"mlx_lm.{n}" for n in nvlm.__all__ if n[0].islower()),
    "losses.cross_entropy",
    "policies.save_names",
]


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_function_has_a_catalogue_entry(name):
    covered = {c[0].split(":")[0] for c in CATALOGUE}
    aliases = {"checkpointed": "checkpoint_flat", "compiled step": "compile_flat"}
    assert name in covered | {aliases.get(n, n) for n in covered}


def test_misuses_leave_the_throttle_memory_limit_device_and_random_key_as_they_were():
    def settings():
        return (
            mx.get_memory_limit(),
            nv.memory.current_throttle(),
            mx.default_device(),
            mx.default_stream(mx.cpu),
            mx.random.state[0].tolist(),
        )

    before = settings()
    for _, misuse, error, _ in CATALOGUE:
        with pytest.raises(error):
            misuse()
    assert settings() == before
