#!/usr/bin/env bash
# The runs behind benchmarks/results/h200/, on a machine laid out as shared/device/mlx-cuda.md
# describes (offline: MLX wheels in $WHEELS; PyTorch, JAX and the NVIDIA libraries in
# /opt/torch/.venv). Writes into OUTDIR; PART picks the runs:
#   suite       the full benchmark, nuvec_mlx's defaults (one op per CUDA graph), PyTorch and JAX
#   mlx-graphs  the MLX strategies again with MLX's own CUDA graph size (100 ops on an H200)
#   budgets     budget sweeps of the seed step, input-only and with weight gradients
#   budget0     the seed MLP (input gradient) and its depth sweep at budget 0: no run-ahead, and its cost
set -euo pipefail
out=${1:?usage: run_cuda.sh OUTDIR [suite|mlx-graphs|budgets|budget0|all]}
part=${2:-all}
WHEELS=${WHEELS:-/root/stash}
# The mlx-cuda-13 wheel travels as parts (split -b 45m ... cudapart.): join them first.
if ls "$WHEELS"/cudapart.* >/dev/null 2>&1; then
  cat "$WHEELS"/cudapart.* > "$WHEELS/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl" && rm "$WHEELS"/cudapart.*
fi
[ -d /tmp/site/mlx ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl
NV=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
export PYTHONPATH=/tmp/site:$PWD LD_LIBRARY_PATH=$NV/cu13/lib:$NV/cudnn/lib:$NV/nccl/lib PYTHONUNBUFFERED=1
PY=/opt/torch/.venv/bin/python
mkdir -p "$out"
$PY -c "import mlx.core as mx; print(mx.default_device(), mx.device_info()['device_name'])"
run() { echo "+ $*"; "$@" 2>>"$out/progress.log" | grep -v '^wrote'; }
if [ "$part" = suite ] || [ "$part" = all ]; then
  run $PY benchmarks/peak_memory.py --suite full --repeats 7 --peer-python $PY \
    --peers torch-eager,torch-compile,jax-jit --out "$out/suite"
fi
if [ "$part" = mlx-graphs ] || [ "$part" = all ]; then
  MLX_MAX_OPS_PER_BUFFER=100 run $PY benchmarks/peak_memory.py --suite full --repeats 7 --peers none \
    --out "$out/suite-mlx-graphs"
fi
if [ "$part" = budgets ] || [ "$part" = all ]; then
  for wg in "" --weight-grads; do
    run $PY benchmarks/budget_sweep.py $wg --repeats 9 --budgets inf,0,16,64,256 --out "$out/budgets"
  done
fi
if [ "$part" = budget0 ] || [ "$part" = all ]; then
  run $PY benchmarks/peak_memory.py --suite full --models mlp --weight-grads off --budget 0 \
    --strategies none,none-policy,nuvec --repeats 7 --peers none --out "$out/budget0"
fi
