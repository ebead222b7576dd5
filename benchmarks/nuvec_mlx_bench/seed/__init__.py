"""The seed workloads: the seed's MLP and a pre-norm decoder transformer of residual blocks.

:mod:`.workload` describes one (a model at a shape, and which gradients its
step takes) and its values on the host, without a framework, so that MLX and
the PyTorch and JAX peers take the very same step on the very same values;
:mod:`.strategies` builds it in MLX, checkpointed as each strategy says, from
the blocks of :mod:`nuvec_mlx_bench.testing`; :mod:`.floors` is the bytes a
checkpointed step cannot go below; :mod:`.rows` is the shape of a result row.
"""
