"""The unit nuvec's memory figures are given in: one home, public as :data:`nuvec_mlx.memory.MiB`."""

#: Bytes in a mebibyte: every figure in MiB is bytes / MiB.
MiB = 1 << 20
