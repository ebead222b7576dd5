"""The PyTorch and JAX peers compute MLX's step, their peak probes read known allocations,
their processes never import MLX, and failures come back as data.

Sections follow the modules of ``benchmarks/peers/``.
"""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from nuvec_mlx.memory import MiB
from nuvec_mlx_bench import peers
from nuvec_mlx_bench.core import rounds
from nuvec_mlx_bench.peers import peak_probes, process
from nuvec_mlx_bench.seed import rows
from nuvec_mlx_bench.seed.workload import MODELS, Workload


def tiny(model: str = "mlp", weight_grads: bool = False) -> Workload:
    return Workload(model, batch=8, dim=16, blocks=3, seq=4 if model == "transformer" else 1, weight_grads=weight_grads)


def peer_process(*args: str) -> dict:
    """Run ``python -m nuvec_mlx_bench.peers`` as run_isolated does and return its JSON line."""
    proc = subprocess.run(
        [sys.executable, "-m", "nuvec_mlx_bench.peers", *args],
        env={**os.environ, **peak_probes.ENV},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


# --- __init__.py ----------------------------------------------------------------------


def test_available_lists_only_importable_peers_without_importing_them():
    loaded = {m for m in ("torch", "jax") if m in sys.modules}
    names = peers.available()
    assert set(names) <= set(peers.PEERS)
    assert {m for m in ("torch", "jax") if m in sys.modules} == loaded
    for peer in peers.PEERS:
        assert (peer in names) == (importlib.util.find_spec(peers.FRAMEWORKS[peer]) is not None)


# --- models.py, torch_peer.py, jax_peer.py: the same step as MLX's ---------------------


@pytest.mark.parametrize("weight_grads", [False, True])
@pytest.mark.parametrize("strategy", peers.STRATEGIES)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("peer", ["torch-eager", "jax-jit"])
def test_peer_step_matches_mlx(peer, model, strategy, weight_grads):
    pytest.importorskip(peers.FRAMEWORKS[peer])
    errors = process.check(peer, tiny(model, weight_grads), strategy)
    assert len(errors) == (3 * (2 if model == "mlp" else 4) + 2 if weight_grads else 2)
    assert max(errors) <= 1e-4, errors


def test_torch_compile_step_matches_mlx():
    """One case, the fullest: torch.compile on a CPU takes tens of seconds a graph."""
    pytest.importorskip("torch")
    errors = process.check("torch-compile", tiny("transformer", weight_grads=True), "checkpoint")
    assert max(errors) <= 1e-4, errors


@pytest.mark.parametrize("peer", ["torch-eager", "jax-jit"])
def test_check_path_checks_the_transformers_weight_gradients(peer):
    pytest.importorskip(peers.FRAMEWORKS[peer])
    r = peer_process(
        "--peer",
        peer,
        "--check",
        "--strategy",
        "checkpoint",
        *process.workload_args(tiny("transformer", weight_grads=True)),
    )
    assert len(r["errors"]) == 3 * 4 + 2 and r["max_error"] <= 1e-4, r


# --- peak_probes.py -------------------------------------------------------------------


def test_rss_probe_reads_a_known_allocation_not_what_was_held_before():
    code = """
import json
from nuvec_mlx_bench.core import rounds
from nuvec_mlx_bench.peers import peak_probes
held = b"\\x01" * (32 << 20)
probe = peak_probes.RssProbe()
def step():
    tmp = b"\\x02" * (16 << 20)  # freed before the 64 MiB: counted only by itself
    del tmp
    return [b"\\x03" * (4 << 20) for _ in range(16)]
print(json.dumps(rounds.measure({"step": (step, lambda out: None)}, 3, probe)["step"]))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **peak_probes.ENV}, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert 63.5 * MiB <= r["peak"]["min"] <= r["peak"]["median"] <= r["peak"]["max"] <= 65 * MiB, r
    assert 0 < r["time"]["min"] <= r["time"]["median"] <= r["time"]["max"]


def test_rss_probe_refuses_a_process_without_the_glibc_setting(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    with pytest.raises(RuntimeError, match="MALLOC_MMAP_THRESHOLD_"):
        peak_probes.RssProbe()


class FakeJaxDevice:
    """A device allocator with JAX's stats (a lifetime peak, never reset) and jax.device_put."""

    def __init__(self):
        self.in_use = self.peak = 0

    def alloc(self, nbytes):
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)
        return FakeBuffer(self, nbytes)

    def memory_stats(self):
        return {"bytes_in_use": self.in_use, "peak_bytes_in_use": self.peak}

    def device_put(self, array, device):
        return self.alloc(array.nbytes)


class FakeBuffer:
    def __init__(self, device, nbytes):
        self.device, self.nbytes = device, nbytes

    def block_until_ready(self):
        return self

    def __del__(self):
        self.device.in_use -= self.nbytes


def test_jax_stats_probe_reads_a_step_under_a_higher_lifetime_peak():
    device = FakeJaxDevice()
    device.alloc(100 * MiB)  # compiling: autotuning peaks, then frees (at once: nothing holds it)
    held = device.alloc(10 * MiB)  # the weights

    def step():
        tmp = device.alloc(4 * MiB)
        out = device.alloc(1 * MiB)
        del tmp
        return out

    probe = peak_probes.JaxStatsProbe(device, device)
    r = rounds.measure({"step": (step, lambda out: None)}, 3, probe)["step"]
    assert r["peak"]["repeats"] == [5 * MiB] * 3 and probe.notes["peak_exact"]
    assert device.in_use == 10 * MiB
    del held


@pytest.mark.parametrize("peer", ["torch-eager", "jax-jit"])
def test_calibration_reads_64_mib(peer):
    pytest.importorskip(peers.FRAMEWORKS[peer])
    r = peer_process("--peer", peer, "--calibrate", "64", "--repeats", "3")
    assert r["expected"] == 64 * MiB
    assert 63 * MiB <= r["peak"]["min"] <= r["peak"]["max"] <= 65 * MiB, r


# --- process.py -----------------------------------------------------------------------


def test_peer_process_never_imports_mlx():
    code = (
        "import sys, nuvec_mlx_bench.peers.process, nuvec_mlx_bench.peers.torch_peer, "
        "nuvec_mlx_bench.peers.jax_peer; print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx'))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_peer_refuses_an_eager_workload():
    with pytest.raises(ValueError, match="workload.compiled must be True"):
        process.measure_peer("jax-jit", dataclasses.replace(tiny(), compiled=False), "none", 1)


def test_workload_round_trips_through_the_command_line():
    w = Workload("transformer", 2, 32, 5, seq=7, weight_grads=True, compiled=False)
    args = process.parse_args(["--peer", "jax-jit", "--strategy", "checkpoint", *process.workload_args(w)])
    assert args.workload == w and args.strategy == "checkpoint"


def test_child_needs_the_workload_unless_it_calibrates(capsys):
    with pytest.raises(SystemExit):
        process.parse_args(["--peer", "jax-jit", "--model", "mlp"])
    assert "--batch, --dim, --blocks required" in capsys.readouterr().err
    assert not hasattr(process.parse_args(["--peer", "jax-jit", "--calibrate", "8"]), "workload")


def test_run_isolated_returns_errors_as_data(tmp_path):
    assert "unknown peer" in process.run_isolated("tensorflow", tiny())["error"]
    assert "cannot run" in process.run_isolated("jax-jit", tiny(), python=str(tmp_path / "no-python"))["error"]
    missing = tmp_path / "python-without-jax"
    missing.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'jax'\" >&2\nexit 1\n")
    missing.chmod(0o755)
    assert process.run_isolated("jax-jit", tiny(), python=str(missing)) == {
        "error": "ModuleNotFoundError: No module named 'jax'"
    }
    slow = tmp_path / "python-that-hangs"
    slow.write_text("#!/bin/sh\nsleep 30 &\nsleep 30\n")
    slow.chmod(0o755)
    assert "timed out" in process.run_isolated("jax-jit", tiny(), python=str(slow), timeout=0.5)["error"]


def test_a_peers_row_has_the_shape_of_an_mlx_row():
    pytest.importorskip("jax")
    measured = process.run_isolated("jax-jit", tiny(), "checkpoint", repeats=2)
    row = rows.row("strategies", "jax-jit", "checkpoint", tiny(), measured)
    mlx_row = rows.row("strategies", "mlx", "nuvec", tiny(), rounds.measured([1, 1], [1.0, 1.0], 0))
    assert set(mlx_row) <= set(row)
    assert len(row["peak"]["repeats"]) == 2 and row["peak"]["median"] > 0 and row["xla_temp_bytes"] > 0
    assert {"method", "version", "device"} <= set(row)
