"""``python -m nuvec_mlx_bench.train``: the command of :mod:`.command`."""

import sys

from .command import main

sys.exit(main())
