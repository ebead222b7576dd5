"""``python -m nuvec_mlx_bench.peers``: one peer measurement, check or calibration (:mod:`.process`)."""

import sys

from .process import main

sys.exit(main())
