#!/usr/bin/env bash
# arcsplit on 2x NVIDIA H200 (the device machine). Idempotent phases, so a second call reuses the first's build
# while the machine is still warm:
#   bash bench/gpu/session.sh build     # CUDA build of the pinned llama.cpp + a 7.2B F16 synthetic llama
#   bash bench/gpu/session.sh native    # plan, devices; throughput: native multi-device and hybrid
#   bash bench/gpu/session.sh rpc       # throughput all-RPC; kill an rpc-server and watch the group recover
#   bash bench/gpu/session.sh ab-hybrid # hybrid with arcsplit's llama.cpp patches on and off, same run (also ab-rpc)
#   MODES=native,hybrid,hybrid-nospin NAME=x bash bench/gpu/session.sh modes  # any modes (UBATCH, NPREDICT, REPS)
#   MODEL=moe bash bench/gpu/session.sh onecard  # ONE GPU: llama-server and rpc-servers share it (--same-card),
#        RUNS independent runs (default 3) of MODES (default native,hybrid,hybrid-stock,rpc,rpc-stock);
#        MODEL=moe: a 3.8 GiB F16 qwen3moe (16 layers, 32 experts, 4 used), MODEL=dense: the 7.2B F16 llama
# Needs (carried, git-ignored): .device/llama-src.tar.gz (the extracted pinned tree), .device/whl (py3.12 wheels).
# Make them here once (the stock pinned tree; the device build patches a copy of it):
#   python -c "from pathlib import Path; from arcsplit.llama.source import *; \
#     extract_source(fetch_sdist(Path('/dev/null')), Path('/tmp/dev-src/src'))"
#   tar czf .device/llama-src.tar.gz -C /tmp/dev-src src
#   pip download --only-binary :all: --no-deps --python-version 3.12 -d .device/whl gguf pyzmq platformdirs
# The build applies arcsplit's patches to a copy (see docs/patches.md); ARCSPLIT_RPC_STOCK=1 rows switch them off.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/.device/out}
# WORK: the build, the models, the rpc weight cache; outside the carried tree on the device, so a second call
# on the warm machine (which replaces the carried folder) finds them
WORK=${WORK:-$ROOT/.device}
mkdir -p "$OUT" "$WORK"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ARCSPLIT_CACHE_DIR=$WORK/cache ARCSPLIT_STATE_DIR=$WORK/state
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .device/whl/*.whl >/dev/null 2>&1 || true
export PYTHONPATH=/tmp/site:$ROOT
DENSE=$WORK/model7b.gguf
MOE=$WORK/moe16x32.gguf
case "${MODEL:-dense}" in moe) MODEL=$MOE ;; dense) MODEL=$DENSE ;; esac
arcsplit() { python3 -m arcsplit "$@"; }

build() {
  [ -d "$WORK/src" ] || tar xzf .device/llama-src.tar.gz -C "$WORK"
  local t0=$SECONDS
  arcsplit llama build --backend cuda --source "$WORK/src" --cmake-flag=-DCMAKE_CUDA_ARCHITECTURES=90 \
    --jobs "$(nproc)" > "$OUT/build.txt" 2>&1 &
  local b=$!
  [ -f "$DENSE" ] || python3 -c "
from arcsplit.synth import write_llama
write_llama('$DENSE', n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=32000, ctx=8192,
            reuse_random=True)" || echo "model generation failed"
  echo "dense model: $(du -h "$DENSE" | cut -f1) after $((SECONDS - t0)) s"
  [ -f "$MOE" ] || python3 -c "
from arcsplit.synth import write_qwen3moe
write_qwen3moe('$MOE', n_layer=16, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=32,
               n_expert_used=4, n_ff_exp=512, n_vocab=32000, ctx=8192)" || echo "moe model generation failed"
  echo "moe model: $(du -h "$MOE" | cut -f1) after $((SECONDS - t0)) s"
  wait $b; echo "build rc=$? after $((SECONDS - t0)) s"; tail -2 "$OUT/build.txt"
  export ARCSPLIT_LLAMA_DIR=$(ls -d "$ARCSPLIT_CACHE_DIR"/llama.cpp/*/build-cuda-*/bin | head -1)
}

case "${1:-all}" in
  build) build ;;
  native)
    build
    nvidia-smi -L; nvidia-smi --query-gpu=index,memory.total,memory.used --format=csv
    arcsplit llama which --backend cuda | tee "$OUT/which.txt"
    arcsplit devices --backend cuda --json | tee "$OUT/devices.json"
    for m in multi hybrid rpc; do python3 -c "
import json, time, arcsplit
t = time.perf_counter(); p = arcsplit.plan('$MODEL', gpus=[0, 1], backend='cuda', mode='$m'); t = time.perf_counter() - t
print(json.dumps({'mode': '$m', 'plan_ms': round(t * 1000, 2), **p.to_dict()}))" > "$OUT/plan_$m.json"; done
    arcsplit plan "$MODEL" --gpus 0,1 --backend cuda | tee "$OUT/plan.txt"
    ${THROUGHPUT_NATIVE:-python3 bench/throughput.py --backend cuda --gpus 0,1 --model $MODEL --modes native,hybrid}
    ;;
  ab-hybrid|ab-rpc|modes)
    # ab-ROUTE: arcsplit's llama.cpp patches on and off in one run (docs/patches.md), -ub 256 in every mode
    if [ "$1" != modes ]; then route=${1#ab-}; MODES=native,$route,$route-stock UBATCH=256 NAME=ab_$route; fi
    build
    python3 bench/throughput.py --backend cuda --gpus 0,1 --model "$MODEL" --modes "${MODES:-native,hybrid,hybrid-nospin}" \
      --reps "${REPS:-5}" --greedy-tokens 32 ${UBATCH:+--ubatch $UBATCH} ${NPREDICT:+--n-predict $NPREDICT} \
      --out "$OUT/throughput_cuda_${NAME:-modes}.md"
    ;;
  onecard)
    # The RPC route's tax on ONE GPU: every route's processes share card 0; RUNS fresh runs, each its own native
    build
    name=$(basename "$MODEL" .gguf)
    python3 bench/throughput.py --backend cuda --gpus 0 --same-card --model "$MODEL" \
      --modes "${MODES:-native,hybrid,hybrid-stock,rpc,rpc-stock}" --runs "${RUNS:-3}" --reps "${REPS:-5}" \
      --n-predict "${NPREDICT:-128}" --greedy-tokens 32 --ctx 8192 --rpc-cache \
      --out "$OUT/throughput_cuda_onecard_$name.md"
    ;;
  rpc)
    build
    ${THROUGHPUT_RPC:-python3 bench/throughput.py --backend cuda --gpus 0,1 --model $MODEL --modes native,rpc}
    python3 bench/recover.py --backend cuda --gpus 0,1 --model "$MODEL" --mode rpc --repeat 2 --out "$OUT/recover_cuda.md"
    ;;
esac
# never over a file this run wrote to $OUT under the same name
cp -n bench/results/*cuda* "$OUT/" 2>/dev/null || true
ls "$OUT"
