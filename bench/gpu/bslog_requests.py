"""The requests of phase bslog (bench/gpu/session.sh) and of bench/gpu/bslog_cpu.sh, against a running llama-server:
a 512-token prompt, then REPS rounds of it with the prompt cache (one token computed) and without, the client's wall
time each; BSLOG_STREAMS=1 puts 4 parallel 8-token streams (ignore_eos, as bench/throughput.py's) before each round.

    python bench/gpu/bslog_requests.py PORT TAG REPS
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from arcsplit.tuning.measure import long_prompt, measure_streams, timed  # noqa: E402


def main(port: str, tag: str, reps: int) -> None:
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # the model loads first
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    streams = os.environ.get("BSLOG_STREAMS") == "1"
    with httpx.Client(timeout=120) as c:
        prompt = long_prompt(c, url, 512)
        for i in range(reps + 1):
            if streams:
                measure_streams(url, 8, 120)
            _, cached = timed(c, url, {"prompt": prompt, "n_predict": 1, "cache_prompt": True})
            _, off = timed(c, url, {"prompt": prompt, "n_predict": 1, "cache_prompt": False})
            print(f"{tag} request {i}: {cached:.1f} ms ({'the prompt computed' if i == 0 else 'cached'}), "
                  f"then cache off {off:.1f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
