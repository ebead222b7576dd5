"""nuvec-compile 0.6.1's checkpoint memory test, ported: same model, same shapes."""

import pytest

from nuvec_mlx_bench.seed import strategies
from nuvec_mlx_bench.seed.workload import SEED
from tests.helpers import rise


def seed_peak(strategy: str) -> int:
    sc = strategies.build(strategy, SEED)
    return rise(lambda: sc.step(sc.inputs), sc.evaluate)


@pytest.mark.slow
def test_checkpointed_blocks_lower_peak_memory_under_compile(compiled):
    plain = seed_peak("none-policy")
    checkpointed = seed_peak("nuvec")
    assert checkpointed * 10 <= plain * 6, f"checkpointed peak {checkpointed} bytes is not at most 60% of {plain}"
