#!/bin/bash
# One GPU, trainer and SGLang colocated, at Qwen2.5-1.5B shapes (random weights):
#   A: GPU numerics tests of the trainer's fast path, then bench/bench_colocate.py (tensor vs disk
#      sync, release/resume memory occupation);
#   B: train_reflect.py with configs/reflect_qwen2.5_1.5b.yaml on one GPU (2 turns of 256 tokens, 8 x 8
#      episodes a step), 4 GRPO steps each: sync mode with the old static split (mem_fraction_static
#      0.3, disk sync, activation checkpointing) against sleep mode (0.55, colocate_sleep, tensor
#      sync), and, both with the static split 0.3, tensor sync and checkpointing, sync_split (sync mode)
#      against async (in_place pause); $RUNS picks runs, $STEPS their length (default 4);
#   C: train_search.py with 1 s of tool latency per search, tiny warm-started search model, 8 steps
#      each, $RUNS of: sync (static split), sync_sleep, async_in_place, async_abort (flushes the prefix
#      cache at every sync), async_no_key (in_place, old prefixes reused);
#   D: how large a model one GPU trains: B's sleep-mode run with the optimizer state offloaded to CPU
#      memory (trainer_offload_optimizer) at Qwen2.5-1.5B, 3B and 7B shapes; $RUNS of 1.5b_sleep (not
#      offloaded), 1.5b_offload, 3b_offload, 7b_offload, 3b_sleep (not offloaded).
#
#   OUT=/tmp/out bash bench/gpu_colocate.sh A|B|C|D
# Needs SGLang 0.5.15 from the offline kit in .kit (docs/gpu.md); for B and C the wheels of fire,
# termcolor, bm25s (for B also datasets, dill, multiprocess, xxhash) in $WHL (default .gpu_carry/whl;
# the machine lacks them); for B and C $SEARCH_CACHE_TAR, a tar.xz of an $AGENTRL_CACHE holding the
# tiny base model (tiny-qwen2-*, cast to bf16 to travel light), the wiki data set (wiki-data-*, with
# its bm25s index) and the math data set (math-data-*).
set -u
T0=$(date +%s); ts() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
eval "$(bash .kit/install.sh)"
WHL=${WHL:-.gpu_carry/whl}
if ls $WHL/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 $WHL/fire-*.whl \
    $WHL/termcolor-*.whl $(ls $WHL/{bm25s,datasets,dill,multiprocess,xxhash}-*.whl 2>/dev/null) 2>&1 | grep -v WARN
fi
export PYTHONPATH=$PWD:$PYTHONPATH:/tmp/site2 PYTHONUNBUFFERED=1 NCCL_CUMEM_ENABLE=0 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu_colocate_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 -c "import sglang, torch, transformers; print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
if [ -n "${SEARCH_CACHE_TAR:-}" ]; then  # the embedded default's cache: its tokenizer, data
  export AGENTRL_CACHE=/tmp/agentrl_cache; mkdir -p $AGENTRL_CACHE
  [ -d $AGENTRL_CACHE/wiki-data-v2-seed0-p20000-q10000 ] || tar -xJf "$SEARCH_CACHE_TAR" -C $AGENTRL_CACHE
fi
if [ "${1:-A}" != C ]; then
  ts "random 1.5B model"
  python3 bench/make_random_model.py --arch qwen2.5-1.5b --out /tmp/q15 > /dev/null 2>&1 || echo "make_random_model failed"
fi
SG="--attention-backend triton --sampling-backend pytorch --grammar-backend none --disable-cuda-graph"
one() {  # name, timeout, args...: one training run of $SCRIPT with the common flags $C
  local name=$1 limit=$2; shift 2
  ts "start $name"
  timeout $limit python3 $SCRIPT --run_dir /tmp/runs/$name $C --sglang_extra_args="$SG" "$@" > $OUT/$name.log 2>&1
  ts "end $name rc=$?"; grep -iE "error|Traceback|out of memory" $OUT/$name.log | head -5
  cp /tmp/runs/$name/metrics.jsonl $OUT/$name.metrics.jsonl 2>/dev/null
  tail -c 3000 /tmp/runs/$name/sglang0.log > $OUT/$name.sglang_tail.log 2>/dev/null
}
case "${1:-A}" in
A)
  ts "numerics tests"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "varlen or fast_path" 2>&1 | tail -3
  ts "bench_colocate"
  timeout 300 python3 bench/bench_colocate.py --model-path /tmp/q15 --mem-fraction-static 0.5 2>&1 | grep -v "Loading weights" | tail -20
  tail -5 /tmp/bench_colocate_sglang.log
  ;;
B)
  # The real recipe's config, on one GPU, with the bundled problems in GSM8K's layout (train, test).
  GSM=/tmp/gsm_style; mkdir -p $GSM; cp $AGENTRL_CACHE/math-data-v2-seed0/{train,test}.jsonl $GSM/
  C="--config configs/reflect_qwen2.5_1.5b.yaml --mode sync --model_path /tmp/q15 --dataset $GSM --base_gpu_id 0 --batch_size 8 --group_size 8 --max_turns 2 --max_new_tokens_per_turn 256 --max_steps ${STEPS:-4} --eval_every 0 --test_size 16 --checkpoint_every 0 --tensorboard False --trace_every 0"
  SCRIPT=train_reflect.py
  first=270  # the first SGLang start on a fresh machine compiles its kernels (~150 s)
  for run in ${RUNS:-sleep static_split async}; do
    case $run in
      sleep) one reflect_sleep $first --mem_fraction_static 0.55 --colocate_sleep True --weight_sync tensor --max_tokens_per_mb 16384 ;;
      static_split) one reflect_static_split $first --mem_fraction_static 0.3 --weight_sync disk --trainer_gradient_checkpointing True --max_tokens_per_mb 32768 ;;
      sync_split) one reflect_sync_split $first --mem_fraction_static 0.3 --weight_sync tensor --trainer_gradient_checkpointing True --max_tokens_per_mb 32768 ;;
      async) one reflect_async $first --mem_fraction_static 0.3 --weight_sync tensor --mode async --trainer_gradient_checkpointing True --max_tokens_per_mb 32768 ;;
      async_no_key) one reflect_async_no_key $first --mem_fraction_static 0.3 --weight_sync tensor --mode async --trainer_gradient_checkpointing True --max_tokens_per_mb 32768 --prefix_cache_per_version False ;;
    esac
    first=200
  done
  python3 bench/bench_step_time.py "static split, disk sync, checkpointing=/tmp/runs/reflect_static_split" \
    "sleep mode, tensor sync=/tmp/runs/reflect_sleep" "sync, static split, tensor sync, checkpointing=/tmp/runs/reflect_sync_split" \
    "async, static split, tensor sync, checkpointing=/tmp/runs/reflect_async" \
    "async, no per-version cache key=/tmp/runs/reflect_async_no_key" --skip 1 --per-step 2>&1 | tail -40
  grep -h "logprob/server_trainer_abs_diff_max" /tmp/runs/*/metrics.jsonl | python3 -c "import sys, json; print('gap max per step', [round(json.loads(l)['logprob/server_trainer_abs_diff_max'], 3) for l in sys.stdin])"
  grep -h -A4 "Recompiling" $OUT/reflect_*.log | head -40
  ;;
C)
  # The embedded default's cache (tiny base model, wiki data) travels as $SEARCH_CACHE_TAR; the
  # search warm start is built here on the GPU (stage 1, 1200 SFT steps: the searcher; stage 2
  # teaches it to answer from memory). The runs use stage 1, which calls the tool most.
  ts "build the search warm start"
  python3 -c "
import train_search as ts
from lib.config import load_config
print('embedded model and data:', ts.embedded_model_and_data(load_config(ts.Config, 'configs/search_tiny.yaml', {})))" 2>&1 | grep -v "it/s]" | tail -3
  MODEL=$(ls -d $AGENTRL_CACHE/search-warm-start-[0-9a-f]* | head -1); DATA=$AGENTRL_CACHE/wiki-data-v2-seed0-p20000-q10000
  ts "model $MODEL"
  C="--model_path $MODEL --data_dir $DATA --server sglang --base_gpu_id 0 --trainer_dtype bfloat16 --trainer_compile False --tool_latency_s 1.0 --batch_size 8 --group_size 4 --max_turns 8 --max_new_tokens_per_turn 64 --max_tokens 1024 --max_steps 8 --eval_every 0 --checkpoint_every 0 --tensorboard False --trace_every 0 --weight_sync tensor"
  SCRIPT=train_search.py
  for run in ${RUNS:-sync async_in_place}; do
    case $run in
      sync) one search_sync 200 --mode sync --mem_fraction_static 0.3 ;;
      async_in_place) one search_async_in_place 150 --mode async --mem_fraction_static 0.3 --pause_mode in_place ;;
      async_abort) one search_async_abort 150 --mode async --mem_fraction_static 0.3 --pause_mode abort ;;
      async_no_key) one search_async_no_key 150 --mode async --mem_fraction_static 0.3 --pause_mode in_place --prefix_cache_per_version False ;;
      sync_sleep) one search_sync_sleep 270 --mode sync --mem_fraction_static 0.5 --colocate_sleep True ;;
    esac
  done
  python3 bench/bench_step_time.py "sync=/tmp/runs/search_sync" "sync, sleep mode=/tmp/runs/search_sync_sleep" \
    "async, in_place pause=/tmp/runs/search_async_in_place" "async, abort pause=/tmp/runs/search_async_abort" \
    "async, no per-version cache key=/tmp/runs/search_async_no_key" --skip 1 2>&1 | tail -10
  mkdir -p $OUT/model && cp $MODEL/* $OUT/model/ 2>/dev/null
  ;;
D)
  df -h /tmp | tail -1; free -g | head -2
  GSM=/tmp/gsm_style; mkdir -p $GSM; cp $AGENTRL_CACHE/math-data-v2-seed0/{train,test}.jsonl $GSM/
  C="--config configs/reflect_qwen2.5_1.5b.yaml --mode sync --dataset $GSM --base_gpu_id 0 --batch_size 8 --group_size 8 --max_turns 2 --max_new_tokens_per_turn 256 --max_steps ${STEPS:-4} --eval_every 0 --test_size 16 --checkpoint_every 0 --tensorboard False --trace_every 0 --colocate_sleep True --weight_sync tensor --max_tokens_per_mb 16384"
  SCRIPT=train_reflect.py
  first=300  # the first SGLang start on a fresh machine compiles its kernels (~150 s)
  labels=()
  for run in ${RUNS:-1.5b_sleep 1.5b_offload 3b_offload 7b_offload}; do
    arch=${run%%_*}; model=/tmp/q$arch; [ $arch = 1.5b ] && model=/tmp/q15
    [ -f $model/config.json ] || { ts "random $arch"; python3 bench/make_random_model.py --arch qwen2.5-$arch --out $model > /dev/null 2>&1; }
    ckpt=""; [ $arch != 1.5b ] && ckpt="--trainer_gradient_checkpointing True"
    offload=""; case $run in *_offload) offload="--trainer_offload_optimizer True" ;; esac
    limit=$(( first + 120 )); [ $arch = 7b ] && limit=$(( first + 280 ))
    one reflect_$run $limit --model_path $model --mem_fraction_static 0.55 $ckpt $offload
    labels+=("$run=/tmp/runs/reflect_$run"); first=200
    free -g | sed -n 2p
  done
  python3 bench/bench_step_time.py "${labels[@]}" --skip 1 --per-step 2>&1 | tail -40
  ;;
esac
ts done
