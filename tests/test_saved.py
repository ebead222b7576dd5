"""nv.saved_activations: the arrays each block keeps, from MLX's graph, checked against memory measured per stage."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

import nuvec_mlx as nv
from nuvec_mlx.planner.saved import residuals
from nuvec_mlx_bench import testing

KiB = 1 << 10


def events_of(fn, *args):
    events = []
    mx.export_function(events.append, fn, *args)
    return events


def test_residuals_are_what_the_backward_part_reads_from_the_forward_part():
    x, w = mx.ones((4, 8)), mx.ones((8, 16))

    def graph(x, w, cotangent):
        out, grads = mx.vjp(lambda x, w: [mx.tanh(x @ w) * 2], [x, w], [cotangent])
        return [*out, *grads]

    saved = residuals(events_of(graph, x, w, mx.ones((4, 16))), outputs=1, arguments={"A"}, weights={"B"})
    # tanh's vjp reads its input (x @ w), the product's the broadcast 2 (one float's buffer), the
    # matmul's x (an argument) and w (a weight: not listed).
    assert sorted((s.made_by, s.shape, s.nbytes) for s in saved) == [
        ("Broadcast", (4, 16), 4),
        ("Matmul", (4, 16), 4 * 16 * 4),
        ("argument", (4, 8), 4 * 8 * 4),
    ]


def test_views_share_their_source_buffer():
    x = mx.ones((4, 8))

    def graph(x, cotangent):
        out, grads = mx.vjp(lambda x: [mx.sin(x.reshape(32)).reshape(4, 8) * mx.cos(x.T).T], [x], [cotangent])
        return [*out, *grads]

    saved = residuals(events_of(graph, x, mx.ones((4, 8))), outputs=1, arguments={"A"}, weights=set())
    # sin's and cos's vjps read their inputs: two views of x (one buffer, counted once); the
    # product's vjp reads both factors: views of the sin and cos outputs.
    assert sorted((s.made_by, s.view_of, s.shared) for s in saved) == [
        ("Reshape", "Sin", False),
        ("Reshape", "argument", True),
        ("Transpose", "Cos", False),
        ("Transpose", "argument", False),
    ]
    assert sum(s.nbytes for s in saved if not s.shared) == 3 * 4 * 8 * 4


@pytest.fixture(scope="module")
def transformer():
    model, x = testing.blocks_model("transformer", batch=2, dim=64, blocks=3, seq=128)
    return model, x, testing.blocks_loss


@pytest.mark.slow
def test_the_report_matches_the_memory_each_block_keeps_between_its_stages(transformer, compiled):
    model, x, loss = transformer
    report = nv.saved_activations(nv.TrainingStep(model, loss), x, policy=nv.policies.save_matmuls, measure=True)
    assert len(report.blocks) == 3
    for b in report.blocks:
        unchecked, checkpointed = b.total(b.unchecked), b.total(b.checkpointed)
        # What the graph says a block keeps, plus its output (the next block's input), against
        # what the block held between its forward and backward stages, measured (compiled).
        assert 0.9 <= b.measured_unchecked / (unchecked - x.nbytes + b.outputs) <= 1.1, b
        assert 0.9 <= b.measured_checkpointed / (checkpointed - x.nbytes + b.outputs) <= 1.1, b
        kinds = {s.made_by for s in b.checkpointed}
        assert {"qkv (nn.Linear output)", "down (nn.Linear output)", "argument"} <= kinds
    assert not any(nv.is_checkpointed(b) for b in model.layers), "the report left the blocks changed"


def test_a_checkpointed_block_keeps_its_input_and_the_report_prints_and_writes_json(transformer, tmp_path):
    model, x, loss = transformer
    nv.checkpoint_layers(model)
    report = nv.saved_activations(nv.TrainingStep(model, loss), x)
    assert all(nv.is_checkpointed(b) for b in model.layers)
    nv.checkpoint_layers(model, enable=False)
    for b in report.blocks:
        assert [(s.made_by, s.nbytes) for s in b.checkpointed] == [("argument", x.nbytes)]
        assert b.total(b.unchecked) > 8 * x.nbytes
    text = str(report)
    assert "block 0 (layers.0, TransformerBlock)" in text and "checkpointed (save_nothing)" in text
    assert "Softmax" in text and "all blocks:" in text
    data = json.loads(report.save_json(tmp_path / "saved.json").read_text())
    assert data["policy"] == "save_nothing" and data["blocks"][0]["unchecked_bytes"] == report.blocks[0].total(
        report.blocks[0].unchecked
    )


def test_a_block_that_cannot_be_exported_says_why():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = mx.ones((4, 4))

        def __call__(self, x):  # a checkpoint inside the block: MLX cannot export its custom function
            return nv.checkpoint_flat(lambda xs: [xs[0] @ xs[1]])([x, self.w])[0]

    model = nn.Module()
    model.layers = [Custom()]
    report = nv.saved_activations(nv.TrainingStep(model, lambda m, x: m.layers[0](x).sum()), mx.ones((2, 4)))
    (b,) = report.blocks
    assert b.unchecked is None and "CustomTransforms" in b.error and "not listed" in str(report)
