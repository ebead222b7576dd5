"""The JAX peer: ``jax-jit``, the step compiled ahead of time."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..core.rounds import Probe
from ..seed.workload import Workload, host_inputs
from .framework import cpu_name
from .models import LN_EPS, Ops, loss
from .peak_probes import JaxStatsProbe, RssProbe


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
            a = jax.nn.dot_product_attention(
                q[:, :, None], k[:, :, None], v[:, :, None], scale=q.shape[-1] ** -0.5, is_causal=True
            )
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

    def train_step(self, workload: Workload, strategy: str) -> tuple[Callable[[], list], dict[str, Any]]:
        """The step, jitted and compiled here; XLA's own memory analysis comes with it."""
        host_weights, host_x = host_inputs(workload)
        weights = [self.jax.device_put(w, self.device) for w in host_weights]
        x = self.jax.device_put(host_x, self.device)
        loss_of = functools.partial(loss, self.ops, workload, strategy, self.jax.checkpoint)
        value_and_grad = self.jax.value_and_grad(
            lambda ws, x: loss_of(x, ws), argnums=(0, 1) if workload.weight_grads else 1
        )

        def step(ws: list, x: Any) -> list:
            value, grads = value_and_grad(ws, x)
            return [*grads[0], grads[1], value] if workload.weight_grads else [grads, value]

        compiled = self.jax.jit(step).lower(weights, x).compile()
        analysis = compiled.memory_analysis()
        extra = {"step": "jax.jit of jax.value_and_grad, compiled ahead of time"}
        if analysis is not None:
            extra |= {"xla_temp_bytes": analysis.temp_size_in_bytes, "xla_output_bytes": analysis.output_size_in_bytes}
        return lambda: compiled(weights, x), extra

    def allocation(self, nbytes: int) -> Callable[[], Any]:
        fill = self.jax.jit(lambda c: self.jax.numpy.full((nbytes // 4,), c)).lower(np.float32(1)).compile()
        return lambda: fill(np.float32(1))

    def to_numpy(self, outputs: list) -> list[np.ndarray]:
        return [np.asarray(o) for o in outputs]
