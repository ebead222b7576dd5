"""Throw-away probe: what nuvec's checkpoint costs beside ``mx.checkpoint``, one part taken away at a time.

nuvec's checkpoint on every block inside mlx-lm's own step (the benchmark's ``nuvec-mx-eval``:
``mx.compile``, one ``mx.eval``, no stages), against mlx-lm's ``grad_checkpoint`` (``mlx-lm``), with
parts of the checkpoint replaced while the step is traced (monkeypatched, never in the library):

- ``mx-depends``: MLX's own ``mx.depends`` in place of ``_depends.depends`` (a custom function);
- ``no-marks``: no stage marks and no chain between a block's gradients;
- ``no-order``: the recomputation does not wait for the cotangents;
- ``no-also-into``: the outputs are not tied to the forward's graph (as ``allow_captured=True``);
- ``bare``: all four.

Peaks and times round-robin in one process (``nuvec_mlx_bench.measure.run_cases``)::

    python benchmarks/probes/checkpoint_cost.py OUT.json                     # the H200 size (1B Llama)
    python benchmarks/probes/checkpoint_cost.py OUT.json --hidden 128 --seq 256 --repeats 3
"""

import contextlib
import importlib
import types

import mlx.core as mx

from nuvec_mlx import _depends
from nuvec_mlx_bench.train_steps import Case

from lora_time import measure_and_report, workload_and_args  # this folder's probe: its workload and report

nv_checkpoint = importlib.import_module("nuvec_mlx.checkpoint")  # the module (the package exports the function)


def _unordered(inputs, dependencies):
    return list(inputs)


def _mx_depends(inputs, dependencies):
    return list(mx.depends(list(inputs), list(dependencies))) if inputs and dependencies else list(inputs)


#: For each variant, the (owner, attribute, value) replaced while its step is traced.
PATCHES = {
    "nuvec": [],
    "mx-depends": [(_depends, "depends", _mx_depends)],
    "no-marks": [(_stages, "mark", lambda arrays, kind, modules=(): list(arrays)),
                 (_stages, "chained", list)],
    "no-order": [(nv_checkpoint, "_depends", types.SimpleNamespace(depends=_unordered))],
    "no-also-into": [(nv_checkpoint, "_also_into", lambda outputs, graph: list(outputs))],
}
PATCHES["bare"] = [p for name in ("no-marks", "no-order", "no-also-into") for p in PATCHES[name]]


@contextlib.contextmanager
def patched(patches):
    held = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in held:
            setattr(owner, name, value)


def main() -> None:
    w, a = workload_and_args()
    cases = {}
    c = Case(w, "mlx-lm")
    cases["mlx-lm"] = (lambda c=c, b=c.batch(w.seq): c.step(b), c.evaluate)
    for name, patches in PATCHES.items():
        c = Case(w, "nuvec-mx-eval")

        def step(c=c, b=c.batch(w.seq), patches=patches):
            with patched(patches):
                return c.step(b)

        cases[name] = (step, c.evaluate)
    measure_and_report(cases, w, a)


if __name__ == "__main__":
    main()
