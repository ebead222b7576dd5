#!/usr/bin/env bash
# The CUDA-backend runs behind benchmarks/results/h200/, on a machine laid out as
# shared/device/mlx-cuda.md describes (offline: MLX wheels in $WHEELS, PyTorch, JAX
# and the NVIDIA libraries in /opt/torch/.venv). Writes everything into $1.
set -euo pipefail
out=${1:?usage: run_cuda.sh OUTDIR}
WHEELS=${WHEELS:-/root/stash}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl
NV=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
export PYTHONPATH=/tmp/site:$PWD LD_LIBRARY_PATH=$NV/cu13/lib:$NV/cudnn/lib:$NV/nccl/lib PYTHONUNBUFFERED=1
PY=/opt/torch/.venv/bin/python
mkdir -p "$out"
$PY -c "import mlx.core as mx; print(mx.default_device(), mx.device_info()['device_name'])"
# nuvec_mlx's defaults (one op per CUDA graph, set at import), then MLX's own graph size for comparison.
for wg in "" --weight-grads; do
  $PY benchmarks/budget_sweep.py $wg --repeats 9 --budgets inf,0,32,128 --out "$out/default" | grep '^|'
  MLX_MAX_OPS_PER_BUFFER=100 $PY benchmarks/budget_sweep.py $wg --repeats 9 --budgets inf,0,128 --out "$out/mlx-graphs" | grep '^|'
done
if [ -f benchmarks/peak_memory.py ] && $PY benchmarks/peak_memory.py --help | grep -q -- --suite; then
  $PY benchmarks/peak_memory.py --suite full --out "$out/suite"
fi
