"""Data-parallel training with mx.distributed (ring backend), checkpointing on.

Two processes on localhost each run tests/distributed_worker.py on half of a
batch: a compiled, checkpointed step whose weight gradients are averaged by
mlx.nn.average_gradients inside the compiled function. The test compares what
they write against one process over the whole batch, and checks
nv.memory.all_stats in one process and in two.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import distributed_worker as worker
import mlx.core as mx
import pytest

import nuvec_mlx as nv
from nuvec_mlx.memory import MiB
from tests.helpers import assert_close
from tests.mlx_lm_folders import data_folder, model_folder

ANSI = re.compile(r"\x1b\[[0-9;]*m")

SIZE = 2
#: Seconds the two ranks may take together (about 10 s on a 2-core CPU).
TIMEOUT_S = 240
#: The checkpointed peak of each rank must be at most this fraction of its plain peak.
MAX_PEAK_RATIO = 0.6
#: Data-parallel gradients sum each half of the batch separately, so they differ
#: from one process's by rounding: in float32 about 1.1e-6 relative in max-norm
#: here (1024 rows), which 1e-6 cannot hold; in float64 (MLX's CPU backend) far
#: below it. One rank's gradients without the average are 0.75 off
#: (distributed_worker.inputs makes the halves differ).
GRAD_RTOL = {mx.float64: 1e-6, mx.float32: 1e-5}


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on localhost that were free a moment ago."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def launch(out_dir: Path, size: int, *args: str, env: dict | None = None) -> list[str]:
    """Run the worker (with ``args`` after its output folder) as ranks 0..size-1 of a ring on localhost;
    fail on error or timeout; each rank's output.

    MLX_RANK and MLX_HOSTFILE are what ``mlx.launch --backend ring`` sets;
    setting them here lets the test pick free ports and bound the time.
    """
    hostfile = out_dir / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(size)]))
    logs = [out_dir / f"rank{rank}.log" for rank in range(size)]
    procs = []
    for rank, log in enumerate(logs):
        rank_env = dict(os.environ, **(env or {}), MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
        with open(log, "w") as f:
            procs.append(
                subprocess.Popen(
                    [sys.executable, worker.__file__, str(out_dir), *args],
                    env=rank_env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        # A rank that failed leaves the other waiting on its socket: stop at the first failure.
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    if codes != [0] * size:
        output = "\n".join(f"--- rank {r} ---\n{log.read_text()}" for r, log in enumerate(logs))
        pytest.fail(
            f"ranks exited with {codes} (negative: killed at the {TIMEOUT_S} s timeout or by a failing peer)\n{output}"
        )
    return [log.read_text() for log in logs]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, compiled):
    """Launch the two ranks once; each rank's JSON report and gradients."""
    out_dir = tmp_path_factory.mktemp("distributed")
    launch(out_dir, SIZE)
    return [
        (json.loads((out_dir / f"rank{r}.json").read_text()), mx.load(str(out_dir / f"rank{r}.npz")))
        for r in range(SIZE)
    ]


def grads(arrays: dict, variant: str) -> list[mx.array]:
    """One variant's gradients from a rank's .npz, in input order."""
    return [arrays[f"{variant}_{i}"] for i in range(2 * worker.BLOCKS)]


def assert_grads_close(actual: list[mx.array], expected: list[mx.array], rtol: float, what: str):
    """helpers.assert_close on each gradient, naming the one that differs."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        try:
            assert_close(a, e, rtol)
        except AssertionError as error:
            error.add_note(f"{what}: gradient {i} of {len(expected)} (rtol {rtol:g})")
            raise


def test_ranks_ran_distributed_and_compiled(ranks):
    for rank, (report, _) in enumerate(ranks):
        assert (report["rank"], report["size"]) == (rank, SIZE)
        # Two calls of each step: 1 trace if MLX compiled, 2 if it silently did not.
        assert report["traces"] == {v: 1 for v in worker.VARIANTS}, (
            f"rank {rank}: traces {report['traces']}, expected 1 per step (compiled)"
        )


@pytest.mark.parametrize("dtype", [mx.float64, mx.float32], ids=["float64", "float32"])
def test_averaged_gradients_equal_one_process_over_the_whole_batch(ranks, dtype):
    one = worker.make_step(False, mx.distributed.init())
    expected = one(worker.inputs(0, 1, dtype))[:-1]
    mx.eval(expected)
    for rank, (_, arrays) in enumerate(ranks):
        for variant in worker.VARIANTS:
            actual = grads(arrays, variant)
            if actual[0].dtype == dtype:
                assert_grads_close(
                    actual, expected, GRAD_RTOL[dtype], f"rank {rank}, {variant} step against one process"
                )


def test_checkpointed_gradients_equal_plain_ones(ranks):
    for rank, (_, arrays) in enumerate(ranks):
        for suffix in ("", "64"):
            assert_grads_close(
                grads(arrays, f"ckpt{suffix}"),
                grads(arrays, f"plain{suffix}"),
                1e-6,
                f"rank {rank}, checkpointed against plain{suffix}",
            )


def test_every_rank_evaluates_the_checkpointed_step_in_the_same_stages(ranks):
    blocks = worker.BLOCKS
    expected = [
        *(f"forward {b}" for b in range(1, blocks + 1)),
        *(f"backward {b}" for b in range(blocks, 0, -1)),
        "outputs None",
    ]
    for rank, (report, _) in enumerate(ranks):
        assert report["stages"]["plain"] == ["outputs None"], f"rank {rank}: a plain step has no stages"
        assert report["stages"]["ckpt"] == expected, f"rank {rank}: {report['stages']['ckpt']}"


def test_checkpointing_lowers_each_ranks_peak(ranks):
    for rank, (report, _) in enumerate(ranks):
        plain, ckpt = report["peak"]["plain"], report["peak"]["ckpt"]
        print(f"rank {rank}: plain {plain / MiB:.2f} MiB, checkpointed {ckpt / MiB:.2f} MiB, ratio {ckpt / plain:.2f}")
        assert plain >= 4 * MiB, f"rank {rank}: plain peak {plain / MiB:.2f} MiB is too small to compare"
        assert ckpt <= MAX_PEAK_RATIO * plain, (
            f"rank {rank}: checkpointed peak {ckpt / MiB:.2f} MiB > {MAX_PEAK_RATIO} x "
            f"plain peak {plain / MiB:.2f} MiB (ratio {ckpt / plain:.2f})"
        )


def test_all_stats_gathers_every_rank_in_rank_order(ranks):
    own = [report["own_stats"] for report, _ in ranks]
    assert own[0] != own[1], "the ranks' counters are identical: rank order is untestable"
    for rank, (report, _) in enumerate(ranks):
        assert report["all_stats"] == own, f"rank {rank} gathered {report['all_stats']}, ranks read {own}"


@pytest.mark.parametrize("explicit_group", [False, True])
def test_all_stats_in_one_process_is_this_process(explicit_group):
    group = mx.distributed.init()
    assert group.size() == 1
    keep = mx.ones((MiB,))  # so that the counters are not all zero
    mx.eval(keep)
    own = nv.memory.stats()
    assert nv.memory.all_stats(group if explicit_group else None) == [own]


@pytest.mark.parametrize("group", [3, "ring", [None]])
def test_all_stats_rejects_a_non_group(group):
    with pytest.raises(TypeError, match="group must be an mlx.core.distributed.Group or None, got"):
        nv.memory.all_stats(group)


def test_training_reports_every_rank_s_peak_in_rank_order(tmp_path):
    """Under mlx.launch each rank measures its own steps: rank 0's report lines show every rank's peak, and
    every rank's callback gets the same list, its own peak at its rank."""
    from nuvec_mlx.mlx_lm._report import peak_text

    model = model_folder(tmp_path / "model", "llama", dtype="float32", hidden=32, layers=2)
    data = data_folder(tmp_path / "data")
    logs = launch(tmp_path, SIZE, "train", str(model), str(data), env={"MLX_DISABLE_COMPILE": "1"})
    told = [json.loads((tmp_path / f"train{rank}.json").read_text()) for rank in range(SIZE)]
    assert [len(t) for t in told] == [2, 2]
    lines = re.findall(r"peak per rank ([0-9.]+ [MG]B), ([0-9.]+ [MG]B)", ANSI.sub("", logs[0]))
    assert len(lines) == 2 and "peak" not in ANSI.sub("", logs[1]).replace("peak_memory", "")
    for report in range(2):
        per_rank = [t[report]["step_peak_memory_per_rank"] for t in told]
        assert per_rank[0] == per_rank[1] and len(per_rank[0]) == SIZE and all(p > 0 for p in per_rank[0])
        assert [t[report]["step_peak_memory"] for t in told] == per_rank[0]  # each rank's own, at its rank
        assert list(lines[report]) == [peak_text(round(p * 1e9)) for p in per_rank[0]]
