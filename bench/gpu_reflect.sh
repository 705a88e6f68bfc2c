#!/bin/bash
# train_reflect.py on GPUs with real SGLang: 2 GPUs (trainer | SGLang) with NCCL sync, sync and async;
# then colocated on one GPU with disk sync. Tiny warm-started model (bf16), synthetic GSM8K-format data.
#
#   MODEL=/path/to/reflect-warm-start OUT=/tmp/out bash bench/gpu_reflect.sh
#
# MODEL: the reflect warm start (~/.cache/agentrl/reflect-warm-start-*; cast to bf16 to travel light).
# Needs SGLang 0.5.15 from the offline kit in .kit (docs/gpu.md) and 2 GPUs.
set -u
T0=$(date +%s); ts() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
eval "$(bash .kit/install.sh)"
if ls .whl/*.whl >/dev/null 2>&1; then  # packages the machine lacks (fire, termcolor)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl 2>&1 | grep -v WARN
fi
export PYTHONPATH=$PWD:$PYTHONPATH:/tmp/site2 PYTHONUNBUFFERED=1 NCCL_CUMEM_ENABLE=0 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu_reflect_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name --format=csv,noheader
python3 -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
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
