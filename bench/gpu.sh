#!/usr/bin/env bash
# bf16 MFU of lm_jax's train step on one NVIDIA H200 (peak 989 dense bf16 TFLOP/s): BERT-base (seq 128),
# GPT-1 (seq 128 and 512) and T5-base (512 -> 114) at their papers' batch sizes, then BERT-base and GPT-1
# without dropout (the attention path jax.nn.dot_product_attention takes). Writes OUT_DIR/gpu_mfu.txt (the
# table), gpu_mfu.json (every step time) and gpu_info.txt. About 5-6 minutes; hard limit 8.
#   bash bench/gpu.sh [OUT_DIR [extra train_step.py args]]   (OUT_DIR defaults to $OUT, else bench_out)
#   bash bench/gpu.sh /tmp/q --quick --steps 2 --warmup 1 --matmul_size 256    # CPU smoke test of the same calls
#   bash bench/gpu.sh OUT_DIR nanogpt [bench/nanogpt.py args]   # instead: nanoGPT's GPU Shakespeare recipe, ours
#       (and nanoGPT's own train.py where NANOGPT_DIR names a checkout and torch has CUDA) against its published
#       best val loss 1.4697 (about 3 minutes on an A100); writes OUT_DIR/nanogpt.txt and nanogpt.json
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-bench_out}}
shift $(( $# > 0 ? 1 : 0 ))
extra=("$@")
mkdir -p "$out"
deadline=$((SECONDS + 470))

# The GPU image has jax, flax, optax, orbax but not ml_collections: install carried wheels (bench/README.md).
if ! python3 -c "import ml_collections" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "ml_collections is missing and no .whl/ was carried: see bench/README.md" >&2; exit 1
  fi
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
} 2>&1 | tee "$out/gpu_info.txt"

export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
if [[ ${extra[0]:-} == nanogpt ]]; then
  timeout $((deadline - SECONDS)) python3 bench/nanogpt.py --gpu --nanogpt="${NANOGPT_DIR:-}" \
    --json "$out/nanogpt.json" "${extra[@]:1}" 2>&1 | tee "$out/nanogpt.txt"
  exit "${PIPESTATUS[0]}"
fi
common=(--dtype bfloat16 --peak_tflops 989 --peers none --matmul_size 8192 --steps 10 --warmup 3)
run() {  # name, seconds allowed, train_step.py arguments...
  local name=$1 limit=$2; shift 2
  local left=$((deadline - SECONDS))
  (( left < 30 )) && { echo "skipped $name: out of time" | tee -a "$out/gpu_mfu.txt"; return; }
  (( limit > left )) && limit=$left
  echo "== $name" | tee -a "$out/gpu_mfu.txt"
  timeout "$limit" python3 bench/train_step.py "${common[@]}" --json "$out/$name.json" "$@" "${extra[@]}" 2>&1 \
    | tee -a "$out/gpu_mfu.txt"
}
# Papers' batches: BERT 256 x 128, GPT-1 64 x 512 (and the same 32k tokens at 128), T5 128 x 512.
run gpu_mfu 330 --models bert,gpt1_512,t5,gpt1_128 --batch bert=256,gpt1_128=256,gpt1_512=64,t5=128
run gpu_mfu_nodropout 150 --models bert,gpt1_512 --batch bert=256,gpt1_512=64 \
  --set model.dropout_rate=0.0 --set model.attention_dropout_rate=0.0
echo "total ${SECONDS}s" | tee -a "$out/gpu_mfu.txt"
