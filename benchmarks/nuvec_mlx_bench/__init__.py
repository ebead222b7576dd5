"""nuvec_mlx's benchmark, one tool of four commands over a shared core.

- :mod:`.peak` (``nuvec-mlx-bench``): the seed workloads' peak memory and time, every strategy;
- :mod:`.sweep` (``nuvec-mlx-bench-sweep``): the seed step against ``nv.eval``'s throttle;
- :mod:`.plan` (``nuvec-mlx-bench-plan``): the planner against budgets and fixed rules;
- :mod:`.train` (``nuvec-mlx-bench-train``): mlx-lm models fine-tuned, mlx-lm's checkpoint against nuvec's;
- :mod:`.seed`: the seed workloads (the MLP and the transformer of blocks) and their steps;
- :mod:`.peers`: the seed workloads in PyTorch and JAX, each in a process of its own;
- :mod:`.core`: measuring in rounds, the environment, the command-line values, the plots;
- :mod:`.testing`: the models the benchmark and nuvec_mlx's tests build.

A distribution of its own (``benchmarks/pyproject.toml``, ``nuvec-mlx-bench``),
so that the library's wheel carries none of it: ``pip install -e benchmarks``
beside ``pip install -e .`` (``bash scripts/setup.sh bench`` does both).
``benchmarks/probes/`` holds scripts that are not part of it, and
``benchmarks/results/`` the figures of past runs (no code).
"""
