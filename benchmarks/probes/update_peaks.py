"""Throw-away probe: a step's peak with ``optimizer.update`` against ``nv.update`` (the planner's question).

The model of ``examples/know_before_you_run.py`` (an 8-layer mlx-lm Llama, hidden 128, AdamW,
batch 2 x 256 tokens), every block checkpointed, compiled with ``nv.compile`` and evaluated with
``nv.eval``: the peak above the step's start (``nv.memory.measure``, cache cleared, after
``mx.synchronize()``) and where it happens (``nv.memory.timeline``), twice each, alternating::

    python benchmarks/probes/update_peaks.py
"""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_lm.models import llama

import nuvec_mlx as nv

MiB = 1 << 20


def main() -> None:
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=8, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=4096))
    tokens = mx.random.randint(0, 4096, (2, 2049), key=mx.random.key(1))
    mx.eval(model.parameters(), tokens)
    loss_fn = lambda m, x: nn.losses.cross_entropy(m(x[:, :-1]), x[:, 1:]).mean()  # noqa: E731
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
