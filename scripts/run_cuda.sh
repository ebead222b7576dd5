#!/usr/bin/env bash
# The benchmark runs behind benchmarks/results/h100/ and h200/, on an NVIDIA GPU machine without
# network access: MLX's CUDA wheels (mlx, mlx-cuda-13, mlx-lm) in $WHEELS, PyTorch, JAX and the
# NVIDIA libraries in $TORCH_VENV. From the repository's root:
#   bash scripts/run_cuda.sh OUTDIR PART
# PART picks the runs, each written into OUTDIR/PART/ with its log OUTDIR/PART.log:
#   suite       the full benchmark (15 MLX repeats, 3 per peer), nuvec_mlx's defaults, PyTorch
#               (eager and torch.compile) and JAX
#   suite-mlp, suite-transformer
#               the same for one model (with the depth sweep for the MLP), peers torch.compile and
#               jax.jit: halves that each fit one device call
#   suite-mlx   the full benchmark's MLX strategies alone (no peers: their peaks repeat to the MiB
#               from run to run), nuvec_mlx's defaults and MLX's own CUDA graph size
#   suite-mlx-ops1
#               the MLP part of suite-mlx with one op per CUDA graph (MLX_MAX_OPS_PER_BUFFER=1)
#   probe-host  benchmarks/probes/host_time.py: the host's time per layer to call and evaluate nuvec's
#               nv.TrainingStep, the same step under mx.compile and mlx-lm's checkpointed step (a tiny
#               Qwen3 at 16, 28, 48 layers); PROBE_ARGS adds arguments; needs mlx-lm (below)
#   probe-head  benchmarks/probes/head_time.py on the loss heads of Gemma-3-1B (hidden 1152, vocabulary 262,144)
#               and Llama-3.2-1B (2048, 128,256) at batch 4 x 2048 tokens, frozen (LoRA) and trained (full):
#               whole, in chunks of head_chunk's length and of 256, 512 and 1024 tokens, each recomputed or
#               (nuvec's) its gradient taken in the forward pass, and by hand unstaged
#   probe-timeline
#               benchmarks/probes/train_timeline.py: the memory after and the peak during every stage of one
#               step of nuvec's, on each of STEP_RUNS' lines ("config mode"), bf16, batch 4 x 2048: where the step peaks,
#               and what each stage would add in flight
#   seed-mlp    the seed MLP alone at nuvec_mlx's defaults against the plain step (none, nuvec; 9 repeats, no
#               peers, no depth sweep): the seed target in a minute
#   gemma-mlx-lm
#               benchmarks/probes/strategy_runs.py: one step of mlx-lm's --grad-checkpoint on Gemma-3-1B at
#               512, 1024 and 2048 tokens (an early probe saw it raise past the sliding window; on 2026-12-05
#               it ran)
#   mlx-graphs  the MLX strategies again with MLX's own CUDA graph size (100 ops on an H200)
#   budgets     throttle sweeps of the seed step, input-only and with weight gradients
#   budget0     the seed MLP (input gradient) and its depth sweep at throttle 0: no run-ahead, and its cost
#   train-llama the fine-tuning benchmark (nuvec-mlx-bench-train --suite h200) on the public Llama-3.2-1B
#               configuration (random weights, seq 2048, batch 4, bf16): full and LoRA; none, mlx-lm's
#               grad_checkpoint, nuvec, nuvec unchunked; peak against length (512 to 8192 tokens) and the
#               largest length in 8, 16 and 32 GiB
#   train-qwen, train-gemma
#               the same on Qwen3-0.6B and on Gemma-3-1B (whose unchecked step at batch 4 x 4096 would build 2^32
#               logits, which ends MLX's process on CUDA: the benchmark skips such steps, LOGITS_LIMIT)
#   train-moe   the same on Qwen3-30B-A3B's configuration, LoRA, 8 of its 48 layers (every strategy holds
#               a model: four of the whole model do not fit an H200)
#   train-mlp-chunks
#               LoRA on the three public 1B configurations at seq 2048, batch 4: none, mlx-lm, nuvec and
#               nuvec with each block's MLP in chunks of 512 tokens (nuvec-mlp-chunks), 5 repeats, no length
#               sweep or search: whether the chunks lower the LoRA peak on a GPU, and what their stages cost
#   train-long  the long-sequence suite (nuvec-mlx-bench-train --suite long) on the public Llama-3.1-8B
#               configuration, QLoRA (random weights, bf16 base quantized to 4 bits in groups of 64, LoRA rank 8
#               on every block), batch 1: mlx-lm's and nuvec's trainers, each length (8192 to 65536 tokens, 3 steps)
#               in a process of its own through the trainer's own train(); the model is built once into
#               $MODEL_CACHE and loaded by every run (4.21 GiB, built in 4 s on an H100)
#   train-long-fit
#               the same model and trainers: the longest length whose every step fits 24 GiB with the weights,
#               adapters and optimizer state, by bisection in steps of 4096 tokens from 16384 (probes of 2 steps,
#               each capped at 25.5 GiB: MLX's memory limit and a guard that ends the probe past it)
#   train       the four (longer than one device call: run the parts where calls are limited)
#               TRAIN_ARGS adds arguments to the train parts' command (later ones win), for example
#               TRAIN_ARGS="--modes full --strategies none,mlx-lm,nuvec" bash scripts/run_cuda.sh OUT train-qwen
#               or TRAIN_ARGS="--trainers nuvec --chunks mlp=2048 --memory 16GiB,32GiB" ... train-long
#   plan        the planner's budget sweep (nuvec-mlx-bench-plan --suite full) on the MLP and the
#               transformer: plans from the smallest reachable peak to the unchecked one, against every
#               block, every 2nd and sqrt(n) segments checkpointed; PLAN_ARGS adds arguments to the plan
#               parts' command (PLAN_ARGS="--optimizer adam": each step updates with Adam through nv.update)
#   plan-transformer
#               the transformer's half of plan
#   plan-llama  the same on a random-weight mlx-lm Llama (hidden 2048, 16 layers, seq 2048, batch 4):
#               needs mlx-lm (below)
#   tests       pytest on the GPU (MLX's default device there): $TESTS, by default the mlx-lm tests
#               (nuvec-mlx-lora's losses and adapters bitwise equal to mlx_lm.lora's, seven architectures,
#               full, LoRA and QLoRA) and nv.eval's; needs mlx-lm (below)
#   all         every part but the train parts, each whether or not the one before failed, then OUTDIR packed into
#               OUTDIR.tgz (the device returns at most 8 files: keep OUTDIR outside the folder
#               that comes back and copy OUTDIR.tgz into it)
# A part that fails says so at the end of its log and on the console; the others still run, and
# the script's exit status is 1 if any part failed.
set -uo pipefail
usage="usage: run_cuda.sh OUTDIR suite|suite-mlp|suite-transformer|suite-mlx|suite-mlx-ops1|probe-host|probe-head|probe-timeline|seed-mlp|gemma-mlx-lm|mlx-graphs|budgets|budget0|train|train-llama|train-qwen|train-gemma|train-moe|train-mlp-chunks|train-long|train-long-fit|plan|plan-transformer|plan-llama|tests|all"
out=${1:?$usage}
part=${2:?$usage}
# The machine's paths, each overridable from the environment.
WHEELS=${WHEELS:-/root/stash}                   # the MLX wheels (mlx, mlx-cuda-13 in parts)
SITE=${SITE:-/tmp/site}                         # where they are installed
TORCH_VENV=${TORCH_VENV:-/opt/torch/.venv}      # PyTorch, JAX and the NVIDIA libraries
NVIDIA_LIBS=${NVIDIA_LIBS:-$TORCH_VENV/lib/python3.12/site-packages/nvidia}
# The train parts need mlx-lm 0.32.2, a pure-Python wheel, in $LM_WHEELS (pip download mlx-lm==0.32.2
# --no-deps): its dependencies (transformers 5.17, tokenizers, sentencepiece, jinja2 ...) are in the
# H200's $TORCH_VENV already; newer ones installed beside it would shadow them (transformers 5.25 needs
# huggingface_hub 2.x, the venv has 1.33). plan-llama needs the same wheel.
# The device returns files at most two folders deep: copy OUTDIR's files up before the call ends.
LM_WHEELS=${LM_WHEELS:-$WHEELS/mlx-lm}
PY=$TORCH_VENV/bin/python

set -e
# The mlx-cuda-13 wheel travels as parts (split -b 45m ... cudapart.): join them first.
if ls "$WHEELS"/cudapart.* >/dev/null 2>&1; then
  cat "$WHEELS"/cudapart.* > "$WHEELS/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl" && rm "$WHEELS"/cudapart.*
fi
[ -d "$SITE/mlx" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
# The library and the benchmark's package from the checkout, without installing them (offline).
export PYTHONPATH=$SITE:$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=$NVIDIA_LIBS/cu13/lib:$NVIDIA_LIBS/cudnn/lib:$NVIDIA_LIBS/nccl/lib
mkdir -p "$out"
$PY -c "import mlx.core as mx; print(mx.default_device(), mx.device_info()['device_name'])"
set +e

bench() { $PY -m nuvec_mlx_bench.peak "$@"; }
sweep() { $PY -m nuvec_mlx_bench.sweep "$@"; }
part_suite() { bench --suite full --peer-python "$PY" --peers torch-eager,torch-compile,jax-jit --out "$out/suite"; }
part_suite_mlp() {
  bench --suite full --models mlp --peer-python "$PY" --peers torch-compile,jax-jit --out "$out/suite-mlp"
}
part_suite_transformer() {
  bench --suite full --models transformer --depths "" --peer-python "$PY" --peers torch-compile,jax-jit \
    --out "$out/suite-transformer"
}
mlx_strategies=none,none-policy,mx,nuvec-nopolicy,nuvec
part_suite_mlx() { bench --suite full --peers none --strategies $mlx_strategies --out "$out/suite-mlx"; }
part_suite_mlx_ops1() {
  MLX_MAX_OPS_PER_BUFFER=1 bench --suite full --models mlp --depths "" --peers none \
    --strategies $mlx_strategies --out "$out/suite-mlx-ops1"
}
part_probe_host() {
  with_mlx_lm && mkdir -p "$out/probe-host" &&
    $PY benchmarks/probes/host_time.py --out "$out/probe-host/host_time.json" ${PROBE_ARGS:-}
}
part_probe_head() {
  local shape trained
  for shape in "--hidden 1152 --vocab 262144" "--hidden 2048 --vocab 128256"; do
    for trained in "" --trainable; do
      # shellcheck disable=SC2086  # the shape and flag are words
      $PY benchmarks/probes/head_time.py --batch 4 --tokens 2048 --chunks auto,256,512,1024 $shape $trained \
        ${PROBE_ARGS:-} || return 1
    done
  done
}
step_runs="llama-3.2-1b lora
qwen3-0.6b lora
qwen3-0.6b full
gemma-3-1b lora
gemma-3-1b full"
each_step_run() {  # each_step_run FN: FN CONFIG MODE for each line of STEP_RUNS (default step_runs), with mlx-lm
  with_mlx_lm || return 1
  local config mode
  while read -r config mode; do
    "$1" "$config" "$mode" || return 1
  done <<<"${STEP_RUNS:-$step_runs}"
}
train_timeline() { $PY benchmarks/probes/train_timeline.py "$1" "$2" bfloat16 --batch 4 --seq 2048; }
part_probe_timeline() { each_step_run train_timeline; }
part_seed_mlp() {
  bench --suite full --models mlp --depths "" --peers none --strategies none,nuvec --repeats 9 --out "$out/seed-mlp"
}
part_gemma_mlx_lm() {
  with_mlx_lm && $PY benchmarks/probes/strategy_runs.py --config gemma-3-1b --strategy mlx-lm --seqs 512 1024 2048
}
part_mlx_graphs() { MLX_MAX_OPS_PER_BUFFER=100 bench --suite full --peers none --out "$out/mlx-graphs"; }
part_budgets() {
  sweep --repeats 9 --throttles inf,0,16,64,256 --out "$out/budgets" &&
    sweep --weight-grads --repeats 9 --throttles inf,0,16,64,256 --out "$out/budgets"
}
plan_sweep() { $PY -m nuvec_mlx_bench.plan --suite full "$@" ${PLAN_ARGS:-}; }
part_plan_transformer() { plan_sweep --models transformer --out "$out/plan/transformer"; }
part_plan() {  # one model at a time, each into its own folder: a cut-off run keeps the models it finished
  plan_sweep --models mlp --out "$out/plan/mlp" && plan_sweep --models transformer --out "$out/plan/transformer"
}
part_plan_llama() { with_mlx_lm && plan_sweep --models llama --out "$out/plan-llama"; }
part_budget0() {
  bench --suite full --models mlp --weight-grads off --throttle 0 --strategies none,none-policy,nuvec \
    --peers none --out "$out/budget0"
}
# The fine-tuning benchmark (run on 2026-12-04: benchmarks/results/h200/2026-12-04-train/).
with_mlx_lm() {
  [ -d "$SITE/mlx_lm" ] || $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$LM_WHEELS"/*.whl
  $PY -c "import mlx_lm, nuvec_mlx.mlx_lm; print('mlx-lm', mlx_lm.__version__)"
}
train() { with_mlx_lm && $PY -m nuvec_mlx_bench.train --suite h200 "$@" ${TRAIN_ARGS:-}; }
part_train_llama() { train --configs llama-3.2-1b --out "$out/train-llama"; }
part_train_qwen() { train --configs qwen3-0.6b --out "$out/train-qwen"; }
part_train_gemma() { train --configs gemma-3-1b --out "$out/train-gemma"; }
part_train_moe() { train --configs qwen3-30b-a3b --layers 8 --modes lora --out "$out/train-moe"; }
part_train_mlp_chunks() {
  train --configs llama-3.2-1b,qwen3-0.6b,gemma-3-1b --modes lora --strategies none,mlx-lm,nuvec,nuvec-mlp-chunks \
    --memory 0 --seqs '' --out "$out/train-mlp-chunks"
}
# The long-sequence suite: one process per run; the model folders it builds are kept in $MODEL_CACHE (about 4.5 GB
# for Llama-3.1-8B QLoRA), so that a later part or call on the same machine loads them instead.
MODEL_CACHE=${MODEL_CACHE:-/tmp/nuvec-models}
train_long() {
  with_mlx_lm && $PY -m nuvec_mlx_bench.train --suite long --configs llama-3.1-8b --modes qlora \
    --trainers mlx-lm,nuvec --model-cache "$MODEL_CACHE" "$@" ${TRAIN_ARGS:-}
}
part_train_long() { train_long --lengths 8192,16384,32768,65536 --steps 3 --out "$out/train-long"; }
part_train_long_fit() {
  train_long --lengths '' --memory 24GiB --granularity 4096 --search-from 16384 --search-steps 2 \
    --out "$out/train-long-fit"
}
part_train() {
  local status=0 p
  for p in llama qwen gemma moe; do "part_train_$p" || status=1; done
  return $status
}

part_tests() { with_mlx_lm && $PY -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_mlx_lm.py tests/test_evaluate.py}; }

failed=0
run_part() {  # run_part NAME: the part's output into its log; a failure is said, not fatal
  local name=$1 log="$out/$1.log" status
  echo "+ part $name (log: $log)"
  "part_${name//-/_}" >"$log" 2>&1
  status=$?
  if [ "$status" -eq 0 ]; then
    echo "part $name: done" | tee -a "$log"
  else
    echo "part $name: FAILED (exit status $status)" | tee -a "$log"
    failed=1
  fi
}

case $part in
  suite|suite-mlp|suite-transformer|suite-mlx|suite-mlx-ops1|probe-host|probe-head|probe-timeline|seed-mlp|gemma-mlx-lm|mlx-graphs|budgets|budget0|train|train-llama|train-qwen|train-gemma|train-moe|train-mlp-chunks|train-long|train-long-fit|plan|plan-transformer|plan-llama|tests)
    run_part "$part" ;;
  all)
    for p in suite mlx-graphs budgets budget0 plan plan-llama; do run_part "$p"; done
    tar -czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && echo "packed $out into $out.tgz"
    ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
exit $failed
