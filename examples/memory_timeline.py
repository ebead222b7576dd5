"""Memory after every stage of one checkpointed training step, as a table, JSON and a PNG.

    python examples/memory_timeline.py [OUT_DIR]     # default benchmarks/results/cpu/timeline

The seed's MLP (8 residual blocks [B, 256] -> [B, 1024] -> [B, 256], float32) at B=1024,
the gradient of the input, compiled with nv.compile_flat, evaluated with nv.eval.
"""

import sys
from pathlib import Path

import mlx.core as mx

import nuvec_mlx as nv

BATCH, DIM, BLOCKS = 1024, 256, 8


def block(xs):
    x, w1, w2 = xs
    h = mx.tanh(x @ w1)
    return [x + mx.tanh(mx.tanh(h * h) @ w2)]


def main(out: Path) -> None:
    keys = mx.random.split(mx.random.key(0), 2 * BLOCKS + 1)
    weights = [
        mx.random.normal((DIM, 4 * DIM) if i % 2 == 0 else (4 * DIM, DIM), key=keys[i]) * 0.03
        for i in range(2 * BLOCKS)
    ]
    xs = [*weights, mx.random.normal((BATCH, DIM), key=keys[-1])]
    mx.eval(xs)
    ckpt = nv.checkpoint_flat(block)

    def loss(xs):
        h = xs[-1]
        for i in range(BLOCKS):
            h = ckpt([h, xs[2 * i], xs[2 * i + 1]])[0]
        return h.sum()

    vg = nv.value_and_grad_flat(loss, [2 * BLOCKS])
    step = nv.compile_flat(lambda xs: (lambda v, g: [*g, v])(*vg(xs)))
    nv.eval(step(xs))  # compile
    with nv.memory.timeline() as t:
        nv.eval(step(xs))
    out.mkdir(parents=True, exist_ok=True)
    print(f"{'stage':>5}  {'kind':8}  {'block':>5}  {'active MiB':>10}  {'peak MiB':>8}")
    for r in t.readings:
        print(f"{r.index + 1:5d}  {r.kind:8}  {r.block or '':>5}  {r.active / 2**20:10.1f}  {r.peak / 2**20:8.1f}")
    print(t.describe())
    t.save_json(out / "timeline.json")
    backend = "cpu" if mx.default_device() == mx.cpu else "gpu"
    t.plot(out / "timeline.png", title=f"seed MLP B={BATCH}, input gradient, MLX {mx.__version__} {backend}")
    print(f"wrote {out / 'timeline.json'} and {out / 'timeline.png'}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/cpu/timeline"))
