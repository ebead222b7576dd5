"""nv.memory.timeline: memory after every stage, where the peak is, JSON and a plot."""

import json

import pytest

import nuvec_mlx as nv
from tests.helpers import FlatStep


def checkpointed_step(blocks=4):
    sc = FlatStep("mlp", batch=256, dim=64, blocks=blocks)
    nv.eval(sc.step(sc.inputs))
    return sc


def test_a_timeline_reads_every_stage_and_names_the_blocks(compiled):
    sc = checkpointed_step(blocks=4)
    with nv.memory.timeline() as t:
        nv.eval(sc.step(sc.inputs))
    assert [(r.kind, r.block) for r in t.readings] == [
        *(("forward", b) for b in (1, 2, 3, 4)),
        *(("backward", b) for b in (4, 3, 2, 1)),
        ("outputs", None),
    ]
    assert all(type(r) is nv.memory.StageReading for r in t.readings)
    seconds = [r.seconds for r in t.readings]
    assert seconds == sorted(seconds) and all(r.peak >= r.active for r in t.readings)
    assert t.peak().kind == "backward" and "backward pass of block" in t.describe()


def test_a_timeline_writes_json_and_a_png(tmp_path, compiled):
    sc = checkpointed_step()
    with nv.memory.timeline() as t:
        nv.eval(sc.step(sc.inputs))
        nv.eval(sc.step(sc.inputs))
    saved = json.loads(t.save_json(tmp_path / "t.json").read_text())
    assert len(saved["readings"]) == 2 * 9 and {r["evaluation"] for r in saved["readings"]} == {0, 1}
    assert saved["peak"]["name"] == t.peak().name()
    png = t.plot(tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_empty_timeline_says_so():
    with nv.memory.timeline() as t:
        pass
    with pytest.raises(ValueError, match="no nv.eval ran inside it"):
        t.peak()


def test_plotting_leaves_the_matplotlib_backend_and_figures_alone(tmp_path, compiled):
    import matplotlib
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    matplotlib.use("svg")  # as a notebook or script may have chosen
    try:
        figures = plt.get_fignums()
        sc = checkpointed_step()
        with nv.memory.timeline() as t:
            nv.eval(sc.step(sc.inputs))
        t.plot(tmp_path / "t.png")
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == figures
    finally:
        matplotlib.use(before)


def test_a_timeline_inside_another_reads_the_same_peaks(compiled):
    """Each timeline resets MLX's peak counter after its reading; the one inside another still reads
    every stage's peak, not 0 (and nv.plan inside a timeline plans from real peaks)."""
    sc = checkpointed_step(blocks=3)
    with nv.memory.timeline() as outer, nv.memory.timeline() as inner:
        nv.eval(sc.step(sc.inputs))
    assert all(r.peak >= r.active for r in inner.readings)
    assert [(r.kind, r.peak) for r in inner.readings] == [(r.kind, r.peak) for r in outer.readings]
