#!/bin/bash
# The learning signal on one GPU, with the embedded tiny defaults, in three stages:
#
#   bash bench/gpu_signal.sh ws      # embedded defaults' warm starts, built here (GPU SFT), evaluated on test
#   bash bench/gpu_signal.sh ab      # GRPO before/after the fixes from those warm starts, 2 seeds, side by side
#   bash bench/gpu_signal.sh sglang  # real SGLang colocated with the trainer: server/trainer mismatch metrics
#                                    #   (needs the warm starts of `ws`; RUNS="reflect_sync ..." picks runs)
#
# "before" is the code of commit 483c05a (the last one before the fixes), unpacked in .old/
# (git archive 483c05a | tar -x -C .old). Both stages share AGENTRL_CACHE, so `sglang` reuses the
# warm starts that `ab` built when the machine is still warm. Wheels the machine lacks: .whl/
# (fire, termcolor, bm25s); SGLang: the offline kit in .kit (docs/gpu.md).
set -u
T0=$(date +%s); ts() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
STAGE=${1:?ws, ab or sglang}
OUT=${OUT:-/tmp/gpu_signal_out}; mkdir -p "$OUT"
export AGENTRL_CACHE=${AGENTRL_CACHE:-/tmp/agentrl_cache} OMP_NUM_THREADS=2 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  NCCL_CUMEM_ENABLE=0 NCCL_NVLS_ENABLE=0
if [ "$STAGE" = sglang ]; then eval "$(bash .kit/install.sh)"; fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl 2>&1 | grep -v WARN
export PYTHONPATH=${PYTHONPATH:-}:/tmp/site2
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
REPO=$PWD

if [ "$STAGE" = ws ]; then
  ts "building the tiny model and data"
  python3 -c "from lib.tiny_model import default_tiny_model_dir as d; print(d())"
  ts "warm starts (both tasks at once)"
  python3 train_search.py --run_dir runs/ws_search --max_steps 0 --eval_every 0 --test_size 200 --tensorboard False \
    > $OUT/ws_search.log 2>&1 &
  python3 train_reflect.py --run_dir runs/ws_reflect --max_steps 0 --eval_every 0 --test_size 200 --tensorboard False \
    > $OUT/ws_reflect.log 2>&1 &
  wait
  ts "warm starts done"; grep -h "^test after\|Error" $OUT/ws_search.log $OUT/ws_reflect.log
fi

if [ "$STAGE" = ab ]; then
  BUDGET=${BUDGET:-240}
  # The warm starts `ws` built, given by path: a run's --seed then changes its RL only (reflect's
  # warm-start cache key holds the seed).
  newest() { ls -td $AGENTRL_CACHE/$1-* | head -1; }
  SM=$(newest search-warm-start-direct); RM=$(newest reflect-warm-start-direct)
  DATA=$(python3 -c "from lib.wiki_data import default_wiki_dir as d; print(d(seed=0))")
  echo "search model $SM, reflect model $RM, data $DATA"
  C="--server_device cuda --time_budget_s $BUDGET --max_steps 1000 --eval_every 10 --eval_size 200 --test_size 200 --checkpoint_every 0 --tensorboard False"
  for seed in 0 1; do
    for code in old new; do
      dir=$REPO; [ $code = old ] && dir=$REPO/.old
      (cd $dir && python3 train_search.py --run_dir $REPO/runs/search_${code}_s$seed --seed $seed $C --model_path $SM --data_dir $DATA \
        > $OUT/search_${code}_s$seed.log 2>&1) &
      (cd $dir && python3 train_reflect.py --run_dir $REPO/runs/reflect_${code}_s$seed --seed $seed $C --model_path $RM \
        > $OUT/reflect_${code}_s$seed.log 2>&1) &
    done
  done
  wait
  ts "RL runs done"
  for f in runs/search_* runs/reflect_*; do cp $f/metrics.jsonl $OUT/$(basename $f).metrics.jsonl 2>/dev/null; done
  for f in $OUT/*.metrics.jsonl; do echo "== $(basename $f)"; python3 bench/summarize_run.py $f | tail -n 12; done
fi

if [ "$STAGE" = sglang ]; then
  ts "casting the warm starts to bf16 for SGLang"
  python3 - <<'PY' || exit 1
import glob, os, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
root = os.environ["AGENTRL_CACHE"]
for name in ("search-warm-start-direct", "reflect-warm-start-direct"):
    built = sorted(glob.glob(f"{root}/{name}-*"), key=os.path.getmtime)
    if not built:
        raise SystemExit(f"no {name} in {root}: run `bash bench/gpu_signal.sh ws` first on this machine")
    src = built[-1]  # what `ws` built
    dst = f"/tmp/{name.split('-')[0]}_bf16"
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    print(src, "->", dst)
PY
  C="--server sglang --base_gpu_id 0 --mem_fraction_static 0.3 --weight_sync disk --trainer_dtype bfloat16 --eval_every 0 --test_size 100 --checkpoint_every 0 --tensorboard False"
  one() {  # name, script, args...
    local name=$1 script=$2; shift 2
    ts "start $name"
    timeout ${RUN_S:-170} python3 $script --run_dir runs/$name $C "$@" > $OUT/$name.log 2>&1
    ts "end $name rc=$?"
    cp runs/$name/metrics.jsonl $OUT/$name.metrics.jsonl 2>/dev/null
  }
  RUNS=${RUNS:-reflect_sync reflect_async search_sync}
  DATA=$(python3 -c "from lib.wiki_data import default_wiki_dir as d; print(d(seed=0))")
  for r in $RUNS; do
    case $r in
      reflect_sync) one sglang_reflect_sync train_reflect.py --model_path /tmp/reflect_bf16 --mode sync --max_steps 12 ;;
      reflect_async) one sglang_reflect_async train_reflect.py --model_path /tmp/reflect_bf16 --mode async --max_steps 12 ;;
      search_sync) one sglang_search_sync train_search.py --model_path /tmp/search_bf16 --data_dir $DATA --mode sync \
        --max_steps 10 ;;
    esac
  done
  python3 - <<'PY'
import glob, json, os, statistics
keys = ["server_trainer_abs_diff_mean", "server_trainer_abs_diff_max", "behaviour_weight_mean", "behaviour_weight_max",
        "behaviour_capped_fraction", "mismatch_kl_k3"]
for f in sorted(glob.glob(os.environ.get("OUT", "/tmp/gpu_signal_out") + "/sglang_*.metrics.jsonl")):
    rows = [r for r in map(json.loads, open(f)) if "perf/step_s" in r]
    if not rows:
        print(os.path.basename(f), "no steps"); continue
    print(os.path.basename(f), len(rows), "steps; median over steps:",
          {k: float("%.3g" % statistics.median(r["logprob/" + k] for r in rows)) for k in keys},
          "worst step:", {k: float("%.3g" % max(r["logprob/" + k] for r in rows)) for k in keys if k != "behaviour_weight_mean"})
PY
fi
ts done
