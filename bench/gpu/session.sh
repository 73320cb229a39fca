#!/usr/bin/env bash
# arcsplit on 2x NVIDIA H200 (the device machine). Idempotent phases, so a second call reuses the first's build
# while the machine is still warm:
#   bash bench/gpu/session.sh build     # CUDA build of the pinned llama.cpp + a 7.2B F16 synthetic llama
#   bash bench/gpu/session.sh native    # plan, devices; throughput: native multi-device and hybrid
#   bash bench/gpu/session.sh rpc       # throughput all-RPC; kill an rpc-server and watch the group recover
#   bash bench/gpu/session.sh ab-hybrid # hybrid with arcsplit's llama.cpp patches on and off, same run (also ab-rpc)
#   MODES=native,hybrid,hybrid-nospin NAME=x bash bench/gpu/session.sh modes  # any modes (UBATCH, NPREDICT, REPS)
#   bash bench/gpu/session.sh accuracy  # issue 16: planner vs llama.cpp's CUDA allocator, per card
#        (bench/plan_accuracy.py --cuda-device 0: plan_accuracy_cuda.md + compute_cuda.json under $OUT)
#   bash bench/gpu/session.sh abpatch   # each patch ALONE on the pinned tree vs the same build switched off,
#        MoE on one GPU (incremental rebuilds of the CUDA build; run it last: it rebuilds that build's tree)
#   bash bench/gpu/session.sh pipeline  # PHASES="accuracy moe dense abpatch" (the default; recover1 too), in order
#   bash bench/gpu/session.sh detach    # the pipeline in the background, results under $WORK/res; then collect
#        (detach goes on into collect, which waits WAIT_S: give its call a timeout above WAIT_S, or WAIT_S=5 for a
#        quick return; a call cut short returns nothing. And never `pkill -f` a phrase the call's own command line
#        holds: it kills the call)
#   bash bench/gpu/session.sh collect   # waits WAIT_S (540) for it; pipeline.log, res.tgz (and a pack's parts) to
#        $OUT. Exits 3 at once on a fresh machine (no pipeline there), instead of waiting out the call. E.g.:
#          call 1: W=/root/w; mkdir -p $W; cp -r .device/whl .device/llama-src.tar.gz .device/cudabin .device/librpc $W/
#                  rm -rf $W/tree; mkdir $W/tree; cp -r $(ls -A | grep -v '^\.device$') $W/tree/
#                  cd $W/tree && WORK=$W FILES=$W PHASES="pack link moe-mps" bash bench/gpu/session.sh detach
#          call 2 (at once, while the machine is warm: it goes back after 30 s idle):
#                  WORK=/root/w bash bench/gpu/session.sh collect
#   SWAP_RPC=KEY (any phase): run the packed build KEY with .device/librpc/lib*.so.* (libggml-rpc.so or libllama.so
#        of a CPU build of this tree's patch set) swapped in, when the set differs from KEY's only in ggml-rpc.cpp or
#        in llama's own sources (src/: no backend code; see swap_rpc below);
#        modes ending -alt run on KEY as packed, so MODES=native,hybrid,hybrid-alt pairs the two in the same runs
#   phase pack: the CUDA build as xz parts (15 MiB) under $OUT; kept as .device/cudabin/ and carried, a fresh
#        machine unpacks a build whose key (flags, patch set) is this tree's instead of compiling it (~350 s).
#        bench/gpu/pack_here.sh makes the same parts without a GPU (CUDA 13.0 from PyPI, about 25 min on 2 cores)
#   MODEL=moe bash bench/gpu/session.sh trace  # ONE GPU: a CUPTI timeline per route (bench/gpu_trace.py;
#        phases trace / trace-dense in PHASES): where a decoded token's time goes, per process
#   phases trace-light / trace-dense-light: the same with ARCSPLIT_CUPTI_LIGHT=1 (one record per CUDA graph);
#        KEEP_RAW=1: every traced process's tracer lines too, gzipped, under $OUT/raw_<model><TAG>/
#   phase trace-gate-mps: the MoE's light trace under MPS, all-RPC with gated sets (arcsplit's default on CUDA) and
#        without (TRACE_MODES): where MoE all-RPC's remaining per-token time goes (+150 us over native, 2026-12-07)
#   phase trace-mps: the MoE's full trace (every kernel) under MPS (TRACE_MODES, default native,rpc): whether the
#        split graphs' extra span (+57 us a token in the light trace, 2026-12-07) is kernels or gaps between them
#        (and MOE_MODES=native,native-neighbour,rpc in moe-mps: native beside an idle second MPS client, the
#        bench's -neighbour; if native slows as much, the extra span is MPS's, not the split's)
#   phase trace-prefill-moe-mps: the MoE's 512-token prefill traced under MPS (native, hybrid, all-RPC): where
#        all-RPC prefill's share of a shared card goes (0.68-0.82 of native, 2026-12-07)
#   phases moe-mps / dense-mps: onecard under NVIDIA MPS (one shared GPU context: the time-slicing's share);
#        DENSE_RUNS: the dense phases' run count where it differs from RUNS; MOE_MODES / DENSE_MODES: a phase's
#        modes where they differ from MPS_MODES (a patch paired in the same runs: -copyset for 0014, -hostembd for
#        0015, e.g. DENSE_MODES=native,rpc,rpc-hostembd,hybrid; with SWAP_RPC, librpc/ holding this set's
#        libggml-rpc.so and libllama.so; 2026-12-08: bench/results/gpu/ttft/*_s22.md)
#   phase bimodal: MoE, time-sliced, all-RPC with one switch off at a time (BIMODAL_MODES): which one makes its
#        prefill bimodal (issue 45); the bench exits 3 when a mode's repetitions differ by more than 2x in a run
#   phase tune: issue 44, bench/tune.py on the one-GPU rig (native, hybrid, all-RPC), a MoE that does not fit
#        (--n-cpu-moe varied), and arcsplit tune + plan on --gpus 0
#   phase lru / lru-mps: MoE, all-RPC with patch 0010 on and off (LRU_MODES), bench/throughput.py --pattern lru: random
#        token ids, a 64-token warm-up, a 3-token prompt between prefills (the pattern that made all-RPC prefill bimodal)
#   phase offload: bench/moe_offload.py on the card, arcsplit --moe-offload against llama.cpp's --n-cpu-moe by hand
#   phase poll-mps: bench/poll_cost.py on ONE GPU under MPS (host cores the link's polling costs, off and on)
#   phase waitword: bench/gpu/wait_host_word.cu, the gated sets' device-side wait alone (patch 0009's primitive)
#   phase link: bench/rpc_link.py on the CUDA build (one rpc-server on the card; shared memory against TCP, 0008);
#        LINK_SIZES: the transfer sizes in MiB (default 0.0625,4,16)
#   phase moe152k-mps: moe-mps on the same MoE with a 151,936-token vocabulary (Qwen3's): what a real model's
#        594 KiB of logits a token costs each route (MOE_MODES)
#   phase tune152k: arcsplit tune on that model and --gpus 0 (TUNE_OBJECTIVE, default decode; TUNE_BUDGET), then
#        arcsplit plan: which settings it keeps (--backend-sampling is one it tries on a GPU)
#   phase bslog: where --backend-sampling's ~15 ms a request goes on CUDA: native llama-server on the 152k MoE, with
#        and without the flag, -lv 5 --log-timestamps, bench/gpu/bslog_requests.py's requests (BSLOG_REPS,
#        BSLOG_STREAMS); the logs come back whole (bslog_{host,bs}.log) to be read line by line
#   MODEL=moe bash bench/gpu/session.sh onecard  # ONE GPU: llama-server and rpc-servers share it (--same-card),
#        RUNS independent runs (default 3) of MODES (default native,hybrid,hybrid-stock,rpc,rpc-stock);
#        MODEL=moe: a 3.8 GiB F16 qwen3moe (16 layers, 32 experts, 4 used), MODEL=dense: the 7.2B F16 llama
#        (UBATCH=N: -ub N in every mode, native too; default arcsplit's choice per route; TIMEOUT=S: a request's
#        limit in seconds, so a mode that hangs costs that, not the bench's 600)
# Needs (carried, git-ignored): .device/llama-src.tar.gz (the extracted pinned tree), .device/whl (py3.12 wheels);
# FILES=DIR names another folder holding those two.
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
FILES=${FILES:-$ROOT/.device}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$FILES"/whl/*.whl >/dev/null 2>&1 || true
export PYTHONPATH=/tmp/site:$ROOT
DENSE=$WORK/model7b.gguf
MOE=$WORK/moe16x32.gguf
# the same MoE with Qwen3's vocabulary (151,936 tokens): the logits a decoded token brings back over the link are
# 594 KiB instead of 125 KiB, as for the real models arcsplit's users run (phase moe152k-mps)
MOE152=$WORK/moe16x32v152k.gguf
case "${MODEL:-dense}" in moe) MODEL=$MOE ;; dense) MODEL=$DENSE ;; esac
arcsplit() { python3 -m arcsplit "$@"; }

models() {
  # the two synthetic models (a fresh machine's; ~15 s and ~70 s)
  [ -f "$DENSE" ] || python3 -c "
from arcsplit.synth import write_llama
write_llama('$DENSE', n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=32000, ctx=8192,
            reuse_random=True)" || echo "model generation failed"
  [ -f "$MOE" ] || python3 -c "
from arcsplit.synth import write_qwen3moe
write_qwen3moe('$MOE', n_layer=16, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=32,
               n_expert_used=4, n_ff_exp=512, n_vocab=32000, ctx=8192)" || echo "moe model generation failed"
}

model152k() {
  [ -f "$MOE152" ] || python3 -c "
from arcsplit.synth import write_qwen3moe
write_qwen3moe('$MOE152', n_layer=16, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=32,
               n_expert_used=4, n_ff_exp=512, n_vocab=151936, ctx=8192)" || echo "moe 152k model generation failed"
}

CUDA_FLAG=-DCMAKE_CUDA_ARCHITECTURES=90
cuda_build_dir() {  # where arcsplit keeps this CUDA build: its name is the key of (flags, patch set)
  python3 -c "from arcsplit.llama.build import BuildConfig; print(BuildConfig('cuda', ('$CUDA_FLAG',)).build_dir)"
}

unpack() {
  # a build packed by an earlier machine (phase pack) whose key is this tree's: a fresh machine skips the ~350 s
  # compile. Another key (the patches changed since) is left alone and built.
  local dir parts; dir=$(cuda_build_dir); parts=$(ls "$FILES/cudabin/$(basename "$dir").tar.xz."* 2>/dev/null)
  [ -d "$dir/bin" ] && return 0
  if [ -z "$parts" ]; then
    [ -n "$(ls "$FILES/cudabin" 2>/dev/null)" ] && echo "cudabin/ holds another key's build, not $(basename "$dir"): compiling"
    return 0
  fi
  mkdir -p "$(dirname "$dir")"
  # shellcheck disable=SC2086
  cat $parts | xz -d | tar xf - -C "$(dirname "$dir")" && echo "build $(basename "$dir"): unpacked from cudabin/"
  runs_here "$dir" || rm -rf "$dir"
}

runs_here() {
  # a build packed on another machine (bench/gpu/pack_here.sh compiles one without a GPU) is used only where its
  # libraries load and show the card, and where the CPU has every instruction-set flag of the machine that compiled
  # it (GGML_NATIVE=ON builds ggml-cpu for that machine; AMX is off in every build; sse4a, AMD's alone, is
  # not counted: no compiler emits it unasked, and an Intel device never has it); else it is compiled here
  local dir=$1 missing
  if [ -f "$dir/bin/.build-host-cpu-flags" ]; then
    missing=$(comm -23 <(tr ' ' '\n' < "$dir/bin/.build-host-cpu-flags" | grep -E '^(avx|f16c|fma|bmi|sse|ssse|gfni|vaes|vpclmul)' | grep -vx sse4a | sort -u) \
      <(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2 | tr ' ' '\n' | sort -u) | tr '\n' ' ')
    if [ -n "$missing" ]; then
      echo "packed build $(basename "$dir") needs CPU flags this machine lacks (${missing% }): compiling"; return 1
    fi
  fi
  if ! timeout 60 "$dir/bin/llama-server" --list-devices 2>&1 | grep -q CUDA0; then
    echo "packed build $(basename "$dir") shows no CUDA0 here (llama-server --list-devices): compiling"; return 1
  fi
}

swap_rpc() {
  # SWAP_RPC=KEY: the packed CUDA build KEY (cudabin/build-cuda-KEY.tar.xz.*) with the libraries in $FILES/librpc/
  # (libggml-rpc.so, libllama.so) put in its place, built on CPU from this tree: a patch set that differs from KEY's
  # only in those libraries' sources (ggml-rpc.cpp; llama's src/, which holds no backend code) then runs without a
  # ~350 s compile. unpack would not find KEY: it looks for this tree's.
  local dir=$WORK/swap-$SWAP_RPC parts
  if [ ! -d "$dir/bin" ]; then
    parts=$(ls "$FILES/cudabin/build-cuda-$SWAP_RPC.tar.xz."* 2>/dev/null) \
      || { echo "SWAP_RPC=$SWAP_RPC: no build-cuda-$SWAP_RPC.tar.xz.* in cudabin/"; return 1; }
    ls "$FILES"/librpc/lib*.so.* >/dev/null 2>&1 || { echo "SWAP_RPC: no librpc/lib*.so.*"; return 1; }
    rm -rf "$dir.tmp"; mkdir -p "$dir.tmp"
    # shellcheck disable=SC2086
    cat $parts | xz -d | tar xf - -C "$dir.tmp" && mv "$dir.tmp/build-cuda-$SWAP_RPC" "$dir" && rm -rf "$dir.tmp" \
      && rm -rf "$dir.orig" && cp -a "$dir" "$dir.orig" && cp "$FILES"/librpc/lib*.so.* "$dir/bin/" \
      || return 1
    echo "build $SWAP_RPC unpacked, librpc/'s $(cd "$FILES/librpc" && echo lib*.so.*) swapped in ($dir.orig keeps the packed ones)"
  fi
  export ARCSPLIT_LLAMA_DIR=$dir/bin
  # modes ending -alt (bench/throughput.py) run on the build as packed: the swap's A/B in the same runs
  export ALT_LLAMA_DIR=$dir.orig/bin
}

build() {
  # a build named in the environment (or by an earlier phase) wins; the models are still written (once)
  [ -n "${SWAP_RPC:-}" ] && [ -z "${ARCSPLIT_LLAMA_DIR:-}" ] && { swap_rpc || return 1; }
  [ -n "${ARCSPLIT_LLAMA_DIR:-}" ] && { models; return; }
  # the source is needed only for a compile: a packed build of this key (cudabin/) runs without it, so a call may
  # leave llama-src.tar.gz behind when the carried tree and .device/ would pass the device's carry limit
  [ -d "$WORK/src" ] || [ ! -f "$FILES/llama-src.tar.gz" ] || tar xzf "$FILES/llama-src.tar.gz" -C "$WORK"
  unpack
  if [ -n "$(ls -d "$ARCSPLIT_CACHE_DIR"/llama.cpp/*/build-cuda-*/bin 2>/dev/null)" ]; then  # built by an earlier phase
    export ARCSPLIT_LLAMA_DIR=$(ls -d "$ARCSPLIT_CACHE_DIR"/llama.cpp/*/build-cuda-*/bin | head -1); models; return; fi
  local t0=$SECONDS
  arcsplit llama build --backend cuda --source "$WORK/src" --cmake-flag=$CUDA_FLAG \
    --jobs "$(nproc)" > "$OUT/build.txt" 2>&1 &
  local b=$!
  models; echo "models written after $((SECONDS - t0)) s"
  wait $b; echo "build rc=$? after $((SECONDS - t0)) s"; tail -2 "$OUT/build.txt"
  export ARCSPLIT_LLAMA_DIR=$(ls -d "$ARCSPLIT_CACHE_DIR"/llama.cpp/*/build-cuda-*/bin | head -1)
}

pack() {
  # the CUDA build into $OUT as xz parts of 15 MiB (a device call returns at most 8 files of 16 MiB), to be
  # carried as .device/cudabin/ so the next fresh machine unpacks it instead of compiling
  build
  local dir; dir=$(dirname "$ARCSPLIT_LLAMA_DIR")
  tar cf - -C "$(dirname "$dir")" "$(basename "$dir")/bin" | xz -T0 -6 \
    | split -b 15M -d -a 1 - "$OUT/$(basename "$dir").tar.xz."
  ls -l "$OUT/$(basename "$dir").tar.xz."*
}

bslog() {
  model152k; build
  local tag bs port pid
  for tag in host bs; do
    bs=; [ "$tag" = bs ] && bs=--backend-sampling
    port=$(python3 -c "from arcsplit.proc.ports import free_port; print(free_port())")
    "$ARCSPLIT_LLAMA_DIR/llama-server" -m "$MOE152" --host 127.0.0.1 --port "$port" -ngl 99 -c 8192 -np 4 \
      --kv-unified -fa on -lv 5 --log-timestamps $bs > "$OUT/bslog_$tag.log" 2>&1 &
    pid=$!
    python3 bench/gpu/bslog_requests.py "$port" "$tag" "${BSLOG_REPS:-5}" | tee -a "$OUT/bslog_times.txt"
    kill "$pid"; wait "$pid" 2>/dev/null
  done
}

onecard() {
  # The RPC route's tax on ONE GPU: every route's processes share card 0; RUNS fresh runs, each its own native
  build
  local name; name=$(basename "$MODEL" .gguf)
  python3 bench/throughput.py --backend cuda --gpus 0 --same-card --model "$MODEL" \
    --modes "${MODES:-native,hybrid,hybrid-stock,rpc,rpc-stock}" --runs "${RUNS:-3}" --reps "${REPS:-5}" \
    --n-predict "${NPREDICT:-128}" --greedy-tokens 32 --ctx 8192 --rpc-cache ${UBATCH:+--ubatch $UBATCH} \
    ${PATTERN:+--pattern $PATTERN} ${TIMEOUT:+--timeout $TIMEOUT} \
    ${ALT_LLAMA_DIR:+--alt-llama-dir "$ALT_LLAMA_DIR"} \
    --out "$OUT/throughput_cuda_onecard_$name${TAG:-}.md"
  echo "throughput rc=$? (3: one mode's repetitions more than 2x apart in a run)"
}

offload() {
  # issue 45: expert offload on the card: arcsplit --moe-offload 0 / 8 / 16 against llama.cpp's own --n-cpu-moe by
  # hand (llama-server -ngl 999, no arcsplit), the MoE model, decode and a 512-token prefill
  build
  python3 bench/moe_offload.py --backend cuda --gpus 0 --model "$MOE" --layers 16 --prompt-tokens 512 --by-hand \
    --ctx 4096 --n-predict 128 --reps "${OFFLOAD_REPS:-5}" --out "$OUT/moe_offload_cuda${TAG:-}.md"
  echo "moe_offload rc=$?"
}

tune() {
  # issue 44: arcsplit tune on the card. bench/tune.py's one-GPU rig (--same-card: native, hybrid and all-RPC all
  # on card 0), its pick against the default order (the whole model on the card); then the MoE planned on 2.5 GiB
  # cards, so experts stay in host RAM (--n-cpu-moe) and tune varies that; then the CLI itself on --gpus 0, with
  # plan showing what it kept. TUNE_RUNS, TUNE_BUDGET
  build
  local tw=$WORK/tunemodels; mkdir -p "$tw"; [ -e "$tw/gpu-moe.gguf" ] || ln -s "$MOE" "$tw/gpu-moe.gguf"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
  BENCH_WORK=$tw python3 bench/tune.py --backend cuda --same-card --rigs gpu-llama,gpu-moe --runs "${TUNE_RUNS:-2}" \
    --budget "${TUNE_BUDGET:-150}" --per-candidate 4 --ctx 8192 --out "$OUT/tune_cuda.md" > "$OUT/tune_cuda.log" 2>&1
  echo "tune bench rc=$?"
  BENCH_WORK=$tw python3 bench/tune.py --backend cuda --same-card --card-mib 2560 --rigs gpu-moe --runs 1 \
    --budget "${TUNE_BUDGET:-150}" --per-candidate 4 --ctx 8192 --out "$OUT/tune_cuda_ncmoe.md" \
    > "$OUT/tune_cuda_ncmoe.log" 2>&1
  echo "tune bench (MoE on 2.5 GiB cards) rc=$?"
  arcsplit tune "$tw/gpu-llama.gguf" --gpus 0 --backend cuda --budget 90 --per-candidate 4 > "$OUT/tune_cli.txt" 2>&1
  echo "arcsplit tune rc=$?"
  arcsplit plan "$tw/gpu-llama.gguf" --gpus 0 --backend cuda > "$OUT/plan_tuned.txt" 2>&1
  echo "arcsplit plan rc=$?"
}

mps() {
  # issue 19: how much of the one-GPU tax is two CUDA contexts time-slicing the card (which a second card would
  # not have) and not the link: the same onecard bench with NVIDIA's multi-process service (MPS) running, so the
  # group's processes share one context. The daemon is started here in private folders and quit when the phase
  # ends (every exit path); the card's settings (compute mode, MIG) are not touched.
  command -v nvidia-cuda-mps-control >/dev/null || { echo "no nvidia-cuda-mps-control here: MPS rows skipped"; return; }
  (
    export CUDA_MPS_PIPE_DIRECTORY=$WORK/mps/pipe CUDA_MPS_LOG_DIRECTORY=$WORK/mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { echo "MPS daemon did not start"; exit 0; }
    trap 'echo quit | nvidia-cuda-mps-control; sleep 1; tail -3 "$CUDA_MPS_LOG_DIRECTORY/control.log"' EXIT
    MODES=${MPS_MODES:-native,hybrid,rpc} TMODES=${MPS_MODES:-native,hybrid,rpc} TAG=_mps${TAG:-} "${1:-onecard}"
  )
}

waitword() {
  # the gated sets' primitive alone (bench/gpu/wait_host_word.cu): a stream wait on a page-locked host word holds the
  # copy and the captured graph behind it until the host stores the word; seconds, no llama.cpp build needed
  local cuda=${CUDA_HOME:-/usr/local/cuda}
  "$cuda/bin/nvcc" -O2 -std=c++17 -o "$WORK/wait_host_word" bench/gpu/wait_host_word.cu -lcuda \
    && "$WORK/wait_host_word" "${WAIT_ROUNDS:-200}" 2>&1 | tee "$OUT/wait_host_word.txt"
  echo "waitword rc=${PIPESTATUS[0]}"
}

trace() {
  # issue 19: a CUPTI timeline of every process of each route on ONE GPU (bench/gpu_trace.py); TMODES, TOKENS;
  # PROMPT_TOKENS=512 traces a prefill of that many tokens instead (trace_..._prefill.md)
  build
  local cuda=${CUDA_HOME:-/usr/local/cuda} lib=$WORK/libcupti_trace.so name inc cl; name=$(basename "$MODEL" .gguf)
  # CUPTI's headers and library: extras/CUPTI up to CUDA 12, targets/<arch>/ in CUDA 13's packages
  inc=$(dirname "$(find -L "$cuda/" -name cupti.h 2>/dev/null | head -1)")
  cl=$(dirname "$(find -L "$cuda/" -name 'libcupti.so*' 2>/dev/null | head -1)")
  [ -f "$lib" ] || cc -O2 -shared -fPIC -I"$cuda/include" -I"$inc" bench/gpu/cupti_trace.c \
    -L"$cl" -l:"$(basename "$(ls "$cl"/libcupti.so* | head -1)")" -Wl,-rpath,"$cl" -o "$lib" \
    || { echo "tracer build failed"; return; }
  python3 bench/gpu_trace.py --trace-lib "$lib" --backend cuda --gpus 0 --same-card --model "$MODEL" \
    --modes "${TMODES:-native,hybrid,rpc}" --tokens "${TOKENS:-64}" ${PROMPT_TOKENS:+--prompt-tokens $PROMPT_TOKENS} \
    --ctx 8192 --rpc-cache ${KEEP_RAW:+--keep-raw "$OUT/raw_$name${TAG:-}"} \
    --out "$OUT/trace_cuda_onecard_$name${TAG:-}${PROMPT_TOKENS:+_prefill}${ARCSPLIT_CUPTI_LIGHT:+_light}.md"
}

poll() {
  # issue 19: what the link's polling (0005, and 0008's shared-memory link under the same budget) costs in host
  # cores on ONE GPU, per decoded token and idle, polling off and at arcsplit's default (bench/poll_cost.py)
  build
  python3 bench/poll_cost.py --backend cuda --same-card --model "$MODEL" --modes "${POLL_MODES:-hybrid,rpc}" \
    --tokens "${TOKENS:-128}" --reps "${POLL_REPS:-3}" --idle "${POLL_IDLE:-3}" \
    --out "$OUT/poll_cost_cuda_onecard${TAG:-}.md"
}

accuracy() {
  build
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
  python3 bench/plan_accuracy.py --llama-dir "$ARCSPLIT_LLAMA_DIR" --cuda-device 0 --jobs "${JOBS:-6}" \
    --out-dir "$OUT" > "$OUT/plan_accuracy_cuda.log" 2>&1
  echo "plan_accuracy rc=$?"; tail -2 "$OUT/plan_accuracy_cuda.log"
}

recover1() {
  # ONE GPU: SIGKILL an rpc-server of a hybrid group sharing card 0, REPEAT times; the new one reads its weights
  # from the GGUF (patch 0006); issue 19's target is <= 10 s to serve again on the 14 GB model
  build
  python3 bench/recover.py --backend cuda --gpus 0 --same-card --mode "${RMODE:-hybrid}" --model "$MODEL" \
    --ctx 8192 --repeat "${REPEAT:-3}" --out "$OUT/recover_cuda_onecard_${RMODE:-hybrid}.md"
}

abpatch() {
  # Each patch alone: the build's patched copy gets the touched files back from the stock tree, then one patch,
  # then an incremental rebuild of llama-server and ggml-rpc-server (cmake's cache names the directory it was
  # configured in, KEY.partial, so the build dir takes that name back). Modes -stock switch the one patch off.
  build
  local bin=$ARCSPLIT_LLAMA_DIR bdir root psrc files p name marker
  bdir=$(dirname "$bin"); root=$(dirname "$bdir"); psrc=$root/src-source; marker=$(cat "$bin/.arcsplit-patches")
  apply1() { if command -v patch >/dev/null; then patch -p1 --batch --forward -d "$psrc" -i "$ROOT/$1"
             else (cd "$psrc" && GIT_CEILING_DIRECTORIES=$root git apply -p1 "$ROOT/$1"); fi; }
  files=$(sed -n 's|^+++ b/||p' arcsplit/data/patches/*.patch | awk '{print $1}' | sort -u)
  mv "$bdir" "$bdir.partial" || return
  for p in ${PATCHES:-arcsplit/data/patches/*.patch}; do
    name=$(basename "$p" .patch)
    for f in $files; do cp "$WORK/src/$f" "$psrc/$f"; done
    apply1 "$p" > "$OUT/ab_$name.txt" 2>&1 || { echo "$name does not apply alone"; continue; }
    local t0=$SECONDS
    cmake --build "$bdir.partial" -j "$(nproc)" --target llama-server ggml-rpc-server >> "$OUT/ab_$name.txt" 2>&1 \
      || { echo "$name: build failed"; continue; }
    echo "$name alone: rebuilt in $((SECONDS - t0)) s"
    printf 'only-%s\n%s\n' "$name" "$name" > "$bdir.partial/bin/.arcsplit-patches"
    MODEL=$MOE ARCSPLIT_LLAMA_DIR=$bdir.partial/bin RUNS=${AB_RUNS:-1} REPS=${AB_REPS:-3} TAG=_only_$name \
      MODES=${AB_MODES:-${MODES:-native,hybrid,hybrid-stock,rpc,rpc-stock}} onecard
  done
  for f in $files; do cp "$WORK/src/$f" "$psrc/$f"; done  # back to the full set, so the build is what its key says
  for p in arcsplit/data/patches/*.patch; do apply1 "$p" >/dev/null; done
  cmake --build "$bdir.partial" -j "$(nproc)" --target llama-server ggml-rpc-server >/dev/null 2>&1
  echo "$marker" > "$bdir.partial/bin/.arcsplit-patches"
  mv "$bdir.partial" "$bdir"
}

case "${1:-all}" in
  build) build ;;
  unpack) unpack ;;
  pack) pack ;;
  detach)
    # the pipeline in the background (its results under $WORK/res, its log $WORK/pipeline.log), then collect: a
    # call can end (600 s) while the pipeline goes on, and a next call on the still-warm machine collects the rest
    mkdir -p "$WORK/res"
    (OUT=$WORK/res setsid nohup bash "$ROOT/bench/gpu/session.sh" pipeline > "$WORK/pipeline.log" 2>&1 < /dev/null &)
    sleep 2; exec bash "$ROOT/bench/gpu/session.sh" collect
    ;;
  collect)
    # wait (WAIT_S, default 540) for the detached pipeline, then its log and a tarball of its results into $OUT.
    # No pipeline here means a fresh machine (the warm one was returned): say so at once instead of waiting.
    [ -f "$WORK/pipeline.log" ] || { echo "no pipeline on this machine: a fresh one (the last was returned)"; exit 3; }
    for ((i = 0; i < ${WAIT_S:-540}; i++)); do grep -q "^pipeline done" "$WORK/pipeline.log" && break; sleep 1; done
    cp "$WORK/pipeline.log" "$OUT/"; tar czf "$OUT/res.tgz" --exclude='*.tar.xz.*' -C "$WORK" res
    cp "$WORK"/res/*.tar.xz.* "$OUT/" 2>/dev/null  # a packed build (phase pack): its parts come back whole
    grep -v '^  ' "$WORK/pipeline.log" | tail -5
    exit 0
    ;;
  accuracy) accuracy ;;
  abpatch) abpatch ;;
  pipeline)
    # everything in order of need; every phase writes under $OUT as it goes, so a cut-short run keeps its files.
    # PHASES picks and orders them (default: accuracy moe dense abpatch); recover1 = the one-GPU recovery
    for ph in ${PHASES:-accuracy moe dense abpatch}; do
      echo "=== $ph at $SECONDS s"
      case $ph in
        accuracy) accuracy ;;
        moe) MODEL=$MOE onecard ;;
        bimodal) MODEL=$MOE TAG=_bimodal RUNS=${BIMODAL_RUNS:-${RUNS:-3}} \
                 MODES=${BIMODAL_MODES:-native,hybrid,rpc,rpc-noshm,rpc-nokvu,rpc-card,rpc-lv3,rpc-nocram} onecard ;;
        lru) MODEL=$MOE TAG=_lru PATTERN=lru RUNS=${LRU_RUNS:-${RUNS:-3}} MODES=${LRU_MODES:-native,rpc,rpc-nospan} onecard ;;
        lru-mps) MODEL=$MOE TAG=_lru PATTERN=lru RUNS=${LRU_RUNS:-${RUNS:-3}} MPS_MODES=${LRU_MODES:-native,rpc,rpc-nospan} mps ;;
        offload) offload ;;
        tune) tune ;;
        dense) MODEL=$DENSE REPS=${DENSE_REPS:-3} RUNS=${DENSE_RUNS:-${RUNS:-3}} onecard ;;
        recover1) MODEL=$DENSE recover1 ;;
        trace) MODEL=$MOE trace ;;
        trace-light) MODEL=$MOE ARCSPLIT_CUPTI_LIGHT=1 trace ;;
        trace-dense-light) MODEL=$DENSE TMODES=${TMODES_DENSE:-native,hybrid} ARCSPLIT_CUPTI_LIGHT=1 trace ;;
        moe-mps) MODEL=$MOE MPS_MODES=${MOE_MODES:-${MPS_MODES:-}} mps ;;
        moe152k-mps) model152k; MODEL=$MOE152 MPS_MODES=${MOE_MODES:-${MPS_MODES:-}} mps ;;
        bslog) bslog ;;
        tune152k) model152k; build
                  arcsplit tune "$MOE152" --gpus 0 --backend cuda --objective "${TUNE_OBJECTIVE:-decode}" \
                    --budget "${TUNE_BUDGET:-120}" --per-candidate 4 > "$OUT/tune_cli_152k.txt" 2>&1
                  echo "arcsplit tune rc=$?"; tail -25 "$OUT/tune_cli_152k.txt"
                  arcsplit plan "$MOE152" --gpus 0 --backend cuda > "$OUT/plan_tuned_152k.txt" 2>&1
                  echo "arcsplit plan rc=$?"; grep -i "tune\|backend-sampling" "$OUT/plan_tuned_152k.txt" | head -5 ;;
        trace-light-mps) MODEL=$MOE ARCSPLIT_CUPTI_LIGHT=1 mps trace ;;
        trace-gate-mps) MODEL=$MOE ARCSPLIT_CUPTI_LIGHT=1 TAG=_gate MPS_MODES=${TRACE_MODES:-native,rpc,rpc-nogate} mps trace ;;
        trace-dense-light-mps) MODEL=$DENSE ARCSPLIT_CUPTI_LIGHT=1 mps trace ;;
        dense-mps) MODEL=$DENSE REPS=${DENSE_REPS:-3} RUNS=${DENSE_RUNS:-${RUNS:-3}} MPS_MODES=${DENSE_MODES:-${MPS_MODES:-}} mps ;;
        poll-mps) MODEL=$MOE mps poll ;;
        trace-prefill-mps) MODEL=$DENSE PROMPT_TOKENS=512 MPS_MODES=${TRACE_MODES:-native,hybrid,rpc} mps trace ;;
        trace-mps) MODEL=$MOE TAG=_full MPS_MODES=${TRACE_MODES:-native,rpc} mps trace ;;
        trace-prefill-moe-mps) MODEL=$MOE PROMPT_TOKENS=512 MPS_MODES=${TRACE_MODES:-native,hybrid,rpc} mps trace ;;
        trace-prefill) MODEL=$DENSE PROMPT_TOKENS=512 TMODES=${TRACE_MODES:-native,hybrid,rpc} trace ;;
        trace-dense) MODEL=$DENSE TMODES=${TMODES_DENSE:-native,hybrid} trace ;;
        abpatch) abpatch ;;
        pack) pack ;;
        waitword) waitword ;;
        link) build; python3 bench/rpc_link.py --backend cuda --runs "${LINK_RUNS:-3}" --sizes "${LINK_SIZES:-0.0625,4,16}" \
                --out "$OUT/rpc_link_cuda.md" > "$OUT/rpc_link_cuda.log" 2>&1; echo "rpc_link rc=$?" ;;
      esac
    done
    echo "pipeline done at $SECONDS s"
    ;;
  recover1) recover1 ;;
  trace) trace ;;
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
  onecard) onecard ;;
  rpc)
    build
    ${THROUGHPUT_RPC:-python3 bench/throughput.py --backend cuda --gpus 0,1 --model $MODEL --modes native,rpc}
    python3 bench/recover.py --backend cuda --gpus 0,1 --model "$MODEL" --mode rpc --repeat 2 --out "$OUT/recover_cuda.md"
    ;;
esac
ls "$OUT"
