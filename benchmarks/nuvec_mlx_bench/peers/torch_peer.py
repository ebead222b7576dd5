"""The PyTorch peers: ``torch-eager`` and ``torch-compile``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..core.rounds import Probe
from ..seed.workload import Workload, host_inputs
from .framework import cpu_name
from .models import LN_EPS, Ops, loss
from .peak_probes import RssProbe, TorchCudaProbe


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
            a = F.scaled_dot_product_attention(
                q[:, None], k[:, None], v[:, None], is_causal=True, scale=q.shape[-1] ** -0.5
            )
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
            "matmul": "float32 (TF32 off)" if not cuda or not self.torch.backends.cuda.matmul.allow_tf32 else "TF32",
        }

    def probe(self) -> Probe:
        return TorchCudaProbe(self.torch) if self.device.type == "cuda" else RssProbe()

    def sync(self, outputs: Any) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def train_step(self, workload: Workload, strategy: str) -> tuple[Callable[[], list], dict[str, Any]]:
        """The step: forward and loss (compiled for torch-compile), then ``torch.autograd.grad``."""
        host_weights, host_x = host_inputs(workload)
        weights = [self.torch.tensor(w, device=self.device) for w in host_weights]
        x = self.torch.tensor(host_x, device=self.device)
        wrt = [*weights, x] if workload.weight_grads else [x]
        for t in wrt:
            t.requires_grad_()
        forward = functools.partial(loss, self.ops, workload, strategy, self.remat)
        if self.compiled:
            forward = self.torch.compile(forward)

        def step() -> list:
            value = forward(x, weights)
            return [*self.torch.autograd.grad(value, wrt), value.detach()]

        how = (
            "torch.compile (inductor, default mode) of the forward and loss, backward by "
            "torch.autograd.grad through AOTAutograd's compiled backward"
            if self.compiled
            else "eager, backward by torch.autograd.grad"
        )
        return step, {"step": how}

    def allocation(self, nbytes: int) -> Callable[[], Any]:
        return lambda: self.torch.ones(nbytes // 4, dtype=self.torch.float32, device=self.device)

    def to_numpy(self, outputs: list) -> list[np.ndarray]:
        return [o.detach().cpu().numpy() for o in outputs]
