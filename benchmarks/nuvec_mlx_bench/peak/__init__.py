"""``nuvec-mlx-bench``: the peak-memory benchmark of the seed workloads, every checkpointing strategy side by side.

:mod:`.command` runs it; :mod:`.depth` measures the depth sweep's growth per
block, :mod:`.targets` checks the targets, :mod:`.report` writes the tables and plots.
"""
