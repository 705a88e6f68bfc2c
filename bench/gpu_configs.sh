#!/bin/bash
# The shipped real-recipe configs (configs/*_qwen2.5_*.yaml), as shipped, for 2 GRPO steps each, with
# random weights of their model's shapes (bench/make_random_model.py; no model hub on these machines).
# What the command line changes: the model path, the data (the bundled synthetic data, in the formats
# the configs read: a GSM8K-style local dataset dir, a Search-R1-style question dir), the run length
# (2 steps, 8 prompts a step instead of 32, 4 for search, 16 test questions) and the run dir. Memory settings
# (micro-batch budget, checkpointing, mem_fraction_static, max_tokens), the GPU layout, the mode and
# the weight sync are the config's. The search configs use a retrieval server on port 8000, started
# here as the README's recipe says (`python -m lib.retrieval`, BM25 over the bundled corpus).
#
#   OUT=/tmp/out bash bench/gpu_configs.sh [RUNS...]     RUNS: reflect_1.5b search_1.5b search_3b search_7b
#
# reflect_1.5b, search_1.5b, search_3b: 2 GPUs each (trainer GPU 0, SGLang GPU 1); with 4 GPUs two
# lanes run side by side: the first run on GPUs 2-3, the others one after another on GPUs 0-1. search_7b needs 4 GPUs and runs its model's shapes on a
# smaller layout than the config's 6 GPUs: FSDP2 over 3 trainer ranks (torchrun), SGLang tp 1 on GPU 3.
# Needs: .kit (SGLang 0.5.15, docs/gpu.md); $WHL with the wheels of fire, termcolor, bm25s, datasets,
# dill, multiprocess, xxhash; $CACHE_TAR, a tar.xz of an $AGENTRL_CACHE holding the tiny model (its
# tokenizer), the wiki data set (with its bm25s index) and the math data set.
set -u
T0=$(date +%s); ts() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
eval "$(bash .kit/install.sh)"
WHL=${WHL:-.gpu_carry/whl}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 $WHL/*.whl 2>&1 | grep -v WARN
export PYTHONPATH=$PWD:$PYTHONPATH:/tmp/site2 PYTHONUNBUFFERED=1 NCCL_CUMEM_ENABLE=0 TOKENIZERS_PARALLELISM=false
export AGENTRL_CACHE=/tmp/agentrl_cache; mkdir -p $AGENTRL_CACHE
[ -d $AGENTRL_CACHE/wiki-data-v2-seed0-p20000-q10000 ] || tar -xJf "${CACHE_TAR:-.gpu_carry/cache.tar.xz}" -C $AGENTRL_CACHE
WIKI=$AGENTRL_CACHE/wiki-data-v2-seed0-p20000-q10000
GSM=/tmp/gsm_style; mkdir -p $GSM; cp $AGENTRL_CACHE/math-data-v2-seed0/{train,test}.jsonl $GSM/  # GSM8K's splits: train, test
OUT=${OUT:-/tmp/gpu_configs_out}; mkdir -p "$OUT"
NGPU=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 -c "import sglang, torch, transformers, datasets; print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'datasets', datasets.__version__)"
RUNS=${*:-reflect_1.5b search_1.5b search_3b}

for arch in 1.5b 3b 7b; do  # only the shapes this call needs
  case " $RUNS " in *"_$arch "*) ts "random qwen2.5-$arch"
    python3 bench/make_random_model.py --arch qwen2.5-$arch --out /tmp/q$arch 2>&1 | tail -1 ;; esac
done
case " $RUNS " in *" search_"*)
  python3 -m lib.retrieval --corpus $WIKI/corpus.jsonl --port 8000 > $OUT/retrieval.log 2>&1 &
  for _ in $(seq 60); do curl -s -o /dev/null localhost:8000/health && break; sleep 1; done
  ts "retrieval server up: $(curl -s localhost:8000/health)" ;;
esac

one() {  # name, gpus, timeout: one config run, then what it measured
  local name=$1 gpus=$2 limit=$3 arch=${1#*_} task=${1%%_*}
  local batch=8; [ $task = search ] && batch=4  # a random model's search episodes run to max_tokens (8192)
  local common="--config configs/${task}_qwen2.5_$arch.yaml --model_path /tmp/q$arch --run_dir /tmp/runs/$name
                --max_steps 2 --batch_size $batch --test_size 16 --eval_size 16"
  local data="--data_dir $WIKI"; [ $task = reflect ] && data="--dataset $GSM"
  local launch="python3"; [ $name = search_7b ] && launch="python3 -m torch.distributed.run --nproc_per_node 3"
  local layout=""; [ $name = search_7b ] && layout="--base_gpu_id 3 --tp_size 1"
  ts "start $name on GPUs $gpus"
  CUDA_VISIBLE_DEVICES=$gpus timeout $limit $launch train_$task.py $common $data $layout > $OUT/$name.log 2>&1
  ts "end $name rc=$?; disk: $(df -h /tmp | tail -1 | awk '{print $4 " free of " $2}'), run dir $(du -sh /tmp/runs/$name 2>/dev/null | cut -f1)"
  grep -iE "error|Traceback|out of memory" $OUT/$name.log | grep -v "^ *warn" | head -5
  cp /tmp/runs/$name/metrics.jsonl $OUT/$name.metrics.jsonl 2>/dev/null
  tail -c 3000 /tmp/runs/$name/sglang0.log > $OUT/$name.sglang_tail.log 2>/dev/null
  python3 bench/bench_step_time.py "$name=/tmp/runs/$name" --skip 0 --per-step | tail -n +3
  python3 bench/summarize_run.py /tmp/runs/$name/metrics.jsonl 2>/dev/null | grep "| test |"
}
lane() {  # gpus, runs...
  local gpus=$1; shift
  for run in "$@"; do one $run $gpus ${RUN_LIMIT_S:-420}; done
}
two_gpu=(); for r in $RUNS; do [ $r != search_7b ] && two_gpu+=($r); done
if [ "$NGPU" -ge 4 ] && [ ${#two_gpu[@]} -ge 2 ]; then  # two lanes side by side: the first run alone
  lane 2,3 "${two_gpu[0]}" > $OUT/lane2.txt 2>&1 &
  lane 0,1 "${two_gpu[@]:1}" > $OUT/lane1.txt 2>&1
  wait; cat $OUT/lane1.txt $OUT/lane2.txt
elif [ ${#two_gpu[@]} -ge 1 ]; then
  lane 0,1 "${two_gpu[@]}"
fi
case " $RUNS " in *" search_7b "*) one search_7b 0,1,2,3 500 ;; esac
ts done
