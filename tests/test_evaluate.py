"""nv.eval: mx.eval's arguments, a step's stages one by one, a throttle above the active memory, stages ahead."""

import math
import operator

import mlx.core as mx
import pytest

import nuvec_mlx as nv
from nuvec_mlx import evaluate
from nuvec_mlx.memory import MiB
from tests.helpers import FlatStep, assert_close, assert_evaluated, lazy_arrays, rise


@pytest.mark.parametrize("throttle", [None, 0, math.inf], ids=["default", "0", "inf"])
def test_eval_computes_every_array_of_nested_containers_and_several_arguments(throttle):
    x, y, z, w = lazy_arrays(MiB, 4)
    mx.synchronize()
    before = mx.get_active_memory()
    nv.eval(x, [y, {"z": (z,)}], {"w": w, "note": "text", "none": None}, throttle=throttle)
    assert_evaluated(before, 4 * MiB)
    assert_close(w, mx.full((MiB // 4,), 5.0))


def test_eval_takes_what_mx_eval_takes():
    import mlx.nn as nn

    layer = nn.Linear(4, 4)
    (layer.weight,) = lazy_arrays(MiB)
    mx.random.uniform(shape=(2,))  # the random state now holds an unevaluated key
    mx.synchronize()
    before = mx.get_active_memory()
    nv.eval(layer.state, mx.random.state, 3.0, None, "s", [1, (2,)], throttle=0)
    nv.eval()
    assert_evaluated(before, MiB)


@pytest.mark.parametrize("throttle", [0, MiB, math.inf])
def test_eval_restores_the_memory_limit(throttle):
    before = mx.get_memory_limit()
    nv.eval([mx.ones((MiB,)) * 3], throttle=throttle)
    assert mx.get_memory_limit() == before


def test_eval_restores_the_memory_limit_when_evaluation_raises(monkeypatch):
    before = mx.get_memory_limit()
    seen = []

    def failing_eval(*args):
        seen.append(mx.get_memory_limit())
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(mx, "eval", failing_eval)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        nv.eval(mx.ones((4,)), throttle=MiB)
    assert seen and seen[0] < before  # the throttle was on ...
    assert mx.get_memory_limit() == before  # ... and is off again


def test_eval_never_loosens_a_tighter_user_limit(monkeypatch):
    seen = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (seen.append(mx.get_memory_limit()), real_eval(*a)))
    mx.synchronize()
    tight = mx.get_active_memory() + 100 * MiB
    previous = mx.set_memory_limit(tight)
    try:
        nv.eval(mx.ones((4,)), throttle=10**15)
        assert seen == [tight]
    finally:
        mx.set_memory_limit(previous)


@pytest.mark.parametrize("given", ["argument", "context"])
def test_a_throttle_is_bytes_above_the_memory_active_when_the_evaluation_starts(monkeypatch, given):
    """nv.eval(throttle=) and nv.memory.throttle are relative: MLX's limit is the active memory plus the
    throttle, whatever is held (a budget, in nv.plan, is absolute)."""
    headroom, real_eval = [], mx.eval
    monkeypatch.setattr(
        mx, "eval", lambda *a: headroom.append(mx.get_memory_limit() - mx.get_active_memory()) or real_eval(*a)
    )
    for held in (0, 64 * MiB):
        ballast = mx.zeros((held // 4,))
        real_eval(ballast)
        if given == "argument":
            nv.eval(lazy_arrays(MiB), throttle=MiB)
        else:
            with nv.memory.throttle(MiB):
                nv.eval(lazy_arrays(MiB))
        del ballast
    assert headroom == [MiB, MiB]


def test_eval_with_a_throttle_holds_back_what_runs_ahead_by_blocks_of_activations(compiled):
    # A plain step has no stages: only the throttle can hold MLX's evaluator back. Measured on this CPU:
    # 16.5 MiB unthrottled, 11.0 within 1 MiB, 11 of a block's hidden activations fewer.
    sc = FlatStep("mlp", checkpointed=False, batch=256, dim=128, blocks=6)
    nv.eval(sc.step(sc.inputs))
    unlimited = rise(lambda: sc.step(sc.inputs), lambda o: nv.eval(o, throttle=math.inf))
    throttled = rise(lambda: sc.step(sc.inputs), lambda o: nv.eval(o, throttle=MiB))
    hidden = 4 * sc.inputs[-1].nbytes  # one block's hidden activation (batch x 4 dim)
    assert throttled <= unlimited - 2 * hidden, (throttled / MiB, unlimited / MiB)


@pytest.mark.parametrize("throttle, error", [(-5, ValueError), ("big", TypeError)])
def test_eval_bad_throttle_raises(throttle, error):
    with pytest.raises(error, match="throttle"):
        nv.eval(mx.ones(2), throttle=throttle)


def _mlp_step(strategy: str, batch: int = 256, dim: int = 64, blocks: int = 6, weight_grads: bool = False):
    """The seed's MLP step: ``"none"`` plain, ``"nuvec"`` every block checkpointed."""
    return FlatStep("mlp", strategy == "nuvec", batch, dim, blocks, weight_grads=weight_grads)


class EvalSpy:
    """Records each mx.eval that nv.eval makes: active memory after it, its peak above its start."""

    def __init__(self, monkeypatch):
        self.calls, real = [], mx.eval

        def spy(*args):
            mx.synchronize()
            start = mx.get_active_memory()
            mx.reset_peak_memory()
            real(*args)
            mx.synchronize()
            self.calls.append((args, mx.get_active_memory(), mx.get_peak_memory() - start))

        monkeypatch.setattr(mx, "eval", spy)


def test_a_step_without_checkpoints_is_mx_eval_itself(monkeypatch, compiled):
    sc = _mlp_step("none")
    outputs = sc.step(sc.inputs)
    limits = []
    monkeypatch.setattr(mx, "set_memory_limit", lambda n: limits.append(n))
    spy = EvalSpy(monkeypatch)
    nv.eval(outputs, "x")
    assert [args for args, _, _ in spy.calls] == [(outputs, "x")]
    assert limits == []  # no throttle either


@pytest.mark.parametrize("weight_grads", [False, True], ids=["input grad", "weight grads"])
def test_a_checkpointed_step_is_evaluated_forward_then_backward_one_block_at_a_time(
    monkeypatch, compiled, weight_grads
):
    blocks, batch, dim = 6, 256, 64
    plain = _mlp_step("none", batch, dim, blocks, weight_grads)
    with nv.memory.measure() as m:
        mx.eval(plain.step(plain.inputs))
    sc = _mlp_step("nuvec", batch, dim, blocks, weight_grads)
    nv.eval(sc.step(sc.inputs))  # compile
    outputs = sc.step(sc.inputs)
    mx.synchronize()
    active = [mx.get_active_memory()]
    spy = EvalSpy(monkeypatch)
    nv.eval(outputs, throttle=math.inf)
    # A stage after each block's forward, one after each block's backward, then the outputs.
    assert len(spy.calls) == 2 * blocks + 1
    active += [after for _, after, _ in spy.calls]
    block_input = 4 * batch * dim
    block_grads = 4 * 8 * dim * dim if weight_grads else 0
    forward, backward = active[: blocks + 1], active[blocks + 1 : -1]
    # Forward stages keep one more block input each (and a mark of a byte or
    # so); each backward stage after
    # the first (the last block's) frees its block's input and keeps, at most,
    # its weight gradients.
    assert all(0 <= b - a - block_input < 64 for a, b in zip(forward, forward[1:])), forward
    grown = [b - a for a, b in zip(backward, backward[1:])]
    assert all(g <= block_grads - block_input + 4096 for g in grown[:-1]), backward
    assert grown[-1] <= block_grads + 4096, backward  # the first block's input is the step's own
    # No stage ran more than about one block: a wrong order would run all in one.
    assert max(peak for _, _, peak in spy.calls) <= 0.25 * m.rise


@pytest.mark.slow
def test_a_checkpointed_step_through_nv_eval_peaks_far_below_the_plain_step(compiled):
    def peak(strategy, evaluate):
        sc = _mlp_step(strategy, blocks=8)
        evaluate(sc.step(sc.inputs))
        return max(rise(lambda: sc.step(sc.inputs), evaluate) for _ in range(3))

    plain, staged = peak("none", mx.eval), peak("nuvec", nv.eval)
    assert staged <= 0.30 * plain, f"{staged / plain:.3f} of the plain peak"


@pytest.mark.slow
def test_stages_not_taken_by_nv_eval_keep_no_memory(compiled):
    sc = _mlp_step("nuvec")
    nv.eval(sc.step(sc.inputs))
    with pytest.warns(nv.NotStagedWarning):  # each step below runs unstaged, and says so
        out = sc.step(sc.inputs)
        mx.eval(out)
        del out
        start = nv.memory.stats().active
        for _ in range(20):  # more steps than the registry of steps remembers
            out = sc.step(sc.inputs)
            mx.eval(out)  # the stages are never evaluated on their own
        del out
    assert abs(nv.memory.stats().active - start) < 4096


def test_a_step_called_twice_before_evaluation_stages_only_what_is_evaluated(monkeypatch, compiled):
    sc = _mlp_step("nuvec", blocks=3)
    first, second = sc.step(sc.inputs), sc.step(sc.inputs)
    spy = EvalSpy(monkeypatch)
    nv.eval(second)
    assert len(spy.calls) == 2 * 3 + 1  # second's stages, not first's
    nv.eval(first)
    assert len(spy.calls) == 2 * (2 * 3 + 1)
    assert all(mx.array_equal(a, b).item() for a, b in zip(first, second))


def test_checkpoints_inside_a_users_own_mx_compile_evaluate_unstaged_and_right(monkeypatch, compiled):
    block = nv.checkpoint_flat(lambda xs: [xs[0] + mx.tanh(xs[0] @ xs[1])])
    vg = nv.value_and_grad_flat(lambda xs: block(block(xs) + xs[1:])[0].sum(), [0, 1])
    step = mx.compile(lambda x, w: vg([x, w]))
    x, w = mx.ones((4, 4)) * 0.5, mx.eye(4) * 0.1
    expected = vg([x, w])
    nv.eval(expected)
    with pytest.warns(nv.NotStagedWarning, match="inside mx.compile, compile with nv.compile"):
        for _ in range(2):
            value, grads = step(x, w)
            spy = EvalSpy(monkeypatch)
            nv.eval(value, grads)  # the stages made inside the user's trace are not these arrays'
            assert len(spy.calls) == 1
            monkeypatch.undo()
            assert_close([value, *grads], [expected[0], *expected[1]], 1e-6)


class QueueSpy:
    """Records, in order, what nv.eval queues (mx.async_eval) and waits for (mx.eval)."""

    def __init__(self, monkeypatch):
        self.events, real_async, real_eval = [], mx.async_eval, mx.eval
        monkeypatch.setattr(mx, "async_eval", lambda *args: self.events.append(("queue", args)) or real_async(*args))
        monkeypatch.setattr(mx, "eval", lambda *args: self.events.append(("wait", args)) or real_eval(*args))

    def order(self) -> list[tuple[str, int]]:
        """Each event and the place of what it evaluated among what was waited for (the n-th wait's is n)."""
        waited = [args for op, args in self.events if op == "wait"]
        place = lambda args: next(i for i, w in enumerate(waited) if all(map(operator.is_, w, args)))  # noqa: E731
        return [(op, place(args)) for op, args in self.events]


def checkpointed_step(blocks=3):
    """The benchmark's MLP, every block checkpointed, compiled (its first step run)."""
    sc = _mlp_step("nuvec", blocks=blocks)
    nv.eval(sc.step(sc.inputs))
    return sc


def queued_and_waited(monkeypatch, sc, ahead):
    """What nv.eval(outputs, ahead=ahead) queues and waits for, in order, for a step of ``sc``; and
    the outputs, and what the last wait evaluated."""
    outputs = sc.step(sc.inputs)
    spy = QueueSpy(monkeypatch)
    nv.eval(outputs, ahead=ahead)
    monkeypatch.undo()
    return spy.order(), outputs, spy.events[-1][1]


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_eval_ahead_queues_that_many_stages_past_the_one_it_waits_for(monkeypatch, compiled, ahead):
    blocks = 3
    events, outputs, last = queued_and_waited(monkeypatch, checkpointed_step(blocks), ahead)
    work = 2 * blocks + 1  # a forward and a backward stage per block, then the outputs
    waits = [i for op, i in events if op == "wait"]
    assert waits == list(range(work)) and last == (outputs,)  # every stage, in order, then the outputs
    for n, (op, i) in enumerate(events):
        if op == "wait":
            queued = [j for o, j in events[:n] if o == "queue"]
            assert queued == (list(range(min(work, i + 1 + ahead))) if ahead else []), (i, queued)


def test_eval_queues_the_devices_default_stages_ahead_unless_told(monkeypatch, compiled):
    """ahead=None is nv.default_ahead(): 1 on a GPU, 0 on the CPU (a loop of your own gets the trainer's)."""
    assert (nv.default_ahead(mx.gpu), nv.default_ahead(mx.cpu)) == (1, 0)
    assert (nv.default_ahead(mx.Device(mx.gpu, 0)), nv.default_ahead(mx.Device(mx.cpu))) == (1, 0)
    assert nv.default_ahead() == nv.default_ahead(mx.default_device())
    sc = checkpointed_step()
    order = {ahead: queued_and_waited(monkeypatch, sc, ahead)[0] for ahead in (0, 1, 2)}
    assert queued_and_waited(monkeypatch, sc, None)[0] == order[nv.default_ahead()]
    for default in (1, 2):  # as on a GPU, and more
        monkeypatch.setattr(evaluate, "default_ahead", lambda device=None, default=default: default)
        assert queued_and_waited(monkeypatch, sc, None)[0] == order[default] != order[0]  # (it undoes the patch)


def test_eval_ahead_gives_the_results_of_waiting_for_every_stage(compiled):
    results = []
    for ahead in (0, 1, 2):
        sc = _mlp_step("nuvec", blocks=4, weight_grads=True)
        outputs = sc.step(sc.inputs)
        nv.eval(outputs, ahead=ahead)
        results.append(outputs)
    for other in results[1:]:
        assert all(mx.array_equal(a, b).item() for a, b in zip(results[0], other))


@pytest.mark.parametrize("watch", ["timeline", "ceiling"])
def test_eval_waits_for_every_stage_while_memory_is_read_after_each(monkeypatch, compiled, watch):
    sc = _mlp_step("nuvec", blocks=3)
    nv.eval(sc.step(sc.inputs))
    queued = []
    monkeypatch.setattr(mx, "async_eval", lambda *args: queued.append(args))
    context = nv.memory.timeline() if watch == "timeline" else nv.memory.ceiling(1 << 40)
    with context:
        nv.eval(sc.step(sc.inputs), ahead=2)
    assert queued == []


@pytest.mark.parametrize("synchronize", [False, True])
def test_eval_synchronize_waits_for_the_device_after_every_stage_only_when_asked(monkeypatch, compiled, synchronize):
    blocks = 3
    sc = _mlp_step("nuvec", blocks=blocks)
    nv.eval(sc.step(sc.inputs))  # compile
    outputs = sc.step(sc.inputs)
    events = []
    real_eval, real_synchronize = mx.eval, mx.synchronize
    monkeypatch.setattr(mx, "eval", lambda *a: events.append("eval") or real_eval(*a))
    monkeypatch.setattr(mx, "synchronize", lambda *a: events.append("synchronize") or real_synchronize(*a))
    nv.eval(outputs, throttle=math.inf, synchronize=synchronize)  # no throttle: it synchronizes once itself
    per_stage = ["eval", "synchronize"] if synchronize else ["eval"]
    assert events == per_stage * 2 * blocks + ["eval"]  # then the outputs, as mx.eval leaves them
