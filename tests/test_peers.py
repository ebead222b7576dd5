"""The PyTorch and JAX peers compute MLX's step, their peak probes read known allocations, failures come back as data."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from nuvec_mlx_bench import peers

MiB = 1 << 20
TINY = {"batch": 8, "dim": 16, "blocks": 3, "seq": 4}


def peer_process(*args: str) -> dict:
    """Run ``python -m nuvec_mlx_bench.peers`` as run_isolated does and return its JSON line."""
    proc = subprocess.run([sys.executable, "-m", "nuvec_mlx_bench.peers", *args],
                          env={**os.environ, **peers.ENV}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("weight_grads", [False, True])
@pytest.mark.parametrize("strategy", peers.STRATEGIES)
@pytest.mark.parametrize("model", peers.MODELS)
@pytest.mark.parametrize("peer", ["torch-eager", "jax-jit"])
def test_peer_step_matches_mlx(peer, model, strategy, weight_grads):
    pytest.importorskip(peers.FRAMEWORKS[peer])
    errors = peers.check(peer, peers.Spec(model, strategy, weight_grads=weight_grads, **TINY))
    assert len(errors) == (3 * (2 if model == "mlp" else 4) + 2 if weight_grads else 2)
    assert max(errors) <= 1e-4, errors


def test_torch_compile_step_matches_mlx():
    """One case, the fullest: torch.compile on a CPU takes tens of seconds a graph."""
    pytest.importorskip("torch")
    errors = peers.check("torch-compile", peers.Spec("transformer", "checkpoint", weight_grads=True, **TINY))
    assert max(errors) <= 1e-4, errors


def test_rss_probe_reads_a_known_allocation_not_what_was_held_before():
    code = """
import json
from nuvec_mlx_bench import peers
held = b"\\x01" * (32 << 20)
probe = peers.RssProbe()
def step():
    tmp = b"\\x02" * (16 << 20)  # freed before the 64 MiB: counted only by itself
    del tmp
    return [b"\\x03" * (4 << 20) for _ in range(16)]
print(json.dumps(peers.measure(step, lambda out: None, probe, repeats=3)))
"""
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **peers.ENV},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert 63.5 * MiB <= r["peak_min"] <= r["peak"] <= r["peak_max"] <= 65 * MiB, r
    assert 0 < r["time_min"] <= r["time"] <= r["time_max"]
    assert "VmHWM" in r["method"] and "MALLOC_MMAP_THRESHOLD_" in r["method"]


def test_rss_probe_refuses_a_process_without_the_glibc_setting(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    with pytest.raises(RuntimeError, match="MALLOC_MMAP_THRESHOLD_"):
        peers.RssProbe()


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

    r = peers.measure(step, lambda out: None, peers.JaxStatsProbe(device, device), repeats=3)
    assert r["peak"] == r["peak_min"] == r["peak_max"] == 5 * MiB and r["peak_exact"]
    assert device.in_use == 10 * MiB
    del held


@pytest.mark.parametrize("peer", ["torch-eager", "jax-jit"])
def test_calibration_reads_64_mib(peer):
    pytest.importorskip(peers.FRAMEWORKS[peer])
    r = peer_process("--peer", peer, "--calibrate", "64", "--repeats", "3")
    assert r["expected"] == 64 * MiB
    assert 63 * MiB <= r["peak_min"] <= r["peak_max"] <= 65 * MiB, r


def test_measure_rejects_zero_repeats():
    with pytest.raises(ValueError, match="repeats"):
        peers.measure(lambda: None, lambda out: None, None, 0)


def test_run_isolated_returns_errors_as_data(tmp_path):
    assert "unknown peer" in peers.run_isolated("tensorflow", **TINY)["error"]
    assert "cannot run" in peers.run_isolated("jax-jit", python=str(tmp_path / "no-python"), **TINY)["error"]
    missing = tmp_path / "python-without-jax"
    missing.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'jax'\" >&2\nexit 1\n")
    missing.chmod(0o755)
    assert peers.run_isolated("jax-jit", python=str(missing), **TINY) == {
        "error": "ModuleNotFoundError: No module named 'jax'"}
    slow = tmp_path / "python-that-hangs"
    slow.write_text("#!/bin/sh\nsleep 30 &\nsleep 30\n")
    slow.chmod(0o755)
    assert "timed out" in peers.run_isolated("jax-jit", python=str(slow), timeout=0.5, **TINY)["error"]


def test_spec_round_trips_through_the_command_line():
    spec = peers.Spec("transformer", "checkpoint", 2, 32, 5, 7, True)
    args = peers.parse_args(["--peer", "jax-jit", *peers.spec_args(spec)])
    assert peers.Spec(**{k: getattr(args, k) for k in peers.Spec.__dataclass_fields__}) == spec


def test_available_lists_only_importable_peers_without_importing_them():
    loaded = {m for m in ("torch", "jax") if m in sys.modules}
    names = peers.available()
    assert set(names) <= set(peers.PEERS)
    assert {m for m in ("torch", "jax") if m in sys.modules} == loaded
    for peer in peers.PEERS:
        assert (peer in names) == (importlib.util.find_spec(peers.FRAMEWORKS[peer]) is not None)


def test_run_isolated_measures_a_peer_end_to_end():
    pytest.importorskip("jax")
    r = peers.run_isolated("jax-jit", model="mlp", strategy="checkpoint", repeats=2, **TINY)
    assert {"peak", "peak_min", "peak_max", "time", "time_min", "time_max", "method", "version", "device"} <= set(r), r
    assert r["peak"] > 0 and r["time"] > 0 and r["xla_temp_bytes"] > 0
