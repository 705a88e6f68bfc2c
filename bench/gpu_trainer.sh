#!/bin/bash
# Trainer fast path on one GPU: numerics tests, then bench_trainer.py at Qwen2.5-1.5B shapes (random
# weights), old path (fp32 params under autocast, sdpa) against lib's defaults (bf16 params + fp32
# master, varlen attention), with and without activation checkpointing and torch.compile.
#
#   OUT=/tmp/out bash bench/gpu_trainer.sh [old]     # old: also the old path (fp32 + autocast, sdpa)
set -u
T0=$(date +%s); ts() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu_trainer_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
ts "numerics tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "varlen or fast_path" 2>&1 | tail -5
ts "random 1.5B model"
python3 bench/make_random_model.py --arch qwen2.5-1.5b --out /tmp/q15 > /dev/null 2>&1 || echo "make_random_model failed"
B="python3 bench/bench_trainer.py --model-path /tmp/q15 --dtype bfloat16 --num-seqs 64 --mean-len 1024 --steps 3"
run() {  # label, args...
  local label=$1; shift
  ts "bench $label: $*"
  timeout 120 $B "$@" > $OUT/trainer_$label.log 2>&1
  echo "exit $?"; grep -E "^packed|^\| [0-9]|^update times|Error|error" $OUT/trainer_$label.log | tail -4
}
case "${1:-all}" in
  old) run old_gc --attn sdpa --no-master-weights --compile off --gradient-checkpointing --max-tokens-per-mb 32768 ;;
esac
run default_16k --max-tokens-per-mb 16384
run default_12k --max-tokens-per-mb 12288
run default_gc_32k --gradient-checkpointing --max-tokens-per-mb 32768
run default_24k --max-tokens-per-mb 24576
ts "profile of lib's default"
timeout 120 $B --max-tokens-per-mb 16384 --profile > $OUT/trainer_profile.log 2>&1; tail -40 $OUT/trainer_profile.log
ts done
