import mlx.core as mx, mlx.nn as nn, nuvec_mlx as nv, sys
sys.path.insert(0, ".")
from tests.test_policies import Model, loss, model_and_input
from nuvec_mlx import policies
def run(swap):
    model, x = model_and_input()
    if swap:
        for b in model.layers: b.gate = nn.Linear(64, 64)
        mx.eval(model.parameters())
    vg = lambda: nv.value_and_grad(model, loss)(model, x)
    v1, _ = vg(); mx.eval(v1); v2, _ = vg(); mx.eval(v2)
    nv.checkpoint_layers(model, policy=policies.save_nothing)
    v3, _ = vg(); nv.eval(v3)
    nv.checkpoint_layers(model, enable=False)
    v4 = loss(model, x); mx.eval(v4)
    print("swap" if swap else "quantized", v1.item(), v2.item(), "ckpt", v3.item(), "plain loss", v4.item(), flush=True)
run(True); run(False)
