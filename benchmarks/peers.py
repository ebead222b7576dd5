"""The benchmark's models in PyTorch and JAX, each measured in a process of its own.

    export MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=131072 XLA_PYTHON_CLIENT_PREALLOCATE=false
    python -m nuvec_mlx_bench.peers --peer torch-eager --model mlp --strategy checkpoint   # one JSON line
    python -m nuvec_mlx_bench.peers --peer jax-jit --check --model transformer --seq 4     # errors against MLX
    python -m nuvec_mlx_bench.peers --peer torch-compile --calibrate 64                    # a known 64 MiB step

(:func:`run_isolated` sets that environment, :data:`ENV`, itself.)

The peers build the models of ``benchmarks/workloads.py`` (same blocks, shapes
and deterministic values, float32) and take the same step: the gradients of
``sum(blocks(x))`` with respect to the input (or the input and every weight),
followed by the loss. Strategy ``none`` runs the blocks as they are,
``checkpoint`` wraps each block in the framework's own checkpoint
(``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, ``jax.checkpoint``).

Peaks are read from the framework's own allocator on a GPU (JAX's, whose
peak cannot be reset, through a padding buffer: :class:`JaxStatsProbe`) and
from the process's resident high-water mark on a CPU, where neither framework
counts its peak (:class:`RssProbe`); every result says how in ``method``, and
JAX's also carry XLA's compiled memory analysis. :func:`run_isolated` runs one
measurement in a fresh interpreter, so that no two frameworks share a process
or an allocator with MLX. This module imports neither framework at its top:
the parent process only launches.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import importlib.util
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from nuvec_mlx_bench import shapes, timing

#: The peers, and the module each needs.
FRAMEWORKS = {"torch-eager": "torch", "torch-compile": "torch", "jax-jit": "jax"}
PEERS = tuple(FRAMEWORKS)
STRATEGIES = ("none", "checkpoint")
MODELS = ("mlp", "transformer")
#: The peer processes' environment. glibc maps every buffer of 64 KiB and more on
#: its own and unmaps it when it is freed, so that the resident set follows the
#: live buffers (glibc reads this at start only; :class:`RssProbe` needs it);
#: JAX allocates GPU memory as it goes instead of taking 75% of it up front.
ENV = {
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TRIM_THRESHOLD_": "131072",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
}
#: glibc's mallopt parameters, and what RssProbe.done sets them to for the timed steps
#: (the mmap threshold's maximum, where glibc's own sliding threshold tends).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
FAST_MMAP_THRESHOLD, FAST_TRIM_THRESHOLD = 32 << 20, 64 << 20
LN_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class Spec:
    """One workload: a model at one shape, a strategy, which gradients."""

    model: str = "mlp"
    strategy: str = "none"
    batch: int = 512
    dim: int = 64
    blocks: int = 8
    seq: int = 1
    weight_grads: bool = False


# --- the models, written once for both frameworks ---------------------------------


@dataclasses.dataclass(frozen=True)
class Ops:
    """The few operations the blocks need, in one framework; arrays use ``@``, ``+`` and ``*``."""

    tanh: Callable[[Any], Any]
    layer_norm: Callable[[Any], Any]  # over the last axis, no affine, eps LN_EPS
    split3: Callable[[Any], tuple[Any, Any, Any]]  # the last axis in three
    causal_attention: Callable[[Any, Any, Any], Any]  # single head on [B, T, D], scale D**-0.5
    gelu: Callable[[Any], Any]  # exact (erf), as mlx.nn.gelu


def mlp_block(ops: Ops, x: Any, w1: Any, w2: Any) -> Any:
    """workloads.mlp_block: a wide two-layer MLP with a residual."""
    h = ops.tanh(x @ w1)
    h = ops.tanh(h * h)
    return x + ops.tanh(h @ w2)


def transformer_block(ops: Ops, x: Any, wqkv: Any, wo: Any, w1: Any, w2: Any) -> Any:
    """workloads.transformer_block: pre-norm causal single-head attention, then a 4x gelu MLP."""
    q, k, v = ops.split3(ops.layer_norm(x) @ wqkv)
    x = x + ops.causal_attention(q, k, v) @ wo
    return x + ops.gelu(ops.layer_norm(x) @ w1) @ w2


BLOCKS = {"mlp": mlp_block, "transformer": transformer_block}


def loss(ops: Ops, spec: Spec, remat: Callable[[Callable], Callable], x: Any, weights: Sequence[Any]) -> Any:
    """``sum(blocks(x))``, each block wrapped by ``remat`` under strategy ``checkpoint``."""
    block = functools.partial(BLOCKS[spec.model], ops)
    if spec.strategy == "checkpoint":
        block = remat(block)
    per = len(weights) // spec.blocks
    h = x
    for i in range(spec.blocks):
        h = block(h, *weights[per * i : per * (i + 1)])
    return h.sum()


def filled(shape: tuple[int, ...], seed: float) -> np.ndarray:
    """workloads.filled: ``sin(arange * seed) * 0.05`` in float32 (the product rounded as MLX rounds it)."""
    n = math.prod(shape)
    return (np.sin(np.arange(n, dtype=np.float32) * np.float32(seed)) * np.float32(0.05)).reshape(shape)


def block_weights(model: str, dim: int, i: int) -> list[np.ndarray]:
    """workloads.block_weights: the weights of block ``i``."""
    return [filled(shape, seed) for shape, seed in shapes.block_weights(model, dim, i)]


def host_inputs(spec: Spec) -> tuple[list[np.ndarray], np.ndarray]:
    """The weights (block by block) and the input, as workloads.build makes them."""
    weights = [w for i in range(spec.blocks) for w in block_weights(spec.model, spec.dim, i)]
    shape = (spec.batch, spec.dim) if spec.model == "mlp" else (spec.batch, spec.seq, spec.dim)
    return weights, filled(shape, shapes.INPUT_SEED)


# --- peaks ---------------------------------------------------------------------------


class Probe(Protocol):
    """Reads the peak of one step: ``start`` before it, ``stop`` (bytes above the start) after it.

    ``done`` comes after the last peak, before the timed steps.
    """

    method: str
    notes: dict[str, Any]

    def start(self) -> None: ...

    def stop(self) -> int: ...

    def done(self) -> None: ...


def _status_kib(field: str) -> int:
    """A field of /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


class RssProbe:
    """The process's resident high-water mark (Linux, glibc), for frameworks that count no CPU peak.

    ``start`` hands glibc's free heap back (``malloc_trim``), resets the
    high-water mark to the resident set (``5`` into ``/proc/self/clear_refs``)
    and notes the resident set; ``stop`` returns ``VmHWM`` minus that. It needs
    the process started with :data:`ENV`'s glibc settings, which unmap freed
    buffers: with glibc's defaults, freed buffers stay in its heap and the
    figure overstates two- to fourfold. Those settings also slow steps down
    (every buffer is fresh pages: PyTorch's CPU steps threefold), so ``done``
    raises glibc's thresholds (mmap 32 MiB, its maximum; trim 64 MiB) for the
    timed steps that follow. Only touched pages count, and everything the
    process touches.
    """

    method = ("resident high-water mark: VmHWM minus VmRSS before the step, the mark reset through "
              "/proc/self/clear_refs; glibc unmapping freed buffers of 64 KiB and more "
              "(MALLOC_MMAP_THRESHOLD_=65536), its free heap trimmed first")

    def __init__(self) -> None:
        if os.environ.get("MALLOC_MMAP_THRESHOLD_") != ENV["MALLOC_MMAP_THRESHOLD_"]:
            raise RuntimeError("a resident-set peak needs the process started with MALLOC_MMAP_THRESHOLD_="
                               f"{ENV['MALLOC_MMAP_THRESHOLD_']} (run_isolated sets it)")
        self.notes: dict[str, Any] = {"time_note": "glibc mmap threshold 32 MiB, trim threshold 64 MiB"}
        self._libc = ctypes.CDLL(None)
        self._base = 0

    def start(self) -> None:
        self._libc.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        self._base = _status_kib("VmRSS")

    def stop(self) -> int:
        return (_status_kib("VmHWM") - self._base) * 1024

    def done(self) -> None:
        self._libc.mallopt(M_MMAP_THRESHOLD, FAST_MMAP_THRESHOLD)
        self._libc.mallopt(M_TRIM_THRESHOLD, FAST_TRIM_THRESHOLD)


class TorchCudaProbe:
    """PyTorch's CUDA caching allocator: its peak of allocated bytes, reset before the step."""

    method = ("torch.cuda.max_memory_allocated() minus memory_allocated() before the step, after "
              "synchronize, empty_cache and reset_peak_memory_stats")

    def __init__(self, torch: Any) -> None:
        self.cuda = torch.cuda
        self.notes: dict[str, Any] = {}
        self._base = 0

    def start(self) -> None:
        self.cuda.synchronize()
        self.cuda.empty_cache()
        self.cuda.reset_peak_memory_stats()
        self._base = self.cuda.memory_allocated()

    def stop(self) -> int:
        self.cuda.synchronize()
        return self.cuda.max_memory_allocated() - self._base

    def done(self) -> None:
        pass


class JaxStatsProbe:
    """JAX's device allocator stats, whose lifetime ``peak_bytes_in_use`` cannot be reset.

    Compiling alone (XLA's autotuning) sets a lifetime peak far above a small
    step's, so ``start`` first fills the gap: it places a padding buffer that
    brings ``bytes_in_use`` up to the lifetime peak, so that whatever the step
    adds shows as a new peak. The figure is ``peak_bytes_in_use`` after the
    step minus ``bytes_in_use`` before it (the padding included); each
    measurement raises the lifetime peak, and the next padding, by one step's
    peak. ``notes["peak_exact"]`` is false if a padding fell short of the
    lifetime peak (the figure then a lower bound). JAX's allocator counts
    whole chunks in use, so the figure includes its internal fragmentation,
    which XLA's own plan (``xla_temp_bytes`` + ``xla_output_bytes``) does not.
    """

    method = ("device.memory_stats(): peak_bytes_in_use after the step minus bytes_in_use before it; "
              "JAX cannot reset the peak, so a padding buffer first brings bytes_in_use up to it")

    def __init__(self, jax: Any, device: Any) -> None:
        self.jax, self.device = jax, device
        self.notes: dict[str, Any] = {"peak_exact": True}
        self._pad: Any = None
        self._base = 0

    def start(self) -> None:
        stats = self.device.memory_stats()
        gap = stats["peak_bytes_in_use"] - stats["bytes_in_use"]
        if gap > 0:
            self._pad = self.jax.device_put(np.zeros(gap, np.uint8), self.device).block_until_ready()
        stats = self.device.memory_stats()
        self.notes["peak_exact"] &= stats["bytes_in_use"] >= stats["peak_bytes_in_use"]
        self._base = stats["bytes_in_use"]

    def stop(self) -> int:
        self._pad = None
        return self.device.memory_stats()["peak_bytes_in_use"] - self._base

    def done(self) -> None:
        pass


# --- the frameworks ----------------------------------------------------------------------


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Framework(Protocol):
    """What a peer needs from its framework: the step, a peak probe, a barrier, the results on the host."""

    def info(self) -> dict[str, Any]: ...

    def probe(self) -> Probe: ...

    def sync(self, outputs: Any) -> None: ...

    def train_step(self, spec: Spec) -> tuple[Callable[[], list], dict[str, Any]]: ...

    def allocation(self, nbytes: int) -> Callable[[], Any]: ...

    def to_numpy(self, outputs: list) -> list[np.ndarray]: ...


class Torch:
    """PyTorch, eager or under ``torch.compile``, on CUDA where there is one, else on the CPU."""

    def __init__(self, compiled: bool) -> None:
        import torch
        import torch.nn.functional as F
        from torch.utils.checkpoint import checkpoint

        self.torch, self.compiled = torch, compiled
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.remat = lambda f: lambda *xs: checkpoint(f, *xs, use_reentrant=False)

        def attention(q: Any, k: Any, v: Any) -> Any:
            a = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=True,
                                               scale=q.shape[-1] ** -0.5)
            return a[:, 0]

        self.ops = Ops(
            tanh=torch.tanh,
            layer_norm=lambda x: F.layer_norm(x, x.shape[-1:], eps=LN_EPS),
            split3=lambda x: x.chunk(3, dim=-1),
            causal_attention=attention,
            gelu=F.gelu,
        )

    def info(self) -> dict[str, Any]:
        cuda = self.device.type == "cuda"
        return {
            "version": f"torch {self.torch.__version__}",
            "device": self.torch.cuda.get_device_name(self.device) if cuda else cpu_name(),
            "threads": self.torch.get_num_threads(),
            "matmul": "float32 (TF32 off)" if not cuda or not self.torch.backends.cuda.matmul.allow_tf32
            else "TF32",
        }

    def probe(self) -> Probe:
        return TorchCudaProbe(self.torch) if self.device.type == "cuda" else RssProbe()

    def sync(self, outputs: Any) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def train_step(self, spec: Spec) -> tuple[Callable[[], list], dict[str, Any]]:
        """The step: forward and loss (compiled for torch-compile), then ``torch.autograd.grad``."""
        host_weights, host_x = host_inputs(spec)
        weights = [self.torch.tensor(w, device=self.device) for w in host_weights]
        x = self.torch.tensor(host_x, device=self.device)
        wrt = [*weights, x] if spec.weight_grads else [x]
        for t in wrt:
            t.requires_grad_()
        forward = functools.partial(loss, self.ops, spec, self.remat)
        if self.compiled:
            forward = self.torch.compile(forward)

        def step() -> list:
            value = forward(x, weights)
            return [*self.torch.autograd.grad(value, wrt), value.detach()]

        how = ("torch.compile (inductor, default mode) of the forward and loss, backward by "
               "torch.autograd.grad through AOTAutograd's compiled backward" if self.compiled
               else "eager, backward by torch.autograd.grad")
        return step, {"step": how}

    def allocation(self, nbytes: int) -> Callable[[], Any]:
        return lambda: self.torch.ones(nbytes // 4, dtype=self.torch.float32, device=self.device)

    def to_numpy(self, outputs: list) -> list[np.ndarray]:
        return [o.detach().cpu().numpy() for o in outputs]


class Jax:
    """JAX: ``jax.jit`` of ``jax.value_and_grad``, compiled ahead of time, on JAX's default device."""

    def __init__(self) -> None:
        import jax
        import jax.numpy as jnp

        # float32 matmuls as PyTorch's default (on GPUs, JAX's default may use TF32).
        jax.config.update("jax_default_matmul_precision", "highest")
        # A CPU step runs in the calling thread, so that its buffers are freed when it returns:
        # dispatched asynchronously, they are freed a while after its outputs are ready, and a
        # resident-set peak misses them at random. Only before the CPU backend starts.
        jax.config.update("jax_cpu_enable_async_dispatch", False)
        self.jax, self.device = jax, jax.devices()[0]

        def layer_norm(x: Any) -> Any:
            mean = x.mean(-1, keepdims=True)
            return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + LN_EPS)

        def attention(q: Any, k: Any, v: Any) -> Any:
            a = jax.nn.dot_product_attention(q[:, :, None], k[:, :, None], v[:, :, None],
                                             scale=q.shape[-1] ** -0.5, is_causal=True)
            return a[:, :, 0]

        self.ops = Ops(
            tanh=jnp.tanh,
            layer_norm=layer_norm,
            split3=lambda x: jnp.split(x, 3, axis=-1),
            causal_attention=attention,
            gelu=functools.partial(jax.nn.gelu, approximate=False),
        )

    def info(self) -> dict[str, Any]:
        import jaxlib

        return {
            "version": f"jax {self.jax.__version__} (jaxlib {jaxlib.__version__})",
            "device": cpu_name() if self.device.platform == "cpu" else self.device.device_kind,
            "matmul": "float32 (precision highest)",
        }

    def probe(self) -> Probe:
        return RssProbe() if self.device.memory_stats() is None else JaxStatsProbe(self.jax, self.device)

    def sync(self, outputs: Any) -> None:
        self.jax.block_until_ready(outputs)

    def train_step(self, spec: Spec) -> tuple[Callable[[], list], dict[str, Any]]:
        """The step, jitted and compiled here; XLA's own memory analysis comes with it."""
        host_weights, host_x = host_inputs(spec)
        weights = [self.jax.device_put(w, self.device) for w in host_weights]
        x = self.jax.device_put(host_x, self.device)
        loss_of = functools.partial(loss, self.ops, spec, self.jax.checkpoint)
        value_and_grad = self.jax.value_and_grad(lambda ws, x: loss_of(x, ws),
                                                 argnums=(0, 1) if spec.weight_grads else 1)

        def step(ws: list, x: Any) -> list:
            value, grads = value_and_grad(ws, x)
            return [*grads[0], grads[1], value] if spec.weight_grads else [grads, value]

        compiled = self.jax.jit(step).lower(weights, x).compile()
        analysis = compiled.memory_analysis()
        extra = {"step": "jax.jit of jax.value_and_grad, compiled ahead of time"}
        if analysis is not None:
            extra |= {"xla_temp_bytes": analysis.temp_size_in_bytes,
                      "xla_output_bytes": analysis.output_size_in_bytes}
        return lambda: compiled(weights, x), extra

    def allocation(self, nbytes: int) -> Callable[[], Any]:
        fill = self.jax.jit(lambda c: self.jax.numpy.full((nbytes // 4,), c)).lower(np.float32(1)).compile()
        return lambda: fill(np.float32(1))

    def to_numpy(self, outputs: list) -> list[np.ndarray]:
        return [np.asarray(o) for o in outputs]


def framework(peer: str) -> Framework:
    """The framework behind a peer (imports it)."""
    if peer not in PEERS:
        raise ValueError(f"peer must be one of {PEERS}, got {peer!r}")
    return Jax() if peer == "jax-jit" else Torch(compiled=peer == "torch-compile")


# --- measuring ------------------------------------------------------------------------


def peak(step: Callable[[], Any], sync: Callable[[Any], None], probe: Probe) -> int:
    """Peak bytes of one step above what was in use before it, its outputs included."""
    probe.start()
    outputs = step()
    sync(outputs)
    del outputs
    return probe.stop()


def seconds(step: Callable[[], Any], sync: Callable[[Any], None], min_seconds: float = timing.MIN_SECONDS) -> float:
    """Wall time of one step until the device has finished it, as :mod:`benchmarks.timing` times MLX's."""
    return timing.seconds(lambda: sync(step()), min_seconds)


def measure(step: Callable[[], Any], sync: Callable[[Any], None], probe: Probe, repeats: int) -> dict[str, Any]:
    """One warm-up (compiling) step, then ``repeats`` peaks and ``repeats`` times: medians, min and max.

    The peaks come first, as :class:`RssProbe` needs glibc as the process
    started and leaves it faster for the timed steps.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    warmup = seconds(step, sync, min_seconds=0)
    peaks = [peak(step, sync, probe) for _ in range(repeats)]
    probe.done()
    times = [seconds(step, sync) for _ in range(repeats)]
    result: dict[str, Any] = {"warmup_s": warmup, "method": probe.method, **probe.notes}
    for name, values in (("peak", peaks), ("time", times)):
        result |= {name: statistics.median(values), f"{name}_min": min(values), f"{name}_max": max(values)}
    return result


def run(peer: str, spec: Spec, repeats: int) -> dict[str, Any]:
    """Measure one peer's step in this process."""
    fw = framework(peer)
    step, extra = fw.train_step(spec)
    result = measure(step, fw.sync, fw.probe(), repeats)
    result["method"] = f"{extra.pop('step')}; peak: {result['method']}"
    return {**result, **extra, **fw.info()}


def calibrate(peer: str, mib: int, repeats: int) -> dict[str, Any]:
    """Measure a step that allocates ``mib`` MiB and frees it: the probe should read about that."""
    fw = framework(peer)
    return {**measure(fw.allocation(mib << 20), fw.sync, fw.probe(), repeats), **fw.info(),
            "expected": mib << 20}


def peer_outputs(peer: str, spec: Spec) -> list[np.ndarray]:
    """One step's outputs on the host: the gradients (weights first, input last), then the loss."""
    fw = framework(peer)
    step, _ = fw.train_step(spec)
    return fw.to_numpy(step())


def mlx_outputs(spec: Spec) -> list[np.ndarray]:
    """The same step in MLX: ``workloads.build("none")``, uncompiled (imports MLX)."""
    import mlx.core as mx

    from nuvec_mlx_bench import workloads

    fields = {k: v for k, v in dataclasses.asdict(spec).items() if k != "strategy"}
    sc = workloads.build("none", compiled=False, **fields)
    outputs = sc.step(sc.inputs)
    mx.eval(outputs)
    return [np.array(o) for o in outputs]


def check(peer: str, spec: Spec) -> list[float]:
    """Relative max-norm errors of a peer's outputs against MLX's, one per output."""
    got, want = peer_outputs(peer, spec), mlx_outputs(spec)
    if [g.shape for g in got] != [w.shape for w in want]:
        raise AssertionError(f"shapes differ: {[g.shape for g in got]} vs {[w.shape for w in want]}")
    return [float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)) for g, w in zip(got, want)]


# --- the parent's side ----------------------------------------------------------------


def available() -> list[str]:
    """The peers whose framework this interpreter can import (without importing it)."""
    return [p for p in PEERS if importlib.util.find_spec(FRAMEWORKS[p]) is not None]


def spec_args(spec: Spec) -> list[str]:
    """The command-line arguments that give a peer process ``spec``."""
    args = []
    for f in dataclasses.fields(Spec):
        value, flag = getattr(spec, f.name), "--" + f.name.replace("_", "-")
        args += ([flag] if value else []) if isinstance(value, bool) else [flag, str(value)]
    return args


def run_isolated(peer: str, python: str = sys.executable, repeats: int = 3, timeout: float = 1800,
                 **spec: Any) -> dict[str, Any]:
    """Measure one peer's step in a fresh ``python`` process; failures come back as ``{"error": ...}``.

    Args:
        peer: one of :data:`PEERS`.
        python: the interpreter, which must be able to import the peer's framework.
        repeats: measurements after the warm-up.
        timeout: seconds before the process is killed.
        spec: the fields of :class:`Spec`.

    Returns:
        :func:`run`'s dict: ``peak``, ``peak_min``, ``peak_max`` (bytes), ``time``,
        ``time_min``, ``time_max`` (seconds), ``method``, ``version``, ``device`` and more.
    """
    if peer not in PEERS:
        return {"error": f"unknown peer {peer!r}"}
    cmd = [python, "-m", "nuvec_mlx_bench.peers", "--peer", peer, "--repeats", str(repeats), *spec_args(Spec(**spec))]
    try:
        proc = subprocess.Popen(cmd, env={**os.environ, **ENV}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    except OSError as e:
        return {"error": f"cannot run {python}: {e.strerror or e}"}
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # The whole group: torch.compile's workers would otherwise hold the pipes open.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"timed out after {timeout:g} s"}
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        reason = (stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return {"error": reason[:300]}
    return json.loads(lines[-1])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", choices=PEERS, required=True)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="print the outputs' relative errors against MLX")
    mode.add_argument("--calibrate", type=int, metavar="MIB", help="measure a step that allocates MIB MiB")
    p.add_argument("--repeats", type=int, default=3, help="measurements after the warm-up")
    for f in dataclasses.fields(Spec):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type=type(f.default), default=f.default,
                           choices={"model": MODELS, "strategy": STRATEGIES}.get(f.name))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Print one JSON line: a measurement, a calibration or a check."""
    args = parse_args(argv)
    spec = Spec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Spec)})
    if args.check:
        errors = check(args.peer, spec)
        result: dict[str, Any] = {"errors": errors, "max_error": max(errors)}
    elif args.calibrate:
        result = calibrate(args.peer, args.calibrate, args.repeats)
    else:
        result = run(args.peer, spec, args.repeats)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
