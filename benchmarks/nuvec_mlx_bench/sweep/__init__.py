"""``nuvec-mlx-bench-sweep``: the seed step's peak memory and time against ``nv.eval``'s throttle (:mod:`.command`)."""
