"""nuvec_mlx.mlx_lm.ssm: mlx-lm's state-space scan (Mamba-2's SSD) in checkpointed chunks of its own ssm_attn:
mlx-lm's values, final state and gradients; its memory linear in the sequence and below mlx-lm's."""

import mlx.core as mx
import pytest
from mlx_lm.models import ssm as mlx_lm_ssm

import nuvec_mlx as nv
from nuvec_mlx.mlx_lm.ssm import make_ssm_update, ssm_update
from tests.helpers import assert_close, recurrence_gradients, rise

NAMES = ("hidden_states", "A_log", "B", "C", "D", "dt", "dt_bias", "state")


def inputs(batch=2, length=100, heads=4, head_dim=8, groups=2, size=16, state=True, seed=2):
    keys = mx.random.split(mx.random.key(seed), 8)
    out = [
        mx.random.normal((batch, length, heads, head_dim), key=keys[0]),
        mx.log(mx.random.uniform(1, 16, (heads,), key=keys[1])),
        mx.random.normal((batch, length, groups, size), key=keys[2]),
        mx.random.normal((batch, length, groups, size), key=keys[3]),
        mx.random.normal((heads,), key=keys[4]),
        mx.random.normal((batch, length, heads), key=keys[5]),
        mx.random.normal((heads,), key=keys[6]),
        0.1 * mx.random.normal((batch, heads, head_dim, size), key=keys[7]) if state else None,
    ]
    mx.eval([x for x in out if x is not None])
    return out


@pytest.mark.parametrize("chunk", [16, 37, 256])
@pytest.mark.parametrize("state", [True, False], ids=["state", "no-state"])
def test_values_final_state_and_gradients_are_mlx_lm_s(chunk, state):
    args = inputs(state=state)
    update = make_ssm_update(chunk=chunk)
    y, s = update(*args)
    y_ref, s_ref = mlx_lm_ssm.ssm_update(*args)
    assert_close(y, y_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)
    if chunk == 256:  # one chunk of mlx-lm's own step: its operations, in its order
        assert mx.array_equal(y, y_ref).item() and mx.array_equal(s, s_ref).item()
    for g, e in zip(recurrence_gradients(update, args), recurrence_gradients(mlx_lm_ssm.ssm_update, args), strict=True):
        assert_close(g, e, 1e-5)


def test_a_left_padding_mask_and_mlx_lm_s_own_inference_paths():
    """mlx-lm's mask pads prompts on the left (its ssm_attn drops a chunk's state update where the chunk's
    last token is masked, so masks elsewhere give other values for other chunk sizes, in mlx-lm too)."""
    args = inputs()
    mask = (mx.arange(100)[None] >= mx.array([[0], [30]])).astype(mx.float32)
    update = make_ssm_update(chunk=16)
    y, s = update(*args, (0.001, 100.0), mask)
    y_ref, s_ref = mlx_lm_ssm.ssm_update(*args, (0.001, 100.0), mask)
    assert_close(y, y_ref, 1e-5)
    assert_close(s, s_ref, 1e-5)
    lengths = mx.array([100, 60])  # a cache's padded batch: mlx-lm's own path
    got = update(*args, (0.001, 100.0), None, lengths)
    expected = mlx_lm_ssm.ssm_update(*args, (0.001, 100.0), None, lengths)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, expected))


def test_compiled_and_staged_as_uncompiled(compiled):
    args = inputs()

    def step(*xs):
        def loss(xs):
            y, s = ssm_update(*xs)
            return (y**2).sum() + s.sum()

        return nv.value_and_grad_flat(loss, list(range(8)))(list(xs))

    expected = step(*args)
    nv.eval(expected)
    compiled_step = nv.compile(step)
    for _ in range(2):
        got = compiled_step(*args)
        with nv.memory.timeline() as timeline:
            nv.eval(got)
    assert compiled_step.traces == 1
    assert_close(got[0], expected[0], 1e-6)
    assert_close(got[1], expected[1], 1e-5)
    # 100 tokens in chunks of 64: two forward, the outputs' cotangents, two backward.
    assert [r.kind for r in timeline.readings] == ["chunk"] * 5 + ["outputs"]


def test_memory_grows_linearly_with_the_sequence_below_mlx_lm_s():
    """A staged gradient step of the scan alone (8 heads of 32, state 32, batch 1) at 128, 256 and 512
    tokens: at most 2.1x per doubling, and at 512 under half of mlx-lm's (every chunk's matrices alive)."""

    def measure(update, length):
        args = inputs(batch=1, length=length, heads=8, head_dim=32, groups=1, size=32, state=False)[:7]
        vg = nv.value_and_grad_flat(lambda xs: (update(*xs)[0] ** 2).sum(), list(range(7)))
        return rise(lambda: vg(args), nv.eval)

    rises = [measure(ssm_update, n) for n in (128, 256, 512)]
    assert rises[1] <= 2.1 * rises[0] and rises[2] <= 2.1 * rises[1], rises
    whole = measure(mlx_lm_ssm.ssm_update, 512)
    assert rises[2] <= whole / 2, (rises, whole)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"hidden_states": 1}, TypeError, "hidden_states must be an mlx.core.array"),
        ({"mask": [1]}, TypeError, "mask must be an mlx.core.array or None"),
        ({"hidden_states": mx.zeros((2, 100, 32))}, ValueError, "hidden_states must be"),
        ({"B": mx.zeros((2, 100, 3, 16))}, ValueError, "B must be"),
        ({"C": mx.zeros((2, 99, 2, 16))}, ValueError, "C must be"),
        ({"dt": mx.zeros((2, 100, 3))}, ValueError, "dt must be"),
        ({"state": mx.zeros((2, 4, 8, 8))}, ValueError, "state must be"),
        ({"mask": mx.ones((2, 99))}, ValueError, "mask must be"),
    ],
    ids=lambda v: v.split(" ")[0] if isinstance(v, str) else "",
)
def test_bad_arguments_raise_naming_them(change, error, match):
    args = dict(zip(NAMES, inputs()))
    args.update(change)
    with pytest.raises(error, match=match):
        ssm_update(**args)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        make_ssm_update(chunk=0)
