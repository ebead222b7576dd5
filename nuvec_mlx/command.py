"""Deprecated home of the ``nuvec-mlx-plan`` command: it is :mod:`nuvec_mlx.mlx_lm.plan`.

``python -m nuvec_mlx.command`` still runs it, with a warning.
"""

import sys
import warnings

from .mlx_lm.plan import main

if __name__ == "__main__":
    warnings.warn(
        "python -m nuvec_mlx.command is deprecated: run nuvec-mlx-plan (or python -m nuvec_mlx.mlx_lm.plan)",
        FutureWarning,
        stacklevel=1,
    )
    sys.exit(main())
