"""Work along the sequence in chunks: the settings, the rules that size them, and the transform of a model's blocks.

A checkpointed block keeps only its input between the forward and the
backward pass; its backward pass then recomputes the whole block at once, and
holds every activation of the block over the whole sequence. Four parts of a
language model's step grow with the sequence beyond that, and each splits
along it: the loss head (one chunk's logits at a time:
:func:`nuvec_mlx.losses.cross_entropy`), attention where MLX trains it unfused
(one chunk of queries' scores: :func:`nuvec_mlx.scaled_dot_product_attention`),
a block's MLP (one chunk of tokens' intermediates: a module checkpointed
in chunks, :func:`nuvec_mlx.checkpoint_module`) and attention's projections
(the same way: LoRA computes its products in float32, so each projection's
backward pass holds float32 copies of its input and output), and, where MLX
computes them unfused (the CPU), a block's norms (float32 copies too). :class:`Chunks` holds the
setting of each, :func:`chunk_layers` applies them to a model's blocks, and
the rules here size the ``"auto"`` settings from the sizes involved.

:func:`chunk_layers` changes the blocks it is given, one instance at a time,
and nothing else: an attention module's ``__call__`` sees the chunked
attention under the name it calls (mlx-lm's ``scaled_dot_product_attention``,
or ``mx.fast.scaled_dot_product_attention``) through its own globals
(:func:`nuvec_mlx.nn.reroute`), so that other modules, other threads and every
other caller of MLX's function are untouched; a block's MLP is checkpointed in
chunks. ``routes`` reroute further names the same way (the mlx-lm integration
routes its recurrences, ``gated_delta_update``, through its own chunked scan).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import _attention, _reroute, _validate
from . import nn as nv_nn

__all__ = [
    "AUTO",
    "FEED_FORWARD",
    "NORMS",
    "PROJECTIONS",
    "Chunks",
    "Setting",
    "attention_queries",
    "blocks_inputs",
    "chunk_layers",
    "feed_forwards",
    "head_tokens",
    "mlp_tokens",
    "norms",
    "projections",
    "whole_up_to",
]

#: A chunk setting: ``"auto"`` (sized by the rules here), a size in tokens, or ``None`` (never chunk).
Setting = int | str | None
AUTO = _attention.AUTO

#: The names blocks give their feed-forward modules (MLP, or mixture of experts; Gemma 4's experts beside its MLP),
#: which treat tokens independently: what the MLP setting checkpoints in chunks.
FEED_FORWARD = ("mlp", "feed_forward", "block_sparse_moe", "experts")

#: The names attention modules give their projections, which treat tokens independently: what the projections
#: setting checkpoints in chunks (mlx-lm's names; Phi-3 projects queries, keys and values at once).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")

#: The names mixtures of experts give their experts per token (mlx-lm's: Qwen3-MoE's and DeepSeek's router's
#: ``top_k``, Mixtral's and OLMoE's ``num_experts_per_tok``; in the configuration a module keeps as ``args`` or
#: ``config``, Kimi's ``num_experts_per_token``, ERNIE's ``moe_k`` and Gemma 4's ``top_k_experts``), which the MLP
#: setting's rule reads.
TOP_K = ("top_k", "num_experts_per_tok", "num_experts_per_token", "moe_k", "top_k_experts")

#: Where a module keeps its configuration (mlx-lm's ``ModelArgs``): read for :data:`TOP_K` too.
CONFIGS = ("args", "config")

#: The names blocks give their norms (mlx-lm's names; Gemma's four, and Gemma 4's three around its experts), which
#: treat tokens independently: what the norms setting checkpoints in chunks.
NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_1",
    "post_feedforward_layernorm_2",
)

#: The share of the blocks' inputs (every checkpointed block's input: what a checkpointed step keeps between
#: its forward and backward pass) that one chunk of a part may hold at its peak: the step's peak is then the
#: blocks' inputs, what a block's backward pass holds for the whole sequence, and one such share, at every length.
SHARE = 1 / 8
#: What each part holds at its peak per unit of its chunk, in bytes, measured on the CPU (bfloat16 LoRA, MLX
#: 0.32): the loss head per logit (a chunk's tokens x the vocabulary: its logits, their float32 softmax and
#: gradient), the MLP's backward per token x its width (float32 copies of its intermediates, LoRA's among them;
#: the rule sizes attention's projections alike), unfused attention per score (heads x queries x keys).
HEAD_BYTES, MLP_BYTES, SCORE_BYTES = 6, 34, 7
#: The loss head's default: ``ceil(vocabulary / (HEAD_RATIO x hidden))`` chunks at most (see :func:`head_tokens`).
HEAD_RATIO = 8
#: A chunk of the head has at least this many rows (batch x tokens), or the whole sequence: on fewer rows
#: each chunk's matrix products read the whole head weight for little work.
MIN_ROWS = 128
#: Where the blocks' inputs ask for smaller chunks of the head than :data:`HEAD_RATIO` gives, a chunk still has
#: this many rows: each chunk is two stages the device waits for.
HEAD_MIN_ROWS = 1024
#: A chunk of the MLP does at least this much work, rows x hidden x width multiply-adds, by backend: on a GPU
#: (CUDA, Metal) each chunk is a stage the device waits for, and narrow MLPs' chunks cost more time than their
#: memory is worth (no 1B model's MLP is chunked at batch 4 x 2048 tokens); on the CPU a stage costs nothing.
MLP_MIN_WORK = {"cpu": 1 << 26, "gpu": 1 << 37}
#: Unfused attention's queries per chunk are at least this many (and at most 4 x the head size).
ATTENTION_MIN = 64
#: The longest sequence :func:`whole_up_to` considers.
_LONGEST = 1 << 24


def check(setting: object, name: str) -> Setting:
    """``setting`` if it is ``"auto"``, ``None`` or a size in tokens (an int >= 1)."""
    return _attention.check(setting, name)


def blocks_inputs(tokens: int, hidden: int, batch: int = 1, blocks: int = 1, itemsize: int = 2) -> int:
    """The bytes of every checkpointed block's input: ``blocks`` x ``batch`` x ``tokens`` x ``hidden`` x ``itemsize``.

    Example:
        >>> nv.chunking.blocks_inputs(tokens=32768, hidden=4096, blocks=32) / 2**30
        8.0
    """
    _check_sizes(tokens=tokens, hidden=hidden, batch=batch, blocks=blocks, itemsize=itemsize)
    return blocks * batch * tokens * hidden * itemsize


def head_tokens(tokens: int, hidden: int, vocabulary: int, batch: int = 1, blocks: int = 1) -> int:
    """The loss head's tokens per chunk by default.

    At most ``ceil(vocabulary / (HEAD_RATIO x hidden))`` chunks' worth (one
    chunk's logits take at most :data:`HEAD_RATIO` times the bytes of all the
    hidden states), and small enough that a chunk holds at most :data:`SHARE`
    of the blocks' inputs (:data:`HEAD_BYTES` per logit), where that leaves a
    chunk :data:`HEAD_MIN_ROWS` rows: on long sequences the chunks then stop
    growing with them, so that the head's peak is a fixed share of what the
    blocks keep. A chunk has at least :data:`MIN_ROWS` rows, or the whole
    sequence.

    Args:
        tokens: the sequence length.
        hidden: the hidden size (the head's input).
        vocabulary: the head's outputs.
        batch: the batch size.
        blocks: the model's checkpointed blocks (1 where unknown).

    Returns:
        The tokens per chunk, at most ``tokens``.

    Example:
        >>> nv.chunking.head_tokens(tokens=2048, hidden=2048, vocabulary=128256, batch=4, blocks=16)
        256
        >>> nv.chunking.head_tokens(tokens=32768, hidden=4096, vocabulary=128256, blocks=32)
        1395
    """
    _check_sizes(tokens=tokens, hidden=hidden, vocabulary=vocabulary, batch=batch, blocks=blocks)
    count = math.ceil(vocabulary / (HEAD_RATIO * hidden))
    widest = max(math.ceil(tokens / count), math.ceil(MIN_ROWS / batch))
    share = int(SHARE * blocks_inputs(tokens, hidden, batch, blocks) // (HEAD_BYTES * vocabulary * batch))
    return min(tokens, widest, max(share, math.ceil(HEAD_MIN_ROWS / batch)))


def mlp_tokens(
    tokens: int, hidden: int, width: int, batch: int = 1, blocks: int = 1, backend: str = "gpu"
) -> int | None:
    """A block's MLP's tokens per chunk by default, or ``None`` to leave it whole.

    Chunks hold at most :data:`SHARE` of the blocks' inputs (:data:`MLP_BYTES`
    per token x ``width``, the MLP's widest layer), but do at least
    :data:`MLP_MIN_WORK` on ``backend``; an MLP whose whole sequence fits one
    such chunk is left whole.

    Args:
        tokens, hidden, width, batch, blocks: the sizes.
        backend: ``"cpu"`` or ``"gpu"`` (CUDA and Metal).

    Example:
        >>> nv.chunking.mlp_tokens(tokens=32768, hidden=4096, width=14336, blocks=32)
        2341
        >>> nv.chunking.mlp_tokens(tokens=2048, hidden=2048, width=8192, batch=4, blocks=16) is None
        True
    """
    _check_sizes(tokens=tokens, hidden=hidden, width=width, batch=batch, blocks=blocks)
    if backend not in MLP_MIN_WORK:
        raise ValueError(f"backend must be one of {', '.join(MLP_MIN_WORK)}, got {backend!r}")
    share = int(SHARE * blocks_inputs(tokens, hidden, batch, blocks) // (MLP_BYTES * width))
    rows = max(share, math.ceil(MLP_MIN_WORK[backend] / (hidden * width)))
    size = math.ceil(rows / batch)
    return None if size >= tokens else size


def attention_queries(q: mx.array, k: mx.array, blocks: int = 1, hidden: int | None = None) -> int:
    """Unfused attention's queries per chunk by default: 4 x the head size, fewer where a chunk's scores
    (:data:`SCORE_BYTES` each) would hold more than :data:`SHARE` of the blocks' inputs, at least
    :data:`ATTENTION_MIN`."""
    batch, heads, tokens, head = q.shape
    width = heads * head if hidden is None else hidden
    share = int(SHARE * blocks_inputs(tokens, width, batch, blocks) // (SCORE_BYTES * batch * heads * k.shape[2]))
    return max(min(4 * head, share), ATTENTION_MIN)


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        _validate.check_int(value, name, minimum=1)


@dataclasses.dataclass(frozen=True)
class Chunks:
    """How a step works along the sequence in chunks: each part's setting.

    Each is ``"auto"`` (the default: sized from the sizes involved by the rules
    of :mod:`nuvec_mlx.chunking`), a size in tokens, or ``None`` (never
    chunked).

    Attributes:
        head: the loss head's tokens per chunk (:func:`head_tokens`).
        attention: attention's queries per chunk; ``"auto"`` chunks where the
            backend trains attention unfused (the CPU, Metal), in chunks of
            :func:`attention_queries` (at most 4 x the head size), and fused
            attention past what MLX's fused backward takes, in fused chunks.
        mlp: a block's MLP's tokens per chunk (:func:`mlp_tokens`).
        scan: a recurrence's tokens per chunk (gated delta, state-space scans).
        projections: the tokens per chunk of attention's projections (a
            child named as in :data:`PROJECTIONS`); ``"auto"`` sizes each as
            :func:`mlp_tokens` sizes an MLP, of the projection's width or
            its input's, the wider.
        norms: the tokens per chunk of a block's norms (children named as
            in :data:`NORMS`); ``"auto"`` chunks them where MLX computes
            them unfused (the CPU, in float32), sized as :func:`mlp_tokens`
            sizes an MLP of the hidden width, and leaves the fused ones of
            CUDA and Metal whole.

    Example:
        >>> nv.chunk_layers(model, nv.Chunks(mlp=1024, attention=None))
    """

    head: Setting = AUTO
    attention: Setting = AUTO
    mlp: Setting = AUTO
    scan: Setting = AUTO
    projections: Setting = AUTO
    norms: Setting = AUTO

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check(getattr(self, field.name), field.name)

    @classmethod
    def of(cls, chunks: object) -> Chunks:
        """``chunks`` as a function's ``chunks`` argument takes it: ``None`` for ``Chunks()`` (every part
        ``"auto"``), else an instance, checked (``TypeError`` for anything else).

        Example:
            >>> Chunks.of(None) == Chunks()
            True
        """
        if chunks is None:
            return cls()
        if not isinstance(chunks, cls):
            raise TypeError(f"chunks must be an nv.Chunks or None, got {type(chunks).__name__}")
        return chunks

    @classmethod
    def from_settings(cls, **settings: object) -> Chunks:
        """Chunks from settings as a command line or a config file gives them: ``0`` is ``None`` (off),
        an absent or ``None`` setting the default.

        Example:
            >>> Chunks.from_settings(mlp=0, attention="auto", head=None)
            Chunks(head='auto', attention='auto', mlp=None, scan='auto', projections='auto', norms='auto')
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(settings) - names
        if unknown:
            raise TypeError(f"Chunks has the settings {sorted(names)}, got {sorted(unknown)}")
        given = {k: None if _is_off(v) else v for k, v in settings.items() if v is not None}
        return cls(**given)  # type: ignore[arg-type]


def _is_off(value: object) -> bool:
    return value == 0 and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class _TokenWise:
    """The chunk of a module that treats tokens independently (an MLP, a projection, a norm), asked at each
    call: a size, or :func:`mlp_tokens` of the call's sizes and the module's width (a mixture of experts':
    ``top_k`` of them per token); with ``unfused_only``, ``"auto"`` leaves the module whole (``None``) on a GPU,
    whose fused kernels hold no float32 copies."""

    setting: int | str
    blocks: int
    unfused_only: bool = False
    top_k: int = 1

    def __call__(self, module: nn.Module, x: mx.array) -> int | None:
        return self.size(module, x.shape[0], x.shape[1], x.shape[-1])

    def size(self, module: nn.Module, batch: int, tokens: int, hidden: int) -> int | None:
        """The chunk for ``batch`` rows of ``tokens`` of ``hidden`` features, ``None`` for none."""
        if isinstance(self.setting, int):
            return self.setting
        backend = "cpu" if _attention.backend() == "cpu" else "gpu"
        if self.unfused_only and backend != "cpu":
            return None
        return mlp_tokens(tokens, hidden, _width(module, hidden, self.top_k), batch, self.blocks, backend)

    def whole_up_to(self, module: nn.Module, batch: int, hidden: int) -> int:
        """The longest sequence that leaves ``module`` whole where longer ones are cut (0: never cut). The
        rules cut from some length on and for good (a chunk's least work is fixed, its share of the blocks'
        inputs grows more slowly than the sequence), so that length is found by bisection."""
        low, high = 1, _LONGEST  # whole at low; checked below at high
        if (self.size(module, batch, high, hidden) or high) >= high:
            return 0
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (
                (middle, high) if (self.size(module, batch, middle, hidden) or middle) >= middle else (low, middle)
            )
        return low


def _width(module: nn.Module, hidden: int, top_k: int = 1) -> int:
    """The widest of ``module``'s input (``hidden``) and what its layers compute per token: a layer's output (an
    MLP's hidden width, a projection's output: the first dimension of its 2-D ``weight``, a quantized layer's
    too, packed along its input), and a mixture of experts' chosen ones: ``top_k`` x the widest of its experts'
    layers (the second dimension of their 3-D ``weight``: experts x outputs x inputs). The input counts too: a
    LoRA projection's backward pass holds a float32 copy of it, so key and value projections narrower than their
    input (heads sharing them) are sized as the query's."""
    weights = [v for k, v in dict(tree_flatten(module.parameters())).items() if k.endswith("weight")]
    widths = [v.shape[0] for v in weights if v.ndim == 2]
    experts = [v.shape[1] for v in weights if v.ndim == 3]
    return max([hidden, *widths, top_k * max(experts, default=0)])


def _top_k(*modules: nn.Module) -> int:
    """The experts per token of the first of ``modules`` that gives it (:data:`TOP_K`, on it or a module in it,
    such as its router, or in their configuration, :data:`CONFIGS`); 1 where none does."""
    holders = [m for module in modules for _, m in module.named_modules()]
    holders += [getattr(m, name, None) for m in holders for name in CONFIGS]
    found = (getattr(h, name, None) for h in holders for name in TOP_K)
    return next((k for k in found if isinstance(k, int) and not isinstance(k, bool) and k >= 1), 1)


@dataclasses.dataclass(frozen=True)
class _FastAttention:
    """``mx.fast.scaled_dot_product_attention`` in chunks of queries: ``chunk`` of them, or with ``"auto"``
    :func:`attention_queries` of a model of ``blocks`` blocks where this backend trains attention unfused (and
    fused chunks past :data:`nuvec_mlx._attention.FUSED_LIMIT`)."""

    chunk: int | str
    blocks: int

    def __call__(self, q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None, **options: Any):
        chunk: int | str | None = self.chunk
        if chunk == AUTO and q.ndim == 4:
            chunk = _attention.auto_size(q, k, v, mask, attention_queries(q, k, self.blocks))
        return _attention.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, chunk=chunk, **options)


@dataclasses.dataclass(frozen=True)
class _LibraryAttention:
    """mlx-lm's ``scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None)``,
    in chunks of queries (:class:`_FastAttention`) where it runs without a cache (training); as it is with
    one (generation)."""

    original: Callable[..., mx.array]
    fast: _FastAttention

    def __call__(self, queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
                 sinks: mx.array | None = None) -> mx.array:  # fmt: skip
        if cache is not None:
            return self.original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        options = {} if sinks is None else {"sinks": sinks}
        return self.fast(queries, keys, values, scale=scale, mask=mask, **options)


def attention_routes(cls: type, chunk: int | str, blocks: int = 1) -> dict[str, Any]:
    """The routes that make ``cls``'s ``__call__`` compute its attention in chunks of ``chunk`` queries (a
    model of ``blocks`` blocks): its global ``scaled_dot_product_attention`` (mlx-lm's), and ``mx`` where it
    calls ``mx.fast.scaled_dot_product_attention`` itself; empty where it calls neither."""
    names = _reroute.names_read(cls)
    if "scaled_dot_product_attention" not in names:
        return {}
    namespace = getattr(cls.__call__, "__globals__", {})
    fast = _FastAttention(chunk, blocks)
    found: dict[str, Any] = {}
    library = namespace.get("scaled_dot_product_attention")
    if callable(library) and library is not mx.fast.scaled_dot_product_attention:
        found["scaled_dot_product_attention"] = _LibraryAttention(library, fast)
    if "fast" in names and namespace.get("mx") is mx:
        found["mx"] = _reroute.Namespace(mx, fast=_reroute.Namespace(mx.fast, scaled_dot_product_attention=fast))
    return found


def chunk_layers(
    model: nn.Module,
    chunks: Chunks | None = None,
    *,
    layers: Any = None,
    routes: Mapping[str, Any] | None = None,
    enable: bool = True,
) -> int:
    """Compute a model's blocks along the sequence in chunks (in place); ``enable=False`` undoes it.

    In each block (and the modules inside it): attention in chunks of queries
    (``chunks.attention``), the feed-forward module (a child named as in
    :data:`FEED_FORWARD`) checkpointed in chunks of tokens (``chunks.mlp``),
    attention's projections (children named as in :data:`PROJECTIONS`) and
    the block's norms (:data:`NORMS`) the same way (``chunks.projections``,
    ``chunks.norms``), and the functions ``routes`` names computed as they
    say. Nothing outside
    the blocks changes: the modules' own calls see the chunked functions
    (:func:`nuvec_mlx.nn.reroute`). Values and gradients are the unchunked
    ones, up to the order of sums. Checkpoint the blocks too
    (:func:`nuvec_mlx.checkpoint_layers`): inside a checkpointed block, the
    chunks bound what its backward pass holds.

    Args:
        model: the model.
        chunks: the settings; ``None`` for ``Chunks()`` (every part ``"auto"``).
        layers: the blocks, as :func:`nuvec_mlx.checkpoint_layers` takes them.
        routes: further global names, each the function the modules that call
            it should call instead (hashable: a module's class is cached by them).
        enable: chunk (True) or put the blocks back (False).

    Returns:
        How many modules changed.

    Example:
        >>> nv.checkpoint_layers(model)
        >>> nv.chunk_layers(model)                        # the rules decide
        >>> nv.chunk_layers(model, nv.Chunks(mlp=1024))   # the MLP in chunks of 1024 tokens
    """
    _validate.check_module(model, "model")
    chunks = Chunks.of(chunks)
    _validate.check_bool(enable, "enable")
    extra = dict(routes or {})
    blocks = nv_nn.find_layers(model, layers)
    changed = 0
    for block in blocks:
        for module in block.modules():
            changed += nv_nn.reroute(module, _routes(module, chunks, extra, len(blocks)) if enable else {})
        for part, rule, lazy in _token_wise(block, chunks, len(blocks)):
            before = type(part)
            nv_nn.in_chunks(part, rule if enable else None, enable=enable and rule is not None, lazy_in_recompute=lazy)
            changed += type(part) is not before
    return changed


def whole_up_to(
    model: nn.Module, hidden: int, chunks: Chunks | None = None, *, batch: int = 1, layers: Any = None
) -> int:
    """The longest sequence at which :func:`chunk_layers` leaves a module of the blocks whole that it cuts into
    chunks at longer ones (an MLP, an attention projection, a norm), or 0 where it cuts every one from the
    shortest sequence on or never.

    Why: a module whole holds its intermediates for the whole sequence, in chunks for one chunk, so a step's
    peak falls where the module starts to be cut and grows more slowly past it. A curve through peaks on both
    sides of that length bends the wrong way and extrapolates short; past it, every module is cut and the peak
    grows smoothly. ``nuvec-mlx-plan --longest`` measures past it. On a GPU the rules leave Llama-3.1-8B's
    attention projections whole up to 8,192 tokens (:data:`MLP_MIN_WORK`).

    Args:
        model: the model, as :func:`chunk_layers` takes it.
        hidden: the blocks' hidden size (their inputs' last dimension).
        chunks: the settings; ``None`` for ``Chunks()``.
        batch: the rows of a batch.
        layers: the blocks, as :func:`nuvec_mlx.checkpoint_layers` takes them.

    Returns:
        The length in tokens, or 0.

    Example:
        >>> nv.chunking.whole_up_to(model, hidden=4096)  # Llama-3.1-8B on a GPU: its projections
        8192
    """
    _validate.check_module(model, "model")
    _check_sizes(hidden=hidden, batch=batch)
    chunks = Chunks.of(chunks)
    blocks = nv_nn.find_layers(model, layers)
    found = (
        rule.whole_up_to(part, batch, hidden)
        for block in blocks
        for part, rule, _ in _token_wise(block, chunks, len(blocks))
        if rule is not None
    )
    return max(found, default=0)


def _token_wise(block: nn.Module, chunks: Chunks, blocks: int) -> list[tuple[nn.Module, _TokenWise | None, bool]]:
    """The modules of ``block`` that treat tokens independently, each with its rule (``None``: its setting is
    off) and whether its chunks are left out of the block's recomputation (lazy). The MLP's output only joins the
    residual sum: its chunks are left out. The projections' and norms' outputs are read there (by attention, the
    MLP): each chunk a stage of its own."""
    parts = [
        *((f, chunks.mlp, True, False) for f in feed_forwards(block)),
        *((p, chunks.projections, False, False) for p in projections(block)),
        *((n, chunks.norms, False, True) for n in norms(block)),
    ]
    return [
        (part, None if setting is None else _TokenWise(setting, blocks, unfused_only, _top_k(part, block)), lazy)
        for part, setting, lazy, unfused_only in parts
    ]


def _routes(module: nn.Module, chunks: Chunks, extra: dict[str, Any], blocks: int) -> dict[str, Any]:
    """The routes ``module``'s own ``__call__`` takes: attention's, and those of ``extra`` it reads."""
    cls = nv_nn.original_class(module)
    found = {} if chunks.attention is None else attention_routes(cls, chunks.attention, blocks)
    names = _reroute.names_read(cls)
    found.update({name: route for name, route in extra.items() if name in names})
    return found


def projections(block: nn.Module) -> list[nn.Module]:
    """Attention's projections in ``block``: the children named as in :data:`PROJECTIONS` of its modules."""
    _validate.check_module(block, "block")
    return [c for m in block.modules() for name in PROJECTIONS if isinstance(c := m.get(name), nn.Module)]


def norms(block: nn.Module) -> list[nn.Module]:
    """``block``'s norms: its children named as in :data:`NORMS`."""
    _validate.check_module(block, "block")
    return [c for name in NORMS if isinstance(c := block.get(name), nn.Module)]


def feed_forwards(block: nn.Module) -> list[nn.Module]:
    """``block``'s feed-forward modules: its children named as in :data:`FEED_FORWARD` (an MLP; Gemma 4's
    experts beside it)."""
    _validate.check_module(block, "block")
    return [c for name in FEED_FORWARD if isinstance(c := block.get(name), nn.Module)]
