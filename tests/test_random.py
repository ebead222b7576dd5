"""The one place that reaches MLX's per-thread random key (nuvec_mlx._random)."""

import mlx.core as mx
import pytest

from nuvec_mlx import _random


def test_key_is_the_threads_current_key():
    mx.random.seed(3)
    assert _random.key() is mx.random.state[0]


def test_drawing_from_a_key_replays_its_draws_and_puts_the_key_back():
    mx.random.seed(4)
    saved = mx.random.state[0]
    draws = []
    for key in (mx.random.key(9), mx.random.key(9), mx.random.key(10)):
        with _random.drawing_from(key):
            draws.append(mx.random.uniform(shape=(3,)))
        assert mx.random.state[0] is saved
    assert mx.array_equal(draws[0], draws[1]).item()
    assert not mx.array_equal(draws[0], draws[2]).item()


def test_drawing_from_puts_the_key_back_when_the_block_raises():
    saved = mx.random.state[0]
    with pytest.raises(KeyError):
        with _random.drawing_from(mx.random.key(1)):
            raise KeyError
    assert mx.random.state[0] is saved


def test_restored_on_error_puts_the_key_back_only_on_error():
    saved = mx.random.state[0]
    with pytest.raises(KeyError):
        with _random.restored_on_error():
            mx.random.uniform(shape=(1,))  # advances the key
            raise KeyError
    assert mx.random.state[0] is saved
    with _random.restored_on_error():
        mx.random.uniform(shape=(1,))
    assert mx.random.state[0] is not saved


def test_an_mlx_that_hides_the_key_list_fails_loudly(monkeypatch):
    class Opaque:
        def __iter__(self):  # a generator: no list behind it to reach
            yield mx.random.key(0)

    monkeypatch.setattr(mx.random, "state", Opaque())
    with pytest.raises(RuntimeError, match="cannot reach mx.random.state's key in MLX"):
        _random.key()
