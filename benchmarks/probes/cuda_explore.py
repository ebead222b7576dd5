"""Throw-away: peaks/times of the seed step under one env config (one process)."""
# A throw-away probe, kept to reproduce benchmarks/results/h200/2026-12-03-explore/: it ran at commit
# b824762 and was committed with its results in 3264d0d; it imports the benchmark as it was then
# (`git checkout 3264d0d`, then run it from the repository's root).
import json, math, os, sys
sys.path.insert(0, os.getcwd())
import mlx.core as mx
import nuvec_mlx as nv
from benchmarks import workloads, measure
MiB = 1 << 20
out = {}
for wg in (False, True):
    cases = {}
    for s in ("none", "none-policy", "nuvec", "mx"):
        sc = workloads.build(s, weight_grads=wg)
        cases[s] = (lambda sc=sc: sc.step(sc.inputs), sc.evaluate)
    sc = workloads.build("nuvec", weight_grads=wg)
    cases["nuvec-b0"] = (lambda sc=sc: sc.step(sc.inputs), lambda o: nv.eval(o, budget=0))
    cases["none-b0"] = (lambda sc=workloads.build("none", weight_grads=wg): sc.step(sc.inputs), lambda o: nv.eval(o, budget=0))
    res = measure.run_cases(cases, int(sys.argv[1]), desc=f"wg={wg}")
    b = res["none"]
    for s, r in res.items():
        print(f"ops={os.environ.get('MLX_MAX_OPS_PER_BUFFER')} bfs={os.environ.get('MLX_BFS_MAX_WIDTH', 20)} wg={int(wg)} {s:12s} "
              f"peak {r['peak']['median']/MiB:6.1f} [{r['peak']['min']/MiB:.0f}-{r['peak']['max']/MiB:.0f}] "
              f"time {r['time']['median']*1e3:6.2f}ms [{r['time']['min']*1e3:.2f}-{r['time']['max']*1e3:.2f}] "
              f"tr {r['time']['median']/b['time']['median']:.3f}", flush=True)
