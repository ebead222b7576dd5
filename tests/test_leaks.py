import mlx.core as mx
import pytest

import nuvec_mlx as nv


def block(xs):
    h, w = xs
    return [h + mx.tanh(h @ w)]


@pytest.mark.slow
def test_a_thousand_compiled_checkpointed_steps_leak_no_memory_and_trace_once(compiled):
    ck = nv.checkpoint_flat(block)

    def loss(xs):
        h = xs[0]
        for w in xs[1:]:
            h = ck([h, w])[0]
        return (h * h).mean()

    vg = nv.value_and_grad_flat(loss, [1, 2, 3])

    def step(xs):
        value, grads = vg(xs)
        return [value, *(w - 0.01 * g for w, g in zip(xs[1:], grads))]

    step = nv.compile_flat(step)
    k = mx.random.split(mx.random.key(0), 4)
    x = mx.random.normal((16, 64), key=k[0])
    ws = [mx.random.normal((64, 64), key=ki) * 0.02 for ki in k[1:]]
    nv.eval([x, ws])
    out = step([x, *ws])  # warm-up: the trace and the JIT happen here
    nv.eval(out)
    ws = out[1:]
    del out
    start = nv.memory.stats().active
    for _ in range(1000):
        out = step([x, *ws])
        nv.eval(out)
        ws = out[1:]
        del out
    end = nv.memory.stats().active
    # Less than one weight over the whole run: a step that leaked any array of
    # the step (16 KiB weights, 4 KiB activations) would leak 4 MB or more.
    assert abs(end - start) < ws[0].nbytes, f"active memory moved by {end - start} bytes"
    assert step.traces == 1
