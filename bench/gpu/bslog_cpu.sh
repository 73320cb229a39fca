#!/bin/bash
# The bslog pattern on CPU by hand (llama-server of a CPU build, SmolLM2-135M from arcsplit's model cache, 4 slots):
# 4 parallel 8-token streams (ignore_eos), the 512-token prompt cached, then not; counts llama.cpp's "reserve took"
# lines. Usage: bench/gpu/bslog_cpu.sh BIN_DIR TAG [--backend-sampling]
B=$1; M=${BSLOG_MODEL:-$HOME/.cache/arcsplit/models/SmolLM2-135M-Instruct.Q4_1.gguf}; PORT=$((18600 + RANDOM % 200))
$B/llama-server -m "$M" --host 127.0.0.1 --port $PORT -c 4096 -np 4 --kv-unified -t 2 -lv 5 --log-timestamps $3 > /tmp/bslogcpu_$2.log 2>&1 & PID=$!
cd "$(dirname "$0")/../.." && BSLOG_STREAMS=1 .venv/bin/python bench/gpu/bslog_requests.py $PORT $2 6
kill $PID; wait $PID 2>/dev/null
echo "$2 reserves: $(grep -c 'reserve took' /tmp/bslogcpu_$2.log)"
