"""Throw-away probe: the host's time to dispatch one compiled fine-tuning step, nuvec's against mlx-lm's.

The step is issued before the device can start it, so a millisecond here is a millisecond of every
step. mlx-lm's trainer step (``mx.compile`` of ``nn.value_and_grad`` and ``optimizer.update``) on a
16-block mlx-lm Llama with LoRA, tiny sizes (the host's work does not depend on them), every block
checkpointed by nuvec, compiled with ``mx.compile`` or ``nv.compile`` and differentiated with
``nn.value_and_grad`` or ``nv.value_and_grad``; the mean dispatch time of 30 warm calls, each
evaluated with ``mx.eval`` before the next, 7 rounds round-robin, median and min–max::

    python benchmarks/probes/host_overhead.py
"""

import statistics
import time

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.utils import average_gradients
from mlx_lm.tuner.trainer import default_loss

import nuvec_mlx as nv
from nuvec_mlx_bench.train_steps import Case, TrainWorkload, checkpointing

VARIANTS = {
    "mx.compile, nn.value_and_grad": (mx.compile, nn.value_and_grad),
    "nv.compile, nn.value_and_grad": (nv.compile, nn.value_and_grad),
    "mx.compile, nv.value_and_grad": (mx.compile, nv.value_and_grad),
    "nv.compile, nv.value_and_grad": (nv.compile, nv.value_and_grad),
}


def dispatch_ms(compile_fn, value_and_grad, calls: int = 30) -> float:
    case = Case(TrainWorkload("llama", 64, 16, batch=1, seq=16, mode="lora", vocab=256), "mlx-lm")
    batch = case.batch(16)
    vg = value_and_grad(case.model, default_loss)

    def step(batch):
        (value, tokens), grads = vg(case.model, *batch)
        case.optimizer.update(case.model, average_gradients(grads))
        return value, tokens

    with checkpointing("nuvec", case.model):
        compiled = compile_fn(step, inputs=case.state, outputs=case.state)
        mx.eval(case.state, compiled(batch))
        total = 0.0
        for _ in range(calls):
            begin = time.perf_counter()
            out = compiled(batch)
            total += time.perf_counter() - begin
            mx.eval(case.state, out)
    return total / calls * 1e3


def main(rounds: int = 7) -> None:
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, (compile_fn, value_and_grad) in VARIANTS.items():
            times[name].append(dispatch_ms(compile_fn, value_and_grad))
    for name, ms in times.items():
        print(f"{name:32} {statistics.median(ms):6.2f} ms ({min(ms):.2f}-{max(ms):.2f})")


if __name__ == "__main__":
    main()
