"""How the CUDA default-budget peak of the seed step varies: alone, interleaved, with/without cache clear."""
# A throw-away probe, kept to reproduce benchmarks/results/h200/2026-12-03-variance/: it ran at commit
# 9ed2516 and was committed with its results in 3119fb5; it imports the benchmark as it was then
# (`git checkout 3119fb5`, then run it from the repository's root).
import statistics, time
import mlx.core as mx
import nuvec_mlx as nv
from benchmarks import workloads
MiB = 1 << 20
sc = {s: workloads.build(s, batch=4096, dim=256, blocks=8) for s in ("none", "nuvec", "mx")}
for s in sc.values():
    s.evaluate(s.step(s.inputs))

def peak(s, clear=True):
    with nv.memory.measure(clear_cache=clear) as m:
        out = s.step(s.inputs); s.evaluate(out); del out
    return m.peak / MiB

def show(name, xs):
    print(f"{name:40s} median {statistics.median(xs):6.1f} min {min(xs):6.1f} max {max(xs):6.1f}  {sorted(xs)}", flush=True)

show("nuvec alone, cache cleared", [peak(sc["nuvec"]) for _ in range(25)])
show("nuvec alone, cache kept", [peak(sc["nuvec"], False) for _ in range(25)])
xs = []
for _ in range(15):
    peak(sc["none"]); xs.append(peak(sc["nuvec"]))
show("nuvec after none", xs)
xs = []
for _ in range(15):
    peak(sc["mx"]); xs.append(peak(sc["nuvec"]))
show("nuvec after mx", xs)
xs = []
for _ in range(15):
    for _ in range(5): sc["none"].evaluate(sc["none"].step(sc["none"].inputs))
    mx.synchronize(); xs.append(peak(sc["nuvec"]))
show("nuvec after 5 plain steps", xs)
xs = []
for _ in range(15):
    time.sleep(0.05); xs.append(peak(sc["nuvec"]))
show("nuvec after 50 ms idle", xs)
with nv.memory.budget(32 * MiB):
    show("nuvec, budget 32 MiB", [peak(sc["nuvec"]) for _ in range(10)])
