"""Throw-away probe: a step's peak with ``optimizer.update`` against ``nv.update`` (the planner's question).

The model of ``examples/know_before_you_run.py`` (an 8-layer mlx-lm Llama, hidden 128, AdamW,
batch 2 x 256 tokens), every block checkpointed, compiled with ``nv.compile`` and evaluated with
``nv.eval``: the peak above the step's start (``nv.memory.measure``, cache cleared, after
``mx.synchronize()``) and where it happens (``nv.memory.timeline``), twice each, alternating::

    python benchmarks/probes/update_peaks.py
"""

import sys
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim

import nuvec_mlx as nv

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from know_before_you_run import llama_and_tokens  # noqa: E402

MiB = 1 << 20


def main() -> None:
    model, tokens, loss_fn = llama_and_tokens()
    batch = tokens[:, :257]
    nv.checkpoint_layers(model)
    for how in ("optimizer.update", "nv.update") * 2:
        opt = optim.AdamW(1e-4)
        opt.init(model.trainable_parameters())
        state = [model.state, opt.state, mx.random.state]
        vg = nv.value_and_grad(model, loss_fn)

        def step(x, how=how, opt=opt, vg=vg):
            loss, grads = vg(model, x)
            nv.update(opt, model, grads) if how == "nv.update" else opt.update(model, grads)
            return loss

        compiled = nv.compile(step, inputs=state, outputs=state)
        nv.eval(compiled(batch), state)
        with nv.memory.measure() as m:
            nv.eval(compiled(batch), state)
        with nv.memory.timeline() as t:
            nv.eval(compiled(batch), state)
        top = max(t.readings, key=lambda r: r.peak)
        print(f"{how:17} peak {m.peak / MiB:6.2f} MiB above the start ({m.start / MiB:.2f} MiB); "
              f"timeline's highest stage: {top.name()}, {(top.peak - m.start) / MiB:.2f} MiB")


if __name__ == "__main__":
    main()
