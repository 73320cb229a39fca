#!/bin/bash
# The bslog pattern on CPU by hand (llama-server of a CPU build, SmolLM2-135M from arcsplit's model cache, 4 slots):
# 4 parallel 8-token streams (ignore_eos), the 512-token prompt cached, then not; counts llama.cpp's "reserve took"
# lines. Usage: bench/gpu/bslog_cpu.sh BIN_DIR TAG [--backend-sampling]
B=$1; M=${BSLOG_MODEL:-$HOME/.cache/arcsplit/models/SmolLM2-135M-Instruct.Q4_1.gguf}; PORT=$((18600 + RANDOM % 200))
$B/llama-server -m "$M" --host 127.0.0.1 --port $PORT -c 4096 -np 4 --kv-unified -t 2 -lv 5 --log-timestamps $3 > /tmp/bslogcpu_$2.log 2>&1 & PID=$!
cd "$(dirname "$0")/../.." && BSLOG_STREAMS=1 .venv/bin/python - $PORT $2 6 <<'PY'
import os, sys, time, httpx
port, tag, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
url = f"http://127.0.0.1:{port}"
for _ in range(600):
    try:
        if httpx.get(f"{url}/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
from arcsplit.tuning.measure import long_prompt, measure_streams, timed
with httpx.Client(timeout=120) as c:
    prompt = long_prompt(c, url, 512)
    on, off = [], []
    for i in range(reps + 1):
        measure_streams(url, 8, 120)
        _, ms = timed(c, url, {"prompt": prompt, "n_predict": 1, "cache_prompt": True})
        _, o = timed(c, url, {"prompt": prompt, "n_predict": 1, "cache_prompt": False})
        if i:
            on.append(round(ms, 1)); off.append(round(o, 1))
    print(tag, "cached", on, "cache off", off)
PY
kill $PID; wait $PID 2>/dev/null
echo "$2 reserves: $(grep -c 'reserve took' /tmp/bslogcpu_$2.log)"
