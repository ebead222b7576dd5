"""nuvec-compile 0.6.1's checkpoint memory test, ported: same model, same shapes."""

from nuvec_mlx_bench import workloads


def test_checkpointed_blocks_lower_peak_memory_under_compile(compiled):
    plain = workloads.peak(workloads.build("none-policy"))
    checkpointed = workloads.peak(workloads.build("nuvec"))
    assert checkpointed * 10 <= plain * 6, (
        f"checkpointed peak {checkpointed} bytes is not at most 60% of {plain}"
    )
