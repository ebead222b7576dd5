"""The public API from several threads at once (MLX 0.32).

MLX keeps the random key per thread, so does nuvec's throttle (a contextvar);
mx.set_memory_limit is process-wide, and nv.eval changes it under a lock.
"""

import threading

import mlx.core as mx
import pytest

import nuvec_mlx as nv

THREADS = 4


def run_in_threads(work):
    """Run ``work(t)`` for t in range(THREADS) at once; return results, re-raise errors."""
    barrier = threading.Barrier(THREADS)
    results, errors = {}, []

    def target(t):
        try:
            barrier.wait()
            results[t] = work(t)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results


ck = nv.checkpoint_flat(lambda xs: [xs[0] + mx.tanh(xs[0] @ xs[1])])
grads = nv.grad_flat(lambda xs: ck(ck(xs) + xs[1:])[0].sum(), [0, 1])


def inputs(seed):
    k = mx.random.split(mx.random.key(seed), 2)
    return [mx.random.normal((8, 8), key=k[0]), mx.random.normal((8, 8), key=k[1]) * 0.1]


def equal(xs, ys):
    return len(xs) == len(ys) and all(mx.array_equal(x, y).item() for x, y in zip(xs, ys))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compile_step", [False, True], ids=["eager", "compiled"])
def test_eval_from_four_threads_gives_serial_values_and_restores_the_limit(compile_step, compiled):
    step = nv.compile_flat(grads) if compile_step else grads
    expected = {t: step(inputs(t)) for t in range(THREADS)}
    nv.eval(expected)
    limit = mx.get_memory_limit()

    def work(t):
        for _ in range(20):
            out = step(inputs(t))
            nv.eval(out, throttle=1 << 12)
        return out

    results = run_in_threads(work)
    assert mx.get_memory_limit() == limit
    for t in range(THREADS):
        assert equal(results[t], expected[t]), f"thread {t} got other gradients"
    if compile_step:
        assert step.traces == 1 + THREADS  # MLX keeps compiled functions per thread


def test_compiled_step_draws_from_the_calling_threads_key(compiled):
    step = nv.compile_flat(lambda xs: [xs[0] + mx.random.uniform(shape=(3,))])

    def draws(t, fn):
        mx.random.seed(200 + t)
        out = [fn([mx.zeros((3,))])[0] for _ in range(3)]
        mx.eval(out)
        return [o.tolist() for o in out], mx.random.state[0].tolist()

    eager = {t: draws(t, lambda xs: [xs[0] + mx.random.uniform(shape=(3,))]) for t in range(THREADS)}
    mx.random.seed(0)
    mx.eval(step([mx.zeros((3,))]))
    main_key = mx.random.state[0].tolist()
    results = run_in_threads(lambda t: draws(t, step))
    assert mx.random.state[0].tolist() == main_key
    for t in range(THREADS):
        assert results[t] == eager[t], f"thread {t} drew from another key"


def test_throttle_is_per_thread():
    default = nv.memory.current_throttle()  # DEFAULT_THROTTLE on CPU, inf on a GPU (CUDA, Metal)
    inside = threading.Barrier(THREADS)

    def work(t):
        with nv.memory.throttle(1000 + t):
            inside.wait()  # every thread has set its own throttle now
            seen = nv.memory.current_throttle()
            inside.wait()
        return seen, nv.memory.current_throttle()

    results = run_in_threads(work)
    for t in range(THREADS):
        assert results[t] == (1000 + t, default)


def dropout_block(xs):
    keep = mx.random.bernoulli(0.5, xs[0].shape)
    return [mx.tanh(xs[0] @ xs[1]) * keep]


def random_loss(block):
    return lambda xs: (block(block(xs) + xs[1:])[0] ** 2).sum()


def test_checkpoints_replay_each_threads_own_random_draws():
    checkpointed = nv.grad_flat(random_loss(nv.checkpoint_flat(dropout_block)), [0, 1])
    plain = nv.grad_flat(random_loss(dropout_block), [0, 1])

    def with_seed(fn, seed):
        mx.random.seed(seed)
        out = fn(inputs(seed))
        mx.eval(out)
        return out

    expected = {t: with_seed(plain, 100 + t) for t in range(THREADS)}
    key = mx.random.state[0].tolist()

    def work(t):
        out = []
        for _ in range(10):
            out.append(with_seed(checkpointed, 100 + t))
            nv.eval(out[-1])
        return out

    results = run_in_threads(work)
    assert mx.random.state[0].tolist() == key  # the main thread's key is untouched
    for t in range(THREADS):
        assert not equal(expected[t], expected[(t + 1) % THREADS])  # seeds matter
        for out in results[t]:
            assert equal(out, expected[t]), f"thread {t} replayed another thread's draws"
