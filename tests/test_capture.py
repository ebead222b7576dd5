"""The module search (nuvec_mlx._capture): every route it follows finds the module, once."""

import functools

import mlx.nn as nn
import pytest

from nuvec_mlx import _capture


class Holder:
    def __init__(self, value):
        self.value = value

    def method(self, x):
        return x


class Slotted:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class Hidden:
    """A module kept as a class attribute: classes are not searched."""

    module = None


class Owner(nn.Module):
    """A module keeping another one as a plain Python attribute (not a child)."""

    def __init__(self, other):
        super().__init__()
        object.__setattr__(self, "_other", other)


def _uses_global(x):
    return _GLOBAL_MODULE(x)


_GLOBAL_MODULE = nn.Linear(2, 2)

ROUTES = {
    "closure cell": lambda m: lambda x: m(x),
    "default": lambda m: lambda x, m=m: m(x),
    "keyword-only default": lambda m: lambda x, *, m=m: m(x),
    "partial argument": lambda m: functools.partial(lambda m, x: m(x), m),
    "partial keyword": lambda m: functools.partial(lambda x, m: m(x), m=m),
    "nested partial": lambda m: functools.partial(functools.partial(lambda m, x: m(x), m)),
    "list in a closure": lambda m: (lambda ms: lambda x: ms[0](x))([m]),
    "tuple in a list in a closure": lambda m: (lambda ms: lambda x: ms[0][1](x))([(1, m)]),
    "dict in a closure": lambda m: (lambda ms: lambda x: ms["m"](x))({"m": m}),
    "set in a closure": lambda m: (lambda ms: lambda x: next(iter(ms)).value(x))({Holder(m)}),
    "attribute of a plain object": lambda m: (lambda o: lambda x: o.value(x))(Holder(m)),
    "slot of a plain object": lambda m: (lambda o: lambda x: o.value(x))(Slotted(m)),
    "bound method's self": lambda m: Holder(m).method,
    "the module itself": lambda m: m,
    "a Python attribute of a module": lambda m: Owner(m),
    "helper function's closure": lambda m: (lambda helper: lambda x: helper(x))(lambda x: m(x)),
    "a lambda defined inside": lambda m: (lambda ms: lambda x: (lambda: ms[0](x))())([m]),
}


@pytest.mark.parametrize("route", ROUTES)
def test_every_followed_route_finds_the_module_once(route):
    m = nn.Linear(2, 2)
    found = _capture.modules(ROUTES[route](m))
    assert sum(f is m for f in found) == 1


def test_a_helper_functions_global_is_followed():
    assert _capture.modules(lambda x: _uses_global(x)) == [_GLOBAL_MODULE]


class _HasModel:
    def __init__(self, model):
        self.model = model


def test_an_attribute_name_that_is_also_a_global_name_does_not_reach_the_global():
    global model
    model = nn.Linear(2, 2)  # a script's global, named like an attribute fn reads
    try:
        owner = _HasModel(nn.Linear(2, 2))
        found = _capture.modules(lambda x: owner.model(x))
        assert found == [owner.model]
    finally:
        del model


def test_classes_python_modules_and_arrays_are_not_followed():
    Hidden.module = nn.Linear(2, 2)
    assert _capture.modules(lambda x: Hidden.module(x)) == []
    assert _capture.modules(lambda x: functools.reduce(x)) == []


def test_the_search_stops_after_limit_objects(monkeypatch):
    m = nn.Linear(2, 2)
    monkeypatch.setattr(_capture, "LIMIT", 50)
    deep = [[[] for _ in range(100)], m]  # the module comes after 100 objects
    assert _capture.modules(lambda x: deep) == []
    monkeypatch.setattr(_capture, "LIMIT", 500)
    assert _capture.modules(lambda x: deep) == [m]
