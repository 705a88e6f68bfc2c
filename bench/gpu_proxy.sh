#!/bin/bash
# The OpenAI-proxy path vs the token path with real SGLang on one GPU (bench/bench_proxy.py), on the
# embedded reflect warm start (built here on the GPU, cast to bf16 for SGLang), then at Qwen2.5-1.5B
# shapes (random weights). Paths: the token loop, the openai-SDK agent on the trainer's event loop,
# and the same agent in AGENT_WORKERS worker processes (train_agent.py --agent_workers).
#
#   OUT=/tmp/out SDK_WHEELS=<dir> [AGENT_WORKERS=8] bash bench/gpu_proxy.sh
#
# Needs SGLang 0.5.15 from the offline kit in .kit (docs/gpu.md); wheels the machine lacks (openai,
# fire, ...) may come in $WHEELS.
set -u
T0=$(date +%s); ts() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
eval "$(bash .kit/install.sh)"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 "$WHEELS"/*.whl 2>&1 | grep -v WARN
fi
# The kit's openai (2.6.1) has no aiohttp transport the machine's aiohttp can run, so the SDK would
# fall back to httpx (several times the CPU per request): $SDK_WHEELS (openai 3.x and its aiohttp
# extra: openai, httpx2, httpcore2, jiter, aiohttp and its deps, as wheels) go first on the path.
if [ -n "${SDK_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sdk "$SDK_WHEELS"/*.whl 2>&1 | grep -v WARN
  PYTHONPATH=/tmp/sdk:$PYTHONPATH
fi
export PYTHONPATH=$PWD:$PYTHONPATH:/tmp/site2 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu_proxy_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name --format=csv,noheader
python3 -c "import openai; print('openai', openai.__version__)"
for direct in 150 0; do  # stage-2 SFT steps: 150 = ~10-token answers (the default's shape), 0 = worked solutions
  ts "warm start (direct $direct)"
  python3 - "$direct" <<'PY'
import sys, torch, train_reflect as tr
from transformers import AutoModelForCausalLM, AutoTokenizer
direct = int(sys.argv[1])
cfg = tr.load_config(tr.Config, "configs/reflect_tiny.yaml", {"warm_start_steps": 300, "warm_start_direct_steps": direct})
path = tr.embedded_model(cfg)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
model.save_pretrained(f"/tmp/m{direct}")
AutoTokenizer.from_pretrained(path).save_pretrained(f"/tmp/m{direct}")
PY
  ts "bench (direct $direct)"
  timeout 280 python3 bench/bench_proxy.py --model-path /tmp/m$direct --server sglang --rounds 7 \
    --warm-start-direct-steps $direct --agent-workers ${AGENT_WORKERS:-8} > $OUT/bench_direct$direct.txt 2>&1
  ts "rc=$?"; tail -7 $OUT/bench_direct$direct.txt
done
ts "random Qwen2.5-1.5B"
python3 bench/make_random_model.py --arch qwen2.5-1.5b --out /tmp/q15 > $OUT/make_q15.log 2>&1
ts "bench (1.5B shapes)"
timeout 300 python3 bench/bench_proxy.py --model-path /tmp/q15 --server sglang --rounds 5 \
  --agent-workers ${AGENT_WORKERS:-8} > $OUT/bench_q15.txt 2>&1
ts "rc=$?"; tail -7 $OUT/bench_q15.txt
