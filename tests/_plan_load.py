"""A plan served for real: llama-server with the plan's own arguments over running rpc-servers, asked for a few
greedy tokens, then stopped; what it reported allocating per rpc-server. The tests that check a synthetic
writer's file against the plan share it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx

from arcsplit.llama.logs import parse_buffer_line, sum_buffers
from arcsplit.proc.ports import free_port

from _procs import wait_healthy


def load_plan(llama_bins: Any, rpc: Any, model: Path, plan: Any, tmp_path: Path) -> dict[str, dict[str, int]]:
    """Serve ``model`` as ``plan`` says over ``rpc``'s servers, generate 4 tokens; endpoint -> buffer -> bytes."""
    port = free_port()
    argv = [str(llama_bins.server), "-m", str(model), "--rpc", ",".join(rpc.endpoints), "--host", "127.0.0.1",
            "--port", str(port), "-t", "1", "-lv", "4", *plan.llama_server_args()]
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(proc, url, log, timeout=60)
            r = httpx.post(f"{url}/completion", json={"prompt": "hello", "n_predict": 4, "temperature": 0}, timeout=120)
            assert r.status_code == 200 and r.json()["tokens_predicted"] == 4
        finally:
            proc.terminate()
            proc.wait(30)
    used = sum_buffers(b for b in map(parse_buffer_line, log.read_text().splitlines()) if b)
    for ep in rpc.endpoints:  # one card per rpc-server: its buffer type is RPC0[endpoint]
        used[ep] = used[f"RPC0[{ep}]"]
        assert {"model", "compute"} <= set(used[ep]), used  # llama-server reported this card's buffers
    return used
