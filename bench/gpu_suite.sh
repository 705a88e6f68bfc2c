#!/usr/bin/env bash
# The GPU benchmark suite on a 2-GPU machine (trainer GPU 0, inference GPU 1).
#
#   bash bench/gpu_suite.sh A    # contract check, trainer MFU variants, rollout overhead, NCCL/disk sync 1.5B
#   bash bench/gpu_suite.sh B    # GPU tests, NCCL/disk sync 7B
#   bash bench/gpu_suite.sh C    # trainer MFU with FSDP2 over both GPUs (no server)
#   bash bench/gpu_suite.sh D    # ~9.5 min: train_search.py step-time breakdown, TRL side by side, sync vs async
#                                #   with tool latency, torchrun FSDP2 x 2 with NCCL sync, colocated
#   MODEL=DIR bash bench/gpu_suite.sh R   # train_reflect.py with the tiny warm-started model on real SGLang:
#                                #   NCCL sync (sync, async), then colocated on GPU 0 with disk sync
#
# Needs: SGLang 0.5.15 from the offline kit in .kit (docs/gpu.md); the tiny model in
# .gpu_carry/tiny (a copy of ~/.cache/agentrl/tiny-qwen2-*, weights cast to bf16 to fit the 64 MiB
# transfer); optional wheels in .whl for packages the machine lacks (none are needed by these benches). Logs and JSON results go to $OUT.
# Random-weight models with Qwen2.5 shapes are built in /tmp by bench/make_random_model.py.
set -u
STAGE=${1:-A}
OUT=${OUT:-/tmp/gpu_suite_out}
mkdir -p "$OUT"
T0=$(date +%s)
ts() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }

eval "$(bash .kit/install.sh)"
for wheels in .whl .hcarry/whl; do  # only where the machine lacks a package (it has aiohttp, requests, pyyaml)
  if ls $wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site2 $wheels/*.whl
  fi
done
export PYTHONPATH=$PWD:$PYTHONPATH:/tmp/site2 PYTHONUNBUFFERED=1 NCCL_CUMEM_ENABLE=0 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TOKENIZERS_PARALLELISM=false
TINY=$PWD/.gpu_carry/tiny
KIT="--attention-backend triton --sampling-backend pytorch --grammar-backend none"
ts "setup done"; nvidia-smi --query-gpu=index,name,memory.used --format=csv
python3 -c "import torch, transformers, sglang; print('torch', torch.__version__, 'transformers', transformers.__version__, 'sglang', sglang.__version__, 'gpus', torch.cuda.device_count())"
git log -1 --format='commit %h' 2>/dev/null || true

# start_server MODEL GPU MEM ADDRFILE [extra sglang args]: lib.launch.launch_sglang in a background
# python that holds the server until it is killed (the server dies with it), address in ADDRFILE.
start_server() {
  local model=$1 gpu=$2 mem=$3 addr=$4; shift 4
  python3 - "$model" "$gpu" "$mem" "$addr" "$@" <<'EOF' &
import sys, time
from lib.launch import launch_sglang
model, gpu, mem, addr, *extra = sys.argv[1:]
t0 = time.time()
s = launch_sglang(model, base_gpu_id=int(gpu), mem_fraction_static=float(mem), dtype="bfloat16", random_seed=0,
                  extra_args=["--attention-backend", "triton", "--sampling-backend", "pytorch",
                              "--grammar-backend", "none", *extra], log_path=addr + ".log", timeout_s=600)
print(f"sglang {model} on GPU {gpu} up at {s.address} in {time.time() - t0:.0f} s", flush=True)
open(addr, "w").write(s.address)
time.sleep(10**6)
EOF
  SERVER_PID=$!
}
wait_file() { for _ in $(seq 1 1200); do [ -s "$1" ] && return 0; kill -0 "$SERVER_PID" 2>/dev/null || return 1; sleep 0.5; done; return 1; }

if [ "$STAGE" = A ]; then
  # --- lane GPU 0: contract check (its own server on GPU 0), then trainer MFU variants ---
  (
    export CUDA_VISIBLE_DEVICES=0
    ts "check_sglang"
    OUT=/tmp/check timeout 240 python3 bench/check_sglang.py --base-gpu-id 0 --mem-fraction-static 0.3
    echo "check_sglang exit $?"
    tar -C /tmp --exclude=check/tiny_model -czf "$OUT/check_sglang.tgz" check
    while [ ! -f /tmp/q15.ready ]; do sleep 1; done
    for args in "--max-tokens-per-mb 16384 --attn torch_varlen --profile" \
                "--max-tokens-per-mb 16384" \
                "--max-tokens-per-mb 32768 --attn torch_varlen --gradient-checkpointing" \
                "--max-tokens-per-mb 16384 --padded"; do
      if [ $(( $(date +%s) - T0 )) -gt 390 ]; then ts "skipped (time): bench_trainer $args"; continue; fi
      ts "bench_trainer $args"
      timeout 110 python3 bench/bench_trainer.py --model-path /tmp/q15 --dtype bfloat16 --num-seqs 64 --mean-len 1024 $args
      echo "bench_trainer exit $?"
    done
    ts "lane GPU 0 done"
  ) > "$OUT/lane0.log" 2>&1 &
  LANE0=$!
  # --- lane GPU 1: 1.5B server, rollout overhead, then (GPU 0 free) weight sync 1.5B ---
  (
    ts "make_random_model 1.5b"
    python3 bench/make_random_model.py --arch qwen2.5-1.5b --out /tmp/q15 --tokenizer-path "$TINY" && touch /tmp/q15.ready
    ts "server 1.5B"
    start_server /tmp/q15 1 0.8 /tmp/q15.addr
    wait_file /tmp/q15.addr || { echo "server failed"; tail -50 /tmp/q15.addr.log; exit 1; }
    ADDR=$(cat /tmp/q15.addr)
    ts "bench_rollout"
    timeout 200 python3 bench/bench_rollout.py --model-path /tmp/q15 --address "$ADDR" --num-prompts 256 \
      --prompt-len 128 --new-tokens 256 --turns 4 --tool-tokens 32 --repeats 3 --json "$OUT/rollout.json"
    echo "bench_rollout exit $?"
    ts "waiting for lane GPU 0"
    while kill -0 "$LANE0" 2>/dev/null; do sleep 1; done
    ts "bench_weight_sync 1.5B"
    timeout 200 python3 bench/bench_weight_sync.py --model-path /tmp/q15 --address "$ADDR" --repeats 4 \
      --bucket-mb 512 128 --disk-repeats 2 --json "$OUT/sync15.json"
    echo "bench_weight_sync exit $?"
    kill "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null
    tail -30 /tmp/q15.addr.log
    ts "lane GPU 1 done"
  ) > "$OUT/lane1.log" 2>&1 &
  wait
  ts "stage A done"
  grep -E "^(PASS|FAIL|ERROR)|^\||^packed=|update times|agreement|exit|skipped|Error|error:" "$OUT/lane0.log" "$OUT/lane1.log" | grep -v "^.*Self CPU" | cut -c1-400
fi

if [ "$STAGE" = B ]; then
  (
    ts "make_random_model 7b (on GPU 0)"
    python3 -c "import torch; torch.set_default_device('cuda:0')
from bench.make_random_model import make_random_model
make_random_model('qwen2.5-7b', '/tmp/q7', '$TINY')"
    ts "7b built"; du -sh /tmp/q7
  ) > "$OUT/build7b.log" 2>&1 &
  BUILD=$!
  ts "GPU tests"
  AGENTRL_GPU_TEST_MODEL=$TINY timeout 240 python3 -m pytest -m gpu tests/test_gpu.py -v -rs -p no:cacheprovider \
    > "$OUT/test_gpu.log" 2>&1
  echo "pytest exit $?"; tail -15 "$OUT/test_gpu.log"
  wait $BUILD; cat "$OUT/build7b.log"
  ts "server 7B"
  start_server /tmp/q7 1 0.8 /tmp/q7.addr --disable-cuda-graph
  if wait_file /tmp/q7.addr; then
    timeout 300 python3 bench/bench_weight_sync.py --model-path /tmp/q7 --address "$(cat /tmp/q7.addr)" --repeats 3 \
      --bucket-mb 512 --disk-repeats 1 --json "$OUT/sync7.json" > "$OUT/sync7.log" 2>&1
    echo "bench_weight_sync 7B exit $?"; tail -20 "$OUT/sync7.log"
  else
    echo "7B server failed"; tail -50 /tmp/q7.addr.log
  fi
  kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null
  ts "stage B done"
fi

if [ "$STAGE" = C ]; then
  python3 bench/make_random_model.py --arch qwen2.5-1.5b --out /tmp/q15 --tokenizer-path "$TINY"
  for args in "--max-tokens-per-mb 16384 --attn torch_varlen" "--max-tokens-per-mb 16384 --padded"; do
    ts "torchrun 2 GPUs bench_trainer $args"
    timeout 150 python3 -m torch.distributed.run --nproc-per-node 2 bench/bench_trainer.py --model-path /tmp/q15 --dtype bfloat16 \
      --num-seqs 64 --mean-len 1024 $args 2>&1 | grep -v "Loading weights"
  done
  ts "stage C done"
fi

if [ "$STAGE" = D ]; then
  # 2 GPUs, one call of about 9 minutes. Needs .hcarry/: search_model (the warm-started tiny search model,
  # bf16 weights), wiki.tgz (the synthetic encyclopedia, train.jsonl cut to 2,000 questions) and whl/ (fire,
  # bm25s, trl, datasets, dill, multiprocess). Order:
  #   GPU 0: TRL GRPOTrainer (1.5B shapes)  |  GPU 1: tiny SGLang + trainer: search task async vs sync, 1 s tool latency
  #   then trainer GPU 0 + SGLang 1.5B GPU 1: step-time breakdown (NCCL sync)
  #   then torchrun: FSDP2 trainer on GPUs 0 and 1, the same SGLang on GPU 1, NCCL sync; then ours in TRL's shape
  #   then colocated: trainer on GPU 1 beside that server, disk sync
  SM=$PWD/.hcarry/search_model
  RUNS=/tmp/runs; mkdir -p $RUNS
  for lane in A B C; do mkdir -p /tmp/wiki$lane; tar -xzf .hcarry/wiki.tgz -C /tmp/wiki$lane --strip-components 1; done
  TS="python3 train_search.py --eval_every 0 --test_size 2 --checkpoint_every 0 --tensorboard False --trace_every 0"
  BIG="--model_path /tmp/q15 --trainer_dtype bfloat16 --pack_sequences False --lr 1e-6 --batch_size 8 --group_size 8"
  MULTI="--max_turns 4 --max_new_tokens_per_turn 256 --max_tokens 1024"  # random weights: every episode runs to max_tokens
  left() { echo $(( $1 - $(date +%s) + T0 )); }  # seconds until t = $1
  ts "make_random_model 1.5b (on GPU 0)"
  python3 -c "import torch; torch.set_default_device('cuda:0')
from bench.make_random_model import make_random_model
make_random_model('qwen2.5-1.5b', '/tmp/q15', '$SM')" || exit 1
  ts "model built"
  (
    ts "B TRL GRPOTrainer on GPU 0 (machine's transformers, not the kit's)"
    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD:/tmp/site2 timeout 200 python3 bench/bench_trl.py --model-path /tmp/q15 \
      --data-dir /tmp/wikiB --batch-size 8 --group-size 8 --max-new-tokens 512 --steps 4 --micro-batch 16 \
      --json "$OUT/trl.json"; echo "B TRL exit $?"
  ) > "$OUT/laneB.log" 2>&1 &
  LANEB=$!
  (
    start_server "$SM" 1 0.15 /tmp/sm.addr --cuda-graph-max-bs 256
    wait_file /tmp/sm.addr || { echo "server failed"; tail -50 /tmp/sm.addr.log; exit 1; }
    touch /tmp/sm.up
    # async first: the 1.5B server starting on this GPU meanwhile can only slow the first run, never favour async
    for mode in async sync; do
      ts "C search task, tiny warm-started model, 1 s tool latency, $mode"
      # Trainer and server share GPU 1, so disk sync (NCCL cannot put two ranks of a group on one GPU).
      CUDA_VISIBLE_DEVICES=1 timeout 100 $TS --model_path "$SM" --data_dir /tmp/wikiC --server external \
        --server_addrs "[\"$(cat /tmp/sm.addr)\"]" --weight_sync disk --mode $mode --tool_latency_s 1.0 \
        --batch_size 16 --group_size 8 --max_turns 8 --max_new_tokens_per_turn 64 --max_tokens 1024 --max_steps 6 \
        --run_dir $RUNS/search_$mode; echo "C $mode exit $?"
    done
    kill "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null
    ts "lane C done"
  ) > "$OUT/laneC.log" 2>&1 &
  LANEC=$!
  # The 1.5B server starts after the tiny one is up (SGLang sizes its KV cache from the memory free at start-up).
  while [ ! -f /tmp/sm.up ] && kill -0 $LANEC 2>/dev/null; do sleep 1; done
  ts "SGLang 1.5B on GPU 1 (mem 0.45)"
  start_server /tmp/q15 1 0.45 /tmp/q15.addr --cuda-graph-max-bs 64
  wait $LANEB $LANEC
  ts "TRL and lane C done"; grep -E "TRL step|exit|Error" "$OUT/laneB.log" | tail -8
  wait_file /tmp/q15.addr || { echo "1.5B server failed"; tail -50 /tmp/q15.addr.log; }
  A="[\"$(cat /tmp/q15.addr)\"]"
  ts "A1 step-time breakdown, 1.5B, trainer GPU 0, SGLang GPU 1, NCCL sync"
  timeout $(( $(left 540) < 130 ? $(left 540) : 130 )) $TS $BIG $MULTI --data_dir /tmp/wikiA --server external \
    --server_addrs "$A" --weight_sync nccl --max_tokens_per_mb 16384 --max_steps 4 --run_dir $RUNS/e2e_nccl \
    > "$OUT/runs_gpu.log" 2>&1; echo "A1 exit $?"
  if [ $(left 540) -gt 100 ]; then
    ts "torchrun: FSDP2 trainer on GPUs 0 and 1, SGLang on GPU 1 beside rank 1, NCCL sync from rank 0"
    timeout $(( $(left 540) < 150 ? $(left 540) : 150 )) python3 -m torch.distributed.run --nproc_per_node 2 \
      train_search.py --eval_every 0 --test_size 2 --checkpoint_every 0 --tensorboard False --trace_every 0 $BIG $MULTI \
      --data_dir /tmp/wikiA --server external --server_addrs "$A" --weight_sync nccl --max_tokens_per_mb 8192 \
      --max_steps 3 --run_dir $RUNS/fsdp2_x2 > "$OUT/torchrun.log" 2>&1
    echo "torchrun exit $?"; grep -v "Loading weights\|Writing model" "$OUT/torchrun.log" | tail -12
  else ts "skipped (time): torchrun"; fi
  if [ $(left 540) -gt 60 ]; then
  ts "A2 ours in TRL's shape: single turn, 512 new tokens"
  timeout $(( $(left 540) < 110 ? $(left 540) : 110 )) $TS $BIG --data_dir /tmp/wikiA --server external \
    --server_addrs "$A" --weight_sync nccl --max_turns 1 --max_new_tokens_per_turn 512 --max_tokens 1024 \
    --max_tokens_per_mb 16384 --max_steps 4 --run_dir $RUNS/ours_trl_shape >> "$OUT/runs_gpu.log" 2>&1; echo "A2 exit $?"
  else ts "skipped (time): A2"; fi
  if [ $(left 540) -gt 60 ]; then
    ts "colocated: trainer on GPU 1 beside its SGLang server (mem 0.45), disk sync"
    CUDA_VISIBLE_DEVICES=1 timeout $(left 540) $TS $BIG $MULTI --data_dir /tmp/wikiA --server external \
      --server_addrs "$A" --weight_sync disk --max_tokens_per_mb 8192 --max_steps 3 --run_dir $RUNS/colocated_disk \
      >> "$OUT/runs_gpu.log" 2>&1; echo "colocated exit $?"
  else ts "skipped (time): colocated"; fi
  nvidia-smi --query-gpu=index,memory.used --format=csv
  kill "$SERVER_PID" 2>/dev/null
  ts "stage D done"
  grep -E "exit|skipped|Error|error:|Traceback" "$OUT"/lane*.log "$OUT/runs_gpu.log" | cut -c1-300 | tail -20
  python3 bench/bench_step_time.py "1.5B, NCCL sync=$RUNS/e2e_nccl" "1.5B, single turn (TRL shape)=$RUNS/ours_trl_shape" \
    "1.5B, torchrun FSDP2 x2=$RUNS/fsdp2_x2" "1.5B, colocated, disk sync=$RUNS/colocated_disk" \
    "tiny, tool 1 s, sync=$RUNS/search_sync" "tiny, tool 1 s, async=$RUNS/search_async" --json "$OUT/step_times.json"
  python3 bench/bench_trl.py --model-path /tmp/q15 --data-dir /tmp/wikiB --batch-size 8 --group-size 8 \
    --max-new-tokens 512 --trl-json "$OUT/trl.json" --ours $RUNS/ours_trl_shape
  tar -C /tmp -czf "$OUT/runs.tgz" --exclude=final --exclude=weights --exclude=checkpoints runs
fi

if [ "$STAGE" = R ]; then
  # MODEL: the reflect warm start (~/.cache/agentrl/reflect-warm-start-*), weights cast to bf16 to travel
  # light; configs/reflect_tiny.yaml otherwise. 6 steps a run, then a test on 100 problems.
  C="--model_path ${MODEL:?set MODEL to the warm-start dir} --server sglang --trainer_dtype bfloat16 --max_steps 6 --eval_every 0 --test_size 100 --checkpoint_every 0 --tensorboard False"
  one() {  # name, args...
    local name=$1; shift
    ts "start $name"
    timeout 130 python3 train_reflect.py --run_dir runs/$name $C "$@" > $OUT/$name.log 2>&1
    ts "end $name rc=$?"
    cp runs/$name/metrics.jsonl $OUT/$name.metrics.jsonl 2>/dev/null
  }
  one reflect_2gpu_nccl_sync --base_gpu_id 1 --weight_sync nccl --mode sync
  one reflect_2gpu_nccl_async --base_gpu_id 1 --weight_sync nccl --mode async
  one reflect_1gpu_colocated_disk --base_gpu_id 0 --mem_fraction_static 0.3 --weight_sync disk --mode sync
  python3 - <<'PY'
import json, glob, os, statistics
for f in sorted(glob.glob(os.environ["OUT"] + "/*.metrics.jsonl")):
    rows = [json.loads(l) for l in open(f)]
    tr = [r for r in rows if "perf/step_s" in r]
    te = [r for r in rows if "test/acc_final" in r]
    if not tr: print(os.path.basename(f), "no steps"); continue
    med = lambda k: statistics.median(r[k] for r in tr)
    print(os.path.basename(f).split(".")[0], "steps", len(tr), "step_s %.2f rollout %.2f logp %.2f update %.2f sync %.3f" % (
        med("perf/step_s"), med("perf/rollout_s"), med("perf/logp_s"), med("perf/update_s"), med("perf/sync_s")),
        "gap_mean %.2e max %.2e" % (max(r["logprob/server_trainer_abs_diff_mean"] for r in tr), max(r["logprob/server_trainer_abs_diff_max"] for r in tr)),
        "reward %.3f" % statistics.mean(r["rollout/reward"] for r in tr), "test", {k: round(v, 3) for k, v in te[0].items() if k.startswith("test/")} if te else None)
PY
  ts "stage R done"
fi
